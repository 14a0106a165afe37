"""Typed run configuration: plain dataclass sections, YAML plus `a.b=value` overrides read into them.

Each field's `help` metadata is the documentation (`slimtune train --help` prints it).
Unknown keys, wrong types and impossible values are refused with one sentence naming
the key. This module knows no engine: whoever reads settings hands in the engine sections they
may hold, and engines.settings (above the registered engines) completes and validates a RunConfig.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from slimtune import local_paths
from slimtune.config_sources import Sources
from slimtune.errors import UserError


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field whose help text travels in its metadata (`slimtune train --help` prints it)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


REQUIRED = dataclasses.MISSING


@dataclass
class DataConfig:
    path: str = setting(REQUIRED, "Training data: a .jsonl/.json/.csv/.parquet file, a saved HF dataset folder, a"
                                  " folder of data files (a Hub dataset repository's layout), or a Hub dataset name"
                                  " (org/name), read through datasets.load_dataset into its cache.")
    subset: str | None = setting(
        None, "A Hub dataset (or dataset folder) with several subsets (configs): the one to read.")
    split: str | None = setting(
        None, "A Hub dataset, dataset folder or saved dataset with several splits: the one to train on (default:"
              " train).")
    eval_split: str | None = setting(
        None, "Evaluate on this split: of eval_path when set, else of path (e.g. validation); replaces eval_fraction.")
    format: Literal["chat", "prompt_response", "text"] = setting(
        "prompt_response",
        "chat: a list of {role, content} messages; prompt_response: two text fields; text: plain text.",
    )
    max_length: int = setting(512, "Tokens per example; longer examples are truncated (and counted).")
    packing: bool = setting(True, "Pack short examples into rows of max_length; attention never crosses examples.")
    eval_path: str | None = setting(
        None, "Separate evaluation data; when unset (and eval_split too), eval_fraction of path is held out.")
    eval_fraction: float = setting(
        0.05, "Share of the training data held out for evaluation when eval_path and eval_split are unset.")
    prompt_field: str = setting("prompt", "prompt_response: the field holding the prompt.")
    response_field: str = setting("response", "prompt_response: the field holding the response.")
    messages_field: str = setting("messages", "chat: the field holding the list of messages.")
    text_field: str = setting("text", "text: the field holding the text.")
    chat_template: str | None = setting(
        None, "chat: a Jinja template (or a path to a .jinja file); default: the tokenizer's own, else slimtune's."
    )

    def validate(self) -> None:
        positive("data.max_length", self.max_length)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}.")
        for name in ("subset", "split", "eval_split", "eval_path"):  # (an empty eval_path fell back to eval_fraction)
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise UserError(f"data.{name} is empty; name one, or leave it out.")
        if self.eval_split is not None and self.eval_path is None and self.eval_split == (self.split or "train"):
            raise UserError(f"data.eval_split '{self.eval_split}' is the split trained on; evaluate on another split.")


@dataclass
class LoraConfig:
    rank: int = setting(16, "LoRA rank r.")
    alpha: float = setting(32.0, "LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = setting(0.0, "Dropout on the LoRA input.")
    targets: str | list[str] = setting(
        "all-linear",
        "Linears to adapt: 'all-linear' (every linear in the blocks) or name patterns such as [q_proj, v_proj]"
        " (matched among the blocks' linears; the LM head takes no adapter).",
    )

    def validate(self) -> None:
        positive("lora.rank", self.rank)
        positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}.")
        if isinstance(self.targets, list) and not self.targets:
            raise UserError("lora.targets is an empty list; name at least one linear or use 'all-linear'.")


@dataclass
class QuantConfig:
    scheme: Literal["none", "nf4", "int4"] = setting(
        "none", "Frozen linear weights in 4 bits, dequantized just in time: nf4 (bitsandbytes) or symmetric int4."
    )
    group_size: int = setting(64, "Weights per quantization scale (int4; nf4 uses bitsandbytes' block of 64).")
    embeddings: bool = setting(False, "Also quantize a frozen embedding and LM head.")

    def validate(self) -> None:
        positive("quant.group_size", self.group_size)


@dataclass
class ActivationsConfig:
    checkpoint: Literal["none", "recompute", "host", "disk"] = setting(
        "none", "Per-block checkpointing: keep block inputs on the device (recompute), in host RAM, or on disk."
    )
    cache: Literal["none", "small", "last_k"] = setting(
        "none", "Selective cache: nothing, small tensors (no recompute of them), or the last k block inputs on the device."
    )
    last_k: int = setting(2, "cache=last_k: how many of the last blocks keep their input on the device.")
    disk_dir: str | None = setting(None, "checkpoint=disk: where block files go (default: output_dir/activations).")
    seq_tile: int = setting(
        0,
        "Checkpointed blocks run in tiles of this many tokens, forward, recompute and backward (exact: attention runs"
        " each query tile against the whole sequence's keys and values); 0 = auto (tiles whose MLP activations are"
        " about a quarter of a block input, >= 256 tokens, the whole row when shorter; packed rows take shorter"
        " tiles, whose key mask also counts: docs/long-context.md).",
    )
    mlp_chunk: int = setting(
        0, "The former name of seq_tile (the MLP's token chunks are now the block's tiles): read as seq_tile.")

    def validate(self) -> None:
        positive("activations.last_k", self.last_k)
        for name in ("seq_tile", "mlp_chunk"):
            if getattr(self, name) < 0:
                raise UserError(f"activations.{name} must be 0 (auto) or a token count, got {getattr(self, name)}.")
        if self.mlp_chunk and self.seq_tile and self.mlp_chunk != self.seq_tile:
            raise UserError(f"activations.mlp_chunk ({self.mlp_chunk}) is the former name of activations.seq_tile "
                            f"({self.seq_tile}); set seq_tile alone.")

    @property
    def tile(self) -> int:
        """Tokens per tile as set (0: auto), under either name."""
        return self.seq_tile or self.mlp_chunk


@dataclass
class LossConfig:
    mode: Literal["exact", "subset"] = setting(
        "exact", "exact: chunked cross-entropy that never builds T x V logits; subset: softmax over top-k candidates."
    )
    chunk_size: int = setting(0, "Tokens per loss chunk; 0 = auto (chunks whose fp32 logits are about 64 MiB).")
    subset_k: int = setting(1000, "mode=subset: candidates per position (top-k of the frozen head, target included).")
    masking: bool = setting(True, "Only trained (response) positions go through the final norm, head and loss.")

    def validate(self) -> None:
        if self.chunk_size < 0:
            raise UserError(f"loss.chunk_size must be 0 (auto) or a token count, got {self.chunk_size}.")
        positive("loss.subset_k", self.subset_k)


@dataclass
class TrainConfig:
    steps: int = setting(100, "Optimizer steps.")
    batch_size: int = setting(4, "Rows per micro-batch.")
    grad_accum: int = setting(1, "Micro-batches per optimizer step.")
    lr: float = setting(2.0e-4, "Peak learning rate.")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.")
    betas: list[float] = setting([0.9, 0.999], "AdamW betas.")
    eps: float = setting(1.0e-8, "AdamW epsilon.")
    max_grad_norm: float = setting(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    master: Literal["split", "fp32"] = setting(
        "split", "Host optimizers (engines slide, chunk, roundpipe) under precision bf16: split keeps each fp32 master"
                 " as the bf16 weight that goes up plus a 16-bit residual (4 bytes a number, the same updates);"
                 " fp32 keeps it whole beside a bf16 copy (6 bytes).")
    moments: Literal["fp32", "8bit"] = setting(
        "fp32", "Host optimizers' AdamW moments: fp32 (8 bytes a number), or 8-bit blockwise codes as bitsandbytes'"
                " AdamW8bit keeps them (2 bytes a number; the update is approximate, the master stays exact).")
    host_threads: int = setting(
        0, "Threads each host AdamW update runs on (engines slide, chunk, roundpipe, lsp; the native loop, where a C"
           " compiler is found). 0 picks: on a GPU, the cores this process may use, shared among the machine's ranks,"
           " less one for the thread that drives the device; on a CPU run, 1 (the step's compute uses the rest)."
           " A short update takes fewer (65,536 numbers a thread at least). The same bits at any count.")
    schedule: Literal["cosine", "linear", "constant"] = setting("cosine", "Learning-rate decay after warmup.")
    warmup_steps: int = setting(0, "Linear warmup steps from 0 to lr.")
    seed: int = setting(0, "Seed for initialisation, data order and dropout.")
    log_every: int = setting(1, "Write metrics every N steps (and at each evaluation).")
    eval_every: int = setting(0, "Evaluate every N steps (0: only at the end).")
    eval_batches: int = setting(0, "Evaluation batches per evaluation (0: the whole eval split).")
    save_every: int = setting(0, "Checkpoint every N steps (0: only at the end).")
    keep_last: int = setting(2, "Checkpoints kept on disk.")
    resume: bool = setting(True, "Resume from the newest checkpoint in output_dir when one exists.")
    overwrite: bool = setting(
        False, "Start afresh in an output_dir that holds a run: its checkpoints, metrics and result are removed first.")
    on_nonfinite: Literal["stop", "skip"] = setting(
        "stop", "A non-finite loss or gradient norm never updates the weights. stop: end the run, naming the last good"
                " checkpoint; skip: leave that step's update out (counted in metrics.jsonl) and go on.")
    nonfinite_patience: int = setting(3, "on_nonfinite=skip: stop after this many skipped steps in a row.")
    measure_memory: bool = setting(
        True, "Measure each step's device peak (free on CUDA; the CPU meter adds about 15% to a step)."
    )

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_last", "nonfinite_patience"):
            positive(f"train.{name}", getattr(self, name))
        positive("train.lr", self.lr)
        positive("train.eps", self.eps)
        for name in ("weight_decay", "max_grad_norm", "warmup_steps", "eval_every", "eval_batches", "save_every",
                     "host_threads"):
            if getattr(self, name) < 0:
                raise UserError(f"train.{name} must not be negative, got {getattr(self, name)}.")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(f"train.betas must be two numbers in [0, 1), got {self.betas}.")
        if self.warmup_steps > self.steps:
            raise UserError(f"train.warmup_steps ({self.warmup_steps}) exceeds train.steps ({self.steps}).")


_WANDB_FORBIDDEN = set("/\\#?%:")  # characters W&B refuses in a project name


@dataclass
class LogConfig:
    wandb: bool = setting(
        False, "Also log to Weights & Biases (pip install wandb): metrics.jsonl's scalars by step, and the settings.")
    wandb_project: str | None = setting(
        None, "wandb: the W&B project; default: WANDB_PROJECT when set, else 'slimtune'.")
    wandb_mode: Literal["online", "offline"] | None = setting(
        None, "wandb: online, or offline (a local run folder to `wandb sync` later); default: WANDB_MODE, else online.")
    mlflow: bool = setting(
        False, "Also log to MLflow (pip install mlflow; mlflow-skinny for a server): metrics.jsonl's scalars by step,"
               " and the settings.")
    mlflow_tracking_uri: str | None = setting(
        None, "mlflow: where runs are recorded (http://host:5000, sqlite:///mlflow.db, file:/path); default:"
              " MLFLOW_TRACKING_URI, else MLflow's own (sqlite:///mlflow.db; mlflow-skinny cannot open it).")
    mlflow_experiment: str | None = setting(
        None, "mlflow: the experiment (made when missing); default: MLFLOW_EXPERIMENT_NAME when set, else 'slimtune'.")
    run_name: str | None = setting(None, "The run's name in W&B and MLflow; default: the name of output_dir.")

    def validate(self) -> None:
        for name in ("wandb_project", "mlflow_tracking_uri", "mlflow_experiment", "run_name"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise UserError(f"log.{name} is empty; give a name or leave it out for the default.")
        if self.wandb_project is not None and _WANDB_FORBIDDEN & set(self.wandb_project):
            raise UserError(f"log.wandb_project must not contain any of / \\ # ? % :, got {self.wandb_project!r}.")


@dataclass
class DistConfig:
    strategy: Literal["ddp", "fsdp"] = setting(
        "ddp", "Under torchrun (or --nproc): ddp: every rank holds the whole model and its gradients are summed across"
               " ranks; fsdp (engine resident): the blocks' weights, gradients and AdamW state are sharded across ranks"
               " (FSDP2), the embedding, final norm and head too (a tied pair as one tensor).")
    param_dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "fsdp: the dtype weights are gathered and computed in (FSDP2's MixedPrecisionPolicy.param_dtype); auto:"
                " bf16 under precision=bf16, else the weights' own. The sharded master weights and AdamW stay fp32.")
    reduce_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "fsdp with bf16 gathers: the dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype);"
                " bf16 halves that traffic and rounds the sum.")
    offload: Literal["none", "cpu"] = setting(
        "none", "fsdp: cpu keeps every weight's shard, its gradient and AdamW's moments in host RAM and runs AdamW there"
                " (FSDP2's CPUOffloadPolicy); the device holds the weights gathered for the block at work and the"
                " activations.")
    timeout_s: float = setting(
        600.0, "Under torchrun: how long a rank waits for the others (a collective, or rank 0 writing a checkpoint)"
               " before the run ends on every rank with a message.")

    def validate(self) -> None:
        positive("dist.timeout_s", self.timeout_s)
        for name, default in (("param_dtype", "auto"), ("reduce_dtype", "fp32"), ("offload", "none")):
            if self.strategy != "fsdp" and getattr(self, name) != default:
                raise UserError(f"dist.{name} sets how FSDP gathers and reduces: it needs dist.strategy=fsdp (it is"
                                f" {self.strategy}).")


@dataclass
class RunConfig:
    model: str = setting(REQUIRED, "A local Hugging Face model folder (config.json, *.safetensors, tokenizer files),"
                                   " or a Hub name (org/name), fetched into the Hub cache.")
    data: DataConfig = setting(REQUIRED, "The dataset; see data.* fields.")
    model_revision: str | None = setting(
        None, "model is a Hub name: the branch, tag or commit to fetch (default: main); the commit resolved is"
              " recorded in run.json and checked on resume.")
    method: Literal["lora", "full"] = setting("lora", "lora: train adapters on a frozen base; full: train every weight.")
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA settings; see lora.* fields."})
    freeze: list[str] = setting([], "full: parameter name patterns (fnmatch) to keep frozen, e.g. ['*embed_tokens*'].")
    quant: QuantConfig = field(default_factory=QuantConfig, metadata={"help": "4-bit base; see quant.* fields."})
    activations: ActivationsConfig = field(
        default_factory=ActivationsConfig, metadata={"help": "Checkpointing; see activations.* fields."}
    )
    loss: LossConfig = field(default_factory=LossConfig, metadata={"help": "The loss; see loss.* fields."})
    engine: str = setting("resident", "How the step is run: one of the registered engines (listed below with their sections).")
    sections: dict[str, Any] = field(default_factory=dict, metadata={"help": "", "internal": True})
    plan: Literal["manual", "auto"] = setting(
        "manual", "auto: let the planner choose engine and options for `gpu` (see `slimtune plan`)."
    )
    gpu: str | None = setting(
        None, "plan=auto: the card to plan for: a name (rtx4090, a100-80gb, ...), a size (8GiB) or a probe JSON."
    )
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimisation; see train.* fields."})
    output_dir: str = setting("runs/slimtune", "Where checkpoints, metrics, plots and the result go.")
    log: LogConfig = field(
        default_factory=LogConfig, metadata={"help": "Logging beside metrics.jsonl and TensorBoard; see log.* fields."})
    dist: DistConfig = field(
        default_factory=DistConfig, metadata={"help": "Several processes (torchrun, --nproc); see dist.* fields."})
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: CUDA when present, else the CPU.")
    precision: Literal["auto", "fp32", "bf16", "fp64"] = setting(
        "auto",
        "auto: bf16 on a CUDA card with bf16 arithmetic (Ampere on), else fp32. bf16: autocast, trained weights"
        " fp32, a frozen LoRA base stored in bf16. fp64 is for tests.",
    )

    def __post_init__(self) -> None:
        self.sections = dict(self.sections)  # its own: dataclasses.replace hands the same dict on

    def section(self, engine: str) -> Any:
        """The settings section of `engine` (e.g. cfg.section("slide").slots)."""
        return self.sections[engine]

    def check_sections(self) -> None:
        """Each section's own check, an engine's section checked like the others. The checks across
        sections and of the engine need the registered engines: engines.settings.validate."""
        named = {"model": (self.model, "a model folder or a Hub name"),
                 "data.path": (self.data.path, "a data file, a folder or a Hub dataset"),
                 "output_dir": (self.output_dir, "the run's folder")}
        for key, (value, what) in named.items():
            if isinstance(value, str) and not value.strip():  # '' is the current folder, or a reader's cryptic error
                raise UserError(f"{key} is empty; name {what}.")
        for section in (self.data, self.lora, self.quant, self.activations, self.loss, self.train, self.log,
                        self.dist, *self.sections.values()):
            section.validate()


def positive(name: str, value: float) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}.")


# ---------------------------------------------------------------- loading


NO_SECTIONS: Mapping[str, type] = types.MappingProxyType({})
COMMAND_LINE = "on the command line"  # where an override was given (Sources' place)


@dataclass(frozen=True)
class Read:
    """Settings as read: the RunConfig (engine sections: those given), and the dotted keys the user
    gave in the file or an override (not in `base`), the innermost of each, in order."""

    cfg: RunConfig
    given: list[str]
    typed: list[str] = dataclasses.field(default_factory=list)  # those of `given` given on the command line


def read(path: str | Path | None, overrides: list[str] = (), base: dict | None = None,
         sections: Mapping[str, type] = NO_SECTIONS) -> Read:
    """Read YAML (or start from `base`), apply `a.b=value` overrides, and type them into a RunConfig:
    an unknown key or a wrong type is refused in a sentence naming the key where the user gave it (the
    YAML file's line, or the command line). `sections` (engine name -> its settings dataclass) are the
    engine sections the settings may hold, handed in by the caller: this module knows no engine.
    Nothing is checked beyond the types; engines.settings.load completes and validates."""
    raw = copy.deepcopy(base or {})  # overrides write into nested sections: never into the caller's
    sources = Sources(f"in {path}" if path is not None else "in the settings given")
    if path is not None:
        raw = _read_yaml(Path(path), sources)
    for item in overrides:
        _apply_override(raw, item, sources)
    given = sources.given()
    return Read(from_dict(RunConfig, raw, prefix="", sources=sources, sections=sections), given,
                [key for key in given if sources.of(key) == COMMAND_LINE])


def _read_yaml(path: Path, sources: Sources) -> dict:
    if path.is_dir():
        inside = " (a run's folder: its settings are in config.yaml there)" if (path / "config.yaml").is_file() else ""
        raise UserError(f"config file '{path}' is a folder, not a YAML file{inside}.")
    if not path.is_file():
        raise UserError(local_paths.missing("config file", path))
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise UserError(f"{path} line {line}: not UTF-8 text (byte 0x{err.object[err.start]:02x}); save it as"
                        " UTF-8.") from None
    except OSError as err:
        raise UserError(f"config file '{path}' cannot be read ({err.strerror or err}).") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)}).") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a mapping of settings at the top level.")
    sources.note_lines(yaml.compose(text, Loader=yaml.SafeLoader), "", path)
    return raw


def _apply_override(raw: dict, item: str, sources: Sources) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise UserError(f"override '{item}' must look like a.b=value.")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError as err:
        if "*" in text:  # freeze=[*embed_tokens*] or freeze=*embed*: YAML reads a bare * as an alias
            items = ", ".join(f"'{i.strip()}'" for i in text.strip().strip("[]").split(",") if i.strip())
            raise UserError(f"override '{item}': quote each pattern, as {key}=\"[{items}]\" (YAML reads a bare *"
                            f" as an alias: {getattr(err, 'problem', err)}).") from None
        value = text
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if depth == 0 and part == "data" and isinstance(child, str):  # the shorthand `data: FILE` (_coerce)
            child = node[part] = {"path": child}
        if not isinstance(child, dict):
            raise UserError(f"override '{item}': '{part}' is not a section.")
        node = child
    node[parts[-1]] = value
    sources.give(key, COMMAND_LINE, text)


def _inside(key: str, known: Mapping[str, tuple]) -> list[str]:
    """`key` as a setting of a section here (`steps` -> train.steps, `rank` -> lora.rank): a key given
    without its section, said before any look-alike of this level's names."""
    return [f"{name}.{key}" for name, (hint, _) in known.items()
            if dataclasses.is_dataclass(hint) and key in {f.name for f in dataclasses.fields(hint)}]


def from_dict(cls: type, raw: Any, prefix: str, sources: Sources,
              sections: Mapping[str, type] = NO_SECTIONS) -> Any:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types by name and place;
    a RunConfig also reads the engine `sections` named (into cfg.sections)."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise UserError(f"{where} {sources.of(prefix.rstrip('.'))} must be a mapping, got {type(raw).__name__}.")
    known = _keys_of(cls, sections)
    for key in raw:
        if key not in known:
            close = _inside(str(key), known) or [prefix + c for c in difflib.get_close_matches(str(key), known, n=1)]
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            raise UserError(f"unknown key '{prefix}{key}' {sources.of(f'{prefix}{key}')}{hint}.")
    values, given_sections = {}, {}
    for name, (hint, required) in known.items():
        if name in raw:
            value = _coerce(hint, raw[name], prefix + name, sources)
            (given_sections if name in sections else values)[name] = value
        elif required:
            raise UserError(f"missing required key '{prefix}{name}' {sources.default}.")
    return cls(**values, sections=given_sections) if cls is RunConfig else cls(**values)


def _keys_of(cls: type, sections: Mapping[str, type] = NO_SECTIONS) -> dict[str, tuple[Any, bool]]:
    """key -> (type, required) of what `cls` reads: its fields, and for RunConfig the engine
    `sections`, right after `engine`."""
    hints = typing.get_type_hints(cls)
    keys = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        keys[f.name] = (hints[f.name], f.default is REQUIRED and f.default_factory is REQUIRED)
        if cls is RunConfig and f.name == "engine":
            keys.update((name, (section, False)) for name, section in sections.items())
    return keys


def _coerce(hint: Any, value: Any, key: str, sources: Sources) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, str) and key == "data":
            value = {"path": value}
        return from_dict(hint, value, key + ".", sources)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(hint), value, key, sources)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise UserError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}.")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, got {value!r}.")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    if hint is str and isinstance(value, (int, float)) and key in sources.texts:
        value = sources.texts[key]  # a text setting as written: output_dir=0755 (YAML reads 493), a name "2024"
    return _coerce_scalar(hint, value, key)


