"""Engine slide (host masters and AdamW, a window of device slots, the head streamed in tiles)
against engine resident, itself checked against hand-written PyTorch with torch.optim.AdamW
(test_oracle_step): float64, several steps, with gradient accumulation and clipping, tied and
untied heads, full fine-tuning and LoRA on a 4-bit base. Then: the device peak does not grow with
depth, the slot pool is never reallocated, resume is exact, host work keeps its order, and the
fake-tensor estimate equals the CPU meter."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from conftest import engine_config, tiny_config
from slimtune.engines import settings
from slimtune.planning import estimate
from slimtune.model import lora, quant
from slimtune.device import runtime
from slimtune.config import LoraConfig, QuantConfig, TrainConfig
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.slide.engine import SlideConfig, SlideEngine
from slimtune.errors import UserError
from slimtune.model.stack import Stack

CPU = torch.device("cpu")


def model_of(layers: int = 3, dtype=torch.float64, seed: int = 0, **overrides) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=layers, **overrides), dtype=dtype,
                                             attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def batches(vocab: int, seed: int, micro: int = 2, rows: int = 2, seq: int = 12) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        ids = torch.randint(3, vocab, (rows, seq), generator=g)
        targets = torch.roll(ids, -1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        targets[0, :4] = IGNORE_INDEX
        out.append(Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone()))
    return out


def train_cfg(slide: SlideConfig | None = None, **overrides):
    """The RunConfig every engine here is built with: these training settings, `slide` as its section.
    The device meter is off unless a test reads peaks: on the CPU it is a dispatch mode that sees
    every op, most of a step's time on these tiny models, and it changes no number a step computes."""
    base = dict(steps=4, batch_size=2, grad_accum=2, lr=1e-2, weight_decay=0.1, warmup_steps=1,
                schedule="cosine", max_grad_norm=0.5, measure_memory=False)
    return engine_config(TrainConfig(**{**base, **overrides}), sections={"slide": slide} if slide else {})


def run_both(model: nn.Module, cfg, steps: int = 3, precision="fp64"):
    """The same steps through resident and slide on copies of `model`: (losses, grad norms, params) each."""
    results = []
    for engine_class in (ResidentEngine, SlideEngine):
        stack = Stack(copy.deepcopy(model))
        engine = engine_class(stack, cfg, CPU, precision)
        torch.manual_seed(123)  # the same dropout masks for both
        out = [engine.step(batches(model.config.vocab_size, seed, cfg.train.grad_accum)) for seed in range(steps)]
        params = {n: p.detach().clone() for n, p in stack.model.named_parameters()}
        results.append(([r.loss for r in out], [r.grad_norm for r in out], params, engine))
    return results


