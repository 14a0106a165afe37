"""8-bit AdamW moments (Moment8) against bitsandbytes.

- The maps are bitsandbytes' dynamic maps to the bit, and the table lookup picks, for every fp32
  number, the code torch.bucketize picks on the maps' midpoints (checked at every bucket's edges and
  around every midpoint, which covers every fp32 number).
- Codes equal bitsandbytes' reference quantizer (its pure-torch kernel, bucketize on the midpoints;
  its native CPU kernel is a coarser 65536-step lookup, held here only to its own tolerance), absmax
  and dequantized values equal its native CPU kernels, bit for bit, on odd lengths with zero,
  denormal and huge blocks; tiles equal one whole quantize; the error is within half the largest gap.
- AdamW: from AdamW8bit's own state, one step of dequantize -> AdamW -> quantize gives AdamW8bit's
  parameters bit for bit (20 steps, teacher-forced); left to run free for 20 steps, the two stay
  within a bound derived below from the two quantizers' error bounds.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from slimtune.optim.moments8 import BLOCK, Moment8, dynamic_map, quantize_rows, zero_code

LUT_STEP = 2 / 65535  # bitsandbytes' native CPU quantizer: a lookup grid of 65536 points over [-1, 1]
REFERENCE_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def bnb():
    """bitsandbytes, imported without its warning about an optional matmul package we never call."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level, log.level = log.level, logging.ERROR
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401
    finally:
        log.setLevel(level)
    return bitsandbytes


