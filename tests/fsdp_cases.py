"""dist.strategy=fsdp cases, run two ways: under torchrun by `python fsdp_cases.py OUT` (each rank
trains its share of every step: micro-batches r, r + W, ...; every rank writes what it found and
holds to OUT/<case>-rank<r>.pt), and in one process on the whole step (`run_case` with SINGLE).
tests/unit/test_fsdp.py compares the two. Several checks share one job: starting ranks is the cost."""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))

from conftest import engine_config  # noqa: E402
from test_slide import batches, model_of  # noqa: E402
from slimtune import assembly, train  # noqa: E402
from slimtune.config import ActivationsConfig, DistConfig, QuantConfig, TrainConfig  # noqa: E402
from slimtune.dist import ranks as distributed  # noqa: E402
from slimtune.engines import settings  # noqa: E402
from slimtune.model.stack import Stack  # noqa: E402

CPU = torch.device("cpu")
NF4 = QuantConfig(scheme="nf4")
STEPS = 2
MICRO = 2  # micro-batches a rank trains a step, whatever the world size
EVAL_BATCHES = 5  # an uneven share on 2 and 3 ranks: a rank runs a forward it does not count
TRAIN = dict(steps=STEPS, batch_size=2, weight_decay=0.1, warmup_steps=1, schedule="cosine", max_grad_norm=0.5)
# name -> (precision, RunConfig.dist fields, model settings, which world sizes run it[, other RunConfig fields])
CASES = {
    # precision=bf16: weights gathered in bf16 (FSDP2's MixedPrecisionPolicy), gradients reduced in fp32.
    "mixed": ("bf16", {}, {}, (2,)),
    # The same in fp64 without mixed precision: exact but for the order of sums.
    "untied": ("fp64", {}, {}, (2, 3)),
    "tied": ("fp64", {}, {"tie_word_embeddings": True}, (2, 3)),
    "mixed_tied": ("bf16", {}, {"tie_word_embeddings": True}, (3,)),
    # Block checkpointing under fsdp: each block recomputed through its module call in backward.
    "recompute": ("fp64", {}, {}, (2,), {"activations": ActivationsConfig(checkpoint="recompute", cache="last_k",
                                                                          last_k=1)}),
    "host_tied": ("fp64", {}, {"tie_word_embeddings": True}, (3,), {"activations": ActivationsConfig(checkpoint="host")}),
    "disk": ("fp64", {}, {}, (2,), {"activations": ActivationsConfig(checkpoint="disk")}),  # block files in OUT
    # LoRA: the frozen base and the adapters sharded alike, the adapters trained.
    "lora": ("fp64", {}, {}, (2,), {"method": "lora"}),
    "mixed_lora": ("bf16", {}, {}, (3,), {"method": "lora"}),  # the frozen base stored in bf16
    "lora_recompute": ("fp64", {}, {}, (2,), {"method": "lora", "activations": ActivationsConfig(checkpoint="recompute")}),
    # Shards, gradients and AdamW in host RAM (FSDP2's CPUOffloadPolicy; on the CPU every copy stays put).
    "offload": ("fp64", {"offload": "cpu"}, {}, (2,)),
    # QLoRA: the 4-bit base's codes and scales sharded a row per quantization block, dequantized from
    # the gathered rows; the same codes as one process's (every rank quantizes the same weights).
    "qlora": ("fp64", {}, {}, (2, 3), {"method": "lora", "quant": NF4}),
    "mixed_qlora": ("bf16", {}, {}, (2,), {"method": "lora", "quant": NF4}),
    # int4's fp16 scales, and a quantized tied embedding and head (one QuantWeight, in the root unit).
    "qlora_int4_tied": ("fp64", {}, {"tie_word_embeddings": True}, (3,),
                        {"method": "lora", "quant": QuantConfig(scheme="int4", group_size=16, embeddings=True)}),
    # The Answer.AI recipe's shape: a sharded 4-bit base, blocks recomputed, shards in host RAM.
    "qlora_offload": ("fp64", {"offload": "cpu"}, {}, (2,),
                      {"method": "lora", "quant": NF4, "activations": ActivationsConfig(checkpoint="recompute")}),
    # Only rank 0 holds the weights, as a launched job loads them (assembly.load_stack): the other
    # ranks build the model on the meta device and are handed their shards (sharding.fill_from_rank0).
    "from_rank0": ("fp64", {}, {}, (2, 3)),
    "qlora_from_rank0": ("fp64", {"offload": "cpu"}, {}, (3,), {"method": "lora", "quant": NF4}),
}
# A checkpointed case is held against the plain case (no checkpointing) it differs from.
PLAIN = {"recompute": "untied", "host_tied": "tied", "disk": "untied", "lora_recompute": "lora", "offload": "untied",
         "qlora_offload": "qlora", "from_rank0": "untied", "qlora_from_rank0": "qlora"}
LR = {"fp64": 1e-2, "bf16": 1e-3}
EPS = {"fp64": 1e-8, "bf16": 1e-6}  # as dist_cases: fp32-rounded residues near eps must not steer AdamW


# Cases whose ranks also run the planner's synthetic step (PLANNED_SHAPE): their meter's peak is what
# the planner's fake rank (estimate with ranks=world: fake_ranks) must give to the byte.
PLANNED = ("untied", "mixed", "mixed_tied", "recompute", "offload", "mixed_qlora", "qlora_offload")  # tied: in mixed_tied
PLANNED_SHAPE = (2, 24)  # batch rows, tokens


