"""The host optimizer's layouts (issue 30) through the engines that use them, on tiny models:
train.master (split | fp32, acting under precision=bf16), train.moments (fp32 | 8bit), slide.moments
and chunk.state (ram | disk), slide.working_set (all | chunk).

- The split master trains slide exactly as the whole fp32 master does: 20 steps, the same losses
  and the same bf16 weights bit for bit, although split_master's tie rule moves a master by an ulp.
  The same for slide's chunk working set, engine chunk and roundpipe's host units; each engine's
  whole-master run is held to engine resident by its own oracle (float64), so the split one is too.
- Every new option resumes bit for bit through a real checkpoint (the files on disk): weights,
  moments, step counts and the 8-bit codes as they rest, equal to a run that never stopped.
- A damaged checkpoint of an 8-bit run (its codes in state.pt, its moments, its weights) is found
  and named by the checkpoint's CRC-32s, not loaded.
- The planner's host and disk bytes equal the CPU meter's for every new option.
- Slide's 8-bit AdamW against bitsandbytes' AdamW8bit: over 20 steps, each started from AdamW8bit's
  own weights and 8-bit state, the engine's step is that state dequantized, torch's fused AdamW and
  bitsandbytes' reference (nearest) codes, bit for bit, and lands within a derived bound of
  AdamW8bit's weights and moments.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from conftest import engine_config, save_tiny_model, tiny_config
from test_estimate import measured_step
from test_moments8 import bnb, reference_codes, worst_error
from test_slide import batches, model_of
from slimtune.config import TrainConfig
from slimtune.engines import settings
from slimtune.engines.chunk.engine import ChunkConfig, ChunkEngine
from slimtune.engines.chunk.engine import weight_dtype as chunk_weight_dtype
from slimtune.engines.roundpipe.engine import RoundPipeConfig, RoundPipeEngine
from slimtune.engines.slide.engine import SlideConfig, SlideEngine
from slimtune.model.stack import Stack
from slimtune.optim import moments8, rules
from slimtune.optim.host_adam import CODED, MOMENTS, HostAdam, nbytes_8bit
from slimtune.planning import estimate
from slimtune.store import checkpoint

CPU = torch.device("cpu")
VOCAB = 300
# One micro-batch a step (a block's bf16 gradient is then held as it came down: the new layout),
# clipping on with a limit the gradients' norms (about 1.5 to 9 here) exceed.
TRAIN = dict(steps=20, batch_size=2, grad_accum=1, lr=1e-2, weight_decay=0.1, warmup_steps=2, schedule="cosine",
             max_grad_norm=0.5, measure_memory=False)


def train(**overrides) -> TrainConfig:
    return TrainConfig(**{**TRAIN, **overrides})


def slide_engine(model, precision: str, slide: SlideConfig | None = None, chunk: ChunkConfig | None = None,
                 **overrides) -> SlideEngine:
    sections = {"slide": slide or SlideConfig(), **({"chunk": chunk} if chunk else {})}
    cfg = engine_config(train(**overrides), engine="slide", method="full", sections=sections)
    return SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, precision)


def step_batches(step: int, rows: int = 2):
    return batches(VOCAB, step, 1, rows=rows)


def host_adams(engine) -> list[HostAdam]:
    """Every host optimizer of an engine: its host units' (slide, roundpipe) or its chunks' (engine
    chunk, slide's chunk working set)."""
    state = getattr(engine, "state", None) or getattr(getattr(engine, "working_set", None), "state", None)
    if state is not None:
        return state.adams
    return [u.adam for u in engine._all_units() if u.adam is not None]


def layouts_of(engine) -> tuple[bool, bool]:
    """(some master rests split, every moment is 8-bit): what the engine's optimizers really hold."""
    adams = host_adams(engine)
    held = [m for a in adams for ms in a.moments for m in ms.values()]
    return any(a.split for a in adams), all(isinstance(m, moments8.Moment8) for m in held)


# ------------------------------------------------------------------ 1. split master == whole master


def bf16_weights(engine: SlideEngine) -> list[torch.Tensor]:
    """What goes up to the device: each HostAdam group's bf16 weights (the split layout's own
    weights, the whole layout's shadows); an untied embedding has none (its rows are gathered on
    the host from its master, which no layout splits)."""
    return [s for adam in host_adams(engine) for s in adam.shadows if s is not None]


def assert_within_ulps_of_peak(got: torch.Tensor, want: torch.Tensor, peak: torch.Tensor, ulps: int, what: str):
    """|got - want| at most `ulps` fp32 ulps of each number's largest magnitude so far. The tie rule's
    difference is an ulp of the number when it struck, and the updates carry it as an absolute amount
    (both runs subtract the same update): a number that then shrinks toward zero keeps it, so a bound
    relative to its present value would fail however small the difference was at its birth (seen on
    an AVX2 machine: an lm_head number from 0.0098 down to 0.0002, 4.5e-6 relative, 1 ulp of 0.0098)."""
    # 2^(e - 24) for peak = m 2^e, m in [0.5, 1); at least 2^-149, a subnormal's (0 would make 0 / 0 of equal zeros)
    ulp = torch.ldexp(torch.ones_like(peak), (torch.frexp(peak).exponent - 24).clamp(min=-149))
    worst = float(((got - want).abs() / ulp).max())
    assert worst <= ulps, f"{what}: {worst} ulps of its largest magnitude apart"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_split_master_losses_equal_the_whole_master_over_twenty_steps(tied):
    """Why the losses stay bit-identical although split_master's tie rule makes a rare master differ
    by an ulp: a master exactly half a bf16 ulp above an even bf16 weight (1 fp32 pattern in 2^17) is
    kept as its neighbour one ulp toward that weight, which rounds to the same bf16 weight: what goes
    up is unchanged, and every block and head tile computes from what goes up. The moments do not
    depend on the master, so the ulp only changes what goes up if a later update lands that master
    within an ulp or two of a bf16 rounding boundary (a few patterns in 2^16 a step), and until it
    reaches the bf16 weights it reaches nothing. On these models (28k-38k numbers, 21 splits: the
    load and 20 updates) the tie rule strikes 4-6 times; the test requires at least one, so the
    claim is exercised, and names the cause if it ever does reach the weights. A tied table is the
    one place a master enters the forward itself (its rows are gathered from the fp32 master): there
    an ulp reaches the embedding output, and is lost in the bf16 casts of the first block unless it
    straddles a rounding point."""
    model = model_of(layers=2, dtype=torch.float32, tie_word_embeddings=tied)
    split, whole = (slide_engine(model, "bf16", master=m) for m in ("split", "fp32"))
    assert all(a.split for a in host_adams(split) if any(s is not None for s in a.shadows))
    assert not any(a.split for a in host_adams(whole))
    apart, norms = 0, []  # master numbers the tie rule left an ulp or so apart, summed over steps
    peaks = {}  # each master number's largest magnitude so far, in either run
    for step in range(20):
        a, b = split.step(step_batches(step)), whole.step(step_batches(step))
        for k, (mine, theirs) in enumerate(zip(bf16_weights(split), bf16_weights(whole))):
            differ = int((mine != theirs).sum())
            assert differ == 0, (f"step {step}: {differ} bf16 weights of group {k} differ between train.master=split"
                                 " and fp32: split_master's tie rule (a master kept one ulp toward its weight)"
                                 " reached what goes up to the device")
        assert a.loss == b.loss, f"step {step}: the losses differ with equal bf16 weights (see the docstring)"
        assert a.grad_norm == b.grad_norm, step
        masters, reference = split.trainable_state(), whole.trainable_state()
        for name, want in reference.items():  # the tie rule's ulps only: a few at most, never more
            peaks[name] = torch.maximum(peaks.get(name, want.abs()), torch.maximum(want.abs(), masters[name].abs()))
            assert_within_ulps_of_peak(masters[name], want, peaks[name], 4, f"step {step}: {name}")
        apart += sum(int((masters[n] != reference[n]).sum()) for n in reference)
        norms.append(a.grad_norm)
    assert max(norms) > TRAIN["max_grad_norm"]  # clipping took effect
    assert apart > 0  # the tie rule struck, and still the losses are equal


def test_a_chunk_working_set_splits_slides_own_host_weights_and_trains_as_the_whole_master():
    """slide.working_set=chunk under bf16: each chunk's masters are split over slide's host weights
    themselves (no bf16 copy in the chunk state, 2 bytes a number less), and the run equals the
    whole-master one (train.master=fp32): losses, and what goes up, bit for bit over a sweep and a half."""
    model = model_of(layers=2, dtype=torch.float32)
    chunked = dict(slide=SlideConfig(working_set="chunk"), chunk=ChunkConfig(n_chunks=2))
    split, whole = (slide_engine(model, "bf16", master=m, **chunked) for m in ("split", "fp32"))
    assert all(a.split and a.weights is not None and a.shadows == [None] * len(a.groups) for a in host_adams(split))
    assert not any(a.split for a in host_adams(whole))
    for step in range(6):
        a, b = split.step(step_batches(step)), whole.step(step_batches(step))
        assert a.loss == b.loss, step
        for name, weight in split.working_set.host.items():  # what goes up
            assert torch.equal(weight, whole.working_set.host[name]), (step, name)
    saved = sum(a.groups[k].numel * 2 for a in host_adams(whole) for k in range(len(a.groups)))
    assert whole.host_bytes() - split.host_bytes() >= saved  # the chunk state's bf16 copies are gone


# ------------------------------------------------------------------ 2. resume through the files


def slide_case(precision: str, slide: SlideConfig | None = None, chunk: ChunkConfig | None = None, **overrides):
    """Builds slide on a model of the given seed, its files (moments, chunk state) under a folder."""
    def build(seed: int, tmp_path):
        slide_cfg = dataclasses.replace(slide or SlideConfig(), moments_dir=str(tmp_path / "moments"))
        chunk_cfg = dataclasses.replace(chunk, state_dir=str(tmp_path / "state")) if chunk else None
        return slide_engine(model_of(layers=2, dtype=torch.float32, seed=seed), precision, slide_cfg, chunk_cfg,
                            **overrides)
    return build


def chunk_case(precision: str, **overrides):
    """Engine chunk in 3 chunks; its weights in the run's weight dtype (bf16 under bf16, as a run
    loads them: the fp32 masters, split, are the chunk state's)."""
    def build(seed: int, tmp_path):
        del tmp_path
        cfg = engine_config(train(**overrides), engine="chunk", method="full",
                            sections={"chunk": ChunkConfig(n_chunks=3)})
        model = model_of(layers=2, dtype=chunk_weight_dtype(precision, "full"), seed=seed)
        return ChunkEngine(Stack(model), cfg, CPU, precision)
    return build


def roundpipe_case(precision: str, **overrides):
    def build(seed: int, tmp_path):
        del tmp_path
        cfg = engine_config(train(batch_size=4, **overrides), engine="roundpipe", method="full",
                            sections={"roundpipe": RoundPipeConfig(workers=2, replan=False)})
        return RoundPipeEngine(Stack(model_of(layers=2, dtype=torch.float32, seed=seed)), cfg, CPU, precision)
    return build


@pytest.mark.parametrize("engine", ["chunk", "roundpipe"])
def test_chunk_and_roundpipe_with_the_split_master_train_as_the_whole_master(tmp_path, engine):
    """Engine chunk's state and roundpipe's host units under bf16: train.master=split equals the whole
    fp32 master over six steps (two sweeps of chunk's three chunks), the losses and gradient norms bit
    for bit, the masters within the tie rule's ulps (the same argument as slide's, above)."""
    build = chunk_case if engine == "chunk" else roundpipe_case
    split, whole = (build("bf16", master=m)(0, tmp_path / m) for m in ("split", "fp32"))
    assert layouts_of(split) == (True, False) and layouts_of(whole) == (False, False)
    rows, peaks = rows_of(split), {}
    for step in range(6):
        a, b = split.step(step_batches(step, rows)), whole.step(step_batches(step, rows))
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm), step
        masters, reference = split.trainable_state(), whole.trainable_state()
        assert masters.keys() == reference.keys() and reference
        for name, want in reference.items():
            peaks[name] = torch.maximum(peaks.get(name, want.abs()), torch.maximum(want.abs(), masters[name].abs()))
            assert_within_ulps_of_peak(masters[name], want, peaks[name], 4, f"step {step}: {name}")


