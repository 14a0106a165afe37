"""The split master (split_master.py) against its rule, bit for bit, where rounding is hardest: both
sides of every binade boundary, all 65,536 low halves under chosen weights, every weight's ties,
subnormals, +-0, the largest finite values, +-inf and NaNs, then 10^7 random patterns.

The oracle is plain integer arithmetic in int64 (no overflow possible): the weight is torch's
`master.to(torch.bfloat16)` and also the textbook round to nearest even on the pattern; the residual is
bits(master) - (bits(weight) << 16), clamped; the only values that do not come back are the upper ties
of even weights (low 16 bits 0x8000 under an even top half), and they come back one ulp lower."""

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from slimtune.optim import split_master

INF_BITS = 0x7F800000  # +inf; a magnitude above it is a NaN
SIGN = 1 << 31


def as_floats(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values with these patterns (int64 in [0, 2^32))."""
    return torch.where(bits >= SIGN, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def patterns(floats: torch.Tensor) -> torch.Tensor:
    """The fp32 patterns of floats as int64 in [0, 2^32)."""
    return floats.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int16: torch.int16}
    return torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def nearest_even(bits: torch.Tensor) -> torch.Tensor:
    """bf16 patterns (int64 in [0, 2^16)) of fp32 patterns rounded to nearest, ties to even, on the
    magnitude; an independent oracle for what torch's conversion does (non-NaN only)."""
    sign, magnitude = bits & SIGN, bits & (SIGN - 1)
    rounded = (magnitude + 0x7FFF + ((magnitude >> 16) & 1)) >> 16
    return (sign >> 16) | rounded


def split_of(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    residual = torch.empty(master.shape, dtype=torch.int16)
    split_master.split(master, weight, residual)
    return weight, residual


def check_round_trip(bits: torch.Tensor) -> int:
    """Every claim of the rule for these non-NaN fp32 patterns (int64); returns how many were ties."""
    assert bool((bits & (SIGN - 1)).le(INF_BITS).all()), "the oracle is for non-NaN patterns"
    master = as_floats(bits)
    weight, residual = split_of(master)
    weight_bits = weight.view(torch.int16).to(torch.int64)
    assert same_bits(weight, master.to(torch.bfloat16))
    assert torch.equal(weight_bits & 0xFFFF, nearest_even(bits))
    signed = master.view(torch.int32).to(torch.int64)
    exact = signed - weight_bits * 65536
    assert bool(exact.ge(-32768).all()) and bool(exact.le(32768).all())
    assert torch.equal(residual.to(torch.int64), exact.clamp(max=32767))
    ties = exact == 32768
    assert torch.equal(ties, (bits & 0x1FFFF) == 0x8000), "ties are exactly the upper ties of even weights"
    back = split_master.combined(weight, residual)
    assert torch.equal(back.view(torch.int32).to(torch.int64), signed - ties.to(torch.int64))
    assert same_bits(back.to(torch.bfloat16), weight)
    return int(ties.sum())


@pytest.mark.quick
def test_all_low_halves_under_chosen_weights():
    """All 65,536 low halves under even and odd weights, both signs, +-0, subnormal, normal and top:
    one tie under each even weight (low half 0x8000), none under odd ones."""
    lows = torch.arange(1 << 16, dtype=torch.int64)
    highs = (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x4B7F, 0x7F7E, 0xFF7E)
    for high in highs:
        assert check_round_trip((high << 16) | lows) == (1 if high % 2 == 0 else 0)


def test_both_sides_of_every_binade_boundary():
    """Every pattern within 40,000 of each exponent's first pattern (more than a bf16 ulp either side,
    where rounding carries into the exponent), exponents 0..255 (255: up to +-inf), both signs."""
    offsets = torch.arange(-40000, 40001, dtype=torch.int64)
    for first in range(0, 256, 16):
        starts = torch.arange(first, first + 16, dtype=torch.int64) << 23
        magnitudes = (starts[:, None] + offsets).reshape(-1)
        magnitudes = magnitudes[(magnitudes >= 0) & (magnitudes <= INF_BITS)]
        ties = check_round_trip(torch.cat([magnitudes, magnitudes | SIGN]))
        assert ties > 0


def test_ties_and_near_ties_under_every_weight():
    """Low halves at and beside each tie, and at the ends, under every non-NaN top half: exactly the
    upper tie of an even weight comes back one ulp lower."""
    highs = torch.arange(1 << 16, dtype=torch.int64)
    highs = highs[(highs & 0x7FFF) < 0x7F80]  # below the infinities: any low half above is finite
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((highs[:, None] << 16) | lows).reshape(-1)
    assert check_round_trip(bits) == int((highs % 2 == 0).sum())


def test_subnormals_and_the_boundary_to_the_normals():
    """Every 7th subnormal pattern (7 is odd, so every low half is met), both signs, and all of them
    within 2^17 of the smallest normal."""
    sampled = torch.arange(0, 0x00800000, 7, dtype=torch.int64)
    boundary = torch.arange(0x00800000 - (1 << 17), 0x00800000 + (1 << 17), dtype=torch.int64)
    for magnitudes in (sampled, boundary):
        assert check_round_trip(torch.cat([magnitudes, magnitudes | SIGN])) > 0


def test_zeros_keep_their_sign():
    master = torch.tensor([0.0, -0.0])
    weight, residual = split_of(master)
    assert weight.view(torch.int16).tolist() == [0, -32768] and residual.tolist() == [0, 0]
    back = split_master.combined(weight, residual)
    assert torch.equal(back.view(torch.int32), master.view(torch.int32))


def test_the_largest_finite_values_round_to_inf_and_still_come_back():
    """0x7F7F0000..0x7F7FFFFF, both signs: from the tie 0x7F7F8000 up the weight is +-inf (as
    master.to(bfloat16) uploads it), the residual negative, the round trip exact."""
    magnitudes = torch.arange(0x7F7F0000, 0x7F800000, dtype=torch.int64)
    bits = torch.cat([magnitudes, magnitudes | SIGN])
    assert check_round_trip(bits) == 0  # 0x7F7F is odd: its ties go to the infinities
    weight, residual = split_of(as_floats(bits))
    to_inf = (bits & (SIGN - 1)) >= 0x7F7F8000
    assert torch.equal(torch.isinf(weight), to_inf)
    assert bool(residual[to_inf].lt(0).all()) and bool(residual[to_inf].ge(-32768).all())
    assert float(as_floats(torch.tensor([0x7F7F8000]))) == 2.0**128 - 2.0**119


def test_infinities_come_back_with_residual_zero():
    master = torch.tensor([float("inf"), float("-inf")])
    weight, residual = split_of(master)
    assert torch.equal(weight.float(), master) and residual.tolist() == [0, 0]
    assert torch.equal(split_master.combined(weight, residual).view(torch.int32), master.view(torch.int32))


def nan_patterns() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    payloads = torch.cat([torch.tensor([1, 0x400000, 0x3FFFFF, 0x7FFFFF, 0x7F8000, 0x8000]),
                          torch.randint(1, 0x800000, (1000,), generator=g)])
    magnitudes = INF_BITS + payloads
    return torch.cat([magnitudes, magnitudes | SIGN])


def test_nan_comes_back_as_nan():
    """Quiet and signalling NaNs of both signs, through torch's vector path (a long tensor) and its
    scalar one (0-d and strided tensors)."""
    bits = nan_patterns()
    long = as_floats(bits)
    for master in [long, long.repeat(3)[::3], *long[:8].unbind()]:
        weight, residual = split_of(master)
        assert bool(torch.isnan(weight).all()) and bool(torch.isnan(master.to(torch.bfloat16)).all())
        assert bool(torch.isnan(split_master.combined(weight, residual)).all())


def test_every_nan_weight_with_any_residual_combines_to_nan():
    """Whatever residual a NaN master leaves, its weight keeps the combined value a NaN."""
    tops = torch.arange(1 << 16, dtype=torch.int64)
    tops = tops[(tops & 0x7FFF) > 0x7F80]
    residuals = torch.arange(-32768, 32768, dtype=torch.int64).to(torch.int16)
    for top in tops.tolist():
        weight = torch.full((1 << 16,), top - (1 << 16) if top >= 1 << 15 else top, dtype=torch.int16)
        assert bool(torch.isnan(split_master.combined(weight.view(torch.bfloat16), residuals)).all())


def test_views_and_strides_agree_with_contiguous_tensors():
    """Outputs that are slices of larger buffers, and transposed (strided) tensors, give the same bits
    as contiguous ones; a length off the chunk size covers the last, short chunk."""
    g = torch.Generator().manual_seed(1)
    n = 3 * split_master.CHUNK + 5
    master = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g)
    weight, residual = split_of(master)
    back = split_master.combined(weight, residual)
    weights, residuals = torch.zeros(n + 7, dtype=torch.bfloat16), torch.zeros(n + 7, dtype=torch.int16)
    split_master.split(master, weights[7:], residuals[7:])
    assert same_bits(weights[7:], weight) and same_bits(residuals[7:], residual)
    assert same_bits(split_master.combined(weights[7:], residuals[7:]), back)

    def grid(flat: torch.Tensor) -> torch.Tensor:
        return flat[: 300 * 400].view(300, 400)

    strided_weight = torch.empty(400, 300, dtype=torch.bfloat16).t()
    strided_residual = torch.empty(400, 300, dtype=torch.int16).t()
    split_master.split(grid(master).t().contiguous().t(), strided_weight, strided_residual)
    assert same_bits(strided_weight, grid(weight)) and same_bits(strided_residual, grid(residual))
    out = torch.empty(400, 300).t()
    split_master.combine(strided_weight, strided_residual, out)
    assert same_bits(out, grid(back))


def test_threads_and_fake_tensors_get_scratch_of_their_own():
    """Two threads splitting and combining at once get the bits one thread gets (each thread has its
    own scratch); under the planner's FakeTensorMode both run on fake tensors without real scratch."""
    g = torch.Generator().manual_seed(2)
    masters = [torch.randn(split_master.CHUNK, generator=g) for _ in range(2)]
    expected = [split_of(m) for m in masters]

    def repeat(k: int, errors: list) -> None:
        for _ in range(40):
            weight, residual = split_of(masters[k])
            back = split_master.combined(weight, residual)
            if not (torch.equal(residual, expected[k][1]) and torch.equal(back.to(torch.bfloat16), weight)):
                errors.append(k)

    errors: list = []
    workers = [threading.Thread(target=repeat, args=(k, errors)) for k in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    with FakeTensorMode():
        master = torch.empty(3, split_master.CHUNK + 1)
        weight, residual = split_of(master)
        assert is_fake(weight) and is_fake(split_master.combined(weight, residual))


def test_wrong_dtypes_and_shapes_are_refused():
    master = torch.zeros(4)
    with pytest.raises(TypeError, match="weight_out"):
        split_master.split(master, torch.empty(4, dtype=torch.float16), torch.empty(4, dtype=torch.int16))
    with pytest.raises(ValueError, match="residual_out"):
        split_master.split(master, torch.empty(4, dtype=torch.bfloat16), torch.empty(5, dtype=torch.int16))


def test_ten_million_random_patterns_round_trip():
    """10^7 seeded random non-NaN patterns, a million at a time: identical except the upper ties of
    even weights (about one in 2^17), which come back one ulp lower."""
    g = torch.Generator().manual_seed(30)
    seen, ties = 0, 0
    while seen < 10**7:
        bits = torch.randint(0, 1 << 32, (10**6,), generator=g, dtype=torch.int64)
        bits = bits[(bits & (SIGN - 1)) <= INF_BITS][: 10**7 - seen]
        ties += check_round_trip(bits)
        seen += bits.numel()
    assert seen == 10**7 and 20 < ties < 200  # 10^7 / 2^17 = 76 expected
