"""The one-pass host AdamW (adamw.c) as Python calls it: the run's tensors in, bits as torch's fused
CPU AdamW leaves them out.

`step` takes the run's tensors by role (as tiled_adamw's forms lend them), checks that the kernel
can read them (real, contiguous CPU tensors of the dtypes it knows, no two overlapping) and calls
it; it returns False, having done nothing, where it cannot, and the caller runs its tile path.
SLIMTUNE_NATIVE=0 in the environment makes it always return False: the torch path, for comparing
the two (they give the same bits; only the speed differs).

Before first use the library is checked on this machine against torch._fused_adamw_ itself, on runs
of every length mod 16 and both of lerp's branches: torch's arithmetic depends on how it was built
(which multiply-adds its compiler fused, where its scalar tail begins), and a torch that computes
otherwise is met with one line on stderr and the tile path, never with different bits.

8-bit moments take the library's AVX-512 VBMI path where the CPU has it (built with its flags, and
checked against the library's portable loops before first use); SLIMTUNE_NATIVE_VBMI=0 keeps the
portable loops (the same bits, about half the speed).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import struct
import types

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from slimtune.optim import moments8, split_master
from slimtune.optim.native import build

# torch's fused CPU AdamW computes a call's last numel % 8 numbers on its scalar path (under both its
# AVX2 and AVX512 builds, measured): v's multiply-add is fused the other way round there.
SCALAR_TAIL = 8
BLOCK = moments8.BLOCK  # adamw.c's BLOCK
ENV = "SLIMTUNE_NATIVE"
VBMI_ENV = "SLIMTUNE_NATIVE_VBMI"  # 0: 8-bit moments on the portable loops even where the VBMI path runs
ROLES = ("master", "weight", "residual", "shadow", "grad", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")  # coded (8-bit): "<moment>_codes" and "<moment>_absmax"
DTYPES = {"master": torch.float32, "weight": torch.bfloat16, "residual": torch.int16, "shadow": torch.bfloat16,
          "grad": (torch.float32, torch.bfloat16), "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
          **{f"{m}_codes": torch.uint8 for m in MOMENTS}, **{f"{m}_absmax": torch.float32 for m in MOMENTS}}
SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # moments8's maps: m signed, v not


class Hyper(ctypes.Structure):
    """adamw.c's Hyper: the step's constants, each rounded once to float."""

    _fields_ = [(name, ctypes.c_float) for name in
                ("decay", "lerp_weight", "beta2", "one_minus_beta2", "bias2_sqrt", "eps", "step_size", "clip")]


class Fast(ctypes.Structure):
    """adamw.c's Fast: one map's tables for the AVX-512 VBMI path (fast_tables builds them)."""

    _fields_ = [("planes", ctypes.c_uint8 * 256 * 4), ("midpoints", ctypes.c_float * 256),
                ("threshold", ctypes.c_uint32 * 32), ("slope", ctypes.c_float * 32), ("intercept", ctypes.c_float * 32),
                ("top", ctypes.c_int32 * 32), ("count", ctypes.c_int32), ("zero", ctypes.c_int32)]


class Coded(ctypes.Structure):
    """adamw.c's Coded: an 8-bit moment's codes and scales, its map's lookup tables, and the VBMI
    path's tables (NULL: the portable loops)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("codes", "absmax", "map", "lookup", "fast")]


class Run(ctypes.Structure):
    """adamw.c's Run: the run's length, its layout and its tensors' addresses."""

    _fields_ = [("numel", ctypes.c_int64), ("vector_end", ctypes.c_int64), ("split", ctypes.c_int32),
                ("grad_bf16", ctypes.c_int32), ("empty_grad", ctypes.c_int32), ("threads", ctypes.c_int32),
                *((role, ctypes.c_void_p) for role in ROLES), ("coded", ctypes.c_int32),
                *((f"{m}_coded", Coded) for m in MOMENTS)]


def run_of(numel: int, tensors: dict[str, torch.Tensor], threads: int, empty_grad: bool = False,
           fast: bool | None = None) -> Run:
    """The Run for tensors that _readable accepted; 8-bit moments on the VBMI path where `fast` (by
    default where it runs here), else on the portable loops."""
    coded = "exp_avg_codes" in tensors
    pointers = {role: t.data_ptr() for role, t in tensors.items() if t is not None}
    fast = _fast_wanted() if fast is None and coded else fast
    codings = [Coded(pointers[f"{m}_codes"], pointers[f"{m}_absmax"], *_tables(SIGNED[m]),
                     ctypes.addressof(fast_tables(SIGNED[m])) if fast else None) if coded else Coded()
               for m in MOMENTS]
    return Run(numel, numel - numel % SCALAR_TAIL, "weight" in pointers, tensors["grad"].dtype == torch.bfloat16,
               empty_grad, threads, *(pointers.get(role) for role in ROLES), coded, *codings)


