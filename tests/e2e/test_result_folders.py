"""The folders slimtune writes as results (a run's adapter/ or model/, a merged export), through the CLI
in-process:

- slimtune replaces a folder only when it wrote it, and never the base model, the run or the data: a
  table over what a user may point `export --out` or `output_dir` at;
- a damaged adapter or model (cut short, or one byte changed) is one sentence naming the file in
  export, chat and eval; an adapter from elsewhere (no manifest) still loads;
- a full disk while writing a checkpoint, the result or an export, and an export into a folder that
  cannot be written, end in one sentence with nothing lost; after freeing space the run goes on;
- a run whose adapter/ is gone loads its newest intact checkpoint in export, chat and eval.

Full disks and read-only folders are real where this process may mount a tmpfs (as root), else a
fake raises the operating system's error where slimtune's folder writes are synced."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import save_tiny_model, write_jsonl
from e2e_helpers import write_sums
from slimtune.store import checkpoint
from slimtune import cli, train

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so its module fixture
# (project) is built once, not once on each worker.
pytestmark = pytest.mark.xdist_group("test_result_folders")

MANIFEST = "slimtune-result.json"  # MANIFEST, spelled out: a user's tools may look for it by name

RUN_YAML = ("model: model\n"
            "data: {path: train.jsonl, format: prompt_response, max_length: 64}\n"
            "method: lora\n"
            "lora: {rank: 4, alpha: 8}\n"
            "train: {steps: 4, batch_size: 4, lr: 1.0e-3, warmup_steps: 1, save_every: 2}\n"
            "output_dir: out\n")


@pytest.fixture(scope="module")
def project(tmp_path_factory, tokenizer) -> Path:
    """A project folder trained once for the module: model/, train.jsonl, run.yaml and the LoRA run out/
    (4 steps, checkpoints at 2 and 4, the result adapter/)."""
    root = tmp_path_factory.mktemp("project")
    save_tiny_model(root / "model", tokenizer)
    write_sums(root / "train.jsonl")
    (root / "run.yaml").write_text(RUN_YAML)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert cli.main(["train", "run.yaml", "--no-progress"]) == 0
    return root


@pytest.fixture()
def here(project, tmp_path, monkeypatch) -> Path:
    """A copy of the project to change, as the working directory."""
    copy = tmp_path / "project"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.chdir(copy)
    return copy


def whole(folder: Path, kind: str) -> None:
    """`folder` is a `kind` result slimtune wrote, every file as its manifest records it."""
    from slimtune.store import results

    results.verify(folder, kind)
    assert results.written_by_slimtune(folder, kind)


def tree(folder: Path) -> dict:
    """Every file under `folder` with a hash of its bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def one_sentence(capsys, code: int, *needles: str) -> str:
    """The command ended with exit 2 and one line holding every needle, no traceback; returns it."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("slimtune: error: ") and err.count("\n") == 0 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def export(*args: str) -> int:
    return cli.main(["export", "out", "--merge", *args])


def fit(*overrides: str) -> int:
    return cli.main(["train", "run.yaml", "--no-progress", *overrides])


def nothing_loads(monkeypatch) -> None:
    """A refusal is said before the model loads: loading it fails the test."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr("slimtune.model.stack.load_model", loaded)
    monkeypatch.setattr(train, "build", loaded)


# ---------------------------------------------------------------- 1. what slimtune may replace


def user_folder(here):
    (here / "victim").mkdir()
    (here / "victim" / "thesis.txt").write_text("four years of work")


def link_to_the_base_model(here):
    (here / "link").symlink_to(here / "model")


def user_adapter_folder(here):
    (here / "mine" / "adapter").mkdir(parents=True)
    (here / "mine" / "adapter" / "notes.txt").write_text("mine")


def user_folder_named_like_a_temporary_one(here):
    (here / "notes.tmp").mkdir()
    (here / "notes.tmp" / "draft.txt").write_text("mine")


def exported_earlier(here):
    assert export("--out", "earlier") == 0
    (here / "earlier" / "config.json").write_text("{}")  # changed since: still slimtune's folder to replace


