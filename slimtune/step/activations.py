"""Block checkpointing: what a block keeps for backward, and where its input waits (device, host, disk).

`run_blocks` replaces the loop over the blocks (Stack.body_hidden's hook: see `runner`). An autograd
Function runs them under no_grad, keeping each block's input (in a store) and its RNG state.
Backward walks the blocks in reverse: take the input (the next is already being fetched), restore
the RNG state (LoRA dropout redraws its masks), recompute the block with grad, back-propagate through
it (parameter grads accumulate into .grad), pass the input's grad on. The device holds what the store
keeps there plus one block's activations; gradients equal plain autograd's. BlockInputs (rotary
tables, masks) are constants shared by all blocks and the recompute, never stored per block.

Where the inputs wait is a store (block_stores.py: the device, host RAM or disk), one per step.

Sequence tiles (activations.seq_tile). A checkpointed block runs in tiles of tokens, forward,
recompute and backward (step/seq_tiles.py): attention by query tiles against whole K and V, the rest
per token. One tile's intermediates exist at a time instead of T x every intermediate: at long
sequences that is what the recompute's peak is made of. Rows no longer than a tile run untiled.
Tiling pays only here: plain autograd (checkpoint=none) keeps every tile's activations anyway.

Caches. last_k: the last k blocks' inputs stay on the device (backward needs them first). small: per
block, the outputs of ops that are deterministic, neither views nor in-place, and small (<= 1/8 of
the block input's elements) stay on the device and are handed back in the recompute instead of
rerunning the op: in a Llama block with LoRA r <= d/8, the 7 LoRA down-projections x·Aᵀ (B, T, r)
and each RMSNorm's mean square, +eps and rsqrt (B, T, 1), i.e. (7r + 6)/d of a block input per
block. That saves those ops' compute, not memory. Attention's log-sum-exp is not kept (SDPA returns
it with the full output). The first recompute op out of step with forward's log ends substitution
for that block, so a mismatch costs compute, never correctness.

"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slimtune.device import memory
from slimtune.step import seq_tiles
from slimtune.step.block_stores import BlockStore
from slimtune.config import ActivationsConfig
from slimtune.model.stack import BlockInputs, Stack

TILE_SHARE = 4  # auto seq_tile: a tile's largest intermediate ~ 1/4 of a (T, D) block input
# Packed rows: that is the tile's (B, 1, t, T) mask, 1 + 2 bytes an element (bool, and SDPA's bf16
# additive copy) against the input's 2: t ~ D / 6. With grouped-query attention the tile folds its query
# heads (seq_tiles._Block.folded_attention) under the mask repeated per group, beside the bool mask it
# was made from: 1 + 3 x group bytes an element (Llama-3.1-8B, group 4: t ~ D / 26, so the shortest
# tile, 256).
MASK_BOOL_BYTES, MASK_ADDITIVE_BYTES, INPUT_BYTES = 1, 2, 2
MIN_TILE = 256  # auto tiles stay at least this long: shorter matmuls waste the device
SMALL_FRACTION = 8  # cache=small: an op output is small at <= 1/8 of the block input's elements


def run_blocks(stack: Stack, hidden: torch.Tensor, inputs: BlockInputs, cfg: ActivationsConfig,
               store: BlockStore | None = None, first: int = 0) -> torch.Tensor:
    """hidden (B, T, D), block `first`'s input -> the last block's output (B, T, D), blocks first..
    checkpointed as cfg says (the blocks below `first` are the caller's: engine chunk runs them
    without grad when no gradient is wanted below `first`)."""
    count = len(stack.blocks)
    # Without grad (evaluation) nothing runs backward, so storing inputs would be wasted traffic.
    if cfg.checkpoint == "none" or count <= first or not torch.is_grad_enabled():
        return stack.run_blocks(hidden, inputs, first)
    if store is None and cfg.checkpoint != "recompute":
        raise ValueError(f"checkpoint={cfg.checkpoint} needs a store from open_store().")
    store = store or BlockStore(hidden.device)
    tensors = [inputs.position_ids, *inputs.position_embeddings]  # masks are made from position_ids
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        # Gradients stop at the Function's inputs: such a tensor would silently get none.
        raise ValueError("checkpointed blocks take BlockInputs as constants; one of them requires grad.")
    on_device = set(range(max(count - cfg.last_k, first), count)) if cfg.cache == "last_k" else set()
    logs = {} if cfg.cache == "small" else None
    # A 0-dim input that needs grad, so backward runs even when `hidden` needs none (LoRA, frozen embedding).
    anchor = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=True)
    tile = tile_tokens(stack, hidden.shape[1], cfg, inputs.segmented)
    if tile >= hidden.shape[1]:
        inputs.masks  # made before the first block, as plain autograd makes them: not in block 0's segment or log
    else:
        logs = None  # see "Caches" above
    return _Checkpointed.apply(_Run(stack, inputs, store, on_device, logs, tile, first), hidden, anchor)


def tile_tokens(stack: Stack, seq: int, cfg: ActivationsConfig, segmented: bool = False) -> int:
    """Tokens per tile of a checkpointed block for `seq`-token rows (seq: untiled); `segmented`:
    rows hold packed examples (data.Batch.segmented), whose tiles carry a mask over every key."""
    if cfg.tile:
        return min(cfg.tile, seq)
    config = stack.config
    tiles = -(-TILE_SHARE * config.intermediate_size // config.hidden_size)
    if segmented:
        tiles = max(tiles, -(-TILE_SHARE * _mask_bytes(config) * seq // (INPUT_BYTES * config.hidden_size)))
    return min(seq, max(-(-seq // tiles), MIN_TILE))


def _mask_bytes(config) -> int:
    """Bytes a packed tile's mask holds per (query, key) pair (above)."""
    heads = config.num_attention_heads
    group = heads // (getattr(config, "num_key_value_heads", None) or heads)
    pair = MASK_BOOL_BYTES + MASK_ADDITIVE_BYTES
    return pair if group == 1 else MASK_BOOL_BYTES + group * pair


