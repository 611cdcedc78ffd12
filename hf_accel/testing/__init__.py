"""The conformance suite plugin authors run against their backends, and the tiny models it uses.

Subclass a feature's class and name your backend::

    from hf_accel.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend = "my_attention"

or run it for any installed backend without writing a test: ``pytest --hf-accel-backend my_attention`` (the
``pytest11`` plugin :mod:`hf_accel.testing.pytest_plugin`, loaded by pytest whenever hf_accel is installed).
docs/plugins.md has the whole walk from the template to a published backend. Names are imported on first use:
pytest loads this package in every run, and only a run that uses the suite should pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    **dict.fromkeys(("PROMPTS", "TINY_ARCHITECTURES", "left_padded_batch", "make_tiny_model"),
                    "hf_accel.testing.models"),
    **dict.fromkeys(("CONFORMANCE", "AttentionConformance", "BackendConformance", "CompileConformance",
                     "KVCacheConformance", "QuantizeConformance", "SpeculativeConformance"), "hf_accel.testing.suite"),
}

__all__ = [
    "CONFORMANCE", "PROMPTS", "TINY_ARCHITECTURES", "AttentionConformance", "BackendConformance",
    "CompileConformance", "KVCacheConformance", "QuantizeConformance", "SpeculativeConformance",
    "left_padded_batch", "make_tiny_model",
]

if TYPE_CHECKING:
    from hf_accel.testing.models import PROMPTS, TINY_ARCHITECTURES, left_padded_batch, make_tiny_model
    from hf_accel.testing.suite import (
        CONFORMANCE,
        AttentionConformance,
        BackendConformance,
        CompileConformance,
        KVCacheConformance,
        QuantizeConformance,
        SpeculativeConformance,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_accel.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
