"""The native one-pass host AdamW (slimtune/optim/native) against torch.

- Against torch._fused_adamw_ itself (what torch.optim.AdamW(fused=True) runs), whole fp32 masters
  and fp32 gradients: the same bits over runs of more than 10^6 numbers per case, for several lr,
  betas, eps, weight decays, step counts and clipping coefficients, values over many decades, zero
  gradients, tiny and zero second moments, and every run length mod 16 (torch's scalar tail).
- Against tiled_adamw's torch tile path (SLIMTUNE_NATIVE=0) for every layout the kernel reads: split
  or whole master, bf16 or fp32 gradient, with or without a bf16 shadow, fp32 or 8-bit moments;
  masters at the edges of the split (binade boundaries, ties, the top of the range, subnormals, -0);
  8-bit blocks of zeros, overflowing, subnormal and NaN numbers; on 1 and 2 threads; and through
  HostAdam.update, whose layouts take it. The kernel's 8-bit coding against moments8's quantizer at
  every midpoint of both maps and its neighbours.
- 8-bit moments on both of the kernel's paths (the AVX-512 VBMI one where this machine runs it, and
  the portable loops, SLIMTUNE_NATIVE_VBMI=0): the VBMI coding against moments8's quantizer on every
  code, every midpoint and its fp32 neighbours, every boundary of its segments, a sweep across all of
  fp32's binades, and blocks of zeros, subnormals, absmax at and around 1e-38, huge, infinite and NaN
  numbers; steps of every run length mod 16, 64 and 256 against the tile path.
- Building: a library is compiled once into the cache folder under its hash and loaded from there
  after; no compiler, or a failing one, means one line on stderr and the torch path, never an error.
"""

import ctypes
import subprocess
import sys

import pytest
import torch

from slimtune.optim import moments8, split_master, tiled_adamw
from slimtune.optim.host_adam import Group, HostAdam, Layout
from slimtune.optim.native import adamw as native
from slimtune.optim.native import build

CPU = torch.device("cpu")
MILLION = (1 << 20) + 13  # more than 10^6 numbers, with a scalar tail of 5


@pytest.fixture(autouse=True)
def needs_the_library(monkeypatch):
    """Skipped only without a compiler; with one, a library that fails its load-time check against
    torch (and so is not used) fails here. The kernel is tested whatever SLIMTUNE_NATIVE says (the
    suite may run under SLIMTUNE_NATIVE=0 to test the rest on the torch path)."""
    monkeypatch.delenv(native.ENV, raising=False)
    if build.compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path runs, and is tested elsewhere")
    assert native.library() is not None


PATHS = ("vbmi", "portable")  # the kernel's two paths for 8-bit moments


@pytest.fixture
def eight_bit_path(request, monkeypatch):
    """SLIMTUNE_NATIVE_VBMI for the path named by the test's `path` parameter; the VBMI path is
    skipped where this machine does not run it (no AVX-512 VBMI, or it failed its load check)."""
    if request.param == "vbmi" and not native.fast_path():
        pytest.skip("this machine does not run the VBMI path")
    monkeypatch.setenv(native.VBMI_ENV, "1" if request.param == "vbmi" else "0")
    return request.param


def spread(numel: int, generator: torch.Generator, low: int, high: int) -> torch.Tensor:
    """Random signs and mantissas over decades 10^low .. 10^high."""
    exponents = torch.randint(low, high + 1, (numel,), generator=generator).to(torch.float32)
    return torch.randn(numel, generator=generator) * torch.pow(10.0, exponents)