def runner(cfg: ActivationsConfig, store: BlockStore | None = None):
    """Stack.body_hidden's `run_blocks`: `stack.body_hidden(ids, positions, runner(cfg, store))`."""
    return functools.partial(run_blocks, cfg=cfg, store=store)


# ---------------------------------------------------------------- the autograd Function


class _Run:
    """One run_blocks call: the blocks' inputs (keys into a store) and RNG states, and its cache log."""

    def __init__(self, stack: Stack, inputs: BlockInputs, store: BlockStore, on_device: set, logs: dict | None,
                 tile: int, first: int = 0):
        self.stack, self.inputs, self.store, self.on_device, self.logs = stack, inputs, store, on_device, logs
        self.tile = tile  # tokens per tile
        self.first = first  # the lowest block run here
        self.keys, self.rng, self.local = {}, {}, BlockStore()  # rng: by block; local: cache=last_k inputs
        # A graph dropped without backward (or a failed forward) gives its entries back.
        self.release = weakref.finalize(self, _discard_all, self.keys)

    def put(self, index: int, x: torch.Tensor) -> None:
        self.rng[index] = dropout_rng_state(x.device)
        store = self.local if index in self.on_device else self.store
        self.keys[index] = (store, store.put(x))

    def prefetch(self, index: int) -> None:
        if index in self.keys:
            self.keys[index][0].prefetch(self.keys[index][1])

    def take(self, index: int) -> torch.Tensor:
        store, key = self.keys.pop(index)
        return store.take(key)


class _Checkpointed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.device = run, hidden.device
        # The engine calls backward outside its autocast block; the recompute must cast as forward did.
        ctx.autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k),
                         torch.is_autocast_cache_enabled()) for k in {hidden.device.type, "cpu"} & {"cpu", "cuda"}]
        try:
            return _forward_blocks(run, hidden)
        except BaseException:
            run.release()  # the graph never forms: no backward will take the inputs
            raise

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("checkpointed blocks support one backward per forward (no retain_graph).")
        try:
            with contextlib.ExitStack() as scope:
                for kind, enabled, dtype, cache in ctx.autocast:
                    scope.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
                # The RNG restores below must not change what the rest of the step draws.
                scope.enter_context(torch.random.fork_rng([ctx.device] if ctx.device.type == "cuda" else []))
                grad = _backward_blocks(run, grad, ctx.needs_input_grad[1])
        finally:
            run.release()
        return None, grad, None


def _forward_blocks(run: _Run, hidden: torch.Tensor) -> torch.Tensor:
    count = len(run.stack.blocks)
    run.store.reserve(hidden, count - run.first - len(run.on_device))
    for index in range(run.first, count):
        memory.mark("forward", index)
        run.put(index, hidden)
        with _SmallCache(run, index, hidden) if run.logs is not None else contextlib.nullcontext():
            hidden = block_forward(run.stack, index, hidden, run.inputs, run.tile)
    return hidden


def block_forward(stack: Stack, index: int, x: torch.Tensor, inputs: BlockInputs, tile: int) -> torch.Tensor:
    """Block `index` without grad, in tiles of `tile` tokens (step.seq_tiles) when x is longer."""
    if tile >= x.shape[1]:
        return stack.run_block(index, x, inputs)
    return seq_tiles.forward(stack, index, x, inputs, tile)


