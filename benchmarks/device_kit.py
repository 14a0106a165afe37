"""The packages the lent GPU machine lacks, made here (PyPI is reachable here, nothing is there), to be
carried with the working tree; and the one command that runs device_checks there.

    python benchmarks/device_kit.py          # -> .device_kit/ (git-ignored, ~18 MB), then prints the command

What the machine has (/work/.library/device/KINDS.md, read 2026-12-01): python3 3.12 with torch 2.11
(cu130), transformers 5.17, tokenizers 0.23.2, safetensors 0.8.0, huggingface_hub 1.33, accelerate,
peft, pyyaml, tqdm, matplotlib; no bitsandbytes, and slimtune is not installed. So the kit holds:
- the transformers 5.24 wheel (what requirements.txt pins; model.py passes `cache=` to
  create_causal_mask, which 5.17 may not take), installed there with pip --no-deps --no-index into a
  temporary folder (unpacked it is 51 MiB, the wheel 13 MiB: the carry limit is 64 MiB in all);
- bitsandbytes 0.50.2 unpacked without the libraries of other CUDA and ROCm versions (its CPU
  library and libbitsandbytes_cuda130.so kept: 4 MiB), for the nf4 plans.
torch stays the machine's 2.11 (ours is 2.13 on the CPU): a difference there is one of the things the
run finds out.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".device_kit"
PINS = {"transformers": "5.24.0", "bitsandbytes": "0.50.2"}
KEPT_LIBRARIES = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")

COMMAND = (
    "python3 -m pip install -q --no-deps --no-index --target /tmp/kit .device_kit/transformers-{transformers}-py3-none-any.whl"
    " && export PYTHONPATH=$PWD:/tmp/kit:$PWD/.device_kit/site SLIMTUNE_CHECKS_PARTIAL=$OUT/device_checks_partial.json"
    " && (python3 benchmarks/run.py device_checks --quick 2>&1 | tail -40 > $OUT/quick.log;"
    " python3 benchmarks/run.py device_checks 2>&1 | tail -200 > $OUT/full.log;"
    " cp benchmarks/results/device_checks_* $OUT/; tail -5 $OUT/quick.log $OUT/full.log)"
)


def download(name: str, version: str) -> Path:
    wheels = KIT / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    f"{name}=={version}"], check=True)
    return next(wheels.glob(f"{name}-{version}-*.whl"))


def unpack_trimmed(wheel: Path, target: Path) -> None:
    """The wheel's package files, less the native libraries of other accelerators."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            name = Path(member.filename).name
            if name.endswith(".so") and name not in KEPT_LIBRARIES:
                continue
            if ".dist-info/" in member.filename or member.is_dir():
                continue
            archive.extract(member, target)


def main() -> int:
    shutil.rmtree(KIT, ignore_errors=True)
    KIT.mkdir()
    transformers = download("transformers", PINS["transformers"])
    shutil.move(str(transformers), KIT / transformers.name)
    unpack_trimmed(download("bitsandbytes", PINS["bitsandbytes"]), KIT / "site")
    shutil.rmtree(KIT / "wheels")
    size = sum(p.stat().st_size for p in KIT.rglob("*") if p.is_file())
    print(f"wrote {KIT.relative_to(ROOT)} ({size / 2**20:.1f} MiB). On the device machine, carry"
          f" ['.device_kit'] and run:\n\n{COMMAND.format(**PINS)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
