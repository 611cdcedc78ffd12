"""Timing generate calls the same way for every configuration."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Timed:
    tokens: torch.Tensor  # the new tokens only, [batch, n]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.shape[-1] / self.seconds if self.seconds > 0 else float("inf")


def timed_generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, **kwargs: Any) -> Timed:
    """Greedy ``model.generate`` on ``inputs``; wall time and the new tokens."""
    prompt_length = inputs["input_ids"].shape[-1]
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    return Timed(sequences[:, prompt_length:], seconds)
