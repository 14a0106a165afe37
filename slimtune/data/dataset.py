"""Datasets -> token examples -> training batches.

Records come from a .jsonl/.json/.csv/.parquet file, a `save_to_disk` folder, a folder laid out as a
Hub dataset repository or a Hub dataset by name (repository.py: data.subset, data.split, data.eval_split),
read through Hugging Face `datasets`; CSV cells are text exactly as written (an empty cell is "").
Each becomes an `Example` whose targets are already shifted (`targets[t]` is token t+1
when that token is trained, else IGNORE_INDEX), so a packed row never asks one example to
predict the first token of the next.

Trained tokens: prompt_response trains the response and eos after encode_prompt(prompt);
text trains everything after the bos; chat trains each assistant turn's content and the
end-of-turn marker the template writes after it.

Chat template: data.chat_template (Jinja text or a file path), else the tokenizer's own,
else DEFAULT_CHAT_TEMPLATE, which writes each turn as `<|role|>`, a newline, the content,
then a newline (system, user) or the eos token (assistant); its generation prompt is
`<|assistant|>\\n`:

    <|system|>\\nBe terse.\\n<|user|>\\nHi\\n<|assistant|>\\nHello.</s><|user|>\\n...

Rendered text is tokenized without special tokens and gets a bos in front only when the
tokenizer adds one by default and the text lacks it. `encode_prompt` follows the same
rule, so generation sees exactly the training prefix.

BatchStream packs examples greedily into rows of at most max_length tokens; position ids
restart at 0 at every example, which is how the model keeps attention inside one.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from slimtune import local_paths
from slimtune.data import repository
from slimtune.data.chat_templates import assistant_spans, render, resolve_template
from slimtune.data.repository import Where
from slimtune import progress
from slimtune.config import DataConfig
from slimtune.errors import UserError
from slimtune.device.memory import mark_host_resident

IGNORE_INDEX = -100

_ROLES = ("system", "user", "assistant")
_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Example:
    input_ids: list[int]
    targets: list[int]  # same length; shifted; IGNORE_INDEX where the next token is not trained


def trained_positions(targets: torch.Tensor) -> torch.Tensor:
    """targets (B, T) -> (N,) long flat indices into B*T of the trained positions. Found when a
    batch is built, on real tensors: the output's shape depends on values."""
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    targets: torch.Tensor  # (B, T) long, IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # (B, T) long, 0 at every example start; the padding tail continues its row
    # Trained positions (targets != IGNORE_INDEX): their flat indices into (B*T) and their count,
    # found once here so that engines never read a tensor value mid-step (fake tensors, used by
    # the planner's estimate, cannot answer, and data-dependent shapes cannot be traced).
    trained_positions: torch.Tensor | None = None  # (N,) long
    num_targets: int = -1
    # Some row holds several examples (its position ids restart): attention needs a block-diagonal
    # mask, a (B, 1, T, T) tensor. Otherwise plain causal attention needs none (SDPA's is_causal).
    segmented: bool | None = None

    def __post_init__(self) -> None:
        if self.trained_positions is None:
            self.trained_positions = trained_positions(self.targets)
        if self.num_targets < 0:
            self.num_targets = int(self.trained_positions.numel())
        if self.segmented is None:
            plain = torch.arange(self.position_ids.shape[-1], device=self.position_ids.device)
            self.segmented = bool((self.position_ids != plain).any())

    def to(self, device: Any) -> Batch:
        """The batch on `device`: always a copy, as a host-to-GPU copy is, of a batch in host memory
        (marked so), so the device meter counts the copy alike on the CPU, under fake tensors and on a GPU."""
        moved = (mark_host_resident(t).to(device, copy=True)
                 for t in (self.input_ids, self.targets, self.position_ids, self.trained_positions))
        return Batch(*moved, num_targets=self.num_targets, segmented=self.segmented)


