"""A checkpointed block run in tiles of tokens along the sequence: forward, recompute and backward.

Everything in a block but attention acts on each token alone (norms, the q/k/v/o and MLP projections
with their LoRA and 4-bit paths, rotary embedding, Qwen3's q/k norms, biases, residual adds), so it
can run on a tile of tokens. Attention needs the keys and values of every earlier token: they are
computed once for the whole sequence, tile by tile, and kept whole (B, Hkv, T, hd): with grouped-query
attention a fraction of the hidden size. Each query tile then attends to its key prefix [k0, end of
tile) in one SDPA call, causal with the tile's offset. So a block holds its input, its output, K and V
and one tile's intermediates, not T x every intermediate. Where the tile does not divide the sequence,
the first tile is the short one (tile_starts).

Forward (no grad): one pass in token order; tile i writes its keys and values, attends, and runs the
MLP half; causality means it needs no later key.

Backward: K and V are recomputed without grad; then the tiles run in reverse order. Tile i recomputes
its norm, k, v and q with grad, attends with K[k0:end] and V[k0:end] as leaves, runs o_proj, the
residual and the MLP half, and back-propagates its slice of the incoming gradient: dK, dV of its key
prefix accumulate into whole buffers. Every later tile has been done by then, so the keys of tile i
have their whole gradient: it is back-propagated through tile i's k and v (and with q's, through the
norm) at once. One tile's graph exists at a time; gradients equal the untiled block's.

Masks. Without packed rows a tile's mask is the causal band with the tile's offset: on CUDA that is
`causal_lower_right` (flash attention, no mask in memory); elsewhere it is built in place per tile and
declared host-resident for the meter, since a GPU run never holds it. Packed rows (position ids that
restart) keep examples apart by segment ids derived once per batch from position_ids: each tile builds
its own (B, 1, tile, keys) mask, so no (T, T) mask is ever built, and such rows get shorter tiles.

Dropout (LoRA's, attention's). Forward and recompute visit tiles in different orders, so each tile
draws from its own seed: one drawn per block from the step's RNG, whose state the caller restores
before the recompute, plus the tile's start. The recompute then draws the same masks, tile by tile.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import memory, runtime
from slimtune.model.stack import BlockInputs, Stack


def forward(stack: Stack, index: int, x: torch.Tensor, inputs: BlockInputs, tile: int) -> torch.Tensor:
    """Block `index` on x (B, T, D) without grad, tile by tile; returns its output (B, T, D)."""
    block = _Block(stack, index, x, inputs, tile)
    memory.note_tiled_block()
    out = None
    # Under fake tensors: the first tile (it makes the output, K and V) and the last (the most keys: the
    # largest transient of the tiles that write into what exists).
    for start in memory.representative(block.starts, x, alike_from=0):
        if out is not None:  # K, V and the output exist: the tile writes into them and keeps nothing
            memory.replayed(block.tile_key("forward", start), lambda: _forward_tile(block, start, out))
            continue
        # the first tile makes them: alike for every block of the step (and both depths of an estimate)
        out, block.k_all, block.v_all = memory.replayed_making(block.tile_key("first forward", start),
                                                               lambda: _first_forward_tile(block, start))
    return out


def _first_forward_tile(block: "_Block", start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first tile of the forward, which makes the block's output and whole K and V: all three."""
    y, n = _forward_tile(block, start)
    out = y.new_empty(block.x.shape[:2] + y.shape[2:])
    out[:, start : block.stop(start)] = y
    del y, n
    return out, block.k_all, block.v_all


def _forward_tile(block: "_Block", start: int, out: torch.Tensor | None = None):
    """One tile of the forward: its keys and values into K and V, and its output into `out`; without
    `out`, the output and the tile's normed input are returned (both live while `out` is made)."""
    with block.tile_rng(start), torch.no_grad():
        xi = block.x[:, start : block.stop(start)]
        n = block.layer.input_layernorm(xi)
        block.write_kv(start, *block.kv(n, start))
        y = block.rest(xi, block.q(n, start), block.keys(start), block.values(start), start)
    if out is None:
        return y, n
    out[:, start : block.stop(start)] = y
    return None


