"""Engine roundpipe (stateless workers fed stages round robin, state on the host) against engine
resident, itself checked against hand-written PyTorch with torch.optim.AdamW (test_oracle_step):
float64, several steps, gradient accumulation, clipping, tied and untied heads, for 1-4 worker
threads, several micro-batch counts, the partitioner's and hand-made partitions and both grains.
The async optimizer against the one-step-delayed recurrence written out with torch.optim.AdamW.
Then: random delays change no result, a failing worker stops the step with a sentence and no hang,
the device peak per worker is flat in depth, LoRA on a 4-bit base, resume, and the estimate.

The tests of arithmetic alone run without the CPU memory meter (measure_memory=False: it only
counts, and doubles a step's time here); those of peaks, of timing and delays and of steps begun
early keep it on, as a run does, and so does the sync matrix against plain AdamW."""

import copy
import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import engine_config
from test_slide import batches, model_of
from slimtune.planning import estimate
from slimtune.model import lora, quant
from slimtune.config import LoraConfig, QuantConfig, TrainConfig
from slimtune.data.dataset import Batch
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.roundpipe.engine import RoundPipeConfig, RoundPipeEngine
from slimtune.errors import UserError
from slimtune.model.stack import Stack
from slimtune.optim import rules
from slimtune.engines.roundpipe.mailbox import WorkerFailed
from slimtune.engines.roundpipe.stages import uniform_partition

CPU = torch.device("cpu")
TRAIN = dict(steps=4, batch_size=4, grad_accum=2, lr=1e-2, weight_decay=0.1, warmup_steps=1, schedule="cosine",
             max_grad_norm=0.5)


def run_cfg(section: RoundPipeConfig, method: str = "full", precision: str = "auto", **train):
    return engine_config(TrainConfig(**{**TRAIN, **train}), engine="roundpipe", method=method, precision=precision,
                         sections={"roundpipe": section})


def run(engine_class, model, cfg, steps=3, rows=4, precision="fp64", partition=None, setup=None):
    stack = Stack(copy.deepcopy(model))
    engine = engine_class(stack, cfg, CPU, precision)
    if partition is not None:
        engine.partition = partition
    if setup is not None:
        setup(engine)
    out = [engine.step(batches(model.config.vocab_size, seed, cfg.train.grad_accum, rows=rows)) for seed in range(steps)]
    params = (engine.trainable_state() if isinstance(engine, RoundPipeEngine)
              else {n: p.detach().clone() for n, p in stack.model.named_parameters() if p.requires_grad})
    return [r.loss for r in out], [r.grad_norm for r in out], {n: p.clone() for n, p in params.items()}, out


def assert_same(expected, found, tol=1e-10):
    assert found[0] == pytest.approx(expected[0], abs=tol, rel=0)
    assert found[1] == pytest.approx(expected[1], abs=tol, rel=0)
    assert expected[2].keys() == found[2].keys()
    for name, value in expected[2].items():
        torch.testing.assert_close(found[2][name], value, atol=tol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def models():
    return {"untied": model_of(4), "tied": model_of(4, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def resident(models):
    cfg = run_cfg(RoundPipeConfig(), measure_memory=False)
    return {name: run(ResidentEngine, model, cfg) for name, model in models.items()}


@pytest.mark.quick
@pytest.mark.parametrize("workers,micro", [(1, 1), (2, 0), (3, 2), (4, 7)])
@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_sync_equals_plain_adamw_for_several_workers_and_micro_batches(models, resident, workers, micro, tied):
    cfg = run_cfg(RoundPipeConfig(workers=workers, micro_batches=micro))
    found = run(RoundPipeEngine, models[tied], cfg)
    assert_same(resident[tied], found)
    assert all(r.host_link_bytes > 0 and r.device_peak_bytes > 0 for r in found[3])


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 1, 1), (4, 2, 1), (1, 4, 2)], ids=str)
def test_hand_made_partitions_and_both_grains_equal_plain_adamw(models, resident, grain, shape):
    forward, backward, tail = shape  # layers per forward stage, per backward stage, in the tail
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=3, grain=grain, replan=False), measure_memory=False)
    partition, kept = uniform_partition(5, forward, backward, tail), []
    found = run(RoundPipeEngine, models["untied"], cfg, partition=partition,
                setup=lambda e: kept.append(e))
    assert_same(resident["untied"], found)
    assert kept[0].partition is partition


