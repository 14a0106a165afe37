"""The training loop, one for every engine: build the run in its fixed order, then step,
log, evaluate, checkpoint, and write the result.

Under torchrun (dist/ranks.py) every rank runs this loop on its own share of each step: the step's
grad_accum x world_size micro-batches come from one seeded stream every rank reads alike, and rank r
trains micro-batches r, r + world_size, ... (the global batch is batch_size x grad_accum x
world_size rows); each engine divides by the step's trained-token count over all ranks and sums its
gradients across them. Rank 0 alone inspects and claims the folder, plans, logs, writes checkpoints
(sharded state: every rank its shards) and the result; what it decides the others follow
(`_on_rank0`), and a failure on rank 0 ends every rank with rank 0's sentence."""

from __future__ import annotations

import contextlib
import dataclasses

import functools
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from slimtune import assembly, engines, export, presets
from slimtune.store import checkpoint
from slimtune.data import dataset as data
from slimtune.dist import ranks as distributed
from slimtune.run import interrupts
from slimtune.planning import planner
from slimtune.planning.weighing import Weighing
from slimtune.progress import is_terminal, large_folder, mode_for
from slimtune.config import RunConfig, to_dict
from slimtune.engines.base import Engine
from slimtune.errors import UserError
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.run.metrics import MetricsLog, RankLog, check_trackers, format_table
from slimtune.units import human_bytes
from slimtune.model import hub
from slimtune.model.stack import Stack, load_tokenizer, read_config
from slimtune.run.resume_settings import changes as settings_changes, refuse
from slimtune.run.step_lines import StepLines
from slimtune.run.folder import RunFolder


@dataclass
class Run:
    """A built run: everything the loop needs, in build order."""

    cfg: RunConfig
    device: torch.device
    precision: str
    tokenizer: object
    stack: Stack
    splits: data.Splits
    engine: Engine
    dist: Dist = dataclasses.field(default_factory=lambda: SINGLE)  # its ranks (torchrun); SINGLE: this process

    @property
    def devices(self) -> list[torch.device]:
        """Every device the run computes on (several where the engine has several workers)."""
        return list(self.engine.devices)

    def trainable_count(self) -> int:
        """Trained weights, as the engine counts them (Engine.trained_numel)."""
        return self.engine.trained_numel()

    @functools.cached_property
    def eval_batches(self) -> list[data.Batch]:
        """The evaluation split as batches (train.eval_batches of them when set), made once."""
        d, t = self.cfg.data, self.cfg.train
        batches = data.eval_batches(self.splits.eval, t.batch_size, d.max_length, d.packing,
                                    self.tokenizer.pad_token_id)
        return batches[: t.eval_batches] if t.eval_batches else batches


def _machine(cfg: RunConfig, gpu: presets.GpuProfile, dist: Dist = SINGLE) -> planner.Machine:
    """The card to plan for, with this machine's RAM and the free disk where the run writes; under
    torchrun as many cards and machines as the job has (its ranks share a machine's RAM)."""
    folder = Path(cfg.output_dir).absolute()
    while not folder.exists():
        folder = folder.parent
    return planner.Machine(gpu, presets.physical_ram_bytes(), shutil.disk_usage(folder).free,
                           cards=dist.local_world_size if dist.active else 1, nodes=dist.nodes if dist.active else 1,
                           rank_per_card=dist.active)


def _weighing(who: str, bar: bool) -> Weighing:
    """What planning before training shows (rank 0 plans): the bar where the run shows one on a
    terminal, else a line."""
    return Weighing(who, bar=bar and is_terminal(sys.stderr))


