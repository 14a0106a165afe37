"""Timeline pictures of simulated schedules: one panel a schedule, one lane a worker.

Each worker's lane holds its compute (forward, recompute, backward, fused tail) as a tall bar and
its host-link copies (weights up, gradients down) as a thin strip beneath; the host's optimizer has
a lane of its own at the bottom. A panel shows about three steps around the start of the
steady-state window (shaded), and its title carries the bubble and step time measured in that
window. matplotlib (Agg backend) is imported only here, on first use.
"""

from __future__ import annotations

from pathlib import Path

from slimtune.errors import UserError
from slimtune.engines.roundpipe.schedule import Schedule

COLOURS = {
    "forward": "#4C78A8",
    "recompute": "#9ECAE9",
    "backward": "#F58518",
    "tail": "#B279A2",
    "optimizer": "#54A24B",
    "upload": "#7F7F7F",
    "download": "#3B3B3B",
}
LEGEND = ("forward", "recompute", "backward", "tail", "optimizer", "upload", "download")


def _bars(schedule: Schedule, low: float, high: float) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(worker, kind) -> [(start, width)] for events that overlap [low, high) (worker -1: the host)."""
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in schedule.events:
        if e.start < high and e.end > low and e.end > e.start:
            bars.setdefault((e.worker, e.kind), []).append((e.start, e.end - e.start))
    return bars


def _shown(schedule: Schedule) -> tuple[float, float]:
    """About three steps: one before the steady-state window and two or more inside it."""
    low, high = schedule.window
    step = schedule.step_time
    return max(0.0, low - step), min(high, low + 3 * step)


def _panel(ax, schedule: Schedule) -> None:
    low, high = schedule.window
    start, stop = _shown(schedule)
    n = schedule.workers
    for (worker, kind), spans in _bars(schedule, start, stop).items():
        row = n if worker < 0 else worker  # the host below the last worker
        if kind in ("upload", "download"):
            ax.broken_barh(spans, (row + 0.3, 0.18), facecolors=COLOURS[kind], linewidth=0, zorder=2)
        else:
            ax.broken_barh(spans, (row - 0.4, 0.65), facecolors=COLOURS.get(kind, "#000000"), linewidth=0, zorder=2)
    ax.axvspan(low, high, color="#FFF3C4", linewidth=0, zorder=0)
    ax.set_xlim(start, stop)
    ax.set_ylim(n + 0.6, -0.6)
    ax.set_yticks(range(n + 1), [f"GPU {w}" for w in range(n)] + ["host"])
    ax.set_xlabel("seconds")
    ax.set_title(f"{schedule.name}: bubble {schedule.bubble:.1%}, step {schedule.step_time * 1e3:,.0f} ms "
                 f"(steady state shaded)", fontsize=10, loc="left")


def write_png(schedules: list[Schedule], path: str) -> Path:
    """One PNG, a panel per schedule; the costs' label (modelled or measured) heads the figure."""
    if not schedules:
        raise ValueError("no schedules to draw")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = schedules[0].workers + 1
    fig, axes = plt.subplots(len(schedules), 1, figsize=(14, (0.32 * rows + 1.1) * len(schedules)), squeeze=False)
    for ax, schedule in zip(axes[:, 0], schedules):
        _panel(ax, schedule)
    fig.legend(handles=[Patch(color=COLOURS[k], label=k) for k in LEGEND], loc="upper right", ncol=len(LEGEND),
               fontsize=8, frameon=False)
    label = schedules[0].costs_label
    fig.suptitle("costs " + (label if len(label) < 160 else label[:157] + "..."), fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    try:
        fig.savefig(out.with_name(out.name + ".part"), dpi=110, format="png")
        out.with_name(out.name + ".part").replace(out)  # never a half-written picture
    except OSError as err:
        raise UserError(f"cannot write the timeline to '{path}' ({err}).") from None
    finally:
        plt.close(fig)
    return out
