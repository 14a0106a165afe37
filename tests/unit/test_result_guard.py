"""The rule for result folders, piece by piece (the CLI's side is tests/e2e/test_result_folders.py):
what counts as slimtune's, how a path relates to one slimtune must keep (through links and relative
paths), the temporary folder of a write, and the operating system's error found behind a library's."""

import errno
import os

import pytest
import torch

from slimtune.store import checkpoint, results
from slimtune.errors import UserError


def write_result(folder, kind="merged", body="weights"):
    with results.writing(folder, kind) as tmp:
        (tmp / "model.safetensors").write_text(body)
    return folder


def test_only_a_folder_slimtune_wrote_as_that_kind_with_nothing_added_is_its_own(tmp_path):
    folder = write_result(tmp_path / "merged")
    assert results.written_by_slimtune(folder, "merged")
    assert not results.written_by_slimtune(folder, "adapter")  # an export never replaces a run's adapter
    (folder / "model.safetensors").write_text("damaged")  # changed: still slimtune's file to replace
    assert results.written_by_slimtune(folder, "merged")
    (folder / "notes.txt").write_text("the user's")  # added: no longer slimtune's alone
    assert not results.written_by_slimtune(folder, "merged")
    with pytest.raises(UserError, match="holds files slimtune did not write"):
        write_result(folder)
    assert (folder / "notes.txt").read_text() == "the user's"


def test_a_killed_writes_temporary_folder_is_replaced_and_a_users_of_that_name_is_kept(tmp_path):
    killed = tmp_path / "merged.tmp"
    with pytest.raises(KeyboardInterrupt), results.writing(tmp_path / "merged", "merged") as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise KeyboardInterrupt
    assert not killed.exists()  # removed on the way out
    killed.mkdir()
    (killed / results.MANIFEST).write_text('{"written_by": "slimtune", "kind": "merged", "files": null}')
    write_result(tmp_path / "merged")  # as a kill -9 leaves it: replaced
    assert not killed.exists() and results.written_by_slimtune(tmp_path / "merged", "merged")
    users = tmp_path / "thesis.tmp"
    users.mkdir()
    (users / "chapter1.txt").write_text("mine")
    with pytest.raises(UserError, match="'.*thesis.tmp' holds files slimtune did not write"):
        write_result(tmp_path / "thesis")
    assert (users / "chapter1.txt").read_text() == "mine" and not (tmp_path / "thesis").exists()


def test_relations_to_kept_paths_are_found_through_links_and_relative_paths(tmp_path, monkeypatch):
    base = tmp_path / "models" / "base"
    base.mkdir(parents=True)
    (tmp_path / "link").symlink_to(base)
    monkeypatch.chdir(tmp_path / "models")
    kept = results.existing({"the base model's folder": "base", "nothing": "no/such/path", "empty": None})
    assert [k.what for k in kept] == ["the base model's folder"]
    cases = {tmp_path / "link": "is", tmp_path / "link" / "sub": "lies inside", tmp_path: "holds",
             "../models/./base": "is"}
    for path, relation in cases.items():
        with pytest.raises(UserError, match=f"^X {relation} the base model's folder"):
            results.check_target(path, "merged", "X", kept, "choose another")
    results.check_target(tmp_path / "other", "merged", "X", kept, "choose another")  # apart from it: allowed
    inside_ok = [results.Kept(base, "the run's folder", inside_ok=True)]
    results.check_target(base / "merged", "merged", "X", inside_ok, "choose another")


def test_a_manifest_names_the_damaged_file_and_a_folder_without_one_loads_as_it_is(tmp_path):
    folder = write_result(tmp_path / "merged", body="0123456789")
    results.verify(folder, "model folder")
    (folder / "model.safetensors").write_text("0123456789"[::-1])
    with pytest.raises(UserError, match="model.safetensors has changed since it was written"):
        results.verify(folder, "model folder")
    (folder / results.MANIFEST).unlink()
    results.verify(folder, "model folder")  # a folder from elsewhere: nothing to check it against


def test_the_operating_systems_error_is_found_behind_torchs_and_safetensors_wrappers(tmp_path):
    def wrapped_by_torch():
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    with pytest.raises(RuntimeError) as torch_style:
        wrapped_by_torch()
    said = checkpoint.write_failure(torch_style.value, tmp_path / "step-00000002", needed=3 << 20)
    assert said.startswith(f"no space left on the device to write '{tmp_path / 'step-00000002'}' (it needs about"
                           " 3.0 MiB, ")
    safetensors_style = Exception("Error while serializing: I/O error: Read-only file system (os error 30)")
    assert "Read-only file system" in checkpoint.write_failure(safetensors_style, tmp_path / "merged")
    assert checkpoint.write_failure(ValueError("a bug"), tmp_path / "merged") is None
    assert checkpoint.write_failure(torch.OutOfMemoryError("no"), tmp_path) is None


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_written_folder_s_files_are_as_readable_as_any_new_file_safetensors_ones_too(tmp_path, umask):
    """safetensors writes its files 0600 (safetensors/safetensors#782): an adapter another user could not
    load. Every file of a result or checkpoint folder takes the mode the umask gives a new file."""
    from safetensors.torch import save_file

    before = os.umask(umask)
    try:
        with results.writing(tmp_path / "adapter", "adapter") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "adapter_model.safetensors"))
            (tmp / "adapter_config.json").write_text("{}")
            written = (tmp / "adapter_model.safetensors").stat().st_mode & 0o777  # what safetensors gave it
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "adapter").iterdir()}
    finally:
        os.umask(before)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), (modes, oct(written))
