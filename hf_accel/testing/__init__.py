"""The conformance suite plugin authors run against their backends, and the tiny models it uses.

Subclass a feature's class and name your backend::

    from hf_accel.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend = "my_attention"

or run it for any installed backend without writing a test: ``pytest --hf-accel-backend my_attention`` (the
``pytest11`` plugin :mod:`hf_accel.testing.pytest_plugin`, loaded by pytest whenever hf_accel is installed).
docs/plugins.md has the whole walk from the template to a published backend.
"""

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

__all__ = [
    "AttentionConformance", "BackendConformance", "CONFORMANCE", "CompileConformance", "KVCacheConformance",
    "PROMPTS", "QuantizeConformance", "SpeculativeConformance", "TINY_ARCHITECTURES", "left_padded_batch",
    "make_tiny_model",
]
