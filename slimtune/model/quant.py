"""4-bit frozen weights, dequantized just in time for each matmul (peak-memory-lora.md 2.3).

Two schemes share one storage module, QuantWeight, whose state is two registered buffers
(`codes`, `scales`), so `state_dict`, `.to(device)` and `estimate.make_fake` all see it:

  int4  symmetric, per row and per group of `group_size` inputs: s = absmax / 7 stored in
        fp16 (the spec's default; 2 B per group), q = clamp(round(w / s), -8, 7) stored as
        q + 8, two codes per byte, high nibble first. codes (out, ceil(in/2)) uint8,
        scales (out, ceil(in/g)) fp16.
  nf4   bitsandbytes' NF4 codebook in blocks of 64 over the flattened weight, fp32 absmax,
        no double quantization. codes (ceil(n/2), 1) uint8, scales (ceil(n/64),) fp32.
        Quantization and matrix dequantization are bitsandbytes' own ops; on fake tensors the
        planner makes the empty result their fake kernel would, without importing bitsandbytes. Row gathers (the
        embedding) use a plain-torch codebook lookup that matches bitsandbytes bit for bit.

Autograd saves the codes and scales, never a dequantized weight (spec pitfall 4): backward
dequantizes again for dx = dy @ W, and the frozen base gets no weight gradient. Both matmuls
run over tiles of output rows (DEQUANT_TILE_ELEMENTS, 32 MiB in fp32), so only one tile of W is dense at a time:
an MLP weight of a 3B model is 96 MiB dense in fp32, which would otherwise outweigh the
activations of a token-chunked, checkpointed block.

Compute dtype: x's dtype, or the autocast dtype when autocast is on for x's device. A
custom autograd Function is not on autocast's op list, so the input is cast explicitly
(as F.linear under autocast would be) and every matmul inside sees equal dtypes.

Order: quant.apply runs before lora.apply; LoRALinear wraps a QuantLinear like a linear.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slimtune.device import memory
from slimtune.config import QuantConfig
from slimtune.errors import UserError

BLOCKS_PREFIX = "model.layers."
NF4_BLOCK = 64
# bitsandbytes' NF4 table (get_4bit_type("nf4")), copied so row gathers need no bnb call.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
DEQUANT_TILE_ELEMENTS = 1 << 23  # dense elements of W per tile (32 MiB in fp32)
BNB_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # bitsandbytes' 4-bit kernels stop at fp32


@dataclass(frozen=True)
class Layout:
    """How `codes` and `scales` encode a dense (rows, cols) = (out, in) weight."""

    scheme: str  # "int4" | "nf4"
    shape: tuple[int, int]
    group_size: int  # int4: inputs per scale; nf4: NF4_BLOCK (over the flattened weight)


# ---------------------------------------------------------------- int4 packing


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 2k) uint8 in [0, 15], high nibble first (bitsandbytes' order)."""
    return torch.stack((codes >> 4, codes & 15), dim=-1).flatten(-2)


