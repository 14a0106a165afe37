"""The byte-stream partition of engine `chunk` (spec chunkft.md 2.1).

The trainable tensors, in model order, form one virtual stream of bytes: each tensor's parameter
bytes plus its optimizer-state bytes (what a number of it costs wherever its state lives). The
stream is cut into N intervals of equal bytes; each cut moves to the nearest whole slice along the
tensor it falls in (a slice: one index along the tensor's split axis, e.g. one input column of a
linear weight). So each tensor gets N contiguous ranges along its axis, most of them empty, and a
chunk is a run of whole tensors with at most one partial tensor at each end. Chunks are disjoint,
cover every element once, and differ from total/N bytes by at most the largest single slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slimtune.errors import UserError


@dataclass(frozen=True)
class Stream:
    """One trainable tensor in the stream: its shape, split axis and bytes a number."""

    name: str
    shape: tuple[int, ...]
    axis: int
    bytes_per_number: int

    @property
    def slices(self) -> int:
        return self.shape[self.axis]

    @property
    def slice_bytes(self) -> int:
        return math.prod(self.shape) // max(self.slices, 1) * self.bytes_per_number

    @property
    def bytes(self) -> int:
        return self.slices * self.slice_bytes


@dataclass(frozen=True)
class Piece:
    """The part of one tensor in one chunk: indices [start, stop) along `axis`."""

    name: str
    axis: int
    start: int
    stop: int


def _cut_positions(streams: list[Stream], n: int) -> list[tuple[int, int]]:
    """The N - 1 inner cuts as (tensor index, slice index), each the nearest slice boundary to an
    equal-byte cut of the stream; monotone in the stream."""
    total = sum(s.bytes for s in streams)
    cuts, offset, t = [], 0, 0
    for j in range(1, n):
        target = total * j / n
        while t < len(streams) - 1 and offset + streams[t].bytes <= target:
            offset += streams[t].bytes
            t += 1
        stream = streams[t]
        index = round((target - offset) / stream.slice_bytes) if stream.slice_bytes else 0
        cuts.append((t, min(max(index, 0), stream.slices)))
    return cuts


def partition(streams: list[Stream], n: int) -> list[list[Piece]]:
    """Chunk k's non-empty pieces, in stream order, for k in 0..n-1. One sentence if a chunk would
    hold nothing (more chunks than slices)."""
    if n < 1:
        raise UserError(f"chunk.n_chunks must be at least 1 here, got {n} (0 is settled by the planner when a run"
                        " starts).")
    slices = sum(s.slices for s in streams)
    if n > slices:  # said before the cuts are made: their lists grow with n (10^8 chunks: gigabytes)
        raise UserError(too_many_chunks(n, "the trainable tensors", f"they hold {slices:,} slices"))
    bounds = [(0, 0), *_cut_positions(streams, n), (len(streams) - 1, streams[-1].slices)]
    chunks = []
    for k in range(n):
        (t0, i0), (t1, i1) = bounds[k], bounds[k + 1]
        pieces = []
        for t in range(t0, t1 + 1):
            start = i0 if t == t0 else 0
            stop = i1 if t == t1 else streams[t].slices
            if stop > start:
                pieces.append(Piece(streams[t].name, streams[t].axis, start, stop))
        if not pieces:
            raise UserError(f"chunk.n_chunks={n} leaves chunk {k} empty: the model has too few slices to cut"
                            f" into {n} chunks; lower chunk.n_chunks.")
        chunks.append(pieces)
    return chunks


def too_many_chunks(n: int, what: str, hold: str) -> str:
    return (f"chunk.n_chunks={n:,} is more chunks than {what} can be cut into: {hold} (a vocabulary row, an"
            " input column or an element each) and each chunk needs one; lower chunk.n_chunks.")


def most_slices(config: dict) -> int:
    """An upper bound on the slices a model's trainable tensors hold, from its (checked) config.json: the
    vocabulary rows of the embedding and an untied head, each block's matrices' input columns and its
    1-D tensors' elements (every bias and per-head norm a family may have counted as present), the
    final norm's elements. A chunk count above it is refused before the model is loaded."""
    d, heads, inner = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // heads
    kv_heads = config.get("num_key_value_heads") or heads
    attention = 4 * d + heads * head_dim  # q, k, v take d columns each, o takes the heads' width; o's bias d
    attention += (heads + 2 * kv_heads) * head_dim + 2 * head_dim  # q, k, v biases; q and k norms
    mlp = 2 * d + inner + 2 * inner + d  # gate and up take d columns, down the inner width; their biases
    block = attention + mlp + 2 * d  # and the two norms
    return 2 * config["vocab_size"] + config["num_hidden_layers"] * block + d


def chunk_bytes(streams: list[Stream], pieces: list[Piece]) -> int:
    by_name = {s.name: s for s in streams}
    return sum((p.stop - p.start) * by_name[p.name].slice_bytes for p in pieces)
