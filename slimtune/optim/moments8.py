"""Blockwise dynamic 8-bit AdamW moments: one byte a number instead of four, as bitsandbytes'
AdamW8bit keeps them.

A moment of n numbers is n uint8 codes into a 256-entry map of values in [-1, 1] (bitsandbytes'
dynamic map: signed for the first moment m, unsigned for the second v) and one fp32 absmax per block
of 256 numbers. A number is code[c] * absmax of its block. The host optimizer dequantizes a tile into
fp32, runs AdamW on it and quantizes it back: a fresh absmax per block (the largest |value|) and, for
each number, the code nearest to value / absmax.

Nearest, exactly: the code index is the number of midpoints (code[i] + code[i+1]) / 2 (fp32) that
lie strictly below value * (1 / absmax), so a value exactly on a midpoint takes the lower code. That
is bitsandbytes' own reference rule (its pure-torch kernel: bucketize on those midpoints; its CUDA
kernel searches to the same midpoints, ties aside), and the tests hold this file to it bit for bit.
bitsandbytes 0.50's native CPU quantizer is not used: it looks codes up on a grid of 65536 points
over [-1, 1], which cannot tell the dynamic map's codes apart near zero (they are 3e-7 apart, the
grid 3e-5): on numbers spread over six decades a third of its codes are not the nearest one, and an
exact 0 in a block of m becomes +2.1e-5 * absmax. Its dequantization is exact, and this file's
equals it bit for bit.

The lookup is a table, not a search: the top 16 bits of an fp32 number (sign, exponent, 7 bits of
mantissa) name a bucket that holds at most one midpoint of either map (checked when the table is
built), so the code is the bucket's base code plus one if the number lies above the bucket's
midpoint: two gathers and a compare. On one thread of this project's CPUs (AMD EPYC, AVX2), 2^20
numbers in tiles of 65536: quantize 2.6 ns a number, dequantize 0.9; bitsandbytes' native CPU
kernels 7.5 and 0.7; torch.bucketize on the midpoints 33.

Non-finite numbers do not survive: a block holding inf or NaN comes back NaN (and inf) throughout.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from slimtune.device import runtime

BLOCK = 256  # numbers per absmax, as bitsandbytes' 8-bit optimizers use
CODES = 256
KEY_SHIFT = 16  # an fp32 number's bucket is its top 32 - 16 bits
KEYS = 1 << (32 - KEY_SHIFT)
CHUNK = 1 << 16  # numbers quantized at once: longer ranges go in pieces, so scratch stays 0.8 MiB

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' `create_dynamic_map(signed)` (7 exponent bits, 8 bits in all), built the same
    way so that it is the same to the bit without importing bitsandbytes (2 s). Sorted, 256 fp32
    values from -0.99297 (signed) or 0 (unsigned) to 1. Each decade 10^-6 .. 10^0 holds a linear run
    of values whose length doubles with the decade: fine steps near zero, coarse ones near 1."""
    return _tables(signed)[0]


def zero_code(signed: bool) -> int:
    """The index of the map's one exact 0.0 (127 in the signed map, 0 in the unsigned one)."""
    return _tables(signed)[3]


