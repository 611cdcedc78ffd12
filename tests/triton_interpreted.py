"""Checks of the Triton FlashAttention kernel under Triton's CPU interpreter.

Run by tests/test_attention_triton.py in a subprocess with TRITON_INTERPRET=1 (the variable must be set
before triton is first imported); not collected by the main test run.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from flash_reference import attend

import hf_accel
from hf_accel_plugins.attention_triton import triton_attention

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

CASES = {  # M queries, N keys, heads, kv heads, dim, window, softcap, left padding per row
    "prefill-gqa-padded": (20, 20, 4, 2, 16, None, None, [0, 5]),
    "decode-mqa-window-softcap": (1, 37, 4, 1, 16, 8, 30.0, [0, 3]),
    "chunk-over-cache-odd-dim": (7, 50, 6, 3, 24, None, None, [2, 0]),
    "long-window": (40, 300, 2, 2, 16, 16, None, [0]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_reference(case):
    m, n, heads, kv_heads, dim, window, softcap, pads = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pads), heads, m, dim, generator=g)
    k = torch.randn(len(pads), kv_heads, n, dim, generator=g)
    v = torch.randn(len(pads), kv_heads, n, dim, generator=g)
    out = triton_attention(q, k, v, torch.tensor(pads), dim**-0.5, True, window, softcap)
    for b, pad in enumerate(pads):
        real_queries = slice(max(0, pad - (n - m)), None)
        expected = attend(q[b].transpose(0, 1)[real_queries], k[b, :, pad:].transpose(0, 1),
                          v[b, :, pad:].transpose(0, 1), dim**-0.5, True, (window - 1 if window else -1, 0),
                          softcap or 0.0)
        torch.testing.assert_close(out[b].transpose(0, 1)[real_queries], expected, rtol=1e-5, atol=1e-5)


# Grouped-query attention with a sliding window and soft-capping (gemma2), with a window alone (mistral), and
# multi-head attention (gpt2): the interpreter runs each kernel call slowly, so the other architectures, which add
# nothing the kernel sees, are left to the conformance suite on CUDA.
ARCHS = ["mistral", "gemma2", "gpt2"]


@pytest.mark.parametrize("arch, lengths", [(a, (1,)) for a in ARCHS] + [(a, (17, 5, 11)) for a in ARCHS]
                         + [("mistral", (300,)), ("gemma2", (300,))])
def test_model_logits_match_eager(arch, lengths):
    model = make_tiny_model(arch)
    ids, mask = left_padded_batch(model, lengths)
    hf_accel.patch(model, attention="eager", kv_cache=None, compile=None, speculative=None)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    hf_accel.unpatch(model)
    hf_accel.patch(model, attention="triton_flash", kv_cache=None, compile=None, speculative=None)
    with torch.no_grad():
        actual = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_greedy_generate_is_token_identical():
    model = make_tiny_model("mistral")
    ids, mask = left_padded_batch(model, (23, 9, 14))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch(model, attention="triton_flash")
    assert hf_accel.report(model)["attention"].backend == "triton_flash"
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)
