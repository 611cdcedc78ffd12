"""``quantize="int8"`` on CPU: int8 weights with one scale per output channel, activations in bf16.

Each Linear weight is rounded to int8 (symmetric, per output channel) once; the product runs in aten's
``_weight_int8pack_mm`` with bf16 activations, reading a quarter of the fp32 bytes. Measured on a 2-core
AVX-512 CPU over SmolLM2's Linear shapes: ~11 ms for one token against ~46 ms for fp32 ``F.linear``, and
~16 ms for 4 tokens (so speculative verification stays cheap). fbgemm's dynamic int8 kernels were as fast
but quantize activations per tensor too, and agreed with fp32 on only ~38% of the verification probe's
top-1 tokens on this model; bitsandbytes' and torchao's int8 paths were slower than fp32 here.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_accel.plugin import (
    SELECTION_OPTIONS,
    Backend,
    Capabilities,
    PatchContext,
    hookimpl,
    kernel_selection,
    quantized_bytes,
    record_quantization,
    tensor_bytes,
)
from hf_accel_plugins.int8_layers import Int8Embedding, Int8WeightLinear, kernel_problem


def quantize_int8(context: PatchContext) -> None:
    model, report = context.model, context.report
    report.weight_bytes_before = tensor_bytes(model)
    replaced: dict[int, nn.Module] = {}  # id(original weight) -> its int8 module, to keep ties tied
    embeddings, linears, left = kernel_selection(context, Int8WeightLinear.takes)
    for parent, name, qualified, embedding in embeddings:
        replaced[id(embedding.weight)] = Int8Embedding(embedding)
        context.changes.set_submodule(parent, name, replaced[id(embedding.weight)])
        report.modules.append(qualified)
    for parent, name, qualified, linear in linears:
        module = Int8WeightLinear(linear)
        tied = replaced.get(id(linear.weight))
        if tied is not None:  # an output head tied to a quantized embedding shares its int8 table
            module.qweight, module.scale = tied.qweight, tied.scale
        context.changes.set_submodule(parent, name, module)
        report.modules.append(qualified)
    record_quantization(context, "int8 weights (symmetric, per output channel), bf16 activations", left)


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="int8_weight_only",
        feature="quantize",
        apply=quantize_int8,
        why_unavailable=kernel_problem,
        capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16)),
        priority=20,
        lossless=False,
        tolerance=0.1,
        variants=("int8",),
        options=SELECTION_OPTIONS,
        memory_needed=lambda context: quantized_bytes(context, 1.0),
        description="int8 per-channel weights, bf16 activations, aten's int8 weight-only CPU kernel",
    ))