def state(numel: int, seed: int, extreme: bool = False) -> dict[str, torch.Tensor]:
    """A master, gradient and moments; `extreme`: values over many decades, exact zero gradients and
    moments, subnormal second moments."""
    g = torch.Generator().manual_seed(seed)
    if not extreme:
        return {"master": torch.randn(numel, generator=g), "grad": torch.randn(numel, generator=g) * 1e-2,
                "exp_avg": torch.randn(numel, generator=g) * 1e-3, "exp_avg_sq": torch.rand(numel, generator=g) * 1e-4}
    grad = spread(numel, g, -30, 3)
    grad[torch.rand(numel, generator=g) < 0.1] = 0.0
    exp_avg = spread(numel, g, -30, 0)
    exp_avg[torch.rand(numel, generator=g) < 0.1] = 0.0
    exp_avg_sq = spread(numel, g, -45, 2).abs()  # down to fp32's subnormals
    exp_avg_sq[torch.rand(numel, generator=g) < 0.1] = 0.0
    return {"master": spread(numel, g, -20, 20), "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def torch_step(s: dict[str, torch.Tensor], hyper: tiled_adamw.Hyper, step: float, clip: float) -> None:
    """The plain way: the gradient times clip (as torch multiplies a tensor by a Python float), then
    torch's fused AdamW over the whole run."""
    grad = s["grad"].mul_(clip) if clip != 1.0 else s["grad"]
    torch._fused_adamw_([s["master"]], [grad], [s["exp_avg"]], [s["exp_avg_sq"]], [], [torch.tensor(step)],
                        amsgrad=False, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                        weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CASES = {  # (lr, beta1, beta2, eps, weight decay), step, clip, extreme values
    "defaults": (tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), 1.0, 1.0, False),
    "no_decay_step_7_clipped": (tiled_adamw.Hyper(2e-4, 0.9, 0.95, 1e-8, 0.0), 7.0, 0.37, False),
    "large_lerp_weight": (tiled_adamw.Hyper(3e-2, 0.3, 0.9, 1e-6, 0.1), 3.0, 0.5, False),
    "lerp_weight_one_half": (tiled_adamw.Hyper(1e-4, 0.5, 0.99, 1e-3, 0.5), 2.0, 1.0, False),
    "large_step": (tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), 1e6, 0.9, False),
    "extreme_values": (tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), 5.0, 0.123, True),
    "extreme_values_step_1": (tiled_adamw.Hyper(1e-2, 0.8, 0.99, 1e-12, 0.0), 1.0, 1.0, True),
}


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_leaves_torch_fused_adamws_bits_over_a_million_numbers(case):
    hyper, step, clip, extreme = CASES[case]
    ours, theirs = state(MILLION, 1, extreme), state(MILLION, 1, extreme)
    assert native.step(hyper, step, MILLION, ours, clip=clip)
    assert same_bits(ours["grad"], state(MILLION, 1, extreme)["grad"])  # only read
    torch_step(theirs, hyper, step, clip)
    for role in ("master", "exp_avg", "exp_avg_sq"):
        assert same_bits(ours[role], theirs[role]), role


@pytest.mark.quick
def test_every_run_length_mod_16_leaves_torch_fused_adamws_bits():
    """Short runs: all vector path, all scalar tail, and every mix; 20 steps on each."""
    hyper = tiled_adamw.Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1)
    for numel in [*range(1, 40), 1021, 1024]:
        ours, theirs = state(numel, numel), state(numel, numel)
        for step in range(1, 21):
            fresh = torch.randn(numel, generator=torch.Generator().manual_seed(step)) * 1e-2
            ours["grad"].copy_(fresh)
            theirs["grad"].copy_(fresh)
            assert native.step(hyper, float(step), numel, ours, clip=0.7)
            torch_step(theirs, hyper, float(step), 0.7)
        assert all(same_bits(ours[r], theirs[r]) for r in ("master", "exp_avg", "exp_avg_sq")), numel


# ---------------------------------------------------------------- every layout against the tile path


def moment_forms(m: torch.Tensor, v: torch.Tensor, coded: bool) -> tuple[list, list[torch.Tensor]]:
    """(the two moments' forms, their tensors): fp32 as given, or coded into 8-bit moments."""
    if not coded:
        return [tiled_adamw.Whole(m), tiled_adamw.Whole(v)], [m, v]
    held = [moments8.Moment8(m.numel(), signed) for signed in (True, False)]
    for moment, values in zip(held, (m, v)):
        moment.quantize(0, m.numel(), values)
    return [tiled_adamw.Coded(moment) for moment in held], [t for h in held for t in (h.codes, h.absmax)]


