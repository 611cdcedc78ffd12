"""Checks of the Triton FlashAttention kernel under Triton's CPU interpreter.

Run by tests/test_attention_triton.py in a subprocess with TRITON_INTERPRET=1 (the variable must be set
before triton is first imported); not collected by the main test run.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from flash_reference import KERNEL_CASES, check_kernel_case

import hf_accel
from hf_accel_plugins.attention_triton import triton_attention

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference(case, dtype, tolerance):
    check_kernel_case(triton_attention, case, dtype=dtype, tolerance=tolerance)


# Grouped-query attention with a sliding window and soft-capping (gemma2), with a window alone (mistral), and
# multi-head attention (gpt2): the interpreter runs each kernel call slowly, so the other architectures, which add
# nothing the kernel sees, are left to the conformance suite on CUDA.
ARCHS = ["mistral", "gemma2", "gpt2"]


@pytest.mark.parametrize("arch, lengths", [(a, (1,)) for a in ARCHS] + [(a, (17, 5, 11)) for a in ARCHS]
                         + [("gemma2", (120,))])  # long: 4 key blocks of 32, in and out of the 16-token window
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
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    # 23 + 10 positions: the decode steps' keys cross a 32-key block
    hf_accel.patch(model, attention="triton_flash", speculative=None)  # verification chunks: kernel case only
    assert hf_accel.report(model)["attention"].backend == "triton_flash"
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False), expected)
