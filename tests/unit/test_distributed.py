"""Data parallelism: 2 and 3 processes under torchrun (gloo, CPU) give the weights one process gets on
the concatenated batch, for every engine and for fsdp (float64 to 1e-10, float32 to 1e-6), with the
loss and gradient norm of every step; and the pieces: sharding, buckets, the combined step figures,
the refusals."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_cases
from conftest import engine_config
from slimtune.dist import ranks as distributed
from slimtune import train
from slimtune.config import DistConfig
from slimtune.data.dataset import BatchStream
from slimtune.engines import settings
from slimtune.engines.base import StepResult
from slimtune.errors import UserError

TESTS = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, script: Path, *args: str, stderr) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node nproc script args` as a user starts it, started; its
    stderr to the file `stderr` (a pipe no one reads yet could fill and stall the ranks)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--max-restarts=0", str(script), *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=TESTS,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def test_ranks_train_as_one_process_on_the_whole_batch(tmp_path):
    """Three ranks (uneven shards under fsdp, an odd count for every sum): two add nothing a missing
    or doubled reduction would not already break here, and --nproc 2 runs end to end
    (tests/e2e/test_cli_distributed.py)."""
    world = 3
    log = tmp_path / "torchrun.err"
    with log.open("w") as stderr:
        job = torchrun(world, TESTS / "dist_cases.py", str(tmp_path), stderr=stderr)
    try:
        # Meanwhile (the ranks, waiting on one another, leave a core to spare): what one process
        # trains on the whole batch, and, in fp64, on one rank's share alone.
        micro = dist_cases.micro_per_rank(world)
        whole = {(name, precision): dist_cases.run_case(name, distributed.SINGLE, micro * world, precision)
                 for precision in dist_cases.PRECISIONS for name in dist_cases.CASES}
        alone = {name: dist_cases.run_case(name, distributed.SINGLE, micro)[2] for name in dist_cases.CASES}
        job.wait(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, log.read_text()[-4000:]
    for precision, tol in (("fp64", 1e-10), ("fp32", 1e-6)):
        for name in dist_cases.CASES:
            case = f"{name} ({precision})"
            saved = torch.load(tmp_path / f"{name}-{precision}.pt", weights_only=False)
            assert saved["world"] == world and saved["micro"] == micro
            losses, norms, weights = saved["found"]
            ref_losses, ref_norms, ref_weights = whole[name, precision]
            assert losses == pytest.approx(ref_losses, abs=tol, rel=0), case
            assert norms == pytest.approx(ref_norms, abs=tol, rel=0), case
            assert weights.keys() == ref_weights.keys(), case
            for key, value in ref_weights.items():
                torch.testing.assert_close(weights[key], value, atol=tol, rtol=0, msg=f"{case}: {key}")
            if name in dist_cases.PARTING:
                assert_ranks_agree(tmp_path, name, precision, world, weights)
            if precision == "fp64":
                # The sum across ranks is what makes them agree: one rank's share alone trains other weights.
                assert max((alone[name][k] - ref_weights[k]).abs().max().item() for k in ref_weights) > 1e-6, case


def assert_ranks_agree(folder: Path, name: str, precision: str, world: int, weights: dict) -> None:
    """Every rank of a PARTING case (made to part in its own projector fits) left each check with rank
    0's outcome: its weights, projector values, subspace moments, baselines and draw state; and the
    last check changed other matrices on rank 0 than on the others (each rank's own set: the
    agreement took their union)."""
    states = [torch.load(folder / f"{name}-{precision}-rank{rank}.pt", weights_only=False) for rank in range(world)]
    first = states[0]
    assert all(torch.equal(first["weights"][key], value) for key, value in weights.items())
    for rank, state in enumerate(states[1:], 1):
        case = f"{name} ({precision}) rank {rank}"
        assert all(torch.equal(state["weights"][key], value) for key, value in weights.items()), case
        for part in ("values", "moments"):
            assert all(torch.equal(a, b) for a, b in zip(state[part], first[part], strict=True)), f"{case}: {part}"
        assert state["baseline"] == first["baseline"] and torch.equal(state["generator"], first["generator"]), case
        assert set(state["changed"]) != set(first["changed"]), case
        assert state["broadcast_bytes"] == first["broadcast_bytes"], case  # what rank 0 sent, each other rank took
    # The first check changed every matrix on every rank: its values and host AdamW state went, not its weights
    # (equal on every rank already). The later checks changed other sets on rank 0 than on the others: their
    # union went whole, weights included.
    nbytes = sum(t.numel() * t.element_size() for part in ("values", "moments", "masters") for t in first[part])
    sent = first["broadcast_bytes"]
    assert sent[0] == nbytes, f"{name} ({precision}): the first check sent {sent[0]} bytes, not {nbytes}"
    assert all(later - before >= min(first["weight_bytes"]) for before, later in zip(sent, sent[1:])), sent


def test_close_frees_the_process_groups_before_the_interpreter_ends():
    """A group freed during interpreter shutdown can abort the process (gloo's thread releases a
    tensor there, pytorch/pytorch#179291): close() must leave no reference of its own behind. One
    in-process gloo group stands for a job's (close reads only `active`)."""
    import datetime
    import weakref

    import torch.distributed as tdist

    tdist.init_process_group("gloo", rank=0, world_size=1, store=tdist.HashStore(),
                             timeout=datetime.timedelta(seconds=30))
    host = tdist.new_group(backend="gloo")
    dist = distributed.Dist(rank=0, world_size=2, device_group=tdist.group.WORLD, host_group=host)
    groups = [weakref.ref(host), weakref.ref(tdist.group.WORLD)]
    del host
    dist.close()
    assert not tdist.is_initialized()
    assert all(group() is None for group in groups)


def test_shard_takes_every_world_th_item():
    dist = distributed.Dist(rank=1, world_size=3)
    assert dist.shard(list(range(8))) == [1, 4, 7]
    assert distributed.SINGLE.shard([1, 2]) == [1, 2]


def test_buckets_keep_order_dtype_and_size(monkeypatch):
    monkeypatch.setattr(distributed, "BUCKET_BYTES", 64)
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(12), torch.zeros(2, dtype=torch.float64), torch.zeros(40)]
    sizes = [[t.numel() for t in bucket] for bucket in distributed.buckets(tensors)]
    assert sizes == [[4, 4], [12], [2], [40]]  # 32 B + 48 B > 64; a dtype change cuts; a large one stands alone


