"""What ``pytest --hf-accel-backend NAME`` collects: every feature's conformance class, each parametrized with
the named backends of its feature (see :mod:`hf_accel.testing.pytest_plugin`)."""

from hf_accel.testing.suite import (
    AttentionConformance,
    CompileConformance,
    KVCacheConformance,
    QuantizeConformance,
    SpeculativeConformance,
)


class TestAttention(AttentionConformance):
    pass


class TestKVCache(KVCacheConformance):
    pass


class TestCompile(CompileConformance):
    pass


class TestSpeculative(SpeculativeConformance):
    pass


class TestQuantize(QuantizeConformance):
    pass