@dataclass
class DataReport:
    train_examples: int
    eval_examples: int
    truncated: int
    dropped: int  # examples with no trainable token left after truncation
    max_length: int | None = None
    empty: int = 0  # examples with no token to train at any length (e.g. an empty text without a bos)
    engine_sample: int = 0  # of train_examples, held out as the engine's own sample (lsp's fit sample)

    def summary(self) -> str:
        limit = f" to {self.max_length} tokens" if self.max_length else ""
        counts = f"{self.truncated} truncated{limit}; {self.dropped} dropped (truncation left no trainable token)"
        counts += f"; {self.empty} dropped (empty: no token to train)" if self.empty else ""
        trained = f"{self.train_examples - self.engine_sample} train"
        if self.engine_sample:
            trained += f" (and {self.engine_sample} held out as the engine's own sample)"
        return f"{trained} / {self.eval_examples} eval examples; {counts}"


@dataclass
class Splits:
    train: list[Example]
    eval: list[Example]
    report: DataReport


def load_splits(cfg: DataConfig, tokenizer: Any, seed: int, shown: progress.Mode = "none",
                records: tuple[list[Any], Callable[[int], str]] | None = None) -> Splits:
    """Read, tokenize, truncate and split the data named by `cfg`; `shown`: how the tokenizing is
    shown when it takes a while (slimtune/progress.py); `records`: what read_records gave for cfg's
    path, subset and split, where the caller has read them already."""
    encoder = _Encoder(cfg, tokenizer)
    counts = {"truncated": 0, "dropped": 0, "empty": 0}
    train = _load_examples(Where(cfg.path, cfg.subset, cfg.split), encoder, cfg.max_length, counts, shown, records)
    if not train:
        raise UserError(_nothing_to_train(cfg, counts))
    if cfg.eval_path or cfg.eval_split:
        held_out = _load_examples(_evaluation(cfg), encoder, cfg.max_length, counts, shown)
    else:
        train, held_out = _hold_out(train, cfg.eval_fraction, seed)
    report = DataReport(len(train), len(held_out), counts["truncated"], counts["dropped"], cfg.max_length,
                        counts["empty"])
    return Splits(train, held_out, report)


def _evaluation(cfg: DataConfig) -> Where:
    """The evaluation data: eval_path (its eval_split when set), else the eval_split of path (its subset)."""
    if cfg.eval_path:
        return Where(cfg.eval_path, None, cfg.eval_split, "data.eval_path", "data.eval_split")
    return Where(cfg.path, cfg.subset, cfg.eval_split, "data.path", "data.eval_split")


def _nothing_to_train(cfg: DataConfig, counts: dict) -> str:
    """Why no record of cfg.path is usable: truncation, records with nothing to train, or both."""
    if not counts["dropped"]:
        return f"no record in {cfg.path} has a token to train: every one is empty."
    empty = f" ({counts['empty']} had none to begin with)" if counts["empty"] else ""
    return f"no record in {cfg.path} keeps a trainable token within data.max_length={cfg.max_length}{empty}."


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt ids exactly as training sees them: (bos) + prompt without special tokens."""
    return _with_bos(tokenizer(prompt, add_special_tokens=False)["input_ids"], _bos_to_add(tokenizer))


def render_chat_prompt(tokenizer: Any, messages: list[dict], template: str | None) -> str:
    """The conversation up to the assistant's generation prompt; `encode_prompt` it for generation."""
    return render(tokenizer, resolve_template(tokenizer, template), messages, True, "the conversation")


def _bos_to_add(tokenizer: Any) -> int | None:
    # Tokenizers differ (Llama adds bos, Qwen does not); ask the tokenizer rather than guess.
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"] if bos is not None else []
    return bos if ids[:1] == [bos] else None


def _with_bos(ids: list[int], bos: int | None) -> list[int]:
    # A chat template may already have written the bos as text; never put in a second one.
    return [bos] + ids if bos is not None and ids[:1] != [bos] else ids