def test_results_do_not_depend_on_the_cut_so_replanning_keeps_them_bitwise(models):
    """Where the stages end changes no bit. The tail stays whole (roundpipe.tail_shards=1) in the
    replanned run: cutting the head into token shards changes the order of the loss's and the head
    gradient's sums (equal to rounding: test_a_tail_cut_into_token_shards_equals_plain_adamw), and a
    replan from measured times picks shards or not by the machine's load (under load it once did,
    and the third loss differed in its last bit)."""
    cuts = [uniform_partition(5, 1, 1), uniform_partition(5, 4, 2, 1), uniform_partition(5, 2, 1, 2)]
    pinned = run_cfg(RoundPipeConfig(workers=2, replan=False), measure_memory=False)
    found = [run(RoundPipeEngine, models["tied"], pinned, partition=cut) for cut in cuts]
    replanned = run(RoundPipeEngine, models["tied"],
                    run_cfg(RoundPipeConfig(workers=2, tail_shards=1), measure_memory=False))
    for other in (*found[1:], replanned):
        assert other[0] == found[0][0] and other[1] == found[0][1]
        assert all(torch.equal(other[2][n], found[0][2][n]) for n in found[0][2])


@pytest.mark.parametrize("shards,grain,tied", [(2, "stage", "untied"), (3, "layer", "tied"), (15, "stage", "tied")])
def test_a_tail_cut_into_token_shards_equals_plain_adamw(models, resident, shards, grain, tied):
    """The LM head + loss as `shards` jobs, each on a slice of every micro-batch's 12 tokens (15:
    some slices empty), on 3 workers; the next backward job joins the slices' gradients."""
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=3, grain=grain, replan=False), measure_memory=False)
    partition = uniform_partition(5, 2, 1, tail_shards=shards)
    assert len(partition.stages()) == 2 + shards + 4
    assert_same(resident[tied], run(RoundPipeEngine, models[tied], cfg, partition=partition))


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_a_sharded_tail_gives_the_same_bits_whichever_shard_ends_first(models, optimizer):
    """The shards' head gradients are added in shard order (one ending early waits): random delays everywhere,
    and a first shard held back, change no bit (tied head: the embedding rows add up after them)."""
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer=optimizer, replan=False))
    partition = uniform_partition(5, 2, 1, tail_shards=3)

    def hold_first_shard(engine):
        slow_everything(engine, 5)
        late = lambda worker, job, m: time.sleep(0.05) if job.stage.kind == "tail" and job.shard == 0 else None
        engine.workers[partition_worker(partition, 0)].delay = late

    calm = run(RoundPipeEngine, models["tied"], cfg, partition=partition)
    shaken = run(RoundPipeEngine, models["tied"], cfg, partition=partition, setup=hold_first_shard)
    assert shaken[0] == calm[0] and shaken[1] == calm[1]
    assert all(torch.equal(shaken[2][n], calm[2][n]) for n in calm[2])


def partition_worker(partition, shard: int, workers: int = 3) -> int:
    """The worker of the first step's tail shard `shard` (the cursor starts at 0)."""
    return (len(partition.forward) + shard) % workers


def test_the_partitioner_cuts_a_heavy_head_by_tokens_and_the_result_stays_exact():
    """A 2,000-token vocabulary on a 32-wide model: the head is several blocks' worth, so the
    partitioner cuts it (roundpipe.tail_shards 0: up to the workers); 1 keeps it whole."""
    model = model_of(3, vocab_size=2000)
    cut = RoundPipeEngine(Stack(copy.deepcopy(model)), run_cfg(RoundPipeConfig(workers=2)), CPU, "fp64")
    whole = RoundPipeEngine(Stack(copy.deepcopy(model)), run_cfg(RoundPipeConfig(workers=2, tail_shards=1)), CPU,
                            "fp64")
    assert cut.partition.tail.shards == 2 and whole.partition.tail.shards == 1
    cfg = run_cfg(RoundPipeConfig(workers=2), measure_memory=False)
    assert_same(run(ResidentEngine, model, cfg), run(RoundPipeEngine, model, cfg))


