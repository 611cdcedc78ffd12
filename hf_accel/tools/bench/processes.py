"""``hf-accel bench --processes N``: the data-parallel job of ``examples/accelerate_generate.py``, stock and
patched, each launched as N fresh processes by ``torchrun``, side by side.

What a user of such a job pays and gets: the wall time of the whole job (start-up, loading, patching, the
generation), the generation's throughput (every process's new tokens over the slowest process's generating
time, since the job waits for it), and whether the patched job wrote the stock job's tokens. Launches alternate
(stock, patched, stock, ...) so a drift of the machine spreads over both, and each starts with empty caches,
as a first job does.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from hf_accel.tools.bench.cold import markdown_table

#: Where the job sits in a checkout of hf_accel (``pip install -e .``, as the README sets up).
EXAMPLE_JOB = Path(__file__).resolve().parents[3] / "examples" / "accelerate_generate.py"


@dataclass
class JobRun:
    config: str  # "stock" or "patch(model)"
    processes: int
    wall_s: float  # launcher start to exit: start-up, loading, patching, generation
    ranks: list[dict[str, Any]]  # each process's prompts, new_tokens, generate_s, drafted, accepted
    new_token_ids: list[list[int]]  # every prompt's new tokens, in the prompt file's order

    @property
    def new_tokens(self) -> int:
        return sum(len(ids) for ids in self.new_token_ids)

    @property
    def generate_s(self) -> float:
        """The slowest process's generating time: the job's generation ends with it."""
        return max(r["generate_s"] for r in self.ranks)


class LaunchError(RuntimeError):
    """A launch that failed or ran past its time; its processes are gone."""


def launch_command(job: Path, processes: int, out: Path, flags: list[str]) -> list[str]:
    """``torchrun --standalone``: N processes on this machine meeting on a port the launcher picks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            str(job), "--out", str(out), *flags]


def run_launch(command: list[str], env: dict[str, str] | None = None, timeout: float = 3600,
               grace: float = 15) -> subprocess.CompletedProcess:
    """Run a launcher (torchrun, ``accelerate launch``) to its end. Past ``timeout`` it is asked to stop its
    workers (SIGTERM, which torchrun passes on), and after ``grace`` seconds every process it started that
    is still there is killed: torchrun starts each worker in a session of its own, out of reach of a signal
    to its group. Output goes through files, not pipes, which a surviving worker would hold open.

    :raises LaunchError: it ran past ``timeout``; the message holds the end of its output.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            started = _descendants(process.pid)  # read before they are orphaned and the tree is lost
            process.terminate()
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for pid, since in started:
                if _start_time(pid) == since:  # still the process seen, not a new one given its number
                    _kill(pid)
            raise LaunchError(f"{' '.join(command)} ran past {timeout:.0f} s; the end of its output:\n"
                              f"{_read(stderr)[-3000:]}") from None
        return subprocess.CompletedProcess(command, process.returncode, _read(stdout), _read(stderr))


def _read(file: Any) -> str:
    file.seek(0)
    return file.read()


def _descendants(pid: int) -> list[tuple[int, str | None]]:
    """Every process below ``pid``, with its start time (Linux ``/proc``; none found elsewhere)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    found = [(child, _start_time(child)) for child in children]
    return found + [grandchild for child in children for grandchild in _descendants(child)]


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(job: Path, processes: int, out: Path, flags: list[str], stock: bool, cache: Path,
            timeout: float = 3600) -> JobRun:
    """One launch of the job, with ``cache`` as its (empty) compile cache."""
    command = launch_command(job, processes, out, [*flags, "--stock"] if stock else flags)
    # An empty compile cache, and the model read from its GGUF file in every launch alike (a launch that kept a
    # converted copy would give the next one a faster load than the first had).
    env = {**os.environ, "HF_ACCEL_CACHE": str(cache), "HF_ACCEL_CONVERTED_MODELS": "0"}
    start = time.perf_counter()
    done = run_launch(command, env, timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise LaunchError(f"the job failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    if not stats_path(out).is_file():
        raise LaunchError(f"{job} wrote no {stats_path(out).name}: the job must write each process's statistics "
                          "there, as examples/accelerate_generate.py does")
    stats = json.loads(stats_path(out).read_text())
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return JobRun(config="stock" if stock else "patch(model)", processes=processes, wall_s=wall,
                  ranks=stats["ranks"], new_token_ids=[r["new_token_ids"] for r in results])


def stats_path(out: Path) -> Path:
    """Where the job writes its per-process statistics, beside its results."""
    return out.with_name(out.name + ".stats.json")


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
            name = f"{attempt}-{'stock' if stock else 'patched'}"
            runs.append(run_job(job, processes, Path(scratch) / f"results-{name}.jsonl", flags, stock,
                                Path(scratch) / f"cache-{name}", timeout))
            if progress:
                progress(runs[-1].config)
    return runs


def format_processes_table(runs: list[JobRun]) -> str:
    """Medians over the launches of each configuration; "identical": prompts whose tokens equal the first
    stock launch's in every launch of the configuration (for stock: whether its launches agree)."""
    reference = next(r for r in runs if r.config == "stock").new_token_ids
    configs = {config: [r for r in runs if r.config == config] for config in dict.fromkeys(r.config for r in runs)}
    wall = {config: statistics.median(r.wall_s for r in mine) for config, mine in configs.items()}
    speed = {config: statistics.median(r.new_tokens / r.generate_s for r in mine) for config, mine in configs.items()}
    lines = [("config", "processes", "job wall s", "x stock", "generate tok/s", "x stock", "per process generate s",
              "accepted / drafted (all launches)", "identical")]
    for config, mine in configs.items():
        ranks = range(len(mine[0].ranks))
        per_process = " / ".join(f"{statistics.median(r.ranks[i]['generate_s'] for r in mine):.1f}" for i in ranks)
        drafted = sum(rank["drafted"] or 0 for r in mine for rank in r.ranks)
        accepted = sum(rank["accepted"] or 0 for r in mine for rank in r.ranks)
        same = min(sum(a == b for a, b in zip(r.new_token_ids, reference)) for r in mine)
        lines.append((config, str(mine[0].processes), f"{wall[config]:.1f}", f"{wall['stock'] / wall[config]:.2f}x",
                      f"{speed[config]:.1f}", f"{speed[config] / speed['stock']:.2f}x", per_process,
                      f"{accepted} / {drafted}" if drafted else "-", f"{same}/{len(reference)}"))
    return markdown_table(lines)


def write_processes_json(runs: list[JobRun], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in runs], indent=1))