def _tables(signed: bool) -> tuple[int, int]:
    """Addresses of the map and the packed lookup table for one signedness."""
    return tuple(t.data_ptr() for t in _held_tables(signed))


@functools.cache
def _held_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(map, lookup): moments8's map, and its quantizer's two tables by bucket packed into one int32 a
    bucket as adamw.c's code_block reads them: the base code, the low 16 bits of the bucket's midpoint
    (a midpoint lies inside its bucket: checked) and whether there is one. Made once, outside any
    dispatch mode (a memory meter running around a step counts nothing)."""
    code, base, midpoint = moments8._tables(signed)[:3]  # noqa: SLF001
    with _disable_current_modes():
        has = torch.isfinite(midpoint)
        bits = midpoint.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal((bits >> 16)[has], torch.arange(moments8.KEYS)[has]), "a midpoint outside its bucket"
        packed = base.to(torch.int64) | torch.where(has, (bits & 0xFFFF) << 8 | 1 << 24, 0)
        return code, packed.to(torch.int32)


def _fast_wanted() -> bool:
    """8-bit moments take the VBMI path: the library has it, it passed its check here, and
    SLIMTUNE_NATIVE_VBMI=0 does not ask for the portable loops."""
    return os.environ.get(VBMI_ENV, "1") != "0" and fast_path()


def fast_path() -> bool:
    """The library has the VBMI path and it leaves the portable loops' bits on this machine (which
    the tests and the torch check hold to moments8 and torch): codes at every midpoint of both maps
    and the fp32 numbers either side, and three steps of the split layout over blocks of every kind
    (a few milliseconds, once a library)."""
    lib = library()
    return lib is not None and _fast_path_of(lib)


@functools.cache
def _fast_path_of(lib: ctypes.CDLL) -> bool:
    if not lib.slimtune_fast_8bit():
        return False
    with _disable_current_modes():
        agrees = _fast_codes_agree(lib) and _fast_steps_agree(lib)
    if not agrees:
        build.say_once("the native host AdamW's VBMI path does not give its portable loops' bits on this machine: "
                       "8-bit moments take the portable loops.")
    return agrees


def _fast_codes_agree(lib: ctypes.CDLL) -> bool:
    for signed in (True, False):
        mids = (lambda code: (code[:-1] + code[1:]) / 2)(moments8.dynamic_map(signed))
        near = (mids.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)).flatten().view(torch.float32)
        values = torch.cat([near, -near]) if signed else near
        values = torch.cat([values, values.new_ones(-values.numel() % BLOCK)])  # whole blocks, absmax 1
        codes = [torch.empty(values.numel(), dtype=torch.uint8) for _ in range(2)]
        absmax = [torch.empty(values.numel() // BLOCK) for _ in range(2)]
        for k, fast in enumerate((ctypes.addressof(fast_tables(signed)), None)):
            coded = Coded(codes[k].data_ptr(), absmax[k].data_ptr(), *_tables(signed), fast)
            lib.slimtune_encode(ctypes.byref(coded), ctypes.c_int64(values.numel()), ctypes.c_void_p(values.data_ptr()))
        if not (torch.equal(codes[0], codes[1]) and torch.equal(absmax[0], absmax[1])):
            return False
    return True


def _fast_steps_agree(lib: ctypes.CDLL) -> bool:
    numel, generator = 4 * BLOCK + 37, torch.Generator().manual_seed(0)
    settings = types.SimpleNamespace(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    master = torch.randn(numel, generator=generator)
    weight = master.bfloat16()
    start = {"weight": weight, "residual": (master.view(torch.int32) - (weight.view(torch.int16).to(torch.int32) << 16))
             .clamp(-32768, 32767).to(torch.int16),
             **{f"{m}_codes": torch.randint(0, 256, (numel,), generator=generator, dtype=torch.uint8) for m in MOMENTS},
             **{f"{m}_absmax": torch.rand(numel // BLOCK + 1, generator=generator) for m in MOMENTS}}
    start["exp_avg_absmax"][0] = 0.0  # a block of zeros
    grads = [torch.randn(numel, generator=generator).bfloat16() for _ in range(3)]
    ends = []
    for fast in (True, False):
        tensors = {name: t.clone() for name, t in start.items()}
        for step_count, grad in enumerate(grads, 1):
            held = {**tensors, "grad": grad.clone()}  # alive while the kernel reads it
            run = run_of(numel, held, 1, fast=fast)
            lib.slimtune_adamw(ctypes.byref(run), ctypes.byref(constants(settings, float(step_count), 0.5)))
        ends.append(tensors)
    return all(torch.equal(ends[0][name].view(torch.uint8), ends[1][name].view(torch.uint8)) for name in start)


FIXED = 1 << 16  # adamw.c: counts in 1/65536ths
UNSURE = 8  # adamw.c: a fixed count within this of a step is settled against the midpoints


@functools.cache
def fast_tables(signed: bool) -> Fast:
    """The VBMI path's tables for one map, from moments8's map and midpoints (fp32, as its quantizer
    computes them). The positive side's midpoints (all 255 for the unsigned map; the 128 from 0 up
    for the signed one) split into segments: below the smallest, one a decade of the map (bitsandbytes'
    dynamic map holds 2^(d + 1) values in decade d, 2^d a sign on the signed map, evenly spaced), and
    above the largest. Within a decade the count of midpoints below a is C + (a / 10^(d-6) - 0.1) n / 0.9
    (n values, C midpoints below the decade's first), in 1/65536ths as slope and intercept. Which
    segment a number is in comes from its binade: the segment at the binade's start, plus one above
    the one boundary a binade may hold (checked here)."""
    code = moments8.dynamic_map(signed)
    zero = moments8.zero_code(signed)
    mids = ((code[:-1] + code[1:]) / 2)[zero:]
    fast = Fast(count=mids.numel(), zero=zero)
    for k, plane in enumerate(code.view(torch.uint8).view(-1, 4).t().tolist()):
        fast.planes[k][:] = plane
    fast.midpoints[:] = mids.tolist() + [math.inf] * (256 - mids.numel())
    starts = [sum(2 ** (e + (0 if signed else 1)) for e in range(d)) for d in range(8)]  # first midpoint of each decade
    assert starts[-1] == mids.numel() - 1, "the map is not seven decades of doubling runs"
    bounds = mids[starts].tolist()  # segment s + 1 begins above bounds[s]
    # Each intercept holds the code of 0.0 (so a line gives a positive number's code) and UNSURE more
    # (adamw.c tests the count's fraction); each top is the segment's last code in the same fixed point,
    # its fraction all ones (so it clamps the fixed-point count itself).
    def line(slope: float, count: float, top: int) -> tuple[float, float, int]:
        return slope, (count + zero) * FIXED + UNSURE, (top + zero) * FIXED + FIXED - 1
    lines = [line(0.0, 0.5, 0)]
    for d in range(7):
        n, below = starts[d + 1] - starts[d], starts[d] + 1
        if n == 1:  # one value: its segment's count is constant
            lines.append(line(0.0, below + 0.5, below))
        else:
            lines.append(line(FIXED * 10.0 ** (6 - d) * n / 0.9, below - 0.1 * n / 0.9, below + n - 1))
    lines.append(line(0.0, mids.numel() + 0.5, mids.numel()))
    bound_bits = [b.view(torch.int32).item() for b in mids[starts]]
    for binade in range(103, 128):  # 2^-24 (below every midpoint) .. [1, 2): entries 7 .. 31
        start = struct.unpack("<f", struct.pack("<I", binade << 23))[0]
        inside = [bits for bits in bound_bits if bits >> 23 == binade]
        assert len(inside) <= 1, "a binade holds two segment boundaries"
        first = sum(1 for b in bounds if b < start)  # the segment the binade starts in
        fast.slope[binade % 32], fast.intercept[binade % 32], fast.top[binade % 32] = lines[first]
        fast.threshold[binade % 32] = inside[0] if inside else 0x40000000  # 2.0: no boundary
    assert not any(bits >> 23 == 127 for bits in bound_bits), "a boundary in [1, 2) would need binade 128's line"
    _check_lines(lines, mids, starts, zero)
    return fast


def _check_lines(lines: list[tuple[float, float, int]], mids: torch.Tensor, starts: list[int], zero: int) -> None:
    """Each decade's line puts each of its midpoints within UNSURE / 65536 of its step (so the numbers
    it does not settle are counted right): the line at a midpoint Q_k is about k + 1."""
    for d in range(7):
        first, last = starts[d] + 1, starts[d + 1]
        if last <= first:
            continue
        q = mids[first:last].double()
        line = (q * float(lines[d + 1][0]) + float(lines[d + 1][1])).float().double()
        steps = torch.arange(first, last, dtype=torch.float64) + 1 + zero
        assert float((line - steps * FIXED - UNSURE).abs().max()) < UNSURE - 1, "a decade's line is off its midpoints"


def constants(hyper, step: float, clip: float) -> Hyper:
    """The constants torch's kernel computes in double from (lr, betas, eps, weight decay) and the
    step count, then rounds to float. `hyper`: tiled_adamw.Hyper (or anything with its fields)."""
    bias1 = 1 - hyper.beta1 ** step
    bias2 = 1 - hyper.beta2 ** step
    decay = 1 - hyper.lr * hyper.weight_decay if hyper.weight_decay != 0 else 1.0
    return Hyper(decay, 1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2, math.sqrt(bias2), hyper.eps,
                 hyper.lr / bias1, clip)


def enabled() -> bool:
    """False when SLIMTUNE_NATIVE=0 asks for torch's path."""
    return os.environ.get(ENV, "1") != "0"


