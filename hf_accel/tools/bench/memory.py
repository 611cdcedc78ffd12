"""``hf-accel bench --memory``: peak resident memory per configuration, each in a fresh process.

A process's peak only grows, so configurations measured one after another in one process would include each
other's; here each runs :mod:`hf_accel.tools.bench.cold_worker` on its own: load the model, patch it (or not), then the
same calls of mixed batch sizes and lengths. The peak while loading is read first; the rest are peaks since
loading ended (the counter reset), so a loading peak cannot hide what patching and calls add.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from hf_accel.tools.bench.cold import ColdConfig, markdown_table, run_worker

#: (max_new_tokens, batch size) of the calls, one after another: mixed, as a server would see them.
MIXED_CALLS: tuple[tuple[int, int], ...] = tuple((n, b) for n, b in zip([128, 32, 64, 128, 48] * 4,
                                                                        [1, 2, 4, 3, 1] * 4))


@dataclass
class MemoryRun:
    config: str
    load_mb: float  # the peak while loading (a GGUF file is dequantized: above what the model keeps)
    resident_after_load_mb: float
    patch_mb: float  # this and the next two: the peak since loading ended
    first_call_mb: float
    last_call_mb: float
    report_held_bytes: int | None

    @property
    def process_peak_mb(self) -> float:
        """What ``/usr/bin/time -v`` would report for the whole process."""
        return max(self.load_mb, self.last_call_mb)


def run_memory_bench(model_dir: str, gguf_file: str | None, prompts: list[str], configs: list[ColdConfig],
                     scratch: str | Path, calls: tuple[tuple[int, int], ...] = MIXED_CALLS,
                     progress: Callable[[str], None] | None = None) -> list[MemoryRun]:
    """Each configuration in a fresh process over the same ``calls``; stock is the configuration whose patch
    is None."""
    plan = [[n, [prompts[(i + row) % len(prompts)] for row in range(batch)]] for i, (n, batch) in enumerate(calls)]
    runs = []
    for config in configs:
        spec = {"model_dir": model_dir, "gguf_file": gguf_file, "patch": config.patch, "calls": plan, "memory": True}
        result = run_worker(spec, {"HF_ACCEL_CACHE": str(Path(scratch) / "hf_accel")})
        runs.append(MemoryRun(config=config.name, **result))
        if progress:
            progress(config.name)
    return runs


def format_memory_table(runs: list[MemoryRun], calls: int = len(MIXED_CALLS)) -> str:
    stock = next((r for r in runs if r.report_held_bytes is None), None)
    lines = [("config", "load peak MiB", "after patch MiB", "after 1st call MiB", f"after {calls} calls MiB",
              "x stock", f"{calls} calls / 1st", "process peak MiB", "x stock", "report: held MiB")]
    for r in runs:
        held = "-" if r.report_held_bytes is None else f"{r.report_held_bytes / 2**20:+.0f}"
        lines.append((r.config, f"{r.load_mb:.0f}", f"{r.patch_mb:.0f}", f"{r.first_call_mb:.0f}",
                      f"{r.last_call_mb:.0f}", f"{r.last_call_mb / stock.last_call_mb:.2f}x" if stock else "-",
                      f"{r.last_call_mb / r.first_call_mb:.2f}x", f"{r.process_peak_mb:.0f}",
                      f"{r.process_peak_mb / stock.process_peak_mb:.2f}x" if stock else "-", held))
    return markdown_table(lines)


def memory_rows(runs: list[MemoryRun]) -> list[dict[str, Any]]:
    return [asdict(r) for r in runs]
