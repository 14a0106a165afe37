"""What a resume does with each setting that changed since the run's last start.

Every key of the flattened settings (`config.flatten(config.to_dict(cfg))`, engine sections
included) is classed once, in RULES:

  safe     nothing the checkpoint holds depends on it: the resumed steps use the new value as a
           run begun with it would (steps, cadences, logging, the learning rate, ...).
  applied  the checkpoint holds state made under the old value, which the resumed run carries over
           in a way worth saying: the announcement says how ("lsp.r: 4 -> 2 (...)").
  refused  the checkpoint's state means nothing under the new value: the resume is refused in one
           sentence before anything is written, naming the setting, both values and the way out.

A setting is weighed only where the run reads it, before and after (lora.* under method=lora, an
engine's section under that engine; a change of engine is itself classed). A key with no rule (an
engine registered outside slimtune) is refused: what its change does to a checkpoint is unknown.

device=auto and precision=auto are compared by what they resolved to (run.json's "resolved"): a run
begun on a card in bf16 and resumed on the CPU in fp32 changes its precision though its setting reads
auto in both, and the announcement says so under the setting's rule.
tests/unit/test_resume_settings.py fails when a built-in setting has no rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from slimtune import config
from slimtune.config import RunConfig
from slimtune.engines import registry, settings
from slimtune.errors import UserError

SAFE, APPLIED, REFUSED = "safe", "applied", "refused"


@dataclass(frozen=True)
class Rule:
    kind: str  # SAFE, APPLIED or REFUSED
    why: str = ""  # applied: the effect, said when the run resumes; refused: why, said in the refusal


def safe() -> Rule:
    return Rule(SAFE)


def applied(effect: str) -> Rule:
    return Rule(APPLIED, effect)


def refused(why: str) -> Rule:
    return Rule(REFUSED, why)


_IDENTITY = refused("it is part of the run's identity: the checkpoint's weights mean nothing without it")
_STREAM = refused("the data stream's position in the checkpoint counts batches made with it")
_DATA = applied("the examples are read afresh; the resume goes on only if the training examples are as many, with as"
                " many tokens, as when the checkpoint was written")
_CARRIED = ("the weights, and the AdamW moments both engines keep by parameter name, carry over; a"
            " checkpoint of other trained tensors is refused")
_LSP_SHAPE = ("if this changes a matrix's {what}, its projectors are drawn afresh at the new one and its AdamW"
              " moments restart, and every matrix's projectors are fit at the next step")

RULES: dict[str, Rule] = {
    # The base model's identity is its weights' fingerprint (run_folder refuses others first): a moved folder is fine.
    "model": applied("the base model is read from the new folder, whose weights are the ones the run began with"),
    # The commit a Hub name resolves to is part of the run's identity (run/folder.py: model_commit).
    "model_revision": safe(),
    "data.path": _DATA,
    "data.subset": _DATA,
    "data.split": _DATA,
    "data.eval_split": _DATA,
    "data.format": _DATA,
    "data.max_length": _STREAM,
    "data.packing": _STREAM,
    "data.eval_path": _DATA,
    "data.eval_fraction": _DATA,
    "data.prompt_field": _DATA,
    "data.response_field": _DATA,
    "data.messages_field": _DATA,
    "data.text_field": _DATA,
    "data.chat_template": _DATA,
    "method": _IDENTITY,
    "lora.rank": _IDENTITY,
    "lora.alpha": _IDENTITY,
    "lora.dropout": safe(),
    "lora.targets": _IDENTITY,
    "freeze": _IDENTITY,
    "quant.scheme": applied("the frozen base is loaded as now set; the adapters trained on the old one carry over"),
    "quant.group_size": applied("the frozen base is loaded as now set; the adapters trained on the old one carry over"),
    "quant.embeddings": applied("the frozen base is loaded as now set; the adapters trained on the old one carry over"),
    "activations.checkpoint": safe(),
    "activations.cache": safe(),
    "activations.last_k": safe(),
    "activations.disk_dir": safe(),
    "activations.mlp_chunk": safe(),
    "activations.seq_tile": safe(),  # tiles split a block's work along the sequence: the same gradients
    "loss.mode": safe(),
    "loss.chunk_size": safe(),
    "loss.subset_k": safe(),
    "loss.masking": safe(),
    "engine": applied(_CARRIED),
    # engine=chunk, and slide.working_set=chunk
    "chunk.n_chunks": refused("the checkpoint's optimizer state is kept per chunk"),
    "chunk.switch_every": safe(),
    "chunk.order": applied("the chunks are visited in the new order from the current sweep's position on, so until"
                           " the sweep ends some may come twice and others not at all"),
    "chunk.lr_schedule": safe(),
    "chunk.lr_scale": safe(),
    "chunk.state": safe(),
    "chunk.state_dir": safe(),
    "chunk.gradients": safe(),
    # engine=lsp
    "lsp.d": applied(_LSP_SHAPE.format(what="subspace size")),
    "lsp.r": applied(_LSP_SHAPE.format(what="rank")),
    "lsp.check_every": safe(),
    "lsp.alpha": safe(),
    "lsp.drift": safe(),
    "lsp.check_samples": safe(),
    "lsp.fit_samples": refused("it decides which examples are held out of training, and so the data stream's batches"),
    "lsp.fit_iterations": safe(),
    "lsp.fit_lr": safe(),
    "lsp.schedule": safe(),
    "lsp.k": safe(),
    "lsp.p": safe(),
    "lsp.h": safe(),
    "lsp.u": safe(),
    "lsp.train_other": refused("it decides which tensors train, and the checkpoint holds the others' state or not"),
    # engine=roundpipe
    "roundpipe.workers": safe(),
    "roundpipe.micro_batches": safe(),
    "roundpipe.grain": safe(),
    "roundpipe.optimizer": applied("the next step computes at the newest weights (sync), or from it on at weights one"
                                   " update old (async)"),
    "roundpipe.memory_fraction": safe(),
    "roundpipe.replan": safe(),
    "roundpipe.tail_shards": safe(),
    "roundpipe.timeout_s": safe(),
    # engine=slide
    "slide.slots": safe(),
    "slide.head_tile_mb": safe(),
    "slide.moments": safe(),
    "slide.moments_dir": safe(),
    "slide.working_set": applied("the AdamW state carries over by parameter name, as from another engine's checkpoint;"
                                 " a chunk working set begins a sweep at its first chunk"),
    "plan": safe(),  # what the planner chooses (engine, options) is weighed key by key
    "gpu": safe(),
    "train.steps": safe(),
    "train.batch_size": _STREAM,
    "train.grad_accum": safe(),
    "train.lr": safe(),
    "train.weight_decay": safe(),
    "train.betas": safe(),
    "train.eps": safe(),
    "train.max_grad_norm": safe(),
    "train.master": safe(),  # checkpoints hold fp32 masters whichever way they rested
    "train.moments": applied("the saved moments are coded to 8 bits, or decoded to fp32, as the run resumes"),
    "train.host_threads": safe(),  # the same bits at any count
    "train.schedule": safe(),
    "train.warmup_steps": safe(),
    "train.seed": refused("the data order, and the examples an engine holds out, are drawn from it"),
    "train.log_every": safe(),
    "train.eval_every": safe(),
    "train.eval_batches": safe(),
    "train.save_every": safe(),
    "train.keep_last": safe(),
    "train.resume": safe(),
    "train.overwrite": safe(),
    "train.on_nonfinite": safe(),
    "train.nonfinite_patience": safe(),
    "train.measure_memory": safe(),
    "output_dir": safe(),  # the run's folder, moved
    "log.wandb": safe(),
    "log.wandb_project": safe(),
    "log.wandb_mode": safe(),
    "log.mlflow": safe(),
    "log.mlflow_tracking_uri": safe(),
    "log.mlflow_experiment": safe(),
    "log.run_name": safe(),
    "dist.strategy": safe(),  # a sharded checkpoint is read into either layout (checkpoint.load)
    "dist.timeout_s": safe(),
    # fsdp's mixed precision: the masters and moments are fp32 whatever the gather and reduce dtypes
    "dist.param_dtype": applied("the resumed steps gather the weights in the new dtype; the fp32 masters are"
                                " unchanged"),
    "dist.reduce_dtype": applied("the resumed steps reduce the gradients in the new dtype"),
    "dist.offload": safe(),  # where the shards and moments live, not what they hold
    "device": safe(),
    "precision": applied("the resumed steps compute in the new precision; weights held in a narrower dtype are"
                         " rounded once as they load"),
}

_UNKNOWN = refused("slimtune cannot tell what its change does to the checkpoint")


def rule(key: str) -> Rule:
    return RULES.get(key, _UNKNOWN)


def in_use(key: str, flat: dict) -> bool:
    """Whether a run with these flattened settings (`flat`) reads `key`."""
    section = key.partition(".")[0]
    if section == "lora":
        return flat.get("method") == "lora"
    if key == "freeze":
        return flat.get("method") == "full"
    engine = flat.get("engine")
    if section == "chunk":  # slide's chunk working set reads the chunk section too
        return engine == "chunk" or (engine == "slide" and flat.get("slide.working_set") == "chunk")
    if "." in key and section in registry.names():
        return engine == section
    return True


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    rule: Rule
    weighed: bool  # read by the run before and after: its rule holds (else nothing depends on it)
    resolved: tuple[str, str] | None = None  # an unchanged auto setting: what it resolved to then and now

    def text(self) -> str:
        said = f"{self.key}: {self.old!r} -> {self.new!r}"
        if self.resolved:
            said = f"{self.key}: {self.old!r} ({self.resolved[0]} at the last start) -> {self.new!r} ({self.resolved[1]} now)"
        if not self.weighed:
            return said
        return f"{said} ({self.rule.why})" if self.rule.kind == APPLIED else said


def changes(before: dict, cfg: RunConfig, resolved_before: dict | None = None,
            resolved_now: dict | None = None) -> list[Change]:
    """The settings that differ between `before` (the nested settings of the run's last start, as
    run.json records them) and `cfg`, each with its rule; and the unchanged settings whose resolution
    differs between `resolved_before` (run.json's, absent in a run recorded before it was kept) and
    `resolved_now` (device=auto that found a card then and none now, say)."""
    old, new = config.flatten(before), config.flatten(config.to_dict(cfg))
    found = [Change(key, old.get(key), value, rule(key), in_use(key, old) and in_use(key, new))
             for key, value in new.items() if old.get(key) != value]
    now = resolved_now or {}
    found += [Change(key, new[key], new[key], rule(key), True, (then, now[key]))
              for key, then in (resolved_before or {}).items()
              if key in new and old.get(key) == new[key] and now.get(key) not in (None, then)]
    return [_engine_change(c, before, cfg) if c.key == "engine" else c for c in found]


def _engine_change(change: Change, before: dict, cfg: RunConfig) -> Change:
    """Another engine takes the checkpoint's state by name (RULES), unless the two hold different
    numbers of training examples out as their own sample (registry.EngineSpec.sample_examples): then
    the data stream's batches are not the checkpoint's."""
    try:
        held_before = registry.get(change.old).sample_examples(settings.load(None, base=before))
    except (KeyError, UserError):  # an engine no longer registered, or settings this version refuses
        return change
    held_now = registry.get(change.new).sample_examples(cfg)
    if held_before == held_now:
        return change
    why = (f"engine {change.old} holds {held_before} training examples out as its own sample and engine"
           f" {change.new} {held_now}, so the data stream's position would mean other batches")
    return Change(change.key, change.old, change.new, refused(why), change.weighed)


def refuse(found: list[Change], output_dir: str) -> None:
    """One sentence for the changes a checkpoint cannot take, if any."""
    refusals = [c for c in found if c.weighed and c.rule.kind == REFUSED]
    if not refusals:
        return
    what = "; ".join(f"{c.key} was {_value(c.old)}, now {_value(c.new)} ({c.rule.why})" for c in refusals)
    back = " ".join(f"{c.key}={_value(c.old)}" for c in refusals)
    raise UserError(f"output_dir '{output_dir}' holds a run whose checkpoints cannot be resumed with these settings: "
                    f"{what}; resume with {back}, or start afresh with train.overwrite=true or another output_dir.")


def _value(value: object) -> str:
    """As an override writes it: plain text unquoted, other values as YAML reads them (JSON is YAML)."""
    if isinstance(value, str) and value and value.strip() == value and value[0] not in "[{'\"":
        return value
    return json.dumps(value)
