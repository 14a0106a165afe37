"""A damaged or foreign model file ends `slimtune train` in one sentence naming the folder and the file:
exit 2, no traceback, and no output folder."""

import pytest
import torch

from e2e_helpers import slimtune, workdir  # noqa: F401  (workdir is a fixture)


def truncate(model):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def replace_with_foreign_tensors(model):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(model / "model.safetensors"))


DAMAGE = {
    "truncated": (truncate, "model.safetensors is not a readable safetensors file"),
    "foreign": (replace_with_foreign_tensors, "the weights in model.safetensors hold none of the 2 layers its "
                "config.json describes; they are another model's or damaged"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_model_file_ends_in_one_sentence(workdir, case):
    damage, says = DAMAGE[case]
    damage(workdir / "model")
    proc = slimtune("train", "run.yaml", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("slimtune: error: model folder 'model': ") and says in lines[0]
    assert not (workdir / "out").exists()