def test_measured_layer_times_feed_the_partitioner(models):
    engine = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), run_cfg(RoundPipeConfig(workers=2)), CPU, "fp64")
    initial = engine.layer_times.costs()
    for seed in range(3):
        engine.step(batches(300, seed, 1, rows=4))
    measured = engine.layer_times.costs()
    assert all(c.forward > 0 and c.backward > 0 for c in measured)
    assert [c.forward for c in measured] != [c.forward for c in initial]  # seconds now, not bytes
    assert [c.memory for c in measured] == [c.memory for c in initial]
    engine.partition.check()


def test_the_partitioner_isolates_the_head_and_every_job_takes_the_next_worker(models):
    cfg = run_cfg(RoundPipeConfig(workers=3, replan=False))
    engine = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), cfg, CPU, "fp64")
    partition = engine.partition
    partition.check()
    assert partition.tail.stop == 5 and len(partition.stages()) >= 3
    seen = []
    engine.workers[0].delay = engine.workers[1].delay = engine.workers[2].delay = (
        lambda worker, job, m: seen.append((job.index, worker.index)) if m == 0 else None)
    engine.step(batches(models["untied"].config.vocab_size, 0, 1, rows=4))
    engine.step(batches(models["untied"].config.vocab_size, 1, 1, rows=4))
    count = len(partition.stages())
    by_step = [sorted(seen[:count]), sorted(seen[count:])]
    assert by_step[0] == [(j, j % 3) for j in range(count)]
    assert by_step[1] == [(j, (count + j) % 3) for j in range(count)]  # the cursor carries on


