"""The planner on several machines and cards (slimtune plan --nodes/--gpus-per-node): ranks per plan,
per-device figures (measured under ddp; under fsdp rank 0's step measured under a fake process group,
or derived and labelled where none can start), the gradient payload each
engine's fake step hands to its all-reduces (counted: lsp's is d x d per matrix), host RAM shared
by a machine's ranks, and the job's modelled speed."""

import copy

import pytest
import torch

from conftest import engine_config
from test_slide import batches, model_of
from slimtune import assembly, cli, presets
from slimtune.dist import ranks as distributed
from slimtune.planning import planner, rank_plan
from slimtune.config import TrainConfig
from slimtune.engines.lsp.engine import LspConfig


@pytest.fixture(scope="module")
def model_config(tiny_model_dir):
    return presets.model_config(str(tiny_model_dir))


def weighed(model_config, machine, method="full"):
    return planner.plan(model_config, planner.planning_config(method), machine, 1, 32)


def test_ranks_are_one_per_card_or_one_per_machine_for_an_engine_spanning_cards(model_config):
    machine = planner.Machine(presets.gpu_profile("rtx4090"), 2**40, 2**40, cards=4, nodes=2)
    results = weighed(model_config, machine)
    assert {r.ranks for r in results if r.engine == "roundpipe"} == {2}
    assert {r.ranks for r in results if r.engine != "roundpipe"} == {8}
    one = weighed(model_config, planner.Machine(presets.gpu_profile("rtx4090"), 2**40, 2**40))
    assert not any(r.options.get("dist.strategy") == "fsdp" for r in one)  # nothing to shard across


def test_ddp_figures_are_the_measured_ones_and_fsdp_is_rank_zeros_measured_step(model_config):
    """Under fsdp the plan's figures are rank 0's sharded step measured under a fake process group
    (estimate with ranks: held to a gloo rank's meter in test_fsdp.py), not a formula: the weights,
    gradients and moments at its peak are a quarter of one device's, to within a row a tensor."""
    from slimtune.planning import estimate

    gpu = presets.gpu_profile("rtx4090")
    machine = planner.Machine(gpu, 2**40, 2**40, cards=4, nodes=1)
    results = {(r.engine, r.label): r for r in weighed(model_config, machine)}
    ddp, fsdp = results[("resident", "precision=bf16")], results[("resident", "precision=bf16 dist.strategy=fsdp")]
    single = planner.weigh(model_config, planner.planning_config("full"), {"engine": "resident", "precision": "bf16"},
                           planner.Machine(gpu, 2**40, 2**40), 1, 32)
    assert ddp.estimate == single.estimate and not ddp.derived
    assert not fsdp.derived and fsdp.as_json()["device_peak_kind"].startswith("measured")
    cfg = planner._run_config(planner.planning_config("full"), {"engine": "resident", "precision": "bf16",
                                                                 "dist.strategy": "fsdp"})
    measured = estimate.estimate(model_config, cfg, 1, 32, ranks=4)
    assert fsdp.estimate.device_peak_bytes == measured.device_peak_bytes
    assert fsdp.estimate.breakdown == measured.breakdown
    # FSDP2 pads each shard to ceil(rows / 4) rows: at most one fp32 row of each weight (9 a block, and
    # the embedding, final norm and head) more or less than a quarter, two for the moments.
    rows = (9 * model_config.num_hidden_layers + 3) * 4 * max(model_config.hidden_size, model_config.intermediate_size)
    for category, count in (("weights", 1), ("optimizer", 2)):
        assert abs(fsdp.estimate.breakdown[category] - ddp.estimate.breakdown[category] / 4) <= count * rows + 64, category
    assert fsdp.estimate.device_peak_bytes < ddp.estimate.device_peak_bytes


