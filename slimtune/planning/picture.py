"""`slimtune plan --png`: the plans as one picture, a stacked bar a plan.

Each bar is a plan's device peak split by memory.CATEGORIES (as the training meter counted it at
the peak, on fake tensors), then the CUDA context the planner assumes (hatched: assumed, not
measured). A dashed line marks the card's memory, so a bar that crosses it does not fit the device;
the words after each bar say whether the plan fits and, if not, what it lacks, as planner.table
does. The recommended plan is outlined and its label bold. matplotlib is imported only here, on
first use, and draws through its Agg canvas (no pyplot: no global backend, nothing left open).
"""

from __future__ import annotations

import contextlib
import os
import textwrap
from pathlib import Path

from slimtune.device import memory
from slimtune.errors import UserError
from slimtune.units import human_bytes
from slimtune.planning.planner import CUDA_OVERHEAD_BYTES, HOST_RAM_SHARE, Machine, PlanResult

GIB = 2**30
COLOURS = {
    "weights": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "loss": "#B279A2",
    "temporaries": "#9D755D",
    "unattributed": "#D0D0D0",
    "total": "#8C8C8C",
}
CUDA_LABEL = "CUDA context (assumed)"
TOTAL_LABEL = "total (no breakdown)"
LABEL_WIDTH = 36  # characters a line of a plan's label; an nf4 + checkpoint + loss plan takes three


def segments(result: PlanResult) -> list[tuple[str, int]]:
    """(name, bytes) left to right, the device peak only (the CUDA context is drawn apart, assumed).
    The meter's breakdown is taken at the peak, so it sums to it; any part it leaves out is shown
    as unattributed rather than silently shortening the bar."""
    peak = result.estimate.device_peak_bytes
    breakdown = result.estimate.breakdown or {}
    parts = [(c, int(breakdown.get(c, 0))) for c in memory.CATEGORIES if breakdown.get(c, 0) > 0]
    if not parts:
        return [("total", peak)]
    rest = peak - sum(b for _, b in parts)
    return parts + ([("unattributed", rest)] if rest > 0 else [])


def status(result: PlanResult) -> str:
    """What planner.table says in its fits column."""
    said = "\u2713 fits" if result.fits else "\u2717 no (" + ", ".join(result.short) + ")"
    return said + ("  \u2190 recommended" if result.recommended else "")


def plan_label(result: PlanResult) -> str:
    return textwrap.fill(f"{result.engine} {result.label}".strip(), LABEL_WIDTH)


def _draw_bar(ax, row: int, result: PlanResult, x_room: float) -> None:
    left = 0.0
    for name, size in segments(result):
        ax.barh(row, size / GIB, left=left, color=COLOURS[name], height=0.7, zorder=2)
        left += size / GIB
    ax.barh(row, CUDA_OVERHEAD_BYTES / GIB, left=left, color="white", edgecolor="#555555", hatch="///",
            linewidth=0.6, height=0.7, zorder=2)
    left += CUDA_OVERHEAD_BYTES / GIB
    if result.recommended:  # an outline round the whole bar: what `plan=auto` would run
        ax.barh(row, left, fill=False, edgecolor="black", linewidth=2.2, height=0.78, zorder=3)
    ax.text(left + x_room, row, status(result), va="center", fontsize=8, zorder=4,
            color="#1A7F37" if result.fits else "#B00020", fontweight="bold" if result.recommended else "normal",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


def _draw_card(ax, machine: Machine) -> None:
    """The card's memory: the device peak is per card, so with several cards the line is one card's."""
    card = machine.gpu.memory_bytes / GIB
    per = " per card" if machine.cards > 1 else ""
    words = f"{machine.gpu.name}: {human_bytes(machine.gpu.memory_bytes)}{per}"
    ax.axvline(card, color="#C00000", linestyle="--", linewidth=1.4, zorder=1, label=words)
    # Named just above the frame, where no bar's status text reaches (inside, at the bottom, it crossed
    # the last rows' texts); the title stands a row higher to leave it room (plan_figure).
    ax.text(card, 1.005, words, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
            fontsize=8, color="#C00000", clip_on=False)


def _legend(ax, results: list[PlanResult]) -> None:
    """Only the parts some bar shows, in the meter's order, then the assumed context and the card."""
    from matplotlib.patches import Patch

    shown = {name for r in results for name, _ in segments(r)}
    handles = [Patch(color=COLOURS[n], label=TOTAL_LABEL if n == "total" else n) for n in COLOURS if n in shown]
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="///", label=CUDA_LABEL))
    handles += ax.get_legend_handles_labels()[0]  # the card's line
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def footnote() -> str:
    return textwrap.fill(
        "Device peak: the planner's estimate, the real training step run on fake tensors and counted by the "
        f"training loop's meter (measured on fake tensors, not on a card). The {human_bytes(CUDA_OVERHEAD_BYTES)} "
        f"CUDA context is assumed, not measured. Fits: peak + CUDA context <= the card, host RAM <= "
        f"{HOST_RAM_SHARE:.0%} of the host's, disk <= the free disk.", 140)


