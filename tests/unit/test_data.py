"""data.py: loading every format, label masks, packing, resumable streams, user errors."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from slimtune.data.chat_templates import DEFAULT_CHAT_TEMPLATE
from slimtune.config import DataConfig
from slimtune.data.dataset import (
    IGNORE_INDEX,
    Batch,
    BatchStream,
    Example,
    encode_prompt,
    eval_batches,
    load_splits,
    render_chat_prompt,
)
from slimtune.errors import UserError

pytestmark = pytest.mark.quick  # files to batches, cheap

PR = [
    {"prompt": "question: what is two plus two?", "response": " answer: four"},
    {"prompt": "hello world", "response": " the quick brown fox"},
    {"prompt": "say hi", "response": " hi and bye"},
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "says hi"},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the quick fox"},
            {"role": "user", "content": "what is two plus two?"},
            {"role": "assistant", "content": "four 4"},
        ]
    },
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}]},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def cfg(path, **kw) -> DataConfig:
    kw.setdefault("eval_fraction", 0.0)
    return DataConfig(path=str(path), **kw)


def trained_text(tokenizer, example: Example) -> str:
    """Decode the tokens that carry loss (targets are shifted, so they are the trained tokens)."""
    return tokenizer.decode([t for t in example.targets if t != IGNORE_INDEX])


def check_shift(example: Example) -> None:
    assert len(example.targets) == len(example.input_ids)
    assert example.targets[-1] == IGNORE_INDEX
    for t, target in enumerate(example.targets[:-1]):
        assert target in (IGNORE_INDEX, example.input_ids[t + 1])


# ---------------------------------------------------------------- formats and masks


def test_prompt_response_masks(tmp_path, tokenizer):
    splits = load_splits(cfg(write_jsonl(tmp_path / "train.jsonl", PR)), tokenizer, seed=0)
    assert [len(splits.train), len(splits.eval)] == [3, 0]
    for record, ex in zip(PR, splits.train):
        check_shift(ex)
        head = encode_prompt(tokenizer, record["prompt"])
        body = tokenizer(record["response"], add_special_tokens=False)["input_ids"]
        assert ex.input_ids == head + body + [tokenizer.eos_token_id]
        assert trained_text(tokenizer, ex) == record["response"] + "</s>"
        # Every prompt position predicts nothing, except the last, which predicts the response's first token.
        assert ex.targets[: len(head) - 1] == [IGNORE_INDEX] * (len(head) - 1)
        assert ex.targets[len(head) - 1] == body[0]


def test_encode_prompt_adds_bos_only_when_the_tokenizer_does(tokenizer):
    plain = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tokenizer, "hello world") == plain  # the fixture tokenizer adds no bos
    bos_tok = copy.deepcopy(tokenizer)
    from tokenizers import processors

    bos_tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    assert encode_prompt(bos_tok, "hello world") == [tokenizer.bos_token_id] + plain
    assert encode_prompt(bos_tok, "<s>hello world") == [tokenizer.bos_token_id] + plain  # never doubled


def test_text_trains_every_token(tmp_path, tokenizer):
    records = [{"text": "the lazy dog"}, {"text": "hello world, tiny corpus"}]
    splits = load_splits(cfg(write_jsonl(tmp_path / "t.jsonl", records), format="text"), tokenizer, 0)
    for record, ex in zip(records, splits.train):
        assert ex.input_ids == tokenizer(record["text"], add_special_tokens=False)["input_ids"] + [2]
        assert ex.targets == ex.input_ids[1:] + [IGNORE_INDEX]
        assert trained_text(tokenizer, ex) == tokenizer.decode(ex.input_ids[1:])


def test_chat_default_template(tmp_path, tokenizer):
    splits = load_splits(cfg(write_jsonl(tmp_path / "c.jsonl", CHAT), format="chat"), tokenizer, 0)
    first, second = splits.train
    assert tokenizer.decode(first.input_ids) == (
        "<|system|>\nsays hi\n<|user|>\nhello world\n<|assistant|>\nthe quick fox</s>"
        "<|user|>\nwhat is two plus two?\n<|assistant|>\nfour 4</s>"
    )
    assert trained_text(tokenizer, first) == "the quick fox</s>four 4</s>"
    assert trained_text(tokenizer, second) == "bye</s>"
    check_shift(first)
    # Generation from render_chat_prompt + encode_prompt sees exactly the training prefix.
    prompt = encode_prompt(tokenizer, render_chat_prompt(tokenizer, CHAT[0]["messages"][:4], None))
    assert first.input_ids[: len(prompt)] == prompt
    assert first.targets[len(prompt) - 1] == tokenizer("four", add_special_tokens=False)["input_ids"][0]


def test_chat_template_from_config_string_and_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", CHAT)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    for template in (CHATML, str(tmp_path / "chatml.jinja")):
        ex = load_splits(cfg(path, format="chat", chat_template=template), tokenizer, 0).train[0]
        assert tokenizer.decode(ex.input_ids).startswith("<|im_start|>system\nsays hi<|im_end|>\n")
        # The span runs to the end of the turn: content, end marker and the template's newline.
        assert trained_text(tokenizer, ex) == "the quick fox<|im_end|>\nfour 4<|im_end|>\n"
    assert render_chat_prompt(tokenizer, CHAT[1]["messages"][:1], CHATML) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_precedence(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", CHAT[1:])
    own = copy.deepcopy(tokenizer)
    own.chat_template = CHATML
    ex = load_splits(cfg(path, format="chat"), own, 0).train[0]
    assert tokenizer.decode(ex.input_ids).startswith("<|im_start|>user")  # the tokenizer's own template
    ex = load_splits(cfg(path, format="chat", chat_template=DEFAULT_CHAT_TEMPLATE), own, 0).train[0]
    assert tokenizer.decode(ex.input_ids).startswith("<|user|>")  # the config overrides it


def test_chat_first_turn_assistant_and_rewriting_template(tmp_path, tokenizer):
    opener = [{"messages": [{"role": "assistant", "content": "hello world"}, {"role": "user", "content": "hi"}]}]
    ex = load_splits(cfg(write_jsonl(tmp_path / "a.jsonl", opener), format="chat"), tokenizer, 0).train[0]
    assert trained_text(tokenizer, ex) == "hello world</s>"  # the end marker is trained on a first turn too
    # A template that numbers turns from the end renders prefixes differently from the whole;
    # the content is still found and trained.
    shifting = "{% for m in messages %}[{{ loop.revindex }}{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ex = load_splits(cfg(tmp_path / "a.jsonl", format="chat", chat_template=shifting), tokenizer, 0).train[0]
    assert trained_text(tokenizer, ex) == "hello world"


def _write_json_array(path: Path, records):
    path.write_text(json.dumps(records, indent=2))


def _write_csv(path: Path, records):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def _write_parquet(path: Path, records):
    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(path))


def _write_folder(path: Path, records):
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path))


@pytest.mark.parametrize(
    "name,writer",
    [("d.json", _write_json_array), ("d.csv", _write_csv), ("d.parquet", _write_parquet), ("saved", _write_folder)],
)
def test_every_file_kind_gives_the_same_examples(tmp_path, tokenizer, name, writer):
    expected = load_splits(cfg(write_jsonl(tmp_path / "d.jsonl", PR)), tokenizer, 0).train
    writer(tmp_path / name, PR)
    assert load_splits(cfg(tmp_path / name), tokenizer, 0).train == expected


def test_chat_from_json_array_parquet_and_csv(tmp_path, tokenizer):
    expected = load_splits(cfg(write_jsonl(tmp_path / "c.jsonl", CHAT), format="chat"), tokenizer, 0).train
    _write_json_array(tmp_path / "c.json", CHAT)
    _write_parquet(tmp_path / "c.parquet", CHAT)
    _write_csv(tmp_path / "c.csv", [{"messages": json.dumps(r["messages"])} for r in CHAT])  # JSON text in a cell
    for name in ("c.json", "c.parquet", "c.csv"):
        assert load_splits(cfg(tmp_path / name, format="chat"), tokenizer, 0).train == expected


# ---------------------------------------------------------------- truncation, dropping, splits


def test_truncation_and_dropped_counts(tmp_path, tokenizer):
    long_text = " the quick brown fox jumps over the lazy dog" * 3
    records = [PR[2], {"prompt": "hi", "response": long_text}, {"prompt": long_text, "response": " bye"}]
    splits = load_splits(cfg(write_jsonl(tmp_path / "t.jsonl", records), max_length=16), tokenizer, 0)
    report = splits.report
    assert (report.train_examples, report.truncated, report.dropped) == (2, 2, 1)
    assert max(len(e.input_ids) for e in splits.train) == 16
    for ex in splits.train:
        check_shift(ex)
    assert report.summary() == (
        "2 train / 0 eval examples; 2 truncated to 16 tokens; 1 dropped (truncation left no trainable token)"
    )


def test_a_record_longer_than_the_tokenizer_s_maximum_gets_no_false_warning(tmp_path, tokenizer):
    """transformers warned "Running this sequence through the model will result in indexing errors"
    for a record the data's truncation then cut (found by a newcomer walkthrough)."""
    import copy
    import logging

    class Heard(logging.Handler):
        def __init__(self):
            super().__init__()
            self.said = []

        def emit(self, record):
            self.said.append(record.getMessage())

    short = copy.deepcopy(tokenizer)
    short.model_max_length, short.deprecation_warnings = 8, {}
    long_text = " the quick brown fox jumps over the lazy dog" * 3
    path = write_jsonl(tmp_path / "t.jsonl", [PR[2], {"prompt": "hi", "response": long_text}])
    heard, logger = Heard(), logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(heard)
    try:
        assert load_splits(cfg(path, max_length=8), short, 0).report.truncated == 2
        assert heard.said == []
        short(long_text)  # outside the data's reading, transformers does warn (once a tokenizer)
    finally:
        logger.removeHandler(heard)
    assert len(heard.said) == 1 and heard.said[0].startswith("Token indices sequence length"), heard.said


