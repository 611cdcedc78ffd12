"""hf_accel's shared attention-backend checks (logits and greedy tokens against eager, masks, caches), run on ours."""

from hf_accel.testing import AttentionConformance


class TestExampleBackend(AttentionConformance):
    backend = "example"