RESUMED = {
    "slide-bf16-split": slide_case("bf16"),
    "slide-fp32-8bit": slide_case("fp32", moments="8bit"),
    "slide-bf16-8bit": slide_case("bf16", moments="8bit"),
    "slide-bf16-8bit-moments-on-disk": slide_case("bf16", SlideConfig(moments="disk"), moments="8bit"),
    "slide-chunk-working-set-bf16-8bit-state-on-disk": slide_case(
        "bf16", SlideConfig(working_set="chunk"), ChunkConfig(n_chunks=3, state="disk"), moments="8bit"),
    "chunk-bf16-8bit": chunk_case("bf16", moments="8bit"),
    "roundpipe-bf16-split": roundpipe_case("bf16"),
    "roundpipe-bf16-8bit": roundpipe_case("bf16", moments="8bit"),
}


def assert_same_state(got: checkpoint.EngineState, want: checkpoint.EngineState) -> None:
    """Weights, fp32 moments, step counts and extras (8-bit codes, a chunk's place) bit for bit."""
    assert (got.step, got.adam_steps) == (want.step, want.adam_steps)
    for field in ("trainable", "exp_avg", "exp_avg_sq"):
        mine, theirs = getattr(got, field), getattr(want, field)
        assert mine.keys() == theirs.keys() and mine, field
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), (field, name)
    assert_same_extra(got.extra, want.extra)