def reference_codes(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' reference quantizer (its default, pure-torch kernel), reached past the native
    CPU one. Its last partial block divides by absmax where whole blocks (and its CUDA kernel)
    multiply by the reciprocal: zero padding to whole blocks keeps every block on the multiply path
    and changes no block's absmax."""
    bnb()
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    codes, _ = op.redispatch(REFERENCE_KERNEL, torch.cat([x, x.new_zeros(-x.numel() % BLOCK)]), code.clone(), BLOCK)
    return codes[: x.numel()]


def native_quantize(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, state = bnb().functional.quantize_blockwise(x, code=code.clone(), blocksize=BLOCK)
    return codes, state.absmax


def native_dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return bnb().functional.dequantize_blockwise(codes, absmax=absmax, code=code.clone(), blocksize=BLOCK)


def worst_error(code: torch.Tensor) -> float:
    """The farthest any number of [-1, 1] (signed) or [0, 1] lies from its nearest code: half the
    largest gap, or the distance from the range's end to the end code."""
    low = -1.0 if code[0] < 0 else 0.0
    gaps = (code[1:] - code[:-1]).double()
    return max(float(gaps.max()) / 2, float(code[0]) - low, 1.0 - float(code[-1]))


def nasty(n: int, signed: bool, seed: int) -> torch.Tensor:
    """Random numbers over 12 decades, then blocks that are all zero, all denormal, denormal beside
    normal, huge (up to the largest finite fp32), exactly on codes and exactly on midpoints."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** (12 * torch.rand(n, generator=g) - 10)
    x = x if signed else x.abs()
    code = dynamic_map(signed)
    mid = (code[:-1] + code[1:]) / 2
    blocks = x[: n // BLOCK * BLOCK].view(-1, BLOCK)
    blocks[0] = 0.0
    blocks[1] = torch.rand(BLOCK, generator=g) * 1e-40
    blocks[2, :128] = torch.rand(128, generator=g) * 1e-41
    blocks[3] = torch.finfo(torch.float32).max * torch.rand(BLOCK, generator=g)
    blocks[3, 7] = torch.finfo(torch.float32).max
    blocks[4] = code[torch.randint(0, 256, (BLOCK,), generator=g)] * 4.0  # absmax 4: scaled exactly
    blocks[4, 0] = 4.0
    blocks[5, 1:] = mid[torch.randint(0, 255, (BLOCK - 1,), generator=g)]
    blocks[5, 0] = 1.0
    if signed:
        blocks[3] *= torch.randn(BLOCK, generator=g).sign()
        blocks[6] = -0.0
    x[-(n % BLOCK or BLOCK):] *= 1e3  # the last (partial) block on a scale of its own
    return x


@pytest.mark.quick
@pytest.mark.parametrize("signed", [True, False])
def test_lookup_picks_the_bucketize_code_for_every_fp32_number(signed):
    code = dynamic_map(signed)
    mid = (code[:-1] + code[1:]) / 2
    assert zero_code(signed) == (127 if signed else 0) and code[zero_code(signed)] == 0
    # Within a bucket (fp32 numbers sharing their top 16 bits) both rules step at most once, at the
    # bucket's midpoint; so agreeing at every bucket's two ends and on both sides of every midpoint
    # is agreeing on every fp32 number.
    keys = torch.arange(1 << 16, dtype=torch.int64)
    ends = torch.cat([keys << 16, (keys << 16) | 0xFFFF])
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).to(torch.int32).view(torch.float32)
    around = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    s = torch.cat([ends[ends.isfinite() & (ends.abs() <= 1)], around])
    # One block per number, each with a 1.0 beside it, so the absmax is 1 and s is scaled exactly.
    rows = torch.stack([s, torch.ones_like(s)], dim=1)
    codes, absmax = torch.empty(rows.shape, dtype=torch.uint8), torch.empty(len(s))
    quantize_rows(rows, codes, absmax, signed)
    assert torch.equal(absmax, torch.ones(len(s)))
    assert torch.equal(codes[:, 0].long(), torch.bucketize(s, mid))


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_bitsandbytes_dynamic_maps(signed):
    theirs = bnb().functional.create_dynamic_map(signed=signed)
    assert torch.equal(dynamic_map(signed).view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [BLOCK * 37 + 77, BLOCK * 8, 255, (1 << 17) + BLOCK * 3 + 5])
def test_quantize_and_dequantize_equal_bitsandbytes(signed, n):
    x = nasty(n, signed, seed=n + signed) if n > 7 * BLOCK else torch.randn(n)
    x = x if signed else x.abs()
    moment = Moment8(n, signed)
    moment.quantize(0, n, x)
    assert torch.equal(moment.codes, reference_codes(x, moment.code))
    codes, absmax = native_quantize(x, moment.code)
    assert torch.equal(moment.absmax, absmax)
    out = moment.dequantize(0, n, torch.empty(n))
    theirs = native_dequantize(moment.codes, moment.absmax, moment.code)
    assert torch.equal(out.view(torch.int32), theirs.view(torch.int32))
    # bitsandbytes' native CPU codes (blocks of normal absmax): within one grid step more than the
    # nearest code's error bound; the free-running AdamW bound below rests on this.
    scale = absmax.repeat_interleave(BLOCK)[:n].double()
    normal = scale >= torch.finfo(torch.float32).tiny
    native_error = (native_dequantize(codes, absmax, moment.code).double() - x.double()).abs()
    assert (native_error[normal] <= scale[normal] * (worst_error(moment.code) + LUT_STEP + 2**-20)).all()


@pytest.mark.parametrize("signed", [True, False])
def test_error_is_within_half_the_largest_gap(signed):
    n = BLOCK * 37 + 77
    x = nasty(n, signed, seed=7)
    moment = Moment8(n, signed)
    moment.quantize(0, n, x)
    error = (moment.dequantize(0, n, torch.empty(n)).double() - x.double()).abs()
    scale = moment.absmax.repeat_interleave(BLOCK)[:n].double()
    normal = scale >= torch.finfo(torch.float32).tiny
    # 2^-20 of absmax covers the fp32 rounding of x / absmax (a denormal reciprocal for huge blocks).
    assert (error[normal] <= scale[normal] * (worst_error(moment.code) + 2**-20)).all()
    # A denormal absmax scales by 1 / 1e-38 as bitsandbytes does, not to [-1, 1]: within absmax.
    assert (~normal).sum() >= BLOCK and (error[~normal] <= scale[~normal]).all()
    assert worst_error(moment.code) == pytest.approx(0.00703 if signed else 0.00352, abs=1e-5)


@pytest.mark.parametrize("signed", [True, False])
def test_tiles_equal_one_whole_quantize(signed):
    n, tile = BLOCK * 37 + 77, BLOCK * 5
    x = nasty(n, signed, seed=3)
    whole, tiled = Moment8(n, signed), Moment8(n, signed)
    whole.quantize(0, n, x)
    for start in range(0, n, tile):
        tiled.quantize(start, min(start + tile, n), x[start : start + tile].clone())
    assert torch.equal(tiled.codes, whole.codes) and torch.equal(tiled.absmax, whole.absmax)
    out = torch.empty(n)
    for start in range(0, n, tile):
        tiled.dequantize(start, min(start + tile, n), out[start : start + tile])
    assert torch.equal(out, whole.dequantize(0, n, torch.empty(n)))


def test_new_moment_is_zero_placed_by_alloc_and_sized():
    placed = []

    def alloc(shape, dtype):
        placed.append((shape, dtype))
        return torch.full(shape, 7, dtype=dtype)  # garbage the constructor must overwrite

    for signed in (True, False):
        moment = Moment8(1000, signed, alloc)
        out = moment.dequantize(0, 1000, torch.full((1000,), float("nan")))
        assert torch.equal(out.view(torch.int32), torch.zeros(1000, dtype=torch.int32))  # +0.0 everywhere
        assert moment.nbytes() == 1000 + 4 * 4
    assert placed == [((1000,), torch.uint8), ((4,), torch.float32)] * 2


def test_moment_made_under_fake_tensors_has_real_tables():
    """The planner builds optimizers on fake tensors: the moment's codes and absmax are fake, the
    map and lookup tables (made on first use, possibly there) are real and shared."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from slimtune.optim import moments8

    moments8._tables.cache_clear()
    with FakeTensorMode():
        moment = Moment8(10_000, True)
        assert is_fake(moment.codes) and is_fake(moment.absmax) and not is_fake(moment.code)
    assert not is_fake(moments8._tables(True)[1])
    assert moment.nbytes() == 10_000 + 4 * 40


def test_misaligned_tiles_are_refused():
    moment = Moment8(1000, True)
    for start, stop in [(100, 512), (0, 300), (512, 1001), (768, 512)]:
        with pytest.raises(ValueError, match="aligned"):
            moment.quantize(start, stop, torch.zeros(max(stop - start, 0)))
    with pytest.raises(ValueError, match="fp32"):
        moment.dequantize(0, 256, torch.zeros(256, dtype=torch.float64))
    moment.quantize(768, 1000, torch.ones(232))  # the partial last block is a tile of its own


# ------------------------------------------------------------------------------------- AdamW

N, STEPS, LR, WD, BETAS, EPS = 10_000, 20, 1e-3, 1e-2, (0.9, 0.999), 1e-8


def adamw_like_bitsandbytes(p, g, m, v, step):
    """AdamW on fp32 tiles in bitsandbytes' CPU kernel's order of operations."""
    b1, b2 = BETAS
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(EPS)
    p.mul_(1 - LR * WD)
    p.addcdiv_(m, denom, value=-LR / (1 - b1**step))


def fused_adamw(p, g, m, v, step):
    """torch's fused CPU AdamW on the same tiles (what a host optimizer runs)."""
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                        weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)


def step_8bit(p, g, m8, v8, step, adamw, tile=BLOCK * 16):
    """One step of the host optimizer's loop: per tile, dequantize m and v, AdamW, quantize back."""
    for start in range(0, N, tile):
        stop = min(start + tile, N)
        m = m8.dequantize(start, stop, torch.empty(stop - start))
        v = v8.dequantize(start, stop, torch.empty(stop - start))
        adamw(p[start:stop], g[start:stop], m, v, step)
        m8.quantize(start, stop, m)
        v8.quantize(start, stop, v)


def adamw8bit(p):
    """bitsandbytes' AdamW8bit on the CPU: blockwise (256), and 8-bit for every size (min_8bit_size=0;
    its default 4096 would keep small tensors in fp32)."""
    return bnb().optim.AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=0)


