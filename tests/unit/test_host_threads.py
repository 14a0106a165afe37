"""train.host_threads: the threads a host AdamW update runs on. Resolved by host_adam.host_threads (the
setting; by default 1 on a CPU run, and on a GPU the cores this process may use, shared among the
machine's ranks, less one); handed to every update by each engine with a host optimizer (slide, chunk,
roundpipe, lsp); and the same bits at any count."""

from __future__ import annotations

import os

import pytest
import torch

from test_host_layouts import chunk_case, roundpipe_case, slide_case, slide_engine, step_batches
from test_lsp import fixed_projector_engine, run_cfg
from test_slide import batches, model_of
from slimtune.config import TrainConfig
from slimtune.engines.chunk.engine import ChunkConfig
from slimtune.engines.slide.engine import SlideConfig
from slimtune.errors import UserError
from slimtune.optim import host_adam, tiled_adamw
from slimtune.optim.native import adamw as native
from slimtune.optim.native import build
from slimtune.optim.host_adam import host_threads

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # (a device object only: nothing runs on CUDA here)


def test_by_default_one_thread_on_a_cpu_run_and_the_free_cores_on_a_gpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_threads(TrainConfig(), CPU) == 1  # the step's own compute takes the cores
    assert host_threads(TrainConfig(), CUDA) == 15  # one left to the thread driving the device
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this machine share its cores
    assert host_threads(TrainConfig(), CUDA) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert host_threads(TrainConfig(), CUDA) == 1
    assert host_threads(TrainConfig(host_threads=6), CPU) == host_threads(TrainConfig(host_threads=6), CUDA) == 6


def test_a_short_run_takes_fewer_threads_than_asked(monkeypatch):
    """A thread is started only for NUMBERS_A_THREAD numbers or more: one for fewer, as many as fit."""
    asked = []
    monkeypatch.setattr(tiled_adamw, "adamw", lambda *args, threads=1, **kwargs: asked.append(threads))
    for numel in (100, 2 * host_adam.NUMBERS_A_THREAD, 10 * host_adam.NUMBERS_A_THREAD):
        adam = host_adam.HostAdam("t", [host_adam.Group((torch.Size([numel]),), 0.0)], torch.float32, CPU,
                                  {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}, threads=4)
        adam.update(1e-3)
    assert asked == [1, 2, 4]


def test_a_negative_count_is_refused_in_one_sentence():
    with pytest.raises(UserError, match=r"^train.host_threads must not be negative, got -1\.$"):
        TrainConfig(host_threads=-1).validate()


def lsp_case(host_threads: int):
    model, cfg = model_of(layers=2, dtype=torch.float32), run_cfg(host_threads=host_threads)
    engine = fixed_projector_engine(model, cfg, precision="fp32")
    return engine, batches(model.config.vocab_size, 0, cfg.train.grad_accum)


ENGINES = {
    "slide": lambda t, tmp: (slide_case("bf16", host_threads=t)(0, tmp), step_batches(0)),
    "slide-chunk-working-set": lambda t, tmp: (slide_case("bf16", SlideConfig(working_set="chunk"),
                                                          ChunkConfig(n_chunks=2), host_threads=t)(0, tmp),
                                               step_batches(0)),
    "chunk": lambda t, tmp: (chunk_case("bf16", host_threads=t)(0, tmp), step_batches(0)),
    "roundpipe": lambda t, tmp: (roundpipe_case("bf16", host_threads=t)(0, tmp), step_batches(0, rows=4)),
    "lsp": lambda t, tmp: lsp_case(t),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_engine_with_a_host_optimizer_updates_on_the_threads_asked_for(monkeypatch, tmp_path, engine):
    monkeypatch.setattr(host_adam, "NUMBERS_A_THREAD", 1)  # these models' runs are short
    asked = []
    update = tiled_adamw.adamw

    def recorded(*args, threads: int = 1, **kwargs):
        asked.append(threads)
        return update(*args, threads=threads, **kwargs)

    monkeypatch.setattr(tiled_adamw, "adamw", recorded)
    built, step = ENGINES[engine](3, tmp_path)
    for _ in range(2):  # (lsp applies a step's updates as the next one reads each matrix)
        built.step(step)
    assert asked and set(asked) == {3}, asked


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
def test_slide_on_two_threads_trains_the_bits_of_one(monkeypatch, moments):
    """The native loop splits an update at 256-number blocks, each thread's share computed as one
    thread computes it: the same weights, moments and losses bit for bit."""
    monkeypatch.setattr(host_adam, "NUMBERS_A_THREAD", 256)  # these models' runs are short
    monkeypatch.delenv(native.ENV, raising=False)
    if build.compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path runs, whose threads are torch's")
    split, native_step = [], native.step

    def recorded(*args, threads: int = 1, **kwargs):
        done = native_step(*args, threads=threads, **kwargs)
        split.append(done and threads > 1)
        return done

    monkeypatch.setattr(native, "step", recorded)
    model = model_of(layers=2, dtype=torch.float32)
    one, two = (slide_engine(model, "bf16", moments=moments, host_threads=t) for t in (1, 2))
    assert max(adam.groups[0].numel for adam in (u.adam for u in two._all_units() if u.adam)) >= 2 * 256
    for step in range(4):
        a, b = one.step(step_batches(step)), two.step(step_batches(step))
        assert a.loss == b.loss and a.grad_norm == b.grad_norm, step
    mine, theirs = one.trainable_state(), two.trainable_state()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert any(split)  # the native loop ran updates split over two threads
