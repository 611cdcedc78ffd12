"""Drafters that run a model: a smaller draft model given by the user, or a quantized copy of the target.

``draft_model``: ``patch(model, speculative=small_model)`` (or ``speculative="draft_model",
draft_model=small_model``). The draft model must share the target's tokenizer.

``self_int8`` / ``self_int4``: a copy of the target whose Linear layers are int8 per output channel, or
int4 in groups of 32 (int8 where the int4 kernel cannot take a layer's shape), on the same aten kernels as
``quantize="int8"`` / ``"int4"``. Where the target's head holds a plain weight, the copy's head (int4 in an
int4 copy, shape permitting) has its best 8 logits recomputed from it; otherwise the head is int8. It shares
the target's embeddings and norms, costs about a quarter (a sixth) of the fp32 Linear weights in extra memory, agrees
with the target on most tokens, and runs each drafted token in a fraction of the target's time on
memory-bound hardware. Output stays the target's: every draft is verified.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_accel.plugin import Backend, Capabilities, DraftLength, Option, PatchContext, hookimpl, install_runner
from hf_accel_plugins.drafters import ModelDrafter, SelfDrafter
from hf_accel_plugins.int4_layers import kernel_problem as int4_kernel_problem
from hf_accel_plugins.int8_layers import kernel_problem as int8_kernel_problem
from hf_accel_plugins.self_drafts import SELF_DRAFTS, describe, draft_bytes, self_draft, self_draft_problem, vocab_size


def requested_draft_model(context: PatchContext) -> PreTrainedModel | None:
    """The draft model passed as ``speculative=<model>`` or ``draft_model=<model>``."""
    for candidate in (context.request, context.option("draft_model")):
        if isinstance(candidate, PreTrainedModel):
            return candidate
    return None


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
    install_runner(context, lambda model, config: ModelDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8),
                   drafts=(draft,))
    context.report.details["draft_model"] = type(draft).__name__


def install_self_draft(context: PatchContext, bits: int) -> None:
    draft = self_draft(context, bits)
    vocab = vocab_size(context.model)
    install_runner(context, lambda model, config: SelfDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8),
                   drafts=(draft,))
    context.report.details["draft"] = describe(draft, bits)


def kernel_problem(bits: int):
    return lambda: int4_kernel_problem() if bits == 4 else int8_kernel_problem()


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="draft_model",
        feature="speculative",
        apply=install_draft_model,
        why_unsuitable=draft_model_problem,
        capabilities=Capabilities(partial_weights=True),  # the draft is a model of its own; the target runs as it is
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
            memory_needed=lambda context, bits=bits: draft_bytes(context, bits),
            description=f"an {SELF_DRAFTS[bits]} drafts, the target verifies",
        ))
