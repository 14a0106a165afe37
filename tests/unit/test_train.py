"""The run builder: precision choices, and the loop's bookkeeping through the public API."""

import json

import torch

from conftest import write_jsonl
from slimtune import config, lora, train


def small_run(tmp_path, model_dir, **overrides):
    records = [{"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"} for a in range(6) for b in range(6)]
    write_jsonl(tmp_path / "d.jsonl", records)
    base = {"model": str(model_dir), "data": {"path": str(tmp_path / "d.jsonl"), "max_length": 32},
            "train": {"steps": 2, "batch_size": 2}, "output_dir": str(tmp_path / "out"), "device": "cpu"}
    return config.load(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def test_bf16_lora_keeps_the_base_in_bf16_and_adapters_in_fp32(tmp_path, tiny_model_dir):
    run = train.build(small_run(tmp_path, tiny_model_dir, precision="bf16"))
    adapter = next(iter(lora.adapters(run.stack.model).values()))
    assert adapter.base.weight.dtype == torch.bfloat16
    assert adapter.lora_A.weight.dtype == torch.float32
    from slimtune import data

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