def step(hyper, step_count: float, numel: int, tensors: dict[str, torch.Tensor | None], clip: float = 1.0,
         threads: int = 1, empty_grad: bool = False) -> bool:
    """One AdamW step over `numel` numbers, in place, on `threads` threads. `tensors` by role: a whole
    fp32 "master" or a split "weight" and "residual"; an optional bf16 "shadow" that gets the new bf16
    weights; the "grad" (fp32 or bf16; read only, or zeroed once read with `empty_grad`: an
    accumulator the step consumes, emptied while in cache); fp32 "exp_avg" and "exp_avg_sq", or
    both 8-bit as moments8 keeps them ("exp_avg_codes", "exp_avg_absmax", and the same for
    "exp_avg_sq": m on the signed map, v on the unsigned one). True when done; False (nothing done) where SLIMTUNE_NATIVE=0, the library is unavailable or the
    tensors are not ones it reads."""
    if not enabled() or not _readable(numel, tensors):
        return False
    lib = library()
    if lib is None:
        return False
    run = run_of(numel, tensors, threads, empty_grad)
    lib.slimtune_adamw(ctypes.byref(run), ctypes.byref(constants(hyper, step_count, clip)))
    return True


MASTER_ROLES = ({"master"}, {"weight", "residual"})  # a layout holds exactly one of each
MOMENT_ROLES = (set(MOMENTS), {f"{m}_{part}" for m in MOMENTS for part in ("codes", "absmax")})