def read_records(source: str | Where) -> tuple[list[Any], Callable[[int], str]]:
    """The records of a path, a folder or a Hub dataset (one split of one subset), and a function naming
    record i for messages: file line where lines mean something."""
    where = source if isinstance(source, Where) else Where(str(source), None, None)
    path, p = where.path, Path(where.path)
    if not p.exists():
        if repository.is_hub_dataset(path):
            return repository.load(where), _where(f"{path} [{where.split or 'train'}]", None)
        raise UserError(local_paths.missing(_what(where), path))
    if p.is_dir():
        if repository.is_saved(p):
            return repository.load_saved(where), _where(path, None)
        return repository.load(where), _where(f"{path} [{where.split or 'train'}]", None)
    repository.refuse_splits_of_a_file(where)
    kind = _LOADERS.get(p.suffix.lower())
    if kind is None:
        raise UserError(f"{_what(where)} '{path}' has an unknown extension; use {', '.join(_LOADERS)} or a folder.")
    if kind == "json":
        return _read_json(p, path)
    lines = _csv_lines(p) if kind == "csv" else None
    if (len(lines) if lines is not None else _parquet_rows(p)) == 0:  # datasets' own message is cryptic
        raise UserError(f"{_what(where)} '{path}' holds no records.")
    return _load_file(kind, p, f"{_what(where)} '{path}'"), _where(path, lines)


def _what(where: Where) -> str:
    """How a sentence names the data: 'data path' for the training data, the setting for the rest
    (data.eval_path), so that an empty or missing evaluation file is not taken for the training data."""
    return "data path" if where.path_setting == "data.path" else where.path_setting


def _where(label: str, lines: list[int] | None) -> Callable[[int], str]:
    return lambda i: f"{label} line {lines[i]}" if lines else f"{label} record {i + 1}"


def _parquet_rows(p: Path) -> int | None:
    import pyarrow.parquet as pq

    with contextlib.suppress(Exception):  # a broken file is reported by the loader
        return pq.read_metadata(p).num_rows


def _read_json(p: Path, label: str) -> tuple[list[Any], Callable[[int], str]]:
    """Parse JSON ourselves first so a bad record is named by line; then load via datasets."""
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: tolerate a byte-order mark
    except UnicodeDecodeError as err:
        raise UserError(f"{label} is not UTF-8 text ({err}).") from None
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        rows, lines = _scan_json_array(text, label)
    else:
        try:
            rows, lines = _scan_json_lines(text, label)
        except UserError:
            _refuse_one_object(text, label)
            raise
    with contextlib.suppress(UserError):  # datasets refuses some valid JSON; our parse is the same data
        loaded = _load_file("json", p, f"data file '{label}'") if rows else []
        rows = loaded if len(loaded) == len(rows) else rows
    return rows, _where(label, lines)


def _parse_json(text: str, label: str, first_line: int = 1) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        line = first_line + err.lineno - 1
        raise UserError(f"{label} line {line}: not valid JSON ({err.msg} at column {err.colno}).") from None


def _scan_json_lines(text: str, label: str) -> tuple[list[Any], list[int]]:
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line breaks verbatim.
    numbered = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    return [_parse_json(line, label, n) for n, line in numbered], [n for n, _ in numbered]


def _scan_json_array(text: str, label: str) -> tuple[list[Any], list[int]]:
    rows = _parse_json(text, label)
    # Walk the array once more to learn the line each element starts on.
    decoder, lines, pos = json.JSONDecoder(), [], text.index("[") + 1
    for _ in rows:
        while text[pos] in " \t\r\n,":
            pos += 1
        lines.append(text.count("\n", 0, pos) + 1)
        pos = decoder.raw_decode(text, pos)[1]
    return rows, lines


def _refuse_one_object(text: str, label: str) -> None:
    """A file that is one JSON object over several lines (`{"data": [...]}`, pretty-printed) is valid JSON but
    no records: said so, naming where its records may be, rather than "not valid JSON" at its first line."""
    try:
        whole = json.loads(text)
    except ValueError:
        return
    if isinstance(whole, dict):
        lists = [str(k) for k, v in whole.items() if isinstance(v, list)]
        inside = f"; its records may be the list under {', '.join(repr(k) for k in lists)}" if lists else ""
        raise UserError(f"{label} holds one JSON object, not records: give a list of records (.json) or one record"
                        f" a line (.jsonl){inside}.")


