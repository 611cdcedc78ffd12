"""Attention implementations that ship with transformers: ``sdpa`` and ``eager``, set on this instance only."""

from __future__ import annotations

from typing import Iterator

from transformers import PreTrainedModel

from hf_accel import Backend, Capabilities, PatchContext, hookimpl


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
    """Switch the model to ``implementation`` (a name in transformers' AttentionInterface), undoably."""
    for config in configs_of(context.model):
        context.changes.setattr(config, "_attn_implementation_internal", config._attn_implementation_internal)
    context.model.set_attn_implementation(implementation)
    context.report.modules = [type(context.model).__name__]
    context.report.details["attn_implementation"] = implementation


def transformers_refusal(context: PatchContext, implementation: str) -> str | None:
    """Why transformers would refuse ``implementation`` for this model, asked before anything is changed."""
    model = context.model
    if not model._can_set_attn_implementation():
        return f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface"
    try:
        model.get_correct_attn_implementation(implementation)
    except (ValueError, ImportError) as exc:
        return str(exc).split(". ")[0]
    return None


def _transformers_backend(name: str, priority: int, description: str, **capabilities) -> Backend:
    return Backend(
        name=name,
        feature="attention",
        apply=lambda context: set_attention(context, name),
        why_unsuitable=lambda context: transformers_refusal(context, name),
        capabilities=Capabilities(**capabilities),
        priority=priority,
        description=description,
    )


@hookimpl
def hf_accel_register_backends(register):
    register(_transformers_backend("sdpa", 10, "PyTorch scaled_dot_product_attention, kernel chosen by PyTorch",
                                   softcap=False))
    register(_transformers_backend("eager", 0, "transformers' reference attention (matmul + softmax)"))