def layout_forms(split: bool, grad_dtype: torch.dtype, shadow: bool, masters: torch.Tensor, seed: int,
                 coded: bool = False, clip: float = 0.3):
    """(master form, gradient form, moment forms, the tensors to compare) for one layout."""
    g = torch.Generator().manual_seed(seed)
    numel = masters.numel()
    grad = (torch.randn(numel, generator=g) * 1e-2).to(grad_dtype)
    moments, held_moments = moment_forms(torch.randn(numel, generator=g) * 1e-3,
                                         torch.rand(numel, generator=g) * 1e-4, coded)
    copy = torch.zeros(numel, dtype=torch.bfloat16) if shadow else None
    if split:
        weights, residuals = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.int16)
        split_master.split(masters, weights, residuals)
        master = tiled_adamw.Split(weights, residuals, (copy,) if shadow else ())
        held = [weights, residuals]
    else:
        master = tiled_adamw.Whole(masters.clone(), (copy,) if shadow else ())
        held = [master.flat]
    forms = (master, tiled_adamw.Scaled([(0, grad)], clip), *moments)
    return forms, [*held, grad, *held_moments, *([copy] if shadow else [])]


def watch_native(monkeypatch) -> list[bool]:
    """What each native.step call tiled_adamw makes answers (True: the kernel ran)."""
    answers, step = [], native.step

    def watched(*args, **kwargs):
        answers.append(step(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(native, "step", watched)
    return answers


def both_paths(monkeypatch, masters: torch.Tensor, steps: int = 3, threads: int = 1,
               hyper: tiled_adamw.Hyper = tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), clip: float = 0.3,
               **layout) -> None:
    """The same steps by the native loop and by the tile path leave the same bits everywhere, the
    gradient emptied by both."""
    runs, answers = [], watch_native(monkeypatch)
    for native_on in ("1", "0"):
        monkeypatch.setenv(native.ENV, native_on)
        forms, held = layout_forms(masters=masters, seed=5, clip=clip, **layout)
        for step in range(1, steps + 1):
            forms[1].pieces[0][1].copy_(torch.randn(masters.numel(), generator=torch.Generator().manual_seed(step)))
            tiled_adamw.adamw(hyper, torch.tensor(float(step)), masters.numel(), torch.float32, *forms,
                              threads=threads, empty_grad=True)
            assert torch.count_nonzero(forms[1].pieces[0][1]) == 0
        runs.append(held)
    assert answers == [True] * steps + [False] * steps  # the kernel, then the tile path
    for ours, theirs in zip(*runs):
        assert same_bits(ours, theirs)


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grad", "fp32_grad"])
@pytest.mark.parametrize("shadow", [True, False], ids=["shadow", "no_shadow"])
@pytest.mark.parametrize("coded", [False, True], ids=["fp32_moments", "8bit_moments"])
def test_every_layout_equals_the_tile_path_bit_for_bit(monkeypatch, split, grad_dtype, shadow, coded):
    """Three tiles and a partial block; 8-bit moments over a million numbers."""
    numel = MILLION if coded else 3 * tiled_adamw.TILE + 11
    masters = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    both_paths(monkeypatch, masters, split=split, grad_dtype=grad_dtype, shadow=shadow, coded=coded)


def edge_masters() -> torch.Tensor:
    """Masters where the split is delicate: every binade's boundary and bf16's ties on both sides
    (some round up into the next binade), the largest finite values (some round to an infinite
    weight), subnormals, +-0, and the exact upper tie of even weights (split_master's one rule)."""
    exponents = torch.arange(-149, 128, dtype=torch.float64)
    bases = torch.cat([torch.ldexp(torch.ones_like(exponents), exponents.to(torch.int64)),
                       torch.tensor([3.3895313892515355e38, 3.4028234663852886e38, 0.0, 1e-45, 1.1754942e-38])])
    bits = bases.to(torch.float32).view(torch.int32)
    offsets = torch.tensor([-0x8001, -0x8000, -0x7FFF, -1, 0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000], dtype=torch.int32)
    near = (bits[:, None] + offsets[None, :]).flatten()
    finite = near.view(torch.float32)
    finite = finite[torch.isfinite(finite)]
    return torch.cat([finite, -finite])


STILL = tiled_adamw.Hyper(0.0, 0.9, 0.999, 1e-8, 0.01)  # lr 0: each master is split again exactly as it was


def test_masters_at_the_edges_of_the_split_equal_the_tile_path(monkeypatch):
    """Moved by a step, and left where they are (lr 0), so that the kernel's own rounding to bf16
    and residual meet the edges themselves."""
    for hyper in (tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), STILL):
        both_paths(monkeypatch, edge_masters(), split=True, grad_dtype=torch.bfloat16, shadow=True, hyper=hyper)
        both_paths(monkeypatch, edge_masters(), split=False, grad_dtype=torch.float32, shadow=True, hyper=hyper)


