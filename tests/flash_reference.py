"""A plain-PyTorch stand-in for the flash-attn package's two entry points, recording how it was called."""

from __future__ import annotations

import torch


def attend(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """One sequence: q [Sq, H, D], k/v [Sk, Hkv, D]. Causal masking is bottom-right aligned, as in flash-attn."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[0])[:, None] + (k.shape[0] - q.shape[0])
    j = torch.arange(k.shape[0])[None, :]
    allowed = torch.ones_like(i == j)
    if causal:
        allowed &= j <= i
    if window_size[0] >= 0:
        allowed &= j >= i - window_size[0]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


class ReferenceFlashAttn:
    """Same signatures as ``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, **kwargs):
        self.calls.append(dict(kind="dense", q=tuple(q.shape), k=tuple(k.shape), causal=causal,
                               window_size=tuple(window_size), softcap=softcap))
        return torch.stack([attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **kwargs):
        self.calls.append(dict(kind="varlen", q=tuple(q.shape), k=tuple(k.shape), causal=causal,
                               window_size=tuple(window_size), softcap=softcap, cu_seqlens_q=cu_seqlens_q.tolist(),
                               cu_seqlens_k=cu_seqlens_k.tolist(), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k))
        pieces = []
        for b in range(len(cu_seqlens_q) - 1):
            qs = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
            ks = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
            pieces.append(attend(q[qs], k[ks], v[ks], softmax_scale, causal, window_size, softcap))
        return torch.cat(pieces)
