"""LoRA fine-tune of a ~34M-parameter random Llama: slimtune vs HF Trainer + peft, same settings.

Both sides train the same model folder on the same JSONL with the same hyper-parameters.
Every example tokenizes to exactly SEQ_LEN tokens, so every row of every batch is one
whole example with no padding and no packing on either side: both process exactly
batch * SEQ_LEN input positions per step and both take the same SDPA is_causal path.

Each (side, metered) pair runs in its own subprocess (separate peak RSS, no shared
allocator state), in interleaved order so that load from other users hits both sides.

Memory, both sides: slimtune.device.memory.LiveBytesMeter (live CPU tensor-storage bytes)
entered at the start of each optimizer step and left at its end, with the model's
parameters, gradients and optimizer state registered as resident. slimtune does that
inside ResidentEngine.step; for HF a TrainerCallback does it from on_step_begin to
on_step_end. Unmetered runs set slimtune's train.measure_memory=false and drop the HF
callback's meter, to show what metering costs in time.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN = 256
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ_LEN,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TRAIN = dict(batch_size=4, lr=2e-4, rank=16, alpha=32.0, dropout=0.0, weight_decay=0.0, max_grad_norm=1.0,
             schedule="constant", seed=0, threads=2)
STEPS = dict(full=(3, 12), quick=(1, 2))  # (warm-up steps, measured steps)
ORDER = [("slimtune", True), ("hf", True), ("slimtune", False), ("hf", False)]


# ---------------------------------------------------------------- the case (parent process)


def run(quick: bool) -> dict:
    warmup, measured = STEPS["quick" if quick else "full"]
    with tempfile.TemporaryDirectory(prefix="slimtune-bench-") as tmp:
        tmp = Path(tmp)
        model_dir, info = build_model(tmp / "model")
        data_path = write_data(tmp / "data.jsonl", model_dir, n=(warmup + measured) * TRAIN["batch_size"] + 8)
        info["token_ids_identical"] = same_tokens(model_dir, data_path)
        runs = {}
        for side, metered in ORDER:
            spec = dict(side=side, metered=metered, model=str(model_dir), data=str(data_path),
                        steps=warmup + measured, warmup=warmup, out=str(tmp / f"{side}-{metered}"))
            runs[f"{side}_{'metered' if metered else 'unmetered'}"] = launch(spec)
    return {"settings": {**TRAIN, "seq_len": SEQ_LEN, "lora_targets": LORA_TARGETS, "warmup_steps": warmup,
                         "measured_steps": measured}, "model": info, "runs": runs, "table": table(runs)}


def train_tokenizer(vocab_size: int, corpus: list[str]):
    """tests/conftest.py's offline byte-level BPE, on a larger corpus for a larger vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def lexicon(rng: random.Random, size: int = 6000) -> list[str]:
    syllables = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = {"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(size * 2)}
    return sorted(words)[:size]


def sentence(rng: random.Random, words: list[str], n: int) -> str:
    # Half Zipf-like (the LM has something to fit), half uniform (every word is seen, so the BPE
    # has merges enough for an ~8000-token vocabulary).
    def word() -> str:
        if rng.random() < 0.5:
            return words[rng.randrange(len(words))]
        return words[min(int(rng.paretovariate(1.1)) - 1, len(words) - 1)]

    return " ".join(word() for _ in range(n))


def build_model(folder: Path) -> tuple[Path, dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    words = lexicon(rng)
    rng.shuffle(words)
    corpus = [sentence(rng, words, 30) for _ in range(20000)]
    tokenizer = train_tokenizer(MODEL["vocab_size"], corpus)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**MODEL, "vocab_size": len(tokenizer)}))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "lexicon.json").write_text(json.dumps(words))
    config = {k: v for k, v in MODEL.items() if not k.endswith("token_id")}
    return folder, {**config, "vocab_size": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters()),
                    "dtype": "float32", "weights": "random (torch.manual_seed(0))"}


def write_data(path: Path, model_dir: Path, n: int) -> Path:
    """n prompt/response records that each tokenize (as both sides encode them) to exactly SEQ_LEN."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = json.loads((model_dir / "lexicon.json").read_text())
    single = [w for w in words[:2000] if len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    rng, records = random.Random(1), []
    while len(records) < n:
        prompt = "copy: " + sentence(rng, words, rng.randint(20, 40))
        budget = SEQ_LEN - len(hf_encode(tok, prompt, "")["input_ids"])  # prompt (+ bos) + eos
        response = sentence(rng, words, 1)
        while (used := len(tok(response, add_special_tokens=False)["input_ids"])) < budget:
            pool = words if budget - used > 4 else single
            response += " " + rng.choice(pool)
        if len(hf_encode(tok, prompt, response)["input_ids"]) == SEQ_LEN:
            records.append({"prompt": prompt, "response": response})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def hf_encode(tok, prompt: str, response: str) -> dict:
    """The usual HF SFT encoding: prompt with the tokenizer's own specials, response + eos trained."""
    head = tok(prompt)["input_ids"]
    body = (tok(response, add_special_tokens=False)["input_ids"] if response else []) + [tok.eos_token_id]
    return {"input_ids": head + body, "labels": [-100] * len(head) + body}