def nothing(here):
    del here


# (command, set-up, what it must say; None: it succeeds and writes `written`)
TABLE = {
    "export into a user's folder": (["export", "--out", "victim"], user_folder,
                                    "--out 'victim' holds files slimtune did not write (thesis.txt)"),
    "export into the run itself": (["export", "--out", "out"], nothing, "--out 'out' is the run's folder ('out')"),
    "export into the base model": (["export", "--out", "model"], nothing,
                                   "--out 'model' is the base model's folder"),
    "export inside the base model": (["export", "--out", "model/merged"], nothing,
                                     "--out 'model/merged' lies inside the base model's folder"),
    "export over a link to the base model": (["export", "--out", "link"], link_to_the_base_model,
                                             "--out 'link' is the base model's folder"),
    "export into a folder holding the run": (["export", "--out", "."], nothing, "--out '.' holds the run's folder"),
    "export over the run's adapter": (["export", "--out", "out/adapter"], nothing,
                                      "--out 'out/adapter' is the run's adapter"),
    "export over the data": (["export", "--out", "train.jsonl"], nothing, "is the training data (data.path)"),
    "export beside a user's folder named like its temporary one": (
        ["export", "--out", "notes"], user_folder_named_like_a_temporary_one, "'notes.tmp' holds files slimtune did"
        " not write"),
    "train a full run into . holding the base model as ./model": (
        ["train", "method=full", "output_dir=."], nothing,
        "the result folder 'model' of output_dir '.' is the base model's folder ('model')"),
    "train into a folder inside the base model": (
        ["train", "output_dir=model/run"], nothing, "lies inside the base model's folder ('model')"),
    "train over a user's adapter/": (["train", "output_dir=mine"], user_adapter_folder,
                                     "the result folder 'mine/adapter' of output_dir 'mine' holds files slimtune did"
                                     " not write (notes.txt)"),
    "export over a merged model slimtune wrote": (["export", "--out", "earlier"], exported_earlier, None),
    "export into a new folder": (["export", "--out", "new/merged"], nothing, None),
    "train.overwrite beside the base model as ./model": (
        ["train", "output_dir=.", "train.overwrite=true", "train.steps=1"], nothing, None),
}


@pytest.mark.parametrize("case", TABLE)
def test_a_result_replaces_only_a_folder_slimtune_wrote(here, capsys, monkeypatch, case):
    (command, *args), set_up, says = TABLE[case]
    set_up(here)
    before = tree(here)
    if says is not None:
        if "temporary" not in case:  # that one is found where the folder is written, after the model loads
            nothing_loads(monkeypatch)
        one_sentence(capsys, export(*args) if command == "export" else fit(*args), says)
        assert tree(here) == before, "a refused command changed the project"
        return
    assert (export(*args) if command == "export" else fit(*args)) == 0
    after = tree(here)
    kept = {k: v for k, v in before.items() if not k.startswith(("earlier/", "out/"))}
    assert {k: after.get(k) for k in kept} == kept, "a file of the user's or the run's changed"
    if command == "export":
        written = Path(args[-1])
        whole(written, "merged")  # by its manifest: a folder changed since was written anew
        assert not written.with_name(written.name + ".tmp").exists()
    else:
        assert (here / "adapter" / MANIFEST).is_file() and (here / "model" / "model.safetensors").is_file()


def test_written_folders_load_in_transformers_and_peft_beside_their_manifest(here):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert export("--out", "merged") == 0
    for folder, kind in ((here / "out" / "adapter", "adapter"), (here / "merged", "merged")):
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["kind"] == kind and set(manifest["files"]) == {
            p.name for p in folder.iterdir() if p.name != MANIFEST}
    AutoModelForCausalLM.from_pretrained(str(here / "merged"))
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(here / "model")), str(here / "out" / "adapter"))


