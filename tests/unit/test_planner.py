"""The planner's choices and the ways a user reaches them: slimtune plan, plan=auto, an OOM."""

import dataclasses
import json

import pytest
import torch

from conftest import write_jsonl
from slimtune import cli, config, presets, train
from slimtune.engines import settings
from slimtune.planning import planner, probe
from slimtune.errors import UserError


def test_plan_json_lists_every_plan_with_one_recommended(tiny_model_dir, capsys):
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "1GiB", "--seq", "64", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert {p["options"]["precision"] for p in plans} == {"bf16", "fp32"}
    for p in plans:
        assert {"engine", "options", "device_peak_bytes", "host_bytes", "fits", "tokens_per_s", "recommended"} <= set(p)
        assert p["tokens_per_s_kind"] == "modelled"
    assert sum(p["recommended"] for p in plans) == 1
    assert max(plans, key=lambda p: p["tokens_per_s"])["recommended"]


def test_plan_table_labels_memory_measured_and_speed_modelled(tiny_model_dir, capsys, tmp_path, monkeypatch):
    # LoRA: the labels are the same for every method and model (a preset's plans: test_plan_picture)
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)  # a card of a few MiB, as a tiny model needs
    picture = tmp_path / "plans" / "plan.png"
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "2MiB", "--seq", "64", "--method", "lora",
                     "--png", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "fake tensors" in out and "modelled" in out and "recommended:" in out
    assert "note:" not in out  # --seq 64 is within the tiny model's positions
    # the plans as a picture (plan_picture's own tests check what is drawn)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000


def test_host_ram_is_checked_before_the_device(tiny_model_dir, monkeypatch):
    """Full fine-tuning on a card too small for resident: slide fits the device, and only while
    the host can hold its masters and moments; then the sentence names the host RAM. (Weight decay
    leaves lsp's plans out: lsp refuses it, and would fit this card with little host RAM; chunk's,
    which keep every weight on the device, are left out here for the same reason, and slide with a
    chunk working set, which fits that host.)"""
    model_config = presets.model_config(str(tiny_model_dir))
    base, gpu = planner.planning_config("full", weight_decay=0.01), presets.gpu_profile("0.4MiB")  # resident: ~650 KiB
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)
    def plans(machine, chunked=False):
        return [r for r in planner.plan(model_config, base, machine, 1, 32)
                if r.engine != "chunk" and (r.options.get("slide.working_set") == "chunk") == chunked]

    def fastest_fitting(results):
        return max((r for r in results if r.fits), key=lambda r: r.tokens_per_s, default=None)

    results = plans(planner.Machine(gpu, 2**40, 2**40))
    chosen = fastest_fitting(results)
    assert chosen is not None and chosen.engine == "slide" and chosen.estimate.host_bytes > 0
    small_host = planner.Machine(gpu, chosen.estimate.host_bytes // 2, 2**40)
    results = plans(small_host)
    assert fastest_fitting(results) is None
    assert all(not r.host_fits for r in results if r.engine == "slide")
    assert "host RAM: needs" in planner.no_fit_sentence(results, small_host)
    assert fastest_fitting(plans(small_host, chunked=True)) is not None  # one chunk's state fits where all do not


def test_a_plan_longer_than_the_model_s_positions_says_so(tiny_model_dir, capsys):
    """The demo model has 256 positions and plan's default --seq is 2048: the plans are of rows the model
    never saw, and nothing said so (found by a newcomer walkthrough)."""
    positions = presets.model_config(str(tiny_model_dir)).max_position_embeddings
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "1GiB", "--seq", str(positions + 1)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"note: --seq {positions + 1} is longer than the model's {positions:,} positions (max_position_embeddings);"
        f" --seq {positions} plans rows of its own length.")
    # (a plan within the positions says nothing of them: test_plan_table_labels_memory_measured_and_speed_modelled)


def test_nothing_fits_a_tiny_card(tiny_model_dir):
    base = planner.planning_config("full")
    results = planner.plan(presets.model_config(str(tiny_model_dir)), base,
                           planner.Machine(presets.gpu_profile("1MiB"), 2**40, 2**40), 1, 32)
    assert not any(r.fits for r in results) and planner.recommended(results) is None


def test_plan_refuses_unknown_model_and_gpu(capsys):
    assert cli.main(["plan", "--model", "Llama-9", "--gpu", "24GiB"]) == 2
    assert "Llama-9" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "Llama-3.2-1B", "--gpu", "lots"]) == 2
    assert "unknown GPU 'lots'" in capsys.readouterr().err


def run_config(tmp_path, model_dir, *overrides):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{a} plus {a}?", "response": f" {2 * a}"} for a in range(30)])
    base = {"model": str(model_dir), "data": {"path": str(tmp_path / "d.jsonl"), "max_length": 32},
            "train": {"steps": 1, "batch_size": 2}, "output_dir": str(tmp_path / "out"), "device": "cpu"}
    return settings.load(None, list(overrides), base=base)


def test_plan_auto_trains_with_the_recommended_plan(tmp_path, tiny_model_dir, capsys):
    run = train.build(run_config(tmp_path, tiny_model_dir, "plan=auto", "gpu=1GiB"))
    assert run.cfg.engine == "resident" and run.cfg.precision == "bf16"
    assert "tokens/s modelled)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=auto must resolve to the CPU")
def test_plan_auto_for_the_cpu_itself_prints_no_modelled_speed(tmp_path, tiny_model_dir, capsys):
    """Planned for the CPU it runs on (no gpu given), the plans are ranked by a generic card's rates:
    it printed that card's millions of tokens/s as the CPU's (found by a newcomer walkthrough)."""
    cfg = dataclasses.replace(run_config(tmp_path, tiny_model_dir), plan="auto", device="auto")
    settings.validate(cfg)
    train.build(cfg)
    said = capsys.readouterr().out
    assert "plan=auto on cpu:" in said and "rtx4090's rates, cpu's own speed not modelled)" in said
    assert "tokens/s" not in said