def delayed_reference(model, cfg, steps=3, rows=4, skip=()):
    """W_k = AdamW(W_{k-1}, gradient at W_{k-2}), W_{-1} = W_0, written out with torch.optim.AdamW;
    the steps in `skip` take no update (W_k = W_{k-1}), as a step with a non-finite norm."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = rules.decay_groups(params, cfg.train.weight_decay)
    optimizer = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for ps, wd in groups],
                                  **rules.adamw_settings(cfg.train))
    compute = [p.detach().clone() for p in params]  # the weights the next gradient is taken at
    losses = []
    for step in range(steps):
        masters = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, c in zip(params, compute):
                p.copy_(c)
        micro = batches(model.config.vocab_size, step, cfg.train.grad_accum, rows=rows)
        total = sum(b.num_targets for b in micro)
        loss_sum = 0.0
        for b in micro:
            logits = model(input_ids=b.input_ids, position_ids=b.position_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100, reduction="sum")
            (loss / total).backward()
            loss_sum += float(loss)
        losses.append(loss_sum / total)
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        compute = [p.detach().clone() for p in params]  # taken before this update: one step stale
        for group in optimizer.param_groups:
            group["lr"] = rules.lr_at(cfg.train, step)
        if step not in skip:
            optimizer.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    return losses, {names[id(p)]: p.detach().clone() for p in params}


@pytest.mark.quick
@pytest.mark.parametrize("workers", [1, 3])
def test_async_equals_the_one_step_delayed_recurrence(models, resident, workers):
    cfg = run_cfg(RoundPipeConfig(workers=workers, optimizer="async"), measure_memory=False)
    losses, params = delayed_reference(models["untied"], cfg, steps=4)
    found = run(RoundPipeEngine, models["untied"], cfg, steps=4)
    assert found[0] == pytest.approx(losses, abs=1e-10, rel=0)
    for name, value in params.items():
        torch.testing.assert_close(found[2][name], value, atol=1e-10, rtol=0, msg=name)
    # Stale is not sync: step 1 computes at W0 where sync's (resident's, equal to it above) computes at W1.
    assert found[0][0] == pytest.approx(resident["untied"][0][0], abs=1e-10, rel=0)
    assert abs(found[0][1] - resident["untied"][0][1]) > 1e-6


def test_async_a_step_that_may_not_update_still_gives_the_step_after_next_its_weights(models):
    """Step 1's gradient norm is not finite: update 1 is left out, so step 3 computes at W1 (the
    weights after update 0), which the left-out update must still write into the version step 3
    reads. Against the delayed recurrence with that update left out."""
    cfg = run_cfg(RoundPipeConfig(workers=2, optimizer="async"), measure_memory=False)

    def poison_step_1(engine: RoundPipeEngine) -> None:
        norm = engine.optimizer.grad_norm
        engine.optimizer.grad_norm = lambda: torch.tensor(float("inf")) if engine.step_count == 1 else norm()

    found = run(RoundPipeEngine, models["untied"], cfg, steps=5, setup=poison_step_1)
    assert [r.applied for r in found[3]] == [True, False, True, True, True]
    losses, params = delayed_reference(models["untied"], cfg, steps=5, skip={1})
    assert found[0] == pytest.approx(losses, abs=1e-10, rel=0)
    for name, value in params.items():
        torch.testing.assert_close(found[2][name], value, atol=1e-10, rtol=0, msg=name)


def jitter(seed: int):
    rng = random.Random(seed)

    def sleep(*_):
        time.sleep(rng.random() * 0.003)

    return sleep


def slow_everything(engine: RoundPipeEngine, seed: int) -> None:
    """Random sleeps before every micro-batch of every worker, every upload, and every host job."""
    for worker in engine.workers:
        worker.delay = jitter(seed + worker.index)
        upload, pause = worker.link.to_device, jitter(seed + 10 + worker.index)
        worker.link.to_device = lambda host, after=None, upload=upload, pause=pause: (pause(), upload(host, after))[1]
    for thread in {id(t): t for t in (engine.host, engine.optimizer.thread)}.values():  # sync: one and the same
        submit, pause = thread.submit, jitter(seed + 20)
        thread.submit = lambda fn, *args, submit=submit, pause=pause: submit(lambda: (pause(), fn(*args))[1])


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_random_delays_in_workers_transfers_and_the_optimizer_change_nothing(models, optimizer):
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer=optimizer))
    calm = run(RoundPipeEngine, models["tied"], cfg)
    for seed in (1, 2):
        shaken = run(RoundPipeEngine, models["tied"], cfg, setup=lambda e, s=seed: slow_everything(e, s))
        assert shaken[0] == calm[0] and shaken[1] == calm[1]
        assert all(torch.equal(shaken[2][n], calm[2][n]) for n in calm[2])


def test_a_tied_heads_gradient_and_the_embedding_rows_add_up_in_one_order_whatever_arrives_first(models):
    """The tied weight gets the head's gradient (the tail job, when it ends) and the embedding rows'
    (the layer-0 job, per micro-batch): which comes first is timing. Forced both ways, the weights
    agree bit for bit (the rows are added after the jobs, in micro-batch order)."""
    def hold(kind: str, start: int, m: int):
        def pause(worker, job, micro):
            if job.stage.kind == kind and job.stage.start == start and micro == m:
                time.sleep(0.3)
        return pause

    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=3, replan=False))
    step = batches(300, 0, 1, rows=3)[0]
    few = 3 + step.input_ids % 4  # four token ids: every row of the table gets many terms
    step = Batch(few, torch.roll(few, -1, dims=1), step.position_ids)
    found = []
    for pause in (hold("tail", 4, 2), hold("backward", 0, 0)):  # rows first, then the head's first
        engine = RoundPipeEngine(Stack(copy.deepcopy(models["tied"]).float()), cfg, CPU, "fp32")  # fp32: rounding shows
        engine.partition = uniform_partition(5, 1, 2)  # tail on worker 1, the layer-0 job on worker 0
        for worker in engine.workers:
            worker.delay = pause
        engine.step([step])
        found.append(engine.trainable_state())
    assert all(torch.equal(found[0][n], found[1][n]) for n in found[0])


def test_a_failing_worker_stops_every_worker_with_one_sentence_and_no_hang(models):
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=3))
    engine = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), cfg, CPU, "fp64")

    def die(worker, job, m):
        if worker.index == 1 and m == 1:
            raise RuntimeError("device lost")

    engine.workers[1].delay = die
    caught = []
    thread = threading.Thread(target=lambda: caught.append(pytest.raises(WorkerFailed, engine.step,
                                                                          batches(300, 0, 1, rows=4))))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the other workers hung"
    message = str(caught[0].value)
    assert "worker 1" in message and "device lost" in message and isinstance(caught[0].value, UserError)


class DrainWatch:
    """A worker delay: each step's last job waits, before its last micro-batch, until the next
    step's first job has begun (at most `patience` s); `overlapped` records, per step, whether it did."""

    def __init__(self, engine: RoundPipeEngine, steps: int, micro: int, patience: float = 5.0):
        self.last_job, self.steps, self.micro, self.patience = len(engine.partition.stages()) - 1, steps, micro, patience
        self.first_jobs, self.overlapped = 0, []
        self.begun = threading.Condition()
        for worker in engine.workers:
            worker.delay = self

    def __call__(self, worker, job, m):
        with self.begun:
            if job.index == 0 and m == 0:
                self.first_jobs += 1
                self.begun.notify_all()
            if job.index == self.last_job and m == self.micro - 1 and len(self.overlapped) < self.steps - 1:
                step = len(self.overlapped)  # this is step `step`'s last job; the next one's job 0 is the (step+2)-th
                self.overlapped.append(self.begun.wait_for(lambda: self.first_jobs > step + 1, self.patience))