def test_fsdp_is_derived_by_formula_and_labelled_where_no_fake_job_can_start(model_config, monkeypatch):
    """Inside a launched job (a process group exists: fake_ranks.available is false) the fsdp figure
    falls back to rank_plan.sharded over one device's measurement, labelled derived."""
    from slimtune.dist import fake_ranks

    monkeypatch.setattr(fake_ranks, "available", lambda: False)
    machine = planner.Machine(presets.gpu_profile("rtx4090"), 2**40, 2**40, cards=4, nodes=1)
    results = {(r.engine, r.label): r for r in weighed(model_config, machine)}
    ddp, fsdp = results[("resident", "precision=bf16")], results[("resident", "precision=bf16 dist.strategy=fsdp")]
    assert fsdp.derived and fsdp.as_json()["device_peak_kind"].startswith("derived")
    blocks = rank_plan.block_params(model_config, ddp.estimate.total_params)
    per_block = blocks / model_config.num_hidden_layers
    head = model_config.vocab_size * model_config.hidden_size + model_config.hidden_size
    embed = 0 if model_config.tie_word_embeddings else model_config.vocab_size * model_config.hidden_size
    gathered = 2 * (2 * per_block + head + embed) + 2 * (per_block + head + embed)  # bf16 gathers (precision=bf16)
    sharded_state = sum(ddp.estimate.breakdown[c] for c in ("weights", "gradients", "optimizer"))
    expected = ddp.estimate.device_peak_bytes - sharded_state * 3 / 4 + gathered
    assert fsdp.estimate.device_peak_bytes == pytest.approx(expected, abs=8)


def test_the_payload_is_what_the_engine_sums(model_config):
    """Resident sums every trained gradient (fp32: 4 bytes each); the table's job speed pays for it."""
    machine = planner.Machine(presets.gpu_profile("rtx4090"), 2**40, 2**40, cards=2, nodes=2)
    result = next(r for r in weighed(model_config, machine) if r.engine == "resident" and r.label == "precision=fp32")
    assert result.estimate.allreduce_bytes == 4 * result.estimate.trainable_params
    assert result.sync_s == pytest.approx(
        2 * 3 / 4 * result.estimate.allreduce_bytes / (rank_plan.NETWORK_GBPS * 1e9), rel=1e-9)
    assert result.tokens_per_s == pytest.approx(4 * 32 / (result.time.seconds + result.sync_s), rel=1e-9)


def test_lsp_sums_d_by_d_per_matrix_on_a_real_step():
    model = model_of(3)
    cfg = engine_config(TrainConfig(steps=2, batch_size=2, lr=1e-3, max_grad_norm=0.5), engine="lsp", method="full",
                        precision="fp64", sections={"lsp": LspConfig(d=8, r=3, check_every=0, fit_iterations=2)})
    counting = distributed.Counting()
    engine = assembly.assemble(cfg, assembly.stack_of(copy.deepcopy(model), cfg, torch.device("cpu"), "fp64"),
                               torch.device("cpu"), "fp64", counting)
    engine.use_sample(batches(model.config.vocab_size, 5))
    engine.step(batches(model.config.vocab_size, 0))
    assert counting.take_reduced_bytes() == sum(8 * m.d ** 2 for m in engine.modules)  # fp64: 8 bytes a number
    assert sum(m.d ** 2 for m in engine.modules) * 20 < sum(p.numel() for p in model.parameters())


def test_host_ram_is_shared_by_the_ranks_of_a_machine(model_config):
    gpu = presets.gpu_profile("rtx4090")
    slide = {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host"}
    alone = planner.weigh(model_config, planner.planning_config("full"), slide, planner.Machine(gpu, 2**40, 2**40),
                          1, 32)
    need = alone.estimate.host_bytes
    roomy = planner.Machine(gpu, int(need * 2 / planner.HOST_RAM_SHARE) + 1, 2**40, cards=2)
    tight = planner.Machine(gpu, int(need * 1.5 / planner.HOST_RAM_SHARE), 2**40, cards=2)
    assert planner.weigh(model_config, planner.planning_config("full"), slide, roomy, 1, 32).fits
    short = planner.weigh(model_config, planner.planning_config("full"), slide, tight, 1, 32)
    assert "host RAM" in short.short
    # the table's host RAM is one rank's (under the machine's RAM): its "no" says the ranks' total
    table = planner.table([short], "t", tight)
    assert f"no (host RAM: 2 ranks x {planner.human_bytes(need)})" in table, table


def test_plan_table_says_what_is_per_device(tiny_model_dir, capsys):
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "rtx4090", "--seq", "32", "--method", "full",
                     "--nodes", "2", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 machines, each 2 x rtx4090" in out and "per device (per rank)" in out
    assert "** derived, not measured" not in out and "dist.strategy=fsdp" in out  # fsdp measured (fake_ranks)
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "rtx4090", "--nodes", "0"]) == 2
