"""--max-seq by length (planning/longest_seq.py): the lines through a few lengths' estimates give the
same longest sequence as the bisection of the same estimate (the oracle), on tiny models' real fake
steps where a different resource binds in each (device, host RAM, disk), and on made-up needs that are
affine, stepped, quadratic or flat, where the line is only a guess."""

import dataclasses

import pytest

from conftest import tiny_config
from slimtune import config, presets
from slimtune.engines import settings
from slimtune.planning import longest_seq, planner


class Asked:
    """A needs(seq) that records every length it was asked about: {"device": (need(seq), have)}."""

    def __init__(self, need, have: int, host=None):
        self.need, self.have, self.host, self.lengths = need, have, host, []

    def __call__(self, seq: int) -> dict:
        self.lengths.append(seq)
        found = {"device": (self.need(seq), self.have)}
        if self.host is not None:
            found["host RAM"] = (self.host(seq), 10**6)
        return found


def both(need, have, known=64, limit=10**6, host=None) -> tuple[int, int, Asked]:
    """(by length, by bisection, the by-length search's asks); every answer fits, one token more not."""
    by_length, by_bisection = Asked(need, have, host), Asked(need, have, host)
    found = longest_seq.longest_by_length(by_length, known, limit)
    oracle = longest_seq.longest_by_bisection(by_bisection, known, limit)
    # a search that misses costs at most its guesses (two asks each) more than the bisection
    assert len(set(by_length.lengths)) <= len(set(by_bisection.lengths)) + 2 * longest_seq.GUESSES + 2
    return found, oracle, by_length


@pytest.mark.quick
def test_an_affine_need_is_solved_in_three_asks_beyond_the_known_length():
    found, oracle, asked = both(lambda t: 1000 + 37 * t, 1000 + 37 * 12345 + 20)
    assert found == oracle == 12345
    assert len(asked.lengths) == 4  # the known length, a second probe, the answer and one token more
    assert asked.lengths[-2:] == [12345, 12346]


@pytest.mark.quick
def test_a_need_in_parts_is_solved_part_by_part():
    """The device's need as the planner gives it: each segment's peak apart. The largest is the loss's
    at short lengths and a block's backward at long ones; each part is a line, their largest is not."""
    have = 1000 + 3 * 20000 + 2

    def parts(t: int) -> dict:
        return {"device: loss": (5000 + t, have), "device: backward": (1000 + 3 * t, have)}

    asked = []
    answer = longest_seq.longest_by_length(lambda t: (asked.append(t), parts(t))[1], 64, 10**6)
    assert answer == 20000 and asked == [64, 128, 20000, 20001]
    whole = Asked(lambda t: max(need for need, _ in parts(t).values()), have)
    assert longest_seq.longest_by_length(whole, 64, 10**6) == 20000 and len(whole.lengths) > 4


