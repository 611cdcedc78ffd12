"""The attention backends' own wiring: flash-attn's adapter and which SDPA kernel runs. Their logits and greedy
tokens against eager, over architectures and shapes, are the conformance suite's (tests/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from flash_reference import ReferenceFlashAttn

import hf_accel
from hf_accel_plugins import attention_flash


@pytest.fixture
def reference_kernels():
    kernels = ReferenceFlashAttn()
    with attention_flash.injected_kernels(kernels):
        yield kernels


def logits_on_real_tokens(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


def test_flash_attn_adapter_unpads_to_cu_seqlens(reference_kernels):
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (7, 3, 5))
    hf_accel.patch(model, attention="flash_attn", kv_cache=None, compile=None, speculative=None, verify=False)
    logits_on_real_tokens(model, ids, mask)
    varlen = [c for c in reference_kernels.calls if c["kind"] == "varlen"]
    assert len(varlen) == model.config.num_hidden_layers
    call = varlen[0]
    assert call["cu_seqlens_q"] == call["cu_seqlens_k"] == [0, 7, 10, 15]
    assert call["max_seqlen_q"] == 7 and call["q"] == (15, 4, 16) and call["k"] == (15, 2, 16)  # GQA kept
    assert call["causal"] and call["window_size"] == (-1, -1) and call["softcap"] == 0.0


def test_flash_attn_adapter_passes_window_and_softcap(reference_kernels):
    model = make_tiny_model("gemma2")  # window 16, attention softcap 50
    ids, mask = left_padded_batch(model, (40,))
    hf_accel.patch(model, attention="flash_attn", kv_cache=None, compile=None, speculative=None, verify=False)
    logits_on_real_tokens(model, ids, torch.ones_like(mask))
    windows = {c["window_size"] for c in reference_kernels.calls}
    assert windows == {(15, 0), (-1, -1)}  # gemma2 alternates sliding and global layers
    assert {c["softcap"] for c in reference_kernels.calls} == {50.0}
    assert {c["kind"] for c in reference_kernels.calls} == {"dense"}  # nothing padded: the dense kernel


def test_flash_attn_decode_step_with_cache_is_bottom_right_causal(reference_kernels):
    model = make_tiny_model("qwen2")
    ids, mask = left_padded_batch(model, (12, 6))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    hf_accel.patch(model, attention="flash_attn", compile=None, speculative=None)
    reference_kernels.calls.clear()
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), expected)
    decode = [c for c in reference_kernels.calls if c["max_seqlen_q"] == 1]
    assert decode and decode[-1]["max_seqlen_k"] == 12 + 4  # one query against the whole cache


def test_flash_attn_without_the_package_says_what_to_install(llama):
    if attention_flash.flash_kernels() is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(hf_accel.BackendUnavailableError, match=r"flash-attn.*pip install 'hf_accel\[flash\]'"):
        hf_accel.patch(llama, attention="flash_attn")
    status = {b.name: b for b in hf_accel.available_backends()}["flash_attn"]
    assert not status.available and "CUDA" in status.reason


def test_sdpa_flash_runs_the_flash_kernel_for_masked_chunks_on_cpu(llama):
    attention_flash.KERNEL_CALLS.clear()
    ids, mask = left_padded_batch(llama, (9, 4))
    hf_accel.patch(llama, attention="sdpa_flash", speculative=None)
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert set(attention_flash.KERNEL_CALLS) == {"flash_attention"}


def test_on_cpu_the_default_dispatch_picks_the_flash_kernel_sdpa_flash_relies_on():
    """sdpa_flash does not switch sdpa_kernel (process-wide flags) on CPU: the default must be flash there."""
    from torch.nn.attention import SDPBackend

    keys = torch.randn(3, 3, 40, 64)
    for queries, mask in ((torch.randn(3, 9, 5, 64), torch.ones(3, 1, 5, 40, dtype=torch.bool)),
                          (torch.randn(3, 9, 1, 64), torch.ones(3, 1, 1, 40, dtype=torch.bool)),
                          (torch.randn(3, 9, 5, 64), None)):
        choice = torch._fused_sdp_choice(queries, keys, keys, attn_mask=mask, enable_gqa=True)
        assert SDPBackend(choice) == SDPBackend.FLASH_ATTENTION


def test_auto_attention_keeps_the_compiled_step_over_a_flash_style_kernel(reference_kernels, llama):
    """flash_attn outranks sdpa_flash, but its unpadded inputs would leave the decode step uncompiled (as on CUDA,
    where triton_flash and flash_attn are available): with the step wanted, auto picks sdpa_flash."""
    from hf_accel_plugins import compile_inductor

    if compile_inductor._cpp_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot compile here, so there is no step to keep")
    hf_accel.patch(llama, speculative=None)
    chosen = hf_accel.report(llama).features
    assert (chosen["attention"].backend, chosen["compile"].backend) == ("sdpa_flash", "inductor")
    hf_accel.unpatch(llama)
    hf_accel.patch(llama, compile=None, speculative=None)
    assert hf_accel.report(llama).features["attention"].backend == "flash_attn"  # no step to keep: plain ranking
    hf_accel.unpatch(llama)
    hf_accel.patch(llama, kv_cache="static-int8", speculative=None)
    assert hf_accel.report(llama).features["attention"].backend == "flash_attn"  # a cache the step refuses


def test_auto_attention_does_not_trade_a_flash_kernel_for_the_reference_one(reference_kernels):
    """gemma2 soft-caps its attention logits, which the sdpa family cannot: eager is the one padded-mask
    candidate left, and the flash kernel keeps its place (no N x N scores at long prompts)."""
    model = make_tiny_model("gemma2")
    hf_accel.patch(model, speculative=None)
    assert hf_accel.report(model).features["attention"].backend == "flash_attn"