def assert_same_extra(got, want, where: str = "extra") -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_extra(got[key], want[key], f"{where}/{key}")
    else:
        assert got == want, where


def rows_of(engine) -> int:
    return 4 if isinstance(engine, RoundPipeEngine) else 2


@pytest.mark.parametrize("case", list(RESUMED))
def test_every_new_option_resumes_bit_for_bit_through_the_checkpoint_files(tmp_path, case):
    """Two steps, a checkpoint written and read back (checkpoint.save / load), a fresh engine built
    from other weights, two more steps: what a straight run of four steps holds, bit for bit."""
    build = RESUMED[case]
    straight = build(0, tmp_path / "straight")
    assert layouts_of(straight) == ("bf16" in case, "8bit" in case)  # bf16: train.master=split, the default
    rows = rows_of(straight)
    losses = [straight.step(step_batches(s, rows)).loss for s in range(4)]
    first = build(0, tmp_path / "first")
    for s in range(2):
        first.step(step_batches(s, rows))
    saved = first.state_dict()
    if "8bit" in case:
        assert saved.extra[CODED], "an 8-bit run checkpoints its codes as they rest"
    folder = checkpoint.save(tmp_path / "run", 2, saved, {}, keep_last=1)
    resumed = build(5, tmp_path / "resumed")  # other weights: everything must come from the files
    resumed.load_state_dict(checkpoint.load(folder)[1])
    assert [resumed.step(step_batches(s, rows)).loss for s in (2, 3)] == losses[2:]
    assert_same_state(resumed.state_dict(), straight.state_dict())


