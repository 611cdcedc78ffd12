"""The chunked online-softmax kernel against attention written out directly: softmax(q k^T * scale + mask) v."""

from __future__ import annotations

import pytest
import torch
from hf_accel_example.attention import CHUNK_SIZE, build_mask, forward
from transformers.masking_utils import sdpa_mask

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 16
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


class Inference(torch.nn.Module):
    """Stands in for the attention module transformers passes: eval mode, causal."""

    is_causal = True

    def __init__(self) -> None:
        super().__init__()
        self.eval()


def reference(query, key, value, allowed=None, scaling=None, softcap=None):
    """Plain attention in float64, key/value heads repeated per query head; rows with no key allowed give 0."""
    query, key, value = (t.double() for t in (query, key, value))
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all -inf row: NaN in softmax, 0 here
    return (weights @ value).transpose(1, 2)


def random_qkv(q_len, kv_len, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((BATCH, HEADS, q_len, DIM), (BATCH, KV_HEADS, kv_len, DIM), (BATCH, KV_HEADS, kv_len, DIM))
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


def causal_allowed(q_len, kv_len):
    """[1, 1, q_len, kv_len] bool: query i is position kv_len - q_len + i."""
    return (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None])[None, None]


def run(query, key, value, mask=None, **kwargs):
    out, weights = forward(Inference(), query, key, value, mask, **kwargs)
    assert weights is None
    assert out.shape == (query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    assert out.dtype == query.dtype and out.is_contiguous()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_mask_over_several_chunks_matches_the_reference(dtype):
    length = 3 * CHUNK_SIZE + 7
    query, key, value = random_qkv(length, length, dtype)
    mask = causal_allowed(length, length).expand(BATCH, 1, -1, -1)
    expected = reference(query, key, value, mask).to(dtype)
    torch.testing.assert_close(run(query, key, value, mask), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_left_padding_with_a_fully_masked_row_gives_zeros_there(dtype):
    length = CHUNK_SIZE + 10
    query, key, value = random_qkv(length, length, dtype, seed=1)
    padding = torch.ones(BATCH, length, dtype=torch.bool)
    padding[1, :20] = False  # row 1 is left-padded: its first 20 queries see no key at all
    mask = causal_allowed(length, length) & padding[:, None, None, :]
    out = run(query, key, value, mask)
    assert not out.isnan().any()
    assert torch.equal(out[1, :20], torch.zeros_like(out[1, :20]))
    torch.testing.assert_close(out, reference(query, key, value, mask).to(dtype), **TOLERANCE[dtype])


def test_additive_mask_is_read_like_the_boolean_one():
    query, key, value = random_qkv(9, 9, seed=2)
    allowed = causal_allowed(9, 9).expand(BATCH, 1, -1, -1).clone()
    allowed[0, :, :3] = False
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    torch.testing.assert_close(run(query, key, value, additive), run(query, key, value, allowed), rtol=0, atol=0)
    assert torch.equal(run(query, key, value, additive)[0, :3], torch.zeros(3, HEADS, DIM))


def test_per_head_mask_is_paired_with_the_query_heads():
    query, key, value = random_qkv(5, 40, seed=3)
    allowed = torch.rand(BATCH, HEADS, 5, 40, generator=torch.Generator().manual_seed(3)) > 0.3
    torch.testing.assert_close(run(query, key, value, allowed), reference(query, key, value, allowed).float(),
                               rtol=1e-5, atol=1e-5)


def test_softcap_and_scaling_are_applied_before_the_softmax():
    length = 2 * CHUNK_SIZE
    query, key, value = random_qkv(length, length, seed=4)
    query = query * 8  # large scores, so that the cap changes them
    mask = causal_allowed(length, length)
    out = run(query, key, value, mask, scaling=0.5, softcap=5.0)
    torch.testing.assert_close(out, reference(query, key, value, mask, scaling=0.5, softcap=5.0).float(),
                               rtol=1e-5, atol=1e-5)
    uncapped = reference(query, key, value, mask, scaling=0.5).float()
    assert (out - uncapped).abs().max() > 0.1  # the cap mattered


def test_single_query_over_a_cache_without_a_mask_sees_every_key():
    query, key, value = random_qkv(1, 2 * CHUNK_SIZE + 1, seed=5)
    torch.testing.assert_close(run(query, key, value), reference(query, key, value).float(), rtol=1e-5, atol=1e-5)


def test_several_queries_without_a_mask_are_causal_bottom_right_aligned():
    q_len, kv_len = 4, CHUNK_SIZE + 30
    query, key, value = random_qkv(q_len, kv_len, seed=6)
    expected = reference(query, key, value, causal_allowed(q_len, kv_len)).float()
    torch.testing.assert_close(run(query, key, value), expected, rtol=1e-5, atol=1e-5)


def test_mask_is_built_where_leaving_it_out_would_misalign_the_causal_rule():
    """A prefill into an empty static cache: 3 queries at positions 0-2, 8 key slots of which 5 are empty.
    sdpa_mask leaves the mask out (SDPA's top-left is_causal is right there); ours builds it."""
    assert sdpa_mask(batch_size=1, q_length=3, kv_length=8) is None
    mask = build_mask(batch_size=1, q_length=3, kv_length=8)
    assert torch.equal(mask[0, 0], torch.arange(8)[None, :] <= torch.arange(3)[:, None])
    query, key, value = random_qkv(3, 8, seed=8)
    torch.testing.assert_close(run(query, key, value, mask), reference(query, key, value, mask).float(),
                               rtol=1e-5, atol=1e-5)
    assert build_mask(batch_size=1, q_length=1, kv_length=8) is None  # one query: every key, either way
    assert build_mask(batch_size=1, q_length=8, kv_length=8) is None  # square: both alignments agree


def test_columns_of_a_mask_past_the_keys_are_ignored():
    """Static caches hand a mask as long as the cache; only the first kv_len columns are the keys'."""
    query, key, value = random_qkv(3, 20, seed=7)
    allowed = causal_allowed(3, 20)
    beyond = torch.rand(BATCH, 1, 3, 12, generator=torch.Generator().manual_seed(0)) > 0.5
    longer = torch.cat([allowed.expand(BATCH, 1, 3, 20), beyond], dim=-1)
    torch.testing.assert_close(run(query, key, value, longer), reference(query, key, value, allowed).float(),
                               rtol=1e-5, atol=1e-5)


def test_dropout_while_training_is_refused():
    query, key, value = random_qkv(2, 2)
    training = Inference().train()
    with pytest.raises(NotImplementedError, match="inference"):
        forward(training, query, key, value, None, dropout=0.1)