@functools.cache
def _tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(map, base codes by bucket, midpoint by bucket, zero's code), made once and outside any
    dispatch mode: a moment made under the planner's fake tensors or the memory meter gets real,
    uncounted tables."""
    with _disable_current_modes():
        code = _build_map(signed)
        (zero,) = (code == 0).nonzero().flatten().tolist()
        return (code, *_lookup(code), zero)


def _build_map(signed: bool) -> torch.Tensor:
    data: list[float] = []
    for i in range(7):
        items = 2 ** (i if signed else i + 1) + 1  # signed: 127 a sign; unsigned: 254
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += (10 ** (i - 6) * means).tolist()
        if signed:
            data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == CODES
    return torch.tensor(sorted(data), dtype=torch.float32)


def _lookup(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base codes (KEYS,) uint8, the midpoint in the bucket or +inf (KEYS,) fp32).

    Bucket k holds the fp32 numbers whose top 16 bits are k: an interval [a, b] in value order.
    base = the number of midpoints below a; the bucket's midpoint (if any) decides the +1."""
    mid = (code[:-1] + code[1:]) / 2
    keys = torch.arange(KEYS, dtype=torch.int64)
    first = _as_float(keys << KEY_SHIFT)
    last = _as_float((keys << KEY_SHIFT) | ((1 << KEY_SHIFT) - 1))
    low, high = torch.minimum(first, last), torch.maximum(first, last)
    base = torch.searchsorted(mid, low, side="left")
    inside = torch.searchsorted(mid, high, side="right") - base
    nan = low.isnan() | high.isnan()
    base[nan], inside[nan] = CODES - 1, 0  # NaN: the top code, where bucketize puts it
    assert int(inside.max()) <= 1, "a bucket holds two midpoints: use more key bits"
    midpoint = torch.full((KEYS,), math.inf)
    midpoint[inside == 1] = mid[base[inside == 1]]
    return base.to(torch.uint8), midpoint


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2^32) -> the fp32 numbers they spell."""
    signed32 = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return signed32.to(torch.int32).view(torch.float32)


class _Tiles:
    """Working views for quantizing (rows, width) numbers, cut from a thread's scratch."""

    def __init__(self, held: dict[str, torch.Tensor], rows: int, width: int):
        n = rows * width
        self.scaled = held["scaled"][:n].view(rows, width)
        self.flat = self.scaled.view(-1)
        self.bits = self.flat.view(torch.int32)
        self.inverse = held["inverse"][:rows]
        self.key = held["key"][:n]
        self.midpoint = held["midpoint"][:n]
        self.above = held["above"][:n]


class _Scratch(threading.local):
    """Working tiles for the thread quantizing, grown to the largest piece seen (CHUNK numbers at
    most) and kept: no allocation per tile, and host-resident, so no device meter counts them (13
    bytes a number: 0.8 MiB a thread). The views for each tile shape are kept too: a 64K tile is quantized in
    about 12 torch calls, and making their views anew each time cost a fifth as much as the
    arithmetic."""

    DTYPES = {"scaled": torch.float32, "inverse": torch.float32, "key": torch.int32,
              "midpoint": torch.float32, "above": torch.bool}

    def tiles(self, rows: int, width: int) -> _Tiles:
        state = self.__dict__
        if rows * width > state.get("numel", -1):
            numel = rows * width
            state["held"] = {name: runtime.host_empty((numel,), dtype, None, pinned=False)
                             for name, dtype in self.DTYPES.items()}
            state["numel"], state["shapes"] = numel, {}
        shapes = state["shapes"]
        if (rows, width) not in shapes:
            shapes[rows, width] = _Tiles(state["held"], rows, width)
        return shapes[rows, width]


_SCRATCH = _Scratch()


