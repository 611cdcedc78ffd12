"""``triton_flash``: our own FlashAttention-2 forward in Triton, for CUDA machines without flash-attn.

One program computes a block of queries for one (batch row, head): it walks the keys and values in
tiles, keeping a running maximum and sum per query row (the online softmax) and rescaling its partial
output when the maximum grows, so the N x N scores never exist in memory. Causal (bottom-right aligned:
the queries are the last M of N positions, so prefill and decode over a cache both work), grouped-query
attention (a query head reads key/value head ``h // group``), sliding window, logit soft-capping and
left padding (keys before a row's first real token are skipped) are handled in the kernel.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any

import torch
from transformers.masking_utils import flash_attention_mask

from hf_accel.plugin import (
    Backend,
    Capabilities,
    PatchContext,
    head_dim,
    hookimpl,
    register_implementation,
    set_attention,
    transformers_refusal,
)

TRITON_FLASH = "hf_accel_triton_fa"
_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kv_start_ptr,
                         sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m,
                         M, N, D, group, scale, softcap, window,
                         CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        block, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_h = h // group
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_ok, dim_ok = rows < M, dims < D
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_m + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        position = rows + (N - M)  # absolute position of each query among the N keys
        first = tl.load(kv_start_ptr + b)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            k = tl.load(k_ptr + b * sk_b + kv_h * sk_h + cols[:, None] * sk_n + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
            # "ieee": no rounding of the fp32 operands to TF32 on tensor cores (Ampere and later round by default),
            # so attention stays within fp32 rounding of the reference.
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if SOFTCAP:
                s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
            ok = col_ok[None, :] & (cols[None, :] >= first)
            if CAUSAL:
                ok = ok & (cols[None, :] <= position[:, None])
            if WINDOW:
                ok = ok & (position[:, None] - cols[None, :] < window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + b * sv_b + kv_h * sv_h + cols[:, None] * sv_n + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_m + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    return attention_kernel


def triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_start: torch.Tensor,
                     scale: float, causal: bool = True, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """FlashAttention-2 forward. ``query`` [B, H, M, D]; ``key``/``value`` [B, Hkv, N, D]; row b's keys
    before ``kv_start[b]`` are padding. Returns [B, H, M, D]."""
    import triton

    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    batch, heads, m, dim = query.shape
    n = key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty_like(query)
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), heads, batch)
    # Triton launches on the current device, not the tensors': a layer device_map put on another GPU must
    # switch to it (the interpreter runs CPU tensors).
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _kernel[grid](query, key, value, out, kv_start.to(torch.int32).contiguous(),
                      query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
                      key.stride(2), value.stride(0), value.stride(1), value.stride(2), out.stride(0),
                      out.stride(1), out.stride(2), m, n, dim, heads // key.shape[1], scale, float(softcap or 1.0),
                      int(window or 0), CAUSAL=causal, SOFTCAP=bool(softcap), WINDOW=bool(window),
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim))
    return out


def triton_flash_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, sliding_window: int | None = None,
                         softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    n = key.shape[2]
    if attention_mask is None:
        kv_start = torch.zeros(query.shape[0], dtype=torch.int32, device=query.device)
    else:
        kv_start = left_padding(attention_mask[:, -n:].bool())
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = triton_attention(query, key, value, kv_start, scaling if scaling is not None else query.shape[-1] ** -0.5,
                           causal, sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None


def left_padding(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading positions are padding; the kernel needs each row's real tokens contiguous."""
    starts = (~mask).long().cumprod(-1).sum(-1)
    if bool((mask.sum(-1) != mask.shape[-1] - starts).any()):
        raise ValueError("triton_flash needs left padding only (each row's real tokens contiguous at the end)")
    return starts.to(torch.int32)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_problem() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not interpreted():
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 to run it, slowly, on the CPU)"
    return None


def triton_unsuitable(context: PatchContext) -> str | None:
    if head_dim(context.model) > 256:
        return (f"the kernel keeps a query block's head dimension in registers: at most 256, this model has "
                f"{head_dim(context.model)}")
    if context.device.type != "cuda" and not interpreted():
        return f"runs on CUDA, the model is on {context.device.type}"
    return transformers_refusal(context, TRITON_FLASH)


@hookimpl
def hf_accel_register_backends(register):
    register_implementation(TRITON_FLASH, triton_flash_forward, flash_attention_mask)
    register(Backend(
        name="triton_flash",
        feature="attention",
        apply=lambda context: set_attention(context, TRITON_FLASH),
        why_unavailable=triton_problem,
        why_unsuitable=triton_unsuitable,
        capabilities=Capabilities(partial_weights=True, padded_masks=False),  # it sees activations, not weights
        priority=25,
        description="FlashAttention-2 forward written in Triton (online softmax, GQA, window, softcap, padding)",
    ))
