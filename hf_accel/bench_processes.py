"""``hf-accel bench --processes N``: the data-parallel job of ``examples/accelerate_generate.py``, stock and
patched, each launched as N fresh processes by ``torchrun``, side by side.

What a user of such a job pays and gets: the wall time of the whole job (start-up, loading, patching, the
generation), the generation's own throughput summed over the processes, and whether the patched job wrote the
stock job's tokens. Runs alternate (stock, patched, stock, ...) so a drift of the machine spreads over both.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .bench_cold import markdown_table

#: Where the job sits in a checkout of hf_accel (``pip install -e .``, as the README sets up).
EXAMPLE_JOB = Path(__file__).resolve().parent.parent / "examples" / "accelerate_generate.py"


@dataclass
class JobRun:
    config: str  # "stock" or "patch(model)"
    processes: int
    wall_s: float  # launcher start to exit: start-up, loading, patching, generation
    ranks: list[dict[str, Any]]  # what each process printed: prompts, new_tokens, tokens_per_s, drafted, accepted
    new_token_ids: list[list[int]]  # every prompt's new tokens, in the prompt file's order

    @property
    def new_tokens(self) -> int:
        return sum(len(ids) for ids in self.new_token_ids)

    @property
    def generate_tokens_per_s(self) -> float:
        """The processes' generation throughput, summed (each process's tokens over its generating time)."""
        return sum(r["tokens_per_s"] or 0.0 for r in self.ranks)


def launch_command(job: Path, processes: int, out: Path, flags: list[str]) -> list[str]:
    """``torchrun --standalone``: N processes on this machine meeting on a port the launcher picks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            str(job), "--out", str(out), *flags]


def run_job(job: Path, processes: int, out: Path, flags: list[str], stock: bool, timeout: float = 3600) -> JobRun:
    """One launch of the job; its processes are killed as a group if it runs past ``timeout`` seconds."""
    command = launch_command(job, processes, out, [*flags, "--stock"] if stock else flags)
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise RuntimeError(f"the job ran past {timeout:.0f} s: {' '.join(command)}") from None
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"the job failed (exit {process.returncode}): {' '.join(command)}\n{stderr[-2000:]}")
    ranks = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"rank"')]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return JobRun(config="stock" if stock else "patch(model)", processes=processes, wall_s=wall,
                  ranks=sorted(ranks, key=lambda r: r["rank"]), new_token_ids=[r["new_token_ids"] for r in results])


def run_processes_bench(processes: int, flags: list[str], scratch: str | Path, repeat: int = 1,
                        job: Path = EXAMPLE_JOB, progress: Callable[[str], None] | None = None,
                        timeout: float = 3600) -> list[JobRun]:
    """``repeat`` launches of the stock job and of the patched one, alternating, each with ``processes``
    processes; ``flags`` go to the job (``--prompts``, ``--max-new-tokens``, ``--batch-size``, ``--tiny``)."""
    if not job.is_file():
        raise FileNotFoundError(f"no job at {job}: bench --processes runs examples/accelerate_generate.py from a "
                                "checkout of hf_accel; pass --job PATH to a copy of it")
    runs = []
    for attempt in range(repeat):
        for stock in (True, False):
            out = Path(scratch) / f"results-{attempt}-{'stock' if stock else 'patched'}.jsonl"
            runs.append(run_job(job, processes, out, flags, stock, timeout))
            if progress:
                progress(runs[-1].config)
    return runs


def format_processes_table(runs: list[JobRun]) -> str:
    """Medians over the repeats; "identical": prompts whose tokens equal the stock job's."""
    stock = next(r for r in runs if r.config == "stock")
    lines = [("config", "processes", "job wall s", "x stock", "job tok/s", "generate tok/s (sum)", "x stock",
              "per process tok/s", "accepted / drafted", "identical")]
    medians = {}
    for config in dict.fromkeys(r.config for r in runs):
        mine = [r for r in runs if r.config == config]
        medians[config] = (statistics.median(r.wall_s for r in mine),
                           statistics.median(r.generate_tokens_per_s for r in mine))
    for config, (wall, speed) in medians.items():
        last = [r for r in runs if r.config == config][-1]
        per_process = " / ".join(f"{r['tokens_per_s']:.1f}" for r in last.ranks)
        drafted = sum(r.get("drafted") or 0 for r in last.ranks)
        accepted = sum(r.get("accepted") or 0 for r in last.ranks)
        same = sum(a == b for a, b in zip(last.new_token_ids, stock.new_token_ids))
        lines.append((config, str(last.processes), f"{wall:.1f}", f"{medians['stock'][0] / wall:.2f}x",
                      f"{last.new_tokens / wall:.1f}", f"{speed:.1f}", f"{speed / medians['stock'][1]:.2f}x",
                      per_process, f"{accepted} / {drafted}" if drafted else "-",
                      "-" if config == "stock" else f"{same}/{len(stock.new_token_ids)}"))
    return markdown_table(lines)


def write_processes_json(runs: list[JobRun], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in runs], indent=1))
