"""The estimate by depth takes the step's peak over every segment at full depth: the blocks between the
ends are affine in the block index, so the largest of them is the shallowest or the deepest of that
range, and both are evaluated. Here the segments' peaks are given (estimate._step stands in for the
fake step with peaks that follow the by-depth argument's affine law exactly), so the peak can be put
in either end block of the range on purpose; the plans' own steps rarely put it there (one plan of 49
in tests/unit/test_estimate_by_depth.py)."""

import pytest

from conftest import tiny_config
from slimtune import config
from slimtune.engines import settings
from slimtune.planning import estimate, planner

DEPTH, MARGIN = 12, 1  # resident: one block at each end is fitted apart


def synthetic_step(middle):
    """A stand-in for estimate._step: at depth D, a start segment, each block's forward (the end blocks
    small, the ones between `middle(D, i)`) and the loss; the device peak is the largest segment's."""
    depths = []

    def step(model_config, cfg, batch, segments=False, replays=None, ranks=1):
        depth = model_config.num_hidden_layers
        depths.append(depth)
        found = {("start", 0): 1000 + 10 * depth, ("loss", 0): 1500 + 20 * depth}
        for i in range(depth):
            between = MARGIN <= i < depth - MARGIN
            found[("forward", i, 0)] = middle(depth, i) if between else 600 + 10 * depth + i
        found = {label: (peak, {"weights": 10 * depth, "activations": peak - 10 * depth})
                 for label, peak in found.items()}
        peak, breakdown = max(found.values(), key=lambda v: v[0])
        return estimate.Estimate(device_peak_bytes=peak, breakdown=breakdown, host_bytes=0, disk_bytes=0,
                                 host_link_bytes=0, trainable_params=depth, total_params=depth), \
            (found if segments else None)

    return step, depths


@pytest.mark.parametrize("end, middle", [
    ("deepest", lambda depth, i: 100 + 10 * depth + 500 * (i - MARGIN)),
    ("shallowest", lambda depth, i: 5000 + 10 * depth - 300 * (i - MARGIN)),
], ids=["deepest", "shallowest"])
def test_the_peak_in_either_end_block_between_the_margins_is_found(monkeypatch, end, middle):
    step, depths = synthetic_step(middle)
    monkeypatch.setattr(estimate, "_step", step)
    cfg = settings.load(None, ["engine=resident", "precision=bf16"],
                        base=config.to_dict(planner.planning_config("full", rank=4)))
    model_config = tiny_config(num_hidden_layers=DEPTH)
    fast = estimate.estimate(model_config, cfg, 1, 16)
    assert depths == [2 * MARGIN + 1, 2 * MARGIN + 2]  # by depth: the two probes only
    full = estimate.estimate(model_config, cfg, 1, 16, by_depth=False)
    index = DEPTH - MARGIN - 1 if end == "deepest" else MARGIN
    assert full.device_peak_bytes == middle(DEPTH, index)  # the peak is where this case put it
    assert (fast.device_peak_bytes, fast.breakdown) == (full.device_peak_bytes, full.breakdown)
