"""Run metrics: metrics.jsonl (one object per logged step), TensorBoard when installed,
a PNG plot of loss and device memory, and the layout of the final summary table."""

from __future__ import annotations

import json
from pathlib import Path

from slimtune.checkpoint import atomic_write_text


class MetricsLog:
    def __init__(self, output_dir: Path, resume_step: int = 0):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.records = self._kept_records(resume_step)
        # A resumed run drops what the killed run logged after its last checkpoint.
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._handle = open(self.path, "a")
        self._tensorboard = _tensorboard_writer(Path(output_dir) / "tensorboard")

    def _kept_records(self, resume_step: int) -> list[dict]:
        """What the run logged up to its checkpoint; a line torn by a kill (or damaged) ends what is kept."""
        if resume_step == 0 or not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                break
            records.append(record)
        return [r for r in records if r["step"] <= resume_step]

    def log(self, record: dict) -> None:
        self.records.append(record)
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._handle.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def plot(self, path: Path) -> Path | None:
        """Loss (train and eval) and device peak bytes against step, as a PNG."""
        train = [r for r in self.records if "loss" in r]
        if not train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        top.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
        evals = [r for r in self.records if "eval_loss" in r]
        if evals:
            top.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        top.set_ylabel("loss")
        top.legend()
        measured = [r for r in train if r["device_peak_bytes"] is not None]
        bottom.plot([r["step"] for r in measured], [r["device_peak_bytes"] / 2**20 for r in measured])
        bottom.set_ylabel("device peak (MiB, measured)")
        bottom.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(folder))


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