def backward(stack: Stack, index: int, x: torch.Tensor, grad: torch.Tensor, inputs: BlockInputs,
             tile: int, grad_owned: bool = False) -> None:
    """Recompute block `index` from x (B, T, D) tile by tile and back-propagate `grad` (B, T, D), the
    gradient of its output: parameter gradients accumulate, x.grad is set when x requires grad. The
    caller restores the block's RNG state first (dropout), as for its forward. `grad_owned`: nothing
    else reads `grad` afterwards, so x's gradient is written into it, tile by tile as each tile's
    slice has been used (one (B, T, D) tensor less on the device); x.grad is then `grad` itself."""
    block = _Block(stack, index, x, inputs, tile)
    block.recompute_kv()
    grad_k, grad_v = torch.zeros_like(block.k_all), torch.zeros_like(block.v_all)
    grad_x = None
    if x.requires_grad:
        reuse = grad_owned and grad.dtype == x.dtype and grad.shape == x.shape and grad.is_contiguous()
        grad_x = grad if reuse else torch.empty_like(x)
    trained = [p for p in block.layer.parameters() if p.requires_grad]
    # A block that makes no gradient but its input's accumulates nothing, plainly or otherwise.
    plain = stack.gradients_accumulate_plainly or (stack.only_parameters_take_gradients and not trained)
    # Under fake tensors: where nothing counts the parts, not tile 0 either (it attends to the fewest
    # keys: its peak is no higher than the tile after it, and it writes into what exists).
    first = block.starts[-1]  # the first tile backward runs
    for start in memory.representative(block.starts[::-1], x, last_alike=plain):
        with block.tile_rng(start):
            run = functools.partial(_tile_backward, block, start, grad[:, start : block.stop(start)], grad_k, grad_v, grad_x)
            if not plain or (start == first and stack.first_backward_tile_hands_over):
                run()
                continue
            # The first tile gives the parameters their gradients (the replay makes them too: `leaves`),
            # later ones add into them in place, as a later forward tile writes into K, V and the output.
            made = tuple(p.grad is None for p in trained)
            memory.replayed(block.tile_key("backward", start) + (grad_x is not None, grad.dtype, made), run, trained)
    if grad_x is not None:
        x.grad = grad_x if x.grad is None else x.grad + grad_x


def _tile_backward(block: "_Block", start: int, grad: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
                   grad_x: torch.Tensor | None) -> None:
    """One tile, recomputed with grad: first the query path with K, V as leaves (their prefix
    gradients accumulate into grad_k, grad_v), then its own k, v with their now whole gradients."""
    stop = start + grad.shape[1]
    with torch.enable_grad():
        xi, xi_in = _leaf(block.x[:, start:stop], grad_x is not None)
        n = block.layer.input_layernorm(xi_in)
        n_leaf, n_in = _leaf(n, n.requires_grad)
        k, v = block.kv(n_in, start)  # before q: the order forward drew dropout masks in
        first = block.first_key(start)
        keys, keys_in = _leaf(block.k_all[:, :, first:stop], True)
        values, values_in = _leaf(block.v_all[:, :, first:stop], True)
        y = block.rest(xi_in, block.q(n_in, start), keys_in, values_in, start)
    _backward([y], [grad])
    grad_k[:, :, first:stop] += keys.grad
    grad_v[:, :, first:stop] += values.grad
    del y, keys, values, keys_in, values_in
    _backward([k, v], [grad_k[:, :, start:stop], grad_v[:, :, start:stop]])
    if n_leaf.grad is not None:
        _backward([n], [n_leaf.grad])
    if grad_x is not None:
        grad_x[:, start:stop] = xi.grad


