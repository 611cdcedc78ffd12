"""How much memory is free, and whether a backend's extra bytes fit in it."""

from __future__ import annotations

from pathlib import Path

import torch


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can still get: ``MemAvailable`` for the CPU (Linux), the CUDA
    driver's free bytes for a GPU; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shortfall(device: torch.device, needed: int) -> str | None:
    """Why ``needed`` more bytes would not fit on ``device`` now, or None (also when free memory is unknown)."""
    free = free_bytes(device)
    if free is None or needed <= free:
        return None
    return f"needs ~{needed / 2**20:.0f} MiB more memory and {free / 2**20:.0f} MiB are free on {device.type}"