def config_of(name: str, ranks: int, world: int, out: Path | None = None):
    """Case `name`'s RunConfig on `ranks` processes with `world` ranks' micro-batches a step."""
    precision, dist_fields, model_settings, _, *others = CASES[name]
    others = [{k: dataclasses.replace(v, disk_dir=str(out)) if k == "activations" and v.checkpoint == "disk" else v
               for k, v in others[0].items()}] if others else []
    train_cfg = TrainConfig(**TRAIN, lr=LR[precision], eps=EPS[precision], grad_accum=MICRO * world // ranks)
    fields = {"engine": "resident", "method": "full", **(others[0] if others else {})}
    cfg = engine_config(train_cfg, precision=precision, dist=DistConfig(strategy="fsdp", **dist_fields), **fields)
    settings.validate(cfg)
    return cfg


def build(name: str, dist: distributed.Dist, world: int, out: Path | None = None, as_loaded: bool = False):
    """(engine, model) of case `name` with `world` ranks' micro-batches a step (`out`: where
    checkpoint=disk writes its block files). `as_loaded`: the model made in its run dtype as a loader
    makes it (the rotary tables stay fp32), not cast whole (stack_of casts them to fp64 too)."""
    precision, _, model_settings, *_ = CASES[name]
    cfg = config_of(name, dist.world_size, world, out)
    # as loaded: in the run's weight dtype (a LoRA base under bf16 is loaded in bf16), else made in
    # fp64 or fp32 and cast by stack_of.
    dtype = assembly.run_weight_dtype(cfg, precision) if as_loaded else (
        torch.float64 if precision == "fp64" else torch.float32)
    if name.endswith("from_rank0") and dist.rank != 0:  # the weights come from rank 0
        with torch.device("meta"):
            model = model_of(3, dtype=dtype, **model_settings)
        stack = Stack(model.to(dtype=assembly.run_weight_dtype(cfg, precision)))
        return assembly.assemble(cfg, stack, CPU, precision, dist), model
    model = model_of(3, dtype=dtype, **model_settings)
    stack = Stack(model) if as_loaded else assembly.stack_of(model, cfg, CPU, precision)
    return assembly.assemble(cfg, stack, CPU, precision, dist), model


def planned_step(name: str, dist: distributed.Dist) -> dict:
    """This rank's meter over the planner's synthetic step of case `name` (its second step: the
    optimizer state used once), as the estimate's fake rank runs it: each rank the same batch."""
    from slimtune.planning import estimate

    engine, model = build(name, dist, dist.world_size, as_loaded=True)  # as the estimate's meta model
    batch = estimate.synthetic_batch(*PLANNED_SHAPE, model.config.vocab_size)
    result = [engine.step([batch] * engine.train_cfg.grad_accum) for _ in range(2)][-1]
    return {"total": result.device_peak_bytes, "breakdown": result.device_peak_breakdown}


def local_bytes(tensors) -> int:
    """Bytes this process holds of `tensors` (a shard's own part only)."""
    from slimtune.dist.sharding import is_sharded

    held = [t.to_local() if is_sharded(t) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in held)


def held_bytes(engine) -> dict:
    """What this rank holds between steps: weights, and AdamW's moments."""
    moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"weights": local_bytes(engine.stack.model.parameters()), "optimizer": local_bytes(moments)}


def run_case(name: str, dist: distributed.Dist, world: int, out: Path | None = None) -> dict:
    """Losses, grad norms, trained weights, the weight dtype a block computes with and the bytes held,
    after STEPS steps of `world` ranks' micro-batches (SINGLE: all of them in one process)."""
    engine, model = build(name, dist, world, out)
    seen = []
    down = engine.stack.blocks[0].mlp.down_proj
    down = getattr(down, "base", down)  # a LoRALinear's frozen base
    down.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    vocab = model.config.vocab_size
    losses, norms = [], []
    for step in range(STEPS):
        whole = batches(vocab, 1000 + step, micro=MICRO * world, rows=2)
        total = sum(b.num_targets for b in whole)
        result = train.combine_ranks(dist, step, engine.step(dist.shard(whole), total))
        losses.append(result.loss)
        peak = {"total": result.device_peak_bytes, **(result.device_peak_breakdown or {}),
                "host": result.host_peak_bytes or 0}
        norms.append(result.grad_norm)
    held = held_bytes(engine)
    eval_sums = train.evaluate_sums(engine, batches(vocab, 77, micro=EVAL_BATCHES, rows=2), dist, sharded=dist.active)
    weights = {k: v.detach().clone() for k, v in engine.trainable_state().items()}
    shapes = [(tuple(p.shape), p.element_size()) for p in engine.stack.model.parameters()]
    return {"losses": losses, "norms": norms, "weights": weights, "computed_in": seen[0], "held": held,
            "eval": eval_sums, "shapes": shapes, "peak": peak}


def main(out: Path) -> None:
    dist = distributed.from_env(60.0)
    for name, case in CASES.items():
        if dist.world_size in case[3]:
            found = run_case(name, dist, dist.world_size, out)
            torch.save({"world": dist.world_size, **found}, out / f"{name}-rank{dist.rank}.pt")
    for name in PLANNED:
        if dist.world_size in CASES[name][3]:
            torch.save(planned_step(name, dist), out / f"planned-{name}-rank{dist.rank}.pt")
    print(f"rank {dist.rank}: every case done", file=sys.stderr, flush=True)
    dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