def _coerce_union(options: tuple, value: Any, key: str, sources: Sources) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            return _coerce(option, value, key, sources)
        except UserError as err:
            errors.append(str(err))
    raise UserError(errors[0] if len(errors) == 1 else f"{key} has the wrong type: {value!r}.")


def _coerce_scalar(hint: type, value: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # nan and inf pass every comparison check below them
                raise UserError(f"{key} must be a finite number, got {value!r}.")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise UserError(f"{key} must be {names.get(hint, hint)}, got {value!r}.")


def to_dict(cfg: RunConfig) -> dict:
    """The settings as a plain mapping, engine sections at the top level (as a YAML file holds them),
    so `load(None, base=to_dict(cfg))` gives cfg back."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name == "sections":
            continue
        value = getattr(cfg, f.name)
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
        if f.name == "engine":
            out.update((name, dataclasses.asdict(section)) for name, section in cfg.sections.items())
    return out


def flatten(settings: dict, prefix: str = "") -> dict:
    """Nested settings as one mapping of dotted keys ('train.lr'), as overrides name them."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def help_text(cls: type = RunConfig, prefix: str = "", summaries: Mapping[str, str] = NO_SECTIONS,
              sections: Mapping[str, type] = NO_SECTIONS, width: int | None = None) -> list[str]:
    """One entry per key: key, default, help, in columns as wide as the longest key and default (at most
    DEFAULT_COLUMN); sections expanded. For RunConfig, the engines (`summaries`: name -> one line) are
    listed under `engine` and their `sections` expanded there. `width`: wrap each help to that many
    columns, its lines under the help's column (an entry is then several lines, joined by newlines)."""
    rows = _help_rows(cls, prefix, summaries, sections)
    key_width = max(len(indent + key) for indent, key, _, _ in rows)
    default_width = min(max(len(default) for _, _, default, _ in rows), DEFAULT_COLUMN)
    lines = []
    for indent, key, default, text in rows:
        head = f"  {indent + key:<{key_width}} {default:<{default_width}} "
        wrapped = textwrap.wrap(text, max(width - len(head), 30)) if width and text else [text]
        lines.append(head + f"\n{' ' * len(head)}".join(wrapped))
    return lines


DEFAULT_COLUMN = 18  # a longer default (a list, a long string) pushes its own help along, not every row's


def _help_rows(cls: type, prefix: str, summaries: Mapping[str, str],
               sections: Mapping[str, type]) -> list[tuple[str, str, str, str]]:
    """(indent, key, default, help) of every key, sections expanded, engines listed under `engine`."""
    rows = []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, (hint, _) in _keys_of(cls, sections).items():
        if dataclasses.is_dataclass(hint):
            rows.extend(_help_rows(hint, prefix + name + ".", NO_SECTIONS, NO_SECTIONS))
            continue
        f = fields[name]
        if f.default is not REQUIRED:
            default = repr(f.default)
        elif f.default_factory is not REQUIRED:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append(("", prefix + name, default, f.metadata.get("help", "")))
        if cls is RunConfig and name == "engine":
            rows += [("  ", engine, "(an engine)", summary) for engine, summary in summaries.items()]
    return rows