def run_early(model, cfg, steps: int, partition=None, setup=None):
    """As run(), but each step hands the engine the next step's batches (then=), as the loop does."""
    engine = RoundPipeEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    engine.partition = partition or engine.partition
    if setup is not None:
        setup(engine)
    data = [batches(model.config.vocab_size, seed, cfg.train.grad_accum, rows=4) for seed in range(steps)]
    out = [engine.step(data[k], then=(data[k + 1], None) if k + 1 < steps else None) for k in range(steps)]
    params = {n: p.clone() for n, p in engine.trainable_state().items()}
    return [r.loss for r in out], [r.grad_norm for r in out], params, out


def test_a_step_begun_early_leaves_the_running_step_s_device_peak_alone(models, monkeypatch):
    """A step's meters open idle (on CUDA: each card's peak statistics reset) only when no other step runs;
    the one begun early (then=) opens them while the step before it still runs, so its peak covers both
    and the running step's is not cut short. The CPU meter does not reset: what reaches it is checked."""
    opened = []
    real = RoundPipeEngine._open_meters
    monkeypatch.setattr(RoundPipeEngine, "_open_meters", lambda self, idle: (opened.append(idle), real(self, idle))[1])
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer="async", replan=False))
    run_early(models["tied"], cfg, 3)
    assert opened == [True, False, False]


@pytest.mark.parametrize("tail_shards,tied", [(1, "tied"), (3, "untied")])
def test_the_next_step_begun_early_fills_the_drain_and_computes_the_same(models, tail_shards, tied):
    """async: with the next step's batches given early its first jobs run while this step's last
    ones still do (the watch holds a step's end until the next has begun, and would time out
    otherwise), and every loss, gradient norm and weight equals the step-by-step run's (that step
    computes at the same weights either way; to 1e-12, see same_run), every link byte count exactly."""
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer="async", replan=False))
    cut = uniform_partition(5, 2, 1, tail_shards=tail_shards)
    straight = run(RoundPipeEngine, models[tied], cfg, steps=4, partition=cut)
    watches = []
    early = run_early(models[tied], cfg, 4, partition=cut, setup=lambda e: watches.append(DrainWatch(e, 4, micro=2)))
    assert watches[0].overlapped == [True, True, True]
    same_run(early, straight)
    assert [r.host_link_bytes for r in early[3]] == [r.host_link_bytes for r in straight[3]]


