"""Memory-mapped state on a disk without room (issue 28, item 3): every state file's blocks are
reserved before it is mapped (a sparse file mapped and written dies of SIGBUS where the disk cannot
back a page), a disk that cannot take them all is one sentence naming the setting, the folder, the
bytes the state needs in all and the bytes free, and no state file is left; a file system that
cannot reserve gets the sparse file it got before, and other failures name the setting and folder.
The full disk is a real tmpfs where this machine can mount one, else a fake posix_fallocate
(tests/small_disk.py). And a scratch folder removed takes the folders above it that its process
made, while they are empty, and no other."""

import errno
import os
import re

import pytest
import torch

from small_disk import fake_full, small_disk
from test_chunk import engine_of, model_of, run_cfg
from slimtune.device import runtime
from slimtune.engines.chunk.state import ON_DISK
from slimtune.engines.chunk.engine import ChunkConfig
from slimtune.errors import UserError
from slimtune.units import human_bytes
from slimtune.optim.host_adam import MOMENTS_ON_DISK, Group, HostAdam, moments_folder

CPU = torch.device("cpu")
SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8}
FILE = 256 << 10  # bytes of each state file below: one fp32 (256, 256) matrix
GROUPS = [Group((torch.Size([256, 256]),), 0.0)]


class Owner:
    """What a scratch folder goes with (an engine, a chunk state): collected, it takes the folder."""


def adam(folder, masters_on_disk=False) -> HostAdam:
    return HostAdam("unit", GROUPS, torch.float32, CPU, SETTINGS, moments_dir=folder, masters_on_disk=masters_on_disk)


def test_state_files_hold_their_blocks_before_they_are_mapped(tmp_path):
    built = adam(tmp_path, masters_on_disk=True)
    files = sorted(tmp_path.glob("*.bin"))
    assert len(files) == 3  # the master and two moments
    for path in files:
        assert path.stat().st_size == FILE and path.stat().st_blocks * 512 >= FILE, path.name  # not sparse
    built.member(0, 0).grad.fill_(1.0)
    built.update(1e-2)
    assert torch.all(built.member(0, 0).master != 0)


def test_a_disk_without_room_for_the_second_file_is_one_sentence_and_keeps_no_file(tmp_path, monkeypatch):
    with small_disk(tmp_path / "small") as disk:
        room = FILE + FILE // 2  # the first moment file fits, the second does not
        users_file = disk.fill(leave=room)
        if not disk.real:
            fake_full(monkeypatch, room)
        root = disk.folder / "moments"
        owner = Owner()  # the folder lives as long as it does
        folder = moments_folder(owner, root, MOMENTS_ON_DISK, need=2 * FILE)
        with pytest.raises(UserError) as refused:
            adam(folder)
        free = human_bytes(room) if disk.real else r"[\d.]+ \w+"
        assert refused.match(
            rf"^slide\.moments=disk needs 512\.0 KiB for the AdamW moments in '{re.escape(str(root))}',"
            rf" which has {free} free; free space there, set slide\.moments_dir elsewhere, or use"
            r" slide\.moments=ram\.$")
        assert [p.name for p in disk.folder.iterdir()] == [users_file.name]  # the folder it made went too


def test_chunk_state_on_a_full_disk_names_all_it_needs(tmp_path, monkeypatch):
    model_cfg = run_cfg(ChunkConfig(n_chunks=3, state="disk", state_dir=str(tmp_path / "room")))
    needed = engine_of(model_of(layers=2), model_cfg).state.disk_bytes()
    root = tmp_path / "full"
    fake_full(monkeypatch, room=needed // 3)  # a disk that takes the first chunk's files only
    with pytest.raises(UserError) as refused:
        engine_of(model_of(layers=2), run_cfg(ChunkConfig(n_chunks=3, state="disk", state_dir=str(root))))
    assert str(refused.value).startswith(f"chunk.state=disk needs {human_bytes(needed)} for {ON_DISK.what} in '{root}'")
    assert not root.exists()


def test_a_file_system_that_cannot_reserve_gets_sparse_files(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    owner = Owner()
    built = adam(moments_folder(owner, tmp_path / "m", MOMENTS_ON_DISK, need=2 * FILE))
    assert sorted(p.stat().st_size for p in (tmp_path / "m").rglob("*.bin")) == [FILE, FILE]
    built.member(0, 0).grad.fill_(1.0)
    built.update(1e-2)
    assert torch.all(built.state(0)["exp_avg"] != 0)  # written through the map


def test_another_failure_at_creation_names_the_setting_and_the_folder(tmp_path, monkeypatch):
    def broken(fd, offset, length):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "posix_fallocate", broken)
    root, owner = tmp_path / "state", Owner()
    with pytest.raises(UserError) as refused:
        adam(moments_folder(owner, root, ON_DISK))
    assert str(refused.value) == (f"chunk.state_dir '{root}' cannot hold the chunks' masters and AdamW moments"
                                  " (Input/output error).")
    assert not root.exists()


def test_a_plain_folder_given_keeps_everything_but_the_files_reserved_in_it(tmp_path, monkeypatch):
    (tmp_path / "thesis.txt").write_text("mine")
    fake_full(monkeypatch, room=FILE)
    with pytest.raises(UserError, match="cannot hold state files"):
        adam(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.txt"]


def test_a_scratch_folder_takes_the_folders_it_made_while_empty_and_no_other(tmp_path):
    made = runtime.scratch_folder(tmp_path / "a" / "b", "adam", "chunk.state_dir")
    users = runtime.scratch_folder(tmp_path, "adam", "chunk.state_dir")  # tmp_path was there before
    shared = runtime.scratch_folder(tmp_path / "c", "adam", "chunk.state_dir")
    other_run = runtime.scratch_folder(tmp_path / "c", "adam", "chunk.state_dir")
    for scratch in (made, users, shared):
        (scratch.path / "x.bin").write_bytes(b"x")
        scratch.remove()
    assert not (tmp_path / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert list((tmp_path / "c").iterdir()) == [other_run.path]  # another run's folder keeps the root
