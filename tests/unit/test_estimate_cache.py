"""The planner's estimate cache keys on every source file of slimtune's, so no code change elsewhere
(an engine's, the host optimizer's) can leave an old answer on disk to be read back."""

from pathlib import Path

import pytest

import slimtune
from slimtune.planning import estimate_cache


@pytest.mark.quick
def test_the_key_covers_every_source_file_of_the_package():
    package = Path(slimtune.__file__).parent
    everything = set(package.rglob("*.py")) | set(package.rglob("*.json"))
    keyed = set(estimate_cache.sources())
    assert everything <= keyed, sorted(str(p.relative_to(package)) for p in everything - keyed)[:5]
    assert package / "engines" / "slide" / "engine.py" in keyed


def _cfg(**activations):
    from slimtune.planning import planner

    base = planner.planning_config("lora")
    return planner._run_config(base, {"engine": "resident", "precision": "fp32", "activations.checkpoint": "recompute",
                                      **{f"activations.{k}": v for k, v in activations.items()}})


def test_the_key_names_the_tile_the_step_runs_not_the_setting():
    from conftest import tiny_config

    config = tiny_config(intermediate_size=64, hidden_size=32)  # auto: 8 tiles a row (>= 256 tokens each)
    auto = estimate_cache._key(config, _cfg(), 1, 2048)
    assert auto == estimate_cache._key(config, _cfg(seq_tile=256), 1, 2048)  # the auto rule's tile here
    assert auto == estimate_cache._key(config, _cfg(mlp_chunk=256), 1, 2048)  # the setting's former name
    assert auto != estimate_cache._key(config, _cfg(seq_tile=512), 1, 2048)
    # a tile as long as the row or longer: the row runs whole (the auto rule's too: rows of 256 tokens)
    assert estimate_cache._key(config, _cfg(seq_tile=300), 1, 256) == estimate_cache._key(config, _cfg(), 1, 256)
    assert estimate_cache._key(config, _cfg(seq_tile=4096), 1, 2048) == estimate_cache._key(
        config, _cfg(seq_tile=2048), 1, 2048)


def test_the_auto_tile_and_the_same_tile_set_by_hand_estimate_alike():
    """What the shared key stands on: the step reads the setting only as the tile it resolves to."""
    from conftest import tiny_config
    from slimtune.planning import estimate

    config = tiny_config()
    found = [estimate.estimate(config, _cfg(**tile), 1, 600) for tile in ({}, {"seq_tile": 256})]
    assert estimate_cache.tile_run(config, _cfg(), 600) == 256
    assert found[0] == found[1]
    assert found[0] != estimate.estimate(config, _cfg(seq_tile=600), 1, 600)  # tiles change the step here


def test_an_estimate_leaves_the_model_config_that_keys_it_as_it_was():
    """Building the fake model set the caller's config's dtype and use_cache: the same question asked
    again then had another key, and a plan made again weighed afresh the plans weighed first."""
    from conftest import tiny_config
    from slimtune.planning import estimate

    config, cfg = tiny_config(), _cfg()
    key = estimate_cache._key(config, cfg, 1, 32)
    estimate.estimate(config, cfg, 1, 32, by_depth=False)
    assert estimate_cache._key(config, cfg, 1, 32) == key