def same_run(found, expected, tol=1e-12):
    """Equal up to float64 reduction order, not bit for bit: a CPU reduction's split can follow how
    many threads are free (seen here in one of about 30 step-by-step runs under load, early start
    off: a loss's last bits, the gradients alike), while a step that read weights of the wrong version would be off by
    about the learning rate (1e-2)."""
    assert found[0] == pytest.approx(expected[0], abs=tol, rel=0)
    assert found[1] == pytest.approx(expected[1], abs=tol, rel=0)
    for name, value in expected[2].items():
        torch.testing.assert_close(found[2][name], value, atol=tol, rtol=0, msg=name)


def test_a_step_begun_early_under_random_delays_computes_the_same(models):
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer="async"))
    calm = run(RoundPipeEngine, models["tied"], cfg, steps=4)
    for seed in (3, 4):
        same_run(run_early(models["tied"], cfg, 4, setup=lambda e, s=seed: slow_everything(e, s)), calm)


def test_a_failure_while_the_next_step_runs_early_stops_both_with_one_sentence(models):
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=3, optimizer="async"))
    engine = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), cfg, CPU, "fp64")
    last, firsts, second_begun = len(engine.partition.stages()) - 1, [], threading.Event()

    def die(worker, job, m):  # the first step's last job fails once the second step has begun
        if job.index == 0 and m == 0:
            firsts.append(job)
            if len(firsts) == 2:
                second_begun.set()
        if job.index == last and m == 2 and second_begun.wait(5):
            raise RuntimeError("device lost")

    for worker in engine.workers:
        worker.delay = die
    steps = [batches(300, seed, 1, rows=4) for seed in range(2)]
    caught = []
    thread = threading.Thread(target=lambda: caught.append(pytest.raises(
        WorkerFailed, engine.step, steps[0], then=(steps[1], None))))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "a worker of the step begun early hung"
    assert "device lost" in str(caught[0].value) and f"job {last}" in str(caught[0].value)
    assert engine._ahead is None


def test_device_peak_per_worker_is_flat_in_depth():
    peaks = []
    for layers in (3, 6):
        model = model_of(layers, dtype=torch.float32)
        cfg = run_cfg(RoundPipeConfig(workers=2, micro_batches=2))
        found = run(RoundPipeEngine, model, cfg, steps=1, precision="fp32",
                    partition=uniform_partition(layers + 1, 1, 1))  # one step: no re-plan yet
        peaks.append(found[3][0].device_peak_bytes)
    assert peaks[0] == peaks[1]


@pytest.fixture(scope="module")
def lora_on_4bit():
    """A 3-layer model with LoRA on an int4 base, and resident's run of it (roundpipe's settings do
    not reach resident: one run serves every case)."""
    model = model_of(3)
    quant.apply(model, QuantConfig(scheme="int4", group_size=16))
    torch.manual_seed(1)
    lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    for adapter in lora.adapters(model).values():
        nn.init.normal_(adapter.lora_B.weight, std=0.2)
    return model, run(ResidentEngine, model, run_cfg(RoundPipeConfig(), method="lora", measure_memory=False))


@pytest.mark.parametrize("tail_shards", [1, 2], ids=["whole tail", "tail in 2 token shards"])
def test_lora_on_a_4bit_base_equals_resident(lora_on_4bit, tail_shards):
    """The frozen head is streamed to every shard; the shards make no parameter gradients."""
    model, expected = lora_on_4bit
    cfg = run_cfg(RoundPipeConfig(workers=2, replan=tail_shards == 1), method="lora", measure_memory=False)
    cut = uniform_partition(4, 1, 1, tail_shards=tail_shards) if tail_shards > 1 else None
    found = run(RoundPipeEngine, model, cfg, partition=cut)
    assert_same(expected, found)
    assert found[2] and all("lora_" in n for n in found[2])  # the frozen base has no masters


@pytest.mark.parametrize("optimizer,tail_shards", [("sync", 1), ("async", 1), ("async", 3)],
                         ids=["sync", "async", "async, tail in 3 token shards"])
