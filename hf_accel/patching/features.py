"""The features hf_accel knows, in the order patch() applies them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    name: str
    summary: str
    #: "auto" may pick a lossy backend only where asking for the feature at all is opting in to a loss.
    opt_in_loss: bool = False


# Weights first (everything after sees the final Linear modules), then the attention kernel the forward
# uses, then what wraps calls: the cache, the compiled step over that cache, and the generation loop.
FEATURES: tuple[Feature, ...] = (
    Feature("quantize", "replace Linear weights with quantized ones", opt_in_loss=True),
    Feature("attention", "swap the attention kernel"),
    Feature("kv_cache", "preallocated KV cache reused across generate calls"),
    Feature("compile", "compiled decode step"),
    Feature("speculative", "draft/verify loop around generate"),
)
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)


def get_feature(name: str) -> Feature:
    for feature in FEATURES:
        if feature.name == name:
            return feature
    raise ValueError(f"Unknown feature {name!r}; valid features: {', '.join(FEATURE_NAMES)}")
