"""The sequence tile the planner chooses (planning/tile_choice.py): a plan whose blocks run in tiles and
that does not fit the card with the auto rule's tile takes the largest offered tile that fits, and
says so in its options; --max-seq names the tile it was found with, and only where blocks are tiled."""

import dataclasses

import pytest

from conftest import tiny_config
from slimtune import cli, config, presets
from slimtune.engines import settings
from slimtune.planning import planner, tile_choice
from slimtune.step import activations

SEQ = 4096
TILED = {"engine": "resident", "precision": "bf16", "activations.checkpoint": "recompute"}


def base_config():
    return settings.load(None, [], base=config.to_dict(planner.planning_config("lora", rank=4)))


def peak(model_config, plan: dict, tile: int) -> int:
    cfg = planner._run_config(base_config(), {**plan, "activations.seq_tile": tile})
    return planner.per_device_estimate(model_config, cfg, None, 1, SEQ).device_peak_bytes  # cached: weigh reads it


def machine(memory: int) -> planner.Machine:
    return planner.Machine(dataclasses.replace(presets.gpu_profile("1GiB"), memory_bytes=memory), 2**50, 2**50)


def test_a_plan_the_auto_tile_does_not_fit_takes_the_largest_tile_that_does(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)
    # The auto rule made to cut long tiles (2 a row: no mask share), so smaller ones are worth offering.
    monkeypatch.setattr(activations, "MASK_BOOL_BYTES", 0)
    monkeypatch.setattr(activations, "MASK_ADDITIVE_BYTES", 0)
    monkeypatch.setattr(activations, "TILE_SHARE", 1)
    model_config = tiny_config("llama", max_position_embeddings=2 * SEQ, num_hidden_layers=1)
    peaks = {tile: peak(model_config, TILED, tile) for tile in (0, SEQ // 2, 1024, 512, 256)}
    assert peaks[0] == peaks[SEQ // 2] > peaks[1024] > peaks[512] > peaks[256]  # auto: two tiles of 2048
    card = (peaks[512] + peaks[1024]) // 2  # 512-token tiles fit, 1024 do not
    result = planner.weigh(model_config, base_config(), TILED, machine(card), 1, SEQ)
    assert result.fits and result.options["activations.seq_tile"] == 512
    assert result.estimate.device_peak_bytes == peaks[512]
    # none fits: the plan is reported as it was, with the auto rule's tile
    result = planner.weigh(model_config, base_config(), TILED, machine(peaks[256] - 1), 1, SEQ)
    assert not result.fits and "activations.seq_tile" not in result.options
    assert result.estimate.device_peak_bytes == peaks[0]


def test_max_seq_names_its_tile_only_where_blocks_are_tiled(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)
    model_config = tiny_config("llama", max_position_embeddings=1024, num_hidden_layers=1)
    roomy = machine(2**40)  # every plan fits at the model's limit
    tiled = planner.weigh(model_config, base_config(), TILED, roomy, 1, 256, max_seq=True)
    assert (tiled.max_seq, tiled.max_seq_tile) == (1024, tile_choice.MIN_TILE)
    untiled = planner.weigh(model_config, base_config(), {"engine": "resident", "precision": "bf16"}, roomy, 1, 256,
                            max_seq=True)
    assert (untiled.max_seq, untiled.max_seq_tile) == (1024, None)
    assert "(tile 256)" in planner._max_seq_cell(tiled) and "tile" not in planner._max_seq_cell(untiled)
    beyond = planner.weigh(model_config, base_config(), TILED, roomy, 1, 256, max_seq=True, seq_limit=1500)
    assert beyond.max_seq == 1500  # --max-seq LIMIT: past the model's positions, as a run extending RoPE
    # each fits at the longest weighed: the cell says longer was not weighed, not that one token more fails
    assert planner._max_seq_cell(untiled) == "1,024 (limit)" and beyond.as_json()["max_seq_limit"] == 1500
    small = machine(planner.weigh(model_config, base_config(), TILED, roomy, 1, 512).estimate.device_peak_bytes)
    short = planner.weigh(model_config, base_config(), TILED, small, 1, 256, max_seq=True)
    assert 256 <= short.max_seq < 1024 and "limit" not in planner._max_seq_cell(short)


def test_max_seq_limit_must_be_positive(capsys):
    assert cli.main(["plan", "--model", "Llama-3.2-1B", "--gpu", "24GiB", "--max-seq", "-5"]) == 2
    assert "--max-seq LIMIT must be a positive token count, got -5." in capsys.readouterr().err


@pytest.mark.parametrize("words, said", [
    (["--seq", "0"], "--seq must be positive, got 0."),
    (["--batch", "-2"], "--batch must be positive, got -2."),
    (["--seq", "256", "--max-seq", "100"], "--max-seq 100 is shorter than --seq 256, which every plan is weighed at;"
                                           " give a LIMIT of at least 256, or a shorter --seq."),
    (["--seq", "1000000000000"], "--seq (1,000,000,000,000) x --batch 1 is 1,000,000,000,000 tokens a step; the"
                                 " planner weighs at most 16,777,216 (2^24)."),
    (["--batch", "100000", "--seq", "2048"], "x --batch 100,000 is 204,800,000 tokens a step"),
    (["--batch", "1000", "--max-seq"], "the model's positions (the --max-seq search's end; give --max-seq a LIMIT)"
                                       " (131,072) x --batch 1,000"),
    (["--png", "plan.jpg"], "the picture's path 'plan.jpg' must end in .png."),
])
def test_plan_flags_that_cannot_be_planned_are_one_sentence_before_any_weighing(capsys, monkeypatch, words, said):
    """A huge step was a torch allocation traceback (the synthetic batch is real), a LIMIT below --seq
    printed a 'longest' shorter than the rows that fit, and a bad --png path was refused after the plans."""
    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("weighed plans before refusing"))
    assert cli.main(["plan", "--model", "Llama-3.1-8B", "--gpu", "24GiB", *words]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.quick
def test_largest_fitting_tile_by_bisection():
    asked = []

    def fits(tile):
        asked.append(tile)
        return tile <= 1024

    assert tile_choice.largest_fitting(8192, fits) == 1024
    assert len(asked) <= 3  # the smallest, then a bisection of the four others
    assert tile_choice.largest_fitting(8192, lambda tile: False) is None
    assert tile_choice.largest_fitting(200, fits) is None  # no tile shorter than the row


def test_rank_with_full_fine_tuning_is_said_to_be_ignored(capsys, monkeypatch):
    """--rank 16 --method full was accepted without a word (full fine-tuning has no adapter)."""
    monkeypatch.setattr(planner, "plan", lambda *a, **k: [])
    monkeypatch.setattr(planner, "table", lambda *a, **k: "TABLE")
    assert cli.main(["plan", "--model", "Llama-3.1-8B", "--gpu", "24GiB", "--method", "full", "--rank", "8"]) == 0
    assert "warning: --rank is set but --method is full (every weight trains, no adapter): ignored." in \
        capsys.readouterr().err
    assert cli.main(["plan", "--model", "Llama-3.1-8B", "--gpu", "24GiB", "--method", "full"]) == 0
    assert "--rank" not in capsys.readouterr().err