def _csv_lines(p: Path) -> list[int]:
    """The line each CSV record starts on (header = line 1); quoted fields may span lines."""
    with open(p, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        next(reader, None)
        starts, previous = [], reader.line_num
        for row in reader:
            if row and (len(row) > 1 or row[0].strip()):  # pandas skips blank lines (or white space alone)
                starts.append(previous + 1)
            previous = reader.line_num
    return starts


def _load_file(kind: str, p: Path, named: str) -> list[Any]:
    # A throwaway cache dir keeps datasets from writing arrow files into the user's home.
    with repository.quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="slimtune-data-") as cache:
        try:
            options = _csv_as_text(p) if kind == "csv" else {}
            ds = datasets.load_dataset(kind, data_files=str(p), split="train", cache_dir=cache, keep_in_memory=True,
                                       **options)
            return ds.to_list()
        except Exception as err:  # noqa: BLE001 - any reader failure is a property of the user's file
            raise UserError(f"{named} could not be read as {kind} ({repository.cause(err)}).") from None


def _csv_as_text(p: Path) -> dict:
    """load_dataset options that read every CSV cell as the text written there. Left alone, pandas
    guesses a type per column and chunk ("007" -> 7, " 4" -> 4, and "12" -> 12.0 in a column with an
    empty cell) and reads empty cells and words like NA, null or None as missing values. An empty
    cell is the empty string, as "" is in JSON."""
    import datasets
    import pandas as pd

    names = pd.read_csv(p, nrows=0).columns  # pandas' own header reading: the builder's column names
    return {"features": datasets.Features({str(n): datasets.Value("string") for n in names}), "na_filter": False}


def _load_examples(source: Where, encoder: _Encoder, max_length: int, counts: dict,
                   shown: progress.Mode = "none", records: tuple | None = None) -> list[Example]:
    rows, where = records if records is not None else read_records(source)
    if not rows:
        raise UserError(f"{_what(source)} '{source.path}' holds no records.")
    _refuse_absent_fields(rows, encoder.fields(), f"{_what(source)} '{source.path}'")
    examples = []
    for i, row in enumerate(progress.shown(rows, f"tokenizing {source.path}", "record", shown)):
        ids, trained = encoder.encode(row, functools.partial(where, i))
        counts["truncated"] += len(ids) > max_length
        example = _shifted(ids[:max_length], trained[:max_length])
        if example is None:  # the first token is never a target, so trained[0] alone trains nothing
            counts["dropped" if any(trained[1:]) else "empty"] += 1
        examples += [example] if example is not None else []
    return examples


def _refuse_absent_fields(rows: list[Any], fields: dict[str, str], named: str) -> None:
    """One sentence for a field no record has (a field named otherwise in this file), before the
    per-record check would blame the first record alone. Loaders give every record every column, so a
    record's own absent field reads as null there and is told apart by this file-wide check only."""
    present = set().union(*(row.keys() for row in rows if isinstance(row, dict)))
    if not present:
        return  # no record is an object: encode() names the first one
    for setting, name in fields.items():
        if name not in present:
            raise UserError(f"no record of {named} has a field '{name}' (its fields: "
                            f"{', '.join(sorted(map(str, present)))}); name the one to use with {setting}=...")


def _shifted(ids: list[int], trained: list[bool]) -> Example | None:
    """Targets[t] = ids[t+1] where token t+1 is trained; None when nothing is trained."""
    targets = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    targets.append(IGNORE_INDEX)
    return Example(ids, targets) if any(t != IGNORE_INDEX for t in targets) else None


def _hold_out(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    n = len(examples)
    # At least one held out when asked for any, and always one left to train on (n >= 1 here).
    k = min(max(round(fraction * n), int(fraction > 0)), n - 1)
    held = set(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].tolist())
    # Both sides keep file order; the training stream does its own shuffling.
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