def test_all_dropped_is_a_user_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "the quick brown fox jumps", "response": "x"}])
    with pytest.raises(UserError, match="max_length=3"):
        load_splits(cfg(path, max_length=3), tokenizer, 0)


def test_records_with_nothing_to_train_are_counted_apart_from_truncation(tmp_path, tokenizer):
    # The fixture tokenizer adds no bos, so an empty text is only the eos, which nothing predicts.
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": ""}, {"text": ""}])
    report = load_splits(cfg(path, format="text", max_length=64), tokenizer, 0).report
    assert (report.train_examples, report.truncated, report.dropped, report.empty) == (1, 0, 0, 2)
    assert report.summary() == (
        "1 train / 0 eval examples; 0 truncated to 64 tokens; 0 dropped (truncation left no trainable token); "
        "2 dropped (empty: no token to train)"
    )
    # When no record is usable, the error names the real cause, not data.max_length.
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": ""}])
    msg = _error(tmp_path, tokenizer, "e.jsonl", format="text", max_length=64)
    assert msg.endswith("e.jsonl has a token to train: every one is empty.") and "max_length" not in msg
    write_jsonl(tmp_path / "m.jsonl", [{"text": ""}, {"text": "hello world"}])
    msg = _error(tmp_path, tokenizer, "m.jsonl", format="text", max_length=1)
    assert msg.endswith("m.jsonl keeps a trainable token within data.max_length=1 (1 had none to begin with).")


