"""``quantize="int4"`` on CPU: 4-bit weights in groups along the input dimension, activations in bf16.

Each group of ``group_size`` input weights of an output channel gets a bf16 scale and offset (asymmetric
min-max); the product runs in aten's ``_weight_int4pack_mm_for_cpu`` on weights packed once by
``_convert_weight_to_int4pack_for_cpu``, the same kernel torchao's int4 weight-only CPU layout calls.
Embedding tables named by ``include=`` keep a plain nibble table, dequantized row by row on lookup (the
kernel's packed layout is not row-addressable, so a head tied to a quantized embedding gets its own copy).
"""

from __future__ import annotations

import torch

from hf_accel.plugin import (
    SELECTION_OPTIONS,
    Backend,
    Capabilities,
    Option,
    PatchContext,
    hookimpl,
    kernel_selection,
    quantized_bytes,
    record_quantization,
    tensor_bytes,
)
from hf_accel_plugins.int4_layers import GROUP_SIZES, Int4Embedding, Int4WeightLinear, bytes_per_weight, kernel_problem


def quantize_int4(context: PatchContext) -> None:
    group_size = int(context.option("group_size", 32))
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size}; the int4 CPU kernel takes one of {GROUP_SIZES}")
    model, report = context.model, context.report
    report.weight_bytes_before = tensor_bytes(model)
    embeddings, linears, left = kernel_selection(context, lambda weight: Int4WeightLinear.takes(weight, group_size),
                                                 lambda embedding: embedding.embedding_dim % group_size == 0)
    for parent, name, qualified, embedding in embeddings:
        context.changes.set_submodule(parent, name, Int4Embedding(embedding, group_size))
        report.modules.append(qualified)
    for parent, name, qualified, linear in linears:
        context.changes.set_submodule(parent, name, Int4WeightLinear(linear, group_size))
        report.modules.append(qualified)
    record_quantization(context, f"int4 weights (asymmetric, groups of {group_size}), bf16 activations", left)


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="int4_weight_only",
        feature="quantize",
        apply=quantize_int4,
        why_unavailable=kernel_problem,
        capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16)),
        priority=10,
        lossless=False,
        tolerance=0.5,
        variants=("int4",),
        options={**SELECTION_OPTIONS, "group_size": Option.choice(*GROUP_SIZES)},
        memory_needed=lambda context: quantized_bytes(
            context, bytes_per_weight(int(context.option("group_size", 32)))),
        description="int4 weights in groups of 32 (asymmetric), bf16 activations, aten's int4 CPU kernel",
    ))
