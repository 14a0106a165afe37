"""An fp32 master kept as the bf16 weight that goes up to the device plus a 16-bit residual.

A host optimizer used to hold each fp32 master (4 bytes) and, beside it, the bf16 copy it uploads
(2 bytes). The bf16 copy is the top of the master, rounded, so the pair says the same thing twice.
`split` keeps the bf16 weight and the 16-bit difference of the bit patterns instead (2 + 2 bytes),
and `combine` rebuilds the fp32 master from them:

    weight   = master.to(torch.bfloat16)                   round to nearest even: what went up before
    residual = bits(master) - (bits(weight) << 16)         in int32, then clamped to [-32768, 32767]
    master   = float32 of (bits(weight) << 16) + residual  (combine)

`bits` reads a float's pattern as a signed integer (fp32 as int32, bf16 as int16). Widening the
bf16 pattern to int32 before the shift keeps the sign right: -32768 * 65536 is -2^31.

The rule, and the one place the split is not lossless. Rounding to nearest puts the master within half
a bf16 ulp of its weight, so the residual lies in [-32768, 32768]. For a weight whose last bit is even,
both ties round to it: 65,537 fp32 patterns share it, one more than 16 bits can name (information
theory, not a choice). The residual is clamped, so the single pattern exactly half a bf16 ulp ABOVE an
even weight (residual +32768) is kept as its fp32 neighbour one ulp toward the weight (residual 32767).
That neighbour rounds to the same weight, so what goes up to the device is unchanged; the master moves
by one fp32 ulp (2^-24 to 2^-23 of a normal value; 2^-149 among the subnormals), which happens with
probability 2^-17 for uniformly random low bits. Every other finite value comes back bit for bit,
-0 with its sign, subnormals too.

Values at the top. Finite masters of magnitude at or above 2^128 - 2^119 (the tie between the largest
bf16, 3.3895e38, and infinity) round to an infinite weight, as the upload did before; their residual
is negative and in range (-32768 .. -1), so they still come back exactly. +-inf come back as they
were (residual 0).

NaN. A NaN master comes back as a NaN; its sign and payload are not kept. torch writes a bf16 NaN as
0xFFFF on its vector path and 0x7FC0 on its scalar one, so the residual of a NaN is not fixed (0, 32767,
or whatever the int32 difference wraps to, two's complement as torch's integer kernels wrap, then
clamped); any bf16 NaN weight with any residual combines to a NaN, because a residual can neither
reach the exponent bits nor empty the mantissa. Only a NaN master can make that difference overflow.

Both functions work a chunk at a time over contiguous tensors, so split's int32 scratch stays small
and in the cache (combine needs none: bf16 -> fp32 is exact, and the residual is added to the pattern
in place); the callers' tiles (tiled_adamw.TILE numbers) fit in one chunk. Strided tensors (views
that are not contiguous) work too, in one piece.
"""

from __future__ import annotations

import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor

from slimtune.device import runtime

CHUNK = 1 << 16  # numbers a pass: 256 KiB of int32 scratch, beside the chunk's own 512 KiB, fits in L2
SHIFT = 1 << 16  # a bf16 pattern times this is the top half of an fp32 pattern
LOWEST, HIGHEST = -(1 << 15), (1 << 15) - 1  # what an int16 residual can hold


@torch.no_grad()
def split(master: torch.Tensor, weight_out: torch.Tensor, residual_out: torch.Tensor) -> None:
    """Write master's bf16 weight into weight_out and its 16-bit residual into residual_out (same
    shape; either may be a view into a larger buffer, neither may overlap master). See the module's
    docstring for the rule."""
    _require(master, torch.float32, "master")
    _require(weight_out, torch.bfloat16, "weight_out", master.shape)
    _require(residual_out, torch.int16, "residual_out", master.shape)
    for m, w, r, scratch in _pieces(master, weight_out, residual_out):
        w.copy_(m)
        scratch.copy_(w.view(torch.int16))  # widened, so times 65536 cannot overflow
        torch.sub(m.view(torch.int32), scratch, alpha=SHIFT, out=scratch)
        r.copy_(scratch.clamp_(LOWEST, HIGHEST))  # +32768 (the even weight's upper tie) becomes 32767


@torch.no_grad()
def combine(weight: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
    """Write into out (fp32, same shape) the master that split turned into (weight, residual)."""
    _require(weight, torch.bfloat16, "weight")
    _require(residual, torch.int16, "residual", weight.shape)
    _require(out, torch.float32, "out", weight.shape)
    for w, r, o in zip(*_flat_pieces(weight, residual, out)):
        o.copy_(w)  # bf16 -> fp32 is exact: the weight's pattern in the top half, zeros below (NaNs too)
        o.view(torch.int32).add_(r)  # sign-extended: a negative residual borrows from the top half, as it should


def combined(weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The fp32 master that split turned into (weight, residual), as a new tensor."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    combine(weight, residual, out)
    return out


class _Scratch(threading.local):
    """Each thread's int32 scratch of CHUNK numbers, made once (a tile's split or combine costs tens of
    microseconds, and making host memory costs about ten more). Host memory, which the device meter
    skips. The planner's fake tensors, and strided tensors larger than a chunk, get scratch of their own."""

    held: torch.Tensor | None = None

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if numel > CHUNK or isinstance(like, FakeTensor):
            return runtime.host_empty((numel,), torch.int32, None, pinned=False)
        if self.held is None:
            self.held = runtime.host_empty((CHUNK,), torch.int32, None, pinned=False)
        return self.held[:numel]


_SCRATCH = _Scratch()


def _flat_pieces(*tensors: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each tensor's pieces: CHUNK numbers at a time when all are contiguous and longer than that, else
    the whole tensor (an elementwise pass needs only equal shapes; a tile takes no views this way)."""
    numel = tensors[0].numel()
    if numel <= CHUNK or not all(t.is_contiguous() for t in tensors):
        return [[t] for t in tensors]
    return [[t.view(-1)[start:start + CHUNK] for start in range(0, numel, CHUNK)] for t in tensors]


def _pieces(*tensors: torch.Tensor):
    """(the tensors' pieces..., int32 scratch of the pieces' shape), as _flat_pieces cuts them."""
    for pieces in zip(*_flat_pieces(*tensors)):
        yield (*pieces, _SCRATCH.take(pieces[0].numel(), tensors[0]).view(pieces[0].shape))


def _require(t: torch.Tensor, dtype: torch.dtype, name: str, shape: torch.Size | None = None) -> None:
    if t.dtype != dtype:
        raise TypeError(f"split_master: {name} must be {dtype}, not {t.dtype}.")
    if shape is not None and t.shape != shape:
        raise ValueError(f"split_master: {name} has shape {tuple(t.shape)}, not {tuple(shape)}.")