def test_the_8bit_codes_in_the_checkpoint_are_what_resumes_exactly(tmp_path):
    """Without the codes as they rested (EngineState.extra) an 8-bit run resumes from its decoded
    moments coded again, and a block whose largest number is negative comes back with another
    absmax (HostAdam.coded says why): the run goes on differently. So the codes must travel."""
    build = RESUMED["slide-fp32-8bit"]
    straight, first = build(0, tmp_path / "a"), build(0, tmp_path / "b")
    for s in range(3):
        straight.step(step_batches(s))
    for s in range(2):
        first.step(step_batches(s))
    saved = first.state_dict()
    saved.extra = {}
    recoded = build(5, tmp_path / "c")
    recoded.load_state_dict(saved)
    recoded.step(step_batches(2))
    want, got = straight.state_dict(), recoded.state_dict()
    assert any(not torch.equal(got.exp_avg[n], want.exp_avg[n]) for n in want.exp_avg)


# ------------------------------------------------------------------ 3. a damaged 8-bit checkpoint


def flip_byte_inside(path, needle: bytes) -> None:
    """Change one bit of `path` in the middle of the first place `needle` occurs in it."""
    blob = bytearray(path.read_bytes())
    at = blob.find(needle)
    assert at >= 0, f"{needle[:16]!r}... is not in {path.name}"
    blob[at + len(needle) // 2] ^= 0x04
    path.write_bytes(bytes(blob))


def safetensors_data(state: dict[str, torch.Tensor], name: str) -> bytes:
    return state[name].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("damaged", [pytest.param("state.pt", marks=pytest.mark.quick), "moments.safetensors",
                                     "trainable.safetensors"])
def test_a_damaged_file_of_an_8bit_checkpoint_is_named_and_not_resumed_from(tmp_path, damaged):
    """The newest checkpoint of an 8-bit slide run, one bit changed inside the file: in state.pt
    inside the 8-bit codes, in moments.safetensors inside a moment, in trainable.safetensors inside
    a master. The CRC-32s name the file, and a resume goes back to the checkpoint before it (the
    one an intact run wrote earlier); loading the changed file unchecked would succeed silently."""
    engine = RESUMED["slide-bf16-8bit"](0, tmp_path)
    for step in (1, 2):
        engine.step(step_batches(step))
        state = engine.state_dict()
        newest = checkpoint.save(tmp_path / "run", step, state, {}, keep_last=2)
    codes = next(k for k in state.extra[CODED] if k.endswith("/codes"))
    name = next(iter(state.exp_avg))
    needle = {"state.pt": state.extra[CODED][codes].numpy().tobytes(),
              "moments.safetensors": safetensors_data(state.exp_avg_sq, name),
              "trainable.safetensors": safetensors_data(state.trainable, name)}[damaged]
    flip_byte_inside(newest / damaged, needle)
    assert checkpoint.damage(newest) == f"{damaged} has changed since it was written (CRC-32)"
    found, said = checkpoint.latest_intact(tmp_path / "run")
    assert found == newest.with_name("step-00000001")
    assert said == [f"checkpoint '{newest}' is damaged ({damaged} has changed since it was written (CRC-32))"]
    unchecked = checkpoint.load(newest)[1]  # what a resume without the CRC-32s would have taken
    changed = {"state.pt": lambda s: s.extra[CODED][codes], "moments.safetensors": lambda s: s.exp_avg_sq[name],
               "trainable.safetensors": lambda s: s.trainable[name]}[damaged]
    assert not torch.equal(changed(unchecked), changed(state))


# ------------------------------------------------------------------ 4. estimate == meter, host and disk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("layouts"), tokenizer)


SLIDE = ["engine=slide", "precision=bf16"]
ESTIMATED = {
    "slide-split": SLIDE,
    "slide-8bit": SLIDE + ["train.moments=8bit"],
    "slide-8bit-moments-on-disk": SLIDE + ["train.moments=8bit", "slide.moments=disk"],
    "slide-moments-on-disk": SLIDE + ["slide.moments=disk"],
    "slide-split-clipping-off": SLIDE + ["train.max_grad_norm=0"],
    "slide-split-accumulating": SLIDE + ["train.grad_accum=2"],  # gradients summed on the host in fp32
    "slide-chunk-working-set-8bit": SLIDE + ["slide.working_set=chunk", "chunk.n_chunks=3", "train.moments=8bit"],
    "slide-chunk-working-set-8bit-state-on-disk": SLIDE + ["slide.working_set=chunk", "chunk.n_chunks=3",
                                                           "train.moments=8bit", "chunk.state=disk"],
    "chunk-8bit": ["engine=chunk", "precision=bf16", "chunk.n_chunks=3", "train.moments=8bit"],
    "roundpipe-split": ["engine=roundpipe", "precision=bf16", "roundpipe.replan=false"],
    "roundpipe-8bit": ["engine=roundpipe", "precision=bf16", "roundpipe.replan=false", "train.moments=8bit"],
}


@pytest.mark.parametrize("case", list(ESTIMATED))
def test_the_estimates_host_and_disk_bytes_equal_the_cpu_meters(tmp_path, tokenizer, model_dir, case):
    scratch = [f"slide.moments_dir={tmp_path / 'moments'}", f"chunk.state_dir={tmp_path / 'state'}"]
    cfg = settings.load(None, ESTIMATED[case] + scratch,
                        base={"model": str(model_dir), "data": "x.jsonl", "method": "full",
                              "output_dir": str(tmp_path), "train": {"batch_size": 2, "grad_accum": 1}})
    predicted = estimate.estimate(tiny_config("llama", len(tokenizer)), cfg, 2, 24)
    measured, _ = measured_step(model_dir, cfg, "bf16", estimate.synthetic_batch(2, 24, len(tokenizer)))
    assert predicted.host_bytes == measured.host_peak_bytes > 0
    assert predicted.disk_bytes == measured.disk_peak_bytes
    assert (predicted.disk_bytes > 0) == ("disk" in case)  # files counted where there are files, only there


def test_8bit_moments_take_what_the_blockwise_codes_take_in_the_estimate():
    """Beside the equality above, the figure itself: 8-bit moments hold a byte and a 256th of an
    fp32 scale a number where fp32 moments held 8 bytes, counted per HostAdam group, and nothing
    else changes."""
    config = tiny_config("llama", VOCAB)

    def planned(*overrides):
        cfg = settings.load(None, SLIDE + list(overrides), base={"model": "(test)", "data": "(test)",
                                                                 "method": "full", "train": {"grad_accum": 1}})
        return estimate.estimate(config, cfg, 2, 24).host_bytes

    engine = slide_engine(model_of(layers=config.num_hidden_layers, dtype=torch.float32, vocab_size=VOCAB), "bf16")
    groups = [g.numel for adam in host_adams(engine) for g in adam.groups]
    assert planned() - planned("train.moments=8bit") == sum(8 * n - 2 * nbytes_8bit(n) for n in groups)


# ------------------------------------------------------------------ 5. 8-bit moments against AdamW8bit


def adamw_in_bitsandbytes_order(p, g, m, v, step, lr, wd, betas, eps) -> None:
    """AdamW on fp32 tensors in bitsandbytes' CPU kernel's order (test_moments8 shows it equals
    AdamW8bit's step bit for bit, from the same dequantized moments)."""
    b1, b2 = betas
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    p.mul_(1 - lr * wd)
    p.addcdiv_(m, denom, value=-lr / (1 - b1**step))


def dense(grad) -> torch.Tensor:
    """A copy of an accumulator as a flat tensor (an embedding's keeps only the rows it was given)."""
    if isinstance(grad, torch.Tensor):
        return grad.clone()
    return grad.tile(0, grad.numel(), torch.empty(grad.numel(), dtype=grad.dtype))


class Recorder:
    """Each HostAdam's gradients (times the clipping coefficient) as its update receives them."""

    def __init__(self, monkeypatch):
        self.grads: dict[tuple[str, int], torch.Tensor] = {}
        self.clips: dict[str, float] = {}
        update = HostAdam.update

        def recording(adam, lr, clip=1.0, shadows=None):
            self.clips[adam.name] = clip
            for k, grad in enumerate(adam.grads):
                self.grads[adam.name, k] = dense(grad)
            return update(adam, lr, clip, shadows)

        monkeypatch.setattr(HostAdam, "update", recording)


def test_slides_8bit_moments_follow_bitsandbytes_adamw8bit_step_by_step(monkeypatch):
    """bitsandbytes' AdamW8bit holds one flat fp32 parameter per HostAdam group (the engine's 8-bit
    blocks run over a group's members laid out one after another; AdamW8bit over the model's own
    tensors would block each tensor apart, and the two could then only be compared statistically).
    Each step is teacher-forced: the engine's masters and 8-bit codes are set to AdamW8bit's, the
    engine steps (its own forward, backward, global norm, clipping, lr and bias correction), and
    AdamW8bit steps on the gradients the engine's update received times the engine's clipping
    coefficient (held to torch's formula on the global norm computed here). Then:
    - exactly: the engine's step is AdamW8bit's state dequantized (the two dequantizers agree bit for
      bit), torch's fused AdamW (the host optimizer's kernel), and the nearest codes of bitsandbytes'
      reference quantizer;
    - within a bound, AdamW8bit itself: its kernel forms m as b1 m + (1 - b1) g where the fused one
      lerps, so the master lands within lr 2^-22 (|m| + |g|) / denominator + 2^-21 of the step + 2
      ulps of AdamW8bit's (test_moments8 derives it), and the decoded moments within the map's half
      gap (h) of their block's absmax, plus 2^-20 absmax and the lerp's 2^-22 (|m| + |g|), of
      AdamW8bit's new moments before its own (coarser) quantizer.
    20 steps: the lr's warmup and cosine, bias corrections from 1, both weight decays (matrices and
    1-D tensors), clipping on every step, and the embedding's gradient however its accumulator keeps it."""
    rec = Recorder(monkeypatch)
    engine = slide_engine(model_of(layers=2, dtype=torch.float32), "fp32", moments="8bit")
    adams = host_adams(engine)
    assert layouts_of(engine) == (False, True)
    betas, eps = tuple(train().betas), train().eps
    params, optimizers = {}, {}
    for adam in adams:
        for k, group in enumerate(adam.groups):
            p = torch.nn.Parameter(adam.masters[k].clone())
            params[adam.name, k] = p
            optimizers[adam.name, k] = bnb().optim.AdamW8bit([p], lr=1.0, betas=betas, eps=eps,
                                                             weight_decay=group.weight_decay, min_8bit_size=0)
    h = {True: worst_error(moments8.dynamic_map(True)), False: worst_error(moments8.dynamic_map(False))}
    for step in range(1, 21):
        if step > 1:
            teacher_force(adams, params, optimizers)
        result = engine.step(step_batches(step))
        total = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in rec.grads.values()]))
        clip = rec.clips["block 0"]  # one coefficient for every unit, torch's formula on the global norm
        assert set(rec.clips.values()) == {clip}
        assert clip == pytest.approx(float(rules.clip_coefficient(total, TRAIN["max_grad_norm"])), rel=1e-6)
        for adam in adams:
            for k, group in enumerate(adam.groups):
                check_group(adam, k, params[adam.name, k], optimizers[adam.name, k], rec.grads[adam.name, k] * clip,
                            step, result.lr, group.weight_decay, betas, eps, h)