@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp_small", "lerp_large"])
@pytest.mark.parametrize("clip", [1.0, 0.3], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["no_decay", "decay"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grad", "fp32_grad"])
def test_each_variant_of_the_split_loop_equals_the_tile_path(monkeypatch, beta1, clip, weight_decay, grad_dtype):
    """The split layout with fp32 moments, the default: on AVX2 builds its loop is written out
    (adamw.c's split_avx2_of), compiled once for each of lerp's branches, with and without the
    clipping and the weight decay's multiplies; elsewhere gcc's vectorization of the plain loop. Each
    against the tile path, at the edges of the split too, over a partial vector and the scalar tail."""
    hyper = tiled_adamw.Hyper(1e-3, beta1, 0.999, 1e-8, weight_decay)
    masters = torch.cat([torch.randn(3 * 256 + 13, generator=torch.Generator().manual_seed(4)), edge_masters()])
    both_paths(monkeypatch, masters, steps=2, hyper=hyper, clip=clip, split=True, grad_dtype=grad_dtype, shadow=True)


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
def test_masters_at_the_edges_of_the_split_with_8bit_moments_equal_the_tile_path(monkeypatch, eight_bit_path):
    """The same masters through the layout the VBMI path fuses (its own rounding to bf16 and
    residual), with and without a shadow."""
    for shadow in (True, False):
        for hyper in (tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), STILL):
            both_paths(monkeypatch, edge_masters(), split=True, grad_dtype=torch.bfloat16, shadow=shadow, coded=True,
                       hyper=hyper)


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
def test_8bit_split_layout_on_each_path_equals_the_tile_path(monkeypatch, eight_bit_path):
    """The layout the VBMI path fuses (split master, bf16 gradient), with and without a shadow, on
    both paths: three tiles and a partial block."""
    masters = torch.randn(3 * tiled_adamw.TILE + 11, generator=torch.Generator().manual_seed(2))
    for shadow in (False, True):
        both_paths(monkeypatch, masters, split=True, grad_dtype=torch.bfloat16, shadow=shadow, coded=True)


@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp_small", "lerp_large"])
@pytest.mark.parametrize("clip", [1.0, 0.3], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["no_decay", "decay"])
def test_each_variant_of_the_fused_8bit_loop_equals_the_tile_path(monkeypatch, beta1, clip, weight_decay):
    """The fused loop is compiled once for each of lerp's branches, with and without the clipping
    multiply (skipped at 1) and the weight decay's (skipped without decay): each against the tile path.
    Where this machine can build the VBMI path, it must also pass its own load-time check (which would
    otherwise hand 8-bit moments to the portable loops, and this test to them)."""
    if "-mavx512vbmi" not in (native.isa() or ()):
        pytest.skip("this machine does not build the VBMI path")
    assert native.fast_path()
    monkeypatch.setenv(native.VBMI_ENV, "1")
    masters = torch.randn(4 * 256 + 9, generator=torch.Generator().manual_seed(3))
    both_paths(monkeypatch, masters, steps=2, hyper=tiled_adamw.Hyper(1e-3, beta1, 0.999, 1e-8, weight_decay),
               clip=clip, split=True, grad_dtype=torch.bfloat16, shadow=True, coded=True)


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
def test_8bit_runs_of_every_length_mod_16_64_and_256_equal_the_tile_path(monkeypatch, eight_bit_path):
    """Whole blocks on the fused loop, the last partial block and the scalar tail on the portable
    one: lengths around 16, 64 and 256 and their multiples, one layout fused and one not."""
    lengths = (1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 263, 511, 512, 520, 3 * 256 + 100, 4 * 256 + 255)
    for numel in lengths:
        masters = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        both_paths(monkeypatch, masters, steps=2, split=True, grad_dtype=torch.bfloat16, shadow=False, coded=True)
        both_paths(monkeypatch, masters, steps=2, split=False, grad_dtype=torch.float32, shadow=True, coded=True)


@pytest.mark.parametrize("coded", [False, True], ids=["fp32_moments", "8bit_moments"])
def test_two_threads_leave_the_bits_of_one(monkeypatch, coded):
    for numel in (255, 257, 2 * 256 + 7, 100_003):
        masters = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        both_paths(monkeypatch, masters, threads=2, split=True, grad_dtype=torch.bfloat16, shadow=False, coded=coded)


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
def test_8bit_blocks_of_zeros_huge_and_tiny_numbers_equal_the_tile_path(monkeypatch, eight_bit_path):
    """Blocks whose moments come out all zero (zero gradients from zero moments), a block of
    gradients near fp32's top (v overflows to inf throughout its block), a block of subnormal
    gradients (absmax under 1e-38), and a NaN gradient (its moments' blocks come back NaN
    throughout on both paths, as moments8 says; the master's NaN bf16 pattern is torch's vector
    one here)."""
    numel = 8 * 256 + 100
    masters = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    runs, answers = [], watch_native(monkeypatch)
    for native_on in ("1", "0"):
        monkeypatch.setenv(native.ENV, native_on)
        forms, held = layout_forms(split=True, grad_dtype=torch.float32, shadow=False, masters=masters, seed=6,
                                   coded=True)
        for moment in forms[2:]:
            moment.moment.codes[:512].fill_(moments8.zero_code(moment.moment.signed))
            moment.moment.absmax[:2].zero_()
        for step in range(1, 4):
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(step))
            grad[:512] = 0.0
            grad[512:768] *= 3e37
            grad[768:1024] *= 1e-42
            grad[1030] = float("nan")
            forms[1].pieces[0][1].copy_(grad)
            tiled_adamw.adamw(tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0), torch.tensor(float(step)), numel,
                              torch.float32, *forms, empty_grad=True)
        runs.append(held)
    assert answers == [True] * 3 + [False] * 3
    for ours, theirs in zip(*runs):
        assert same_bits(ours, theirs)


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
def test_8bit_a_lone_infinite_moment_in_a_fused_block_equals_the_tile_path(monkeypatch, eight_bit_path):
    """One step of the fused layout where one number's v overflows to inf in an otherwise finite
    block: the block's absmax is inf, its other codes the zero code and that one's 255, each in its
    place (the fused loop holds numbers out of order until it stores them). One step only: the next
    would decode 0 * inf = NaN into the block's masters, whose NaN bits are not held to torch's."""
    numel = 4 * 256
    masters = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    runs, answers = [], watch_native(monkeypatch)
    for native_on in ("1", "0"):
        monkeypatch.setenv(native.ENV, native_on)
        forms, held = layout_forms(split=True, grad_dtype=torch.bfloat16, shadow=False, masters=masters, seed=7,
                                   coded=True)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        grad[300] = 1e30
        forms[1].pieces[0][1].copy_(grad)
        tiled_adamw.adamw(tiled_adamw.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0), torch.tensor(1.0), numel, torch.float32,
                          *forms, empty_grad=True)
        runs.append(held)
    assert answers == [True, False]
    assert runs[1][6][1] == float("inf") and runs[1][5][300] == 255  # v's absmax and code there
    for ours, theirs in zip(*runs):
        assert same_bits(ours, theirs)