def _readable(numel: int, tensors: dict[str, torch.Tensor | None]) -> bool:
    """The tensors are ones the kernel reads: a complete layout, each a real contiguous CPU tensor of
    its role's dtype and length (`numel`, or a scale a block for an absmax), no two sharing memory."""
    present = {role: t for role, t in tensors.items() if t is not None}
    roles = present.keys() - {"grad", "shadow"}
    if "grad" not in present or not any(m | v == roles for m in MASTER_ROLES for v in MOMENT_ROLES):
        return False
    blocks = -(-numel // BLOCK)
    for role, t in present.items():
        if (role not in DTYPES or t.dtype not in _dtypes(role) or isinstance(t, FakeTensor)
                or t.device.type != "cpu" or not t.is_contiguous()
                or t.numel() != (blocks if role.endswith("_absmax") else numel)):
            return False
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in present.values())
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _dtypes(role: str) -> tuple[torch.dtype, ...]:
    known = DTYPES[role]
    return known if isinstance(known, tuple) else (known,)


# Instruction sets by torch's CPU capability (torch checks the CPU has them). AVX-512's conversions
# and masks halve the split layout's arithmetic (1.26 -> 0.68 ns a number in cache on this project's
# CPUs); the bits are the same, each number's operations being IEEE's whatever the vector width.
ISA = {"AVX2": ("-mavx2", "-mfma", "-mf16c"),
       "AVX512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                  "-mprefer-vector-width=512")}


VBMI = ("-mavx512vbmi",)  # byte permutes: 8-bit moments decoded and coded without gathers (adamw.c's Fast)
BF16 = ("-mavx512bf16",)  # vcvtne2ps2bf16: the fused split loop rounds its weights in one instruction


def isa() -> tuple[str, ...] | None:
    """The instruction-set flags to build with here: by torch's capability on x86 (None: torch runs
    no AVX2 there, so neither does this), with VBMI's where torch runs AVX-512 and the CPU has it (and
    AVX-512 BF16's beside them where it has that too); none elsewhere (the load-time check still
    decides)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = ISA.get(torch.backends.cpu.get_cpu_capability())
    if flags != ISA["AVX512"] or "avx512vbmi" not in cpu_flags():
        return flags
    return (*flags, *VBMI, *(BF16 if "avx512_bf16" in cpu_flags() else ()))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere: no VBMI path)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def library() -> ctypes.CDLL | None:
    """adamw.c built and loaded, once it has left torch's bits on this machine; else None (said once)."""
    flags = isa()
    if flags is None:
        build.say_once("the native host AdamW needs AVX2 and FMA, which torch does not use here "
                       f"(capability {torch.backends.cpu.get_cpu_capability()}): the tiled torch path runs.")
        return None
    lib = build.load("adamw.c", flags)
    if lib is None:
        return None
    lib.slimtune_adamw.argtypes = [ctypes.POINTER(Run), ctypes.POINTER(Hyper)]
    lib.slimtune_adamw.restype = ctypes.c_int
    lib.slimtune_fast_8bit.restype = ctypes.c_int
    with _disable_current_modes():  # first use may come inside a step the memory meter watches
        agrees = _agrees_with_torch(lib)
    if not agrees:
        build.say_once(f"the native host AdamW does not give torch {torch.__version__}'s bits on this machine "
                       f"(capability {torch.backends.cpu.get_cpu_capability()}): the tiled torch path runs.")
        return None
    return lib


def _agrees_with_torch(lib: ctypes.CDLL) -> bool:
    """The library and torch._fused_adamw_ leave the same bits on runs of every length mod 16 (the
    scalar tail), four of each, with and without weight decay and clipping, on both of lerp's branches,
    for a whole fp32 master and for the split one (split_master's pieces, updated from their combined
    master by torch, then split again), its gradient bf16 or fp32 by turns: AVX2 builds run the split
    layout on a loop of its own (a few milliseconds, once a process)."""
    generator = torch.Generator().manual_seed(0)
    for length in range(1024, 1088):
        settings = types.SimpleNamespace(lr=1e-3 * (1 + length % 3), beta1=(0.9, 0.3)[length // 16 % 2], beta2=0.999,
                                         eps=1e-8, weight_decay=0.01 * (length % 3))
        step = (settings, float(1 + length % 5), (1.0, 0.37)[length // 32 % 2])
        p, g, m = (torch.randn(length, generator=generator) * scale for scale in (1.0, 1e-2, 1e-3))
        v = torch.rand(length, generator=generator) * 1e-4
        if not (_whole_agrees(lib, step, p, g, m, v) and _split_agrees(lib, step, p, g, m, v, length % 2 == 0)):
            return False
    return True


def _torch_step(step: tuple, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> tuple:
    """(p, m, v) after torch._fused_adamw_'s step on copies, the gradient clipped in fp32 first."""
    settings, step_count, clip = step
    p, m, v = p.clone(), m.clone(), v.clone()
    torch._fused_adamw_([p], [g.float() * clip], [m], [v], [], [torch.tensor(step_count)], amsgrad=False,
                        lr=settings.lr, beta1=settings.beta1, beta2=settings.beta2,
                        weight_decay=settings.weight_decay, eps=settings.eps, maximize=False)
    return p, m, v


def _library_step(lib: ctypes.CDLL, step: tuple, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    length = tensors["grad"].numel()
    lib.slimtune_adamw(ctypes.byref(run_of(length, tensors, 1)), ctypes.byref(constants(*step)))
    return tensors


def _whole_agrees(lib: ctypes.CDLL, step: tuple, p, g, m, v) -> bool:
    ours = _library_step(lib, step, {"master": p.clone(), "grad": g.clone(), "exp_avg": m.clone(),
                                     "exp_avg_sq": v.clone()})
    return _same_bits(_torch_step(step, p, g, m, v), (ours["master"], ours["exp_avg"], ours["exp_avg_sq"]))


def _split_agrees(lib: ctypes.CDLL, step: tuple, p, g, m, v, grad_bf16: bool) -> bool:
    weight, residual = torch.empty(p.shape, dtype=torch.bfloat16), torch.empty(p.shape, dtype=torch.int16)
    split_master.split(p, weight, residual)
    grad = g.to(torch.bfloat16) if grad_bf16 else g
    ours = _library_step(lib, step, {"weight": weight.clone(), "residual": residual.clone(), "grad": grad.clone(),
                                     "exp_avg": m.clone(), "exp_avg_sq": v.clone()})
    p1, m1, v1 = _torch_step(step, split_master.combined(weight, residual), grad, m, v)
    split_master.split(p1, weight, residual)
    return _same_bits((weight, residual, m1, v1), (ours["weight"], ours["residual"], ours["exp_avg"], ours["exp_avg_sq"]))


def _same_bits(expected: tuple, found: tuple) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(expected, found))