def test_chat_record_without_an_assistant_turn_names_its_line(tmp_path, tokenizer):
    user_only = {"messages": [{"role": "system", "content": "says hi"}, {"role": "user", "content": "hello"}]}
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl([CHAT[1], user_only, CHAT[0]]), format="chat")
    assert msg.endswith("c.jsonl line 2: the conversation in 'messages' has no assistant turn, so it has nothing "
                        "to train.")
    # Every record without one: the same sentence, not a complaint about max_length.
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl([user_only, user_only]), format="chat", max_length=512)
    assert "c.jsonl line 1: the conversation in 'messages' has no assistant turn" in msg
    assert "max_length" not in msg


def test_csv_cells_are_text_exactly_as_written(tmp_path, tokenizer):
    # Columns pandas would read as numbers (per 10k-row chunk), with NaN for an empty cell, or as missing
    # for NA-like words: all stay the text in the file, and an empty cell is "" as in JSON.
    for records in (
        [{"prompt": "12", "response": " 4"}, {"prompt": "7", "response": " 0.50"},
         {"prompt": "007", "response": " 1e3"}],
        [{"prompt": "12", "response": " 4"}, {"prompt": "3", "response": ""}],
        [{"prompt": "NA", "response": " None"}, {"prompt": "null", "response": " n/a"},
         {"prompt": "", "response": " x"}],
    ):
        _write_csv(tmp_path / "n.csv", records)
        expected = load_splits(cfg(write_jsonl(tmp_path / "n.jsonl", records)), tokenizer, 0).train
        assert len(expected) == len(records)
        assert load_splits(cfg(tmp_path / "n.csv"), tokenizer, 0).train == expected
    _write_csv(tmp_path / "t.csv", [{"text": "12"}, {"text": "3.0"}])
    ex = load_splits(cfg(tmp_path / "t.csv", format="text"), tokenizer, 0).train
    assert [tokenizer.decode(e.input_ids) for e in ex] == ["12</s>", "3.0</s>"]


