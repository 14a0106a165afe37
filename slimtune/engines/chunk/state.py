"""The host side of the chunk working set (spec chunkft.md 2.3), shared by engine chunk (weights on
the device) and engine slide with slide.working_set=chunk (weights on the host, a window of blocks
on the device).

It owns the partition of the trainable tensors into chunks, and per chunk a HostAdam (the shared
host optimizer) over the chunk's pieces: fp32 masters, AdamW moments and a step count per
(tensor, chunk), in RAM or memory-mapped files (masters too). One `host_adam.Working` set of
gradient accumulators and shadows, sized for the largest chunk, serves the chunk that is active:
only it has gradients. It also keeps the visiting order (round robin, or a seeded random order per
sweep), the learning-rate schedule's mode, and the checkpoint form of all of it.

A chunk's masters start as its weights on its first visit (`weight_of` reads them wherever they
live); an update writes the new weights back through the engine's `write` (a device copy up, or a
host copy).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from slimtune.device import runtime
from slimtune.store.checkpoint import EngineState
from slimtune.engines.chunk.partition import Piece, Stream, partition
from slimtune.config import RunConfig
from slimtune.config_sources import say_warning
from slimtune.errors import UserError
from slimtune.optim import rules
from slimtune.optim import host_adam
from slimtune.optim.host_adam import MOMENTS, Group, HostAdam, Layout, Working, moments_folder

STATE_BYTES = 8  # two fp32 AdamW moments a number: what each number costs beside its own bytes
ON_DISK = runtime.DiskUse("chunk.state=disk", "the chunks' masters and AdamW moments", "chunk.state_dir",
                          "chunk.state=ram")
Member = tuple[Piece, int, int]  # a piece and its (group, member) in its chunk's HostAdam


def axis_of(model: nn.Module) -> Callable[[str, nn.Parameter], int]:
    """The split axis of each trainable tensor (spec 2.1): vocabulary rows of the token embedding and
    of the causal-LM head, elements of 1-D tensors, input columns of every other matrix."""
    by_rows = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        by_rows.add(id(head.weight))

    def axis(name: str, param: nn.Parameter) -> int:
        del name
        return 0 if param.ndim == 1 or id(param) in by_rows else 1
    return axis


def scratch(cfg: RunConfig) -> dict[str, str]:
    """chunk.state=disk keeps the masters and moments in files under chunk.state_dir."""
    section = cfg.section("chunk")
    if section.state != "disk":
        return {}
    return {"chunk.state_dir": str(section.state_dir or Path(cfg.output_dir) / "chunk-state")}


CHUNK_COUNTS = tuple(2**i for i in range(9))  # 1 .. 256: what chunk.n_chunks=0 chooses from
# chunk.switch_every=0 derives K from the run, at most this: the longest stay the budget benchmark
# found good (benchmarks/docs/chunk_budget.md: K = 50 with a random order within 2 points of resident
# at N = 4 and 16; K = 1 to 10 far from it).
MOST_STEPS_ON_A_CHUNK = 50
VISITS = 2  # a derived K gives every chunk at least this many visits over the run


def derived_switch_every(steps: int, n_chunks: int) -> int:
    """The largest K (steps on a chunk before the next) that still gives every chunk VISITS visits in
    `steps` optimizer steps, within 1..MOST_STEPS_ON_A_CHUNK: a run too short for two visits gets K = 1."""
    return max(1, min(MOST_STEPS_ON_A_CHUNK, steps // (VISITS * n_chunks)))


def _steps(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''}"


def derived_lr_scale(n_chunks: int) -> float:
    """chunk.lr_scale=0: sqrt(N). Each tensor is updated on 1/N of the steps; on SmolLM2-135M at N = 8 the
    rate that trained chunk level with resident was about 3x resident's (benchmarks/docs/smollm2_engines.md)."""
    return math.sqrt(n_chunks)


def open_settings(cfg: RunConfig) -> list[dict]:
    """chunk.n_chunks=0: the fewest chunks that fit are wanted (each tensor updated most often)."""
    if cfg.section("chunk").n_chunks:
        return []
    return [{"chunk.n_chunks": n} for n in CHUNK_COUNTS]


# Within a block, the order its parts run in: a norm before the projections it feeds. The stream
# follows it (not the modules' declaration order, which puts a Llama block's two norms last), so a
# chunk that begins inside a block holds nothing that runs before its first tensor there, and its
# backward can skip that part of the block (chunk/reach.py).
BLOCK_CALL_ORDER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_IN_A_BLOCK = re.compile(r"^(.*\.layers\.\d+\.)([^.]+)")