def test_plan_auto_with_no_fitting_plan_names_the_need(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match=r"no plan fits .*: the smallest on the device, (resident|slide) precision=bf16 .*, lacks device: needs \d"):
        train.build(run_config(tmp_path, tiny_model_dir, "plan=auto", "gpu=1MiB"))


def test_out_of_memory_ends_with_a_plan_that_fits(tmp_path, tiny_model_dir):
    cfg = run_config(tmp_path, tiny_model_dir)
    run = train.build(cfg)

    def exhausted(micro_batches, total_targets=None, then=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    run.engine.step = exhausted
    with pytest.raises(UserError, match=r"out of device memory at step 1 .*a plan that fits .*engine=resident"):
        train.fit(cfg, progress=False, run=run)


def test_out_of_memory_in_the_evaluation_after_a_step_is_one_sentence_too(tmp_path, tiny_model_dir, monkeypatch):
    """The evaluation after a step runs out of memory as the step can: the same advice, naming when. A run that
    already is the planner's pick (plan=auto) is told so, with what to lower, not sent to the same plan."""
    cfg = run_config(tmp_path, tiny_model_dir, "train.eval_every=1", "plan=auto", "gpu=1GiB")
    run = train.build(cfg)

    def exhausted(run, batches):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train, "evaluate", exhausted)
    with pytest.raises(UserError, match=r"out of device memory evaluating after step 1 with engine=resident "
                                        r"precision=bf16, the plan the planner picks .*lower train.batch_size"):
        train.fit(run.cfg, progress=False, run=run)


def test_probe_writes_a_profile_the_planner_reads(tmp_path):
    profile = probe.run(str(tmp_path / "me.json"))
    assert profile["fp32_tflops"] > 0 and profile["memory_gbps"] > 0
    card = presets.gpu_profile(str(tmp_path / "me.json"))
    assert card.memory_bytes == profile["memory_bytes"]
    # its rates are measured, and the table's footnote says so (it said "spec-sheet" of every card)
    assert card.rates == "measured" and presets.gpu_profile("rtx4090").rates == "spec-sheet"
    machine = planner.Machine(card, 2**40, 2**40)
    assert f"over {card.name}'s measured rate at" in planner.speed_note(machine)


def test_every_plan_with_a_4bit_base_pays_for_its_dequantization_in_the_modelled_time():
    """Each engine's modelled step time: the same plan and the same counted bytes take longer over a
    4-bit base than over a bf16 one, by at least the dequantization traffic over the card's bandwidth."""
    from slimtune import engines
    from slimtune.device import speed

    model_config, gpu = presets.model_config("Llama-3.2-1B"), presets.gpu_profile("rtx4090")
    counts = speed.StepCounts(trainable_params=10**7, host_link_bytes=0, disk_bytes=0)
    base = config.to_dict(planner.planning_config("lora"))
    quantized = [plan for plan in engines.plans_for("lora") if plan.get("quant.scheme", "none") != "none"]
    assert {plan["engine"] for plan in quantized} == {"resident", "slide"}
    for plan in quantized:
        times = {}
        for scheme in ("nf4", "none"):
            cfg = settings.load(None, [f"{k}={v}" for k, v in {**plan, "quant.scheme": scheme}.items()], base=base)
            times[scheme] = engines.get(cfg.engine).step_time(model_config, cfg, counts, gpu, 1, 1024).seconds
        passes = 3 if plan["engine"] == "slide" or plan.get("activations.checkpoint", "none") != "none" else 2
        floor = speed.dequant_bytes(model_config, passes) / (gpu.memory_gbps * 1e9)
        assert times["nf4"] - times["none"] == pytest.approx(floor, rel=1e-9), plan


def test_the_plans_whose_estimates_take_longest_are_handed_out_first():
    """_weigh_all's workers take plans from the end of its order: lsp's (its first step checks the
    projectors: three passes over the model), then those estimated at full depth, then the recomputed."""
    base = planner.planning_config("full", 16)
    expected = {json.dumps(p, sort_keys=True): planner._expected_length(base, p) for p in planner.applicable_plans(base)}

    def length(**plan) -> tuple:
        return expected[json.dumps(plan, sort_keys=True)]

    lsp = {"engine": "lsp", "precision": "bf16"}
    chunk = {"engine": "chunk", "precision": "bf16", "activations.checkpoint": "recompute", "chunk.n_chunks": 16,
             "chunk.gradients": "host"}
    resident = {"engine": "resident", "precision": "bf16"}
    assert (length(**lsp, **{"activations.checkpoint": "recompute"}) > length(**lsp) > length(**chunk)
            > length(**resident, **{"activations.checkpoint": "recompute"}) > length(**resident))


def test_a_run_is_the_plan_when_the_plan_changes_none_of_its_settings():
    """The advice after an out-of-memory error says when the run already is the planner's pick (plan=auto)."""
    from types import SimpleNamespace

    cfg = settings.load(None, ["engine=lsp", "precision=bf16", "activations.checkpoint=recompute"],
                        base={"model": "x", "data": "x.jsonl", "method": "full", "output_dir": "out"})
    assert planner.is_the_plan(cfg, SimpleNamespace(engine="lsp", options={"precision": "bf16",
                                                                         "activations.checkpoint": "recompute"}))
    assert not planner.is_the_plan(cfg, SimpleNamespace(engine="resident", options={"precision": "bf16"}))
    assert not planner.is_the_plan(cfg, SimpleNamespace(engine="lsp", options={"precision": "fp32"}))
