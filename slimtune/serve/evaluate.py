"""`slimtune eval`: a model's loss, perplexity and exact-match rate on a data file.

Loss and perplexity: the file is read, tokenized and batched as training reads its evaluation split
(data.load_splits with nothing held out, data.eval_batches), and each batch's loss is the one the
trainer evaluates (step.forward.model_loss: the whole model, the exact cross-entropy over the
trained tokens). loss = summed loss / trained tokens, perplexity = exp(loss), as train.evaluate.

Exact match (prompt_response and chat data): the greedy answer to each prompt, decoded without
special tokens, equals the reference, both stripped of surrounding white space; the demo's measure
(slimtune.demo.accuracy is `exact_match`). A prompt_response prompt is encoded as training encodes
it (data.encode_prompt); a chat record is answered at its last assistant turn, from the turns
before it rendered up to the generation prompt. Answers get, unless told, the longest reference's
token count plus ANSWER_SLACK new tokens: a longer answer could not match.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

import torch

from slimtune.data import dataset as data
from slimtune.serve import inference
from slimtune import config, progress
from slimtune.config import DataConfig
from slimtune.errors import UserError

FORMATS = ("text", "prompt_response", "chat")
ANSWER_SLACK = 16


@dataclass
class EvalData:
    cfg: DataConfig
    batches: list[data.Batch]
    examples: int
    tokens: int  # trained tokens: what the loss averages over
    truncated: int
    cases: list[tuple[list[int], str]] | None  # (prompt ids, reference answer); None for text data


# What the data is and what training held out of it: --data names the one and eval holds out nothing.
NOT_EVAL_SETTINGS = frozenset({"data.path", "data.eval_path", "data.eval_split", "data.eval_fraction"})


def data_config(source: inference.Source, path: str, fmt: str | None, overrides: list[str] = ()) -> DataConfig:
    """The data settings of `path`: the run's own (fields, template, max_length, packing), with
    `fmt` when given (default: the run's format, else prompt_response) and `data.key=value` overrides
    (an eval file whose fields are named otherwise than the run's, a split: data.split=test); all of
    `path` scored, nothing held out. The run's subset is kept where `path` is the run's own dataset;
    its splits are not (they named what it trained and evaluated on, and a file has none)."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    settings = {k: v for k, v in source.data.items() if k in known}
    subset = settings.get("subset") if settings.get("path") == str(path) else None
    settings.update(path=str(path), subset=subset, split=None, eval_path=None, eval_split=None, eval_fraction=0.0)
    if fmt is not None:
        settings["format"] = fmt
    outside = [item for item in overrides if not item.startswith("data.")]
    if outside:
        raise UserError(f"'{outside[0]}': eval takes data.* settings only (the fields, template and lengths of"
                        " --data), e.g. data.prompt_field=question.")
    held = next((item for item in overrides if item.split("=", 1)[0] in NOT_EVAL_SETTINGS), None)
    if held is not None:
        raise UserError(f"'{held}': eval scores all of --data, held out nothing; name the file with --data, and a"
                        " split of a dataset with data.split (e.g. data.split=test).")
    if overrides:  # typed and checked as train's overrides are
        settings = config.to_dict(config.read(None, list(overrides), base={"model": "-", "data": settings}).cfg)["data"]
    cfg = DataConfig(**settings)
    if cfg.format not in FORMATS:
        raise UserError(f"data format '{cfg.format}' is not one of {', '.join(FORMATS)}.")
    cfg.validate()
    return cfg


def prepare(cfg: DataConfig, tokenizer, batch_size: int, shown: progress.Mode = "none") -> EvalData:
    """The batches the loss is over and the cases answered: the same records, read once (a Hub dataset
    that cannot be reached is read by a process of its own: once, and said once)."""
    records = data.read_records(data.Where(cfg.path, cfg.subset, cfg.split, path_setting="--data"))
    splits = data.load_splits(cfg, tokenizer, seed=0, shown=shown, records=records)
    examples = splits.train  # eval_fraction 0: every record
    batches = data.eval_batches(examples, batch_size, cfg.max_length, cfg.packing, tokenizer.pad_token_id)
    cases = None if cfg.format == "text" else answer_cases(cfg, tokenizer, *records)
    return EvalData(cfg, batches, len(examples), sum(b.num_targets for b in batches), splits.report.truncated, cases)


def answer_cases(cfg: DataConfig, tokenizer, rows: list, where) -> list[tuple[list[int], str]]:
    """(prompt ids, reference answer) of every record (`where` names record i); load_splits has checked
    their fields."""
    cases = []
    for i, row in enumerate(rows):
        if cfg.format == "prompt_response":
            cases.append((data.encode_prompt(tokenizer, row[cfg.prompt_field]), row[cfg.response_field]))
            continue
        messages = data.messages_field(row, cfg.messages_field, functools.partial(where, i))  # noqa: SLF001
        last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
        if last == 0:  # an assistant turn with nothing before it answers no prompt
            continue
        prompt = data.render_chat_prompt(tokenizer, messages[:last], cfg.chat_template)
        cases.append((data.encode_prompt(tokenizer, prompt), messages[last]["content"]))
    return cases


def default_new_tokens(tokenizer, cases: list[tuple[list[int], str]]) -> int:
    longest = max((len(tokenizer(ref, add_special_tokens=False)["input_ids"]) for _, ref in cases), default=0)
    return longest + ANSWER_SLACK


def exact_match(model: torch.nn.Module, tokenizer, device: torch.device, cases: list[tuple[list[int], str]],
                batch_size: int = 50, max_new_tokens: int = 24, precision: str = "fp32",
                shown: progress.Mode = "none") -> float:
    """The share of `cases` (prompt ids, reference) whose greedy answer equals the reference, both stripped."""
    answers = inference.greedy_answers(model, tokenizer, device, [ids for ids, _ in cases], max_new_tokens,
                                       batch_size, precision, shown)
    return sum(a.strip() == ref.strip() for a, (_, ref) in zip(answers, cases)) / max(len(cases), 1)


def loss_sum(loaded: inference.Loaded, batches: list[data.Batch], shown: progress.Mode = "none") -> tuple[float, int]:
    """(summed loss, trained tokens) over `batches`, as the trainer evaluates them."""
    from slimtune.config import ActivationsConfig, LossConfig
    from slimtune.step.forward import evaluate_batches, model_loss
    from slimtune.model.stack import Stack

    stack, activations, loss = Stack(loaded.model), ActivationsConfig(), LossConfig()
    return evaluate_batches(progress.shown(batches, "eval: loss", "batch", shown, "batches"),
                            lambda b: model_loss(stack, activations, loss, loaded.device, loaded.precision,
                                                 b.to(loaded.device), training=False).exact_sum)


def score(loaded: inference.Loaded, prepared: EvalData, batch_size: int, max_new_tokens: int | None,
          shown: progress.Mode = "none") -> dict:
    """eval_loss, eval_ppl and (prompt_response, chat) exact_match of one model."""
    total, tokens = loss_sum(loaded, prepared.batches, shown)
    loss = total / max(tokens, 1)
    figures = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
    if prepared.cases:
        figures["exact_match"] = exact_match(loaded.model, loaded.tokenizer, loaded.device, prepared.cases,
                                             batch_size, max_new_tokens, loaded.precision, shown)
    return figures


def report(prepared: EvalData, max_new_tokens: int | None, scores: dict[str, dict]) -> dict:
    """Everything eval says: the data, how answers were made, and each model's figures by name."""
    answers = len(prepared.cases) if prepared.cases is not None else None
    return {"data": prepared.cfg.path, "format": prepared.cfg.format, "examples": prepared.examples,
            "trained_tokens": prepared.tokens, "truncated": prepared.truncated, "answers": answers,
            "max_new_tokens": max_new_tokens if answers else None, **scores}


def table(found: dict, names: list[str]) -> str:
    from slimtune.run.metrics import format_table

    def cells(key: str, show) -> str:
        return "".join(f"{show(found[n][key]) if key in found[n] else '-':>12}" for n in names)

    truncated = f", {found['truncated']} truncated" if found["truncated"] else ""
    rows = [("data", f"{found['data']} ({found['format']}: {found['examples']} examples, "
                     f"{found['trained_tokens']:,} trained tokens{truncated})"),
            ("", "".join(f"{n:>12}" for n in names)),
            ("eval loss", cells("eval_loss", lambda v: f"{v:.4f}")),
            ("perplexity", cells("eval_ppl", lambda v: f"{v:,.2f}"))]
    if found["answers"]:
        rows.append(("exact match", cells("exact_match", lambda v: f"{v:.1%}")))
        rows.append(("answers", f"{found['answers']} greedy, at most {found['max_new_tokens']} new tokens each"))
    return format_table(rows)


def to_json(found: dict) -> str:
    return json.dumps(found, indent=2)