def in_call_order(names: list[str]) -> list[str]:
    """`names` (model order) with each block's tensors in BLOCK_CALL_ORDER by their part, a part not
    named there after the others, ties in model order; everything outside the blocks where it was."""
    def key(item: tuple[int, str]) -> tuple:
        found = _IN_A_BLOCK.match(item[1])
        if not found:
            return (item[0],)
        part = found.group(2)
        rank = BLOCK_CALL_ORDER.index(part) if part in BLOCK_CALL_ORDER else len(BLOCK_CALL_ORDER)
        return (first_of_block[found.group(1)], rank, item[0])
    first_of_block: dict[str, int] = {}
    for i, name in enumerate(names):
        found = _IN_A_BLOCK.match(name)
        if found:
            first_of_block.setdefault(found.group(1), i)
    return [name for _, name in sorted(enumerate(names), key=key)]


def narrow(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t.narrow(piece.axis, piece.start, piece.stop - piece.start)


class ChunkState:
    """`params`: name -> trainable parameter, in model order (tied ones once); `axes`: name -> axis;
    `weight_of(name)`: the tensor holding that parameter's current weights (any device)."""

    def __init__(self, params: dict[str, nn.Parameter], axes: dict[str, int], cfg: RunConfig,
                 device: torch.device, fake: bool, weight_of: Callable[[str], torch.Tensor],
                 shares_weights: bool = False):
        """`shares_weights`: weight_of's tensors are host bf16 weights the updates may write in place
        (slide's under a chunk working set): under the split master they are its top half, so the
        state keeps only the residuals and moments (no bf16 copy of its own)."""
        self.section, self.train_cfg, self.seed = cfg.section("chunk"), cfg.train, cfg.train.seed
        params = {name: params[name] for name in in_call_order(list(params))}  # the stream's order
        self.params, self.device, self.weight_of = params, device, weight_of
        self.shares_weights = shares_weights
        streams = [self._stream(name, param, axes[name]) for name, param in params.items()]
        self.streams = {s.name: s for s in streams}
        self.chunks = partition(streams, self.section.n_chunks)
        self.switch_every = self.section.switch_every or derived_switch_every(self.train_cfg.steps, len(self.chunks))
        self.lr_scale = self.section.lr_scale or derived_lr_scale(len(self.chunks))
        self.fake = fake
        self.state_dir = self._state_dir(cfg)
        self.adams, self.members = self._optimizers()
        self.visited = [False] * len(self.chunks)
        self.sweep = self.position = self.done_on_active = 0
        self.planned = self.heaviest()  # the chunk the planner's fake step runs; an engine may choose another

    # ------------------------------------------------------------ building

    def _state_dir(self, cfg: RunConfig) -> runtime.ScratchFolder | Path | None:
        """chunk.state=disk: a private folder for the state files, removed with the state (under fake
        tensors the path is only named: nothing is written)."""
        if self.section.state != "disk":
            return None
        root = Path(scratch(cfg)["chunk.state_dir"])
        params = list(self.params.values())  # a master (or its weight and residual) and two moments a number
        need = sum(p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize for p in params) + \
            host_adam.moments_bytes(params, self.train_cfg.moments)
        return root if self.fake else moments_folder(self, root, ON_DISK, need)

    def _stream(self, name: str, param: nn.Parameter, axis: int) -> Stream:
        master = 4 if param.element_size() < 4 else 0  # an fp32 master beside narrower weights
        return Stream(name, tuple(param.shape), axis, param.element_size() + master + STATE_BYTES)

    def piece_shape(self, piece: Piece) -> torch.Size:
        shape = list(self.params[piece.name].shape)
        shape[piece.axis] = piece.stop - piece.start
        return torch.Size(shape)

    def _optimizers(self) -> tuple[list[HostAdam], list[list[Member]]]:
        """One HostAdam per chunk, its pieces in two groups (matrices decay, 1-D tensors do not),
        all sharing one Working set sized for the largest chunk."""
        param = next(iter(self.params.values()))
        self.dtype = torch.promote_types(param.dtype, torch.float32)
        shadow = param.dtype if param.dtype != self.dtype else None
        layout = Layout.for_run(self.train_cfg, None)  # gradients are summed from slices: fp32
        # Under the split layout each chunk's bf16 weights are half its masters, so no shared shadows.
        split = layout.split and shadow == torch.bfloat16 and self.dtype == torch.float32
        self.working = Working(max(self.numel(k) for k in range(len(self.chunks))), self.dtype, self.device,
                               None if split else shadow)
        adams, members = [], []
        for k, pieces in enumerate(self.chunks):
            decayed = [p for p in pieces if rules.decays(self.params[p.name])]
            plain = [p for p in pieces if not rules.decays(self.params[p.name])]
            grouped = [(g, wd) for g, wd in ((decayed, self.train_cfg.weight_decay), (plain, 0.0)) if g]
            groups = [Group(tuple(self.piece_shape(p) for p in g), wd) for g, wd in grouped]
            shared = [[narrow(self.weight_of(p.name), p) for p in g] for g, _ in grouped] \
                if split and self.shares_weights else None
            adams.append(HostAdam(f"chunk {k}", groups, self.dtype, self.device, rules.adamw_settings(self.train_cfg),
                                  shadow_dtype=shadow, moments_dir=self.state_dir,
                                  masters_on_disk=self.state_dir is not None, working=self.working,
                                  layout=layout, weights=shared,
                                  threads=host_adam.host_threads(self.train_cfg, self.device)))
            members.append([(p, g, i) for g, (group, _) in enumerate(grouped) for i, p in enumerate(group)])
        return adams, members

    def numel(self, k: int) -> int:
        return sum(self.piece_shape(p).numel() for p in self.chunks[k])

    def describe(self) -> str:
        """One line for the start of a run: the chunks, their order, how long each stays and how often the
        run's steps come round to each (or how many they never reach)."""
        order = "a new random order each sweep" if self.section.order == "random" else "model order (round robin)"
        why = "chunk.switch_every" if self.section.switch_every else (
            f"derived from train.steps={self.train_cfg.steps}, at most {MOST_STEPS_ON_A_CHUNK} a visit;"
            " chunk.switch_every sets it")
        scale = "chunk.lr_scale" if self.section.lr_scale else f"sqrt of {len(self.chunks)} chunks; chunk.lr_scale sets it"
        return (f"chunk: {len(self.chunks)} chunks in {order}, {_steps(self.switch_every)} on each ({why}):"
                f" {self.coverage()}; lr x{self.lr_scale:.3g} ({scale})")

    def coverage(self) -> str:
        """How the run's train.steps cover the chunks: every one visited so many times over, or, in a run
        shorter than one sweep, how many chunks no step reaches (their tensors do not train)."""
        n, k, steps = len(self.chunks), self.switch_every, self.train_cfg.steps
        reached = min(n, -(-steps // k))
        if reached < n:
            return (f"the run's {_steps(steps)} reach {reached} of the {n} chunks and the other {n - reached} are not"
                    f" trained (train.steps={n * k} or more visits each once, or lower chunk.n_chunks)")
        sweeps = steps // (n * k)
        return f"every chunk visited {sweeps} time{'s' if sweeps != 1 else ''}" + (
            "" if steps % (n * k) == 0 else ", some once more")

    # ------------------------------------------------------------ which chunk, which lr

    def order(self, sweep: int) -> list[int]:
        """The chunks in visiting order in `sweep`: model order, or a permutation drawn from the seed
        and the sweep (no RNG state to keep: resume draws the same)."""
        ks = list(range(len(self.chunks)))
        if self.section.order == "random":
            random.Random(self.seed * 1_000_003 + sweep).shuffle(ks)
        return ks

    @property
    def active(self) -> int:
        """The active chunk; under fake tensors (the planner's step) the planned one."""
        return self.planned if self.fake else self.order(self.sweep)[self.position]

    def heaviest(self) -> int:
        """The chunk with the most numbers: every chunk's step holds the same activations and its own
        gradient, so its step holds the most. Other chunks' steps differ from it by small transients
        only (a norm's or a bias's weight-gradient sums while its range is live: within 0.1% on the
        test model)."""
        return max(range(len(self.chunks)), key=self.numel)

    def most_of(self, name: str) -> int:
        """The chunk holding the most of tensor `name` (the first of equals)."""
        def share(k: int) -> int:
            return sum(self.piece_shape(p).numel() for p in self.chunks[k] if p.name == name)
        return max(range(len(self.chunks)), key=share)

    def advance(self) -> None:
        """After a successful step: the next chunk once this one had switch_every of them."""
        if self.fake:
            return
        self.done_on_active += 1
        if self.done_on_active < self.switch_every:
            return
        self.done_on_active, self.position = 0, self.position + 1
        if self.position == len(self.chunks):
            self.position, self.sweep = 0, self.sweep + 1

    def lr(self, step: int) -> float:
        """per_step: the run's schedule at `step`; per_sweep: held at the sweep's first step's value;
        either times lr_scale."""
        if self.section.lr_schedule == "per_sweep":
            sweep_steps = len(self.chunks) * self.switch_every
            step = step // sweep_steps * sweep_steps
        return rules.lr_at(self.train_cfg, step) * self.lr_scale

    # ------------------------------------------------------------ the update

    def grad_views(self, k: int) -> list[tuple[Member, torch.Tensor]]:
        """Chunk k's pieces and their host gradient accumulators (the Working set's views)."""
        return [(m, self.adams[k].member(m[1], m[2]).grad) for m in self.members[k]]

    def grad_norm(self, k: int) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack(self.adams[k].grad_norms()))

    def first_visit(self, k: int) -> None:
        """The chunk's masters start as its weights (made lazily, spec 2.3)."""
        if self.visited[k]:
            return
        with torch.no_grad():
            for piece, g, i in self.members[k]:
                self.adams[k].set_master(g, i, narrow(self.weight_of(piece.name).detach(), piece))
            self.adams[k].refresh_shadows()
        self.visited[k] = True

    def update(self, k: int, lr: float, clip: float, write: Callable[[Piece, torch.Tensor], None]) -> None:
        """Host AdamW over chunk k with its accumulated gradients times `clip`; each piece's new
        weights (the shadow, or the master itself) go to `write(piece, values)`."""
        self.first_visit(k)
        adam = self.adams[k]
        adam.update(lr, clip)
        if adam.weights is not None:
            return  # the update wrote the shared weights in place
        for piece, g, i in self.members[k]:
            views = adam.member(g, i)  # what goes up: the bf16 weight (shadow, or split half), or the master
            write(piece, views.shadow if views.shadow is not None else views.master)

    def discard(self, k: int) -> None:
        self.adams[k].discard()

    # ------------------------------------------------------------ accounting and checkpoints

    def pieces(self) -> list[list[list]]:
        """The partition as a checkpoint keeps it: per chunk, [name, start, stop] of each piece."""
        return [[[p.name, p.start, p.stop] for p in chunk] for chunk in self.chunks]

    def host_bytes(self) -> int:
        return sum(a.host_bytes() for a in self.adams) + self.working.host_bytes()

    def disk_bytes(self) -> int:
        return sum(a.disk_bytes() for a in self.adams)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights by name at full precision: the masters where a chunk was visited."""
        state = {name: self.weight_of(name).detach().to("cpu", self.dtype, copy=True) for name in self.params}
        for k, adam in enumerate(self.adams):
            if self.visited[k]:
                for piece, g, i in self.members[k]:
                    narrow(state[piece.name], piece).copy_(adam.master_of(g, i))
        return state

    def state_dict(self, engine: str, step: int) -> EngineState:
        moments = {m: {n: torch.zeros(p.shape, dtype=self.dtype) for n, p in self.params.items()} for m in MOMENTS}
        steps = {}
        for k, adam in enumerate(self.adams):
            for piece, g, i in self.members[k]:
                for m in MOMENTS:
                    narrow(moments[m][piece.name], piece).copy_(adam.moment_of(g, i, m))
                steps.setdefault(piece.name, float(adam.state(g)["step"]))
        extra = {"n_chunks": len(self.chunks), "pieces": self.pieces(), "visited": list(self.visited),
                 "sweep": self.sweep, "position": self.position, "done_on_active": self.done_on_active,
                 "chunk_steps": [[float(a.state(g)["step"]) for g in range(len(a.groups))] for a in self.adams]}
        return EngineState(engine=engine, step=step, trainable=self.trainable_state(), exp_avg=moments["exp_avg"],
                           exp_avg_sq=moments["exp_avg_sq"], adam_steps=steps,
                           extra={"chunk": extra, host_adam.CODED: host_adam.coded_state(self.adams)})

    def load_state_dict(self, state: EngineState) -> None:
        """Masters, moments and steps per (tensor, chunk), and where the sweep was. From a checkpoint
        without chunk state (another engine's, or slide's own) every chunk starts from its tensors'
        moments and step counts. The weights themselves are the engine's to load."""
        mine = state.extra.get("chunk")
        if mine is not None and mine["n_chunks"] != len(self.chunks):
            raise UserError(f"the checkpoint was cut into {mine['n_chunks']} chunks and this run into"
                            f" {len(self.chunks)}: set chunk.n_chunks={mine['n_chunks']} to resume it.")
        if mine is not None and mine.get("pieces") != self.pieces():
            say_warning("the checkpoint's chunks were cut in another order (written before the stream followed"
                        " each block's call order): every chunk starts from its tensors' moments and step counts.")
            mine = None
        for k, adam in enumerate(self.adams):
            for g in range(len(adam.groups)):
                pieces = [piece for piece, group, _ in sorted(self.members[k], key=lambda m: m[2]) if group == g]
                step = mine["chunk_steps"][k][g] if mine else state.adam_steps[pieces[0].name]
                adam.load_group(g, [narrow(state.trainable[p.name], p) for p in pieces],
                                {m: [narrow(getattr(state, m)[p.name], p) for p in pieces] for m in MOMENTS}, step)
        if mine:  # the same partition: its 8-bit moments as they rested
            host_adam.load_coded_state(self.adams, state.extra.get(host_adam.CODED, {}))
        self.visited = list(mine["visited"]) if mine else [True] * len(self.chunks)
        if mine:
            self.sweep, self.position, self.done_on_active = mine["sweep"], mine["position"], mine["done_on_active"]
