"""``compile="inductor"``: stock ``generate``'s decode step compiled by ``torch.compile`` over a static cache.

Every later ``generate`` call gets a fixed-shape cache (a bucket of :data:`hf_accel.compiled_step.BUCKET`
positions, reused while it fits, window-sized for sliding-window layers) and transformers' own switch to a
compiled forward for the decode steps, served by :class:`~hf_accel.compiled_step.CompiledDecodeStep`:
inductor's C++ code on CPU, CUDA graphs (``mode="reduce-overhead"``) on CUDA. On CPU in fp32 the Linear
layers are first moved onto prepacked oneDNN weights (as ``compile="onednn_prepack"``), which inductor calls
as opaque kernels: on SmolLM2 on a 2-core CPU the matrix products are ~70% of a step, and compiling the rest
alone gains ~4%. The speculative loop (``speculative=``) compiles its own forwards with the same settings:
the target's verification chunks and a draft model's steps, over fixed-length caches it can roll back.
The prompt (prefill) stays eager.
"""

from __future__ import annotations

import shutil

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from hf_accel import Backend, PatchContext, hookimpl
from hf_accel.compiled_step import BF16_CHECK_TOLERANCE, CHECK_TOLERANCE, CompiledDecodeStep
from hf_accel.kv_cache import PreallocatedLayer
from hf_accel_plugins.compile_onednn import pack_linears


def install(context: PatchContext) -> None:
    model, state = context.model, context.state
    on_cuda = state.device.type == "cuda"
    if context.option("prepack", True) and _can_prepack(context):
        pack_linears(context)
    mode = context.option("compile_mode") or ("reduce-overhead" if on_cuda else None)
    quantized = state.report["quantize"].backend is not None
    low_precision = quantized or state.dtype in (torch.float16, torch.bfloat16)
    step = CompiledDecodeStep(model, mode=mode, bucket=int(context.option("cache_bucket", 256)),
                              details=context.report.details,
                              tolerance=BF16_CHECK_TOLERANCE if low_precision else CHECK_TOLERANCE)
    context.report.details["serves"] = ("stock generate's decode steps; the speculative loop compiles its own "
                                        "forwards with these settings (its report: speculative 'compiled')")
    context.changes.setattr(state, "compiled_step", step)
    context.changes.setattr(model, "get_compiled_call", step.get_compiled_call)


def _can_prepack(context: PatchContext) -> bool:
    return (context.state.device.type == "cpu" and context.state.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def why_unavailable() -> str | None:
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    return None


def why_unsuitable(context: PatchContext) -> str | None:
    model = context.model
    if context.state.device.type == "cpu" and _cpp_compiler() is None:
        return "inductor needs a C++ compiler on CPU and none was found (install g++ or clang, or set CXX)"
    if model.config.is_encoder_decoder:
        return "encoder-decoder models are not covered by the compiled decode step"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not mark {type(model).__name__} as compileable with a static cache"
    cache = context.state.kv_cache
    if cache is not None and any(type(layer).encode is not PreallocatedLayer.encode for layer in cache.layers):
        return ("the KV cache stores keys and values in another form (e.g. kv_cache='static-int8'), which the "
                "compiled step's fixed-shape cache would replace; use kv_cache='static' to compile the decode step")
    implementation = model.config._attn_implementation
    if ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) is flash_attention_mask:
        return (f"attention {implementation!r} takes unpadded sequences (flash-style masks), which a fixed-shape "
                "cache does not give it; choose attention='sdpa_flash' or 'sdpa' to compile the decode step")
    return None


def _cpp_compiler() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # raises when no compiler is found
        return shutil.which("g++") or shutil.which("clang++")


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="inductor",
        feature="compile",
        apply=install,
        why_unavailable=why_unavailable,
        why_unsuitable=why_unsuitable,
        probe="forward",  # checks the prepacked weights; each compiled graph is checked against eager on first use
        priority=20,
        options={"prepack": True, "compile_mode": None, "cache_bucket": 256},
        description="decode step compiled by torch.compile over a fixed-shape static cache (oneDNN weights on CPU)",
    ))
