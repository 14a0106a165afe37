"""The planner: every applicable plan (engine plus options), its measured-on-fake-tensors device
peak, host RAM and disk, its modelled speed, which fit the machine the user names, the longest
sequence each fits, and the one to run.

A plan is a set of RunConfig overrides. Each engine offers its own candidates and models its
own step time in its registration (engines.EngineSpec.plans, .step_time), so the planner names no
engine. The figures come from estimate.estimate (the estimate by depth: seconds for any preset).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass, field

import torch

from slimtune.model import config_json
from slimtune import engines, presets
from slimtune.engines import settings
from slimtune.dist import fake_ranks
from slimtune.planning import estimate, longest_seq, tile_choice, worker as planning_worker, rank_plan
from slimtune.device import speed
from slimtune.planning.estimate_cache import cached_estimate, is_cached
from slimtune.planning.weighing import Weighing, quiet
from slimtune.config import RunConfig, to_dict
from slimtune.errors import UserError
from slimtune.units import human_bytes

# CUDA context and allocator slack a process holds beyond its tensors (PLATFORM.md: 0.5-1 GiB).
# Assumed: benchmarks/cases/device_checks.py measures it on a GPU (context bytes beside this figure).
CUDA_OVERHEAD_BYTES = 768 * 2**20
# Host RAM a plan may hold for the device (masters, moments, offloaded activations): this share of
# the machine's RAM, checked beside the device (a plan the host cannot hold never fits).
HOST_RAM_SHARE = 0.9


@dataclass(frozen=True)
class Machine:
    """What a plan must fit: a card, the host's RAM and its free disk (defaults: this machine's)."""

    gpu: presets.GpuProfile
    ram_bytes: int  # the host's RAM; plans may hold HOST_RAM_SHARE of it
    disk_bytes: int  # free disk for scratch files (block inputs, memory-mapped moments)
    cards: int = 1  # cards of that kind per machine: an engine that uses several is weighed on all (EngineSpec.on_cards)
    nodes: int = 1  # machines alike, trained together with data parallelism (torchrun; rank_plan.py)
    # True under a running torchrun job that has a rank per card: an engine spanning a machine's
    # cards (EngineSpec.uses_cards) cannot be chosen for it.
    rank_per_card: bool = False

    @classmethod
    def named(cls, gpu: str, host_ram: str | None = None, disk: str | None = None, folder: str = ".",
              cards: int = 1, nodes: int = 1) -> Machine:
        """`gpu` as presets.gpu_profile reads it; sizes such as 64GiB; unset: this machine's RAM and
        the free disk under `folder` (RAM and disk are each machine's)."""
        if cards < 1:
            raise UserError(f"--gpus-per-node must be at least 1, got {cards}.")
        if nodes < 1:
            raise UserError(f"--nodes must be at least 1, got {nodes}.")
        ram = presets.memory_size(host_ram, "--host-ram") if host_ram else presets.physical_ram_bytes()
        free = presets.disk_size(disk, "--disk") if disk else shutil.disk_usage(folder).free
        return cls(presets.gpu_profile(gpu), ram, free, cards, nodes)

    def refuse_unloadable(self, model_config) -> None:
        """A plain bound, said before anything is weighed: every engine loads the weights whole, in 16
        bits at least (a 4-bit base is quantized after), into the host's RAM or onto one card, so a
        model larger than both cannot run here whatever the plan (nor be planned block by block)."""
        weights = config_json.parameter_count(model_config)
        need, room = weights * config_json.BYTES_16BIT, max(self.ram_bytes, self.gpu.memory_bytes)
        if need > room:
            raise UserError(f"the model has {weights:,} weights or more, {config_json.gib(need)} in 16 bits, more than"
                            f" the host's RAM ({config_json.gib(self.ram_bytes)}) or the card"
                            f" ({config_json.gib(self.gpu.memory_bytes)}) holds; every engine loads the weights whole"
                            " into one of them.")

    def ranks(self, engine: str) -> int:
        """Processes a plan of `engine` runs as on this machine set (one per card, or per machine)."""
        return rank_plan.ranks(engines.get(engine).uses_cards, self.nodes, self.cards)

    def describe(self) -> str:
        cards = f"{self.cards} x " if self.cards > 1 else ""
        nodes = f"{self.nodes} machines, each " if self.nodes > 1 else ""
        return (f"{nodes}{cards}{self.gpu.name} ({human_bytes(self.gpu.memory_bytes)}), {human_bytes(self.ram_bytes)}"
                f" host RAM, {human_bytes(self.disk_bytes)} free disk")

    def needs(self, found: estimate.Estimate, ranks: int = 1) -> dict[str, tuple[int, int]]:
        """What a plan needs of each resource and what there is: {"device" | "host RAM" | "disk":
        (needed, available)}. `ranks`: processes of the job; those on one machine share its RAM and disk."""
        here = max(ranks // self.nodes, 1)
        return {"device": (found.device_peak_bytes + CUDA_OVERHEAD_BYTES, self.gpu.memory_bytes),
                "host RAM": (found.host_bytes * here, int(HOST_RAM_SHARE * self.ram_bytes)),
                "disk": (found.disk_bytes * here, self.disk_bytes)}

    def shortfalls(self, found: estimate.Estimate, ranks: int = 1) -> dict[str, tuple[int, int]]:
        """What a plan lacks: the needs that exceed what there is, empty when it fits."""
        return {what: (need, have) for what, (need, have) in self.needs(found, ranks).items() if need > have}


@dataclass
class PlanResult:
    engine: str
    options: dict
    estimate: estimate.Estimate
    time: speed.StepTime
    tokens_per_s: float
    short: dict[str, tuple[int, int]] = field(default_factory=dict)  # Machine.shortfalls
    recommended: bool = False
    max_seq: int | None = None  # --max-seq: the longest sequence that fits (0: none)
    max_seq_tile: int | None = None  # the sequence tile it was found with (None: the plan's own blocks)
    max_seq_limit: int | None = None  # the longest --max-seq weighed (LIMIT, else the model's positions)
    ranks: int = 1  # processes under data parallelism (Machine.ranks); the figures are per device
    sync_s: float = 0.0  # modelled seconds a step spends summing gradients across ranks
    derived: bool = False  # the device figures are derived from the measurement by a formula (fsdp)
    sharded: bool = False  # fsdp on several ranks: the figures are rank 0's sharded step (fake_ranks)

    @property
    def fits(self) -> bool:
        return not self.short

    @property
    def host_fits(self) -> bool:
        return "host RAM" not in self.short

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options.items())

    def as_json(self) -> dict:
        e = self.estimate
        out = {
            "engine": self.engine,
            "options": self.options,
            "device_peak_bytes": e.device_peak_bytes,
            "device_peak_kind": ("derived: one device's measurement on fake tensors, every weight's state divided"
                                 " by the ranks (rank_plan.sharded)") if self.derived
                                else "measured on fake tensors (training meter)",
            "ranks": self.ranks,
            "allreduce_bytes": e.allreduce_bytes,
            "allreduce_bytes_kind": "derived (rank_plan.sharded)" if self.derived
                                    else "formula (rank_plan.fsdp_payload)" if self.sharded
                                    else "counted on the fake step (distributed.Counting)",
            "breakdown_kind": "derived (rank_plan.sharded)" if self.derived else "measured on fake tensors",
            "sync_s_modelled": self.sync_s,
            "breakdown": e.breakdown,
            "host_bytes": e.host_bytes,
            "disk_bytes": e.disk_bytes,
            "host_link_bytes": e.host_link_bytes,
            "fits": self.fits,
            "host_fits": self.host_fits,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_kind": "modelled",
            "step_s_modelled": self.time.seconds,
            "step_parts_s_modelled": {"compute": self.time.compute_s, "optimizer": self.time.optimizer_s,
                                      "link": self.time.link_s},
            "trainable_params": e.trainable_params,
            "total_params": e.total_params,
            "recommended": self.recommended,
        }
        if self.max_seq is not None:
            out["max_seq"] = self.max_seq
            out["max_seq_tile"] = self.max_seq_tile
            out["max_seq_limit"] = self.max_seq_limit  # max_seq equal to it: fits there, longer not weighed
        return out


def warm_up(model: str | None) -> None:
    """A planning worker's first deed, while the command line's process imports the same: the code
    that reads `model`'s config and builds its modules (about two seconds, no longer paid by its first plan)."""
    if model is None:
        return
    model_config = presets.model_config(model)
    estimate.meta_model(estimate.at_depth(model_config, 1), torch.float32)


def _run_config(base: RunConfig, plan: dict) -> RunConfig:
    """`base` with the plan's dotted-key settings applied, validated like any run config (the planner's
    own settings: nothing for the user to be warned of)."""
    return settings.load(None, [f"{k}={v}" for k, v in plan.items()], base=to_dict(base), warn=lambda text: None)


def weigh(model_config, base: RunConfig, plan: dict, machine: Machine, batch_size: int, seq_len: int,
          max_seq: bool = False, seq_limit: int = 0) -> PlanResult:
    """One plan: its device peak, host RAM and disk on fake tensors, its modelled time on the card,
    what it lacks on `machine`, and (`max_seq`) the longest sequence that fits, up to `seq_limit`
    tokens (0: the model's positions). A plan whose blocks run in tiles and that does not fit the card
    with the auto rule's tile takes the largest of tile_choice.TILES that fits (its options say so)."""
    cfg = _run_config(base, plan)
    ranks = machine.ranks(cfg.engine)
    derived = fake_ranks.needed(cfg, ranks) and not fake_ranks.available()
    found = per_device_estimate(model_config, cfg, machine, batch_size, seq_len)
    tileable = not cfg.activations.tile and cfg.dist.strategy != "fsdp"  # fsdp's blocks run whole (whole_blocks)
    if "device" in machine.shortfalls(found, ranks) and tileable:
        plan, cfg, found = _tiled_to_fit(model_config, base, plan, machine, batch_size, seq_len, found)
    time = engines.get(cfg.engine).step_time(model_config, cfg, found.counts(), machine.gpu, batch_size, seq_len)
    tokens = batch_size * seq_len * cfg.train.grad_accum
    sync = rank_plan.sync_seconds(found.allreduce_bytes, ranks, machine.nodes, machine.gpu)
    options = {k: v for k, v in plan.items() if k != "engine"}
    result = PlanResult(plan["engine"], options, found, time, rank_plan.job_tokens_per_s(time, tokens, ranks, sync),
                        machine.shortfalls(found, ranks), ranks=ranks, sync_s=sync, derived=derived,
                        sharded=fake_ranks.needed(cfg, ranks))
    if max_seq:
        result.max_seq_limit = seq_limit_of(model_config, seq_limit)
        result.max_seq, result.max_seq_tile = _longest_with_tile(model_config, cfg, machine, batch_size, seq_len,
                                                                 result.max_seq_limit)
    return result


def seq_limit_of(model_config, limit: int = 0) -> int:
    """The longest sequence --max-seq weighs: `limit`, else the model's positions, else 2^20 tokens."""
    return limit or getattr(model_config, "max_position_embeddings", None) or 2**20


def _tiled_to_fit(model_config, base: RunConfig, plan: dict, machine: Machine, batch_size: int, seq_len: int,
                  found: estimate.Estimate) -> tuple[dict, RunConfig, estimate.Estimate]:
    """The plan with the largest of tile_choice.TILES that fits `machine`, its config and estimate; the
    plan as it was where none does (or its blocks are not tiled: every tile weighs the same)."""
    ranks, weighed = machine.ranks(plan["engine"]), {}

    def fits(tile: int) -> bool:
        cfg = _run_config(base, {**plan, "activations.seq_tile": tile})
        weighed[tile] = (cfg, per_device_estimate(model_config, cfg, machine, batch_size, seq_len))
        return not machine.shortfalls(weighed[tile][1], ranks)

    tile = tile_choice.largest_fitting(seq_len, fits)
    if tile is None:
        return plan, _run_config(base, plan), found
    return {**plan, "activations.seq_tile": tile}, *weighed[tile]


def _longest_with_tile(model_config, cfg: RunConfig, machine: Machine, batch_size: int, known: int,
                       limit: int) -> tuple[int, int | None]:
    """The longest sequence of the plan, and the tile it was found with: the plan's own, or where it
    leaves the tile to the auto rule and its blocks run in tiles (its estimate with tiles of
    tile_choice.MIN_TILE tokens says a block did), MIN_TILE: the tile that fits the longest."""
    limit = seq_limit_of(model_config, limit)
    at = min(tile_choice.probe_length(known), limit)
    # else no row is long enough to tile, or (fsdp) blocks run whole: sharding.whole_blocks
    if not cfg.activations.tile and at > tile_choice.MIN_TILE and cfg.dist.strategy != "fsdp":
        tiled = _run_config(cfg, {"activations.seq_tile": tile_choice.MIN_TILE})
        # at the plan's own length the auto rule's tile is often MIN_TILE: the plan's row, from the cache
        if per_device_estimate(model_config, tiled, machine, batch_size, at).tiled_blocks:
            return longest_fitting_seq(model_config, tiled, machine, batch_size, known, limit=limit), tile_choice.MIN_TILE
    return longest_fitting_seq(model_config, cfg, machine, batch_size, known, limit=limit), cfg.activations.tile or None


def per_device_estimate(model_config, cfg: RunConfig, machine: Machine, batch_size: int,
                        seq_len: int) -> estimate.Estimate:
    """What one device holds: the measured estimate; under fsdp rank 0's sharded step, measured under a
    fake process group (fake_ranks), or where none can start derived by formula (rank_plan.sharded)."""
    ranks = machine.ranks(cfg.engine) if machine is not None else 1  # no machine: one device's step
    if not fake_ranks.needed(cfg, ranks):
        return cached_estimate(model_config, cfg, batch_size, seq_len)
    width = rank_plan.gather_bytes(cfg)
    if not fake_ranks.available():
        return rank_plan.sharded(cached_estimate(model_config, cfg, batch_size, seq_len), model_config, ranks,
                                 cfg.train.grad_accum, width)
    found = cached_estimate(model_config, cfg, batch_size, seq_len, ranks)
    return dataclasses.replace(found, allreduce_bytes=rank_plan.fsdp_payload(found, model_config,
                                                                             cfg.train.grad_accum, width))


def longest_fitting_seq(model_config, cfg: RunConfig, machine: Machine, batch_size: int, known: int,
                        by_length: bool = True, limit: int = 0) -> int:
    """The longest sequence, up to `limit` tokens (0: the model's positions), whose step fits `machine`,
    from the length already estimated (`known`): by the curves through a few lengths' estimates
    (longest_seq.py), or (`by_length=False`) by doubling and bisection on the same estimate. Either
    way the answer fits and one token more does not (0: not even one token fits)."""
    limit = seq_limit_of(model_config, limit)
    ranks = machine.ranks(cfg.engine)

    def needs(seq: int) -> dict[str, tuple[int, int]]:
        return _needs_by_segment(machine, per_device_estimate(model_config, cfg, machine, batch_size, seq), ranks)

    if not by_length:
        return longest_seq.longest_by_bisection(needs, known, limit)
    tiled = per_device_estimate(model_config, cfg, machine, batch_size, min(known, limit)).tiled_blocks
    return longest_seq.longest_by_length(needs, known, limit, tile=cfg.activations.tile or 1, affine=tiled)


def _needs_by_segment(machine: Machine, found: estimate.Estimate, ranks: int) -> dict[str, tuple[int, int]]:
    """machine.needs, with the device's need split into each segment's peak where the estimate by
    depth gives them: the step fits exactly when the largest fits, and each grows with the length along
    its own line, where the peak turns from one segment to another as the length grows."""
    needs = machine.needs(found, ranks)
    if found.segment_peaks:
        need, have = needs.pop("device")
        overhead = need - found.device_peak_bytes
        needs.update({f"device: {label}": (peak + overhead, have) for label, peak in found.segment_peaks.items()})
    return needs


# Below this many block-widths (layers x hidden) plans are estimated faster than a worker process starts.
PARALLEL_FROM = 16 * 1024


def first_fitting(model_config, cfg: RunConfig, candidates: list[dict], machine: Machine,
                  progress: Weighing | None = None) -> tuple[RunConfig, PlanResult]:
    """The run with the first of `candidates` (settings the run left open, in the engine's order of
    preference) that fits `machine`, found by bisection: a later candidate needs no more than an
    earlier one (e.g. more chunks). One sentence when none fits."""
    machine.refuse_unloadable(model_config)
    plan = {"engine": cfg.engine}
    progress = progress or quiet()

    # Candidates in the estimate cache cost nothing and are not counted.
    fresh = {i for i, c in enumerate(candidates)
             if not is_cached(model_config, _run_config(cfg, {**plan, **c}), cfg.train.batch_size, cfg.data.max_length)}

    def weighed(i: int) -> PlanResult:
        found = weigh(model_config, cfg, {**plan, **candidates[i]}, machine, cfg.train.batch_size, cfg.data.max_length)
        if i in fresh:
            progress.tick()
        return found

    most = 1 + math.ceil(math.log2(len(candidates)))  # a bisection's weighings at most
    progress.start(min(most, len(fresh)), exact=len(candidates) == 1)
    with progress:
        low, high, found = -1, len(candidates) - 1, weighed(len(candidates) - 1)
        if not found.fits:
            raise UserError(f"engine={cfg.engine} with {found.label} does not fit {machine.describe()}: "
                            f"{_smallest_need([found])}.")
        while high - low > 1:  # candidates[high] fits, candidates[low] does not (or low = -1)
            middle = (low + high) // 2
            result = weighed(middle)
            low, high, found = (low, middle, result) if result.fits else (middle, high, found)
    return _run_config(cfg, candidates[high]), found


def applicable_plans(base: RunConfig, machine: Machine | None = None) -> list[dict]:
    """Every engine's plans for the run's method on the machine's cards, less those an engine refuses
    for the run's other settings (e.g. chunk over a 4-bit base) and sharded plans where
    there is one rank: those are not candidates, not errors. The device peak of a plan is per card
    (per worker, for an engine using several)."""
    cards, found = machine.cards if machine else 1, []
    for plan in engines.plans_for(base.method, cards):
        try:
            _run_config(base, plan)
        except UserError:
            continue
        if plan.get("dist.strategy") == "fsdp" and (machine is None or machine.ranks(plan["engine"]) < 2):
            continue
        if machine is not None and machine.rank_per_card and machine.cards > 1 and engines.get(plan["engine"]).uses_cards:
            continue
        found.append(plan)
    return found


def _weigh_all(model_config, base: RunConfig, machine: Machine, batch_size: int, seq_len: int,
               max_seq: bool, seq_limit: int = 0, progress: Weighing | None = None) -> list[PlanResult]:
    """Plans are independent: beside this process, one spawned worker (a forked torch can hang in its
    thread pool) takes the next plan the moment it is free; results keep the plans' order."""
    import os

    jobs = [(model_config, base, p, machine, batch_size, seq_len, max_seq, seq_limit)
            for p in applicable_plans(base, machine)]
    # Answers already in the cache cost nothing: only the others are worth a worker.
    results = {i: weigh(*job) for i, job in enumerate(jobs)
               if not max_seq and is_cached(model_config, _run_config(base, job[2]), batch_size, seq_len)}
    left = [i for i in range(len(jobs)) if i not in results]
    order = sorted(left, key=lambda i: (_expected_length(base, jobs[i][2]), i))
    small = model_config.num_hidden_layers * model_config.hidden_size < PARALLEL_FROM
    progress = progress or quiet()
    progress.start(len(order))
    with progress:
        if (os.cpu_count() or 1) < 2 or len(order) < 2 or small:
            planning_worker.discard()
            for i in order:
                results[i] = weigh(*jobs[i])
                progress.tick()
        else:
            with planning_worker.take() as worker:
                results.update(_share_with_a_worker(worker, jobs, order, progress.tick))
    return [results[i] for i in range(len(jobs))]


def _expected_length(base: RunConfig, plan: dict) -> tuple[int, bool, bool]:
    """What makes a plan's estimate long, most telling first: the passes over the model its fake step
    makes (lsp's first step also checks its projectors), whether it runs the whole stack (its engine
    does not extrapolate from two shallow ones), whether its blocks are recomputed. Only an order:
    the longest are handed out first."""
    cfg = _run_config(base, plan)
    spec = engines.get(cfg.engine)
    return spec.estimate_passes(cfg), not spec.by_depth(cfg), cfg.activations.checkpoint != "none"


def _share_with_a_worker(worker, jobs: list[tuple], order: list[int], weighed=lambda: None) -> dict[int, PlanResult]:
    """Weigh jobs[i] for i in `order`: this process and the worker (fed by a thread that waits for it,
    so it never idles) each take the next one left until none is. `order` puts the plans expected to
    take longest last (_expected_length; within alike ones, engines list their plans plain to
    elaborate): taking them from the end, the longest go first and the last ones, which decide when
    both are done, are short. `weighed()` is called after each plan, by whichever thread weighed it."""
    import threading

    lock, results, failures = threading.Lock(), {}, []

    def take() -> int | None:
        with lock:
            return order.pop() if order else None

    def feed() -> None:
        try:
            while (index := take()) is not None:
                results[index] = worker.run(weigh, *jobs[index])
                weighed()
        except BaseException as err:  # noqa: BLE001  (raised again in this process's thread)
            failures.append(err)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    while (index := take()) is not None:
        results[index] = weigh(*jobs[index])
        weighed()
    feeder.join()
    if failures:
        raise failures[0]
    return results


def plan(model_config, base: RunConfig, machine: Machine, batch_size: int, seq_len: int,
         max_seq: bool = False, seq_limit: int = 0, progress: Weighing | None = None) -> list[PlanResult]:
    """Every candidate plan for base.method, fastest first; the fastest that fits is recommended.
    `max_seq`: also each plan's longest sequence, up to `seq_limit` (0: the model's positions).
    `progress`: what to show while the plans not in the estimate cache are weighed (None: nothing)."""
    machine.refuse_unloadable(model_config)
    results = _weigh_all(model_config, base, machine, batch_size, seq_len, max_seq, seq_limit, progress)
    results.sort(key=lambda r: (-r.tokens_per_s, r.estimate.device_peak_bytes))
    fitting = [r for r in results if r.fits]
    if fitting:
        fitting[0].recommended = True
    return results


def recommended(results: list[PlanResult]) -> PlanResult | None:
    return next((r for r in results if r.recommended), None)


def smallest(results: list[PlanResult]) -> PlanResult:
    """The plan that needs the least device memory (the card is what a user can least change)."""
    return min(results, key=lambda r: r.estimate.device_peak_bytes)


def planning_config(method: str, rank: int = 16, **train) -> RunConfig:
    """A RunConfig for planning a model by preset or folder (no data is read)."""
    base = {"model": "(planned)", "data": "(planned)", "method": method, "lora": {"rank": rank, "alpha": 2 * rank},
            "train": {"batch_size": 1, **train}}
    return settings.load(None, [], base=base)


def plan_run(cfg: RunConfig, model_config, machine: Machine,
             progress: Weighing | None = None) -> tuple[list[PlanResult], PlanResult | None]:
    """The run's own method, sequence length and batch, planned for `machine`; and the recommended plan."""
    results = plan(model_config, cfg, machine, cfg.train.batch_size, cfg.data.max_length, progress=progress)
    return results, recommended(results)


def no_fit_sentence(results: list[PlanResult], machine: Machine) -> str:
    return f"no plan fits {machine.describe()}: {_smallest_need(results)}."


def _smallest_need(results: list[PlanResult]) -> str:
    """What the plan that needs the least device memory lacks on the machine, and by how much."""
    need = smallest(results)
    lacks = "; ".join(f"{what}: needs {human_bytes(n)}, has {human_bytes(h)} ({human_bytes(n - h)} short)"
                      for what, (n, h) in need.short.items())
    advice = " lower train.batch_size or data.max_length," if "device" in need.short else ""
    return f"the smallest on the device, {need.engine} {need.label}, lacks {lacks};{advice} or plan for a larger machine"


def is_the_plan(cfg: RunConfig, result: PlanResult) -> bool:
    """Whether the run already is `result`'s plan: its engine and options change none of cfg's settings."""
    return _run_config(cfg, {"engine": result.engine, **result.options}) == cfg


def apply_recommended(cfg: RunConfig, model_config, machine: Machine,
                      progress: Weighing | None = None) -> tuple[RunConfig, PlanResult]:
    """plan=auto: the run's settings with the recommended plan's engine and options."""
    results, chosen = plan_run(cfg, model_config, machine, progress)
    if chosen is None:
        raise UserError(no_fit_sentence(results, machine))
    return _run_config(cfg, {"engine": chosen.engine, **chosen.options}), chosen


# ---------------------------------------------------------------- printing

_DETAIL = ("weights", "gradients", "optimizer", "activations", "loss", "temporaries")


def table(results: list[PlanResult], title: str, machine: Machine, detail: bool = False) -> str:
    """The plans as a table that fits a terminal; `detail` adds the breakdown of the device peak."""
    head = ["engine", "options", "device peak", *(_DETAIL if detail else ()), "host RAM", "disk", "link/step",
            "tokens/s*"]
    with_seq = any(r.max_seq is not None for r in results)
    head += ["max seq"] if with_seq else []
    rows = [head + ["fits"]]
    for r in results:
        e = r.estimate
        row = [r.engine, r.label, human_bytes(e.device_peak_bytes) + ("**" if r.derived else ""),
               *(human_bytes(e.breakdown.get(c, 0)) + ("**" if r.derived else "") for c in (_DETAIL if detail else ())),
               human_bytes(e.host_bytes), human_bytes(e.disk_bytes), human_bytes(e.host_link_bytes),
               f"{r.tokens_per_s:,.0f}"]
        row += [_max_seq_cell(r)] if with_seq else []
        rows.append(row + [("yes" if r.fits else "no (" + ", ".join(_short_cell(r, machine)) + ")")
                           + (" <- recommended" if r.recommended else "")])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title, ""] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [
        "",
        "Device peak" + (" and its breakdown" if detail else "") + ": the real training step run on fake tensors and "
        f"counted by the training loop's meter. Fits: peak + {human_bytes(CUDA_OVERHEAD_BYTES)} CUDA context "
        f"(assumed) <= the card, host RAM <= {HOST_RAM_SHARE:.0%} of the host's, disk <= the free disk.",
        speed_note(machine),
    ]
    if with_seq:
        lines.append("max seq: the longest sequence whose step fits (one token more does not), solved from a few "
                     "lengths' estimates and confirmed by the estimate at it and one token more; (limit): it fits "
                     "at the longest weighed (--max-seq LIMIT, else the model's positions), and longer was not "
                     "weighed; (tile N): with activations.seq_tile=N, where the plan leaves its blocks' tile to the "
                     "auto rule.")
    if machine.nodes * machine.cards > 1:
        lines += _data_parallel_notes(results, machine)
    chosen = recommended(results)
    lines.append(f"recommended: {chosen.engine} {chosen.label}" if chosen else f"no plan fits: {_smallest_need(results)}.")
    return "\n".join(lines)