@pytest.mark.parametrize("need", [
    lambda t: 5000 + 3 * t + (700 if t > 4000 else 0),  # a step between the probes and the answer
    lambda t: 100 + 2 * t + t * t // 50,  # a quadratic term (a (T, T) mask)
    lambda t: 100 + 40 * ((t + 255) // 256) * 256,  # padded to a multiple: flat inside each stair
    lambda t: 10**5 if t < 3000 else 10**5 + 9 * (t - 3000),  # flat first: the first line rises nowhere
], ids=["step", "quadratic", "stairs", "flat-then-rising"])
def test_a_need_that_is_not_affine_still_gets_the_bisections_answer(need):
    have = need(7001)
    found, oracle, asked = both(need, have)
    assert found == oracle and need(found) <= have < need(found + 1)


def test_the_resource_that_binds_first_decides_and_the_limit_caps():
    found, oracle, _ = both(lambda t: 10 * t, 10**9, host=lambda t: 300 * t)  # host: 10**6 / 300
    assert found == oracle == 3333
    found, oracle, asked = both(lambda t: 10 * t, 10**9, limit=5000)  # fits all the way to the model's limit
    assert found == oracle == 5000 and 5001 not in asked.lengths


@pytest.mark.quick
def test_tiled_blocks_probe_the_limit_and_follow_the_line_past_the_bend():
    """affine (blocks in tiles): a block's peak is the larger of its MLP's part (fixed) and its
    attention's (grows with the keys): a line through the known length and the limit, then lines
    through the latest two; a plan that fits all the way is settled by its second ask."""
    def bend(t):
        return max(10**6 + 40 * t, 4 * 10**5 + 46 * t)  # attention's part takes over at 100,000 tokens

    have = bend(150_000) + 7
    asked = Asked(bend, have)
    found = longest_seq.longest_by_length(asked, 2048, 2**20, tile=256, affine=True)
    assert found == longest_seq.longest_by_bisection(Asked(bend, have), 2048, 2**20) == 150_000
    assert asked.lengths[:2] == [2048, 2**20] and len(asked.lengths) <= 5
    everywhere = Asked(bend, bend(2**20))
    assert longest_seq.longest_by_length(everywhere, 2048, 2**20, tile=256, affine=True) == 2**20
    assert everywhere.lengths == [2048, 2**20]


@pytest.mark.quick
def test_a_plan_over_at_the_known_length_is_asked_at_one_token_next():
    asked = Asked(lambda t: 10**6 + t, 10**5)
    assert longest_seq.longest_by_length(asked, 2048, 10**6) == 0 and asked.lengths == [2048, 1]


def test_nothing_fits_and_a_too_long_known_length():
    found, oracle, _ = both(lambda t: 10**6 + t, 10**5)
    assert found == oracle == 0
    found, oracle, _ = both(lambda t: 50 * t, 50 * 40, known=4096)  # the known length does not fit
    assert found == oracle == 40


# --- real fake steps on tiny models: the by-length answer equals the bisection's, to the token

def run_config(method: str, plan: dict):
    base = config.to_dict(planner.planning_config(method, rank=4))
    return settings.load(None, [f"{k}={v}" for k, v in plan.items()], base=base)


# (family, method, plan, the resource whose limit is set at TARGET tokens: the others unbounded)
SHAPES = {
    "llama-lora-tiled-device": ("llama", {}, "lora", {"engine": "resident", "precision": "bf16",
                                                     "activations.checkpoint": "recompute"}, "device"),
    "qwen2-full-slide-host": ("qwen2", {"tie_word_embeddings": True}, "full",
                              {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host"}, "host RAM"),
    "qwen3-lora-disk": ("qwen3", {"num_key_value_heads": 1}, "lora",
                        {"engine": "resident", "precision": "bf16", "activations.checkpoint": "disk"}, "disk"),
}
# Tokens: the machine is cut to what the step needs at TARGET; the search starts at KNOWN and ends at
# the model's LIMIT (blocks in tiles of 256: the auto rule's least), which keeps the oracle's bisection short.
KNOWN, TARGET, LIMIT = 512, 555, 640


def machine_at(model_config, cfg, binding: str, monkeypatch) -> planner.Machine:
    """A machine whose `binding` resource holds the step at TARGET tokens exactly; the rest is ample."""
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)
    found = planner.per_device_estimate(model_config, cfg, None, 1, TARGET)
    big = 2**50
    gpu = presets.gpu_profile("1GiB")
    memory = found.device_peak_bytes if binding == "device" else big
    ram = -(-found.host_bytes * 10 // 9) if binding == "host RAM" else big  # HOST_RAM_SHARE of it holds the need
    disk = found.disk_bytes if binding == "disk" else big
    return planner.Machine(dataclasses.replace(gpu, memory_bytes=memory), ram, disk)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_by_length_equals_the_bisection_on_three_shapes(shape, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # every estimate made here, none read back
    family, overrides, method, plan, binding = SHAPES[shape]
    model_config = tiny_config(family, max_position_embeddings=LIMIT, num_hidden_layers=1, **overrides)
    cfg = run_config(method, plan)
    machine = machine_at(model_config, cfg, binding, monkeypatch)
    found = planner.longest_fitting_seq(model_config, cfg, machine, 1, KNOWN)
    oracle = planner.longest_fitting_seq(model_config, cfg, machine, 1, KNOWN, by_length=False)
    assert found == oracle >= TARGET
    needs = machine.needs(planner.per_device_estimate(model_config, cfg, machine, 1, found + 1))
    assert needs[binding][0] > needs[binding][1]  # one token more: the binding resource is over
