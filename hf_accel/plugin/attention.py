"""Helpers for attention backends: switching a model instance's attention implementation, undoably."""

from __future__ import annotations

from typing import Callable, Iterator

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from hf_accel.patching.backends import PatchContext


def configs_of(model: PreTrainedModel) -> Iterator[object]:
    """Every config object whose ``_attn_implementation`` the model's layers read: its own, its
    sub-models' and their sub-configs, each once."""
    seen: set[int] = set()
    stack = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while stack:
        config = stack.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        yield config
        stack.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))


def set_attention(context: PatchContext, implementation: str) -> None:
    """Switch this model instance to ``implementation`` (a name in transformers' AttentionInterface)."""
    for config in configs_of(context.model):
        context.changes.setattr(config, "_attn_implementation_internal", config._attn_implementation_internal)
    context.model.set_attn_implementation(implementation)
    context.report.modules = [type(context.model).__name__]
    context.report.details["attn_implementation"] = implementation


def register_implementation(name: str, forward: Callable, mask: Callable) -> None:
    """Make ``name`` selectable per model: transformers looks attention and mask builders up by name.
    Registering a new name changes nothing for models that do not select it."""
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask)


def head_dim(model: PreTrainedModel) -> int:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def transformers_refusal(context: PatchContext, implementation: str) -> str | None:
    """Why transformers would refuse ``implementation`` for this model, asked before anything changes."""
    model = context.model
    if not model._can_set_attn_implementation():
        return f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface"
    try:
        model.get_correct_attn_implementation(implementation)
    except (ValueError, ImportError, KeyError) as exc:
        return str(exc).split(". ")[0]
    return None