def test_a_single_process_reduces_nothing():
    grads = [torch.ones(3)]
    distributed.SINGLE.all_reduce_(grads)
    assert grads[0].tolist() == [1.0, 1.0, 1.0] and distributed.SINGLE.reduced_bytes == 0
    result = StepResult(loss=1.0, tokens=3, seen_tokens=4, lr=0.1, grad_norm=2.0, device_peak_bytes=5,
                        host_link_bytes=0)
    assert train.combine_ranks(distributed.SINGLE, 1, result) is result


def test_the_stream_position_is_tied_to_the_world_size():
    from slimtune.data.dataset import Example

    examples = [Example([1, 2, 3, 4], [-100, 2, 3, 4]) for _ in range(8)]
    saved = BatchStream(examples, 2, 8, False, 0, 0, world_size=2).state_dict()
    with pytest.raises(UserError, match="world_size was 2, now 3"):
        BatchStream(examples, 2, 8, False, 0, 0, world_size=3).load_state_dict(saved)


def test_fsdp_is_refused_where_an_engine_does_not_shard():
    cfg = engine_config(engine="slide", method="full", dist=DistConfig(strategy="fsdp"))
    with pytest.raises(UserError, match="dist.strategy=fsdp is not available with engine slide"):
        settings.validate(cfg)
    settings.validate(engine_config(engine="resident", method="full", dist=DistConfig(strategy="fsdp")))


