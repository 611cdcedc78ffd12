"""The Triton FlashAttention kernel, checked under Triton's CPU interpreter in a subprocess."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_accel

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "triton_interpreted.py"],
                            cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_triton_flash_says_why_it_cannot_run_on_cpu(llama):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter makes it runnable here")
    with pytest.raises(hf_accel.BackendUnavailableError, match="triton_flash"):
        hf_accel.patch(llama, attention="triton_flash")
