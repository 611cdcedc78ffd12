"""How much memory is free, and whether a backend's extra bytes fit in it."""

from __future__ import annotations

from pathlib import Path

import torch


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can still get: for the CPU (Linux) ``MemAvailable``, or less
    where this process's cgroup has a lower limit (a container); for a GPU the driver's free bytes plus what
    PyTorch's allocator has reserved but not handed out. None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device)
    if device.type != "cpu":
        return None
    limits = [value for value in (_mem_available(), _cgroup_room()) if value is not None]
    return min(limits) if limits else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2), or None without a limit."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1]
        directory = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (directory / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((directory / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def shortfall(device: torch.device, needed: int) -> str | None:
    """Why ``needed`` more bytes would not fit on ``device`` now, or None (also when free memory is unknown)."""
    free = free_bytes(device)
    if free is None or needed <= free:
        return None
    return f"needs ~{needed / 2**20:.0f} MiB more memory and {free / 2**20:.0f} MiB are free on {device.type}"