def test_resume_from_state_dict_continues_exactly(models, optimizer, tail_shards):
    # replan off: a cut replanned from measured times depends on the machine's load, so the straight run
    # and the resumed one could cut differently (what resume restores is the optimizer, not the timings).
    cfg = run_cfg(RoundPipeConfig(workers=3, optimizer=optimizer, replan=False), measure_memory=False)
    cut = uniform_partition(5, 2, 1, tail_shards=tail_shards) if tail_shards > 1 else None
    straight = run(RoundPipeEngine, models["untied"], cfg, steps=4, partition=cut)
    first = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), cfg, CPU, "fp64")
    first.partition = cut or first.partition
    for seed in range(2):
        first.step(batches(300, seed, 2, rows=4))
    state = copy.deepcopy(first.state_dict())
    second = RoundPipeEngine(Stack(copy.deepcopy(models["untied"])), cfg, CPU, "fp64")
    second.partition = cut or second.partition
    second.load_state_dict(state)
    losses = [second.step(batches(300, seed, 2, rows=4)).loss for seed in (2, 3)]
    assert losses == straight[0][2:]
    assert all(torch.equal(second.trainable_state()[n], straight[2][n]) for n in straight[2])


@pytest.mark.parametrize("vocab", [300, 2000], ids=["whole tail", "tail in token shards"])
def test_the_estimate_equals_the_cpu_meter_per_worker(vocab):
    """The planner's fake step (workers inline, one meter each) against the threads' real one; the
    batch's rows are alike, as the estimate's split of trained positions by rows assumes. The cut
    is kept (replan off): both run the first cut, from the layers' bytes, not one from measured times."""
    model = model_of(3, dtype=torch.float32, vocab_size=vocab)
    cfg = run_cfg(RoundPipeConfig(workers=2, micro_batches=2, replan=False), precision="fp32", grad_accum=1,
                  batch_size=4)
    step = estimate.synthetic_batch(4, 12, model.config.vocab_size)
    engine = RoundPipeEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp32")
    assert engine.partition.tail.shards == (2 if vocab == 2000 else 1)
    real = [engine.step([step]) for _ in range(2)][-1]
    fake = estimate.estimate(model.config, cfg, 4, 12, batch=step)
    assert fake.device_peak_bytes == real.device_peak_bytes
    assert fake.host_link_bytes == real.host_link_bytes


@pytest.mark.parametrize("override,words", [
    (dict(loss_mode="subset"), "loss.mode=exact"),
    (dict(lora_dropout=0.1), "lora.dropout=0"),
])
def test_what_it_does_not_do_is_refused_in_one_sentence(override, words):
    from slimtune.engines.roundpipe import engine as roundpipe

    cfg = run_cfg(RoundPipeConfig(), method="lora")
    if "loss_mode" in override:
        cfg.loss.mode = override["loss_mode"]
    if "lora_dropout" in override:
        cfg.lora.dropout = override["lora_dropout"]
    with pytest.raises(UserError, match=words):
        roundpipe.validate(cfg)


def test_a_negative_tail_shard_count_is_refused_in_one_sentence():
    with pytest.raises(UserError, match=r"roundpipe.tail_shards must be 0 \(up to the workers\) or more, got -1\."):
        RoundPipeConfig(tail_shards=-1).validate()


def test_model_dropout_is_refused():
    with pytest.raises(UserError, match="dropout"):
        RoundPipeEngine(Stack(model_of(2, attention_dropout=0.1)), run_cfg(RoundPipeConfig()), CPU, "fp64")


