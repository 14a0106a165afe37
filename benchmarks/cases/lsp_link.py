"""Engine lsp (spec lsp-offload.md): what crosses the host link and what it needs on the device, at
the default subspace size (lsp.d = -1: derived from the shapes, slimtune/engines/lsp/sizing.py) and
at d = 512.

Part 1, link bytes (fake tensors, counted by Link in slimtune/device/runtime.py): lsp's bytes per step against
full-gradient offload, i.e. the gradient bytes the slide engine sends down per step (its
Link.bytes_down at depths 3 and 4, extrapolated in depth as the estimate does: bytes are affine in
depth), for Llama-3.2-1B/3B and Llama-3.1-8B, batch 1 x 1024. Goal (issue 12): <= 5% at the default d.

Part 2, device peak from the estimate (fake tensors, the training meter), batch 1 x 1024, bf16:
lsp (default d) with and without block recompute against resident full fine-tuning, Llama-3.2-1B/3B,
Llama-3.1-8B.
"""

from __future__ import annotations

import time

from torch._subclasses.fake_tensor import FakeTensorMode

from slimtune import assembly, presets
from slimtune.engines import settings
from slimtune.data import dataset as data
from slimtune.planning import estimate
from slimtune.engines.lsp import sizing
from slimtune.model.stack import Stack

GIB = 2**30
SEQ = 1024


def run_config(engine: str, *extra: str):
    return settings.load(None, [f"engine={engine}", "method=full", "precision=bf16", "train.batch_size=1", *extra],
                         base={"model": "(benchmark)", "data": "(benchmark)"})


def slide_gradient_bytes(model_config, depth: int) -> int:
    """Bytes the slide engine sends down (its gradients) in one fake step at `depth` blocks."""
    cfg = run_config("slide", "activations.checkpoint=host")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shallow = estimate.at_depth(model_config, depth)
    stack = Stack(estimate.fake_model(shallow, assembly.run_weight_dtype(cfg, "bf16"), mode))
    real = estimate.synthetic_batch(1, SEQ, model_config.vocab_size)
    with mode:
        engine = assembly.assemble(cfg, stack, assembly.HOST, "bf16")
        batch = data.Batch(*(mode.from_tensor(t) for t in (real.input_ids, real.targets, real.position_ids,
                                                            real.trained_positions)),
                           num_targets=real.num_targets, segmented=real.segmented)
        engine.step([batch])
    return engine.link.bytes_down


def default_d(model_config) -> int:
    return sizing.derived_d(sizing.block_shapes(model_config) * model_config.num_hidden_layers)


def part1(quick: bool) -> list[dict]:
    rows = []
    for name in ("Llama-3.2-3B",) if quick else ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"):
        model_config = presets.model_config(name)
        low, high = slide_gradient_bytes(model_config, 3), slide_gradient_bytes(model_config, 4)
        slide = low + (high - low) * (model_config.num_hidden_layers - 3)
        for d, label in ((-1, "default"), (512, "512")):
            lsp = estimate.estimate(model_config, run_config("lsp", f"lsp.d={d}"), 1, SEQ)
            rows.append({"model": name, "d_setting": label, "d": default_d(model_config) if d == -1 else d,
                         "lsp_link_bytes": lsp.host_link_bytes, "lsp_link_gib": lsp.host_link_bytes / GIB,
                         "slide_gradient_bytes": slide, "slide_gradient_gib": slide / GIB,
                         "ratio": lsp.host_link_bytes / slide, "goal": 0.05 if d == -1 else None,
                         "met": lsp.host_link_bytes / slide <= 0.05})
    return rows


def part2(quick: bool) -> list[dict]:
    rows = []
    models = ("Llama-3.2-1B",) if quick else ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B")
    plans = [("lsp", ()), ("lsp", ("activations.checkpoint=recompute",)), ("resident", ()),
             ("resident", ("activations.checkpoint=recompute",))]
    for name in models:
        model_config = presets.model_config(name)
        for engine, extra in plans:
            began = time.perf_counter()
            found = estimate.estimate(model_config, run_config(engine, *extra), 1, SEQ)
            rows.append({"model": name, "engine": engine, "options": list(extra),
                         "d": default_d(model_config) if engine == "lsp" else None,
                         "device_peak_bytes": found.device_peak_bytes, "device_peak_gib": found.device_peak_bytes / GIB,
                         "breakdown_gib": {k: v / GIB for k, v in found.breakdown.items()},
                         "host_gib": found.host_bytes / GIB, "seconds": time.perf_counter() - began})
    return rows


# ---------------------------------------------------------------- part 3: projector quality


def run(quick: bool) -> dict:
    began = time.perf_counter()
    result = {"link_bytes": part1(quick), "device_peak": part2(quick)}
    result["seconds"] = time.perf_counter() - began
    return result
