"""Causal-LM loss from the final block output: masking, exact chunked CE, subset softmax.

Targets arrive already shifted (data.Example), so position t is scored against
targets[t] and IGNORE_INDEX rows cost nothing. The engine divides the returned sum by
the trained-token count of the whole optimizer step, so gradient accumulation gives
exactly the gradient of one large batch.

Three memory measures (specs/peak-memory-lora.md 2.5, 2.6):
- Logits masking (exact): only the trained rows of the final block output go through
  the final norm, the head and the loss. Their flat indices come from the caller
  (`data.Batch.trained_positions`, found when the batch is built), because finding them here would
  read tensor values mid-step, which fake tensors (the planner's estimate) cannot answer.
- mode=exact: cross-entropy in token chunks that computes each chunk's gradients in the
  forward pass, so no (N, V) logits are ever kept; only the (N, D) hidden gradient (and
  the (V, D) head gradient when the head trains) waits for backward. The final norm runs
  inside the same chunks (_NormedExactCE): its fp32 temporaries and the normed rows exist
  for one chunk, never for the whole sequence (at 256K tokens that was the step's peak).
- mode=subset (training only): softmax over a per-position candidate set S_t (top-k of
  the frozen head's logits, target forced in), the final norm inside its chunks as above. L_S <= L_full, so it is never reported
  as the loss: `exact_sum` carries the full-softmax loss and `excluded_mass_sum` the
  probability mass the training objective ignored.
Logits are formed in at least fp32 (fp64 stays fp64), whatever the autocast context.

Memory of the head itself: a token chunk's logits are (c, V); loss.chunk_size=0 (auto) picks c so
that they stay near LOGITS_CHUNK_BYTES. The (V, D) weight is read in vocabulary tiles (`_Head`): a
head narrower than the compute dtype is cast tile by tile and a 4-bit head dequantized tile by
tile, so no full-size dense copy of it ever exists (1.5 GiB in fp32 for Llama-3's vocabulary).

A sliced head (engine chunk: its module has `slices`, slimtune/chunk/sliced.py, the weight sliced by
vocabulary rows) gets gradients only for its active rows, from those columns of the logits
gradient, and the bias for its own range; they go to the slices' side buffers, never to `.grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slimtune.device import memory
from slimtune.config import LossConfig
from slimtune.data.dataset import IGNORE_INDEX
from slimtune.errors import UserError

# A head stored in a narrower dtype than the logits is cast in tiles of this many rows,
# so the cast never holds a full (V, D) fp32 copy (1.5 GiB for Llama-3's vocabulary).
CAST_TILE_ROWS = 8192
# loss.chunk_size=0: tokens per chunk such that the (c, V) logits stay near this (64 MiB; 130
# tokens at Llama-3's vocabulary in fp32), and never fewer than MIN_CHUNK_TOKENS.
LOGITS_CHUNK_BYTES = 64 << 20
MIN_CHUNK_TOKENS = 16


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # () the training objective summed over trained positions; backprop this
    exact_sum: torch.Tensor  # () detached full-softmax loss sum: the loss to log and report
    excluded_mass_sum: torch.Tensor  # () detached sum of 1 - p(S_t) over trained positions; 0 in mode=exact


def causal_lm_loss(
    hidden: torch.Tensor,
    norm: nn.Module,
    head: nn.Module,
    targets: torch.Tensor,
    cfg: LossConfig,
    trained_positions: torch.Tensor | None = None,
    training: bool = True,
) -> LossOutput:
    """hidden (B, T, D), the last block's output before the final norm; targets (B, T) shifted;
    trained_positions (N,): data.trained_positions(targets), required when cfg.masking. Returns sums, never means."""
    source = _Head(head)
    chunk = chunk_tokens(cfg, source.shape[0])
    if not (training and torch.is_grad_enabled()):
        with torch.no_grad():  # evaluation: the exact loss and no graph, the norm a chunk at a time
            rows, t = trained_rows(hidden, targets, cfg, trained_positions)
            loss = _normed_pass(rows, norm, source, t, chunk, (False, False, False))[0]
        return LossOutput(loss, loss, torch.zeros_like(loss))
    if cfg.mode == "exact" and source.slices is None:
        # The final norm runs inside the loss's chunks: only one chunk's norm temporaries exist.
        rows, t = trained_rows(hidden, targets, cfg, trained_positions)
        loss = _NormedExactCE.apply(rows, source.weight, source.bias, t, chunk, source, norm, *norm.parameters())
        out = LossOutput(loss, loss.detach(), torch.zeros_like(loss.detach()))
        memory.mark_on_backward(out.loss_sum, "loss backward")
        return out
    if cfg.mode == "subset":  # the final norm inside the loss's chunks too (a sliced head trains: refused)
        _refuse_trainable_head(head)
        rows, t = trained_rows(hidden, targets, cfg, trained_positions)
        loss, exact, excluded = _SubsetCE.apply(rows, t, source, chunk, cfg.subset_k, norm, *norm.parameters())
        out = LossOutput(loss, exact, excluded)
    else:  # a sliced head (engine chunk) norms every row at once, as before
        x, t = head_inputs(hidden, norm, targets, cfg, trained_positions)
        loss = _ExactCE.apply(x, source.weight, source.bias, t, chunk, source)
        out = LossOutput(loss, loss.detach(), torch.zeros_like(loss.detach()))
    # The loss's backward is a segment apart from its forward (memory.mark): what each holds grows
    # with depth at its own rate, and the estimate by depth needs every segment's peak to be a line.
    memory.mark_on_backward(out.loss_sum, "loss backward")
    return out


def chunk_tokens(cfg: LossConfig, vocab: int) -> int:
    """Tokens per loss chunk: cfg.chunk_size, or for 0 (auto) ~LOGITS_CHUNK_BYTES of fp32 logits."""
    return cfg.chunk_size or max(MIN_CHUNK_TOKENS, LOGITS_CHUNK_BYTES // (4 * vocab))


class _Head:
    """The LM head's (V, D) weight, handed out in vocabulary tiles: as it is when it is already in
    the compute dtype, else cast (a narrower head) or dequantized (a 4-bit head, quant.QuantLinear)
    one tile at a time. `weight` is the dense weight autograd sees, None for a 4-bit head.
    `slices`: a sliced head's {"weight"?, "bias"?: ActiveSlice}, else None."""

    def __init__(self, module: nn.Module):
        self.module, self.bias = module, getattr(module, "bias", None)
        self.slices = _head_slices(module)
        if hasattr(module, "weight_tiles"):
            self.weight, self.shape, self.dtype = None, (module.out_features, module.in_features), module.qweight.dtype
        elif isinstance(getattr(module, "weight", None), torch.Tensor):
            self.weight, self.shape, self.dtype = module.weight, tuple(module.weight.shape), module.weight.dtype
        else:
            raise TypeError(f"LM head {type(module).__name__} has neither a weight nor weight_tiles().")

    def tiles(self, dtype: torch.dtype):
        """Yields (start, stop, rows [start, stop) of the weight in `dtype`)."""
        if self.weight is None:
            yield from self.module.weight_tiles(dtype)
        elif self.weight.dtype == dtype:
            yield 0, self.shape[0], self.weight
        else:
            for start in memory.representative(range(0, self.shape[0], CAST_TILE_ROWS), self.weight):
                stop = min(start + CAST_TILE_ROWS, self.shape[0])
                yield start, stop, self.weight[start:stop].to(dtype)


