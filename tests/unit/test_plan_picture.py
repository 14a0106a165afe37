"""`slimtune plan --png`: the plans drawn as stacked bars, written whole or not at all."""

from pathlib import Path

import pytest

from conftest import tiny_config
from slimtune.planning import picture as plan_picture, planner
from slimtune import presets
from slimtune.device import speed
from slimtune.planning.estimate import Estimate
from slimtune.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GIB = 2**30


def plan_result(engine, options, peak, breakdown, short=None, recommended=False, host=0):
    found = Estimate(peak, breakdown, host, 0, 0, 1_000, 500_000_000)
    return planner.PlanResult(engine, options, found, speed.StepTime(0.1, 0.1, 0.0, 0.0, 1e12), 1_000.0,
                              short or {}, recommended)


@pytest.fixture(scope="module")
def preset_plans():
    """Qwen2.5-0.5B, LoRA, batch 1 x seq 256 on an rtx3060, as planner.plan weighs it (its figures,
    copied: planning the preset takes ~25 s on two cores), plus a plan the host cannot hold and one
    whose breakdown is missing."""
    machine = planner.Machine(presets.gpu_profile("rtx3060"), 2**40, 2**40)
    parts = {"weights": 1023258624, "gradients": 0, "optimizer": 70387008, "activations": 371293184,
             "loss": 175844850, "temporaries": 7664}
    nf4 = {**parts, "weights": 508882944, "activations": 29196290}
    results = [
        plan_result("resident", {"precision": "bf16"}, sum(parts.values()), parts, recommended=True),
        plan_result("resident", {"precision": "bf16", "quant.scheme": "nf4", "activations.checkpoint": "recompute",
                                 "loss.mode": "subset"}, sum(nf4.values()), nf4),
        plan_result("slide", {"precision": "bf16", "quant.scheme": "nf4"}, 272106454,
                    {"weights": 86830080, "temporaries": 185276374}, short={"host RAM": (2**41, 2**40)}, host=2**41),
        plan_result("resident", {"precision": "fp32"}, 2863109990, {}),
    ]
    return results, machine


def assert_whole_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    image = imread(path)
    height, width, channels = image.shape
    assert height > 300 and width > 800 and channels in (3, 4)


def test_a_preset_plan_picture_is_a_whole_png_in_a_new_folder(tmp_path, preset_plans):
    results, machine = preset_plans
    path = tmp_path / "pictures" / "plan.png"  # the folder does not exist yet
    assert plan_picture.write_png(results, machine, str(path), "slimtune plan: Qwen2.5-0.5B") == path
    assert_whole_png(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.png"]  # no partial file beside it


def test_each_bar_is_its_plans_peak_then_the_assumed_cuda_context(preset_plans):
    results, machine = preset_plans
    ax = plan_picture.figure(results, machine, "t").axes[0]
    widths: dict[int, float] = {}
    for bar in ax.patches:
        if bar.get_fill():  # the recommended plan's outline is drawn unfilled, round its bar
            row = round(bar.get_y() + bar.get_height() / 2)
            widths[row] = widths.get(row, 0.0) + bar.get_width()
    for row, result in enumerate(results):
        expected = (result.estimate.device_peak_bytes + planner.CUDA_OVERHEAD_BYTES) / GIB
        assert widths[row] == pytest.approx(expected)
    hatched = [b for b in ax.patches if b.get_hatch() and b.get_fill()]
    assert len(hatched) == len(results)
    assert all(b.get_width() == pytest.approx(planner.CUDA_OVERHEAD_BYTES / GIB) for b in hatched)
    assert plan_picture.segments(results[3]) == [("total", results[3].estimate.device_peak_bytes)]
    assert [name for name, _ in plan_picture.segments(results[2])] == ["weights", "temporaries"]


def test_the_picture_names_the_card_the_verdicts_and_what_is_assumed(preset_plans):
    results, machine = preset_plans
    fig = plan_picture.figure(results, machine, "slimtune plan: Qwen2.5-0.5B")
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert "\u2713 fits  \u2190 recommended" in texts and "\u2717 no (host RAM)" in texts
    assert sum("rtx3060: 12.0 GiB" in t for t in texts) == 1
    (card,) = [t for t in ax.texts if t.get_text() == "rtx3060: 12.0 GiB"]
    assert card.get_position()[1] > 1.0  # above the frame: inside, at its foot, it crossed the last rows' verdicts
    assert [line.get_xdata()[0] for line in ax.lines] == [12.0]  # the card's line, in GiB
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"weights", "temporaries", "total (no breakdown)", "CUDA context (assumed)", "rtx3060: 12.0 GiB"} <= set(legend)
    assert "gradients" not in legend  # no bar holds any
    ticks = ax.get_yticklabels()
    assert [t.get_text().replace("\n", " ") for t in ticks][1] == \
        "resident precision=bf16 quant.scheme=nf4 activations.checkpoint=recompute loss.mode=subset"
    assert "\n" in ticks[1].get_text()  # long labels wrap
    assert [t.get_fontweight() for t in ticks] == ["bold", "normal", "normal", "normal"]
    assert "GiB" in ax.get_xlabel() and ax.get_title(loc="left").startswith("slimtune plan: Qwen2.5-0.5B")
    footnote = " ".join(t.get_text() for t in ax.texts if "fake tensors" in t.get_text()).replace("\n", " ")
    assert "fake tensors" in footnote and "CUDA context is assumed" in footnote


def test_one_real_plan_of_a_tiny_model_draws(tmp_path):
    machine = planner.Machine(presets.gpu_profile("1GiB"), 2**40, 2**40)
    base = planner.planning_config("lora")
    result = planner.weigh(tiny_config(), base, planner.applicable_plans(base)[0], machine, 1, 32)
    result.recommended = result.fits
    path = plan_picture.write_png([result], machine, tmp_path / "tiny.png", "tiny")
    assert_whole_png(path)
    assert sum(size for _, size in plan_picture.segments(result)) == result.estimate.device_peak_bytes


@pytest.mark.parametrize("name", ["plan.jpg", "plan", "plan.png.txt"])
def test_a_path_that_is_not_a_png_is_refused_in_one_sentence(tmp_path, preset_plans, name):
    results, machine = preset_plans
    with pytest.raises(UserError) as refused:
        plan_picture.write_png(results, machine, tmp_path / name, "t")
    message = str(refused.value)
    assert name in message and ".png" in message
    assert message.endswith(".") and ". " not in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_path_is_refused_and_leaves_nothing(tmp_path, preset_plans):
    results, machine = preset_plans
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "taken.png").mkdir()  # a folder where the picture would go: the rename fails
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=r"^cannot write the picture .*\.$") as refused:
        plan_picture.write_png(results, machine, tmp_path / "a-file" / "plan.png", "t")
    assert ". " not in str(refused.value)
    with pytest.raises(UserError, match=r"^the picture's path .*taken\.png' is a folder; name a \.png file in it\.$"):
        plan_picture.write_png(results, machine, tmp_path / "taken.png", "t")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_write_that_fails_midway_leaves_the_old_picture_whole(tmp_path, preset_plans, monkeypatch):
    from matplotlib.figure import Figure

    results, machine = preset_plans
    path = plan_picture.write_png(results, machine, tmp_path / "plan.png", "first")
    old = path.read_bytes()

    def torn(self, out, **kwargs):
        out.write(PNG_MAGIC + b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(UserError, match="No space left on device"):
        plan_picture.write_png(results, machine, path, "second")
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]
