"""``hf-accel bench --cold``: start-up as users meet it, in fresh processes.

A user adds ``hf_accel.patch(model)`` to a script that loads a model, generates once and exits. Each run here
is that script (:mod:`hf_accel.tools.bench.cold_worker`) in a new Python process, stock or patched, for several
``max_new_tokens``; the parent times the whole process. Two rounds: ``cold``, every run with empty on-disk
caches (a compile cache and an inductor cache of its own, as on a machine that never ran hf_accel), then
``warm``, all runs sharing caches that an untimed run of each configuration filled first. The operating
system's file cache is warm in both (the model file and Python's bytecode are read once before).

The break-even length is where the patched script's total time meets stock's, from a straight line per
configuration: seconds per token fitted to its generate calls, plus the rest of the process as a fixed cost.

Then a long-running process (:func:`run_calls_bench`): calls with new batch sizes, prompt lengths and
``max_new_tokens`` one after another, stock and then patched in the same process, each call timed against
stock's same call; once with empty caches, once with the caches that run filled.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

WORKER = Path(__file__).with_name("cold_worker.py")
_MARK = "HF_ACCEL_COLD_RESULT "


@dataclass
class ColdRun:
    caches: str  # "cold" (empty) or "warm"
    config: str
    max_new_tokens: int
    tokens: int
    total_s: float  # the process, from its start to its exit, as the parent saw it
    import_s: float
    load_s: float
    patch_s: float
    generate_s: float
    ttft_s: float
    token_ids: list[int] = field(default_factory=list, repr=False)
    identical: bool | None = None  # the same tokens as the stock run of the same caches and length


@dataclass(frozen=True)
class ColdConfig:
    name: str
    patch: dict[str, Any] | None  # None: stock


def run_cold_bench(model_dir: str, gguf_file: str | None, prompt: str, lengths: list[int], configs: list[ColdConfig],
                   scratch: str | Path, progress: Callable[[str], None] | None = None) -> list[ColdRun]:
    """Every configuration at every length in fresh processes, with empty caches then with warm ones (in
    ``scratch/warm``, filled first by an untimed run of each configuration)."""
    runs: list[ColdRun] = []
    base = {"model_dir": model_dir, "gguf_file": gguf_file, "prompt": prompt}
    warm = _cache_dirs(Path(scratch) / "warm")
    for config in configs:  # fills the warm caches (and the OS file cache) untimed
        run_worker({**base, "max_new_tokens": max(lengths), "patch": config.patch}, warm)
        if progress:
            progress(f"filled caches: {config.name}")
    for caches in ("cold", "warm"):
        for n in lengths:
            for i, config in enumerate(configs):
                dirs = warm if caches == "warm" else _cache_dirs(Path(scratch) / f"cold-{n}-{i}")
                runs.append(_timed_run({**base, "max_new_tokens": n, "patch": config.patch}, dirs, caches,
                                       config.name))
                if progress:
                    progress(f"{caches} caches: {config.name}, {n} tokens")
    _mark_identity(runs)
    return runs


#: The long-running process: ``(max_new_tokens, prompt indices)`` per call, one prompt per row. After two
#: single-row calls come a new batch size, a longer prompt, another batch size and length, and a call
#: long enough to need a bigger cache.
DEFAULT_CALLS: tuple[tuple[int, tuple[int, ...]], ...] = (
    (128, (0,)), (128, (2,)), (48, (1, 3, 5)), (64, (4,)), (200, (6, 7)), (512, (0,)))


@dataclass
class CallPair:
    caches: str
    call: int
    batch: int
    prompt_tokens: int
    max_new_tokens: int
    stock_s: float
    patched_s: float
    identical: bool
    compile_s: float = 0.0  # of the patched call's time, spent compiling


def run_calls_bench(model_dir: str, gguf_file: str | None, prompts: list[str], patch: dict[str, Any],
                    scratch: str | Path, calls: tuple[tuple[int, tuple[int, ...]], ...] = DEFAULT_CALLS,
                    progress: Callable[[str], None] | None = None) -> list[CallPair]:
    """The calls one after another in one process, stock then patched: with empty caches, then with the warm
    caches :func:`run_cold_bench` left in ``scratch/warm`` (as on a machine that has compiled before)."""
    spec = {"model_dir": model_dir, "gguf_file": gguf_file, "patch": patch,
            "calls": [[n, [prompts[i % len(prompts)] for i in rows]] for n, rows in calls]}
    pairs = []
    runs = (("cold", _cache_dirs(Path(scratch) / "calls-cold")), ("warm", _cache_dirs(Path(scratch) / "warm")))
    for caches, dirs in runs:
        result = run_worker(spec, dirs)
        for i, (stock, patched) in enumerate(zip(result["stock"], result["patched"]), start=1):
            pairs.append(CallPair(caches, i, stock["batch"], stock["prompt_tokens"], stock["max_new_tokens"],
                                  stock["seconds"], patched["seconds"], stock["token_ids"] == patched["token_ids"],
                                  patched["compile_s"]))
        if progress:
            progress(f"calls in one process, {caches} caches")
    return pairs


def format_calls_table(pairs: list[CallPair]) -> str:
    lines = [("caches", "call", "batch", "prompt tokens", "max new", "stock s", "patched s", "of which compiling s",
              "patched - stock s", "identical")]
    lines += [(p.caches, str(p.call), str(p.batch), str(p.prompt_tokens), str(p.max_new_tokens), f"{p.stock_s:.1f}",
               f"{p.patched_s:.1f}", f"{p.compile_s:.1f}", f"{p.patched_s - p.stock_s:+.1f}",
               "yes" if p.identical else "NO") for p in pairs]
    return markdown_table(lines)


def _cache_dirs(root: Path) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "HF_ACCEL_CACHE": str(root / "hf_accel")}


def _timed_run(spec: dict[str, Any], dirs: dict[str, str], caches: str, name: str) -> ColdRun:
    start = time.perf_counter()
    result = run_worker(spec, dirs)
    total = time.perf_counter() - start
    return ColdRun(caches=caches, config=name, max_new_tokens=spec["max_new_tokens"], tokens=result["tokens"],
                   total_s=total, import_s=result["import_s"], load_s=result["load_s"], patch_s=result["patch_s"],
                   generate_s=result["generate_s"], ttft_s=result["ttft_s"], token_ids=result["token_ids"])


def run_worker(spec: dict[str, Any], dirs: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **dirs}
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"the benchmark run failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")


def _mark_identity(runs: list[ColdRun]) -> None:
    stock = {(r.caches, r.max_new_tokens): r.token_ids for r in runs if r.config == "stock"}
    for run in runs:
        reference = stock.get((run.caches, run.max_new_tokens))
        run.identical = None if run.config == "stock" or reference is None else run.token_ids == reference


def break_even(runs: list[ColdRun], config: str, caches: str) -> float | None:
    """Tokens from which the configuration's script is no slower than stock's: 0 if it never is slower,
    ``inf`` if it never catches up, None without enough runs to fit."""
    fits = [_fit([r for r in runs if r.config == name and r.caches == caches]) for name in ("stock", config)]
    if None in fits:
        return None
    (fixed_stock, per_token_stock), (fixed, per_token) = fits
    if fixed <= fixed_stock and per_token <= per_token_stock:
        return 0.0
    if per_token >= per_token_stock:
        return float("inf")
    return max((fixed - fixed_stock) / (per_token_stock - per_token), 0.0)


def _fit(runs: list[ColdRun]) -> tuple[float, float] | None:
    """``total = fixed + per_token * tokens``: the slope fitted (least squares) to the generate calls alone,
    whose time does not include the process's start and the model's load (which vary by a second or more
    between processes); the fixed cost is each run's total less its tokens' share, averaged."""
    points = [(r.tokens, r.generate_s) for r in runs]
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return statistics.mean(r.total_s - slope * r.tokens for r in runs), slope


def format_cold_table(runs: list[ColdRun]) -> str:
    stock = {(r.caches, r.max_new_tokens): r for r in runs if r.config == "stock"}
    header = ("caches", "config", "max new", "tokens", "total s", "vs stock", "import+load s", "patch s",
              "first generate s", "TTFT s", "TTFT vs stock", "identical")
    lines = [header]
    for r in runs:
        ref = stock.get((r.caches, r.max_new_tokens))
        lines.append((r.caches, r.config, str(r.max_new_tokens), str(r.tokens), f"{r.total_s:.1f}",
                      f"{r.total_s / ref.total_s:.2f}x" if ref else "-", f"{r.import_s + r.load_s:.1f}",
                      f"{r.patch_s:.1f}", f"{r.generate_s:.1f}", f"{r.ttft_s:.2f}",
                      f"{r.ttft_s - ref.ttft_s:+.2f} s" if ref else "-",
                      "-" if r.identical is None else ("yes" if r.identical else "NO")))
    return markdown_table(lines)


def format_break_even(runs: list[ColdRun]) -> str:
    lines = [("caches", "config", "break-even (new tokens)", "fixed cost vs stock s", "s per token vs stock")]
    for caches in ("cold", "warm"):
        stock_fit = _fit([r for r in runs if r.config == "stock" and r.caches == caches])
        for config in dict.fromkeys(r.config for r in runs if r.config != "stock"):
            fit = _fit([r for r in runs if r.config == config and r.caches == caches])
            point = break_even(runs, config, caches)
            text = ("-" if point is None else "from the first token" if point == 0
                    else "never" if point == float("inf") else f"{point:.0f}")
            extra = ("-", "-") if fit is None or stock_fit is None else (
                f"{fit[0] - stock_fit[0]:+.1f}", f"{fit[1] / stock_fit[1]:.2f}x")
            lines.append((caches, config, text, *extra))
    return markdown_table(lines)


def markdown_table(lines: list[tuple[str, ...]]) -> str:
    lines = [tuple(cell.replace("|", "\\|") for cell in line) for line in lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(out)


def write_cold_json(runs: list[ColdRun], pairs: list[CallPair], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"runs": [asdict(r) for r in runs], "calls": [asdict(p) for p in pairs]},
                                     indent=1))