def same_tokens(model_dir: Path, data_path: Path) -> bool:
    """slimtune's own tokenization of the file gives exactly the ids and trained tokens the HF side uses."""
    from slimtune.data import dataset as data
    from slimtune.config import DataConfig
    from slimtune.model.stack import load_tokenizer

    tok = load_tokenizer(model_dir)
    cfg = DataConfig(path=str(data_path), max_length=SEQ_LEN, eval_fraction=0.0)
    ours = data.load_splits(cfg, tok, seed=0).train
    records = [json.loads(line) for line in data_path.read_text().splitlines()]
    for example, record in zip(ours, records, strict=True):
        hf = hf_encode(tok, record["prompt"], record["response"])
        shifted = hf["labels"][1:] + [-100]  # slimtune stores targets already shifted by one
        if example.input_ids != hf["input_ids"] or example.targets != shifted:
            return False
    return True


def launch(spec: dict) -> dict:
    Path(spec["out"]).mkdir(parents=True)
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['side']} run failed:\n{proc.stderr[-4000:]}")
    return json.loads((Path(spec["out"]) / "result.json").read_text())


def table(runs: dict) -> list[dict]:
    keys = ("tokens_per_s", "mean_step_s", "median_step_s", "min_step_s", "device_peak_bytes", "peak_rss_bytes",
            "final_loss")
    return [{"run": name, **{k: r[k] for k in keys}} for name, r in runs.items()]


# ---------------------------------------------------------------- one side (child process)


def summarize(steps: list[dict], warmup: int) -> dict:
    """Steady state: the steps after the warm-up ones; tokens/s = input positions / seconds."""
    measured = steps[warmup:]
    seconds = sum(s["step_s"] for s in measured)
    return {
        "tokens_per_s": sum(s["tokens"] for s in measured) / seconds,
        "mean_step_s": seconds / len(measured),
        "device_peak_bytes": max((s["device_peak_bytes"] for s in steps if s["device_peak_bytes"]), default=None),
        "median_step_s": statistics.median(s["step_s"] for s in measured),
        "min_step_s": min(s["step_s"] for s in measured),
        "final_loss": steps[-1]["loss"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "steps": steps,
    }


def slimtune_side(spec: dict) -> dict:
    from slimtune import train
    from slimtune.engines import settings

    t = TRAIN
    cfg = settings.load(None, [], base={
        "model": spec["model"], "output_dir": spec["out"], "device": "cpu", "precision": "fp32", "method": "lora",
        "data": {"path": spec["data"], "format": "prompt_response", "max_length": SEQ_LEN, "packing": True,
                 "eval_fraction": 0.0},
        "lora": {"rank": t["rank"], "alpha": t["alpha"], "dropout": t["dropout"], "targets": LORA_TARGETS},
        "train": {"steps": spec["steps"], "batch_size": t["batch_size"], "lr": t["lr"], "weight_decay":
                  t["weight_decay"], "max_grad_norm": t["max_grad_norm"], "schedule": t["schedule"],
                  "warmup_steps": 0, "seed": t["seed"], "log_every": 1, "measure_memory": spec["metered"]},
    })
    run, summary = train.fit(cfg, progress=False)
    records = [json.loads(line) for line in (Path(spec["out"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], "loss": r["loss"], "step_s": r["step_s"], "device_peak_bytes":
              r["device_peak_bytes"], "tokens": r["seen_tokens"]} for r in records]
    return {**summarize(steps, spec["warmup"]), "trainable_params": summary["trainable_params"],
            "meter": summary["meter"]}


def step_callback(metered: bool, batch_positions: int):
    """Times (and optionally meters) each optimizer step from on_step_begin to on_step_end."""
    import torch
    from transformers import TrainerCallback

    from slimtune.device.memory import LiveBytesMeter

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.tick, self.meter = time.perf_counter(), None
            if metered:
                self.meter = LiveBytesMeter("cpu")
                self.meter.track(model.parameters())
                self.meter.track(p.grad for p in model.parameters())
                for values in optimizer.state.values():
                    self.meter.track(v for v in values.values() if isinstance(v, torch.Tensor))
                self.meter.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            peak = 0
            if self.meter is not None:
                self.meter.__exit__(None, None, None)
                peak = self.meter.peak
                self.meter.close()
            self.steps.append({"step": state.global_step, "step_s": time.perf_counter() - self.tick,
                               "device_peak_bytes": int(peak), "tokens": batch_positions})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and self.steps:
                self.steps[-1]["loss"] = logs["loss"]

    return StepMeter()


def hf_side(spec: dict) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    t = TRAIN
    tok = AutoTokenizer.from_pretrained(spec["model"])
    records = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    rows = [hf_encode(tok, r["prompt"], r["response"]) for r in records]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=t["rank"], lora_alpha=t["alpha"], lora_dropout=t["dropout"],
                                             target_modules=LORA_TARGETS, bias="none", task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=t["batch_size"],
        learning_rate=t["lr"], weight_decay=t["weight_decay"], max_grad_norm=t["max_grad_norm"],
        lr_scheduler_type=t["schedule"], warmup_steps=0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=t["seed"], use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False,
    )
    callback = step_callback(spec["metered"], t["batch_size"] * SEQ_LEN)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[callback])
    trainer.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    meter = "live tensor bytes (CPU meter)" if spec["metered"] else "none (unmetered timing run)"
    return {**summarize(callback.steps, spec["warmup"]), "trainable_params": trainable, "meter": meter}


def collate(rows: list[dict]) -> dict:
    import torch

    ids = torch.tensor([r["input_ids"] for r in rows])  # (B, T); every row is SEQ_LEN, nothing to pad
    labels = torch.tensor([r["labels"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def child(spec: dict) -> None:
    import torch

    torch.set_num_threads(TRAIN["threads"])
    result = (slimtune_side if spec["side"] == "slimtune" else hf_side)(spec)
    result["torch_threads"] = torch.get_num_threads()
    (Path(spec["out"]) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