@pytest.mark.parametrize("split, moments", [(True, "fp32"), (False, "fp32"), (True, "8bit")],
                         ids=["split", "whole", "split_8bit"])
def test_host_adam_updates_the_same_with_and_without_the_kernel(monkeypatch, split, moments):
    groups = [Group((torch.Size([300, 257]), torch.Size([1001])), 0.1), Group((torch.Size([4099]),), 0.0)]
    adams, answers = [], watch_native(monkeypatch)
    for native_on in ("1", "0"):
        monkeypatch.setenv(native.ENV, native_on)
        adam = HostAdam("n", groups, torch.float32, CPU, {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8},
                        shadow_dtype=torch.bfloat16, layout=Layout(split=split, grad_dtype=torch.bfloat16, moments=moments))
        adam.load_group_masters([[torch.randn(s, generator=torch.Generator().manual_seed(3)) for s in g.shapes]
                                 for g in groups])
        for step in range(4):
            for k, group in enumerate(groups):
                adam.grads[k].copy_(torch.randn(group.numel, generator=torch.Generator().manual_seed(step)))
            adam.update(1e-2, (1.0, 0.5)[step % 2])
        adams.append(adam.state_dict())
    assert answers == [True] * 8 + [False] * 8
    ours, theirs = adams
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        assert all(same_bits(a, b) for a, b in zip(ours[key], theirs[key])), key
    for a, b in zip(ours["coded"], theirs["coded"]):  # 8-bit moments as they rest
        assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


