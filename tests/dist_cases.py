"""Data-parallel cases for every engine, run two ways: under torchrun by `python dist_cases.py OUT`
(each rank trains its share of every step: micro-batches r, r + W, ...; rank 0 writes what it
found to OUT/<case>.pt), and in one process on the whole step (`reference`). tests/unit/
test_distributed.py compares the two."""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))

from conftest import engine_config  # noqa: E402
from test_slide import batches, model_of  # noqa: E402
from slimtune import assembly, train
from slimtune.dist import ranks as distributed  # noqa: E402
from slimtune.engines import settings  # noqa: E402
from slimtune.engines.chunk.engine import ChunkConfig  # noqa: E402
from slimtune.config import ActivationsConfig, DistConfig, TrainConfig  # noqa: E402
from slimtune.engines.lsp.engine import LspConfig  # noqa: E402
from slimtune.engines.slide.engine import SlideConfig  # noqa: E402
from slimtune.engines.roundpipe.settings import RoundPipeConfig  # noqa: E402

CPU = torch.device("cpu")
# fp32 sums the ranks' gradients in another order than one process does. Where contributions cancel,
# the residue differs (~1e-9) and AdamW, which divides by sqrt(v) + eps, turns a residue near eps
# into a step near lr / 10: up to 3e-5 apart at lr 1e-3, eps 1e-8 on this tiny random model. fp32
# cases use eps 1e-6, where such residues cannot steer and ordinary gradients (1e-4 and up) are
# unaffected; fp64 keeps 1e-8.
LR = {"fp64": 1e-2, "fp32": 1e-3}
EPS = {"fp64": 1e-8, "fp32": 1e-6}
STEPS = 2
TRAIN = dict(steps=STEPS, batch_size=2, lr=1e-2, weight_decay=0.1, warmup_steps=1, schedule="cosine",
             max_grad_norm=0.5)
TILED = ActivationsConfig(checkpoint="recompute", seq_tile=4)
# name -> (RunConfig fields, model settings[, training settings over TRAIN])
CASES = {
    "resident": (dict(engine="resident", method="full"), {}),
    "resident_lora": (dict(engine="resident", method="lora"), {}),
    # Checkpointed blocks run in tiles of 4 of the 12 tokens: each block's gradients arrive in three
    # parts per backward, and a bucket must wait for the last (grad_buckets.py).
    "resident_tiled": (dict(engine="resident", method="full", activations=TILED), {}),
    "resident_lora_tiled": (dict(engine="resident", method="lora", activations=TILED), {}),
    "resident_fsdp": (dict(engine="resident", method="full", dist=DistConfig(strategy="fsdp")),
                      {"tie_word_embeddings": True}),
    "slide": (dict(engine="slide", method="full", sections={"slide": SlideConfig()}), {"tie_word_embeddings": True}),
    "slide_chunk": (dict(engine="slide", method="full", sections={"slide": SlideConfig(working_set="chunk"),
                                                                  "chunk": ChunkConfig(n_chunks=2)}), {}),
    "lsp": (dict(engine="lsp", method="full", sections={"lsp": LspConfig(d=8, r=3, check_every=0, fit_iterations=3)}),
            {}, {"weight_decay": 0.0}),
    # The embedding, norms and head trained beside the subspace (a device AdamW of their own): their
    # gradients are summed across ranks apart from the d x d ones.
    "lsp_other": (dict(engine="lsp", method="full",
                       sections={"lsp": LspConfig(d=8, r=3, check_every=0, fit_iterations=3, train_other=True)}),
                  {}, {"weight_decay": 0.0}),
    # A projector check before every step, with the ranks made to part in it (PARTING): every rank
    # must leave each check with rank 0's outcome.
    "lsp_checked": (dict(engine="lsp", method="full", sections={"lsp": LspConfig(d=8, r=3, check_every=1,
                                                                                fit_iterations=3)}),
                    {}, {"weight_decay": 0.0}),
    "chunk": (dict(engine="chunk", method="full", sections={"chunk": ChunkConfig(n_chunks=3)}), {}),
    "chunk_host": (dict(engine="chunk", method="full", sections={"chunk": ChunkConfig(n_chunks=3, gradients="host")}),
                   {"tie_word_embeddings": True}),
    "roundpipe": (dict(engine="roundpipe", method="full", sections={"roundpipe": RoundPipeConfig(workers=2)}), {}),
}


