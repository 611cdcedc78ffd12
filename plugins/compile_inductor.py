"""``compile="inductor"``: decode steps whose decoder layers run graphs compiled by ``torch.compile``.

Every later ``generate`` call gets a fixed-shape cache (a bucket of :data:`hf_accel.runtime.compiled_step.BUCKET`
positions, reused while it fits) and transformers' own switch to a compiled forward for the decode steps,
served by :class:`~hf_accel.runtime.compiled_step.CompiledDecodeStep`: the model's forward with its decoder layers
compiled one kind at a time (regional compilation: one layer's graph serves all of them), inductor's C++ code
on CPU, CUDA graphs (``mode="reduce-overhead"``) on CUDA. On CPU in fp32 the Linear layers are first moved
onto prepacked oneDNN weights (as ``compile="onednn_prepack"``), which inductor calls as opaque kernels. The
speculative loop runs its target's verification chunks through the same step and compiles a draft model's
steps with the same settings. The prompt (prefill) stays eager.

When to compile is ``compile_when``: ``"auto"`` runs layers eagerly until what a compiled graph would have
saved them exceeds the time compiling is expected to take (see :mod:`hf_accel.runtime.compile_policy`),
``"first_use"`` compiles when a call first needs a shape. Compiled code persists in ``compile_cache``
(default: ``HF_ACCEL_CACHE``, else ``$XDG_CACHE_HOME/hf_accel``, else ``~/.cache/hf_accel``; ``False``: not
kept).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from hf_accel.plugin import (
    BF16_CHECK_TOLERANCE,
    CHECK_TOLERANCE,
    Backend,
    CompiledDecodeStep,
    CompilePolicy,
    CompileStore,
    Option,
    PatchContext,
    PreallocatedLayer,
    decoder_layers,
    hookimpl,
    is_routed,
)
from hf_accel_plugins.onednn_packing import pack_linears, packing_problem


class InductorCompiler:
    """Inductor as the compiled step's :class:`GraphCompiler`, counting the graphs it compiles. ``mode`` as in
    ``torch.compile`` (``"reduce-overhead"`` turns on CUDA graphs)."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs, config_patches=list_mode_options(self.mode) if self.mode else None)

    def fresh(self) -> InductorCompiler:
        return InductorCompiler(self.mode)

    @contextlib.contextmanager
    def caching_in(self, directory: Path) -> Iterator[None]:
        """Inductor's cache directory (a process-wide environment variable) is ``directory`` while a compile
        runs, and what it was afterwards."""
        previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def install(context: PatchContext) -> None:
    model, state = context.model, context.state
    on_cuda = state.device.type == "cuda"
    if context.option("prepack", True):
        problem = packing_problem(context)
        if problem is None:
            pack_linears(context)
        context.report.details["prepacked"] = True if problem is None else f"no: {problem}"
    mode = context.option("compile_mode") or ("reduce-overhead" if on_cuda else None)
    quantized = state.report["quantize"].backend is not None
    low_precision = quantized or state.dtype in (torch.float16, torch.bfloat16)
    step = CompiledDecodeStep(model, InductorCompiler(mode), bucket=int(context.option("cache_bucket", 256)),
                              details=context.report.details,
                              tolerance=BF16_CHECK_TOLERANCE if low_precision else CHECK_TOLERANCE,
                              policy=CompilePolicy(when=context.option("compile_when", "auto")),
                              store=_store(context.option("compile_cache", True)))
    context.report.details["serves"] = ("stock generate's decode steps and the speculative loop's verification "
                                        "chunks; a draft model's compiled steps are in the speculative report")
    step.install(context.changes)
    context.changes.on_undo(step.release)
    context.changes.setattr(state, "compiled_step", step)
    context.account_memory("compiled step's static caches", step.cache_bytes)
    context.changes.setattr(model, "get_compiled_call", step.get_compiled_call)


def _is_store_setting(value: object) -> bool:
    return value is None or isinstance(value, (bool, str, os.PathLike))  # not 1 or 0.0, which equal True/False


def _store(setting: object) -> CompileStore | None:
    """``compile_cache``: True for the default directory, a path, or False/None for no store."""
    if setting in (None, False):
        return None
    return CompileStore(None if setting is True else str(setting))


def why_unavailable() -> str | None:
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    return None


def why_unsuitable(context: PatchContext) -> str | None:
    problem = _model_problem(context)
    if problem:
        return problem
    cache = context.state.kv_cache
    if cache is not None and any(type(layer).encode is not PreallocatedLayer.encode for layer in cache.layers):
        return ("the KV cache stores keys and values in another form (e.g. kv_cache='static-int8'), which the "
                "compiled step's fixed-shape cache would replace; use kv_cache='static' to compile the decode step")
    implementation = context.model.config._attn_implementation
    if ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) is flash_attention_mask:
        return (f"attention {implementation!r} takes unpadded sequences (flash-style masks), which a fixed-shape "
                "cache does not give it; choose attention='sdpa_flash' or 'sdpa' to compile the decode step")
    return None


def _model_problem(context: PatchContext) -> str | None:
    """Why the step cannot serve this model at all, whatever attention and KV cache it is given."""
    model = context.model
    if context.state.device.type == "cpu" and _cpp_compiler() is None:
        return "inductor needs a C++ compiler on CPU and none was found (install g++ or clang, or set CXX)"
    if model.config.is_encoder_decoder:
        return "encoder-decoder models are not covered by the compiled decode step"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not mark {type(model).__name__} as compileable with a static cache"
    try:
        regions = decoder_layers(model)
    except ValueError as exc:
        return str(exc)
    if any("forward" in vars(region.layer) and not is_routed(region.layer) for region in regions):
        return ("its decoder layers' forward is wrapped on the instance (accelerate hooks?), which compiling would "
                "bypass")
    return None


def _cpp_compiler() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # raises when no compiler is found
        return shutil.which("g++") or shutil.which("clang++")


@hookimpl(trylast=True)  # every other plugin's choice first; the core's plain ranking after this
def hf_accel_select_backend(feature: str, candidates: tuple[Backend, ...], context: PatchContext) -> Backend | None:
    """``auto`` attention, when this step will compile the decode steps: the best candidate that takes padded
    masks. A flash-style kernel ranks higher on CUDA but would leave the model with no compiled step, and for the
    one-token decode steps that dominate generation the step (CUDA graphs, fused code) outweighs the kernel. Not
    a reference implementation (priority 0 or less: ``eager``), whose N x N scores would replace the flash
    kernel's memory use at long prompts; not when the user chose the KV cache, which the step may not serve."""
    arguments = context.state.arguments
    if feature != "attention" or arguments.get("compile") not in ("auto", True, "inductor"):
        return None
    if arguments.get("kv_cache") not in ("auto", True, None, False) or why_unavailable() or _model_problem(context):
        return None  # no step to keep, or one that may not come: the plain ranking stands
    padded = next((candidate for candidate in candidates if candidate.capabilities.padded_masks), None)
    return padded if padded is not None and padded.priority > 0 else None


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
        options={"prepack": Option.flag(True),
                 "keep_original": Option.flag(False),
                 "compile_mode": Option.choice(None, "default", "reduce-overhead", "max-autotune",
                                               "max-autotune-no-cudagraphs"),
                 "cache_bucket": Option.integer(256, maximum=1 << 16),
                 "compile_when": Option.choice("auto", "first_use"),
                 "compile_cache": Option.any_of(True, _is_store_setting, "True, False, None or a directory path")},
        description="decode step compiled by torch.compile over a fixed-shape static cache (oneDNN weights on CPU)",
    ))