@pytest.mark.parametrize("adamw", [adamw_like_bitsandbytes, fused_adamw])
def test_one_step_from_adamw8bit_state_equals_adamw8bit(adamw):
    """Teacher-forced: each step starts both from AdamW8bit's parameters and state, so the two see
    the same dequantized moments. Same dequantize, same AdamW order: the same parameters, bit for
    bit, and the new codes are the reference quantizer's codes of the new fp32 moments (AdamW8bit's
    own are its coarser grid's). Fused AdamW forms m by lerp, m + (1 - b1)(g - m), not b1 m +
    (1 - b1) g: m differs by at most 2^-22 (|m| + |g|), the step by lr / (c1 denom) times that, plus
    2^-21 of the step and 2 ulps of the parameter for the other roundings."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, generator=g))
    optimizer = adamw8bit(p)
    m8, v8 = Moment8(N, True), Moment8(N, False)
    for step in range(1, STEPS + 1):
        grad = torch.randn(N, generator=g) * torch.rand(N, generator=g) ** 4  # gradients over decades
        if step > 1:
            state = optimizer.state[p]
            for moment, k in ((m8, "1"), (v8, "2")):
                moment.codes.copy_(state["state" + k])
                moment.absmax.copy_(state["absmax" + k])
        m, v = m8.dequantize(0, N, torch.empty(N)), v8.dequantize(0, N, torch.empty(N))
        before, mine, plain = m.clone(), p.detach().clone(), p.detach().clone()
        adamw_like_bitsandbytes(plain, grad, m, v, step)  # the fp32 moments AdamW8bit computes
        step_8bit(mine, grad, m8, v8, step, adamw)
        p.grad = grad.clone()
        optimizer.step()
        theirs = p.detach()
        assert torch.equal(plain, theirs), step  # (the test's own AdamW is AdamW8bit's, to the bit)
        if adamw is adamw_like_bitsandbytes:
            assert torch.equal(mine, theirs), step
            assert torch.equal(m8.codes, reference_codes(m, m8.code))
            assert torch.equal(v8.codes, reference_codes(v, v8.code))
        else:
            b1, b2 = BETAS
            denom = (1 - b1**step) * (v.double().sqrt() / math.sqrt(1 - b2**step) + EPS)
            update = LR * m.double().abs() / denom
            lerp = LR * 2**-22 * (before.double().abs() + grad.double().abs()) / denom
            ulps = 2 * torch.finfo(torch.float32).eps * theirs.double().abs()
            assert ((mine.double() - theirs.double()).abs() <= lerp + 2**-21 * update + ulps).all(), step


def test_twenty_free_steps_stay_within_the_derived_bound_of_adamw8bit():
    """Each runs on its own state for 20 steps. Gradients share one magnitude within a block (random
    signs, magnitudes over decades across blocks and steps), so v is equal across each block,
    quantizes exactly (code 1.0) in both, and the parameters differ only through m:

      m_t = b1 * q(m_{t-1}) + (1 - b1) g_t,     |q(m) - m| <= h * absmax(m's block)
      D_t = b1 * (D_{t-1} + h_mine * absmax_mine_{t-1} + h_bnb * absmax_bnb_{t-1}),  D_1 = 0
      |p_mine - p_bnb| <= sum_t lr * D_t / ((1 - b1^t) * (sqrt(v_t) / sqrt(1 - b2^t) + eps))

    with h_mine half the largest gap of the signed map and h_bnb one grid step more (its native
    quantizer, bound tested above), plus fp32 rounding of the weight decay and the update."""
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(N, generator=g))
    mine = p.detach().clone()
    optimizer = adamw8bit(p)
    m8, v8 = Moment8(N, True), Moment8(N, False)
    h_mine = worst_error(m8.code)
    h_bnb = h_mine + LUT_STEP
    blocks = -(-N // BLOCK)
    drift, bound, v = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64), None
    absmax_mine = absmax_bnb = torch.zeros(N, dtype=torch.float64)
    for step in range(1, STEPS + 1):
        magnitude = (10 ** (3 * torch.rand(blocks, generator=g) - 3)).repeat_interleave(BLOCK)[:N]
        grad = magnitude * (torch.rand(N, generator=g) - 0.5).sign()
        step_8bit(mine, grad, m8, v8, step, adamw_like_bitsandbytes)
        p.grad = grad.clone()
        optimizer.step()
        state = optimizer.state[p]
        v = v8.dequantize(0, N, torch.empty(N)).double()
        theirs_v = native_dequantize(state["state2"], state["absmax2"], v8.code).double()
        assert torch.allclose(theirs_v, v, rtol=1e-6, atol=0)  # v: the same in both, as derived
        b1, b2 = BETAS
        drift = b1 * (drift + h_mine * absmax_mine + h_bnb * absmax_bnb)
        bound += LR * drift / ((1 - b1**step) * (v.sqrt() / math.sqrt(1 - b2**step) + EPS))
        absmax_mine = m8.absmax.double().repeat_interleave(BLOCK)[:N]
        absmax_bnb = state["absmax1"].double().repeat_interleave(BLOCK)[:N]
    rounding = STEPS * 2 * torch.finfo(torch.float32).eps * (p.detach().abs().double() + LR)
    difference = (mine.double() - p.detach().double()).abs()
    assert (difference <= bound + rounding).all()
    assert difference.max() > 0  # the two quantizers did differ: the bound was exercised
