"""The tokenizer as GGUF metadata: tokens, their kinds, merges, special ids and the chat template.

Two kinds of tokenizer map onto llama.cpp's. Byte-level BPE (GPT-2's kind, which Llama 3, Qwen and
SmolLM use) becomes llama.cpp's `gpt2` model: its token list and merges, and the split before merging
by the name llama.cpp knows it by (tokenizer.ggml.pre), read off the tokenizer's own split pattern,
which must be one llama.cpp names, or the file would tokenize differently there. SentencePiece-style
BPE (spaces as ▁, unknown bytes as <0xNN> tokens: Llama 2, Mistral 7B) becomes llama.cpp's `llama`
model, which merges by token score, highest first: each token scores minus the rank of the merge
that makes it, so llama.cpp merges in the order the tokenizer's merges do. Any other is refused.
"""

from __future__ import annotations

import json
import re

from slimtune.errors import UserError

# GPT-2's split, which ByteLevel(use_regex=True) applies on its own.
GPT2 = "gpt-2"  # llama.cpp's name (llama-vocab.cpp); "gpt2" is its tokenizer model, not a split
# Split patterns of tokenizer.json files, by the name llama.cpp gives the same split.
CONTRACTIONS_AND_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
PUNCTUATION_AND_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {
    CONTRACTIONS_AND_LETTERS + r"\p{N}{1,3}" + PUNCTUATION_AND_SPACES: "llama-bpe",  # Llama 3: digits in threes
    CONTRACTIONS_AND_LETTERS + r"\p{N}" + PUNCTUATION_AND_SPACES: "qwen2",  # Qwen2, Qwen2.5, Qwen3: digits alone
}

# llama.cpp's token kinds (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def tokenizer_kind(spec: dict) -> tuple[str, str]:
    """(llama.cpp's tokenizer model, its pre-tokenizer name) for a tokenizer.json; refused when
    llama.cpp has no such tokenizer."""
    if _space_prefix(spec) is not None:
        return "llama", "default"
    return "gpt2", pre_tokenizer_name(spec)


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Write the tokenizer's metadata; one sentence when llama.cpp could not rebuild it."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model, pre = tokenizer_kind(spec)
    tokens, kinds = token_list(tokenizer, vocab_size)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if model == "llama":
        kinds = [BYTE if kind == NORMAL and BYTE_TOKEN.fullmatch(token) else kind for token, kind in zip(tokens, kinds)]
        if tokenizer.unk_token_id is not None:
            kinds[tokenizer.unk_token_id] = UNKNOWN
        writer.add_token_scores(scores(spec, tokens))
        writer.add_add_space_prefix(_space_prefix(spec))
    writer.add_token_types(kinds)
    writer.add_token_merges(merges(spec))  # llama.cpp's `llama` model merges by score; other readers use these
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
        raise UserError(f"the tokenizer is neither byte-level BPE nor SentencePiece-style BPE (model"
                        f" {model.get('type')}, pre-tokenizer {'+'.join(map(str, kinds)) or 'none'}), the kinds"
                        " llama.cpp rebuilds from a GGUF file.")
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


def merge_pairs(spec: dict) -> list[tuple[str, str]]:
    found = spec["model"].get("merges") or []
    return [tuple(pair.split(" ", 1)) if isinstance(pair, str) else tuple(pair) for pair in found]


def merges(spec: dict) -> list[str]:
    """Merges as "left right" lines; both kinds spell a space as a letter (Ġ, ▁), so none holds one."""
    return [" ".join(pair) for pair in merge_pairs(spec)]


def scores(spec: dict, tokens: list[str]) -> list[float]:
    """Minus the rank of the first merge that makes each token; tokens no merge makes (characters,
    bytes, special tokens) score below every merge, so llama.cpp never prefers them."""
    rank: dict[str, int] = {}
    for index, (left, right) in enumerate(merge_pairs(spec)):
        rank.setdefault(left + right, index)
    floor = -float(len(rank) + 1)
    return [-float(rank[token]) if token in rank else floor for token in tokens]


def _space_prefix(spec: dict) -> bool | None:
    """For SentencePiece-style BPE (byte fallback, spaces as ▁ over the whole text): whether a ▁ is
    put before the text. None: not that kind (Metaspace that splits at spaces included: llama.cpp
    merges across them)."""
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return None
    if pre.get("type") == "Metaspace" and pre.get("replacement") == "\u2581" and not pre.get("split", True):
        return pre.get("prepend_scheme", "always") != "never"
    steps = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    if not pre and {"Replace"} <= {step.get("type") for step in steps}:  # the older form: a normalizer
        return any(step.get("type") == "Prepend" and step.get("prepend") == "\u2581" for step in steps)
    return None


def _add_special_tokens(writer, tokenizer) -> None:
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id}
    for kind, index in ids.items():
        if index is not None:
            getattr(writer, f"add_{kind}_token_id")(index)
    sample = tokenizer("a")["input_ids"]  # what the tokenizer adds around a text of its own accord
    writer.add_add_bos_token(ids["bos"] is not None and sample[:1] == [ids["bos"]])
    writer.add_add_eos_token(ids["eos"] is not None and len(sample) > 1 and sample[-1:] == [ids["eos"]])
