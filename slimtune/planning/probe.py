"""`slimtune probe`: measure the machine it runs on and write a GPU profile the planner reads.

On CUDA: the card's memory, its dense bf16 and fp32 matmul rates, its memory bandwidth, and
pinned host<->device bandwidth. On a CPU-only machine: the same figures for the CPU (the
device and the host are one memory there), which is what the planner's CPU calibration uses.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from slimtune import presets


def _timed(fn, repeats: int) -> float:
    """Seconds per call, after one warm-up call; synchronises CUDA around the timing."""
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - began) / repeats


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(lambda: a @ b, repeats) / 1e12


def copy_gbps(source: torch.Tensor, target: torch.Tensor, repeats: int) -> float:
    """Bytes moved per second by target.copy_(source) (one direction)."""
    return source.numel() * source.element_size() / _timed(lambda: target.copy_(source, non_blocking=True),
                                                            repeats) / 1e9


def probe_cuda(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    big = 256 * 2**20 // 4
    on_device = torch.empty(big, device=device)
    pinned = torch.empty(big, pin_memory=True)
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "bf16_tflops": matmul_tflops(device, torch.bfloat16, 8192, 20),
        "fp32_tflops": matmul_tflops(device, torch.float32, 8192, 5),
        # a device copy reads and writes every byte
        "memory_gbps": 2 * copy_gbps(on_device, torch.empty_like(on_device), 20),
        "host_link_gbps": min(copy_gbps(pinned, on_device, 10), copy_gbps(on_device, pinned, 10)),
        "description": f"measured by slimtune probe on {props.name}",
        "rates": "measured",  # the planner's footnote says so (an 8192-square matmul's rate, not the spec sheet's)
    }


def probe_cpu() -> dict:
    cpu = torch.device("cpu")
    big = torch.empty(64 * 2**20 // 4)
    memory_gbps = 2 * copy_gbps(big, torch.empty_like(big), 10)
    return {
        "name": "cpu",
        "memory_bytes": presets.physical_ram_bytes(),
        "bf16_tflops": matmul_tflops(cpu, torch.bfloat16, 512, 3),
        "fp32_tflops": matmul_tflops(cpu, torch.float32, 2048, 5),
        "memory_gbps": memory_gbps,
        "host_link_gbps": memory_gbps,  # host and device are the same memory
        "description": f"measured by slimtune probe on a CPU ({torch.get_num_threads()} threads)",
        "rates": "measured",
    }


def run(out: str | None = None) -> dict:
    profile = probe_cuda(torch.device("cuda")) if torch.cuda.is_available() else probe_cpu()
    if out is not None:
        Path(out).write_text(json.dumps(profile, indent=2) + "\n")
    return profile