def pack(q: torch.Tensor) -> torch.Tensor:
    """(..., C) integer codes in [-8, 7] -> (..., ceil(C/2)) uint8, two per byte."""
    u = (q + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = F.pad(u, (0, 1), value=8)  # 8 encodes q = 0
    return (u[..., 0::2] << 4) | u[..., 1::2]


def unpack(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of pack: (..., ceil(C/2)) uint8 -> (..., C) int8 in [-8, 7]."""
    return _nibbles(codes)[..., :cols].to(torch.int8) - 8


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to fp16, upwards where rounding went down, so |w| / s <= 7 always holds
    and no code is clamped: |w - q s| <= s / 2 then holds with the stored s."""
    s16 = scale.clamp(max=torch.finfo(torch.float16).max).to(torch.float16)
    low = s16.to(scale.dtype) < scale
    return torch.where(low, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)


def int4_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> codes (rows, ceil(cols/2)) uint8, scales (rows, ceil(cols/g)) fp16."""
    rows, cols = w.shape
    groups = -(-cols // group_size)
    work = w.to(torch.float64 if w.dtype == torch.float64 else torch.float32)  # never divide in 16 bits
    grouped = F.pad(work, (0, groups * group_size - cols)).view(rows, groups, group_size)  # zero pad: absmax unchanged
    scales = _fp16_scale(grouped.abs().amax(dim=-1) / 7)
    divisor = torch.where(scales > 0, scales, 1).to(work.dtype)  # an all-zero group has s = 0 and codes 0
    q = torch.round(grouped / divisor[..., None]).clamp(-8, 7)
    return pack(q.view(rows, -1)[:, :cols]), scales


def _int4_dequantize(codes: torch.Tensor, scales: torch.Tensor, cols: int, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """codes (R, ceil(C/2)), scales (R, G) -> (R, C) in `dtype`, multiplied in `dtype`."""
    q = unpack(codes, cols)
    rows, groups = scales.shape
    padded = groups * group_size
    if padded != cols:
        q = F.pad(q, (0, padded - cols))
    w = q.view(rows, groups, group_size).to(dtype) * scales.to(dtype)[..., None]
    return w.view(rows, padded)[:, :cols]


# ---------------------------------------------------------------- nf4 (bitsandbytes)


def _bitsandbytes():
    """bitsandbytes.functional, imported lazily (optional) and outside any dispatch mode: a
    first import under FakeTensorMode or the memory meter would fake or count its tensors."""
    if "bitsandbytes.functional" not in sys.modules:
        from torch.utils._python_dispatch import _disable_current_modes

        # bitsandbytes warns at import that an optional CPU matmul kernel package is missing; we
        # never call that kernel (we dequantize and use torch's matmul), so the warning is noise.
        cpu_ops_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = cpu_ops_log.level
        cpu_ops_log.setLevel(logging.ERROR)
        with _disable_current_modes():
            try:
                import bitsandbytes.functional  # noqa: F401  (registers torch.ops.bitsandbytes)
            except ImportError:
                raise UserError(
                    "quant.scheme=nf4 needs bitsandbytes (pip install bitsandbytes); or use quant.scheme=int4."
                ) from None
            finally:
                cpu_ops_log.setLevel(level)
    return sys.modules["bitsandbytes.functional"]


def nf4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> codes (ceil(n/2), 1) uint8, absmax (ceil(n/64),) fp32."""
    bnb = _bitsandbytes()
    if w.dtype not in BNB_DTYPES:
        w = w.float()  # fp64 (tests): bitsandbytes quantizes 16/32-bit floats only
    codes, state = bnb.quantize_4bit(w, blocksize=NF4_BLOCK, compress_statistics=False, quant_type="nf4")
    return codes, state.absmax


def _nf4_dequantize(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
                    dtype: torch.dtype) -> torch.Tensor:
    # A flat shape: bitsandbytes 0.50's CPU kernel, given (rows, cols) with cols % 64 != 0,
    # scales each row as if blocks restarted per row, while quantize_4bit blocks the flattened
    # weight. A flat shape dequantizes the blocks quantize_4bit made, on every backend, at the same speed.
    return _nf4_dequantize_flat(codes, absmax, 0, shape[0] * shape[1], dtype).view(shape).to(dtype)


def _nf4_dequantize_flat(codes: torch.Tensor, absmax: torch.Tensor, first: int, last: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of flat elements [first, last) (first on a block), in `dtype`
    where its kernels support it (else fp32: fp32 -> fp64 is exact). On fake tensors (the planner's
    step) this is the empty tensor that bitsandbytes' own fake kernel returns, made without importing
    bitsandbytes (0.8 s a process) or slicing the codes (views: no bytes, but ops)."""
    out_dtype = dtype if dtype in BNB_DTYPES else torch.float32
    if _is_placeholder(codes):
        return torch.empty(last - first, dtype=out_dtype, device=codes.device)
    _bitsandbytes()
    codes, absmax = codes[first // 2 : (last + 1) // 2], absmax[first // NF4_BLOCK : -(-last // NF4_BLOCK)]
    return torch.ops.bitsandbytes.dequantize_4bit(codes, absmax, NF4_BLOCK, "nf4", [last - first], out_dtype)


def _nf4_rows(codes: torch.Tensor, absmax: torch.Tensor, index: torch.Tensor, cols: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` (N,) of the dense weight, (N, cols): codebook[nibble] * absmax[block] in
    fp32, as bitsandbytes computes it. Blocks run over the flattened weight, so a row owns
    whole blocks only when cols % 64 == 0: then the rows' codes and absmax are gathered and
    bitsandbytes dequantizes them (on the device, straight into `dtype`: no codebook sent up and
    no int64 index a number). Otherwise each element finds its own block through the codebook."""
    if cols % NF4_BLOCK == 0:
        picked = codes.view(-1, cols // 2)[index].view(-1, 1)  # (N * cols / 2, 1): quantize_4bit's layout
        scales = absmax.view(-1, cols // NF4_BLOCK)[index].view(-1)  # (N * cols / 64,)
        return _nf4_dequantize_flat(picked, scales, 0, len(index) * cols, dtype).view(len(index), cols).to(dtype)
    nibbles = _nibbles(codes.view(-1, cols // 2)[index])  # (N, cols)
    values = torch.tensor(NF4_TABLE, dtype=torch.float32, device=codes.device)[nibbles.long()]
    element = index[:, None] * cols + torch.arange(cols, device=codes.device)
    return (values * absmax[element // NF4_BLOCK]).to(dtype)


# ---------------------------------------------------------------- one entry point per operation


def dequantize(layout: Layout, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense (out, in) weight in `dtype`."""
    if layout.scheme == "int4":
        return _int4_dequantize(codes, scales, layout.shape[1], layout.group_size, dtype)
    return _nf4_dequantize(codes, scales, layout.shape, dtype)


def row_tiles(layout: Layout) -> list[tuple[int, int]]:
    """[start, stop) ranges of output rows, about DEQUANT_TILE_ELEMENTS each. nf4 blocks run
    over the flattened weight, so an nf4 tile starts where a block starts."""
    rows, cols = layout.shape
    step = max(1, DEQUANT_TILE_ELEMENTS // cols)
    if layout.scheme == "nf4":
        unit = NF4_BLOCK // math.gcd(cols, NF4_BLOCK)  # rows per whole number of blocks
        step = max(unit, step // unit * unit)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def dequantize_row_range(layout: Layout, codes: torch.Tensor, scales: torch.Tensor, start: int, stop: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, stop) of the dense weight, (stop - start, in); for nf4 start * in must be a
    whole number of blocks (row_tiles' ranges are)."""
    rows, cols = layout.shape
    if layout.scheme == "int4":
        return _int4_dequantize(codes[start:stop], scales[start:stop], cols, layout.group_size, dtype)
    first, last = start * cols, stop * cols  # flat element range
    assert first % NF4_BLOCK == 0, "an nf4 tile must start on a block"
    w = _nf4_dequantize_flat(codes, scales, first, last, dtype)
    return w.view(stop - start, cols).to(dtype)


def dequantize_rows(layout: Layout, codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` (any shape) of the dense weight: (*index.shape, in), nothing else dequantized."""
    flat, cols = index.reshape(-1), layout.shape[1]
    if layout.scheme == "int4":
        rows = _int4_dequantize(codes[flat], scales[flat], cols, layout.group_size, dtype)
    else:
        rows = _nf4_rows(codes, scales, flat, cols, dtype)
    return rows.reshape(*index.shape, cols)


def state_shapes(layout: Layout) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of codes and of scales: what a real quantization of `layout` holds."""
    rows, cols = layout.shape
    if layout.scheme == "int4":
        return ((rows, -(-cols // 2)), torch.uint8), ((rows, -(-cols // layout.group_size)), torch.float16)
    n = rows * cols
    return (((n + 1) // 2, 1), torch.uint8), ((-(-n // NF4_BLOCK),), torch.float32)


# ---------------------------------------------------------------- modules


class QuantWeight(nn.Module):
    """A frozen (out, in) weight in 4 bits. A tied embedding and LM head share one instance.

    Its codes and scales are buffers, in the layouts the kernels read (module docstring), until
    hold_as_rows makes them frozen parameters a row per quantization block, for FSDP to shard."""

    def __init__(self, layout: Layout, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.layout = layout
        self.dtype = dtype  # the dense weight's dtype: the default dequantization dtype
        self.as_rows = False
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def hold_as_rows(self) -> None:
        """dist.strategy=fsdp: the codes and scales as frozen parameters (FSDP2 shards parameters, not
        buffers), a row per quantization block (nf4: 32 code bytes and 4 absmax bytes; int4: a weight
        row's codes and its fp16 scales' bytes), so FSDP's dim-0 shards cut both at the same blocks.
        The scales travel as bytes: FSDP's mixed precision casts floating parameters, and an absmax
        gathered in bf16 would move every block's values (2^-9 relative); uint8 is left as it is."""
        if self.as_rows:
            return
        codes, scales = rows_of_blocks(self.layout, self.codes, self.scales)
        del self.codes, self.scales  # the buffers: their storage is the parameters' (views) or freed
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.as_rows = True

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) in the layouts the kernels read, whichever way they are held (views)."""
        if not self.as_rows:
            return self.codes, self.scales
        return kernel_state(self.layout, self.codes, self.scales)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.layout, *self.state(), dtype or self.dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_rows(self.layout, *self.state(), index, dtype or self.dtype)

    def extra_repr(self) -> str:
        return f"scheme={self.layout.scheme}, shape={self.layout.shape}, group_size={self.layout.group_size}"


def rows_of_blocks(layout: Layout, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes and scales a row per quantization block, uint8 both (QuantWeight.hold_as_rows). Views of
    the inputs but where nf4's last block is partial (its codes padded to the block's 32 bytes)."""
    if layout.scheme == "int4":  # already a row per weight row; the fp16 scales as their bytes
        return codes, scales.view(torch.uint8)
    blocks = scales.numel()
    flat = codes.reshape(-1)
    if flat.numel() < blocks * NF4_BLOCK // 2:
        flat = F.pad(flat, (0, blocks * NF4_BLOCK // 2 - flat.numel()))
    return flat.view(blocks, NF4_BLOCK // 2), scales.view(torch.uint8).view(blocks, 4)


def kernel_state(layout: Layout, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows_of_blocks' inverse: the kernels' codes and scales, as views of the (gathered) rows."""
    if layout.scheme == "int4":
        return codes, scales.view(torch.float16)
    (codes_shape, _), _ = state_shapes(layout)
    return codes.reshape(-1)[: codes_shape[0]].view(codes_shape), scales.view(torch.float32).reshape(-1)


def hold_as_rows(model: nn.Module) -> None:
    """Every 4-bit weight of `model` held as parameters a row per block (QuantWeight.hold_as_rows)."""
    for module in model.modules():
        if isinstance(module, QuantWeight):
            module.hold_as_rows()


class _DequantLinear(torch.autograd.Function):
    """y = x @ W^T with W rebuilt from codes in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, layout, codes, scales):
        ctx.layout = layout
        ctx.save_for_backward(codes, scales)  # codes and scales only: never the dense W
        tiles = row_tiles(layout)
        if len(tiles) == 1:
            return F.linear(x, dequantize(layout, codes, scales, x.dtype))
        y = x.new_empty((*x.shape[:-1], layout.shape[0]))
        rows, out = x.reshape(-1, x.shape[-1]), y.view(-1, layout.shape[0])  # 2-D once, not per tile
        for start, stop in memory.representative(tiles, codes, alike_from=0):  # each tile dropped after use
            out[:, start:stop] = rows @ dequantize_row_range(layout, codes, scales, start, stop, x.dtype).T
        return y

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        codes, scales = ctx.saved_tensors
        tiles = row_tiles(ctx.layout)
        if len(tiles) == 1:
            return dy @ dequantize(ctx.layout, codes, scales, dy.dtype), None, None, None
        flat = dy.reshape(-1, dy.shape[-1])  # (n, out)
        dx = flat.new_zeros((flat.shape[0], ctx.layout.shape[1]))  # (n, in)
        for start, stop in memory.representative(tiles, codes, alike_from=0):  # each tile dropped after use
            dx.addmm_(flat[:, start:stop], dequantize_row_range(ctx.layout, codes, scales, start, stop, dy.dtype))
        return dx.view(*dy.shape[:-1], -1), None, None, None  # no weight gradient: the base is frozen


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in: autocast's when it is on for x's device."""
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class QuantLinear(nn.Module):
    """A frozen linear whose weight is a QuantWeight; forward dequantizes just in time."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.layout.shape
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach())
        self.register_parameter("bias", bias)
        if bias is not None:
            bias.requires_grad_(False)

    @property
    def scheme(self) -> str:
        return self.qweight.layout.scheme

    @property
    def weight(self) -> torch.Tensor:
        """The packed codes (uint8), as bitsandbytes' Linear4bit exposes them: code that reads
        `.weight` for a device or a dtype (LoRALinear) gets the right device and a non-float
        dtype, and code that needs dense values must call dequantized_weight()."""
        return self.qweight.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(_compute_dtype(x))  # autograd casts dx back to x's dtype
        y = _DequantLinear.apply(x, self.qweight.layout, *self.qweight.state())
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(out, in) dense weight, in the original weight's dtype unless told otherwise."""
        return self.qweight.dequantize(dtype)

    def weight_tiles(self, dtype: torch.dtype | None = None):
        """Yields (start, stop, rows [start, stop) of W dense in `dtype`), one tile at a time
        (the LM head of the loss: never the whole (V, D) weight at once)."""
        q = self.qweight
        codes, scales = q.state()
        for start, stop in memory.representative(row_tiles(q.layout), codes):
            yield start, stop, dequantize_row_range(q.layout, codes, scales, start, stop, dtype or q.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """A frozen embedding that dequantizes only the rows it looks up."""

    def __init__(self, qweight: QuantWeight, padding_idx: int | None = None):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.layout.shape
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        """The packed codes; the same tensor as a tied QuantLinear head's (Stack.tied holds)."""
        return self.qweight.codes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)  # (*ids.shape, d) in the original dtype, as nn.Embedding

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.qweight.dequantize(dtype)


# ---------------------------------------------------------------- building


def _is_placeholder(t: torch.Tensor) -> bool:
    """Meta or fake: the planner's model, where only shapes and dtypes matter."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def quantize_weight(weight: torch.Tensor, cfg: QuantConfig, device: torch.device | None = None) -> QuantWeight:
    """Quantize a dense (out, in) weight, on `device` when given (default: where it lies).
    A meta or fake weight gets empty buffers of the exact shapes and dtypes, computing nothing."""
    if cfg.scheme not in ("int4", "nf4"):
        raise ValueError(f"quant scheme {cfg.scheme!r} has no 4-bit form")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    layout = Layout(cfg.scheme, tuple(weight.shape), cfg.group_size if cfg.scheme == "int4" else NF4_BLOCK)
    if _is_placeholder(weight):
        (codes_shape, codes_dtype), (scales_shape, scales_dtype) = state_shapes(layout)
        codes = weight.new_empty(codes_shape, dtype=codes_dtype)
        scales = weight.new_empty(scales_shape, dtype=scales_dtype)
    else:
        with torch.no_grad():
            w = weight.detach().to(device) if device is not None else weight.detach()
            codes, scales = int4_quantize(w, cfg.group_size) if cfg.scheme == "int4" else nf4_quantize(w)
    return QuantWeight(layout, codes, scales, weight.dtype)


def quantize(linear: nn.Linear, cfg: QuantConfig, device: torch.device | None = None) -> QuantLinear:
    bias = linear.bias
    if bias is not None and device is not None and not _is_placeholder(bias):
        bias = nn.Parameter(bias.detach().to(device), requires_grad=False)
    return QuantLinear(quantize_weight(linear.weight, cfg, device), bias)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(path) if path else model, leaf, module)


def _quantize_embeddings(model: nn.Module, cfg: QuantConfig, device: torch.device | None) -> list[str]:
    """The input embedding and the LM head; a tied pair is quantized once and shares it."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    where = {id(m): n for n, m in model.named_modules()}
    qembed = QuantEmbedding(quantize_weight(embed.weight, cfg, device), embed.padding_idx)
    replaced = {where[id(embed)]: qembed}
    if head is not None:
        if head.weight is embed.weight:
            replaced[where[id(head)]] = QuantLinear(qembed.qweight, head.bias)
        else:
            replaced[where[id(head)]] = quantize(head, cfg, device)
    for name, module in replaced.items():
        _replace(model, name, module)
    return list(replaced)


def apply(model: nn.Module, cfg: QuantConfig, device: torch.device | None = None) -> list[str]:
    """Replace every nn.Linear in the blocks (and, with cfg.embeddings, the embedding and LM
    head) by its frozen 4-bit form. Returns the replaced names; scheme 'none' changes nothing.
    `device`: where the codes go (quantize a CPU-loaded model straight onto the GPU)."""
    if cfg.scheme == "none":
        return []
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(BLOCKS_PREFIX)]
    for name in names:
        _replace(model, name, quantize(model.get_submodule(name), cfg, device))
    if cfg.embeddings:
        names += _quantize_embeddings(model, cfg, device)
    return names