def teacher_force(adams, params, optimizers) -> None:
    """The engine's masters and 8-bit moments become AdamW8bit's (so both step from one state)."""
    with torch.no_grad():
        for adam in adams:
            for k in range(len(adam.groups)):
                state = optimizers[adam.name, k].state[params[adam.name, k]]
                adam.masters[k].copy_(params[adam.name, k])
                adam.load_coded(k, {"exp_avg/codes": state["state1"], "exp_avg/absmax": state["absmax1"],
                                    "exp_avg_sq/codes": state["state2"], "exp_avg_sq/absmax": state["absmax2"]})


def dequantized(optimizer, p: torch.nn.Parameter, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW8bit's m and v as fp32 (zeros before its first step)."""
    state = optimizer.state[p]
    if not state:
        return torch.zeros(n), torch.zeros(n)
    out = []
    for signed, k in ((True, "1"), (False, "2")):
        moment = moments8.Moment8(n, signed)
        moment.codes.copy_(state["state" + k])
        moment.absmax.copy_(state["absmax" + k])
        out.append(moment.dequantize(0, n, torch.empty(n)))
    return out[0], out[1]


def fused_step(p, g, m, v, step, lr, wd, betas, eps) -> None:
    """torch's fused CPU AdamW (what the host optimizer runs) on fp32 tensors, in place."""
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=wd, eps=eps, amsgrad=False, maximize=False)