@pytest.mark.parametrize("coded", [False, True], ids=["fp32_moments", "8bit_moments"])
def test_without_empty_grad_the_gradient_is_only_read(monkeypatch, coded):
    """A gradient that is not an accumulator (a staging buffer the step reads where it arrived)."""
    masters = torch.randn(5000, generator=torch.Generator().manual_seed(8))
    forms, _ = layout_forms(split=True, grad_dtype=torch.bfloat16, shadow=False, masters=masters, seed=2, coded=coded)
    grad = forms[1].pieces[0][1]
    before, answers = grad.clone(), watch_native(monkeypatch)
    tiled_adamw.adamw(CASES["defaults"][0], torch.tensor(1.0), 5000, torch.float32, *forms)
    assert answers == [True] and same_bits(grad, before)


def test_tensors_the_kernel_cannot_read_are_left_to_the_tile_path():
    hyper, s = CASES["defaults"][0], state(64, 0)
    assert not native.step(hyper, 1.0, 64, {**s, "master": s["master"].double()})
    assert not native.step(hyper, 1.0, 64, {**s, "exp_avg": torch.zeros(128)[::2]})  # strided
    assert not native.step(hyper, 1.0, 64, {**s, "exp_avg_sq": s["exp_avg"]})  # two roles, one tensor
    assert not native.step(hyper, 1.0, 64, {k: v for k, v in s.items() if k != "exp_avg"})
    assert not native.step(hyper, 1.0, 32, s)  # not the run's length
    assert torch.equal(s["master"], state(64, 0)["master"])  # nothing was done


def kernel_codes_equal_moments8s(values: torch.Tensor, signed: bool, path: str) -> None:
    """values coded by the kernel's coding alone (slimtune_encode: absmax and codes a block at a
    time) on one path, and by moments8's quantizer: the same absmax and codes."""
    ours, theirs = moments8.Moment8(values.numel(), signed), moments8.Moment8(values.numel(), signed)
    theirs.quantize(0, values.numel(), values)
    fast = ctypes.addressof(native.fast_tables(signed)) if path == "vbmi" else None
    coded = native.Coded(ours.codes.data_ptr(), ours.absmax.data_ptr(), *native._tables(signed), fast)
    native.library().slimtune_encode(ctypes.byref(coded), ctypes.c_int64(values.numel()),
                                     ctypes.c_void_p(values.data_ptr()))
    assert same_bits(ours.absmax, theirs.absmax)
    assert torch.equal(ours.codes, theirs.codes), int((ours.codes != theirs.codes).sum())