def figure(results: list[PlanResult], machine: Machine, title: str):
    """The picture as a matplotlib Figure (bars top to bottom in the order given)."""
    from matplotlib.figure import Figure

    lines = max(plan_label(r).count("\n") + 1 for r in results)
    # tall enough for the legend beside even a single bar
    fig = Figure(figsize=(13, max(3.4, 1.9 + len(results) * (0.2 + 0.16 * lines))), dpi=100)
    ax = fig.add_subplot()
    widest = max(machine.gpu.memory_bytes, *(r.estimate.device_peak_bytes + CUDA_OVERHEAD_BYTES for r in results))
    ax.set_xlim(0, widest / GIB * 1.38)  # room after the widest bar for its words
    for row, result in enumerate(results):
        _draw_bar(ax, row, result, widest / GIB * 0.01)
    _draw_card(ax, machine)
    ax.set_yticks(range(len(results)), [plan_label(r) for r in results], fontsize=8)
    for tick, result in zip(ax.get_yticklabels(), results):
        tick.set_fontweight("bold" if result.recommended else "normal")
    ax.set_ylim(len(results) - 0.4, -0.6)  # the first plan on top, as the table lists it
    ax.set_xlabel("device memory (GiB)")
    ax.grid(axis="x", color="#E6E6E6", zorder=0)
    ax.set_title(textwrap.fill(title, 110), fontsize=10, loc="left", pad=16)  # above the card's name
    _legend(ax, results)
    ax.annotate(footnote(), xy=(0, 0), xycoords="axes fraction", xytext=(0, -34), textcoords="offset points",
                va="top", ha="left", fontsize=7, color="#444444")
    return fig


def check_target(path: str | Path) -> Path:
    """The picture's path, refused in one sentence unless it names a .png file (not a folder)."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise UserError(f"the picture's path {str(path)!r} must end in .png.")
    if target.is_dir():
        raise UserError(f"the picture's path {str(path)!r} is a folder; name a .png file in it.")
    return target


def _save(fig, target: Path) -> None:
    """Beside the target first, then renamed over it: a reader (or a killed run) never finds half a
    PNG, and an older picture at `target` stays whole until the new one is complete."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as out:
            fig.savefig(out, format="png", bbox_inches="tight")
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    except OSError as err:
        raise UserError(f"cannot write the picture {str(target)!r}: {err.strerror or err}.") from None
    finally:
        with contextlib.suppress(OSError):  # gone after the rename, or its folder could not be made
            partial.unlink()


def write_png(results: list[PlanResult], machine: Machine, path: str | Path, title: str) -> Path:
    """The plans (as planner.plan returns them) drawn for `machine` into the PNG at `path`."""
    target = check_target(path)
    if not results:
        raise UserError("there are no plans to draw.")
    _save(figure(results, machine, title), target)
    return target
