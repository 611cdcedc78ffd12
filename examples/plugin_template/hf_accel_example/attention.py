"""FlashAttention's algorithm in plain PyTorch: keys and values are read in chunks of ``CHUNK_SIZE`` and the
softmax is computed online, so the full ``q_len x kv_len`` score matrix never exists at once.

For each chunk, every query row keeps a running maximum ``m`` of its scores, a running sum ``l`` of
``exp(score - m)`` and an output accumulator; when a chunk raises the maximum, the sum and the accumulator
are rescaled by ``exp(m_old - m_new)``. After the last chunk the output is ``accumulator / l``.

Grouped-query attention: the query heads that share a key/value head are stacked along the query axis, so
each key/value chunk is multiplied once per key/value head and never copied per query head.

Masking follows transformers' ``sdpa_mask`` convention: padding, causal and sliding-window constraints all
arrive in one 4-D mask (boolean, True = attend; or additive floats). Without a mask, several queries are
causal, bottom-right aligned: the queries are the last ``q_len`` of ``kv_len`` positions. :func:`build_mask`
is the mask builder to register with the forward: it leaves out the mask only where that rule is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import sdpa_mask

#: Keys per chunk: small, so that prompts of a few hundred tokens run through several chunks.
CHUNK_SIZE = 64


def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
            softcap: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function as transformers' ``AttentionInterface`` calls it.

    :param query: ``[batch, heads, q_len, head_dim]``.
    :param key: ``[batch, kv_heads, kv_len, head_dim]``; ``heads`` is a multiple of ``kv_heads``.
    :param value: ``[batch, kv_heads, kv_len, v_dim]``.
    :param attention_mask: ``[batch, 1 or heads, q_len, >= kv_len]``, boolean or additive, or None.
    :param scaling: the factor applied to ``query @ key.T``; ``head_dim ** -0.5`` when None.
    :param softcap: when set, scores become ``softcap * tanh(scores / softcap)`` before masking.
    :param is_causal: whether a call without a mask is causal; the module's ``is_causal`` when None.
    :returns: the output, ``[batch, q_len, heads, v_dim]``, contiguous and in the query's dtype; and ``None``
        (no attention weights).
    """
    if dropout > 0 and getattr(module, "training", False):
        raise NotImplementedError("the example attention backend is for inference: it has no attention dropout "
                                  "(call model.eval(), or train with another attention implementation)")
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    accumulate = torch.promote_types(query.dtype, torch.float32)
    queries = grouped_queries(query, kv_heads).to(accumulate) * scaling
    bias = mask_bias(attention_mask, kv_len, heads, kv_heads, accumulate)
    causal = attention_mask is None and q_len > 1 and bool(is_causal)
    out = online_softmax_attention(queries, key, value, bias, causal, softcap, q_len)
    out = out.view(batch, heads, q_len, -1).transpose(1, 2)
    return out.to(query.dtype).contiguous(), None


def build_mask(batch_size: int, q_length: int, kv_length: int, *args: Any, allow_is_causal_skip: bool = True,
               **kwargs: Any) -> torch.Tensor | None:
    """transformers' ``sdpa_mask``, skipping the mask (returning None) only when one query, or as many queries
    as keys, make bottom-right and top-left alignment agree. ``sdpa_mask`` also skips it for a prefill into a
    static cache (more keys than queries, the extra ones empty slots), where SDPA's top-left ``is_causal`` is
    right and this kernel's bottom-right rule is not."""
    if q_length > 1 and kv_length != q_length:
        allow_is_causal_skip = False
    return sdpa_mask(batch_size, q_length, kv_length, *args, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def grouped_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, heads, q_len, dim]`` as ``[batch, kv_heads, group * q_len, dim]``: query head ``h`` reads
    key/value head ``h // group``, as transformers' ``repeat_kv`` pairs them."""
    batch, heads, q_len, dim = query.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot be grouped over {kv_heads} key/value heads")
    return query.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)


def mask_bias(mask: torch.Tensor | None, kv_len: int, heads: int, kv_heads: int,
              dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as an additive bias of shape ``[batch, kv_heads or 1, group or 1, q_len, kv_len]`` (0 where
    a key is seen, -inf where it is masked), laid out like the grouped scores."""
    if mask is None:
        return None
    mask = mask[..., :kv_len]  # static caches may hand a mask longer than the keys
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        # Additive masks mark masked keys with the dtype's most negative value rather than -inf; making them
        # -inf lets a row with every key masked come out as zeros instead of an average of its values.
        masked = mask <= torch.finfo(mask.dtype).min
        bias = mask.to(dtype).masked_fill(masked, float("-inf"))
    if bias.shape[1] == 1:
        return bias.unsqueeze(1)
    return bias.unflatten(1, (kv_heads, heads // kv_heads))


def causal_bias(q_len: int, kv_len: int, start: int, stop: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """``[q_len, stop - start]``: -inf where key ``start + j`` lies after query ``i``'s position
    ``kv_len - q_len + i`` (bottom-right alignment, so several queries over a cache see the whole cache)."""
    positions = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(start, stop, device=device)[None, :]
    return torch.zeros((), dtype=dtype, device=device).masked_fill(keys > positions, float("-inf"))


def online_softmax_attention(queries: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             bias: torch.Tensor | None, causal: bool, softcap: float | None,
                             q_len: int) -> torch.Tensor:
    """``softmax(queries @ key.T + bias) @ value`` one key chunk at a time, in the queries' dtype.

    ``queries`` is ``[batch, kv_heads, group * q_len, dim]``, already scaled. Returns
    ``[batch, kv_heads, group * q_len, v_dim]``; rows with every key masked are zeros."""
    batch, kv_heads, rows, _ = queries.shape
    kv_len, dtype = key.shape[2], queries.dtype
    running_max = queries.new_full((batch, kv_heads, rows, 1), float("-inf"))
    running_sum = queries.new_zeros((batch, kv_heads, rows, 1))
    accumulator = queries.new_zeros((batch, kv_heads, rows, value.shape[-1]))
    for start in range(0, kv_len, CHUNK_SIZE):
        stop = min(start + CHUNK_SIZE, kv_len)
        scores = queries @ key[:, :, start:stop].to(dtype).transpose(-1, -2)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = masked_scores(scores, bias, causal, q_len, kv_len, start, stop)
        chunk_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # While a row has seen only masked keys its maximum is -inf; shifting by 0 keeps exp() at 0, not NaN.
        shift = chunk_max.masked_fill(chunk_max == float("-inf"), 0.0)
        weights = torch.exp(scores - shift)
        rescale = torch.exp(running_max - shift)
        running_sum = running_sum * rescale + weights.sum(dim=-1, keepdim=True)
        accumulator = accumulator * rescale + weights @ value[:, :, start:stop].to(dtype)
        running_max = chunk_max
    return torch.where(running_sum > 0, accumulator / running_sum, 0.0)


def masked_scores(scores: torch.Tensor, bias: torch.Tensor | None, causal: bool, q_len: int, kv_len: int,
                  start: int, stop: int) -> torch.Tensor:
    """One chunk's ``[batch, kv_heads, group * q_len, chunk]`` scores with the mask (or the causal rule) added."""
    if bias is None and not causal:
        return scores
    batch, kv_heads, rows, width = scores.shape
    grouped = scores.view(batch, kv_heads, rows // q_len, q_len, width)
    if bias is not None:
        grouped = grouped + bias[..., start:stop]
    if causal:
        grouped = grouped + causal_bias(q_len, kv_len, start, stop, scores.dtype, scores.device)
    return grouped.reshape(batch, kv_heads, rows, width)