class _Encoder:
    """One record -> (ids, trained flags) for the configured format."""

    def __init__(self, cfg: DataConfig, tokenizer: Any):
        self.cfg, self.tok, self.bos, self.eos = cfg, tokenizer, _bos_to_add(tokenizer), tokenizer.eos_token_id
        if self.eos is None:
            raise UserError("the tokenizer has no eos token; slimtune ends every trained example with one.")
        self.template = resolve_template(tokenizer, cfg.chat_template) if cfg.format == "chat" else None

    def fields(self) -> dict[str, str]:
        """The fields a record of this format must have, by the setting that names each."""
        names = {"chat": ["messages_field"], "text": ["text_field"]}.get(self.cfg.format,
                                                                          ["prompt_field", "response_field"])
        return {f"data.{n}": getattr(self.cfg, n) for n in names}

    def encode(self, row: Any, where) -> tuple[list[int], list[bool]]:
        if not isinstance(row, dict):
            raise UserError(f"{where()}: expected an object with named fields, got {type(row).__name__}.")
        if self.cfg.format == "chat":
            return self._chat(messages_field(row, self.cfg.messages_field, where), where)
        if self.cfg.format == "text":
            head, body = _with_bos([], self.bos), _text_field(row, self.cfg.text_field, where)
        else:
            # Tokenized apart so that generation from encode_prompt(prompt) sees this exact prefix.
            head = _with_bos(self._ids(_text_field(row, self.cfg.prompt_field, where)), self.bos)
            body = _text_field(row, self.cfg.response_field, where)
        trained = self._ids(body) + [self.eos]
        return head + trained, [False] * len(head) + [True] * len(trained)

    def _ids(self, text: str) -> list[int]:
        # verbose=False: transformers' "longer than the specified maximum ... indexing errors" is false here,
        # where every example is truncated to data.max_length (and counted).
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def _chat(self, messages: list[dict], where) -> tuple[list[int], list[bool]]:
        text, spans = assistant_spans(self.tok, self.template, messages, where)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        # A token is trained when its characters lie inside an assistant span.
        trained = [any(s <= a and b <= e for s, e in spans) and b > a for a, b in enc["offset_mapping"]]
        ids = _with_bos(enc["input_ids"], self.bos)
        return ids, [False] * (len(ids) - len(trained)) + trained


def _present(row: dict, name: str, where) -> Any:
    value = row.get(name)
    if value is None or (isinstance(value, float) and math.isnan(value)):  # NaN: pandas' missing value
        raise UserError(f"{where()}: field '{name}' is missing or null.")
    return value


def _text_field(row: dict, name: str, where) -> str:
    value = _present(row, name, where)
    if not isinstance(value, str):
        raise UserError(f"{where()}: field '{name}' must be a string, got {type(value).__name__}.")
    return value


def messages_field(row: dict, name: str, where) -> list[dict]:
    value = _present(row, name, where)
    if isinstance(value, str):  # CSV cells can only hold the list as JSON text
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if not isinstance(value, list) or not value:
        raise UserError(f"{where()}: field '{name}' must be a non-empty list of {{role, content}} messages.")
    messages = []
    for j, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise UserError(f"{where()}: message {j} in '{name}' must be a {{role, content}} object.")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise UserError(f"{where()}: message {j} has role {role!r}; expected one of {', '.join(_ROLES)}.")
        if not isinstance(content, str):
            raise UserError(f"{where()}: message {j} needs a string 'content', got {type(content).__name__}.")
        messages.append({"role": role, "content": content})
    # Only assistant turns are trained: such a record is malformed, as a prompt without a response is.
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where()}: the conversation in '{name}' has no assistant turn, so it has nothing to train.")
    return messages


# ---------------------------------------------------------------- batches


def _build_rows(lengths: list[int], order: list[int], max_length: int, packing: bool) -> list[list[int]]:
    """Example indices per row: greedy in `order`, never splitting an example."""
    if not packing:
        return [[i] for i in order]
    rows, current, used = [], [], 0
    for i in order:
        if current and used + lengths[i] > max_length:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        rows.append(current)
    return rows


def _collate(examples: list[Example], rows: list[list[int]], pad_id: int) -> Batch:
    """Rows -> one batch padded to its longest row. The padding tail continues its row's last
    example: causal attention keeps it from every real token, its targets are ignored, and a row
    of one example stays unsegmented (no attention mask to build)."""
    used = [sum(len(examples[i].input_ids) for i in row) for row in rows]
    ids, targets, positions = [], [], []
    for row, pad in zip(rows, [max(used) - u for u in used]):
        ids.append([t for i in row for t in examples[i].input_ids] + [pad_id] * pad)
        targets.append([t for i in row for t in examples[i].targets] + [IGNORE_INDEX] * pad)
        last = len(examples[row[-1]].input_ids)
        positions.append([p for i in row for p in range(len(examples[i].input_ids))] + list(range(last, last + pad)))
    return Batch(*(torch.tensor(x, dtype=torch.long) for x in (ids, targets, positions)))  # each (B, T)


