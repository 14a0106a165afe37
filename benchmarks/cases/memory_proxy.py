"""Why the 8-bit host AdamW loses 3-10% in DRAM though the memory could feed it three times over
(issue 30, item 7; benchmarks/docs/host_adam_bandwidth.md, "A proxy says the memory's share is this
machine's"). `_memory_proxy.c` reads and writes the loop's five streams in place (16 bytes a number)
with a body of chosen density, on 2^25 numbers (in DRAM) and 2^16 (in the L2), with 4 KiB pages and
with huge pages, beside a memcpy:

    python benchmarks/run.py memory_proxy      # about ten seconds

Rows: no arithmetic (what the memory gives these streams); a sparse body (a chain of 12 divisions a
32 numbers); a body as dense in instructions as the real loop (about 160), alone,
with software prefetch into the L1 four blocks ahead and into the L2 sixteen ahead. A row's
`dram_over_cache` is what the memory adds to that body. Needs x86 with AVX-512 (the loop's own ISA).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("_memory_proxy.c")
ROWS = {  # name: (body, work, ahead, hint)
    "no_arithmetic": ("trivial", 0, 0, 0),
    "sparse_divisions": ("divides", 12, 0, 0),
    "dense": ("dense", 40, 0, 0),
    "dense_prefetch_l1_4_ahead": ("dense", 40, 4, 0),
    "dense_prefetch_l2_16_ahead": ("dense", 40, 16, 1),
}
BYTES_A_NUMBER = 16


def run(quick: bool) -> dict:
    from slimtune.optim.native import adamw, build

    if adamw.library() is None or not adamw.fast_path():
        return {"skipped": "the proxy is the AVX-512 loop's; this machine does not run that loop"}
    cc = build.compiler()
    rows = dict(list(ROWS.items())[:1]) if quick else ROWS
    out: dict = {"bytes_a_number": BYTES_A_NUMBER, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="memory-proxy-") as folder:
        program = Path(folder) / "memory_proxy"
        subprocess.run([*cc, "-O2", "-mavx512f", "-mavx512bw", "-o", str(program), str(SOURCE)], check=True)
        for name, args in rows.items():
            done = subprocess.run([str(program), *map(str, args)], check=True, capture_output=True, text=True)
            row = json.loads(done.stdout)
            row["dram_over_cache"] = row["dram_ns"] / row["cache_ns"]
            row["dram_over_cache_huge_pages"] = row["dram_ns_huge_pages"] / row["cache_ns_huge_pages"]
            row["dram_gbps"] = BYTES_A_NUMBER / row["dram_ns"]
            out["rows"][name] = row
            print(f"{name}: {row['dram_ns']:.3f} ns a number in DRAM, {row['cache_ns']:.3f} in the L2 "
                  f"(x{row['dram_over_cache']:.2f}; huge pages x{row['dram_over_cache_huge_pages']:.2f}), "
                  f"{row['dram_gbps']:.1f} GB/s; memcpy {row['memcpy_gbps']:.1f} GB/s", flush=True)
    return out