def part_rank(engine, step: int, rank: int) -> None:
    """What a CUDA rank's own projector fit may do (its sums in another order), made to happen on the
    CPU on ranks other than 0: before the first check this rank draws its fresh projector values from
    another seed, so its fit differs; before the second its baselines are zero, so it refits every
    matrix where rank 0 refits fewer."""
    if step == 0:
        engine.generator.manual_seed(1000 + rank)
    else:
        engine.learning.baseline = [0.0] * len(engine.modules)


# Cases whose ranks other than 0 are made to part (name -> what is done to them before each step);
# every rank saves its weights and lsp_state, and each must equal rank 0's.
PARTING = {"lsp_checked": part_rank}


def step_batches(vocab: int, step: int, count: int):
    """Step `step`'s micro-batches, the whole job's (every rank draws the same)."""
    return batches(vocab, 1000 + step, micro=count, rows=2)


def run_case(name: str, dist: distributed.Dist, micro_per_rank: int, precision: str = "fp64", lr: float | None = None,
             kept: dict | None = None):
    """(losses, grad norms, trained weights) after STEPS steps of `micro_per_rank` micro-batches on
    each of dist's ranks (SINGLE: the whole step's in one process); an lsp engine's check state into
    `kept` when given (lsp_state)."""
    fields, model_settings, *train_settings = CASES[name]
    fields = copy.deepcopy(fields)
    train_fields = {**TRAIN, **(train_settings[0] if train_settings else {}), "grad_accum": micro_per_rank}
    train_fields["lr"] = lr if lr is not None else LR[precision]
    train_fields["eps"] = EPS[precision]
    cfg = engine_config(TrainConfig(**train_fields), precision=precision, **fields)
    settings.validate(cfg)
    model = model_of(3, dtype=torch.float64 if precision == "fp64" else torch.float32, **model_settings)
    stack = assembly.stack_of(model, cfg, CPU, precision)
    engine = assembly.assemble(cfg, stack, CPU, precision, dist)
    if hasattr(engine, "use_sample"):
        engine.use_sample(batches(model.config.vocab_size, 7, micro=2, rows=2))
    losses, norms, sent, sent_before = [], [], [], dist.broadcast_bytes
    for step in range(STEPS):
        if name in PARTING and dist.rank > 0:
            PARTING[name](engine, step, dist.rank)
        whole = step_batches(model.config.vocab_size, step, micro_per_rank * dist.world_size)
        total = sum(b.num_targets for b in whole)
        result = train.combine_ranks(dist, step, engine.step(dist.shard(whole), total))
        losses.append(result.loss)
        norms.append(result.grad_norm)
        sent.append(dist.broadcast_bytes - sent_before)  # this case's, by the end of each step
    weights = {k: v.detach().clone() for k, v in engine.trainable_state().items()}
    if kept is not None:
        kept.update(lsp_state(engine), broadcast_bytes=sent)
    return losses, norms, weights


def lsp_state(engine) -> dict:
    """What an lsp check leaves besides the weights: baselines, the fresh draws' state, each matrix's
    projector values and subspace moments, and the matrices the last check changed on this rank."""
    return {"baseline": list(engine.learning.baseline), "generator": engine.generator.get_state(),
            "values": [t.clone() for m in engine.modules for t in (m.p_o.val, m.p_i.val)],
            "moments": [t.clone() for a in engine.adams for t in a.moments[0].values()],
            "masters": [a.masters[0].clone() for a in engine.adams],
            "weight_bytes": [m.weight.numel() * m.weight.element_size() for m in engine.modules],
            "changed": list(engine.learning.changed)}


PRECISIONS = ("fp64", "fp32")


def micro_per_rank(world: int) -> int:
    """Each rank's micro-batches a step: two of two ranks, one of three."""
    return 2 if world == 2 else 1


def main(out: Path) -> None:
    dist = distributed.from_env(60.0)
    micro = micro_per_rank(dist.world_size)
    for precision in PRECISIONS:
        for name in CASES:
            kept = {} if name in PARTING else None
            found = run_case(name, dist, micro, precision, kept=kept)
            if dist.is_main:
                torch.save({"micro": micro, "world": dist.world_size, "found": found}, out / f"{name}-{precision}.pt")
            if kept is not None:
                torch.save({"weights": found[2], **kept}, out / f"{name}-{precision}-rank{dist.rank}.pt")
    # Said so that a rank dying at exit reads apart from one dying in a case.
    print(f"rank {dist.rank}: every case done", file=sys.stderr, flush=True)
    dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
