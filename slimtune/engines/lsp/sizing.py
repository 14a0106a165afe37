"""The default subspace size d of engine `lsp` (lsp.d = -1), from the model's matrix shapes.

The engine exists to cut what crosses the host link, so the default is set by that: the largest d
(a multiple of 64, at most 512) whose compressed traffic, 2 x d^2 x 4 bytes a matrix a step (G_c
down, Z up, fp32), is at most LINK_SHARE of the projected matrices' bf16 gradient bytes
(2 x n_o x n_i a matrix), i.e. of what full-gradient offload would send for them.

Why not the spec's "largest d whose copy and d^2 AdamW hide behind one layer's backward": d fixes
the shapes of Z and the moments, so it must be known when the model is built, before any time is
measured; and on a fast card it comes out above 512 for 3B-class models, where the link share is
already past 5%. By shapes: Llama-3.1-8B keeps d = 512 (the paper's d; 3.4% of its block
gradients), Llama-3.2-3B gets 384 and Llama-3.2-1B 320, so a small model on a small card does not
send a quarter of its gradient bytes. Error e(G) falls with d (benchmarks/README.md, lsp), so a
user who wants more quality for more traffic sets lsp.d.
"""

from __future__ import annotations

LINK_SHARE = 0.05
STEP = 64
CAP = 512


def compressed_bytes(shapes: list[tuple[int, int]], d: int) -> int:
    """Bytes over the link a step at subspace size d: G_c down and Z up, fp32, each min(d, n_o, n_i)^2."""
    return sum(2 * min(d, n_o, n_i) ** 2 * 4 for n_o, n_i in shapes)


def derived_d(shapes: list[tuple[int, int]]) -> int:
    """The largest multiple of STEP up to CAP within LINK_SHARE of the bf16 gradient bytes (STEP at least)."""
    gradient_bytes = sum(2 * n_o * n_i for n_o, n_i in shapes)
    fits = [d for d in range(STEP, CAP + 1, STEP) if compressed_bytes(shapes, d) <= LINK_SHARE * gradient_bytes]
    return max(fits, default=STEP)


def subspace_size(setting: int, shapes: list[tuple[int, int]]) -> int:
    """lsp.d as given, or derived from the projected matrices' shapes when it is -1."""
    return setting if setting != -1 else derived_d(shapes)


def block_shapes(model_config) -> list[tuple[int, int]]:
    """(n_o, n_i) of a block's linears: q, k, v, o and the gated MLP."""
    width, heads = model_config.hidden_size, model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or width // heads
    q, kv, ffn = heads * head_dim, model_config.num_key_value_heads * head_dim, model_config.intermediate_size
    return [(q, width), (kv, width), (kv, width), (width, q), (ffn, width), (ffn, width), (width, ffn)]
