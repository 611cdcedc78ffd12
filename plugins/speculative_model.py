"""Drafters that run a model: a smaller draft model given by the user, or an int8 copy of the target.

``draft_model``: ``patch(model, speculative=small_model)`` (or ``speculative="draft_model",
draft_model=small_model``). The draft model must share the target's tokenizer.

``self_int8``: a copy of the target whose Linear layers are int8 with one scale per output channel
(fbgemm's dynamic-quantized kernels on CPU). It shares the target's embeddings and norms, costs about a
quarter of the Linear weights in extra memory, agrees with the target on most tokens, and runs each
drafted token in a fraction of the target's time on memory-bound hardware. Output stays the target's:
every draft is verified.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_accel import Backend, Capabilities, PatchContext, hookimpl
from hf_accel.speculative import DraftLength, ModelDrafter, install_runner, object_request_problem

logger = logging.getLogger(__name__)


def requested_draft_model(context: PatchContext) -> PreTrainedModel | None:
    """The draft model passed as ``speculative=<model>`` or ``draft_model=<model>``."""
    for candidate in (context.request, context.option("draft_model")):
        if isinstance(candidate, PreTrainedModel):
            return candidate
    return None


def _vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def draft_model_problem(context: PatchContext) -> str | None:
    draft = requested_draft_model(context)
    if draft is None:
        return "needs a draft model: patch(model, speculative=small_model)"
    if draft is context.model:
        return "the draft model is the target itself; pass a smaller model"
    if next(draft.parameters()).device != context.device:
        return f"the draft model is on {next(draft.parameters()).device}, the target on {context.device}"
    target_vocab, draft_vocab = _vocab_size(context.model), _vocab_size(draft)
    if abs(target_vocab - draft_vocab) > 128:
        return f"vocabularies differ ({draft_vocab} vs {target_vocab} tokens): the draft needs the same tokenizer"
    return None


def install_draft_model(context: PatchContext) -> None:
    draft = requested_draft_model(context).eval()
    vocab = _vocab_size(context.model)
    install_runner(context, lambda model, config: ModelDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8))
    context.report.details["draft_model"] = type(draft).__name__


def int8_copy(model: PreTrainedModel) -> nn.Module:
    """A copy of ``model`` sharing its non-Linear tensors, with every Linear quantized to int8 per channel."""
    with torch.device("meta"):
        draft = type(model)(copy.deepcopy(model.config))
    draft.load_state_dict(model.state_dict(), assign=True, strict=False)
    for name, buffer in model.named_buffers():  # non-persistent buffers (rotary tables) are not in state_dict
        owner, _, leaf = name.rpartition(".")
        draft.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    draft.tie_weights()
    for name, param in draft.named_parameters():
        if param.is_meta:
            raise RuntimeError(f"could not copy parameter {name} into the int8 draft")
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    with warnings.catch_warnings():  # the eager quantization API is deprecated, and still the fast CPU int8 path
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
        return torch.ao.quantization.quantize_dynamic(draft.eval(), {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)


def install_self_int8(context: PatchContext) -> None:
    draft = int8_copy(context.model)
    vocab = _vocab_size(context.model)
    install_runner(context, lambda model, config: ModelDrafter(draft, config, vocab), DraftLength(k=4, low=1, high=8))
    context.report.details["draft"] = "int8 per-channel copy of the target"


def fbgemm_problem() -> str | None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm quantized engine"
    return None


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="draft_model",
        feature="speculative",
        apply=install_draft_model,
        why_unsuitable=draft_model_problem,
        probe="generate",
        priority=20,
        options={"draft_model": None},
        description="a smaller model with the same tokenizer drafts, the target verifies",
    ))
    register(Backend(
        name="self_int8",
        feature="speculative",
        apply=install_self_int8,
        why_unavailable=fbgemm_problem,
        why_unsuitable=object_request_problem,
        capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32,)),
        probe="generate",
        priority=5,
        description="an int8 copy of the target drafts, the fp32 target verifies",
    ))