def _auto_plan(cfg: RunConfig, device: torch.device, dist: Dist = SINGLE, bar: bool = False) -> RunConfig:
    """plan=auto: the planner's recommended engine and options for the run's card (and its ranks)."""
    gpu = presets.gpu_profile(cfg.gpu) if cfg.gpu else presets.device_profile(device)
    planned, chosen = planner.apply_recommended(cfg, presets.model_config(cfg.model), _machine(cfg, gpu, dist),
                                                _weighing(f"plan=auto on {gpu.name}", bar))
    # On the CPU, or a card not in the presets, the plans are ranked by a generic card's rates
    # (presets.device_profile): no speed is printed as this device's.
    speed = (f"ranked by {presets.GENERIC_RATES_FROM}'s rates, {gpu.name}'s own speed not modelled"
             if gpu.generic_rates else f"{chosen.tokens_per_s:,.0f} tokens/s modelled")
    print(f"plan=auto on {gpu.name}: {chosen.engine} {chosen.label} "
          f"(device peak {human_bytes(chosen.estimate.device_peak_bytes)}, measured on fake tensors; {speed})")
    return planned


def _settle_open(cfg: RunConfig, device: torch.device, dist: Dist = SINGLE, bar: bool = False) -> RunConfig:
    """Settings the run left to the planner (EngineSpec.open_settings): the engine's first candidate
    that fits the run's card."""
    candidates = engines.get(cfg.engine).open_settings(cfg)
    if not candidates:
        return cfg
    gpu = presets.gpu_profile(cfg.gpu) if cfg.gpu else presets.device_profile(device)
    open_keys = ", ".join(sorted({key for candidate in candidates for key in candidate}))
    settled, chosen = planner.first_fitting(presets.model_config(cfg.model), cfg, candidates, _machine(cfg, gpu, dist),
                                            _weighing(f"settling {open_keys} for {gpu.name}", bar))
    print(f"settled for {gpu.name}: {chosen.label} (device peak {human_bytes(chosen.estimate.device_peak_bytes)},"
          " measured on fake tensors)")
    return settled


def build(cfg: RunConfig, dist: Dist = SINGLE, bar: bool = False) -> Run:
    """Device, plan, precision, tokenizer and data, then the model and engine (assembly.py). Under
    torchrun rank 0 plans and every rank takes its plan (their RAM and disk may differ)."""
    cfg = hub.resolved(cfg)  # fit resolved it already; a caller of build alone may give a Hub name
    device = assembly.resolve_device(cfg.device, dist)

    def planned() -> RunConfig:
        settled = _auto_plan(cfg, device, dist, bar) if cfg.plan == "auto" else cfg
        return _settle_open(settled, device, dist, bar)

    cfg = _on_rank0(dist, planned, "the plan")
    precision = assembly.resolve_precision(cfg.precision, device)
    torch.manual_seed(cfg.train.seed)
    read_config(cfg.model)  # a wrong folder is named before anything else is read
    tokenizer = load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data, tokenizer, cfg.train.seed, mode_for(bar, dist.is_main))
    if not splits.train:
        raise UserError(f"data.path '{cfg.data.path}' gives no training examples after tokenization.")
    stack = assembly.load_stack(cfg, device, precision, dist)
    engine = assembly.assemble(cfg, stack, device, precision, dist)
    wanted = engines.get(cfg.engine).sample_examples(cfg)
    if wanted:
        sample, splits = engine_sample(cfg, splits, tokenizer, wanted)
        if sample:
            engine.use_sample(sample)
    return Run(cfg, device, precision, tokenizer, stack, splits, engine, dist)


def _on_rank0(dist: Dist, work, what: str):
    """`work()` done on rank 0 and its result handed to every rank; an error there (a sentence) is
    raised on every rank (distributed.Echo on the others: rank 0 alone says it)."""
    if not dist.active:
        return work()
    outcome = None
    if dist.is_main:
        try:
            outcome = ("done", work())
        except BaseException as err:
            # Said here, before the others learn of it and end (torchrun then stops this rank too).
            distributed.say_error(err)
            dist.broadcast_object(("failed", str(err) or type(err).__name__), what)
            raise
    kind, value = dist.broadcast_object(outcome, what)
    if kind == "failed":
        raise distributed.Echo(value)
    return value