def _leaf(t: torch.Tensor, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf cut from t, and the tensor to compute with: a view of it. Autocast keeps its cast of
    a leaf that requires grad until its region ends (it takes it for a weight), so a leaf per tile
    cast directly would keep every tile's cast alive; a view is no leaf."""
    leaf = t.detach().requires_grad_(requires_grad)
    return leaf, (leaf.view_as(leaf) if requires_grad else leaf)


def _backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    pairs = [(y, g) for y, g in zip(outputs, grads) if y.requires_grad]
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])


class _Block:
    """One block's tiled run: its layer, the batch's rotary tables and key ranges, whole K and V."""

    def __init__(self, stack: Stack, index: int, x: torch.Tensor, inputs: BlockInputs, tile: int):
        self.layer, self.x, self.inputs, self.tile = stack.blocks[index], x, inputs, tile
        self.attn = self.layer.self_attn
        self.family = sys.modules[type(self.attn).__module__]  # rotate_half: the family's own rotary math
        self.seq = x.shape[1]
        self.starts = tile_starts(self.seq, tile)
        self._stops = dict(zip(self.starts, [*self.starts[1:], self.seq]))
        sliding = stack.layer_type(index) == "sliding_attention"
        self.window = stack.config.sliding_window if sliding else None
        self.segments = segments(inputs)
        self.firsts = dict(zip(self.starts, first_keys(self.starts, self.window)))
        self.k_all = self.v_all = None  # (B, Hkv, T, hd), made by the first tile's keys
        self.seed = _dropout_seed(self.layer, x)

    # ------------------------------------------------------------ the parts of a tile

    def kv(self, n: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x) of a tile (B, t, D) -> k after k_norm and rotary, v: (B, Hkv, t, hd) each."""
        attn, shape = self.attn, (*n.shape[:2], -1, self.attn.head_dim)
        k = attn.k_proj(n).view(shape)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        return self.rotate(k.transpose(1, 2), start), attn.v_proj(n).view(shape).transpose(1, 2)

    def q(self, n: torch.Tensor, start: int) -> torch.Tensor:
        attn, shape = self.attn, (*n.shape[:2], -1, self.attn.head_dim)
        q = attn.q_proj(n).view(shape)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        return self.rotate(q.transpose(1, 2), start)

    def rotate(self, t: torch.Tensor, start: int) -> torch.Tensor:
        """apply_rotary_pos_emb's math on one tensor (B, heads, t, hd) with the tile's cos and sin."""
        cos, sin = (table[:, start : start + t.shape[2]].unsqueeze(1) for table in self.inputs.position_embeddings)
        return (t * cos) + (self.family.rotate_half(t) * sin)

    def rest(self, xi: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             start: int) -> torch.Tensor:
        """Attention of q over (keys, values), o_proj, both residual adds and the MLP half: the tile's output."""
        attn = self.attn
        dropout = attn.attention_dropout if attn.training else 0.0
        mask, causal = self.mask(start, q, keys)
        grouped = q.shape[1] != keys.shape[1]
        unfused = grouped and not fused_grouped_attention(q, mask)  # a card would run its math kernel
        if unfused and not _plain_causal(mask):
            attended = self.folded_attention(q, keys, values, mask, dropout)
        else:
            if unfused:  # plain causal, in fp32 or with wide heads
                keys, values = _repeated_heads(q, keys, values)
                grouped = False
            if _is_causal_bias(mask):
                q, keys, values = _autocast_inputs(q, keys, values)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, dropout_p=dropout,
                                                 scale=attn.scaling, enable_gqa=grouped)
            attended = out.transpose(1, 2).reshape(*xi.shape[:2], -1)
        h = xi + attn.o_proj(attended)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def folded_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         dropout: float) -> torch.Tensor:
        """Grouped-query attention under an explicit mask (packed rows, sliding windows), which no fused kernel
        takes with fewer key heads (fused_grouped_attention), as o_proj's input (B, t, heads x hd): each key
        head's query heads folded into one longer run of queries, (B, heads, t, hd) -> (B, key heads, group x t,
        hd), under the mask repeated once per query head of the group. SDPA then sees as many query heads as key
        heads and its memory-efficient kernel takes the mask, with no (B, heads, t, keys) scores held (the math
        kernel's) and no keys and values repeated per query head (_repeated_heads: 2 x heads x hd x 2 bytes a
        key, as much again for their gradients, against 1 + 3 x group bytes a (query, key) pair for the mask,
        its repeat and SDPA's additive copy: less at packed rows' short tiles)."""
        batch, heads, queries, width = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        folded = F.scaled_dot_product_attention(
            q.reshape(batch, kv_heads, group * queries, width), keys, values,
            attn_mask=torch.cat([mask] * group, dim=-2), dropout_p=dropout, scale=self.attn.scaling)
        # (B, key heads, group x t, hd) -> (B, t, key heads, group, hd): head h = key head x group + r, as
        # enable_gqa pairs them; one copy into o_proj's layout.
        return folded.unflatten(2, (group, queries)).permute(0, 3, 1, 2, 4).reshape(batch, queries, heads * width)

    # ------------------------------------------------------------ whole K and V

    def write_kv(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_all is None:
            self.k_all = k.new_empty(*k.shape[:2], self.seq, k.shape[3])
            self.v_all = v.new_empty(*v.shape[:2], self.seq, v.shape[3])
        self.k_all[:, :, start : start + k.shape[2]] = k
        self.v_all[:, :, start : start + v.shape[2]] = v

    def recompute_kv(self) -> None:
        """K and V of the whole sequence without grad, tile by tile (the backward's first pass)."""
        for start in memory.representative(self.starts, self.x, alike_from=0):
            if self.k_all is None:  # the first tile makes K and V, alike for every block
                self.k_all, self.v_all = memory.replayed_making(self.tile_key("first recompute_kv", start),
                                                                lambda: self._recompute_kv_tile(start))
            else:  # K and V exist: the tile writes into them and keeps nothing
                memory.replayed(self.tile_key("recompute_kv", start), lambda: self._recompute_kv_tile(start))

    def _recompute_kv_tile(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One tile's keys and values into K and V (made by the first tile); returns K and V."""
        with self.tile_rng(start), torch.no_grad():
            n = self.layer.input_layernorm(self.x[:, start : self.stop(start)])
            self.write_kv(start, *self.kv(n, start))
        return self.k_all, self.v_all

    def tile_key(self, part: str, start: int) -> tuple:
        """What decides the transient bytes of a tile of `part` (memory.replayed): the tile's queries and
        key prefix, its mask, the block's tensors and the step's dtypes; not the block's index."""
        stop = self.stop(start)
        first = self.first_key(start)
        cast = torch.is_autocast_enabled(self.x.device.type) and torch.get_autocast_dtype(self.x.device.type)
        return (part, stop - start, stop - first, start - first, self.window, self.segments is None,
                tuple(self.x.shape), self.x.dtype, cast, self.layer.training, _signature(self.layer))

    def stop(self, start: int) -> int:
        """Where the tile that begins at `start` ends."""
        return self._stops[start]

    def first_key(self, start: int) -> int:
        return self.firsts[start]

    def keys(self, start: int) -> torch.Tensor:
        return self.k_all[:, :, self.first_key(start) : self.stop(start)]

    def values(self, start: int) -> torch.Tensor:
        return self.v_all[:, :, self.first_key(start) : self.stop(start)]

    # ------------------------------------------------------------ masks and dropout

    def mask(self, start: int, q: torch.Tensor, keys: torch.Tensor) -> tuple[object, bool]:
        """SDPA's (attn_mask, is_causal) for the tile's queries q at [start, ...) over keys [first, ...)."""
        first, queries, count = self.first_key(start), q.shape[2], keys.shape[2]
        offset = start - first  # of the first query among the keys
        if self.segments is None and self.window is None:
            if offset == 0:
                return None, True
            if lower_right_bias(keys):
                return _attention_bias().causal_lower_right(queries, count), False
            # Elsewhere a float band, built in place; a GPU attends without it (above), so no meter counts it.
            with memory.host_allocation():  # -inf above the band, 0 in it: one tensor, one pass
                band = torch.full((queries, count), float("-inf"), dtype=q.dtype, device=keys.device).triu_(offset + 1)
            return memory.mark_host_resident(band), False
        band = causal_band(queries, count, offset, self.window, keys.device)
        if self.segments is None:
            return band, False
        same = self.segments[:, start : start + queries, None] == self.segments[:, None, first : first + count]
        return (same & band).unsqueeze(1), False  # (B, 1, queries, keys)

    def tile_rng(self, start: int):
        """The tile's own dropout seed (see the module's docstring); nothing without dropout."""
        if self.seed is None:
            return contextlib.nullcontext()
        return _seeded(self.seed + start, self.x.device)


def lower_right_bias(keys: torch.Tensor) -> bool:
    """Whether a tile's plain causal band goes to SDPA as a lower-right CausalBias (CUDA: its fused
    kernels take it, and no mask is made) rather than as a band tensor (elsewhere)."""
    return keys.is_cuda


def _plain_causal(mask: object) -> bool:
    """A tile's mask is the plain causal band: none (the first tile), a card's CausalBias, or the CPU's
    host-resident band standing for one (_Block.mask)."""
    return mask is None or _is_causal_bias(mask) or memory.is_host_resident(mask)  # a CausalBias is a Tensor


def _repeated_heads(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated to q's heads (transformers' repeat_kv), for a plain causal tile no fused
    kernel takes with fewer key heads (fp32, heads wider than 256): the memory-efficient kernel then
    takes it, the causal band as its lower-right mask type, no mask in memory. At the long tiles of
    unpacked rows this holds less than a folded mask would (its bytes grow with the tile)."""
    group = q.shape[1] // keys.shape[1]
    return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)


def fused_grouped_attention(q: torch.Tensor, mask: object) -> bool:
    """Whether a CUDA card attends q against fewer key and value heads (grouped-query attention) in a
    fused kernel. Only flash attention does: SDPA's memory-efficient and cuDNN kernels refuse
    enable_gqa, and flash takes no explicit mask, no fp32 and no head wider than 256. Anything else
    falls back to SDPA's math kernel, which holds the tile's (B, heads, queries, keys) scores and their
    softmax: packed rows (their segment mask), sliding windows, fp32 runs. Masked tiles fold their query
    heads instead (_Block.folded_attention), plain causal ones repeat their keys and values
    (_repeated_heads), on every device alike, so the planner's fake step and the CPU meter count what
    a card holds. `mask`: the tile's mask as _Block.mask made it (the CPU's host-resident band stands
    for a card's CausalBias). Torch's rules as read for 2.13 on consumer and Ampere cards; not covered
    (docs/long-context.md): cuDNN attention, preferred on Hopper and newer with a recent cuDNN, which
    takes masked grouped attention itself (the fold then only costs the mask's repeat), and pre-Ampere
    cards, which have no flash kernel (fp16 grouped attention still falls back)."""
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
    return _plain_causal(mask) and dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _attention_bias():
    """torch.nn.attention.bias, imported on first use: a submodule torch.nn.attention does not import,
    and importing it imports torch._dynamo (about a second on two cores, in every process that imports
    this module: the CLI, the planner's worker, training)."""
    import torch.nn.attention.bias

    return torch.nn.attention.bias


def _is_causal_bias(mask: object) -> bool:
    """Whether SDPA's mask is a CausalBias (none exists before _attention_bias imported its module)."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def _autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype, where autocast is on for their device: a CausalBias takes SDPA over
    through __torch_function__ before autocast can cast, and SDPA's kernels then refuse q, k and v of
    different dtypes (fp32 weights under bf16: q and k come out of the fp32 rotary tables, v out of a bf16
    matmul). The same cast autocast makes for SDPA, so gradients reach the fp32 leaves as they would."""
    kind = tensors[0].device.type
    if not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) for t in tensors)


def _signature(layer: nn.Module) -> tuple:
    """A block's parameters and buffers by name, shape, dtype and whether they train, and the state of
    each submodule whose ops depend on more (a `tile_signature()`: lsp's ProjectedLinear, whose
    forward skips its correction while Z is known zero and keeps X while probed)."""
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in (*layer.named_parameters(), *layer.named_buffers()))
    return tensors + tuple(m.tile_signature() for m in layer.modules() if hasattr(m, "tile_signature"))


def causal_band(queries: int, keys: int, offset: int, window: int | None, device) -> torch.Tensor:
    """(queries, keys) bool: query i (at offset + i among the keys) sees key j when j <= offset + i,
    and with a sliding window when j > offset + i - window (transformers' sliding_window_overlay)."""
    band = torch.ones(queries, keys, dtype=torch.bool, device=device).tril_(offset)
    return band if window is None else band.triu_(offset - window + 1)


def segments(inputs: BlockInputs) -> torch.Tensor | None:
    """(B, T) example index of every token of packed rows (transformers' find_packed_sequence_indices:
    a position that does not follow the one before starts an example); None when rows are not
    packed (BlockInputs.segmented). Derived once per batch (inputs.derived), without reading values."""
    if "segments" not in inputs.derived:
        found = None
        if inputs.segmented:
            positions = inputs.position_ids
            steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
            found = (steps != 1).cumsum(-1)
        inputs.derived["segments"] = found
    return inputs.derived["segments"]


def tile_starts(seq: int, tile: int) -> list[int]:
    """Where each tile of a sequence of `seq` tokens begins. Where `tile` does not divide `seq` the
    first tile is the short one (seq % tile tokens): every later tile is whole, so the tiles that attend
    to the most keys, the last ones, are alike at every length, and a step's bytes grow with the length
    along one line (the planner's --max-seq solves it) with no jump where a short last tile would begin
    and a different tile hold the peak. The first tile attends to the fewest keys: no peak is there."""
    short = seq % tile
    return [0, *range(short, seq, tile)] if short else list(range(0, seq, tile))


def first_keys(starts: list[int], window: int | None) -> list[int]:
    """Per tile, the first key any of its queries may see: 0, or where a sliding window reaches. Not
    where a packed row's example starts: that would read values, and a tile's bytes would then
    depend on the data, which the planner's fake tensors cannot know (activations.tile_tokens
    shortens tiles of packed rows instead)."""
    return [0 if window is None else max(0, start - window + 1) for start in starts]


# ---------------------------------------------------------------- dropout seeds


def _dropout_seed(layer: nn.Module, x: torch.Tensor) -> int | None:
    """A seed for this block's tiles, drawn from the step's RNG (which the caller restores before the
    recompute, so the recompute draws it again); None when the layer draws no dropout mask (nothing
    to repeat). Drawn, not derived from the state: the next block and the next step draw others."""
    draws = layer.training and (getattr(layer.self_attn, "attention_dropout", 0.0) > 0 or any(
        isinstance(m, nn.Dropout) and m.p > 0 for m in layer.modules()))
    if not draws:
        return None
    if is_fake(x):  # the planner's estimate draws nothing
        return 0
    return int(torch.randint(0, 2**62, (), device="cpu"))


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    with torch.random.fork_rng([device] if device.type == "cuda" else [], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":  # the card fork_rng saved, which need not be the current one
            torch.cuda.default_generators[runtime.card_index(device)].manual_seed(seed)
        yield