def _numbered(n):
    return [{"prompt": f"say {i}", "response": f" {i}"} for i in range(n)]


def test_hold_out_sizes_and_determinism(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", _numbered(20))
    a = load_splits(cfg(path, eval_fraction=0.1), tokenizer, seed=3)
    b = load_splits(cfg(path, eval_fraction=0.1), tokenizer, seed=3)
    c = load_splits(cfg(path, eval_fraction=0.25), tokenizer, seed=4)
    assert (len(a.train), len(a.eval)) == (18, 2) and (a.train, a.eval) == (b.train, b.eval)
    assert (len(c.train), len(c.eval)) == (15, 5)
    keys = lambda exs: sorted(tuple(e.input_ids) for e in exs)  # noqa: E731
    assert keys(a.train + a.eval) == keys(c.train + c.eval)  # a partition of the same examples
    assert not set(keys(a.train)) & set(keys(a.eval))
    seeds = {tuple(keys(load_splits(cfg(path, eval_fraction=0.25), tokenizer, s).eval)) for s in range(4)}
    assert len(seeds) > 1  # the seed chooses the held-out examples
    assert load_splits(cfg(path, eval_fraction=0.0), tokenizer, 0).eval == []
    two = load_splits(cfg(write_jsonl(tmp_path / "two.jsonl", _numbered(2)), eval_fraction=0.05), tokenizer, 0)
    assert (len(two.train), len(two.eval)) == (1, 1)  # at least one held out
    one = write_jsonl(tmp_path / "one.jsonl", _numbered(1))
    assert load_splits(cfg(one, eval_fraction=0.5), tokenizer, 0).eval == []


def test_eval_path(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", _numbered(5))
    held = write_jsonl(tmp_path / "eval.jsonl", PR)
    splits = load_splits(DataConfig(path=str(train), eval_path=str(held), eval_fraction=0.5), tokenizer, 0)
    assert (len(splits.train), len(splits.eval)) == (5, 3)
    assert splits.eval == load_splits(cfg(held), tokenizer, 0).train
    assert splits.report.summary().startswith("5 train / 3 eval examples")


# ---------------------------------------------------------------- batches


def synthetic(lengths: list[int], trained_from: int = 1) -> list[Example]:
    """Example k holds ids 1000*k + j, so every token names its example and position."""
    out = []
    for k, n in enumerate(lengths):
        ids = [1000 * k + j for j in range(n)]
        targets = [ids[t + 1] if t + 1 >= trained_from else IGNORE_INDEX for t in range(n - 1)]
        out.append(Example(ids, targets + [IGNORE_INDEX]))
    return out


def segments(batch: Batch, pad_id: int):
    """Per row: (example index, start, end) of each example segment; position 0 opens a segment,
    the padding tail (pad ids, positions continuing the last segment) closes the last one."""
    rows = []
    for ids, pos in zip(batch.input_ids.tolist(), batch.position_ids.tolist()):
        used = ids.index(pad_id) if pad_id in ids else len(ids)
        starts = [t for t, p in enumerate(pos[:used]) if p == 0] + [used]
        rows.append([(ids[s] // 1000, s, e) for s, e in zip(starts, starts[1:])])
    return rows


def check_batch(batch: Batch, examples: list[Example], max_length: int, pad_id: int, packing: bool) -> list[int]:
    """Asserts the row rules and returns the example indices in the batch, in order."""
    seen, width, longest = [], batch.input_ids.shape[1], 0
    for b, segs in enumerate(segments(batch, pad_id)):
        assert packing or len(segs) == 1
        used = segs[-1][2] if segs else 0
        longest, row = max(longest, used), batch.input_ids[b]
        assert used <= max_length
        for k, s, e in segs:
            assert row[s:e].tolist() == examples[k].input_ids  # whole, in one row
            assert batch.targets[b, s:e].tolist() == examples[k].targets  # never predicts across examples
            assert batch.position_ids[b, s:e].tolist() == list(range(e - s))
            seen.append(k)
        assert (row[used:] == pad_id).all() and (batch.targets[b, used:] == IGNORE_INDEX).all()
        last = segs[-1][2] - segs[-1][1] if segs else 0
        assert batch.position_ids[b, used:].tolist() == list(range(last, last + width - used))
        assert batch.segmented == any(len(r) > 1 for r in segments(batch, pad_id))
    assert width == longest  # padded to the longest row, no further
    return seen


def one_epoch(stream: BatchStream) -> list[Batch]:
    """The rest of the stream's current epoch (it leaves the stream one batch into the next)."""
    epoch, batches = stream.epoch, []
    while True:
        batch = stream.next_batch()
        if stream.epoch != epoch:  # that batch opened the next epoch
            return batches
        batches.append(batch)


@pytest.mark.parametrize("packing", [True, False])
def test_stream_epoch_covers_every_example_once(packing):
    lengths = [3, 7, 2, 9, 4, 4, 10, 5, 2, 6, 8, 3, 5]
    examples, max_length, pad_id = synthetic(lengths), 12, 999_999
    stream = BatchStream(examples, batch_size=3, max_length=max_length, packing=packing, pad_id=pad_id, seed=1)
    epochs = []
    for _ in range(2):
        seen = []
        for batch in one_epoch(stream):
            assert batch.input_ids.dtype == torch.long and batch.input_ids.shape == batch.targets.shape
            seen += check_batch(batch, examples, max_length, pad_id, packing)
        assert sorted(seen) == list(range(len(lengths)))
        epochs.append(seen)
        stream = _rewound_to_epoch(stream, len(epochs))
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    if packing:
        assert len(one_epoch(BatchStream(examples, 3, max_length, True, pad_id, 1))) < len(lengths) / 3


def _rewound_to_epoch(stream: BatchStream, epoch: int) -> BatchStream:
    s = stream
    fresh = BatchStream(s.examples, s.batch_size, s.max_length, s.packing, s.pad_id, s.seed)
    fresh.load_state_dict({**stream.state_dict(), "epoch": epoch, "cursor": 0})
    return fresh


def test_stream_partial_last_batch_and_seed():
    examples = synthetic([4] * 7)
    stream = BatchStream(examples, batch_size=3, max_length=4, packing=True, pad_id=0, seed=5)
    sizes = [stream.next_batch().input_ids.shape[0] for _ in range(6)]
    assert sizes == [3, 3, 1, 3, 3, 1]

    def order(seed):
        return [b.input_ids[:, 0].tolist() for b in one_epoch(BatchStream(examples, 3, 4, True, 0, seed))]

    assert order(5) == order(5) and order(5) != order(6)


@pytest.mark.parametrize("packing", [True, False])
def test_stream_resumes_exactly(packing):
    examples = synthetic([3, 7, 2, 9, 4, 4, 10, 5, 2, 6, 8])
    args = (examples, 2, 12, packing, 0, 7)
    reference = BatchStream(*args)
    expected = [reference.next_batch() for _ in range(20)]  # several epochs
    for k in (0, 1, 3, 4, 5, 9):  # includes positions just before and after an epoch boundary
        original = BatchStream(*args)
        for _ in range(k):
            original.next_batch()
        state = json.loads(json.dumps(original.state_dict()))
        resumed = BatchStream(*args)
        resumed.load_state_dict(state)
        for want in expected[k : k + 8]:
            got = resumed.next_batch()
            for name in ("input_ids", "targets", "position_ids"):
                assert torch.equal(getattr(got, name), getattr(want, name))
    other = BatchStream(examples, 3, 12, packing, 0, 7)
    with pytest.raises(UserError, match="batch_size"):
        other.load_state_dict(state)


def test_eval_batches_keep_order():
    examples, pad_id = synthetic([3, 7, 2, 9, 4, 4], trained_from=2), 999_999
    for packing in (True, False):
        batches = eval_batches(examples, batch_size=2, max_length=10, packing=packing, pad_id=pad_id)
        seen = [k for b in batches for k in check_batch(b, examples, 10, pad_id, packing)]
        assert seen == list(range(6))
    # Greedy rows [0, 1] [2] [3] [4, 5], padded per batch to its longest row.
    assert [b.input_ids.shape for b in eval_batches(examples, 2, 10, True, pad_id)] == [(2, 10), (2, 9)]


def test_batch_num_targets_and_to():
    batch = eval_batches(synthetic([3, 4], trained_from=2), 2, 10, False, 0)[0]
    assert batch.num_targets == 1 + 2
    moved = batch.to("cpu")
    assert torch.equal(moved.position_ids, batch.position_ids) and moved.num_targets == 3


# ---------------------------------------------------------------- user errors


def _error(tmp_path, tokenizer, name: str, text: str | None = None, **kw) -> str:
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as info:
        load_splits(cfg(tmp_path / name, **kw), tokenizer, 0)
    return str(info.value)


def test_bad_json_line_names_file_and_line(tmp_path, tokenizer):
    good = json.dumps(PR[0])
    msg = _error(tmp_path, tokenizer, "train.jsonl", f"{good}\n\n{good}\n{{'prompt': 1}}\n")
    assert "train.jsonl line 4: not valid JSON" in msg
    msg = _error(tmp_path, tokenizer, "arr.json", '[\n  {"prompt": "a", "response": "b"},\n  {"prompt": "a",,}\n]')
    assert "arr.json line 3: not valid JSON" in msg


def test_missing_and_mistyped_fields_name_the_line(tmp_path, tokenizer):
    records = [PR[0], PR[1], {"prompt": "x"}]
    assert "t.jsonl line 3: field 'response' is missing or null" in _error(tmp_path, tokenizer, "t.jsonl",
                                                                            _jsonl(records))
    records = [PR[0], {"prompt": "x", "response": 5}]
    msg = _error(tmp_path, tokenizer, "t.jsonl", _jsonl(records))
    assert "t.jsonl line 2: field 'response' must be a string" in msg
    _write_json_array(tmp_path / "a.json", [PR[0], {"prompt": "x"}])
    assert "a.json line 6: field 'response' is missing or null" in _error(tmp_path, tokenizer, "a.json")
    # A record's null reads as the loaders' fill for an absent field: one message for both.
    msg = _error(tmp_path, tokenizer, "t.jsonl", _jsonl([PR[0], {"prompt": "x", "response": None}]))
    assert "t.jsonl line 2: field 'response' is missing or null" in msg
    # Turns in CSV cells are JSON text; a record is named by the line it starts on, past a quoted cell
    # that spans two lines.
    turns = json.dumps(CHAT[1]["messages"])
    _write_csv(tmp_path / "c.csv", [{"messages": turns}, {"messages": turns.replace("}, {", "},\n{")},
                                    {"messages": "hello"}])
    assert "c.csv line 5: field 'messages' must be a non-empty list" in _error(tmp_path, tokenizer, "c.csv",
                                                                                format="chat")
    _write_parquet(tmp_path / "t.parquet", [PR[0], {"prompt": "x", "response": None}])
    assert "t.parquet record 2: field 'response' is missing or null" in _error(tmp_path, tokenizer, "t.parquet")


@pytest.mark.parametrize("name, text, kw, words", [
    ("t.csv", "prompt,answer\na,b\n", {}, "'response' (its fields: answer, prompt); name the one to use with"
                                              " data.response_field=..."),
    ("t.jsonl", None, {"format": "text"}, "'text' (its fields: prompt, response); name the one"
                                                          " to use with data.text_field=..."),
    ("c.jsonl", '{"conversation": []}\n', {"format": "chat"}, "'messages' (its fields: conversation); name the one to use with"
                                                               " data.messages_field=..."),
])
def test_a_field_no_record_has_is_named_with_the_file_s_fields(tmp_path, tokenizer, name, text, kw, words):
    """A field named otherwise in the whole file is one sentence naming the file's fields and the
    setting, not the first record's 'missing'."""
    msg = _error(tmp_path, tokenizer, name, _jsonl(PR) if text is None else text, **kw)
    assert f"no record of data path '{tmp_path / name}' has a field " in msg and words in msg


def _jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_bad_chat_records(tmp_path, tokenizer):
    bad_role = [CHAT[1], {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}]
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl(bad_role), format="chat")
    assert "c.jsonl line 2: message 2 has role 'bot'" in msg
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl([{"messages": "hello"}]), format="chat")
    assert "c.jsonl line 1: field 'messages' must be a non-empty list" in msg
    no_content = [{"messages": [{"role": "user"}]}]
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl(no_content), format="chat")
    assert "message 1 needs a string 'content'" in msg
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl(CHAT), format="chat", chat_template=str(tmp_path / "x.jinja"))
    assert "x.jinja" in msg and "does not exist" in msg


def test_missing_path_unknown_extension_and_empty_data(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, "nope.jsonl")
    assert "nope.jsonl" in msg and "does not exist" in msg
    msg = _error(tmp_path, tokenizer, "data.txt", "hello\n")
    assert "data.txt" in msg and "unknown extension" in msg
    assert "no records" in _error(tmp_path, tokenizer, "empty.jsonl", "")
    assert "no records" in _error(tmp_path, tokenizer, "blank.jsonl", "\n\n")
    assert "no records" in _error(tmp_path, tokenizer, "arr.json", "[]")
    assert "no records" in _error(tmp_path, tokenizer, "head.csv", "prompt,response\n")
    _write_parquet(tmp_path / "empty.parquet", [])
    assert "no records" in _error(tmp_path, tokenizer, "empty.parquet")
    (tmp_path / "folder").mkdir()
    assert "save_to_disk" in _error(tmp_path, tokenizer, "folder")
    # The evaluation data is named by its setting, not taken for the training data (a newcomer walkthrough).
    train = write_jsonl(tmp_path / "train.jsonl", PR)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    for name, said in [("empty.jsonl", "holds no records"), ("none.jsonl", "does not exist"),
                       ("bad.parquet", "could not be read as parquet")]:
        with pytest.raises(UserError) as err:
            load_splits(cfg(train, eval_path=str(tmp_path / name)), tokenizer, 0)
        assert str(err.value).startswith(f"data.eval_path '{tmp_path / name}' {said}")


def test_a_chat_template_with_no_jinja_is_a_missing_file_not_a_template(tmp_path, tokenizer):
    """data.chat_template=templates/chat.tmpl (no such file): without {{ }}, {% %} or {# #} it is a file's name,
    not a template (as text it rendered every conversation to itself, and the run said every record empty)."""
    msg = _error(tmp_path, tokenizer, "c.jsonl", _jsonl(CHAT), format="chat", chat_template="templates/chat.tmpl")
    assert msg == "data.chat_template file 'templates/chat.tmpl' does not exist."


def test_a_white_space_line_in_a_csv_does_not_shift_the_lines_named(tmp_path, tokenizer):
    ok = json.dumps(CHAT[1]["messages"]).replace('"', '""')
    bad = json.dumps([{"role": "user", "content": "no answer"}]).replace('"', '""')
    msg = _error(tmp_path, tokenizer, "ws.csv", f'messages\n"{ok}"\n   \n"{ok}"\n"{bad}"\n', format="chat")
    assert msg.startswith(f"{tmp_path / 'ws.csv'} line 5: ")  # pandas skips the line of spaces (line 3); the count did not


def test_one_pretty_printed_json_object_is_said_to_be_no_records_not_invalid_json(tmp_path, tokenizer):
    text = json.dumps({"data": PR, "version": 1}, indent=2)
    msg = _error(tmp_path, tokenizer, "obj.json", text)
    assert msg == (f"{tmp_path / 'obj.json'} holds one JSON object, not records: give a list of records (.json) or one record a line"
                   " (.jsonl); its records may be the list under 'data'.")
    assert "line 2: not valid JSON" in _error(tmp_path, tokenizer, "bad.json", '{"prompt": "a", "response": "b"}\n{"p\n')


def test_a_folder_of_data_files_in_several_formats_is_one_sentence(tmp_path, tokenizer):
    """datasets reads a folder's most common format alone: a.jsonl's records were read and b.csv's dropped
    without a word."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(_jsonl(PR))
    _write_csv(folder / "b.csv", PR[:1])
    (folder / ".hidden.csv").write_text("prompt,response\nx,y\n")  # hidden files are not read: not counted
    msg = _error(tmp_path, tokenizer, "mixed")
    assert msg == (f"data.path '{folder}' holds data files in several formats (a.jsonl (JSON), b.csv (CSV)); datasets"
                   " would read one format and drop the others: keep one format in the folder, or name a file.")
    (folder / "b.csv").unlink()
    assert len(load_splits(cfg(folder), tokenizer, 0).train) == len(PR)