def assert_same(resident, slide, tol=1e-10):
    assert slide[0] == pytest.approx(resident[0], abs=tol, rel=0)  # losses
    assert slide[1] == pytest.approx(resident[1], abs=tol, rel=0)  # grad norms before clipping
    assert resident[2].keys() == slide[2].keys()
    for name, value in resident[2].items():
        torch.testing.assert_close(slide[2][name], value, atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("clip", [0.5, 0.0], ids=["clipped", "overlapped-updates"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_full_fine_tuning_equals_resident(clip, tied):
    model = model_of(tie_word_embeddings=tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    resident, slide = run_both(model, train_cfg(max_grad_norm=clip))
    assert_same(resident, slide)
    assert all(not torch.equal(slide[2][n], before[n]) for n in before)  # every weight moved
    if clip:
        assert max(slide[1]) > clip  # clipping took effect


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_micro_batch_without_clipping_updates_from_where_the_gradients_arrive(tied):
    """No accumulators: each block's AdamW reads its gradients from the staging buffer, the LM
    head's from each vocabulary tile (a tied table sums embedding rows, so it keeps its own), and the
    run equals resident as the accumulating one does."""
    model = model_of(tie_word_embeddings=tied)
    resident, slide = run_both(model, train_cfg(max_grad_norm=0.0, grad_accum=1, slide=SlideConfig(head_tile_mb=0.01)))
    assert_same(resident, slide)
    engine = slide[3]
    assert all(u.direct and all(g is None for g in u.adam.grads) for u in engine.units)
    assert [u.direct for u in engine.edges] == ([False] if tied else [True, False])  # the head; not the embedding


def test_one_micro_batch_three_slots_and_small_head_tiles():
    model = model_of(layers=4)
    resident, slide = run_both(model, train_cfg(grad_accum=1, slide=SlideConfig(slots=3, head_tile_mb=0.01)))
    assert_same(resident, slide)
    tiles = slide[3].head_tiles[0].shape[0]
    assert tiles < model.config.vocab_size  # the head really went up in several tiles


def test_lora_on_a_4bit_base_equals_resident():
    model = model_of()
    quant.apply(model, QuantConfig(scheme="int4", group_size=16))
    torch.manual_seed(1)
    lora.apply(model, LoraConfig(rank=4, alpha=8.0, dropout=0.1))
    for adapter in lora.adapters(model).values():
        nn.init.normal_(adapter.lora_B.weight, std=0.2)
    resident, slide = run_both(model, train_cfg())
    assert_same(resident, slide)
    assert all(u.adam is None for u in slide[3].edges)  # the frozen embedding and head have none
    trained = [n for n in slide[2] if "lora_" in n]
    assert trained and all(n in slide[3].trainable_state() for n in trained)


def test_bf16_compute_keeps_fp32_masters_and_tracks_resident():
    model = model_of(dtype=torch.float32)
    resident, slide = run_both(model, train_cfg(), precision="bf16")
    engine = slide[3]
    masters = {unit.name: unit.adam.state_dict()["masters"] for unit in engine.units}  # rebuilt from their split
    assert all(unit.adam.split for unit in engine.units)
    assert all(m.dtype == torch.float32 for ms in masters.values() for m in ms)
    head, embedding = engine.edges  # untied: the head gets a bf16 shadow to stream, the embedding none
    assert all(s is not None for s in head.adam.shadows) and all(s is None for s in embedding.adam.shadows)
    assert engine.pool.slots[0].weights.numel() < sum(  # the slot holds bf16 copies: half of fp32
        p.numel() * 4 for p in engine.stack.blocks[0].parameters())
    assert slide[0] == pytest.approx(resident[0], rel=2e-2)
    for unit in engine.units:  # what goes up is the updated master, rounded once to bf16
        assert all(shadow is not None and torch.equal(shadow, master.to(torch.bfloat16))
                   for shadow, master in zip(unit.adam.shadows, masters[unit.name]))


def peak_of(layers: int) -> tuple[int, object]:
    model = model_of(layers=layers, dtype=torch.float32)
    engine = SlideEngine(Stack(model), train_cfg(grad_accum=1, measure_memory=True), CPU, "fp32")
    results = [engine.step(batches(model.config.vocab_size, seed, 1)) for seed in range(2)]
    return results[-1].device_peak_bytes, engine


def test_device_peak_is_flat_in_depth_and_the_pool_is_never_reallocated():
    peaks = {}
    for layers in (4, 8, 16):  # from 4: the first and last blocks, which the window treats apart, and two between
        peaks[layers], engine = peak_of(layers)
        pointers = [t.data_ptr() for t in engine.pool.tensors()]
        engine.step(batches(engine.stack.config.vocab_size, 9, 1))
        assert [t.data_ptr() for t in engine.pool.tensors()] == pointers
        assert engine.pool.allocations == len(engine.pool.slots) == 2
        assert all(unit.slot is None for unit in engine.units)  # every slot came back
    assert peaks[4] == peaks[8] == peaks[16], peaks
    resident = ResidentEngine(Stack(model_of(layers=16, dtype=torch.float32)),
                              train_cfg(grad_accum=1, measure_memory=True), CPU, "fp32")
    assert resident.step(batches(300, 0, 1)).device_peak_bytes > 4 * peaks[16]  # what the window saves


def test_resume_is_exact():
    model = model_of()
    cfg = train_cfg()
    straight = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    losses = [straight.step(batches(300, seed, 2)).loss for seed in range(3)]
    first = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    for seed in range(2):
        first.step(batches(300, seed, 2))
    state = copy.deepcopy(first.state_dict())
    resumed = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    resumed.load_state_dict(state)
    assert resumed.step(batches(300, 2, 2)).loss == losses[2]
    for (name, a), (_, b) in zip(straight.trainable_state().items(), resumed.trainable_state().items()):
        assert torch.equal(a, b), name


def test_uploads_wait_for_updates_and_staging_for_its_reader(monkeypatch):
    """Random sleeps in every host job: results stay equal to a run without them, no unit is
    uploaded while its AdamW runs, and no staging buffer is refilled while a host job reads it."""
    from slimtune.optim.host_unit import HostUnit

    model = model_of()
    cfg = train_cfg(max_grad_norm=0.0)  # updates overlap the backward: the racy case
    calm = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    want = [calm.step(batches(300, seed, 2)).loss for seed in range(2)]
    updating, reading, violations = set(), set(), []
    rng = torch.Generator().manual_seed(0)

    def nap():
        time.sleep(float(torch.rand((), generator=rng)) * 0.01)

    def slow_update(unit, *args):
        updating.add(id(unit))
        nap()
        try:
            return update(unit, *args)
        finally:
            updating.discard(id(unit))

    def slow_accumulate(unit, staging, *args):
        reading.add(staging.data_ptr())
        nap()
        try:
            return accumulate(unit, staging, *args)
        finally:
            reading.discard(staging.data_ptr())

    def checked_bind(unit, *args):
        if id(unit) in updating:
            violations.append(f"{unit.name} uploaded during its update")
        return bind(unit, *args)

    def checked_download(binding, link, staging):
        if staging.data_ptr() in reading:
            violations.append(f"staging refilled while read ({binding.slot.holder})")
        return download(binding, link, staging)

    update, accumulate = HostUnit.update, HostUnit.accumulate
    bind, download = HostUnit.bind, runtime.SlotBinding.download_grads
    monkeypatch.setattr(HostUnit, "update", slow_update)
    monkeypatch.setattr(HostUnit, "accumulate", slow_accumulate)
    monkeypatch.setattr(HostUnit, "bind", checked_bind)
    monkeypatch.setattr(runtime.SlotBinding, "download_grads", checked_download)
    engine = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    got = [engine.step(batches(300, seed, 2)).loss for seed in range(2)]
    assert got == want and not violations
    assert threading.active_count() >= 2  # the host worker is a thread of its own


def test_estimate_equals_the_cpu_meter():
    model_config = tiny_config(num_hidden_layers=3)
    cfg = settings.load(None, ["engine=slide", "method=full", "precision=fp32", "train.batch_size=2",
                                    "train.grad_accum=1"], base={"model": "(test)", "data": "(test)"})
    batch = batches(model_config.vocab_size, 0, 1)[0]
    found = estimate.estimate(model_config, cfg, 2, 12, batch=batch)
    model = model_of(layers=3, dtype=torch.float32)
    engine = SlideEngine(Stack(model), cfg, CPU, "fp32")
    real = [engine.step([batch]) for _ in range(2)][-1]
    assert found.device_peak_bytes == real.device_peak_bytes
    assert found.host_bytes == real.host_peak_bytes > 16 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("override, words", [
    ("loss.mode=subset", "loss.mode=exact"),
    ("quant.embeddings=true", "quant.embeddings=false"),
    ("activations.cache=small", "activations.cache=none"),
    ("slide.slots=4", "slide.slots must be 2 or 3"),
    ("activations.checkpoint=recompute", "activations.checkpoint=host"),
])
def test_what_slide_does_not_do_is_refused_in_one_sentence(override, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        settings.load(None, ["engine=slide", override, "quant.scheme=int4"],
                           base={"model": "(test)", "data": "(test)"})


def test_moments_on_disk_train_exactly_like_moments_in_ram(tmp_path):
    model = model_of()
    cfg = train_cfg()
    ram = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    on_disk = train_cfg(slide=SlideConfig(moments="disk", moments_dir=str(tmp_path)))
    disk = SlideEngine(Stack(copy.deepcopy(model)), on_disk, CPU, "fp64")
    for seed in range(3):
        assert ram.step(batches(300, seed, 2)).loss == disk.step(batches(300, seed, 2)).loss
    files = list(tmp_path.rglob("*.bin"))
    assert len(files) == 2 * sum(len(u.adam.masters) for u in disk._all_units() if u.adam)  # m, v per group
    assert disk.host_bytes() < ram.host_bytes()
    for (name, a), (_, b) in zip(ram.trainable_state().items(), disk.trainable_state().items()):
        assert torch.equal(a, b), name
    resumed = SlideEngine(Stack(copy.deepcopy(model)), on_disk, CPU, "fp64")
    resumed.load_state_dict(copy.deepcopy(disk.state_dict()))
    assert resumed.step(batches(300, 3, 2)).loss == disk.step(batches(300, 3, 2)).loss
    del disk, resumed
    import gc

    gc.collect()
    assert not list(tmp_path.rglob("*.bin"))  # the folders go with their engines


def test_bf16_resume_uploads_the_loaded_weights_and_frozen_blocks_need_no_optimizer():
    """A resumed bf16 run sends up the loaded masters (their shadows are refreshed), and a block
    with nothing to train (freeze) takes part without an optimizer, clipping on or off."""
    model = model_of(dtype=torch.float32)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    for clip in (0.0, 0.5):
        cfg = train_cfg(max_grad_norm=clip)
        straight = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "bf16")
        losses = [straight.step(batches(300, seed, 2)).loss for seed in range(3)]
        assert straight.units[0].adam is None
        first = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "bf16")
        for seed in range(2):
            first.step(batches(300, seed, 2))
        resumed = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "bf16")
        resumed.load_state_dict(copy.deepcopy(first.state_dict()))
        assert resumed.step(batches(300, 2, 2)).loss == losses[2]


def test_a_failed_step_gives_every_slot_back(monkeypatch):
    from slimtune.engines.slide import engine as slide_module

    engine = SlideEngine(Stack(model_of()), train_cfg(), CPU, "fp64")
    monkeypatch.setattr(slide_module, "streamed_ce", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step(batches(300, 0, 2))
    assert len(engine.pool.free) == len(engine.pool.slots) and all(u.slot is None for u in engine.units)


def test_a_unit_is_uploaded_only_after_its_pending_update():
    """The guard in _Unit.bind where it is the only one (no step-end barrier in between): a host
    AdamW still running when its unit is bound finishes before the copy, so the slot holds the
    updated weights, not the ones before the update."""
    engine = SlideEngine(Stack(model_of()), train_cfg(), CPU, "fp64")
    engine.step(batches(300, 0, 2))
    unit, go = engine.units[1], threading.Event()

    def late_update():
        go.wait(10)
        with torch.no_grad():
            for master in unit.adam.masters:
                master.add_(1.0)

    unit.update_job = engine.worker.submit(late_update)
    threading.Timer(0.2, go.set).start()  # the update ends only after bind has had time to copy
    engine._load(1, with_grads=False)
    unit.update_job.result()
    try:
        for param, k, i in unit.members:
            assert param.data.data_ptr() != unit.adam.member(k, i).master.data_ptr()  # a slot view, not the host
            assert torch.equal(param.data, unit.adam.member(k, i).master)
    finally:
        engine._unload(1)


def test_the_working_sets_share_one_seam_and_the_engine_never_asks_which():
    """Every slide.working_set choice is a complete WorkingSet, and engine.py holds no branch on the
    choice: what differs lives in working_set.py."""
    import inspect
    import typing

    from slimtune.engines.slide import engine as slide_module
    from slimtune.engines.slide.working_set import WORKING_SETS, WorkingSet

    assert set(WORKING_SETS) == set(typing.get_args(typing.get_type_hints(SlideConfig)["working_set"]))
    for choice, kind in WORKING_SETS.items():
        assert issubclass(kind, WorkingSet) and not inspect.isabstract(kind), choice
    source = inspect.getsource(slide_module)
    for branch in ("chunked", "working_set ==", "working_set !=", "isinstance(", "getattr(", "hasattr(",
                   *(kind.__name__ for kind in WORKING_SETS.values())):
        assert branch not in source, branch