def engine_sample(cfg: RunConfig, splits: data.Splits, tokenizer, count: int) -> tuple[list[data.Batch], data.Splits]:
    """`count` training examples drawn once (seeded by train.seed, apart from the data order) and held
    out of training, as batches of train.batch_size: an engine's own fixed sample (lsp fits and
    checks its projectors on it); and the splits without them. At least one example stays to train on."""
    count = min(count, len(splits.train) - 1)
    if count <= 0:
        return [], splits
    picked = set(random.Random(cfg.train.seed).sample(range(len(splits.train)), count))
    chosen = [e for i, e in enumerate(splits.train) if i in picked]
    rest = [e for i, e in enumerate(splits.train) if i not in picked]
    d = cfg.data
    batches = data.eval_batches(chosen, cfg.train.batch_size, d.max_length, d.packing, tokenizer.pad_token_id)
    report = dataclasses.replace(splits.report, engine_sample=len(chosen))
    return batches, dataclasses.replace(splits, train=rest, report=report)


def batch_stream(run: Run) -> data.BatchStream:
    """The run's training batches, from the start of its data (resume moves it on)."""
    d = run.cfg.data
    return data.BatchStream(
        run.splits.train, run.cfg.train.batch_size, d.max_length, d.packing, run.tokenizer.pad_token_id,
        run.cfg.train.seed, run.dist.world_size,
    )