def test_outside_torchrun_there_is_one_process(monkeypatch):
    for name in distributed.ENV:
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched() and distributed.env_rank() == 0
    assert distributed.from_env(10.0) is distributed.SINGLE


@pytest.mark.parametrize("on_cuda", [True, False])
def test_a_cpu_run_under_torchrun_claims_no_card(monkeypatch, on_cuda):
    """On a machine with CUDA, a rank of a device=cpu run joins gloo alone and sets no CUDA device
    (each rank would hold a CUDA context on its card); a CUDA run takes cuda:LOCAL_RANK and NCCL."""
    import threading
    import torch.distributed as tdist

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(distributed, "_JOINED", threading.Event())  # joining is this process's state: undone after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group", lambda backend, timeout: calls.append(("backend", backend)))
    monkeypatch.setattr(tdist, "new_group", lambda backend, timeout: "host")
    monkeypatch.setattr(tdist, "get_rank", lambda: 1)
    monkeypatch.setattr(tdist, "get_world_size", lambda: 2)
    dist = distributed.from_env(10.0, on_cuda=on_cuda)
    assert dist.rank == 1 and dist.world_size == 2 and dist.host_group == "host"
    assert calls == ([("set_device", 1), ("backend", "cpu:gloo,cuda:nccl")] if on_cuda else [("backend", "gloo")])


def test_a_lost_job_names_the_rank_that_was_killed_not_a_survivor_nccl_aborted():
    """torchrun's failure times are whole seconds: a rank killed and a survivor that NCCL's watchdog
    then aborted (SIGABRT) tie, and the lower rank, here the survivor, was named."""
    import signal
    from types import SimpleNamespace

    from slimtune import launch

    def failure(exitcode: int, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)

    killed, aborted, stopped = failure(-signal.SIGKILL, 100), failure(-signal.SIGABRT, 100), failure(-signal.SIGTERM, 99)
    assert launch._cause({0: aborted, 1: killed, 2: stopped})[0] == 1
    assert launch._cause({0: stopped, 1: aborted})[0] == 1  # an abort alone is the cause, not torchrun's SIGTERM
    assert launch._cause({0: stopped, 1: failure(2, 100)})[0] == 1  # a rank that said why (exit 2)
    assert launch._cause({0: failure(-signal.SIGKILL, 101), 1: failure(-signal.SIGKILL, 100)})[0] == 1  # the first


def test_nproc_is_spelled_out_and_not_nested(monkeypatch, capsys):
    from slimtune import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "run.yaml", "--npro", "2"])  # an abbreviation would survive into every rank
    assert "unrecognized arguments: --npro" in capsys.readouterr().err
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", "--nproc", "2", "model=m", "data.path=d"]) == 2
    assert "under torchrun leave it out" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--nproc", "2"], "--nproc"), (["--gpu", "8GiB"], "--gpu"),
                                          (["--nproc", "2", "--gpu", "8GiB"], "--nproc and --gpu")])
def test_the_demo_does_not_take_a_flag_it_would_ignore(monkeypatch, capsys, flags, named):
    """`slimtune train --nproc 2` alone ran the demo in one process, the flag unsaid."""
    from slimtune import cli, demo

    monkeypatch.setattr(demo, "main", lambda **kwargs: pytest.fail("the demo ran"))
    assert cli.main(["train", *flags]) == 2
    assert f"{named} {'need' if ' and ' in named else 'needs'} a config or key=value settings; `slimtune train` alone runs the built-in demo, in one" \
           " process." in capsys.readouterr().err