# ---------------------------------------------------------------- 9. damaged results


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    """One byte of the tensor data changed, the size kept: only a checksum tells."""
    blob = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(blob[:8], "little")
    blob[header + (len(blob) - header) // 2] ^= 0x5A
    path.write_bytes(bytes(blob))


def commands(here: Path) -> dict[str, list[str]]:
    write_jsonl(here / "eval.jsonl", [{"prompt": "question: what is 1 plus 2? answer:", "response": " 3"}])
    return {"export": ["export", "out", "--merge"],
            "chat": ["chat", "out", "--prompt", "question: what is 1 plus 2? answer:", "--max-new-tokens", "2"],
            "eval": ["eval", "out", "--data", "eval.jsonl", "--max-new-tokens", "2"]}


@pytest.mark.parametrize("damage, says", [(cut_short, "adapter_model.safetensors has "),
                                          (flip_a_byte, "adapter_model.safetensors has changed since it was written")])
def test_a_damaged_adapter_is_one_sentence_naming_the_file(here, capsys, damage, says):
    damage(here / "out" / "adapter" / "adapter_model.safetensors")
    for name, argv in commands(here).items():
        one_sentence(capsys, cli.main(argv), "adapter folder 'out/adapter' is damaged: ", says)
    assert not (here / "out" / "merged").exists()


def test_an_adapter_without_a_manifest_loads_and_a_cut_short_one_is_named(here, capsys):
    """A PEFT adapter from elsewhere has no manifest: it loads as before, and when it cannot be read
    the sentence says so (as a damaged model file's does)."""
    shutil.copytree(here / "out" / "adapter", here / "foreign")
    (here / "foreign" / MANIFEST).unlink(missing_ok=True)
    assert cli.main(["chat", "foreign", "--prompt", "question: what is 1 plus 2? answer:",
                     "--max-new-tokens", "2"]) == 0
    cut_short(here / "foreign" / "adapter_model.safetensors")
    capsys.readouterr()
    one_sentence(capsys, cli.main(["chat", "foreign", "--prompt", "hi"]),
                 "adapter folder 'foreign': adapter_model.safetensors is not a readable safetensors file")


def test_a_full_runs_model_with_one_byte_changed_is_named(here, capsys):
    assert fit("method=full", "output_dir=full", "train.steps=1", "train.lr=1e-4") == 0
    flip_a_byte(here / "full" / "model" / "model.safetensors")
    capsys.readouterr()
    one_sentence(capsys, cli.main(["chat", "full", "--prompt", "hi"]),
                 "model folder 'full/model' is damaged: model.safetensors has changed since it was written (CRC-32)")


# ---------------------------------------------------------------- 10. a full disk


class SmallDisk:
    """A folder on a filesystem that can be filled: a real 16 MiB tmpfs where this process may mount
    one, else a fake that raises ENOSPC where slimtune's folder writes are synced, as a full disk may."""

    def __init__(self, root: Path):
        self.root, self.ballast = root, root / "ballast"
        root.mkdir(parents=True)
        self.real = mount(root, "size=16m")
        self.fake = pytest.MonkeyPatch()

    def fill(self, leave: int) -> None:
        if not self.real:
            self.fake.setattr(checkpoint, "_fsync_tree", _disk_full)
            return
        size = shutil.disk_usage(self.root).free - leave
        with open(self.ballast, "wb") as handle:
            while size > 0:
                size -= handle.write(b"\1" * min(size, 1 << 20))

    def free(self) -> None:
        self.fake.undo()
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()
        if self.real:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)