def evaluate(run: Run, batches: list[data.Batch]) -> dict:
    """Exact loss and perplexity over `batches`, shared out across ranks (evaluate_sums)."""
    if not batches:
        return {}
    sharded = run.cfg.dist.strategy == "fsdp" and run.dist.active
    loss_sum, tokens = evaluate_sums(run.engine, batches, run.dist, sharded)
    loss = loss_sum / max(tokens, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def evaluate_sums(engine, batches: list[data.Batch], dist, sharded: bool) -> tuple[float, int]:
    """(summed loss, tokens) over `batches`, each rank a share (Dist.shard), the sums summed across
    ranks. `sharded` (fsdp): a sharded forward is a collective, so a rank whose share is one short
    runs its first batch again, uncounted, and every rank runs as many forwards."""
    mine = dist.shard(batches)
    loss_sum, tokens = engine.evaluate(mine) if mine else (0.0, 0)
    if sharded and len(mine) < -(-len(batches) // dist.world_size):
        engine.evaluate(batches[:1])
    if dist.active:
        loss_sum, tokens = dist.sum_floats([loss_sum, tokens], "the evaluation's sums")
    return loss_sum, int(tokens)


def resume(run: Run, stream: data.BatchStream, say=print) -> int:
    """Restore the newest intact checkpoint of the run's output_dir (train.resume): the engine's state,
    the data stream's position and every RNG; damaged newer ones are named (`say`) and passed over.
    Returns the step it was written after (0: none)."""
    if not run.cfg.train.resume:
        return 0
    found = _on_rank0(run.dist, lambda: _intact_checkpoint(run, say), "the checkpoint to resume from")
    if found is None:
        return 0
    found = Path(found)
    if not (found / "meta.json").is_file():  # rank 0 sees it: this rank is on another filesystem
        raise UserError(f"rank {run.dist.rank} cannot read checkpoint '{found}', which rank 0 resumes from: under"
                        " torchrun on several machines output_dir must be on a filesystem every node shares.")
    if run.dist.is_main:  # every rank reads it; one says so
        large_folder("reading", found, checkpoint.written_bytes(found))
    step, engine_state, stream_state, rng = checkpoint.load(found, run.engine.state_dict)
    try:
        stream.load_state_dict(stream_state)
        run.engine.load_state_dict(engine_state)
    except UserError as err:
        raise UserError(f"cannot resume from '{found}': {err}") from None
    checkpoint.set_process_rng_state(rng)
    return step


def _intact_checkpoint(run: Run, say) -> str | None:
    """The newest intact checkpoint's folder (None: none yet); damaged newer ones are named."""
    found, damaged = checkpoint.latest_intact(Path(run.cfg.output_dir))
    if damaged and found is None:
        raise UserError(f"{'; '.join(damaged)}: no intact checkpoint is left to resume from; start afresh with"
                        " train.overwrite=true or another output_dir.")
    for reason in damaged:
        say(f"{reason}; resuming from '{found}' instead")
    return None if found is None else str(found)


def _record(step: int, result, seconds: float) -> dict:
    return {
        "step": step,
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens": result.tokens,
        "seen_tokens": result.seen_tokens,
        "tokens_per_s": result.seen_tokens / max(seconds, 1e-9),
        "device_peak_bytes": result.device_peak_bytes,
        "host_link_bytes": result.host_link_bytes,
        "step_s": seconds,
        **result.extras,
    }


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def fit(cfg: RunConfig, progress: bool = True, run: Run | None = None) -> tuple[Run, dict]:
    """Train `cfg` to its last step (resuming when a checkpoint exists); returns the run and its summary.
    The run folder is inspected before anything loads and held (locked) until the end (run/folder.py).
    Under torchrun (distributed.launched) every rank calls it; the summary is rank 0's to print."""
    owned = run is None and distributed.launched()
    cfg = hub.resolved(cfg)  # a Hub name becomes its snapshot folder (each machine fetches its own) before all else
    dist = run.dist if run is not None else distributed.from_env(cfg.dist.timeout_s, on_cuda=cfg.device != "cpu")
    fitted = _fit(cfg, progress and dist.is_main, run, dist)
    if owned:  # after a failure the group may be broken: the process ends without tearing it down (cli)
        dist.close()
    return fitted


def _fit(cfg: RunConfig, progress: bool, run: Run | None, dist: Dist) -> tuple[Run, dict]:
    from tqdm.auto import tqdm

    say = tqdm.write if progress else (print if dist.is_main else _silent)
    with RunFolder(cfg) if dist.is_main else contextlib.nullcontext() as folder:
        _on_rank0(dist, lambda: _check_before_loading(folder, cfg), "the run folder's check")
        run = run or build(cfg, dist, bar=progress)
        run.engine.progress, run.engine.notes = progress, dist.is_main
        out = Path(run.cfg.output_dir)
        stream, start = _begin(run, folder, say)
        if start >= run.cfg.train.steps:
            say(f"nothing to train: output_dir '{run.cfg.output_dir}' holds this run trained to step {start} of"
                f" {run.cfg.train.steps} already; raise train.steps to go on.")
        log = _open_log(run, folder, start)
        # A log file or pipe gets a refresh every 30 s instead of every step; no bar (--no-progress), a line as often.
        bar = tqdm(total=run.cfg.train.steps, initial=start, unit="step", dynamic_ncols=True,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0) if progress else \
            StepLines(run.cfg.train.steps, start, say)
        began, skips, drawn, peak = time.perf_counter(), Skips(), DrawnBatches(stream), LoggedPeak()
        try:
            for step in range(start + 1, run.cfg.train.steps + 1):
                _train_step(run, step, drawn, log, bar, skips, peak)
                interrupts.check()  # a Ctrl-C that a finalizer swallowed during the step stops the run here
        except BaseException as err:
            log.close(failed=True)  # the W&B and MLflow runs are marked failed
            if folder is not None:  # stopped before its first checkpoint: nothing to continue, so a retry may
                folder.withdraw()  # change any setting (its metrics stay until then)
            if isinstance(err, distributed.PeerFailed):
                raise distributed.PeerFailed(f"{err} {_last_checkpoint_sentence(run)}") from None
            if isinstance(err, KeyboardInterrupt):
                raise interrupts.Interrupted(_last_checkpoint_sentence(run), interrupts.signum_of(err)) from None
            raise
        finally:
            bar.close()
            log.close()
        trained_to = max(start, run.cfg.train.steps)  # a run with nothing to train holds its checkpoint's step
        kept = _on_rank0(dist, lambda: _result_of(folder, trained_to, out), "the result's check")
        result_dir = out / kept if kept else export.save_result(run, out)
        if dist.is_main and not kept:
            folder.finished(trained_to, result_dir)
    summary = _summary(run, log, time.perf_counter() - began, start, result_dir)
    if dist.is_main:
        log.plot(out / "metrics.png")
    return run, summary


def _result_of(folder: RunFolder, step: int, out: Path) -> str | None:
    """The result folder's name when the folder's record says it already holds the weights of `step`
    (a finished run run again: nothing is exported again, gigabytes for a full fine-tune); else None."""
    result = (folder.record or {}).get("result") or {}
    return result["path"] if result.get("step") == step and (out / str(result.get("path"))).is_dir() else None


def _check_before_loading(folder: RunFolder, cfg: RunConfig) -> None:
    """The folder may take this run, and a wanted wandb or mlflow is installed: said before the
    model loads."""
    folder.inspect()
    check_trackers(cfg.log)


def _silent(*args, **kwargs) -> None:
    del args, kwargs


def _open_log(run: Run, folder: RunFolder | None, start: int) -> MetricsLog | RankLog:
    """Rank 0's metrics.jsonl, starting W&B and MLflow (log.*). A tracker that cannot start ends the
    run before its first step; a run without a checkpoint is then forgotten again (run.json), so a
    retry with other settings is not held to this start's (run_folder.withdraw)."""
    if not run.dist.is_main:
        return RankLog()
    try:
        return MetricsLog(Path(run.cfg.output_dir), start, run.cfg)
    except BaseException:  # a UserError, or Ctrl-C while a tracker connects
        folder.withdraw()
        raise


def _last_checkpoint_sentence(run: Run) -> str:
    """Where the same command would go on from: the newest checkpoint (named, not read: checking its files
    would read them all, gigabytes, before a Ctrl-C ends; the resume checks them), or the start."""
    latest = checkpoint.latest(Path(run.cfg.output_dir))
    if latest:
        return f"The last checkpoint is '{latest}'; resume with the same command."
    every = run.cfg.train.save_every
    when = "train.save_every=0 writes none before the end" if every <= 0 else f"the first is due at step {every}"
    return f"No checkpoint was written yet ({when}), so the same command starts over."


def _begin(run: Run, folder: RunFolder | None, say) -> tuple[data.BatchStream, int]:
    """Claim the folder, resume, say what changed since the run's last start, record the settings
    (the folder: rank 0's; the other ranks read the checkpoint once rank 0 has claimed it). A changed
    setting a checkpoint cannot take is refused before the claim: the folder stays as it was."""
    changed = _on_rank0(run.dist, lambda: _changed_settings(run, folder), "the resume's settings check")
    _on_rank0(run.dist, lambda: folder.claim(run.cfg, _resolved(run)), "the run folder's claim")
    stream = batch_stream(run)
    start = resume(run, stream, say)  # before config.yaml: a refused resume leaves the folder's settings as they were
    # A finished run run again trains nothing: its record keeps the settings its weights were trained
    # with, so that the next resume compares with them (not with an engine that never ran).
    if run.dist.is_main and start < run.cfg.train.steps:
        folder.settled(run.cfg, _resolved(run))
        if start and changed:
            say(f"resuming with changed settings: {', '.join(changed)}")
        checkpoint.atomic_write_text(Path(run.cfg.output_dir) / "config.yaml",
                                     yaml.safe_dump(to_dict(run.cfg), sort_keys=False))
    ranks = f" on {run.dist.world_size} ranks" if run.dist.active else ""
    say(f"data: {run.splits.report.summary()}{ranks}" + (f"; resuming after step {start}" if start else ""))
    return stream, start


def _resolved(run: Run) -> dict[str, str]:
    """What the run's auto settings resolved to on this machine, as run.json records it."""
    return {"device": run.device.type, "precision": run.precision}


def _changed_settings(run: Run, folder: RunFolder) -> list[str]:
    """The settings changed since the run's last start, each said with what resuming does about it
    (resume_settings.py); one a checkpoint cannot take is refused. Nothing when no checkpoint is resumed."""
    cfg, before = run.cfg, (folder.record or {}).get("settings")
    resumes = cfg.train.resume and not cfg.train.overwrite
    if before is None or not resumes or not checkpoint.list_checkpoints(Path(cfg.output_dir) / "checkpoints"):
        return []
    found = settings_changes(before, cfg, folder.record.get("resolved"), _resolved(run))
    refuse(found, cfg.output_dir)
    return [change.text() for change in found]


@dataclass
class Skips:
    """Steps whose update was left out because their loss or gradient norm was not finite."""

    in_a_row: int = 0
    total: int = 0

    def note(self, applied: bool) -> None:
        self.in_a_row = 0 if applied else self.in_a_row + 1
        self.total += not applied


@dataclass
class LoggedPeak:
    """The largest device peak of the steps since the last logged row: with train.log_every > 1 a row
    stands for several steps, and carries their largest peak (the summary's is the largest row's)."""

    largest: int | None = None

    def note(self, peak: int | None) -> int | None:
        """The largest so far, this step's included."""
        if peak is not None:
            self.largest = peak if self.largest is None else max(self.largest, peak)
        return self.largest

    def logged(self) -> None:
        self.largest = None


class DrawnBatches:
    """The stream's batches step by step. For an engine that starts a step before the one before it
    ends (`starts_ahead`: roundpipe's async optimizer), the next step's are drawn one step early,
    never across a step whose checkpoint or evaluation must see the stream and weights as they are."""

    def __init__(self, stream: data.BatchStream):
        self.stream, self._early = stream, None

    def take(self, count: int) -> list[data.Batch]:
        found, self._early = self._early, None
        return found if found is not None else [self.stream.next_batch() for _ in range(count)]

    def draw_early(self, count: int) -> list[data.Batch]:
        self._early = [self.stream.next_batch() for _ in range(count)]
        return self._early


def _next_starts_early(run: Run, step: int) -> bool:
    """Whether step `step` hands the engine the next step's batches: the engine can use them, and
    after this step no checkpoint, evaluation or end reads the engine (one process: under torchrun
    the ranks' sums would have to be ordered across two steps)."""
    t = run.cfg.train
    return (run.engine.starts_ahead and not run.dist.active and step < t.steps
            and not _due(step, t.eval_every, t.steps) and not _due(step, t.save_every, t.steps))


def _train_step(run: Run, step: int, drawn: DrawnBatches, log: MetricsLog, bar, skips: Skips,
                peak: LoggedPeak) -> None:
    """One optimizer step, then what is due after it: evaluation, the log, a checkpoint. A step that
    could not update (non-finite) is logged, then ends the run or is skipped (train.on_nonfinite)."""
    t, dist = run.cfg.train, run.dist
    count = t.grad_accum * dist.world_size
    step_batches = drawn.take(count)
    # Under torchrun: this rank's share, and the divisor of the whole step (every rank's targets).
    micro_batches = dist.shard(step_batches)
    total_targets = sum(b.num_targets for b in step_batches) if dist.active else None
    then = (drawn.draw_early(count), None) if _next_starts_early(run, step) else None
    tick = time.perf_counter()
    try:
        result = combine_ranks(dist, step, run.engine.step(micro_batches, total_targets, then=then))
    except torch.OutOfMemoryError:
        raise UserError(out_of_memory_advice(run, step)) from None
    skips.note(result.applied)
    record = {**_record(step, result, time.perf_counter() - tick), "skipped_updates": skips.total,
              "device_peak_bytes": peak.note(result.device_peak_bytes)}
    if dist.active:
        record["allreduce_bytes"] = dist.take_reduced_bytes()  # this rank's payload, the step's own sums
    evaluated = _due(step, t.eval_every, t.steps)
    if evaluated:
        try:
            with _named_while_running(bar, f"evaluating after step {step}"):
                record.update(evaluate(run, run.eval_batches))
        except torch.OutOfMemoryError:
            raise UserError(out_of_memory_advice(run, step, "evaluating after")) from None
    if _due(step, t.log_every, t.steps) or evaluated or not result.applied:  # an evaluation is always logged
        log.log(record)
        peak.logged()
    if not result.applied:
        _refuse_nonfinite(run, step, result, skips)
    if _due(step, t.save_every, t.steps):
        with _named_while_running(bar, f"saving step {step}"):
            checkpoint.save(Path(run.cfg.output_dir), step, run.engine.state_dict(), drawn.stream.state_dict(),
                            t.keep_last, dist)
    bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False,
                    mem=_peak_text(result.device_peak_bytes))
    bar.update(1)


@contextlib.contextmanager
def _named_while_running(bar, doing: str):
    """What runs between two steps (an evaluation; a checkpoint's save, minutes for a full fine-tune's
    state) named while it runs, where the progress would otherwise sit still with no word: on a terminal
    by the bar; with --no-progress by a line once it outlasts the lines' rhythm (StepLines.running). A
    bar in a file is left as it is (tqdm writes it every 30 s)."""
    if isinstance(bar, StepLines):
        with bar.running(doing):
            yield
        return
    named = hasattr(bar, "set_description_str") and is_terminal(sys.stderr)
    if named:
        bar.set_description_str(doing, refresh=True)
    try:
        yield
    finally:
        if named:
            bar.set_description_str("", refresh=False)


def combine_ranks(dist: Dist, step: int, result):
    """A rank's StepResult as the whole job's: loss (each rank's is its own sum over the global
    divisor), tokens and link bytes summed; device, host and disk peaks the largest rank's."""
    if not dist.active:
        return result
    loss, tokens, seen, link, skipped = dist.sum_floats(
        [result.loss, result.tokens, result.seen_tokens, result.host_link_bytes, not result.applied], "the step's sums")
    peak, host, disk = dist.max_floats(
        [-1 if result.device_peak_bytes is None else result.device_peak_bytes, result.host_peak_bytes,
         result.disk_peak_bytes], "the step's peaks")
    if 0 < skipped < dist.world_size:  # their gradients are one sum: only a non-finite loss alone can part them
        raise UserError(f"step {step}: {int(skipped)} of {dist.world_size} ranks found their loss not finite while the"
                        " summed gradients were, so the ranks' weights would part; the run stops. Lower train.lr or"
                        " raise train.warmup_steps.")
    return dataclasses.replace(result, loss=loss, tokens=int(tokens), seen_tokens=int(seen), host_link_bytes=int(link),
                               device_peak_bytes=None if peak < 0 else int(peak), host_peak_bytes=int(host),
                               disk_peak_bytes=int(disk), applied=skipped == 0)


def _refuse_nonfinite(run: Run, step: int, result, skips: Skips) -> None:
    """train.on_nonfinite=stop, or skip past its patience: the run ends, naming the last good checkpoint."""
    t = run.cfg.train
    if t.on_nonfinite == "skip" and skips.in_a_row < t.nonfinite_patience:
        return
    latest, _ = checkpoint.latest_intact(Path(run.cfg.output_dir))
    resume_from = f"the last good checkpoint is '{latest}'" if latest else "no checkpoint was written yet"
    if t.on_nonfinite == "skip":
        streak, option = f" ({skips.in_a_row} steps in a row)", "raise train.nonfinite_patience"
    else:
        streak, option = "", "set train.on_nonfinite=skip to go past such steps"
    raise UserError(
        f"step {step}: the loss ({result.loss}) or gradient norm ({result.grad_norm}) is not finite{streak}, so no "
        f"update was applied and the run stopped; {resume_from}. Lower train.lr or raise train.warmup_steps, or "
        f"{option}.")


def out_of_memory_advice(run: Run, step: int, when: str = "at") -> str:
    """One sentence for a step (or the evaluation after it) that ran out of device memory, naming a plan
    that fits this card, or saying that the run's plan is the one the planner picks."""
    cfg = run.cfg
    gpu = presets.device_profile(run.device)
    machine = _machine(cfg, gpu)
    # A bar (wiped when done) and never lines, so that what is printed here stays one sentence.
    looking = Weighing(f"out of device memory: a plan for {gpu.name}", bar=True,
                       show=run.dist.is_main and is_terminal(sys.stderr))
    results, chosen = planner.plan_run(cfg, presets.model_config(cfg.model), machine, looking)
    where = f"out of device memory {when} step {step} with engine={cfg.engine} precision={run.precision}"
    if chosen is None:
        return f"{where}, and {planner.no_fit_sentence(results, machine)}"
    peak = f"device peak {human_bytes(chosen.estimate.device_peak_bytes)} on fake tensors"
    options = " ".join(f"{k}={v}" for k, v in chosen.options.items())
    if planner.is_the_plan(cfg, chosen):
        return (f"{where}, the plan the planner picks for {human_bytes(gpu.memory_bytes)} ({options}, {peak}): the card "
                f"had less free than planned (another process on it, or the allocator's fragmentation); lower "
                f"train.batch_size or data.max_length.")
    return (f"{where}; a plan that fits {human_bytes(gpu.memory_bytes)}: engine={chosen.engine} {options} "
            f"({peak}), or train with plan=auto.")



def _peak_text(peak: int | None) -> str:
    return "not measured" if peak is None else human_bytes(peak)


def _steady_tokens_per_s(records: list[dict]) -> float:
    """Total tokens over total step time, leaving out the first (warm-up) step when there are others."""
    steady = records[1:] if len(records) > 1 else records
    seconds = sum(r["step_s"] for r in steady)
    return sum(r["seen_tokens"] for r in steady) / seconds if seconds > 0 else 0.0


def _summary(run: Run, log: MetricsLog, seconds: float, start: int, result_dir: Path) -> dict:
    done = [r for r in log.records if r["step"] > start]
    evals = [r for r in log.records if "eval_loss" in r]
    return {
        "steps": run.cfg.train.steps,
        "resumed_from": start,
        "seconds": seconds,
        "final_loss": log.records[-1]["loss"] if log.records else float("nan"),
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_ppl": evals[-1]["eval_ppl"] if evals else None,
        "tokens_per_s": _steady_tokens_per_s(done),
        "device_peak_bytes": max((r["device_peak_bytes"] for r in done if r["device_peak_bytes"] is not None),
                                 default=None),
        "meter": run.engine.meter.kind,
        "devices": [str(d) for d in run.devices],
        "trainable_params": run.trainable_count(),
        "result": str(result_dir),
        "data": run.splits.report.summary(),
        "rank": run.dist.rank,
        "world_size": run.dist.world_size,
    }


def _devices_text(devices: list[str]) -> str:
    """'cuda:0' or 'cpu x 3 workers' or 'cuda:0, cuda:1 (2 workers)'."""
    if len(devices) <= 1:
        return devices[0] if devices else "?"
    if len(set(devices)) == 1:
        return f"{devices[0]} x {len(devices)} workers"
    return f"{', '.join(devices)} ({len(devices)} workers)"


def summary_table(summary: dict, extra: list[tuple[str, str]] = ()) -> str:
    """The run's figures, and `extra` rows (the demo's accuracies) aligned with them; a run that trained
    nothing (its steps were all done before) has no speed or peak to show, and says so instead of zeros."""
    idle = summary["resumed_from"] >= summary["steps"]
    steps = (f"{summary['resumed_from']} (all taken before this run)" if idle else
             f"{summary['steps']} (resumed from {summary['resumed_from']})" if summary["resumed_from"] else
             str(summary["steps"]))
    rows = [
        ("steps", steps),
        ("data", summary["data"]),
        ("trainable parameters", f"{summary['trainable_params']:,}"),
        ("final train loss", f"{summary['final_loss']:.4f}"),
    ]
    if summary["eval_loss"] is not None:
        rows.append(("eval loss / perplexity", f"{summary['eval_loss']:.4f} / {summary['eval_ppl']:.2f}"))
    if summary.get("world_size", 1) > 1:
        rows.append(("ranks", f"{summary['world_size']} (data parallel: torchrun)"))
    if not idle:
        rows += [
            ("tokens/s (after step 1)", f"{summary['tokens_per_s']:.0f}"),
            ("devices", _devices_text(summary.get("devices", []))),
            ("device peak" + (" (the largest worker's)" if len(summary.get("devices", [])) > 1 else ""),
             _peak_text(summary["device_peak_bytes"]) + (
                f" ({summary['meter']})" if summary["device_peak_bytes"] is not None else "")),
            ("wall time", f"{summary['seconds']:.1f} s"),
        ]
    rows.append(("result", summary["result"]))
    return format_table(rows + list(extra))