def test_gradient_buckets_launch_in_bucket_order_as_they_fill(monkeypatch):
    """Hooks may fire in any order; buckets go out in one order on every rank, each as soon as it
    and those before it are full (one rank of gloo in this process: the sums are the gradients)."""
    import torch.distributed as tdist

    from slimtune.dist.grad_buckets import GradientBuckets

    monkeypatch.setattr(distributed, "BUCKET_BYTES", 16)
    tdist.init_process_group("gloo", rank=0, world_size=1, store=tdist.HashStore())
    try:
        params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(4)]  # 16 bytes each: a bucket each
        for i, p in enumerate(params):
            p.grad = torch.full((4,), float(i))
        dist = distributed.Dist(device_group=tdist.group.WORLD)
        buckets = GradientBuckets(dist, params)
        assert [bucket[0] is p for bucket, p in zip(buckets.buckets, reversed(params))] == [True] * 4
        buckets.arm()
        buckets.ready(params[1])  # bucket 2: waits for buckets 0 and 1
        assert len(buckets._flights) == 0
        buckets.ready(params[3])  # bucket 0 goes
        assert [f[0][0] is params[3].grad for f in buckets._flights] == [True]
        buckets.ready(params[2])  # bucket 1, then the waiting bucket 2
        assert [f[0][0] for f in buckets._flights] == [params[3].grad, params[2].grad, params[1].grad]
        buckets.finish()  # bucket 3 (params[0]) never got its hook: sent at the end
        assert [p.grad.tolist() for p in params] == [[float(i)] * 4 for i in range(4)]
        assert dist.take_reduced_bytes() == 4 * 16 and not buckets.armed
        buckets.ready(params[0])  # not armed: earlier micro-batches only accumulate
        assert buckets._flights == []
    finally:
        tdist.destroy_process_group()


def test_gradient_buckets_wait_for_the_last_part_of_a_tiled_blocks_gradients(monkeypatch):
    """A block run in tiles adds into each of its tensors' gradients once per tile: a bucket of them
    goes out only once backward has left the block (what it sends then is the whole gradient), while
    an ungrouped tensor's, and any tensor's when the blocks run whole, goes out at its hook."""
    import torch.distributed as tdist

    from slimtune.dist.grad_buckets import GradientBuckets

    monkeypatch.setattr(distributed, "BUCKET_BYTES", 16)
    tdist.init_process_group("gloo", rank=0, world_size=1, store=tdist.HashStore())
    try:
        embed, wq, wk, norm = params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(4)]  # a bucket each
        dist = distributed.Dist(device_group=tdist.group.WORLD)
        buckets = GradientBuckets(dist, params, groups={id(wq): 0, id(wk): 0})

        def part(p):  # autograd adds one tile's part, then the hook fires
            p.grad = torch.ones(4) if p.grad is None else p.grad + 1
            buckets.ready(p)

        buckets.arm(in_parts=True)
        part(norm)  # ungrouped: whole at once
        assert len(buckets._flights) == 1
        for _ in range(3):  # three tiles
            part(wk)
            part(wq)
        assert len(buckets._flights) == 1  # wk's bucket waits: a later tile might add more
        part(embed)  # backward has left the block
        assert [f[0][0] for f in buckets._flights] == [norm.grad, wk.grad, wq.grad, embed.grad]
        buckets.finish()
        assert [p.grad.tolist() for p in params] == [[1.0] * 4, [3.0] * 4, [3.0] * 4, [1.0] * 4]

        for p in params:
            p.grad = None
        buckets.arm(in_parts=False)  # whole blocks: each gradient goes at its one hook, as before
        part(norm)
        part(wk)
        assert [f[0][0] for f in buckets._flights] == [norm.grad, wk.grad]
        buckets.finish()
    finally:
        tdist.destroy_process_group()


def test_resident_counts_its_blocks_in_parts_only_where_they_may_run_in_tiles():
    from slimtune import assembly
    from slimtune.config import ActivationsConfig
    from test_slide import batches, model_of

    model = model_of(2)
    tiled = engine_config(activations=ActivationsConfig(checkpoint="recompute", seq_tile=4))
    for cfg, seq, expected in ((tiled, 12, True), (tiled, 4, False), (engine_config(), 12, False)):
        engine = assembly.assemble(cfg, assembly.stack_of(model, cfg, dist_cases.CPU, "fp64"), dist_cases.CPU, "fp64")
        assert engine._in_tiles(batches(model.config.vocab_size, 0, micro=1, seq=seq)[0]) is expected, (cfg, seq)