def blocks_of_absmax_one(values: torch.Tensor) -> torch.Tensor:
    """values in blocks of 255 and a 1.0 (so each block's numbers are coded as they are)."""
    blocks = values.reshape(-1)[: values.numel() // 255 * 255].view(-1, 255)
    return torch.cat([blocks, torch.ones(blocks.shape[0], 1)], dim=1).flatten().contiguous()


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
@pytest.mark.parametrize("signed", [True, False], ids=["m_map", "v_map"])
def test_8bit_codes_at_every_midpoint_and_its_neighbours_are_moments8s(signed, eight_bit_path):
    """The kernel's coding against moments8's quantizer, on blocks whose absmax is 1: every midpoint
    of the map, the 4 fp32 numbers either side of it, both signs, every map value and its
    neighbours, and numbers across all of fp32's binades."""
    code = moments8.dynamic_map(signed)
    mids = (code[:-1] + code[1:]) / 2
    around = torch.arange(-4, 5, dtype=torch.int32)[None, :]
    bits = torch.cat([(mids.view(torch.int32)[:, None] + around).flatten(),
                      (code.view(torch.int32)[:, None] + around[:, 2:-2]).flatten()])
    binades = torch.ldexp(torch.ones(300), torch.arange(-150, 150)).float()
    values = torch.cat([bits.view(torch.float32), code, binades.clamp(max=1.0), torch.rand(2000)])
    values = values[torch.isfinite(values)]  # (below +0's bits lie NaNs)
    values = torch.cat([values, -values]) if signed else values.abs()
    kernel_codes_equal_moments8s(blocks_of_absmax_one(values), signed, eight_bit_path)


@pytest.mark.parametrize("signed", [True, False], ids=["m_map", "v_map"])
def test_vbmi_codes_across_fp32_and_at_its_segment_boundaries_are_moments8s(signed):
    """The VBMI coding counts midpoints by each decade's line, so its edges are where the line
    changes and where it lands near a step: every bit pattern in a sweep from 0 to just past 1 (a
    stride of 4099, all binades, both signs), the 64 fp32 numbers either side of every segment
    boundary and of every power of two and of ten in range, +-0 and the smallest subnormal. (Every
    fp32 number up to 1 + 2000 ulp, both signs, was checked once offline: benchmarks/docs/
    host_adam_bandwidth.md.)"""
    if not native.fast_path():
        pytest.skip("this machine does not run the VBMI path")
    fast = native.fast_tables(signed)
    one = torch.tensor(1.0).view(torch.int32).item()
    sweep = torch.arange(0, one + 2000, 4099, dtype=torch.int32)
    edges = torch.tensor([b for b in fast.threshold if b not in (0, 0x40000000)]  # (0, 2.0: no boundary)
                         + [torch.tensor(10.0 ** -k).float().view(torch.int32).item() for k in range(0, 9)]
                         + [(127 + e) << 23 for e in range(-30, 1)], dtype=torch.int32)
    near = (edges[:, None] + torch.arange(-64, 65, dtype=torch.int32)[None, :]).flatten()
    values = torch.cat([sweep, near, torch.tensor([0, 1], dtype=torch.int32)]).view(torch.float32)
    assert values.isfinite().all()
    values = torch.cat([values, -values]) if signed else values
    kernel_codes_equal_moments8s(blocks_of_absmax_one(values), signed, "vbmi")


@pytest.mark.parametrize("eight_bit_path", PATHS, indirect=True)
@pytest.mark.parametrize("signed", [True, False], ids=["m_map", "v_map"])
def test_8bit_blocks_at_the_edges_of_the_absmax_are_coded_as_moments8_does(signed, eight_bit_path):
    """Whole blocks on the VBMI path whose absmax is 0, subnormal, just under, at and just over 1e-38
    (the floor of the scale), near fp32's top, infinite or NaN (those whole blocks go to the
    portable coding), a lone -0; then the last partial block of lengths 255, 257 and 300."""
    g = torch.Generator().manual_seed(3)
    sign = (lambda x: x) if signed else torch.abs
    tiny = torch.tensor([1, 0x7FFFFF, 0x006CE3ED, 0x006CE3EE, 0x006CE3EF], dtype=torch.int32)
    blocks = [torch.zeros(256), torch.full((256,), -0.0), torch.rand(256, generator=g) * 1e-40]
    for bits in tiny:  # absmax a subnormal, 1e-38 and its neighbours
        block = torch.rand(256, generator=g) * bits.view(torch.float32)
        block[17] = bits.view(torch.float32)
        blocks.append(block)
    blocks += [torch.randn(256, generator=g) * 1e38, torch.randn(256, generator=g)]
    blocks[-1][5] = float("inf")
    blocks.append(torch.randn(256, generator=g))
    blocks[-1][200] = float("nan")
    values = sign(torch.cat(blocks))
    kernel_codes_equal_moments8s(values, signed, eight_bit_path)
    for numel in (255, 257, 300):
        kernel_codes_equal_moments8s(sign(torch.randn(numel, generator=g)), signed, eight_bit_path)


# ---------------------------------------------------------------- building and falling back


def test_a_library_is_built_once_into_the_cache_under_its_hash(tmp_path, monkeypatch):
    """Two processes building into an empty cache at once each load a whole library; one file
    remains, named by the hash, and no temporary files. (A one-line source: the race is the cache's,
    whatever it compiles; adamw.c takes 6 s of a core to build, and every other test here builds it.)"""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "tiny.c").write_text("int slimtune_tiny(void) { return 7; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = ("import pathlib; from slimtune.optim.native import build; "
              f"build.HERE = pathlib.Path({str(sources)!r}); lib = build.load('tiny.c'); "
              "assert lib is not None and lib.slimtune_tiny() == 7")
    racers = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [racer.wait(timeout=120) for racer in racers] == [0, 0]
    built = list((tmp_path / "cache" / "slimtune" / "kernels").iterdir())
    assert built == [build.library_path(sources / "tiny.c", build.compiler())]
    monkeypatch.setattr(build, "HERE", sources)
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("rebuilt a library the cache holds"))
    assert build.load("tiny.c").slimtune_tiny() == 7