def _head_slices(module: nn.Module) -> dict | None:
    slices = getattr(module, "slices", None)
    weight = None if slices is None else slices.get("weight")
    if weight is not None and weight.axis != 0:
        raise ValueError(f"LM head {type(module).__name__} is sliced along axis {weight.axis}; the causal-LM"
                         " head is sliced by vocabulary rows (axis 0).")
    return slices


def head_inputs(
    hidden: torch.Tensor, norm: nn.Module, targets: torch.Tensor, cfg: LossConfig,
    trained_positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> normed rows x (N, D) and their targets (N,): the trained rows only when masking."""
    flat, flat_targets = trained_rows(hidden, targets, cfg, trained_positions)
    return norm(flat), flat_targets


def trained_rows(
    hidden: torch.Tensor, targets: torch.Tensor, cfg: LossConfig, trained_positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> rows of hidden before the final norm (N, D) and their targets (N,): the trained rows only
    when masking."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, D)
    flat_targets = targets.reshape(-1)  # (B*T,)
    if cfg.masking:
        if trained_positions is None:
            raise ValueError("loss.masking needs data.trained_positions(targets), found when the batch is built.")
        # Gathered before the norm: the norm, head and loss then cost N rows, not B*T.
        flat, flat_targets = flat.index_select(0, trained_positions), flat_targets.index_select(0, trained_positions)
    return flat, flat_targets


def _refuse_trainable_head(head: nn.Module) -> None:
    # The subset Function does not take the head as an input, so a trainable head (or a tied
    # trainable embedding) would silently get no gradient. Parameters only: no dequantizing.
    if any(p.requires_grad for p in head.parameters()):
        raise UserError(
            "loss.mode=subset needs a frozen LM head (LoRA); this run trains the head or a tied embedding."
            " Use loss.mode=exact or freeze them."
        )


def _logits_dtype(x: torch.Tensor, head: _Head) -> torch.dtype:
    # Softmax over a large vocabulary in half precision loses the small probabilities.
    return torch.promote_types(torch.promote_types(x.dtype, head.dtype), torch.float32)


# ---------------------------------------------------------------- head matmuls in the compute dtype


def _logits(x: torch.Tensor, head: _Head, dtype: torch.dtype) -> torch.Tensor:
    """x (c, D) in `dtype` -> logits (c, V) in `dtype`, one weight tile at a time."""
    z = None
    for start, stop, tile in head.tiles(dtype):  # tile (stop - start, D)
        if start == 0 and stop == head.shape[0]:
            z = x @ tile.T
        else:
            z = x.new_empty((x.shape[0], head.shape[0])) if z is None else z
            z[:, start:stop] = x @ tile.T
    if head.bias is not None:
        z += head.bias.to(dtype)
    return z


def _times_weight(g: torch.Tensor, head: _Head) -> torch.Tensor:
    """g (c, V) in the compute dtype @ weight (V, D) -> (c, D) in the compute dtype."""
    out = None
    for start, stop, tile in head.tiles(g.dtype):
        if start == 0 and stop == head.shape[0]:
            return g @ tile
        out = g.new_zeros((g.shape[0], head.shape[1])) if out is None else out
        out.addmm_(g[:, start:stop], tile)
    return out


def _target_terms(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """z (c, V), t (c,) -> target logit (c,), valid (c,) bool, safe target ids (c,)."""
    valid = t != IGNORE_INDEX
    safe = torch.where(valid, t, 0)  # ignored rows read column 0 and are masked out after
    return z.gather(1, safe[:, None]).squeeze(1), valid, safe


# The loss allocates nothing inside an op: the CPU meter (a dispatch mode) sees op outputs only, so
# a buffer an op makes and frees inside itself is device memory it would miss (torch.logsumexp's
# own (c, V) copy of z - max was one: up to LOGITS_CHUNK_BYTES, at the loss's peak). Hence reductions,
# elementwise ops and in-place updates below, never torch.logsumexp, softmax or cross_entropy.


def exp_shifted_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z (c, n) -> log-sum-exp of each row (c,) and the row sums of exp(z - max) (c, 1), computed
    as torch.logsumexp computes them, in place: z is left holding exp(z - max), so z.div_(sums) is
    the softmax, and no (c, n) buffer is made."""
    m = z.amax(dim=-1, keepdim=True)  # (c, 1)
    m.masked_fill_(m.isinf(), 0)  # a row with an infinite max keeps its infinity, as in torch.logsumexp
    sums = z.sub_(m).exp_().sum(dim=-1, keepdim=True)  # (c, 1)
    return sums.log().add_(m).squeeze(-1), sums


# ---------------------------------------------------------------- mode=exact


def _exact_pass(
    x: torch.Tensor,
    head: _Head,
    targets: torch.Tensor,
    chunk: int,
    need: tuple[bool, bool, bool],
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss sum and, as `need` (x, weight, bias) asks, gradients for an upstream gradient of 1.
    x (N, D), head (V, D), targets (N,) -> (), (N, D), (V, D), (V,). One (c, V) buffer at a time.
    lse_out (N,): filled with each row's log-sum-exp."""
    dtype = _logits_dtype(x, head)
    loss = x.new_zeros((), dtype=dtype)
    grad_x = torch.empty_like(x) if need[0] else None
    grad_w = x.new_zeros(head.shape, dtype=dtype) if need[1] else None
    grad_b = x.new_zeros(head.shape[:1], dtype=dtype) if need[2] else None
    for start in memory.representative(range(0, x.shape[0], chunk), x):
        part, lse, g_x = _exact_chunk(x[start : start + chunk].to(dtype), head, targets[start : start + chunk],
                                      need[0], grad_w, grad_b)
        loss = loss + part
        if lse_out is not None:
            lse_out[start : start + chunk] = lse
        if grad_x is not None:
            grad_x[start : start + chunk] = g_x
    return loss, grad_x, grad_w, grad_b


def _exact_chunk(
    x_c: torch.Tensor, head: _Head, t: torch.Tensor, need_x: bool,
    grad_w: torch.Tensor | None, grad_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token chunk x_c (c, D) in the logits dtype -> its loss sum, each row's log-sum-exp (c,)
    and, when need_x, d(loss)/dx_c (c, D); adds its share into grad_w (V, D) and grad_b (V,) when given."""
    z = _logits(x_c, head, x_c.dtype)  # (c, V)
    z_y, valid, safe = _target_terms(z, t)
    lse, sums = exp_shifted_(z)  # z now holds exp(z - max)
    loss = torch.where(valid, lse - z_y, 0).sum()
    if not (need_x or grad_w is not None or grad_b is not None):
        return loss, lse, None
    g = z.div_(sums)  # softmax, in place over the logits: (c, V)
    g.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))  # minus one-hot(y)
    g.mul_(valid[:, None])  # ignored rows carry no gradient
    if grad_w is not None:
        grad_w.addmm_(g.T, x_c)
    if grad_b is not None:
        grad_b += g.sum(0)
    return loss, lse, _times_weight(g, head) if need_x else None


def _slice_rows(s) -> tuple[bool, tuple[int, int] | None]:
    """An ActiveSlice of the head (or None: frozen) -> (gradient needed, its rows)."""
    if s is None or s.empty:
        return False, None
    return True, (s.start, s.stop)


class _ExactCE(torch.autograd.Function):
    """Summed cross-entropy of x @ W.T (+ b) whose gradients are made in forward
    (the Liger / Cut-Cross-Entropy trick): backward only scales them by grad_output.

    A sliced head (engine chunk) is the exception for its weight and bias: their active rows'
    gradients are made in backward instead, from x and each row's log-sum-exp kept from forward
    (N x D in the compute dtype, N numbers), by recomputing only those rows' logits, and added
    straight into the slices' side buffers; None goes to autograd. Made in forward they would be held
    from the loss to its backward beside the side buffer: up to a second copy of the head's share of
    the chunk (a whole 128K x 4096 head is 2 GiB in fp32)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, chunk, head: _Head):
        # weight, bias: head.weight and head.bias, passed so autograd routes their gradients
        need = tuple(ctx.needs_input_grad[:3])
        ctx.slices = None if head.slices is None else (head.slices.get("weight"), head.slices.get("bias"))
        sliced = ctx.slices is not None and any(_slice_rows(s)[0] for s in ctx.slices)
        lse = x.new_empty(x.shape[:1], dtype=_logits_dtype(x, head)) if sliced else None
        if ctx.slices is not None:
            need = (need[0], False, False)
        with torch.autocast(x.device.type, enabled=False):  # dtypes are chosen explicitly
            loss, grad_x, grad_w, grad_b = _exact_pass(x, head, targets, chunk, need, lse_out=lse)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        ctx.head, ctx.chunk = head, chunk
        ctx.save_for_backward(grad_x, grad_w, grad_b,  # (N, D), (V, D) | None, (V,) | None
                              *((x, targets, lse) if sliced else (None, None, None)))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w, grad_b, x, targets, lse = ctx.saved_tensors
        grads = tuple(None if g is None else g * grad_out.to(g.dtype) for g in (grad_x, grad_w, grad_b))
        if x is not None:
            with torch.autocast(x.device.type, enabled=False):
                _sliced_head_grads(x, targets, lse, ctx.head, ctx.chunk, ctx.slices, grad_out)
        return (*grads, None, None, None)


class _NormedExactCE(torch.autograd.Function):
    """_ExactCE with the final norm inside its token chunks: takes the rows before the norm (N, D)
    and norms them one chunk at a time, without grad in forward and again with grad in backward,
    where the chunk's gradient goes through the norm. So the norm's temporaries (fp32 inside an
    RMSNorm) and the normed rows exist for one chunk, never for all N rows; what waits for backward
    is the rows and d(loss)/d(normed rows), (N, D) each, and the head's gradients when it trains.

    The norm's backward stays after grad_output scales the gradient, as when the norm ran outside the
    loss: an RMSNorm that computes in fp32 rounds its incoming gradient there, so scaling after it
    would change the result in the 8th digit. A sliced head keeps _ExactCE (its gradients are made
    in backward from the normed rows)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, chunk, head: _Head, norm: nn.Module, *norm_params):
        # weight, bias, norm_params: passed so autograd routes their gradients
        need = tuple(ctx.needs_input_grad[:3])
        through_norm = need[0] or any(ctx.needs_input_grad[7:])
        loss, grad_x, grad_w, grad_b = _normed_pass(rows, norm, head, targets, chunk, (through_norm, *need[1:]))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        ctx.norm, ctx.chunk, ctx.autocast = norm, chunk, _autocast_state(rows.device.type)
        ctx.wanted = tuple(ctx.needs_input_grad[7:])
        ctx.save_for_backward(grad_x, grad_w, grad_b, rows if through_norm else None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w, grad_b, rows = ctx.saved_tensors
        grads = [None if g is None else g * grad_out.to(g.dtype) for g in (grad_w, grad_b)]
        grad_rows, grad_params = None, [None] * len(ctx.wanted)
        if rows is not None:
            params = [p for p, wanted in zip(ctx.norm.parameters(), ctx.wanted) if wanted]
            grad_rows, trained = _norm_backward(rows, grad_x, grad_out, ctx.norm, params, ctx.chunk, ctx.autocast,
                                                ctx.needs_input_grad[0])
            found = iter(trained)
            grad_params = [next(found) if wanted else None for wanted in ctx.wanted]
        return (grad_rows, *grads, None, None, None, None, *grad_params)


def _autocast_state(kind: str) -> tuple:
    return kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind)


def _normed_pass(rows, norm: nn.Module, head: _Head, targets, chunk: int, need: tuple):
    """Loss sum of norm(rows) against the head and, as `need` (normed rows, weight, bias) asks,
    gradients for an upstream gradient of 1: (), (N, D) in the normed rows' dtype | None, (V, D) | None,
    (V,) | None. The norm runs under the caller's autocast, the head without."""
    dtype = _logits_dtype(rows, head)
    loss = rows.new_zeros((), dtype=dtype)
    grad_x = None
    grad_w = rows.new_zeros(head.shape, dtype=dtype) if need[1] else None
    grad_b = rows.new_zeros(head.shape[:1], dtype=dtype) if need[2] else None
    for start in memory.representative(range(0, rows.shape[0], chunk), rows):
        with torch.no_grad():
            x_c = norm(rows[start : start + chunk])  # (c, D): this chunk's normed rows
        if need[0] and grad_x is None:
            grad_x = rows.new_empty(rows.shape, dtype=x_c.dtype)  # as the normed rows' gradient was
        with torch.autocast(rows.device.type, enabled=False):  # dtypes are chosen explicitly
            part, _, g_x = _exact_chunk(x_c.to(_logits_dtype(x_c, head)), head, targets[start : start + chunk],
                                        need[0], grad_w, grad_b)
        loss = loss + part
        if need[0]:
            grad_x[start : start + chunk] = g_x
    if need[0] and grad_x is None:  # no rows at all
        grad_x = torch.empty_like(rows)
    return loss, grad_x, grad_w, grad_b


def _norm_backward(rows, grad_x, grad_out, norm: nn.Module, params: list, chunk: int, autocast: tuple,
                   need_rows: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """d(loss)/d(rows) (N, D) | None and the trained norm `params`' gradients, from grad_x (N, D) times
    grad_out: each chunk of rows normed again with grad and back-propagated alone."""
    grad_rows = torch.empty_like(rows) if need_rows else None
    totals = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
    kind, cast, enabled = autocast
    for start in memory.representative(range(0, rows.shape[0], chunk), rows):
        r = rows[start : start + chunk].detach().requires_grad_(need_rows)  # (c, D)
        with torch.enable_grad(), torch.autocast(kind, dtype=cast, enabled=enabled):
            y = norm(r)
        g = grad_x[start : start + chunk] * grad_out.to(grad_x.dtype)  # scaled before the norm, as before
        grads = torch.autograd.grad(y, ([r] if need_rows else []) + params, g)
        if need_rows:
            grad_rows[start : start + chunk] = grads[0]
        for total, part in zip(totals, grads[1:] if need_rows else grads):
            total += part  # summed over chunks in at least fp32, cast to each parameter's dtype below
        del y, r, g, grads
    return grad_rows, [t.to(p.dtype) for t, p in zip(totals, params)]


def _sliced_head_grads(x, targets, lse, head: _Head, chunk: int, slices, scale: torch.Tensor) -> None:
    """The active rows' gradients of a sliced head's weight and bias, times `scale`, added into their
    side buffers: per tile of rows and token chunk, softmax(z) - onehot(y) on those rows' logits
    (from the saved log-sum-exp), then its transpose @ x for the weight, its column sums for the
    bias. Rows go in CAST_TILE_ROWS tiles, so a head narrower than the logits is cast a tile at a time;
    with a sink (chunk.gradients=host) each tile's gradient is handed over when complete."""
    dtype = lse.dtype
    for active, is_bias in zip(slices, (False, True)):
        live, rows = _slice_rows(active)
        if not live:
            continue
        a, b = rows
        tiles = range(a, b, CAST_TILE_ROWS)
        # every tile under a sink, fake tensors too: each crosses the link, and the link's bytes are counted
        for r0 in tiles if active.sink is not None else memory.representative(tiles, x):
            r1 = min(r0 + CAST_TILE_ROWS, b)
            tile = head.weight[r0:r1].to(dtype)  # (r, D): a view when the head is in the logits dtype
            target = active.rows(r0 - a, r1 - a, x)  # the side buffer's rows, or a tile for the sink
            for start in memory.representative(range(0, x.shape[0], chunk), x):
                x_c = x[start : start + chunk].to(dtype)  # (c, D)
                g = _rows_gradient(x_c, tile, head, r0, r1, targets[start : start + chunk],
                                   lse[start : start + chunk], scale)
                if is_bias:
                    target += g.sum(0)
                else:
                    target.addmm_(g.T, x_c)
            active.rows_done(r0 - a, target)
            del target


def _rows_gradient(x_c, tile, head: _Head, r0: int, r1: int, t, lse, scale) -> torch.Tensor:
    """(softmax(z) - onehot(y)) * scale on vocabulary rows [r0, r1) of a token chunk: (c, r1 - r0)."""
    z = x_c @ tile.T
    if head.bias is not None:
        z += head.bias[r0:r1].to(z.dtype)
    z.sub_(lse[:, None]).exp_()
    hit = (t >= r0) & (t < r1)
    z.scatter_add_(1, torch.where(hit, t - r0, 0)[:, None], -hit[:, None].to(z.dtype))
    return z.mul_((t != IGNORE_INDEX)[:, None]).mul_(scale.to(z.dtype))


# ---------------------------------------------------------------- mode=subset


@torch.no_grad()
def select_subset(z: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """z (c, V) logits, targets (c,) valid ids -> candidate ids (c, min(k, V)), distinct per row:
    the top-k, except that a target outside them replaces the smallest (last, as topk sorts)."""
    ids = z.topk(min(k, z.shape[-1]), dim=-1).indices  # (c, k)
    present = (ids == targets[:, None]).any(dim=-1)
    ids[:, -1] = torch.where(present, ids[:, -1], targets)
    return ids


def _subset_chunk(z: torch.Tensor, t: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """z (c, V), t (c,) -> ids (c, k), dL_S/dz on S (c, k), and the chunk's sums of
    L_S, L_full and 1 - p(S)."""
    z_y, valid, safe = _target_terms(z, t)
    ids = select_subset(z, safe, k)
    z_s = z.gather(1, ids)  # (c, k)
    lse = exp_shifted_(z)[0]  # z's last use: overwritten in place
    lse_s, sums_s = exp_shifted_(z_s)  # z_s now holds exp(z_s - max)
    g_s = z_s.div_(sums_s).sub_((ids == safe[:, None]).to(z.dtype))  # q - one-hot(y)
    g_s.mul_(valid[:, None])
    sums = (
        torch.where(valid, lse_s - z_y, 0).sum(),
        torch.where(valid, lse - z_y, 0).sum(),
        # 1 - p(S) = 1 - exp(lse_S - lse), never below 0 (rounding can put lse_S a hair above lse)
        torch.where(valid, -torch.expm1((lse_s - lse).clamp_max(0)), 0).sum(),
    )
    return ids, g_s, *sums


class _SubsetCE(torch.autograd.Function):
    """Summed subset-softmax loss against a frozen `head`, of the rows before the final norm, which runs
    inside the token chunks as in _NormedExactCE: without grad in forward, again with grad in backward,
    so its temporaries (fp32 inside an RMSNorm) and the normed rows exist for one chunk, never for all N
    rows. The head is not an input, so nothing head-sized is saved (a quantized head dequantizes again,
    tile by tile, in backward); forward keeps the rows and, (N, k) each, the candidate ids and dL/dz on
    them."""

    @staticmethod
    def forward(ctx, rows, targets, head: _Head, chunk: int, k: int, norm: nn.Module, *norm_params):
        # norm_params: passed so autograd routes their gradients
        k = min(k, head.shape[0])
        dtype, x_dtype = _logits_dtype(rows, head), rows.dtype  # the normed rows' own, once a chunk shows them
        ids = g_s = None
        sums = [rows.new_zeros((), dtype=dtype) for _ in range(3)]  # L_S, L_full, excluded mass
        for start in memory.representative(range(0, rows.shape[0], chunk), rows):
            with torch.no_grad():
                x_c = norm(rows[start : start + chunk])  # (c, D): this chunk's normed rows
            dtype, x_dtype = _logits_dtype(x_c, head), x_c.dtype
            if ids is None:  # (N, k) each: about 12 k bytes per trained token, vocabulary-wide only if k >= V
                ids, g_s = targets.new_empty((rows.shape[0], k)), rows.new_empty((rows.shape[0], k), dtype=dtype)
            with torch.autocast(rows.device.type, enabled=False):
                z = _logits(x_c.to(dtype), head, dtype)  # (c, V)
                ids_c, g_c, *parts = _subset_chunk(z, targets[start : start + chunk], k)
            ids[start : start + chunk], g_s[start : start + chunk] = ids_c, g_c
            sums = [s + p for s, p in zip(sums, parts)]
        if ids is None:  # no rows at all
            ids, g_s = targets.new_empty((0, k)), rows.new_empty((0, k), dtype=dtype)
        ctx.save_for_backward(ids, g_s, rows)
        ctx.head, ctx.chunk, ctx.x_dtype, ctx.norm = head, chunk, x_dtype, norm
        ctx.autocast, ctx.wanted = _autocast_state(rows.device.type), tuple(ctx.needs_input_grad[6:])
        ctx.mark_non_differentiable(sums[1], sums[2])
        return tuple(sums)

    @staticmethod
    def backward(ctx, grad_out, _exact_grad, _excluded_grad):
        ids, g_s, rows = ctx.saved_tensors
        head, ctx.head = ctx.head, None
        grad_x = g_s.new_empty((ids.shape[0], head.shape[1]), dtype=ctx.x_dtype)  # (N, D): d/d(normed rows)
        with torch.autocast(grad_x.device.type, enabled=False):
            for start in memory.representative(range(0, ids.shape[0], ctx.chunk), g_s):
                g_c = g_s[start : start + ctx.chunk] * grad_out.to(g_s.dtype)  # (c, k)
                dense = g_c.new_zeros((g_c.shape[0], head.shape[0]))  # (c, V), transient
                dense.scatter_(1, ids[start : start + ctx.chunk], g_c)  # ids are distinct per row
                grad_x[start : start + ctx.chunk] = _times_weight(dense, head)
        params = [p for p, wanted in zip(ctx.norm.parameters(), ctx.wanted) if wanted]
        # grad_out is in grad_x already (scaled before the head's product, as before): the norm takes it as 1
        grad_rows, trained = _norm_backward(rows, grad_x, grad_out.new_ones(()), ctx.norm, params, ctx.chunk,
                                            ctx.autocast, ctx.needs_input_grad[0])
        found = iter(trained)
        return (grad_rows, None, None, None, None, None, *[next(found) if wanted else None for wanted in ctx.wanted])
