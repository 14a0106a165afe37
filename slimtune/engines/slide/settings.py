"""Engine slide's settings (the `slide` section), what it refuses, the scratch folders it keeps and
the plans the planner weighs for it. What differs by working set is the working set's to say
(working_set.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slimtune.config import RunConfig, positive, setting
from slimtune.engines.slide.working_set import working_set_of
from slimtune.errors import UserError


@dataclass
class SlideConfig:
    slots: int = setting(2, "engine=slide: device slots, each the size of the largest block (2: one runs while the next loads).")
    head_tile_mb: float = setting(64.0, "engine=slide: MiB of the LM head streamed to the device per vocabulary tile.")
    moments: Literal["ram", "disk"] = setting(
        "ram", "engine=slide: AdamW moments in host RAM, or in memory-mapped files (8 B a weight off the RAM)."
    )
    moments_dir: str | None = setting(
        None, "slide.moments=disk: where the moment files go (default: output_dir/moments).")
    working_set: Literal["all", "chunk"] = setting(
        "all", "engine=slide: all: every tensor has gradients, fp32 masters and AdamW state on the host; chunk:"
               " only the active chunk's (ChunkFT, the chunk.* settings), the host holding bf16 weights besides.")

    def unread_given(self, given: list[str]) -> list[tuple[list[str], str]]:
        """The given settings of this section that its other settings leave unread, each with why."""
        if "slide.moments_dir" in given and self.moments != "disk":
            return [(["slide.moments_dir"], f"slide.moments is {self.moments}, not disk")]
        return []

    def validate(self) -> None:
        if self.slots not in (2, 3):
            raise UserError(f"slide.slots must be 2 or 3, got {self.slots}.")
        positive("slide.head_tile_mb", self.head_tile_mb)


def validate(cfg: RunConfig) -> None:
    """What engine=slide does not do, refused in one sentence each."""
    if cfg.loss.mode != "exact":
        raise UserError("engine=slide streams the LM head for the exact loss; set loss.mode=exact.")
    if cfg.quant.embeddings:
        raise UserError("engine=slide keeps the embedding and LM head on the host in full precision;"
                        " set quant.embeddings=false.")
    if cfg.activations.checkpoint == "recompute":
        raise UserError("engine=slide keeps block inputs in host RAM or on disk; set activations.checkpoint=host"
                        " (or disk).")
    if cfg.activations.cache != "none":
        raise UserError("engine=slide keeps only each block's input; set activations.cache=none.")
    working_set_of(cfg).refuse(cfg)


def scratch(cfg: RunConfig) -> dict[str, str]:
    """slide.moments=disk keeps the AdamW moments in files under slide.moments_dir; the working set
    its own (a chunk working set with chunk.state=disk its state under chunk.state_dir)."""
    section, folders = cfg.section("slide"), {}
    if section.moments == "disk":
        folders["slide.moments_dir"] = str(section.moments_dir or Path(cfg.output_dir) / "moments")
    folders.update(working_set_of(cfg).scratch(cfg))
    return folders


def plans(method: str) -> list[dict]:
    """Full fine-tuning with block inputs in host RAM or on disk, with the AdamW moments in files
    (the same updates in 6 bytes a parameter of host RAM), and with a chunk working set (8 chunks,
    their state in files: the smallest host RAM); LoRA over a 4-bit base."""
    if method == "lora":
        return [{"precision": "bf16", "quant.scheme": "nf4"}]
    chunked = {"precision": "bf16", "activations.checkpoint": "host", "slide.working_set": "chunk",
               "chunk.n_chunks": 8, "chunk.state": "disk"}
    moments_on_disk = {"precision": "bf16", "activations.checkpoint": "host", "slide.moments": "disk"}
    return [*({"precision": "bf16", "activations.checkpoint": store} for store in ("host", "disk")), moments_on_disk,
            chunked]
