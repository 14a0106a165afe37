"""A full disk under memory-mapped state (chunk.state=disk, slide.moments=disk) through the CLI on the
tiny model: one sentence naming the setting, the folder, the bytes needed and free, exit 2 (not a
Bus error: a sparse file mapped and written dies of SIGBUS where the disk cannot back a page), and
nothing of the user's lost. The disk is a real 1 MiB tmpfs where the machine can mount one, else a
fake posix_fallocate that fails for lack of room (tests/small_disk.py). And a finished run leaves no
empty scratch folder behind that it made, while a folder of the user's stays."""

import hashlib

import pytest

from e2e_helpers import slimtune, slimtune_here, workdir  # noqa: F401  (workdir is a fixture)
from small_disk import small_disk

STATE = {
    "chunk.state=disk": (["engine=chunk", "method=full", "chunk.n_chunks=2", "chunk.state=disk"], "chunk.state_dir",
                         "the chunks' masters and AdamW moments", "chunk.state=ram"),
    "slide.moments=disk": (["engine=slide", "method=full", "activations.checkpoint=host", "slide.moments=disk"],
                           "slide.moments_dir", "the AdamW moments", "slide.moments=ram"),
}
LEFT = 64 << 10  # what the user's file leaves free on the tmpfs: less than either state needs


def snapshot(folder):
    """Every file's bytes but the lock's (it holds the pid of the run that last took the folder)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("mode", list(STATE))
def test_a_full_disk_under_mapped_state_is_one_sentence_and_the_run_stays_resumable(workdir, mode):
    settings, key, what, instead = STATE[mode]
    with small_disk(workdir / "small") as disk:
        where = disk.folder / "state"
        run = ["train", "run.yaml", *settings, f"{key}={where}", "train.save_every=2", "--no-progress"]
        # the run to resume, its state on the small disk: in this process (the refusal is the one checked)
        slimtune_here(*run, "train.steps=2", cwd=workdir)
        before = snapshot(workdir / "out")
        assert any(name.startswith("checkpoints/") for name in before)
        users_file = disk.fill(leave=LEFT)
        kept = users_file.read_bytes()

        refused = disk.cli(*run, "train.steps=4", cwd=workdir, full=True)

        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr
        sentence = refused.stderr.strip().splitlines()[-1]
        assert sentence.startswith(f"slimtune: error: {mode} needs ")
        assert f" KiB for {what} in '{where}', which has " in sentence
        assert sentence.endswith(f" free; free space there, set {key} elsewhere, or use {instead}.")
        if disk.real:
            assert "which has 64.0 KiB free" in sentence
        assert snapshot(workdir / "out") == before  # the checkpoints, run.json, the result: untouched
        assert [p.name for p in disk.folder.iterdir()] == [users_file.name]  # no state file, no folder
        assert users_file.read_bytes() == kept


def test_a_finished_run_leaves_no_scratch_folder_it_made_and_keeps_the_users(workdir):
    users = workdir / "scratch"
    users.mkdir()
    (users / "thesis.txt").write_text("mine")
    slimtune("train", "run.yaml", "engine=slide", "method=full", "slide.moments=disk", "activations.checkpoint=disk",
             f"activations.disk_dir={users}", "train.steps=2", "--no-progress", cwd=workdir)
    out = workdir / "out"
    assert (out / "model").is_dir()
    assert not (out / "moments").exists()  # output_dir/moments: made by the run, empty at its end
    assert [p.name for p in users.iterdir()] == ["thesis.txt"]
