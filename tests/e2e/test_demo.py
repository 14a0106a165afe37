"""The bundled demo: its assets are small, self-consistent, and the base model cannot do the task yet."""

import json

from slimtune import demo, train
from slimtune.engines import settings


def test_assets_are_small_and_heldout_is_disjoint():
    total = sum(p.stat().st_size for p in demo.ASSETS.rglob("*") if p.is_file())
    assert total <= 20 * 2**20
    train_prompts = {json.loads(line)["prompt"] for line in (demo.ASSETS / "data" / "train.jsonl").open()}
    held = demo.heldout()
    assert len(held) >= 100 and not train_prompts & {r["prompt"] for r in held}


def test_base_model_fails_the_task_before_fine_tuning(tmp_path):
    base = dict(demo.SETTINGS, output_dir=str(tmp_path / "out"))
    run = train.build(settings.load(None, [], base=base))
    assert demo.accuracy(run, demo.heldout()) <= 0.05
