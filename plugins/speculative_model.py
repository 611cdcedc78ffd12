"""Drafters that run a model: a smaller draft model given by the user, or a quantized copy of the target.

``draft_model``: ``patch(model, speculative=small_model)`` (or ``speculative="draft_model",
draft_model=small_model``). The draft model must share the target's tokenizer.

``self_int8`` / ``self_int4``: a copy of the target whose Linear layers are int8 per output channel, or
int4 in groups of 32 (with an int8 output head), on the same aten kernels as ``quantize="int8"`` /
``"int4"``. It shares the target's embeddings and norms, costs a quarter (an eighth) of the Linear weights
in extra memory, agrees with the target on most tokens, and runs each drafted token in a fraction of the
target's time on memory-bound hardware. Output stays the target's: every draft is verified.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_accel import Backend, Capabilities, Option, PatchContext, hookimpl
from hf_accel.quantize import linear_children, weight_and_bias
from hf_accel.speculative import DraftLength, ModelDrafter, SelfDrafter, install_runner, object_request_problem
from hf_accel_plugins.quantize_int4 import Int4WeightLinear
from hf_accel_plugins.quantize_int4 import kernel_problem as int4_kernel_problem
from hf_accel_plugins.quantize_int8 import Int8WeightLinear
from hf_accel_plugins.quantize_int8 import kernel_problem as int8_kernel_problem

logger = logging.getLogger(__name__)


def requested_draft_model(context: PatchContext) -> PreTrainedModel | None:
    """The draft model passed as ``speculative=<model>`` or ``draft_model=<model>``."""
    for candidate in (context.request, context.option("draft_model")):
        if isinstance(candidate, PreTrainedModel):
            return candidate
    return None


def vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()  # possibly a quantized module without a .weight
    return getattr(head, "out_features", None) or head.weight.shape[0]


def draft_model_problem(context: PatchContext) -> str | None:
    draft = requested_draft_model(context)
    if draft is None:
        return "needs a draft model: patch(model, speculative=small_model)"
    if draft is context.model:
        return "the draft model is the target itself; pass a smaller model"
    if next(draft.parameters()).device != context.device:
        return f"the draft model is on {next(draft.parameters()).device}, the target on {context.device}"
    target_vocab, draft_vocab = vocab_size(context.model), vocab_size(draft)
    if abs(target_vocab - draft_vocab) > 128:
        return f"vocabularies differ ({draft_vocab} vs {target_vocab} tokens): the draft needs the same tokenizer"
    return None


def install_draft_model(context: PatchContext) -> None:
    draft = requested_draft_model(context).eval()
    vocab = vocab_size(context.model)
    install_runner(context, lambda model, config: ModelDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8))
    context.report.details["draft_model"] = type(draft).__name__


def quantized_copy(model: PreTrainedModel, bits: int) -> nn.Module:
    """A copy of ``model`` sharing its non-Linear tensors (embeddings, norms), whose Linear layers are int8
    per output channel (``bits=8``), or int4 in groups of 32 with an int8 output head (``bits=4``)."""
    with torch.device("meta"):
        draft = type(model)(copy.deepcopy(model.config))
    draft.load_state_dict(model.state_dict(), assign=True, strict=False)
    for name, buffer in model.named_buffers():  # non-persistent buffers (rotary tables) are not in state_dict
        owner, _, leaf = name.rpartition(".")
        draft.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    draft.tie_weights()
    for name, param in draft.named_parameters():
        if param.is_meta:
            raise RuntimeError(f"could not copy parameter {name} into the quantized draft")
    head = draft.get_output_embeddings()
    for parent, name, _, linear in list(linear_children(draft)):
        in_features = weight_and_bias(linear)[0].shape[1]
        four_bits = bits == 4 and linear is not head and in_features % 32 == 0
        setattr(parent, name, Int4WeightLinear(linear, 32) if four_bits else Int8WeightLinear(linear))
    return draft.eval()


def install_self_draft(context: PatchContext, bits: int) -> None:
    draft = quantized_copy(context.model, bits)
    vocab = vocab_size(context.model)
    install_runner(context, lambda model, config: SelfDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8))
    context.report.details["draft"] = SELF_DRAFTS[bits]


def self_draft_problem(context: PatchContext) -> str | None:
    """Why a quantized copy cannot be made of this target (or would not be cheaper), or None."""
    problem = object_request_problem(context)
    if problem:
        return problem
    # Not hf_quantizer: a GGUF checkpoint loads through one, dequantized to floating point.
    quantized_weights = any(not p.is_floating_point() for p in context.model.parameters())
    if context.state.report["quantize"].backend is not None or quantized_weights:
        return "the target's weights are quantized already, so a quantized copy would not draft any cheaper"
    with torch.device("meta"):
        fresh = type(context.model)(copy.deepcopy(context.model.config))
    if fresh.state_dict().keys() != context.model.state_dict().keys():
        return ("the model's modules differ from what its class builds from its config (adapters such as LoRA?), "
                "so a quantized copy cannot be made from it; merge the adapters first")
    return None


#: What each self-draft is, for the report.
SELF_DRAFTS = {8: "int8 per-channel copy of the target", 4: "int4 (groups of 32) copy of the target, int8 head"}


def kernel_problem(bits: int):
    return lambda: int4_kernel_problem() if bits == 4 else int8_kernel_problem()


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="draft_model",
        feature="speculative",
        apply=install_draft_model,
        why_unsuitable=draft_model_problem,
        probe="generate",
        priority=20,
        options={"draft_model": Option.any_of(None, lambda v: v is None or isinstance(v, PreTrainedModel),
                                              "a transformers PreTrainedModel (the draft) or None")},
        description="a smaller model with the same tokenizer drafts, the target verifies",
    ))
    for bits in (8, 4):
        register(Backend(
            name=f"self_int{bits}",
            feature="speculative",
            apply=lambda context, bits=bits: install_self_draft(context, bits),
            why_unavailable=kernel_problem(bits),
            why_unsuitable=self_draft_problem,
            capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16)),
            probe="generate",
            priority=5,
            description=f"an {SELF_DRAFTS[bits]} drafts, the target verifies",
        ))