def _disk_full(folder):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def mount(folder: Path, options: str) -> bool:
    """Mount a tmpfs at `folder`; False where this process may not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture()
def disk(tmp_path):
    found = SmallDisk(tmp_path / "small")
    yield found
    found.close()


def test_a_full_disk_ends_checkpoints_results_and_exports_in_one_sentence_and_loses_nothing(here, capsys, disk):
    run_dir = disk.root / "run"
    assert fit(f"output_dir={run_dir}") == 0
    checkpoints = run_dir / "checkpoints"
    size = sum(p.stat().st_size for p in (checkpoints / "step-00000004").iterdir())
    capsys.readouterr()

    disk.fill(leave=size // 2)  # room for the log's lines, not for a checkpoint
    one_sentence(capsys, fit(f"output_dir={run_dir}", "train.steps=6"),
                 f"no space left on the device to write '{checkpoints / 'step-00000006'}' (it needs about",
                 "what was written before is intact: free some space and run the same command again")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]
    assert all(checkpoint.damage(p) is None for p in checkpoints.iterdir())
    disk.free()
    assert fit(f"output_dir={run_dir}", "train.steps=6") == 0
    assert "resuming after step 4" in capsys.readouterr().out

    size = sum(p.stat().st_size for p in (run_dir / "adapter").iterdir())
    shutil.rmtree(run_dir / "adapter")  # the result is written again at the end of a run resumed at its last step
    disk.fill(leave=size // 2)
    one_sentence(capsys, fit(f"output_dir={run_dir}", "train.steps=6"),
                 f"no space left on the device to write '{run_dir / 'adapter'}'")
    assert not (run_dir / "adapter").exists() and not (run_dir / "adapter.tmp").exists()
    disk.free()
    assert fit(f"output_dir={run_dir}", "train.steps=6") == 0
    whole(run_dir / "adapter", "adapter")

    disk.fill(leave=4096)
    capsys.readouterr()
    one_sentence(capsys, export("--out", str(disk.root / "merged")),
                 f"no space left on the device to write '{disk.root / 'merged'}'")
    assert not (disk.root / "merged").exists() and not (disk.root / "merged.tmp").exists()


# ---------------------------------------------------------------- 11. a folder that cannot be written


@pytest.fixture()
def read_only(tmp_path, monkeypatch) -> Path:
    """A folder this user cannot write: a read-only tmpfs as root, else a folder without write
    permission; where neither can be made, os.access and the folder's sync say so (a fake)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if mount(folder, "ro,size=1m"):
        yield folder
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        return
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(folder)) and
                        real_access(path, mode))

    def denied(tmp):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp))

    monkeypatch.setattr(checkpoint, "_fsync_tree", denied)
    yield folder


def test_an_export_into_a_folder_that_cannot_be_written_is_one_sentence(here, capsys, monkeypatch, read_only):
    with monkeypatch.context() as mp:
        nothing_loads(mp)
        one_sentence(capsys, export("--out", str(read_only / "merged")),
                     f"--out '{read_only / 'merged'}' is not writable ('{read_only}' does not let this user write)")
    # Were the folder to turn read-only after the check, the write itself says so.
    from slimtune.run import folder as run_folder

    monkeypatch.setattr(run_folder, "check_writable", lambda *args, **kwargs: None, raising=False)
    one_sentence(capsys, export("--out", str(read_only / "merged")), f"cannot write '{read_only / 'merged'}'")
    assert not any(read_only.iterdir())


# ---------------------------------------------------------------- 17. adapter/ gone, checkpoints intact


def test_a_run_without_its_adapter_loads_its_newest_intact_checkpoint(here, capsys):
    shutil.rmtree(here / "out" / "adapter")
    argv = commands(here)
    assert cli.main(argv["export"]) == 0
    assert "merged model (step 4, adapter from out/checkpoints/step-00000004)" in capsys.readouterr().out
    merged = load_file(str(here / "out" / "merged" / "model.safetensors"))
    trained = load_file(str(here / "out" / "checkpoints" / "step-00000004" / "trainable.safetensors"))
    base = load_file(str(here / "model" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    delta = trained[f"{name}.lora_B.weight"] @ trained[f"{name}.lora_A.weight"] * 2.0  # alpha / rank = 8 / 4
    assert (merged[f"{name}.weight"] - base[f"{name}.weight"] - delta).abs().max() < 1e-6
    assert delta.abs().max() > 0
    for name in ("chat", "eval"):
        assert cli.main(argv[name]) == 0
        assert "a checkpoint's adapter at step 4" in capsys.readouterr().err
    flip_a_byte(here / "out" / "checkpoints" / "step-00000004" / "trainable.safetensors")
    (here / "out" / "checkpoints" / "step-00000002" / "meta.json").write_text("{")
    one_sentence(capsys, cli.main(argv["chat"]), "run 'out' holds no adapter/ and no intact checkpoint (checkpoint",
                 "trainable.safetensors has changed since it was written (CRC-32)")
