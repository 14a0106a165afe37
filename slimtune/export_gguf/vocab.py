"""The tokenizer as GGUF metadata: tokens, their kinds, merges, special ids and the chat template.

llama.cpp rebuilds a byte-level BPE tokenizer (GPT-2's kind, which Llama 3, Qwen and SmolLM use) from
its token list and merges, and splits text before merging with a pre-tokenizer it knows by name
(tokenizer.ggml.pre). The name is read off the tokenizer's own pre-tokenizer: its split pattern must
be one llama.cpp names, or the file would tokenize differently there, so any other is refused.
"""

from __future__ import annotations

import json

from slimtune.errors import UserError

# GPT-2's split, which ByteLevel(use_regex=True) applies on its own.
GPT2 = "gpt2"
# Split patterns of tokenizer.json files, by the name llama.cpp gives the same split.
CONTRACTIONS_AND_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
PUNCTUATION_AND_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {
    CONTRACTIONS_AND_LETTERS + r"\p{N}{1,3}" + PUNCTUATION_AND_SPACES: "llama-bpe",  # Llama 3: digits in threes
    CONTRACTIONS_AND_LETTERS + r"\p{N}" + PUNCTUATION_AND_SPACES: "qwen2",  # Qwen2, Qwen2.5, Qwen3: digits alone
}

# llama.cpp's token kinds (gguf.TokenType)
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Write the tokenizer's metadata; one sentence when llama.cpp could not rebuild it."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = pre_tokenizer_name(spec)
    tokens, kinds = token_list(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges(spec))
    _add_special_tokens(writer, tokenizer)
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: llama.cpp reads them as a list
        template = [{"name": name, "template": text} for name, text in template.items()]
    if template:
        writer.add_chat_template(template)


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for the tokenizer's split before merging; refused when it has none."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if model.get("type") != "BPE" or not kinds or kinds[-1] != "ByteLevel":
        raise UserError(f"the tokenizer is not a byte-level BPE one (model {model.get('type')}, pre-tokenizer"
                        f" {'+'.join(map(str, kinds)) or 'none'}), the only kind the GGUF export carries.")
    name = _split_name(steps)
    if name is None:
        raise UserError(f"the tokenizer's pre-tokenizer ({_describe(steps)}) is not one llama.cpp knows by name, so"
                        " the GGUF file would split text differently there.")
    return name


def _split_name(steps: list[dict]) -> str | None:
    last = steps[-1]
    if len(steps) == 1 and last.get("use_regex", True):
        return GPT2
    if len(steps) == 2 and last.get("use_regex", True) and steps[0].get("type") == "Digits" \
            and steps[0].get("individual_digits"):
        return "smollm"  # each digit alone, then GPT-2's split
    split = steps[0]
    if len(steps) == 2 and not last.get("use_regex", True) and split.get("type") == "Split" \
            and split.get("behavior") == "Isolated" and not split.get("invert"):
        return SPLITS.get((split.get("pattern") or {}).get("Regex"))
    return None


def _describe(steps: list[dict]) -> str:
    return " + ".join(step.get("type", "?") for step in steps)


def token_list(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """One token per embedding row, as tokenizer.json spells them (byte-level), with llama.cpp's
    kinds; rows past the tokenizer's last id get unused placeholder tokens, as llama.cpp's own
    converter writes them."""
    by_id = {index: token for token, index in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= vocab_size:
        raise UserError(f"the tokenizer has token id {max(by_id)}, beyond the model's vocab_size {vocab_size}.")
    added = tokenizer.added_tokens_decoder
    tokens, kinds = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            kinds.append(UNUSED)
            continue
        tokens.append(by_id[index])
        kinds.append(NORMAL if index not in added else CONTROL if added[index].special else USER_DEFINED)
    return tokens, kinds


def merges(spec: dict) -> list[str]:
    """Merges as "left right" lines; a byte-level vocabulary spells a space as Ġ, so none holds one."""
    found = spec["model"].get("merges") or []
    return [pair if isinstance(pair, str) else " ".join(pair) for pair in found]


def _add_special_tokens(writer, tokenizer) -> None:
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id}
    for kind, index in ids.items():
        if index is not None:
            getattr(writer, f"add_{kind}_token_id")(index)
    sample = tokenizer("a")["input_ids"]  # what the tokenizer adds around a text of its own accord
    writer.add_add_bos_token(ids["bos"] is not None and sample[:1] == [ids["bos"]])
    writer.add_add_eos_token(ids["eos"] is not None and len(sample) > 1 and sample[-1:] == [ids["eos"]])
