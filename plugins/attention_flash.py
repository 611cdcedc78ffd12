"""FlashAttention for any transformers causal LM, set on one model instance.

``sdpa_flash``: PyTorch's own flash kernel through ``scaled_dot_product_attention``, with grouped-query
attention computed natively (keys and values are never repeated per query head). On CUDA the kernel is
chosen per call: flash, or the memory-efficient kernel for padded or sliding-window calls, which flash
cannot mask. On CPU the flash kernel takes any mask and the default dispatch picks it once GQA is native,
so nothing is forced there (``sdpa_kernel`` flips process-wide flags); the report counts, per call, the
kernel the dispatcher picked.

``flash_attn``: the ``flash-attn`` package (FlashAttention-2, CUDA, fp16/bf16). Unpadded calls go to
``flash_attn_func``; padded batches are unpadded to ``cu_seqlens`` and sent to ``flash_attn_varlen_func``,
then padded back. Causal (bottom-right aligned, so decode steps over a cache work), GQA/MQA, sliding window
(``window_size``) and logit soft-capping are passed to the kernel.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.masking_utils import flash_attention_mask, sdpa_mask

from hf_accel.plugin import (
    Backend,
    Capabilities,
    PatchContext,
    head_dim,
    hookimpl,
    is_tracing,
    register_implementation,
    set_attention,
    transformers_refusal,
)

SDPA_FLASH = "hf_accel_sdpa_fa"  # transformers treats names containing "flash" as hub kernels
FLASH_ATTN = "hf_accel_fa2"
#: Which kernel ``sdpa_flash`` ran, and why when it was not the flash kernel (process-wide counts of eager calls).
KERNEL_CALLS: Counter[str] = Counter()


# -- sdpa_flash ---------------------------------------------------------------------------------------------
def sdpa_flash_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = attention_mask is None and query.shape[2] > 1 and bool(
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    kernel, why = _sdpa_kernel_for(query, attention_mask)
    gqa = query.shape[1] != key.shape[1]
    if not is_tracing():  # a Python counter in a compiled graph would recompile every step
        if query.device.type == "cpu":  # not forced on CPU (see below): count what the dispatcher picks
            kernel = SDPBackend(torch._fused_sdp_choice(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
                is_causal=causal, scale=scaling, enable_gqa=gqa))
            why = "" if kernel == SDPBackend.FLASH_ATTENTION else "chosen by the default CPU dispatch"
        KERNEL_CALLS[f"{kernel.name.lower()}{f' ({why})' if why else ''}"] += 1
    if gqa and kernel != SDPBackend.FLASH_ATTENTION and query.device.type != "cpu":
        repeat = query.shape[1] // key.shape[1]  # only CUDA's flash and math kernels take GQA natively
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        gqa = False
    # sdpa_kernel switches process-wide flags (another thread's attention would run under them) and dynamo
    # cannot trace it. On CPU the default dispatch picks the flash kernel for these calls anyway (masks and
    # GQA included; tests/test_attention.py checks it), so it is used on CUDA only, outside compiled graphs.
    explicit = query.device.type != "cpu" and not is_tracing()
    choose = sdpa_kernel([kernel]) if explicit else contextlib.nullcontext()
    with choose:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             dropout_p=dropout if module.training else 0.0, scale=scaling,
                                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_kernel_for(query: torch.Tensor, mask: torch.Tensor | None) -> tuple[SDPBackend, str]:
    if query.device.type == "cpu":
        return SDPBackend.FLASH_ATTENTION, ""
    if query.dtype not in (torch.float16, torch.bfloat16):
        return SDPBackend.EFFICIENT_ATTENTION, "flash needs fp16/bf16"
    if mask is not None:
        return SDPBackend.EFFICIENT_ATTENTION, "flash takes no mask (padding or sliding window)"
    return SDPBackend.FLASH_ATTENTION, ""


def apply_sdpa_flash(context: PatchContext) -> None:
    set_attention(context, SDPA_FLASH)
    context.report.details["kernel_calls"] = KERNEL_CALLS
    context.report.details["kernel_rule"] = (
        "CPU: the default dispatch, which picks flash for masked and GQA calls (counted per call)"
        if context.device.type == "cpu"
        else "flash when unmasked fp16/bf16, else memory-efficient")


# -- flash_attn ---------------------------------------------------------------------------------------------
_injected: list[Any] = []


@contextlib.contextmanager
def injected_kernels(kernels: Any) -> Iterator[None]:
    """Use ``kernels`` (anything with ``flash_attn_func`` and ``flash_attn_varlen_func``) in place of the
    flash-attn package, e.g. a reference implementation to test the adapter on a machine without CUDA."""
    _injected.append(kernels)
    try:
        yield
    finally:
        _injected.remove(kernels)


def flash_kernels() -> Any:
    if _injected:
        return _injected[-1]
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def flash_attn_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    kernels = flash_kernels()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # flash-attn wants [batch, seq, heads, dim]
    options = dict(dropout_p=dropout if module.training else 0.0, softmax_scale=scaling,
                   causal=bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)),
                   window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                   softcap=softcap or 0.0)
    if attention_mask is None:
        return kernels.flash_attn_func(q, k, v, **options), None
    return _varlen(kernels, q, k, v, attention_mask[:, -k.shape[1]:].bool(), options), None


def _varlen(kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            options: dict[str, Any]) -> torch.Tensor:
    """Unpad each row to its real tokens, run the varlen kernel over ``cu_seqlens``, pad back."""
    batch, q_len, heads, dim = q.shape
    q_mask = mask[:, -q_len:]
    q_index, cu_q, max_q = _unpad_index(q_mask)
    k_index, cu_k, max_k = _unpad_index(mask)
    out = kernels.flash_attn_varlen_func(
        q.reshape(-1, heads, dim)[q_index], k.reshape(-1, *k.shape[2:])[k_index],
        v.reshape(-1, *v.shape[2:])[k_index], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, **options)
    padded = out.new_zeros(batch * q_len, heads, out.shape[-1])
    padded[q_index] = out
    return padded.view(batch, q_len, heads, -1)


def _unpad_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    lengths = mask.sum(-1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return mask.flatten().nonzero()[:, 0], cu_seqlens, int(lengths.max())


def flash_attn_unavailable() -> str | None:
    return None if flash_kernels() is not None else "the flash-attn package is not installed (it needs CUDA)"


def flash_attn_unsuitable(context: PatchContext) -> str | None:
    if head_dim(context.model) > 256:
        return f"FlashAttention-2 supports head dimensions up to 256, this model's is {head_dim(context.model)}"
    if not _injected:  # the real package: CUDA and half precision only
        if context.device.type != "cuda":
            return f"flash-attn runs on CUDA, the model is on {context.device.type}"
        if context.dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn needs fp16/bf16 weights, the model is {str(context.dtype).removeprefix('torch.')}"
    return transformers_refusal(context, FLASH_ATTN)


@hookimpl
def hf_accel_register_backends(register):
    register_implementation(SDPA_FLASH, sdpa_flash_forward, sdpa_mask)
    register_implementation(FLASH_ATTN, flash_attn_forward, flash_attention_mask)
    register(Backend(
        name="flash_attn",
        feature="attention",
        apply=lambda context: set_attention(context, FLASH_ATTN),
        why_unavailable=flash_attn_unavailable,
        why_unsuitable=flash_attn_unsuitable,
        capabilities=Capabilities(partial_weights=True, padded_masks=False),  # it sees activations, not weights
        priority=30,
        install="pip install 'hf_accel[flash]'",
        description="FlashAttention-2 kernels from the flash-attn package (varlen for padded batches)",
    ))
    register(Backend(
        name="sdpa_flash",
        feature="attention",
        apply=apply_sdpa_flash,
        why_unsuitable=lambda context: transformers_refusal(context, SDPA_FLASH),
        capabilities=Capabilities(softcap=False, partial_weights=True),
        priority=20,
        description="PyTorch's flash kernel (chosen on CUDA, picked by the dispatcher on CPU), GQA without repeating "
                    "keys/values",
    ))