def test_prefetch_cuts_weights_into_pieces_and_queues_one_group_per_activation(monkeypatch):
    from slimtune.device import runtime
    from slimtune.optim.host_unit import HostUnit
    from slimtune.engines.roundpipe import worker as worker_module

    monkeypatch.setattr(worker_module, "PIECE_BYTES", 4096)
    block = model_of(1).model.layers[0]
    unit = HostUnit("block 0", [block], CPU, None, TrainConfig(), None)
    link = runtime.Link(CPU)
    prefetch = worker_module.Prefetch(link, [unit], lambda t: t.upload, groups=4)
    pieces = [p for group in prefetch.pending for p in group]
    assert len(prefetch.pending) == 4 and all(runtime.nbytes(src) <= 4096 for _, src in pieces)
    total = sum(runtime.nbytes(t.upload) for t in unit.binding.tensors)
    assert sum(runtime.nbytes(src) for _, src in pieces) == total  # every byte once
    largest_group = max(sum(runtime.nbytes(src) for _, src in group) for group in prefetch.pending)
    assert largest_group <= total / 4 + 4096  # balanced: largest first into the lightest group
    before = link.bytes_up
    prefetch.advance()  # what one activation copy may wait behind
    assert 0 < link.bytes_up - before <= largest_group
    uploaded = prefetch.finish()
    assert link.bytes_up - before == total
    for t, copy_ in zip(unit.binding.tensors, uploaded.copies[0]):
        assert torch.equal(copy_, t.upload)


def test_the_loop_starts_each_next_step_early_except_before_a_checkpoint_and_the_end(tmp_path, tiny_model_dir):
    """train.fit with async roundpipe: every step but a checkpoint's and the last hands the engine
    the next step's batches, and weights and logged losses equal a run that never does (fp32, to
    1e-6: a wrong weight version is off by about the learning rate, 1e-2)."""
    from test_train import fit_with_and_without_early_starts

    settings = {"engine": "roundpipe", "method": "full", "roundpipe.workers": 2, "roundpipe.optimizer": "async",
                "train.steps": 6, "train.save_every": 3, "train.eval_every": 0, "train.lr": 0.01}
    found = fit_with_and_without_early_starts(tmp_path, tiny_model_dir, settings)
    assert found[True][0] == [True, True, False, True, True, False] and not any(found[False][0])
    assert found[True][2] == pytest.approx(found[False][2], abs=1e-6, rel=0) and len(found[True][2]) == 6
    for name, value in found[False][1].items():  # fp32: rounding, see same_run
        torch.testing.assert_close(found[True][1][name], value, atol=1e-6, rtol=0, msg=name)


def test_the_step_after_next_starts_before_the_whole_update_is_done(models):
    """async: the AdamW goes unit by unit in the order a step first reads them (the embedding table,
    then the layers), and each unit's weight copy for the step after next is taken once its own
    update is done: held back, the head's first update waits until step 2's first job has begun,
    which a step waiting for the whole update could not do (it would time out)."""
    cfg = run_cfg(RoundPipeConfig(workers=3, micro_batches=2, optimizer="async", replan=False))
    straight = run(RoundPipeEngine, models["untied"], cfg, steps=4)
    firsts, waited, begun = [], [], threading.Condition()

    def count_first_jobs(worker, job, m):
        if job.index == 0 and m == 0:
            with begun:
                firsts.append(job)
                begun.notify_all()

    def hold_the_head(engine: RoundPipeEngine) -> None:
        head, update = engine.units[-1], engine.units[-1].update

        def held(*args, **kwargs):
            if not waited:  # update 0 of the head: steps 0 and 1 compute at W0, step 2 at W1
                with begun:
                    waited.append(begun.wait_for(lambda: len(firsts) >= 3, 5.0))
            update(*args, **kwargs)

        head.update = held
        for worker in engine.workers:
            worker.delay = count_first_jobs

    found = run_early(models["untied"], cfg, 4, setup=hold_the_head)
    assert waited == [True]
    same_run(found, straight)


def test_the_stage_cap_is_the_smallest_free_card_memory_shared_by_the_workers_on_a_card(monkeypatch):
    """memory_fraction of the smallest free card memory, halved (a stage and the one prefetched), split between
    the workers sharing a card; nothing off CUDA. torch.cuda stood in for: this machine has no card."""
    from types import SimpleNamespace

    free = {0: 10 << 30, 1: 8 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[d.index], 80 << 30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cards = [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)]
    engine = SimpleNamespace(devices=cards, section=RoundPipeConfig(memory_fraction=0.6))
    assert RoundPipeEngine._stage_cap(engine) == int(0.6 * (8 << 30) / 2 / 2)  # two workers on card 0
    engine.devices = [CPU, CPU]
    assert RoundPipeEngine._stage_cap(engine) is None
