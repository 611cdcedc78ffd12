"""Find the transformers model inside the wrappers users hand us."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PreTrainedModel

_MAX_DEPTH = 8


def unwrap_model(model: Any) -> PreTrainedModel:
    """The ``PreTrainedModel`` inside DDP/FSDP/DeepSpeed (``.module``), ``torch.compile`` (``._orig_mod``)
    or PEFT (``.get_base_model()``) wrappers, however they are nested.

    Example::

        >>> unwrap_model(torch.compile(model)) is model
        True
    """
    current = model
    for _ in range(_MAX_DEPTH):
        if isinstance(current, PreTrainedModel) and not hasattr(current, "get_base_model"):
            return current
        inner = _inner(current)
        if inner is None:
            break
        current = inner
    if isinstance(current, PreTrainedModel):
        return current
    raise TypeError(
        f"hf_accel.patch needs a transformers PreTrainedModel (or one wrapped by accelerate, DDP, "
        f"torch.compile or PEFT); got {type(model).__name__}. Load the model with "
        "AutoModelForCausalLM.from_pretrained(...) and pass it."
    )


def _inner(wrapper: Any) -> Any:
    if callable(getattr(wrapper, "get_base_model", None)):  # PEFT
        base = wrapper.get_base_model()
        return None if base is wrapper else base
    for attr in ("_orig_mod", "module"):  # torch.compile; DDP, FSDP, DataParallel, DeepSpeed
        inner = getattr(wrapper, attr, None)
        if isinstance(inner, nn.Module):
            return inner
    return None