def _short_cell(result: PlanResult, machine: Machine) -> list[str]:
    """What a plan lacks, by name; a host resource that its ranks on one machine share says their total
    (the row's host RAM and disk are one rank's: 2 x 59.8 GiB of disk do not fit in 70 GiB)."""
    here = max(result.ranks // machine.nodes, 1)
    return [f"{what}: {here} ranks x {human_bytes(need // here)}" if here > 1 and what != "device" else what
            for what, (need, _) in result.short.items()]


def speed_note(machine: Machine) -> str:
    """The table's footnote on tokens/s: modelled, and over which rates (a card's spec sheet, or measured)."""
    return (f"* tokens/s is modelled: step FLOPs over {machine.gpu.name}'s {machine.gpu.rates} rate at "
            f"{speed.ASSUMED_MFU:.0%} MFU (assumed), plus optimizer and host-link traffic over its bandwidths.")


def _max_seq_cell(result: PlanResult) -> str:
    """The longest sequence, and the tile it needs where the plan's options do not name it."""
    if not result.max_seq:
        return "-"
    tile = result.max_seq_tile if "activations.seq_tile" not in result.options else None
    capped = " (limit)" if result.max_seq == result.max_seq_limit else ""
    return f"{result.max_seq:,}{capped}" + (f" (tile {tile})" if tile else "")


def _data_parallel_notes(results: list[PlanResult], machine: Machine) -> list[str]:
    """What the figures mean on several cards or machines: per device, per rank, and for the job."""
    ranks = sorted({r.ranks for r in results})
    lines = [f"Data parallelism (torchrun) on {machine.nodes} machine(s) x {machine.cards} card(s): each plan runs as "
             f"{' or '.join(map(str, ranks))} ranks, and every figure but tokens/s is per device (per rank): under ddp"
             " each rank holds what one device holds alone. tokens/s is the whole job's: ranks x a rank's tokens over"
             " its step plus the gradient sum across ranks; a fit counts the host RAM and disk of every rank on a"
             " machine (a ring all-reduce of the bytes the engine's fake step"
             f" hands to its all-reduces, over the host link{' and an assumed %g GB/s network' % rank_plan.NETWORK_GBPS if machine.nodes > 1 else ''}; modelled, not overlapped)."]
    if any(r.derived for r in results):
        lines.append("** derived, not measured: the one-device measurement with every weight, gradient and AdamW"
                     " moment divided by the ranks, and two blocks, the head and an untied embedding gathered whole,"
                     " in bf16 under precision=bf16 (FSDP2; rank_plan.sharded).")
    return lines


def to_json(results: list[PlanResult]) -> str:
    return json.dumps([r.as_json() for r in results], indent=2)
