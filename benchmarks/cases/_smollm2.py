"""The real SmolLM2-135M-Instruct for the quality and timing cases: converted once from its PyPI
package by scripts/make_smollm2.py and cached under ~/.cache/slimtune/models (PLATFORM.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def smollm2_folder() -> Path:
    """The converted model's folder, made on first use."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_smollm2.py"
    spec = importlib.util.spec_from_file_location("make_smollm2", script)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.make()