def check_group(adam, k, p, optimizer, grad, step, lr, wd, betas, eps, h) -> None:
    """Group k's step from AdamW8bit's state: the engine's is the dequantized moments, torch's fused
    AdamW and the nearest codes, bit for bit; and AdamW8bit's lands within the bounds the test's
    docstring derives of it."""
    n = adam.groups[k].numel
    m, v = dequantized(optimizer, p, n)
    m_before, plain = m.clone(), p.detach().clone()
    fused = [t.clone() for t in (plain, m, v)]
    fused_step(fused[0], grad, fused[1], fused[2], step, lr, wd, betas, eps)
    assert torch.equal(adam.masters[k], fused[0]), (adam.name, k, step)
    for moment, values in zip(MOMENTS, fused[1:]):
        held = adam.moments[k][moment]
        assert torch.equal(held.codes, reference_codes(values, held.code)), (adam.name, k, moment, step)
    adamw_in_bitsandbytes_order(plain, grad, m, v, step, lr, wd, betas, eps)  # the exact new moments
    p.grad = grad.clone()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.step()
    assert torch.equal(plain, p.detach()), (adam.name, k, step)  # the order above is AdamW8bit's
    theirs, mine = p.detach().double(), adam.masters[k].double()
    b1, b2 = betas
    denom = (1 - b1**step) * (v.double().sqrt() / math.sqrt(1 - b2**step) + eps)
    update = lr * m.double().abs() / denom
    lerp_m = 2**-22 * (m_before.double().abs() + grad.double().abs())
    ulps = 2 * torch.finfo(torch.float32).eps * theirs.abs()
    worst = (mine - theirs).abs() - (lr * lerp_m / denom + 2**-21 * update + ulps)
    assert worst.max() <= 0, (adam.name, k, step, float(worst.max()))
    for moment, exact, signed, lerp in (("exp_avg", m, True, lerp_m), ("exp_avg_sq", v, False,
                                                                    2**-22 * (v.double() + grad.double() ** 2))):
        held = adam.moments[k][moment]
        scale = held.absmax.double().repeat_interleave(moments8.BLOCK)[:n]
        decoded = held.dequantize(0, n, torch.empty(n)).double()
        error = (decoded - exact.double()).abs() - ((h[signed] + 2**-20) * scale + lerp)
        assert error.max() <= 0, (adam.name, k, moment, step, float(error.max()))
