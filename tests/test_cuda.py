"""What only a CUDA device can check: the Triton kernel compiled for the GPU, SDPA's flash kernels, the compiled
step's CUDA graphs, what ``auto`` picks there, speculation and bitsandbytes. Skipped without CUDA; run by
``scripts/gpu_check.sh`` on a lent GPU (its ``--dry-run``, in tests/test_gpu_check.py, collects them here)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from flash_reference import KERNEL_CASES, check_kernel_case

import hf_accel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

#: GQA with window and softcap (gemma2), GQA (llama), window alone (mistral), MHA through Conv1D (gpt2).
ARCHITECTURES = ("llama", "gemma2", "mistral", "gpt2")
SHAPES = {"left-padded-batch": (17, 5, 11), "one-token": (1,), "long": (300, 40)}


def tiny_on_cuda(arch: str, dtype: torch.dtype = torch.float32):
    return make_tiny_model(arch, dtype=dtype).to("cuda")


def batch_on_cuda(model, lengths):
    ids, mask = left_padded_batch(model, lengths)
    return ids.cuda(), mask.cuda()


def greedy(model, ids, mask, new_tokens: int = 12) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def real_token_logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()


@needs_triton
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_triton_kernel_matches_the_reference(case, dtype, tolerance):
    from hf_accel_plugins.attention_triton import triton_attention

    check_kernel_case(triton_attention, case, "cuda", dtype, tolerance)  # fp32: its products do not round to TF32


def skip_what_cannot_run(backend: str, arch: str) -> None:
    if backend == "triton_flash" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if backend == "sdpa_flash" and arch == "gemma2":
        pytest.skip("sdpa has no softcap: gemma2 is refused (tested in the conformance suite)")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("backend", ["triton_flash", "sdpa_flash"])
def test_attention_logits_match_eager(backend, arch, shape):
    skip_what_cannot_run(backend, arch)
    model = tiny_on_cuda(arch, torch.bfloat16)
    ids, mask = batch_on_cuda(model, SHAPES[shape])
    hf_accel.patch(model, attention="eager", kv_cache=None, compile=None, speculative=None)
    expected = real_token_logits(model, ids, mask)
    hf_accel.unpatch(model)
    hf_accel.patch(model, attention=backend, kv_cache=None, compile=None, speculative=None)
    actual = real_token_logits(model, ids, mask)
    error = (actual - expected).abs().max() / expected.abs().max()
    assert error < 2e-2, f"{backend} on {arch} ({shape}, bf16): logits differ from eager by {error:.2e} relative"


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("backend", ["triton_flash", "sdpa_flash"])
def test_attention_decode_steps_over_the_cache_are_token_identical_to_eager(backend, arch):
    """One query against a growing cache, rows left-padded differently: in fp32, every token as eager's."""
    skip_what_cannot_run(backend, arch)
    model = tiny_on_cuda(arch)
    ids, mask = batch_on_cuda(model, (17, 5, 11))
    hf_accel.patch(model, attention="eager", kv_cache="static", compile=None, speculative=None)
    expected = greedy(model, ids, mask, 16)
    hf_accel.unpatch(model)
    hf_accel.patch(model, attention=backend, kv_cache="static", compile=None, speculative=None)
    assert torch.equal(greedy(model, ids, mask, 16), expected)


def test_auto_on_cuda_keeps_the_compiled_step():
    """triton_flash (and flash_attn) outrank sdpa_flash, but would leave the decode step uncompiled."""
    model = tiny_on_cuda("llama", torch.bfloat16)
    hf_accel.patch(model, compile_when="first_use")
    chosen = {name: feature.backend for name, feature in hf_accel.report(model).features.items()}
    assert chosen["attention"] == "sdpa_flash" and chosen["kv_cache"] == "static" and chosen["compile"] == "inductor"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_step_with_cuda_graphs_is_token_identical_over_batch_sizes(arch):
    model = tiny_on_cuda(arch)
    calls = [batch_on_cuda(model, lengths) for lengths in ((9, 4, 6), (5,), (12, 3))]
    expected = [greedy(model, ids, mask) for ids, mask in calls]
    hf_accel.patch(model, speculative=None, compile_when="first_use")
    for (ids, mask), reference in zip(calls + calls, expected + expected):  # each batch size twice, in turn
        assert torch.equal(greedy(model, ids, mask), reference)
    details = hf_accel.report(model)["compile"].details
    assert details["failure"] is None and details["misses"] == 0 and details["compiled_steps"] > 0, details


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_default_patch_with_speculation_is_token_identical(arch):
    model = tiny_on_cuda(arch)
    ids, mask = batch_on_cuda(model, (14, 6, 9))
    expected = greedy(model, ids, mask, 24)
    hf_accel.patch(model, compile_when="first_use")
    assert hf_accel.report(model)["speculative"].backend is not None, hf_accel.report(model)["speculative"].reason
    assert torch.equal(greedy(model, ids, mask, 24), expected)
    hf_accel.unpatch(model)
    assert torch.equal(greedy(model, ids, mask, 24), expected)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("scheme, bound", [("int8", 0.1), ("nf4", 0.9)])  # nf4: its declared tolerance
def test_bitsandbytes_quantizes_on_cuda(scheme, bound):
    import bitsandbytes as bnb

    model = tiny_on_cuda("llama", torch.bfloat16)
    ids, mask = batch_on_cuda(model, (9, 4))
    expected = real_token_logits(model, ids, mask)
    hf_accel.patch(model, quantize="bnb", bnb_quant_type=scheme, keep_original=True, speculative=None)
    quantized = hf_accel.report(model).to_dict()["quantize"]
    assert quantized["backend"] == "bnb" and quantized["weight_bytes_after"] < quantized["weight_bytes_before"]
    layers = [m for m in model.modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]
    assert len(layers) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down of every layer
    error = (real_token_logits(model, ids, mask) - expected).abs().max() / expected.abs().max()
    assert error < bound, f"bnb {scheme}: logits {error:.2e} from bf16"
    hf_accel.unpatch(model)
    torch.testing.assert_close(real_token_logits(model, ids, mask), expected)