def eval_batches(examples: list[Example], batch_size: int, max_length: int, packing: bool, pad_id: int) -> list[Batch]:
    """All of `examples` in their given order, batched by the same row rules as training."""
    rows = _build_rows([len(e.input_ids) for e in examples], list(range(len(examples))), max_length, packing)
    return [_collate(examples, rows[i : i + batch_size], pad_id) for i in range(0, len(rows), batch_size)]


class BatchStream:
    """Training batches: infinite, reshuffled every epoch, exactly resumable."""

    def __init__(
        self, examples: list[Example], batch_size: int, max_length: int, packing: bool, pad_id: int, seed: int,
        world_size: int = 1,
    ):
        """`world_size`: the ranks that share the stream's batches (each step takes grad_accum x
        world_size of them, rank r keeping r, r + world_size, ...); part of the fingerprint, since a
        saved position means the same steps only for the same world size."""
        if not examples:
            raise UserError("there are no training examples to batch.")
        self.examples, self.batch_size, self.max_length = examples, batch_size, max_length
        self.packing, self.pad_id, self.seed, self.world_size = packing, pad_id, seed, world_size
        self.lengths = [len(e.input_ids) for e in examples]
        if packing and max(self.lengths) > max_length:
            raise ValueError(f"an example of {max(self.lengths)} tokens cannot be packed into rows of {max_length}.")
        self.epoch, self.cursor, self._rows_epoch, self._rows = 0, 0, -1, []

    def _epoch_rows(self) -> list[list[int]]:
        if self._rows_epoch != self.epoch:
            # Mixed into one 63-bit seed so every (seed, epoch) pair gets its own order.
            mixed = (self.seed * 0x9E3779B97F4A7C15 + self.epoch) % (1 << 63)
            order = torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(mixed)).tolist()
            self._rows = _build_rows(self.lengths, order, self.max_length, self.packing)
            self._rows_epoch = self.epoch
        return self._rows

    def next_batch(self) -> Batch:
        rows = self._epoch_rows()
        if self.cursor * self.batch_size >= len(rows):
            self.epoch, self.cursor = self.epoch + 1, 0
            rows = self._epoch_rows()
        start = self.cursor * self.batch_size
        self.cursor += 1
        return _collate(self.examples, rows[start : start + self.batch_size], self.pad_id)

    def _fingerprint(self) -> dict:
        # What must match for a saved position to mean the same batches again.
        names = ("seed", "batch_size", "max_length", "packing", "world_size")
        sizes = {"num_examples": len(self.examples), "num_tokens": sum(self.lengths)}
        return {**{name: getattr(self, name) for name in names}, **sizes}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self._fingerprint().items():
            if key in state and state[key] != value:
                raise UserError(f"the data stream cannot be resumed exactly: {_stream_change(key, state[key], value)},"
                                " or start afresh with train.overwrite=true or another output_dir.")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


# The settings behind a stream's fingerprint, by its key.
_STREAM_SETTINGS = {"seed": "train.seed", "batch_size": "train.batch_size", "max_length": "data.max_length",
                    "packing": "data.packing"}


def _stream_change(key: str, before, now) -> str:
    """What differs from the stream a checkpoint was written with, and how to resume it as it was."""
    if key in _STREAM_SETTINGS:
        setting, before, now = _STREAM_SETTINGS[key], _as_written(before), _as_written(now)
        return f"{setting} was {before}, now {now}; resume with {setting}={before}"
    if key == "world_size":
        return f"world_size was {before}, now {now} (ranks); resume it on {before} rank(s) (--nproc {before})"
    what = key.removeprefix("num_")
    return (f"the training data give {now} {what} where the checkpoint's gave {before} (the data at data.path, or a"
            " data.* setting that reads them, changed); resume with the data it began with")


def _as_written(value) -> str:
    """A value as an override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
