"""device_checks' SDPA routes: which of torch's attention kernels the card takes for each call
seq_tiles makes of a grouped-query tile, against what seq_tiles.fused_grouped_attention assumes.

seq_tiles was written from torch's kernel rules without a card (2026-12-07): with fewer key heads than
query heads (enable_gqa) only flash attention is fused, and flash takes no explicit mask and no fp32;
so masked tiles fold their query heads onto the key heads and plain causal fp32 tiles repeat their
keys and values. Each call below is asked of torch's own dispatcher (torch._fused_sdp_choice: the
backend SDPA's default path picks) and run once, forward and backward, with the allocator's peak
above its inputs: a "math" pick on a call seq_tiles makes is the bug the fold and the repeat are
there to avoid, and a fused pick on the unfolded masked call (cuDNN on Hopper and newer) says the
fold costs that card its mask's repeat for nothing. Llama-3.1-8B's heads (32 query, 8 key, 128 wide),
a 256-token tile over 8,192 keys; on the CPU (--quick) the same calls at 64 over 512 keys, the CPU's
own choices (not a card's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimtune.step import seq_tiles

BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_routes(quick: bool, device: torch.device) -> list[dict]:
    queries, keys = (64, 512) if quick else (256, 8192)
    return [_route(name, queries, keys, device, **case) for name, case in _cases().items()]


def _cases() -> dict[str, dict]:
    """name -> (dtype, mask kind, key heads as given to SDPA, whether seq_tiles makes this call)."""
    return {
        "plain_bf16_gqa": dict(dtype=torch.bfloat16, mask="causal", shape="grouped", made=True),
        "lower_right_bf16_gqa": dict(dtype=torch.bfloat16, mask="lower_right", shape="grouped", made=True),
        "masked_bf16_gqa": dict(dtype=torch.bfloat16, mask="segments", shape="grouped", made=False),
        "masked_bf16_folded": dict(dtype=torch.bfloat16, mask="segments", shape="folded", made=True),
        "plain_fp32_gqa": dict(dtype=torch.float32, mask="causal", shape="grouped", made=False),
        "plain_fp32_repeated": dict(dtype=torch.float32, mask="causal", shape="repeated", made=True),
        "lower_right_fp32_repeated": dict(dtype=torch.float32, mask="lower_right", shape="repeated", made=True),
        "masked_fp32_folded": dict(dtype=torch.float32, mask="segments", shape="folded", made=True),
    }


def _route(name: str, queries: int, keys: int, device: torch.device, dtype: torch.dtype, mask: str, shape: str,
           made: bool) -> dict:
    heads, kv_heads, width = 32, 8, 128
    keys = queries if mask == "causal" else keys  # a row's first tile: its own keys, causal from the top left
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, queries, width, generator=g).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, keys, width, generator=g).to(device, dtype) for _ in range(2))
    attn_mask, causal = _mask(mask, queries, keys, device)
    row = {"call": name, "dtype": str(dtype), "mask": mask, "shape": shape, "seq_tiles_makes_it": made,
           "assumed_fused": seq_tiles.fused_grouped_attention(q, None if mask == "causal" else attn_mask)
           if shape == "grouped" else True}
    if shape == "folded":
        group = heads // kv_heads
        q, attn_mask = q.reshape(1, kv_heads, group * queries, width), torch.cat([attn_mask] * group, dim=-2)
    elif shape == "repeated":
        k, v = seq_tiles._repeated_heads(q, k, v)  # noqa: SLF001
    grouped = q.shape[1] != k.shape[1]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if mask != "lower_right":
        try:
            choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, causal, enable_gqa=grouped)
            row["backend"] = BACKENDS.get(int(choice), str(choice))
        except RuntimeError as err:
            row["backend_error"] = str(err).splitlines()[0][:200]
    else:
        row["backend"] = "CausalBias dispatch (flash, then efficient, then math with the mask made)"
    try:
        row.update(_run_once(q, k, v, attn_mask, causal, grouped, device))
    except RuntimeError as err:
        row["run_error"] = str(err).splitlines()[0][:200]
    print(f"sdpa_routes {name}: {row.get('backend', row.get('backend_error'))}, peak above inputs "
          f"{row.get('peak_above_inputs_bytes')}", flush=True)
    return row


def _mask(kind: str, queries: int, keys: int, device: torch.device):
    """SDPA's (attn_mask, is_causal) for the tile that ends the row (its queries are the last keys)."""
    if kind == "causal":
        return None, queries == keys
    if kind == "lower_right":
        return seq_tiles._attention_bias().causal_lower_right(queries, keys), False  # noqa: SLF001
    band = seq_tiles.causal_band(queries, keys, keys - queries, None, device)
    segment = torch.arange(keys, device=device) >= keys // 2  # two packed examples
    same = segment[-queries:, None] == segment[None, :]
    return (band & same)[None, None], False


def _run_once(q, k, v, attn_mask, causal: bool, grouped: bool, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=grouped)
    out.float().square().sum().backward()
    if not cuda:
        return {"ran": True}
    torch.cuda.synchronize()
    return {"ran": True, "peak_above_inputs_bytes": torch.cuda.max_memory_allocated() - before}