def _backward_blocks(run: _Run, grad: torch.Tensor, wants_input_grad: bool):
    last = len(run.stack.blocks) - 1
    run.prefetch(last)
    for index in range(last, run.first - 1, -1):
        memory.mark("backward", index)
        x = run.take(index)
        run.prefetch(index - 1)  # overlaps the fetch with this block's recompute
        x = x.detach().requires_grad_(index > run.first or wants_input_grad)
        restore_dropout_rng(run.rng[index], x.device)
        cache = _SmallCache(run, index) if run.logs is not None else contextlib.nullcontext()
        block_backward(run.stack, index, x, grad, run.inputs, run.tile, cache, grad_owned=index < last)
        grad = x.grad if x.requires_grad else None
        del x
        # The recompute runs in one autocast region over every block (Checkpointed.backward), and autocast
        # keeps its cast of each trained weight until a region ends: every block's bf16 copy would stay to
        # the end of backward (11.8 GiB at Llama-3.1-8B, full fine-tuning). This block's graph is gone: its
        # casts may go too. The cache is the process's, not this thread's: a cast another region still
        # wants is made again when next asked for, with the same values.
        torch.clear_autocast_cache()
    return grad


def block_backward(stack: Stack, index: int, x: torch.Tensor, grad: torch.Tensor | None, inputs: BlockInputs,
                   tile: int, cache=None, grad_owned: bool = False) -> None:
    """Recompute block `index` from its input x (RNG state restored by the caller) and back-propagate
    its output's gradient: parameter grads accumulate, x.grad is set. Each graph is freed by its
    backward before the next block (or tile) is recomputed. `cache`: a _SmallCache or None (untiled).
    `grad_owned`: the caller reads `grad` no more, so a tiled block may write x.grad into it (it is
    the previous block's x.grad, or the engine's own leaf's); never autograd's own incoming gradient."""
    if grad is None:
        return
    if tile < x.shape[1]:
        seq_tiles.backward(stack, index, x, grad, inputs, tile, grad_owned)
        return
    with torch.enable_grad(), cache if cache is not None else contextlib.nullcontext():
        y = stack.run_block(index, x, inputs)
    _backward(y, grad)


def _backward(y: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None and y.requires_grad:
        torch.autograd.backward(y, grad)


def _discard_all(keys: dict) -> None:
    for store, key in keys.values():
        store.discard(key)
    keys.clear()


def dropout_rng_state(device: torch.device) -> tuple:
    """The CPU (and the device's CUDA) generator states before a block: what its recompute restores
    so that dropout draws the same masks."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def restore_dropout_rng(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


# ---------------------------------------------------------------- cache=small

# Not logged and never substituted: autograd adds detach when it saves an output, and a copy_
# writes into place (a tiled forward), which a recompute need not repeat.
_UNLOGGED = {torch.ops.aten.detach.default, torch.ops.aten.copy_.default}
_VIEW_LIKE = {torch.ops.aten._unsafe_view.default}  # aliases its input though its schema says not


def _signature(func, args, kwargs) -> tuple:
    return func, tuple(
        (tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor)
        else v if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(v)
        for v in tree_flatten((args, kwargs))[0])


def _versions(out) -> tuple:
    return () if out is None else tuple(t._version for t in tree_flatten(out)[0])


def _is_small(func, args, out, limit: int) -> bool:
    # Random ops must rerun (the RNG stream), factories cost nothing, views and in-place ops own nothing.
    if (torch.Tag.nondeterministic_seeded in func.tags or func in _VIEW_LIKE
            or not any(isinstance(a, torch.Tensor) for a in tree_flatten(args)[0])
            or any(r.alias_info is not None for r in func._schema.returns)):
        return False
    leaves = tree_flatten(out)[0]
    return all(isinstance(t, torch.Tensor) for t in leaves) and 0 < sum(t.numel() for t in leaves) <= limit


class _SmallCache(TorchDispatchMode):
    """cache=small for one block. In forward (x given) it logs every op's signature in order, with
    its output when small. In the recompute an op matching the next logged signature gets the kept
    output instead of running; the first op out of step ends substitution for the block."""

    def __init__(self, run: _Run, index: int, x: torch.Tensor | None = None):
        super().__init__()
        self.replay, self.store, self.position = x is None, run.store, 0
        self.log = run.logs.pop(index, []) if x is None else run.logs.setdefault(index, [])
        self.limit = 0 if x is None else x.numel() // SMALL_FRACTION

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNLOGGED or self.position is None:
            return func(*args, **kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            kept = out if _is_small(func, args, out, self.limit) else None
            self.store.cache_kept += kept is not None
            self.log.append((_signature(func, args, kwargs), kept, _versions(kept)))
            return out
        entry = self.log[self.position] if self.position < len(self.log) else None
        if entry is None or entry[0] != _signature(func, args, kwargs):
            self.position, self.log[:] = None, []
            return func(*args, **kwargs)
        self.log[self.position], self.position = None, self.position + 1  # handed back once, then freed
        _, kept, versions = entry
        if kept is None or _versions(kept) != versions:  # not kept, or changed in place since
            return func(*args, **kwargs)
        self.store.cache_hits += 1
        return kept
