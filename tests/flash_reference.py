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
    i = torch.arange(q.shape[0], device=q.device)[:, None] + (k.shape[0] - q.shape[0])
    j = torch.arange(k.shape[0], device=q.device)[None, :]
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


KERNEL_CASES = {  # M queries, N keys, heads, kv heads, dim, window, softcap, left padding per row
    "prefill-gqa-padded": (20, 20, 4, 2, 16, None, None, [0, 5]),
    "decode-mqa-window-softcap": (1, 37, 4, 1, 16, 8, 30.0, [0, 3]),
    "chunk-over-cache-odd-dim": (7, 50, 6, 3, 24, None, None, [2, 0]),
    "long-window": (40, 300, 2, 2, 16, 16, None, [0]),
}


def check_kernel_case(kernel, case: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                      tolerance: float = 1e-5) -> None:
    """``kernel`` (triton_attention's signature) against :func:`attend` on one of :data:`KERNEL_CASES`, row by
    row over each row's real (unpadded) keys."""
    m, n, heads, kv_heads, dim, window, softcap, pads = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(pads), h, length, dim, generator=g).to(device, dtype)
               for h, length in ((heads, m), (kv_heads, n), (kv_heads, n)))
    out = kernel(q, k, v, torch.tensor(pads, device=device), dim**-0.5, True, window, softcap)
    for b, pad in enumerate(pads):
        real_queries = slice(max(0, pad - (n - m)), None)
        expected = attend(q[b].transpose(0, 1)[real_queries], k[b, :, pad:].transpose(0, 1),
                          v[b, :, pad:].transpose(0, 1), dim**-0.5, True, (window - 1 if window else -1, 0),
                          softcap or 0.0)
        torch.testing.assert_close(out[b].transpose(0, 1)[real_queries], expected, rtol=tolerance, atol=tolerance)
