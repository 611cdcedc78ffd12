"""Attention implementations that ship with transformers: ``sdpa`` and ``eager``, set on this instance only."""

from __future__ import annotations

from hf_accel.plugin import Backend, Capabilities, hookimpl, set_attention, transformers_refusal


def _transformers_backend(name: str, priority: int, description: str, **capabilities) -> Backend:
    return Backend(
        name=name,
        feature="attention",
        apply=lambda context: set_attention(context, name),
        why_unsuitable=lambda context: transformers_refusal(context, name),
        capabilities=Capabilities(partial_weights=True, **capabilities),
        priority=priority,
        description=description,
    )


@hookimpl
def hf_accel_register_backends(register):
    register(_transformers_backend("sdpa", 10, "PyTorch scaled_dot_product_attention, kernel chosen by PyTorch",
                                   softcap=False))
    register(_transformers_backend("eager", 0, "transformers' reference attention (matmul + softmax)"))
