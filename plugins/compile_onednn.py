"""Exact fp32 Linear layers on prepacked oneDNN weights (CPU).

Stock ``F.linear`` on this class of CPU reads fp32 weights at ~12 GB/s for one token and gets *slower* for
the few-token chunks speculative decoding verifies. oneDNN with the weight reordered once into its blocked
layout (what inductor's weight freezing does) reads them at ~20 GB/s and stays flat up to ~8 tokens.
Same fp32 arithmetic, different summation order: verified against the model before it, like every backend.
"""

from __future__ import annotations

import torch

from hf_accel.plugin import Backend, Capabilities, Option, PatchContext, hookimpl
from hf_accel_plugins.onednn_packing import linear_children, pack_linears, packing_needed, why_unavailable


def why_unsuitable(context: PatchContext) -> str | None:
    if not any(True for _ in linear_children(context.model)):
        return "the model has no nn.Linear layers to pack"
    return None


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="onednn_prepack",
        feature="compile",
        apply=pack_linears,
        why_unavailable=why_unavailable,
        why_unsuitable=why_unsuitable,
        capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32,)),
        priority=10,
        options={"keep_original": Option.flag(False)},
        memory_needed=packing_needed,
        description="Linear layers on prepacked oneDNN fp32 weights (exact arithmetic, ~1.7x faster matmuls)",
    ))
