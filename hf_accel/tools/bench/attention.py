"""``hf-accel bench-attention``: prefill attention alone, per backend, at several sequence lengths.

Times one causal self-attention call with SmolLM2-135M's head layout (9 query heads, 3 key/value heads,
head dim 64) for every attention backend that can run here (eager and stock sdpa included), and
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
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_accel import available_backends, patch
from hf_accel.patching.errors import BackendUnavailableError
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.tools.bench.steady import reset_peak_rss, rss_mb


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


def implementations(heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> dict[str, Callable]:
    """The attention function each available attention backend installs, found by patching a one-layer
    model with this head layout and reading which implementation it selected (so no backend is named here)."""
    found: dict[str, Callable] = {}
    for status in available_backends():
        if status.feature != "attention" or not status.available:
            continue
        model = _probe_model(heads, kv_heads, head_dim)
        try:
            patch(model, **{**{f: None for f in FEATURE_NAMES}, "attention": status.name}, verify=False)
        except BackendUnavailableError:
            continue  # e.g. needs CUDA, or a dtype this probe does not have
        name = model.config._attn_implementation
        found[status.name] = eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    return found


def _probe_model(heads: int, kv_heads: int, head_dim: int) -> nn.Module:
    config = LlamaConfig(vocab_size=16, hidden_size=heads * head_dim, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return LlamaForCausalLM(config).eval()


def bench_attention(lengths=(512, 2048, 8192), heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                    repeat: int = 3, dtype: torch.dtype = torch.float32,
                    queries: int | None = None) -> list[AttentionRow]:
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
        for name, fn in implementations(heads, kv_heads, head_dim).items():
            # transformers' eager function ignores is_causal, so it gets an additive mask; the others a boolean
            # one, or None for plain causal prefill
            if fn is eager_attention_forward:
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
