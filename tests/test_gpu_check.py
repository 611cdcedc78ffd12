"""scripts/gpu_check.sh, the run a lent GPU gets, kept working by its CPU dry run: every step listed, the steps
that need no GPU run (prepare, an offline install of this checkout, doctor, collecting the CUDA tests, a CPU bench
of the prepared model with random weights)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def run_script(*arguments: str, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), *arguments], env=env, capture_output=True, text=True, timeout=timeout)


def steps_table(text: str) -> dict[str, tuple[str, str]]:
    """The final table's rows: step -> (needs, result without pytest's counts)."""
    rows = re.findall(r"^\| ([\w-]+) \| (CPU|GPU) \| ([^|:]+)[^|]* \| [^|]+ \|$", text, re.MULTILINE)
    return {name: (needs, result.strip()) for name, needs, result in rows}


@pytest.mark.slow
def test_dry_run_lists_every_step_and_runs_those_that_need_no_gpu(tmp_path):
    result = run_script("--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    table = steps_table((tmp_path / "gpu_check.md").read_text())
    assert table == {"prepare": ("CPU", "passed"), "environment": ("CPU", "passed"), "install": ("CPU", "passed"),
                     "doctor": ("CPU", "passed"), "collect-tests": ("CPU", "passed"),
                     "cuda-tests": ("GPU", "listed (dry run)"), "cpu-bench": ("CPU", "passed"),
                     "bench": ("GPU", "listed (dry run)")}
    installed = re.search(r"hf_accel \S+ from (\S+)", (tmp_path / "install.log").read_text())
    assert installed and "gpu_check_work" in installed.group(1)  # the offline install, not this checkout's
    collected = re.search(r"(\d+) tests? collected", (tmp_path / "collect-tests.log").read_text())
    assert collected and int(collected.group(1)) >= 40
    bench = (tmp_path / "cpu-bench.log").read_text()
    assert re.search(r"^\| stock \| [\d.]+ \| 1\.00x \| 4/4 \|", bench, re.MULTILINE)
    assert re.search(r"^\| hf_accel attention only \| [\d.]+ \| [\d.]+x \| 4/4 \|", bench, re.MULTILINE)
    summary = (tmp_path / "gpu_check.md").read_text()
    assert re.search(r"^\| stock \| [\d.]+ \| 1\.00x \| 4/4 \|", summary, re.MULTILINE)  # the bench's table ends it
    assert re.search(r"^\| collect-tests \| CPU \| passed: \d+ tests collected", summary, re.MULTILINE)
    capability = torch.backends.cpu.get_cpu_capability()  # which machine the figures are from
    assert re.search(rf"^machine: .*CPU kernels {capability}( \([a-z0-9_ ]+\))?, torch ", summary, re.MULTILINE)
    gpu_lines = [line for line in result.stdout.splitlines() if line.startswith("== ") and "(GPU)" in line]
    assert "--device cuda --dtype bfloat16" in gpu_lines[1] and "test_cuda.py" in gpu_lines[0]


def test_a_real_run_without_a_prepared_model_says_what_to_do(tmp_path):
    result = run_script("--model", str(tmp_path / "missing"), out=tmp_path, timeout=60)
    assert result.returncode == 2 and "run scripts/gpu_check.sh --prepare first" in result.stderr


def test_an_unknown_argument_is_refused(tmp_path):
    result = run_script("--dryrun", out=tmp_path, timeout=60)
    assert result.returncode == 2 and "unknown argument '--dryrun'" in result.stderr
