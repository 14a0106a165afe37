#!/usr/bin/env python
"""Regenerate the bundled demo assets of `slimtune train` (no arguments).

Everything is synthetic and built here, offline and deterministically:

1. a pretraining corpus of short English-like sentences: arithmetic stated in
   words ("12 plus 7 is 19.") and facts about made-up people ("Tomar lives in
   Kelvane.", "The favorite color of Tomar is red.", ...);
2. a byte-level BPE tokenizer (tokenizers library), wrapped as a
   transformers.PreTrainedTokenizerFast (bos/eos/pad, no chat template);
3. a tiny LlamaForCausalLM pretrained on the corpus with a plain PyTorch loop
   (1000 steps, ~9 minutes on 2 idle CPU cores), saved as safetensors to slimtune/demo/base/;
4. the fine-tuning task, prompt/response JSONL in slimtune/demo/data/:
   calculator notation ("12 + 7 =" -> " 19"). The base model knows the sums
   (from "12 plus 7 is 19." sentences) but has never seen "+"/"=", so it
   fails before fine-tuning; LoRA only has to teach it the new notation.

Usage:  python scripts/make_demo_assets.py [--minutes 10] [--out slimtune/demo]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SEED = 1234

# ----------------------------------------------------------------------------
# 1. corpus
# ----------------------------------------------------------------------------

MAX_OPERAND = 29  # sums a + b with 0 <= a, b <= MAX_OPERAND (900 facts)

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange",
          "purple", "pink", "brown", "gray", "gold"]
JOBS = ["baker", "farmer", "doctor", "teacher", "painter", "sailor", "pilot",
        "singer", "writer", "tailor", "miner", "judge", "nurse", "cook",
        "hunter", "dancer", "driver", "guard", "potter", "smith"]


def _names(rng: random.Random, n: int, syllables: tuple[int, int]) -> list[str]:
    cons = "bdfgklmnprstvz"
    vow = "aeiou"
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        k = rng.randint(*syllables)
        s = "".join(rng.choice(cons) + rng.choice(vow) for _ in range(k))
        if rng.random() < 0.5:
            s += rng.choice("nrls")
        s = s.capitalize()
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def make_world(seed: int = SEED) -> dict:
    rng = random.Random(seed)
    names = _names(rng, 300 + 40, (2, 3))
    people, cities = names[:300], names[300:]
    facts = {
        p: {"city": rng.choice(cities), "color": rng.choice(COLORS), "job": rng.choice(JOBS)}
        for p in people
    }
    return {"people": people, "cities": cities, "facts": facts}


ADD_TEMPLATES = [
    "{a} plus {b} is {c}.",
    "{a} plus {b} equals {c}.",
    "The sum of {a} and {b} is {c}.",
    "If you add {a} and {b} you get {c}.",
    "Adding {b} to {a} gives {c}.",
]
FACT_TEMPLATES = {
    "city": ["{p} lives in {v}.", "The home town of {p} is {v}.", "{p} has a house in {v}.",
             "Everyone knows that {p} lives in {v}."],
    "color": ["The favorite color of {p} is {v}.", "{p} likes the color {v}.",
              "{p} loves {v} things.", "Ask {p} and you will hear that {v} is the best color."],
    "job": ["{p} works as a {v}.", "{p} is a {v}.", "By trade {p} is a {v}.",
            "The job of {p} is {v}."],
}
FILLER = [
    "The {c} {n} sat on the {m}.", "A {n} is not a {m}.", "Today the sky is {c}.",
    "The {n} and the {m} went to {t}.", "Nobody saw the {c} {n} in {t}.",
    # "+" and "=" only ever appear in non-arithmetic notes, so their embeddings are
    # trained but the base model has no idea that "a + b =" asks for a sum.
    "Note: {n} + {m} = a pair.", "Rule: {c} {n} = good {n}.", "{t} + {n} = home.",
]
NOUNS = ["cat", "dog", "bird", "fish", "tree", "box", "boat", "road", "hat", "cup",
         "door", "house", "river", "hill", "stone", "book"]


def sentence(rng: random.Random, world: dict) -> str:
    r = rng.random()
    if r < 0.55:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        return rng.choice(ADD_TEMPLATES).format(a=a, b=b, c=a + b)
    if r < 0.92:
        p = rng.choice(world["people"])
        attr = rng.choice(["city", "color", "job"])
        return rng.choice(FACT_TEMPLATES[attr]).format(p=p, v=world["facts"][p][attr])
    return rng.choice(FILLER).format(c=rng.choice(COLORS), n=rng.choice(NOUNS),
                                     m=rng.choice(NOUNS), t=rng.choice(world["cities"]))


def corpus_lines(n: int, world: dict, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [sentence(rng, world) for _ in range(n)]


# ----------------------------------------------------------------------------
# 2. tokenizer
# ----------------------------------------------------------------------------

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_tokenizer(lines: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=256, padding_side="right")


# ----------------------------------------------------------------------------
# 3. pretraining
# ----------------------------------------------------------------------------

def model_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id,
        pad_token_id=pad_id, torch_dtype="float32")


def pack(tokenizer, lines: list[str], seq_len: int, seed: int) -> torch.Tensor:
    """Documents of 1-4 sentences (newline separated) as <s> doc </s>, packed into
    seq_len blocks (padded, never split)."""
    rng = random.Random(seed)
    docs, i = [], 0
    while i < len(lines):
        k = rng.randint(1, 4)
        docs.append("\n".join(lines[i:i + k]))
        i += k
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    blocks, cur = [], []
    for d in ids:
        d = [bos] + d[:seq_len - 2] + [eos]
        if len(cur) + len(d) > seq_len:
            blocks.append(cur + [pad] * (seq_len - len(cur)))
            cur = []
        cur += d
    blocks.append(cur + [pad] * (seq_len - len(cur)))
    return torch.tensor(blocks, dtype=torch.long)


def pretrain(model, data: torch.Tensor, pad_id: int, minutes: float, batch: int, lr: float,
             max_steps: int, log) -> None:
    g = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max_steps)))))
    model.train()
    t0 = time.time()
    perm = torch.randperm(len(data), generator=g)
    pos = 0
    for step in range(max_steps):
        if pos + batch > len(perm):
            perm, pos = torch.randperm(len(data), generator=g), 0
        x = data[perm[pos:pos + batch]]
        pos += batch
        labels = x.masked_fill(x == pad_id, -100)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == max_steps - 1:
            log(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:6.0f}s")
        if time.time() - t0 > minutes * 60:
            log(f"time budget reached at step {step}")
            break
    model.eval()


@torch.no_grad()
def completion_accuracy(model, tokenizer, pairs: list[tuple[str, str]]) -> float:
    """Fraction of (prefix, answer) pairs where greedy decoding of the prefix starts with answer."""
    ok = 0
    for prefix, answer in pairs:
        ids = tokenizer(prefix, return_tensors="pt")["input_ids"]
        want = tokenizer(answer, add_special_tokens=False)["input_ids"]
        out = model.generate(ids, max_new_tokens=len(want), do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        ok += out[0, ids.shape[1]:].tolist() == want
    return ok / len(pairs)


# ----------------------------------------------------------------------------
# 4. task data
# ----------------------------------------------------------------------------

def task_examples(seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed + 1)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    rng.shuffle(pairs)
    rows = [{"prompt": f"{a} + {b} =", "response": f" {a + b}"} for a, b in pairs]
    heldout, train = rows[:100], rows[100:]
    return train, heldout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "slimtune" / "demo"))
    ap.add_argument("--minutes", type=float, default=20.0, help="pretraining wall-clock safety cap (steps normally end it first)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    log = lambda m: print(m, flush=True)  # noqa: E731

    world = make_world()
    log("generating corpus ...")
    lines = corpus_lines(600_000, world, SEED)
    tokenizer = train_tokenizer(lines[:200_000], vocab_size=1024)
    data = pack(tokenizer, lines, seq_len=128, seed=SEED)
    log(f"corpus: {len(lines)} sentences, {data.numel() / 1e6:.2f}M tokens in {len(data)} blocks")

    from transformers import LlamaForCausalLM

    cfg = model_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                       tokenizer.pad_token_id)
    model = LlamaForCausalLM(cfg)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    pretrain(model, data, tokenizer.pad_token_id, args.minutes, batch=32, lr=3e-3,
             max_steps=args.steps, log=log)

    rng = random.Random(SEED + 7)
    arith = [(f"{a} plus {b} is", f" {a + b}") for a, b in
             ((rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)) for _ in range(100))]
    facts = [(f"{p} lives in", " " + world["facts"][p]["city"]) for p in rng.sample(world["people"], 100)]
    log(f"base model, corpus-format completion: arithmetic {completion_accuracy(model, tokenizer, arith):.0%}, "
        f"city facts {completion_accuracy(model, tokenizer, facts):.0%}")

    base = out / "base"
    if base.exists():
        shutil.rmtree(base)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(base, safe_serialization=True)
    tokenizer.save_pretrained(base)

    train, heldout = task_examples(SEED)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    log(f"wrote {base} and {len(train)} train / {len(heldout)} heldout examples to {data_dir}")


if __name__ == "__main__":
    main()
