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
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import types

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from slimtune.optim import moments8
from slimtune.optim.native import build

# torch's fused CPU AdamW computes a call's last numel % 8 numbers on its scalar path (under both its
# AVX2 and AVX512 builds, measured): v's multiply-add is fused the other way round there.
SCALAR_TAIL = 8
BLOCK = moments8.BLOCK  # adamw.c's BLOCK
ENV = "SLIMTUNE_NATIVE"
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


class Coded(ctypes.Structure):
    """adamw.c's Coded: an 8-bit moment's codes and scales, and its map's lookup tables."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("codes", "absmax", "map", "lookup")]


class Run(ctypes.Structure):
    """adamw.c's Run: the run's length, its layout and its tensors' addresses."""

    _fields_ = [("numel", ctypes.c_int64), ("vector_end", ctypes.c_int64), ("split", ctypes.c_int32),
                ("grad_bf16", ctypes.c_int32), ("empty_grad", ctypes.c_int32), ("threads", ctypes.c_int32),
                *((role, ctypes.c_void_p) for role in ROLES), ("coded", ctypes.c_int32),
                *((f"{m}_coded", Coded) for m in MOMENTS)]


def run_of(numel: int, tensors: dict[str, torch.Tensor], threads: int, empty_grad: bool = False) -> Run:
    """The Run for tensors that _readable accepted."""
    coded = "exp_avg_codes" in tensors
    pointers = {role: t.data_ptr() for role, t in tensors.items() if t is not None}
    codings = [Coded(pointers[f"{m}_codes"], pointers[f"{m}_absmax"], *_tables(SIGNED[m])) if coded else Coded()
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


def isa() -> tuple[str, ...] | None:
    """The instruction-set flags to build with here: by torch's capability on x86 (None: torch runs
    no AVX2 there, so neither does this), none elsewhere (the load-time check still decides)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    return ISA.get(torch.backends.cpu.get_cpu_capability())


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
    with _disable_current_modes():  # first use may come inside a step the memory meter watches
        agrees = _agrees_with_torch(lib)
    if not agrees:
        build.say_once(f"the native host AdamW does not give torch {torch.__version__}'s bits on this machine "
                       f"(capability {torch.backends.cpu.get_cpu_capability()}): the tiled torch path runs.")
        return None
    return lib


def _agrees_with_torch(lib: ctypes.CDLL) -> bool:
    """The library and torch._fused_adamw_ leave the same bits on runs of every length mod 16 (the
    scalar tail), four of each, with and without weight decay and clipping, on both of lerp's branches
    (a few milliseconds, once a process)."""
    generator = torch.Generator().manual_seed(0)
    for length in range(1024, 1088):
        settings = types.SimpleNamespace(lr=1e-3 * (1 + length % 3), beta1=(0.9, 0.3)[length // 16 % 2], beta2=0.999,
                                         eps=1e-8, weight_decay=0.01 * (length % 3))
        step_count, clip = float(1 + length % 5), (1.0, 0.37)[length // 32 % 2]
        p, g, m = (torch.randn(length, generator=generator) * scale for scale in (1.0, 1e-2, 1e-3))
        v = torch.rand(length, generator=generator) * 1e-4
        ours = {"master": p.clone(), "grad": g.clone(), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        lib.slimtune_adamw(ctypes.byref(run_of(length, ours, 1)), ctypes.byref(constants(settings, step_count, clip)))
        torch._fused_adamw_([p], [g.mul_(clip)], [m], [v], [], [torch.tensor(step_count)], amsgrad=False,
                            lr=settings.lr, beta1=settings.beta1, beta2=settings.beta2,
                            weight_decay=settings.weight_decay, eps=settings.eps, maximize=False)
        if not all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip((p, m, v), (ours["master"], ours["exp_avg"], ours["exp_avg_sq"]))):
            return False
    return True
