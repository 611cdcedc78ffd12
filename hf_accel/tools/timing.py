"""Timing generate calls the same way everywhere (demo, generate, bench)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Timed:
    tokens: torch.Tensor  # the new tokens only, [batch, n]
    seconds: float
    ttft_s: float  # time to the first generated token

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.shape[-1] / self.seconds if self.seconds > 0 else float("inf")


class _FirstTokenClock:
    """A streamer that notes when the first generated token arrives, passing everything on to ``inner``."""

    def __init__(self, inner: Any = None) -> None:
        self.inner, self.puts, self.first_at = inner, 0, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first_at = time.perf_counter()
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def timed_generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, streamer: Any = None,
                   **kwargs: Any) -> Timed:
    """Greedy ``model.generate`` on ``inputs``: the new tokens, wall time and time to first token."""
    prompt_length = inputs["input_ids"].shape[-1]
    clock = _FirstTokenClock(streamer)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock, **kwargs)
    sequences = out.sequences if hasattr(out, "sequences") else out
    if sequences.is_cuda:
        torch.cuda.synchronize(sequences.device)  # the last kernels finish before the clock stops
    end = time.perf_counter()
    return Timed(sequences[:, prompt_length:], end - start, (clock.first_at or end) - start)
