"""The run builder: precision choices, and the loop's bookkeeping through the public API."""

import json

import pytest
import torch

from conftest import save_tiny_model, write_jsonl
from slimtune import train
from slimtune.engines import settings
from slimtune.model import lora


def small_run(tmp_path, model_dir, **overrides):
    records = [{"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"} for a in range(6) for b in range(6)]
    write_jsonl(tmp_path / "d.jsonl", records)
    base = {"model": str(model_dir), "data": {"path": str(tmp_path / "d.jsonl"), "max_length": 32},
            "train": {"steps": 2, "batch_size": 2}, "output_dir": str(tmp_path / "out"), "device": "cpu"}
    return settings.load(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def test_bf16_lora_keeps_the_base_in_bf16_and_adapters_in_fp32(tmp_path, tiny_model_dir):
    run = train.build(small_run(tmp_path, tiny_model_dir, precision="bf16"))
    adapter = next(iter(lora.adapters(run.stack.model).values()))
    assert adapter.base.weight.dtype == torch.bfloat16
    assert adapter.lora_A.weight.dtype == torch.float32
    from slimtune.data import dataset as data

    batch = data.eval_batches(run.splits.train[:4], 2, 32, True, run.tokenizer.pad_token_id)[0]
    result = run.engine.step([batch])
    assert torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0


def test_fit_logs_every_step_and_reports_measured_peak(tmp_path, tiny_model_dir):
    run, summary = train.fit(small_run(tmp_path, tiny_model_dir), progress=False)
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    params = sum(p.numel() * p.element_size() for p in run.stack.model.parameters())
    # the peak holds at least the weights, and the summary names the meter that measured it
    assert summary["device_peak_bytes"] > params
    assert "CPU meter" in summary["meter"]


def test_resume_restores_the_data_stream_position(tmp_path, tiny_model_dir):
    """train.resume puts the stream where the checkpoint left it: the next batch is the one an
    uninterrupted stream gives after the steps already taken, not the first one again."""
    cfg = small_run(tmp_path, tiny_model_dir, **{"train.steps": 3, "train.grad_accum": 2, "train.save_every": 2})
    run, _ = train.fit(cfg, progress=False)
    straight = train.batch_stream(run)
    first = straight.next_batch()
    for _ in range(3 * 2 - 1):  # every micro-batch of the 3 steps the checkpoint holds
        straight.next_batch()
    resumed_run = train.build(cfg)
    resumed = train.batch_stream(resumed_run)
    assert train.resume(resumed_run, resumed) == 3
    after = resumed.next_batch()
    want = straight.next_batch()
    assert torch.equal(after.input_ids, want.input_ids) and torch.equal(after.targets, want.targets)
    assert not torch.equal(after.input_ids, first.input_ids)


@pytest.mark.parametrize("engine, method", [("resident", "lora"), ("resident", "full"), ("slide", "lora"),
                                            ("slide", "full")])
def test_the_export_holds_the_engines_trainable_state(tmp_path, tokenizer, engine, method):
    """What export writes is engine.trainable_state(), weight for weight, and it loads back: an adapter
    under PEFT's names, a full model with a tied embedding and head through transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "model", tokenizer, tie_word_embeddings=True)
    run, _ = train.fit(small_run(tmp_path, model_dir, engine=engine, method=method, **{"train.lr": 0.05}),
                       progress=False)
    trained = run.engine.trainable_state()
    if method == "lora":
        saved = load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
        assert saved.keys() == {lora.PEFT_PREFIX + name for name in trained}
        assert all(torch.equal(saved[lora.PEFT_PREFIX + name], t) for name, t in trained.items())
        assert any(t.abs().sum() > 0 for name, t in trained.items() if "lora_B" in name)  # it trained
        return
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "model"), local_files_only=True)
    state = loaded.state_dict()
    assert all(torch.equal(state[name], t) for name, t in trained.items())
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in trained
    assert torch.equal(state["lm_head.weight"], trained["model.embed_tokens.weight"])
    start = load_file(str(model_dir / "model.safetensors"))
    assert all(not torch.equal(start[name], t) for name, t in trained.items())  # every weight trained


def test_an_engines_own_sample_is_held_out_of_training():
    from types import SimpleNamespace

    from slimtune.data import dataset as data
    examples = [data.Example([3 * i, 3 * i + 1, 3 * i + 2], [3 * i + 1, 3 * i + 2, data.IGNORE_INDEX])
                for i in range(1, 21)]  # no token in two examples
    splits = data.Splits(train=list(examples), eval=[], report=data.DataReport(20, 0, 0, 0))
    cfg = settings.load(None, [], base={"model": "x", "data": "x.jsonl", "train": {"batch_size": 2}})
    batches, rest = train.engine_sample(cfg, splits, SimpleNamespace(pad_token_id=0), 6)
    firsts = {e.input_ids[0] for e in examples}
    sampled = {int(t) for b in batches for t in b.input_ids.reshape(-1)} & firsts
    kept = {e.input_ids[0] for e in rest.train}
    assert len(rest.train) == 14 and not sampled & kept and len(sampled) == 6
    assert sampled | kept == firsts
    again, _ = train.engine_sample(cfg, splits, SimpleNamespace(pad_token_id=0), 6)  # drawn the same each run
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again))


def fit_with_and_without_early_starts(tmp_path, tiny_model_dir, settings: dict) -> dict:
    """train.fit twice, the engine allowed to start ahead (True) and not (False): per run, whether
    each step was handed the next batches (then=), the trained weights, and the logged losses."""
    import json

    from slimtune import train

    found = {}
    for early in (True, False):
        folder = tmp_path / str(early)
        folder.mkdir()
        cfg = small_run(folder, tiny_model_dir, **settings)
        run = train.build(cfg)
        run.engine.starts_ahead, calls, step = early, [], run.engine.step
        run.engine.step = lambda *args, **kwargs: (calls.append(kwargs.get("then") is not None), step(*args, **kwargs))[1]
        train.fit(cfg, progress=False, run=run)
        losses = [json.loads(line)["loss"] for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
        found[early] = calls, run.engine.trainable_state(), losses
    return found
