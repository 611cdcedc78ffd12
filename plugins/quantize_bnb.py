"""``quantize="nf4" | "fp4" | "int8"`` (or ``"bnb"``) through bitsandbytes, on CUDA or its CPU path.

Converts the already-loaded weights in place (transformers can only quantize with bitsandbytes while
loading): each selected Linear becomes a ``Linear4bit`` (NF4 or FP4, 64-value blocks, optional double
quantization of the block scales with ``bnb_double_quant=True``) or a ``Linear8bitLt`` (LLM.int8).
On this project's 2-core CPU its kernels were slower than fp32 before any code existed (int8 ~18.5,
nf4 ~12.8 tokens/s against ~16), so ``quantize="int8"`` prefers ``int8_weight_only`` there; ``nf4`` and
``fp4`` are only offered by this backend.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_accel.plugin import (
    SELECTION_OPTIONS,
    Backend,
    Capabilities,
    Option,
    PatchContext,
    hookimpl,
    record_quantization,
    selected_linears,
    tensor_bytes,
    weight_and_bias,
)

logger = logging.getLogger(__name__)
SCHEMES = ("nf4", "fp4", "int8")
#: Columns of a repacked 4-bit weight read per product when saving (bounds the identity block's memory).
IDENTITY_BLOCK = 1024


def scheme_of(context: PatchContext) -> str:
    request = context.request
    return request if request in SCHEMES else str(context.option("bnb_quant_type", "nf4"))


def bnb_linear(linear: nn.Module, scheme: str, compute_dtype: torch.dtype, double_quant: bool) -> nn.Module:
    import bitsandbytes as bnb

    weight, bias = weight_and_bias(linear)
    out_features, in_features = weight.shape
    device = weight.device
    if scheme == "int8":
        module = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                     device="meta")
        module.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        module = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                   compress_statistics=double_quant, quant_type=scheme, device="meta")
        module.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type=scheme,
                                          compress_statistics=double_quant)
    if bias is not None:
        module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    module = module.to(device)  # bitsandbytes quantizes when the weight moves to a real device
    # On the instance, in place of bitsandbytes' own: that one first undoes the CPU kernel's repacking of
    # 4-bit codes, which (bitsandbytes 0.50) scrambles rows of the layer itself.
    module._save_to_state_dict = functools.partial(_save_float_state, module, dtype=weight.dtype,
                                                   transposed=isinstance(linear, Conv1D))
    module.register_load_state_dict_pre_hook(_refuse_float_weights)
    return module


def dequantized(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a bitsandbytes layer computes with."""
    import bitsandbytes as bnb

    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is not None and not getattr(state, "packing_format_for_cpu", False):
        return bnb.functional.dequantize_4bit(weight.data, state).float()
    if state is not None:
        # 4-bit codes the CPU kernel repacked at the first forward: read through the layer's own product with
        # the identity, in blocks of columns, as the kernel reads them (bitsandbytes' inverse of the repacking
        # mixed up rows here). Products with 1 and 0 are exact: these are its weights.
        dtype = module.compute_dtype or torch.float32
        columns = []
        with torch.no_grad():
            for start in range(0, module.in_features, IDENTITY_BLOCK):
                eye = torch.eye(module.in_features, device=weight.device, dtype=dtype)[start:start + IDENTITY_BLOCK]
                columns.append(bnb.matmul_4bit(eye, weight, bias=None, quant_state=state).float().t())
        return torch.cat(columns, dim=1)
    # LLM.int8: one absmax per row, which bitsandbytes moves to the layer's state at its first forward.
    row_absmax = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
    return weight.data.float() * row_absmax.float()[:, None] / 127


def _save_float_state(module: nn.Module, destination: dict, prefix: str, keep_vars: bool, dtype: torch.dtype,
                      transposed: bool) -> None:
    """The layer's state as the float module it replaced (``Conv1D`` stores ``[in, out]``): ``weight`` (what it
    computes with) and ``bias``, not bitsandbytes' codes and statistics, which transformers would load into a
    float model as numbers."""
    weight = dequantized(module)
    destination[prefix + "weight"] = (weight.t() if transposed else weight).to(dtype)
    if module.bias is not None:
        destination[prefix + "bias"] = module.bias if keep_vars else module.bias.detach()


def _refuse_float_weights(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    if prefix + "weight" in state_dict:
        raise RuntimeError(
            f"{prefix.rstrip('.')} is a bitsandbytes layer made by hf_accel.patch and cannot take new weights; load "
            "them before patching, or patch with keep_original=True and hf_accel.unpatch(model) first")


def quantize(context: PatchContext) -> None:
    scheme = scheme_of(context)
    if scheme not in SCHEMES:
        raise ValueError(f"bnb_quant_type={scheme!r}; choose one of {', '.join(SCHEMES)}")
    double_quant = bool(context.option("bnb_double_quant", False))
    report = context.report
    report.weight_bytes_before = tensor_bytes(context.model)
    for parent, name, qualified, linear in selected_linears(context):
        context.changes.set_submodule(parent, name, bnb_linear(linear, scheme, context.dtype, double_quant))
        report.modules.append(qualified)
    record_quantization(context, f"bitsandbytes {scheme}" + (" with double quantization" if double_quant else ""))


def bnb_problem() -> str | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    return None


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="bnb",
        feature="quantize",
        apply=quantize,
        why_unavailable=bnb_problem,
        # Each quantized layer is made on its own weight's device, so a model split by device_map stays split.
        capabilities=Capabilities(devices=("cpu", "cuda"), dtypes=(torch.float32, torch.float16, torch.bfloat16),
                                  split_devices=True),
        priority=5,
        lossless=False,
        # 4-bit moves logits far (SmolLM2 nf4: 0.77 on the probe, perplexity +18%); this catches broken output
        tolerance=0.9,
        variants=SCHEMES,
        options={**SELECTION_OPTIONS, "bnb_quant_type": Option.choice(*SCHEMES),
                 "bnb_double_quant": Option.flag(False)},
        install="pip install 'hf_accel[bnb]'",
        description="bitsandbytes LLM.int8 or 4-bit NF4/FP4 Linear layers, converted from the loaded weights",
    ))