def test_a_library_built_without_vbmi_has_only_the_portable_loops_and_their_bits(tmp_path, monkeypatch):
    """Built for a CPU without AVX-512 VBMI (the flags isa() gives such a machine), the library says
    it has no VBMI path, and its portable loops leave the bits of this machine's default library."""
    flags = tuple(f for f in native.isa() or () if f not in native.VBMI)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plain = build.load("adamw.c", flags)
    assert plain is not None and plain.slimtune_fast_8bit() == 0
    numel, hyper = 5 * 256 + 77, CASES["defaults"][0]
    runs = []
    for lib, fast in ((plain, False), (native.library(), native.fast_path())):
        forms, held = layout_forms(split=True, grad_dtype=torch.bfloat16, shadow=False,
                                   masters=torch.randn(numel, generator=torch.Generator().manual_seed(1)), seed=3,
                                   coded=True)
        tensors = {"weight": held[0], "residual": held[1], "grad": held[2], "exp_avg_codes": held[3],
                   "exp_avg_absmax": held[4], "exp_avg_sq_codes": held[5], "exp_avg_sq_absmax": held[6]}
        for step in (1.0, 2.0):
            lib.slimtune_adamw(ctypes.byref(native.run_of(numel, tensors, 1, fast=fast)),
                               ctypes.byref(native.constants(hyper, step, 1.0)))
        runs.append(held)
    assert all(same_bits(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("cc, said", [("no-such-compiler", "no C compiler"), ("false", "compiling adamw.c failed")])
def test_without_a_working_compiler_the_tile_path_runs_and_says_so_once(tmp_path, monkeypatch, capsys, cc, said):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(build, "_said", set())
    native.library.cache_clear()
    try:
        hyper, s = CASES["defaults"][0], state(64, 0)
        assert not native.step(hyper, 1.0, 64, s) and not native.step(hyper, 1.0, 64, s)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and "torch's tiled path" in lines[0]
    finally:
        native.library.cache_clear()


def test_a_build_at_a_terminal_says_so_once_and_a_cached_library_says_nothing(tmp_path, monkeypatch, capsys):
    """A first build takes seconds: at a terminal one line says what is being built; a library the cache
    holds loads silently, and output that is not a terminal (logs, these tests) gets no line."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "tiny.c").write_text("int slimtune_tiny(void) { return 7; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "HERE", sources)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert build.load("tiny.c").slimtune_tiny() == 7
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("slimtune: building tiny.c with "), said
    assert build.load("tiny.c").slimtune_tiny() == 7
    assert capsys.readouterr().err == ""


def test_a_machine_without_a_compiler_builds_the_library_with_zig_from_pypi(tmp_path, monkeypatch):
    """No cc, gcc or clang on the PATH and no $CC: the ziglang package's zig cc builds the library (a
    requirement of the tests, an extra of the package: slimtune[compiler]), and the library passes its
    load-time checks against torch and the portable loops, so the native path runs."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build.compiler() == build.ZIG == (sys.executable, "-m", "ziglang", "cc", "-mcpu=baseline")
    native.library.cache_clear()
    try:
        lib = native.library()
        assert lib is not None, "zig cc did not build a library that passes its checks"
        assert native.fast_path() == bool(lib.slimtune_fast_8bit())
        built = list((tmp_path / "cache" / "slimtune" / "kernels").glob("adamw-*.so"))
        assert built == [build.library_path(build.HERE / "adamw.c", build.compiler(), native.isa() or ())]
        assert native.step(CASES["defaults"][0], 1.0, 64, state(64, 0))
    finally:
        native.library.cache_clear()


def test_slimtune_native_0_takes_the_torch_path(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert not native.step(CASES["defaults"][0], 1.0, 64, state(64, 0))