def quantize_rows(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """values (blocks, width) fp32 -> codes (blocks, width) uint8 and absmax (blocks,), in place."""
    _, base, midpoint, _ = _tables(signed)
    shift, mask, tiny = _constants()
    tiles = _SCRATCH.tiles(*values.shape)
    torch.amax(torch.abs(values, out=tiles.scaled), dim=1, out=absmax)
    # bitsandbytes scales by a reciprocal and keeps an all-zero block's codes at the map's zero
    # (1e-38: 0 * 1e38 = 0). A scaled value can pass +-1 by an ulp; its bucket's base is the end code.
    torch.maximum(absmax, tiny, out=tiles.inverse).reciprocal_()
    torch.mul(values, tiles.inverse[:, None], out=tiles.scaled)
    torch.bitwise_right_shift(tiles.bits, shift, out=tiles.key)
    torch.bitwise_and(tiles.key, mask, out=tiles.key)  # the shift kept the sign: an unsigned key
    flat_codes = codes.view(-1)
    torch.index_select(base, 0, tiles.key, out=flat_codes)
    torch.index_select(midpoint, 0, tiles.key, out=tiles.midpoint)
    flat_codes.add_(torch.gt(tiles.flat, tiles.midpoint, out=tiles.above))


@functools.cache
def _constants() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key's shift and mask and the smallest absmax divided by, as 0-dim tensors: a Python
    number costs each call about 6 us of wrapping, a third of a 64K tile's arithmetic."""
    with _disable_current_modes():
        return (torch.tensor(KEY_SHIFT, dtype=torch.int32), torch.tensor(KEYS - 1, dtype=torch.int32),
                torch.tensor(1e-38, dtype=torch.float32))


def dequantize_rows(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, out: torch.Tensor) -> None:
    """codes (blocks, width) uint8 -> out (blocks, width) fp32: code[c] * absmax of the block."""
    index = _SCRATCH.tiles(*codes.shape).key.copy_(codes.view(-1))
    torch.index_select(code, 0, index, out=out.view(-1))
    out.mul_(absmax[:, None])


class Moment8:
    """One 8-bit AdamW moment of `numel` numbers: `codes` (uint8, numel), `absmax` (fp32, one per
    block of 256), `signed` (m) or not (v), and `code`, the 256-entry map. `alloc(shape, dtype)`
    places the two tensors (host RAM, a memory-mapped file); by default plain CPU tensors. A new
    moment is all zeros. Tiles are read and written in place, [start, stop) with start a multiple
    of 256 and stop a multiple of 256 or numel, so a block never straddles two tiles."""

    def __init__(self, numel: int, signed: bool, alloc: Alloc | None = None):
        alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self.numel, self.signed = numel, signed
        self.code = dynamic_map(signed)
        self.codes = alloc((numel,), torch.uint8)
        self.absmax = alloc((-(-numel // BLOCK),), torch.float32)
        self.codes.fill_(zero_code(signed))
        self.absmax.zero_()

    def dequantize(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Numbers [start, stop) as fp32 into `out` (stop - start numbers); returns out."""
        self._check(start, stop, out)
        for codes, absmax, rows in self._rows(start, stop, out):
            dequantize_rows(codes, absmax, self.code, rows)
        return out

    def quantize(self, start: int, stop: int, values: torch.Tensor) -> None:
        """Stores the fp32 `values` of [start, stop): a fresh absmax per block, nearest codes."""
        self._check(start, stop, values)
        for codes, absmax, rows in self._rows(start, stop, values):
            quantize_rows(rows, codes, absmax, self.signed)

    def nbytes(self) -> int:
        """Bytes held: the codes and the absmax (the map is shared)."""
        return self.codes.numel() + 4 * self.absmax.numel()

    def _check(self, start: int, stop: int, tile: torch.Tensor) -> None:
        aligned = start % BLOCK == 0 and (stop % BLOCK == 0 or stop == self.numel)
        if not (aligned and 0 <= start <= stop <= self.numel):
            raise ValueError(f"tile [{start}, {stop}) of a {self.numel}-number moment is not aligned "
                             f"to blocks of {BLOCK}")
        if tile.shape != (stop - start,) or tile.dtype != torch.float32 or not tile.is_contiguous():
            raise ValueError(f"tile must be contiguous fp32 of shape ({stop - start},), "
                             f"got {tuple(tile.shape)} {tile.dtype}")

    def _rows(self, start: int, stop: int, tile: torch.Tensor):
        """(codes, absmax, tile) as (blocks, 256) views of at most CHUNK numbers (the scratch stays
        small and in cache whatever the range), then the last partial block as (1, rest)."""
        full = (stop - start) // BLOCK * BLOCK
        for offset in range(0, full, CHUNK):
            size = min(CHUNK, full - offset)
            first = (start + offset) // BLOCK
            yield (self.codes[start + offset : start + offset + size].view(-1, BLOCK),
                   self.absmax[first : first + size // BLOCK], tile[offset : offset + size].view(-1, BLOCK))
        if full < stop - start:
            last = (start + full) // BLOCK
            yield self.codes[start + full : stop].view(1, -1), self.absmax[last : last + 1], tile[full:].view(1, -1)
