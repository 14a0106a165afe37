"""Under data parallelism over several machines, only the job's rank 0 writes (checkpoints, the
result): every machine's first process has LOCAL_RANK 0, and only one of them is the job's rank 0.
Every other test runs one machine, where the two coincide."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from test_slide import model_of
from slimtune.store import checkpoint
from slimtune import export
from slimtune.store.checkpoint import EngineState
from slimtune.dist.ranks import Dist
from slimtune.model.stack import Stack

# The first process on the second of two machines (two processes each): RANK 2, LOCAL_RANK 0.
SECOND_MACHINE = dict(rank=2, local_rank=0, world_size=4, local_world_size=2)


def state() -> EngineState:
    weights = {"w": torch.ones(2, 3)}
    return EngineState(engine="resident", step=1, trainable=weights, exp_avg={"w": torch.zeros(2, 3)},
                       exp_avg_sq={"w": torch.zeros(2, 3)}, adam_steps={"w": 1.0})


def test_the_main_process_is_the_jobs_rank_0_not_each_machines_first():
    assert Dist(rank=0, local_rank=0, world_size=4, local_world_size=2).is_main
    assert not Dist(**SECOND_MACHINE).is_main
    assert not Dist(rank=1, local_rank=1, world_size=4, local_world_size=2).is_main


def test_another_machines_first_process_writes_no_checkpoint_and_no_result(tmp_path, tokenizer):
    second, main = Dist(**SECOND_MACHINE), Dist(rank=0, local_rank=0, world_size=4, local_world_size=2)
    checkpoint.save(tmp_path / "second", 1, state(), {}, keep_last=1, dist=second)
    assert not (tmp_path / "second").exists()
    saved = checkpoint.save(tmp_path / "main", 1, state(), {}, keep_last=1, dist=main)  # the same call on rank 0
    assert (saved / "meta.json").is_file()
    model = model_of(layers=1, dtype=torch.float32)
    for dist, out in ((second, tmp_path / "second"), (main, tmp_path / "main")):
        cfg = SimpleNamespace(method="full", data=SimpleNamespace(format="text", chat_template=None))
        run = SimpleNamespace(dist=dist, cfg=cfg, stack=Stack(model), tokenizer=tokenizer,
                              engine=SimpleNamespace(trainable_state=dict))
        export.save_result(run, out)
    assert not (tmp_path / "second").exists()
    assert (tmp_path / "main" / "model" / "model.safetensors").is_file()


WORKER = """
import json, sys
from pathlib import Path
import torch
from slimtune.store import checkpoint
from slimtune.dist import ranks as distributed
from slimtune.store.checkpoint import EngineState
dist = distributed.from_env(60.0)
weights = {"w": torch.ones(2, 3)}
state = EngineState("resident", 1, weights, {"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)}, {"w": 1.0})
checkpoint.save(Path(sys.argv[1]), 1, state, {}, keep_last=1, dist=dist)
dist.barrier("the test's end")
print(json.dumps({"rank": dist.rank, "local_rank": dist.local_rank, "is_main": dist.is_main}))
dist.close()
"""


def test_two_machines_one_process_each_only_rank_0_writes(tmp_path):
    """Two processes joined as torchrun starts one on each of two machines (RANK 0 and 1, LOCAL_RANK 0
    both), each with its own output folder: the second machine's writes nothing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**__import__("os").environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / f"machine{rank}")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    said = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        said.append(json.loads(out.strip().splitlines()[-1]))
    assert said == [{"rank": 0, "local_rank": 0, "is_main": True}, {"rank": 1, "local_rank": 0, "is_main": False}]
    assert (tmp_path / "machine0" / "checkpoints" / "step-00000001" / "meta.json").is_file()
    assert not Path(tmp_path / "machine1").exists()
