"""``hf-accel bench-attention``: prefill attention alone, per backend, at several sequence lengths.

Times one causal self-attention call with SmolLM2-135M's head layout (9 query heads, 3 key/value heads,
head dim 64; override with flags) for eager, stock sdpa and each attention backend that can run here, and
the extra resident memory each needed (eager materialises the N x N scores; flash kernels do not).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from . import available_backends
from .bench import reset_peak_rss, rss_mb


@dataclass
class AttentionRow:
    backend: str
    tokens: int
    ms: float
    extra_mb: float | None


def _peak_extra_mb(fn: Callable[[], object]) -> float | None:
    """How much the process's peak resident memory grew while ``fn`` ran."""
    if not reset_peak_rss():
        return None
    before = rss_mb("VmRSS")
    fn()
    peak = rss_mb("VmHWM")
    return None if before is None or peak is None else max(peak - before, 0.0)


class _Layer(nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def implementations() -> dict[str, Callable]:
    """eager and stock sdpa, plus every available attention backend's registered function."""
    found: dict[str, Callable] = {"eager": eager_attention_forward, "sdpa": AttentionInterface._global_mapping["sdpa"]}
    names = {"sdpa_flash": "hf_accel_sdpa_fa", "flash_attn": "hf_accel_fa2"}
    for status in available_backends():
        if status.feature == "attention" and status.available and status.name in names:
            found[status.name] = AttentionInterface._global_mapping[names[status.name]]
    return found


def bench_attention(lengths=(512, 2048, 8192), heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                    repeat: int = 3, dtype: torch.dtype = torch.float32, queries: int | None = None) -> list[AttentionRow]:
    """Prefill (``queries=None``: n queries over n keys, causal) or a chunk of ``queries`` new tokens over n
    keys with an explicit mask, as speculative verification and padded batches run it."""
    rows = []
    layer = _Layer(heads // kv_heads).eval()
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        m = queries or n
        q = torch.randn(1, heads, m, head_dim, generator=g, dtype=dtype)
        k = torch.randn(1, kv_heads, n, head_dim, generator=g, dtype=dtype)
        v = torch.randn(1, kv_heads, n, head_dim, generator=g, dtype=dtype)
        causal = torch.ones(m, n, dtype=torch.bool).tril(diagonal=n - m)
        calls = {}
        for name, fn in implementations().items():
            # eager takes an additive mask; the sdpa family a boolean one, or None for plain causal prefill
            if name == "eager":
                mask = torch.zeros(1, 1, m, n, dtype=dtype).masked_fill(~causal, float("-inf"))
            else:
                mask = causal[None, None] if queries else None
            calls[name] = functools.partial(fn, layer, q, k, v, mask, scaling=head_dim**-0.5, dropout=0.0)
        with torch.no_grad():
            extra = {name: _peak_extra_mb(call) for name, call in calls.items()}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(repeat):  # round-robin, rotating the order, so no backend always runs first
                names = list(calls)[r % len(calls):] + list(calls)[: r % len(calls)]
                for name in names:
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - start)
        rows += [AttentionRow(name, n, 1000 * statistics.median(times[name]), extra[name]) for name in calls]
    return rows


def format_attention_table(rows: list[AttentionRow]) -> str:
    lengths = sorted({r.tokens for r in rows})
    backends = list(dict.fromkeys(r.backend for r in rows))
    cell = {(r.backend, r.tokens): r for r in rows}
    header = "| backend | " + " | ".join(f"{n} tokens: ms / extra MB" for n in lengths) + " |"
    lines = [header, "|" + " --- |" * (len(lengths) + 1)]
    for b in backends:
        parts = []
        for n in lengths:
            r = cell[(b, n)]
            parts.append(f"{r.ms:.1f} / {'-' if r.extra_mb is None else f'{r.extra_mb:.0f}'}")
        lines.append(f"| {b} | " + " | ".join(parts) + " |")
    return "\n".join(lines)
