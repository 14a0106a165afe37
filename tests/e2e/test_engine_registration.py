"""An engine is one file that registers itself: a toy engine (plain SGD with momentum on the
device, written only against engines.base) is declared here, in this file alone, and trains,
checkpoints, resumes exactly, logs its own figures, exports, shows in the help and is weighed by
the planner, all through the CLI, with no edit anywhere else."""

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from e2e_helpers import workdir  # noqa: F401  (a fixture)
from slimtune import cli, engines
from slimtune.device import memory, speed
from slimtune.store.checkpoint import EngineState
from slimtune.config import setting
from slimtune.data.dataset import IGNORE_INDEX
from slimtune.engines.base import Engine, StepResult
from slimtune.step.forward import evaluate_batches, step_divisor, to_float
from slimtune.store.checkpoint import check_resumable, copy_named
from slimtune.errors import UserError


@dataclass
class ToyConfig:
    momentum: float = setting(0.0, "engine=toy: SGD momentum.")

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"toy.momentum must be in [0, 1), got {self.momentum}.")


class ToyEngine(Engine):
    name = "toy"

    def __init__(self, stack, cfg, device, precision, dist):
        self.stack, self.device, self.train_cfg, self.dist = stack, device, cfg.train, dist
        self.named = [(n, p) for n, p in stack.model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD([p for _, p in self.named], lr=cfg.train.lr,
                                         momentum=cfg.section("toy").momentum)
        self.meter = memory.meter_for(device, cfg.train.measure_memory)
        self.step_count = 0

    def _loss_sum(self, batch):
        batch = batch.to(self.device)
        hidden = self.stack.final_hidden(batch.input_ids, batch.position_ids)
        logits = self.stack.head(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def _tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        for state in self.optimizer.state.values():
            yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))

    def step(self, micro_batches, total_targets=None, then=None):
        self.stack.model.train()
        total = step_divisor(micro_batches, total_targets)
        with self.meter.measure(self._tensors()) as reading:
            loss = 0.0
            for batch in micro_batches:
                part = self._loss_sum(batch)
                (part / total).backward()
                loss = loss + part.detach()
            self.dist.all_reduce_(p.grad for _, p in self.named)  # under torchrun: summed across ranks
            grad_norm = torch.nn.utils.get_total_norm([p.grad for _, p in self.named])
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        buffers = [s["momentum_buffer"] for s in self.optimizer.state.values() if "momentum_buffer" in s]
        extras = {"toy_momentum_norm": to_float(torch.nn.utils.get_total_norm(buffers))} if buffers else {}
        return StepResult(loss=to_float(loss) / total, tokens=total,
                          seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=self.train_cfg.lr,
                          grad_norm=to_float(grad_norm), device_peak_bytes=reading.peak, host_link_bytes=0,
                          device_peak_breakdown=reading.peak_breakdown, extras=extras)

    def evaluate(self, batches):
        self.stack.model.eval()
        return evaluate_batches(batches, self._loss_sum)

    def trainable_state(self):
        return {n: p.detach() for n, p in self.named}

    def host_bytes(self):
        return 0

    def state_dict(self):
        momentum = {n: self.optimizer.state[p]["momentum_buffer"] for n, p in self.named if p in self.optimizer.state}
        return EngineState(engine=self.name, step=self.step_count, trainable=self.trainable_state(), exp_avg={},
                           exp_avg_sq={}, adam_steps={}, extra={"momentum": momentum})

    def load_state_dict(self, state):
        check_resumable(state, [n for n, _ in self.named], self.name)
        copy_named(self.trainable_state(), state.trainable)
        for name, param in self.named:
            if name in state.extra.get("momentum", {}):
                self.optimizer.state[param] = {"momentum_buffer": state.extra["momentum"][name].to(param, copy=True)}
        self.step_count = state.step


def validate(cfg):
    if cfg.method != "full":
        raise UserError("engine=toy trains every weight; set method=full.")


def step_time(model_config, cfg, counts, gpu, batch_size, seq_len):
    flops = speed.step_flops(model_config, cfg.method, batch_size, seq_len) * cfg.train.grad_accum
    return speed.serial_step_time(flops, counts.trainable_params, gpu, cfg.precision)


@pytest.fixture()
def toy_engine():
    engines.register(engines.EngineSpec(
        name="toy", summary="plain SGD with momentum, everything on the device (a test's engine).",
        build=ToyEngine, step_time=step_time, section=ToyConfig, validate=validate,
        plans=lambda method: [{"precision": "fp32"}] if method == "full" else []))
    yield
    engines.unregister("toy")


def train(workdir, *overrides, check=True):
    args = ["train", "--no-progress", "run.yaml", "engine=toy", "method=full", "toy.momentum=0.9", "train.lr=0.05",
            "train.schedule=constant", *overrides]
    code = cli.main(args)
    assert code == 0 or not check, f"slimtune {' '.join(args)} exited {code}"
    return code


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_toy_engine_registered_here_trains_resumes_and_exports_through_the_cli(workdir, toy_engine, monkeypatch):
    monkeypatch.chdir(workdir)
    train(workdir, "train.steps=4", "output_dir=straight")
    train(workdir, "train.steps=2", "output_dir=split")
    train(workdir, "train.steps=4", "output_dir=split")
    straight, split = records(workdir / "straight"), records(workdir / "split")
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]  # resumed exactly, momentum included
    assert all(r["toy_momentum_norm"] > 0 for r in straight)  # the engine's own figure reaches metrics.jsonl
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert json.loads((workdir / "split" / "checkpoints" / "step-00000004" / "meta.json").read_text())["engine"] == "toy"
    exported = load_file(str(workdir / "straight" / "model" / "model.safetensors"))
    final = load_file(str(workdir / "straight" / "checkpoints" / "step-00000004" / "trainable.safetensors"))
    assert final and all(torch.equal(exported[name], tensor) for name, tensor in final.items())


def test_the_toy_engine_is_in_the_help_and_the_plans_and_refuses_what_it_cannot(workdir, toy_engine, monkeypatch,
                                                                                 capsys):
    monkeypatch.chdir(workdir)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "toy.momentum" in help_text and "a test's engine" in help_text
    assert cli.main(["plan", "--model", "model", "--gpu", "1GiB", "--seq", "32", "--method", "full", "--json"]) == 0
    assert "toy" in {plan["engine"] for plan in json.loads(capsys.readouterr().out)}
    assert train(workdir, "method=lora", check=False) == 2
    assert train(workdir, "toy.momentum=1.5", check=False) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["slimtune: error: engine=toy trains every weight; set method=full.",
                      "slimtune: error: toy.momentum must be in [0, 1), got 1.5."]
