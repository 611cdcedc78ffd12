"""End to end on the real SmolLM2-135M-Instruct model (slow: a ~20 s load, then real generation)."""

from __future__ import annotations

import pytest
import torch

import hf_accel
from hf_accel.prompts import encode_chat, load_prompts

pytestmark = pytest.mark.slow


def first_of_each_category():
    firsts = {}
    for prompt in load_prompts():
        firsts.setdefault(prompt.category, prompt)
    return list(firsts.values())


def greedy(model, inputs, n=32):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False)


def test_default_model_is_the_embedded_smollm2(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and tokenizer.eos_token_id is not None


def test_patched_greedy_output_equals_stock_on_every_shipped_prompt(smollm2):
    """chat, code, summarize a quoted passage, edit a quoted code block: two prompts each, 64 tokens."""
    model, tokenizer = smollm2
    inputs = [encode_chat(tokenizer, p.prompt) for p in load_prompts()]
    expected = [greedy(model, x, 64) for x in inputs]
    hf_accel.patch(model)
    try:
        for x, want in zip(inputs, expected):
            assert torch.equal(greedy(model, x, 64), want)
        speculative = hf_accel.report(model)["speculative"]
        details = speculative.details
        assert speculative.backend == "ngram_self_int4"  # auto: the int4 copy, extended by prompt lookup
        assert details["accepted"] > 0 and details["fallbacks_to_stock"] == 0
        for role in ("target", "draft"):  # both ran compiled, every graph checked against eager
            assert details["compiled"][role]["compiled_steps"] > 0 and details["compiled"][role]["failure"] is None
    finally:
        hf_accel.unpatch(model)


def test_speculation_on_a_quantized_model_is_lossless_for_that_model(smollm2):
    model, tokenizer = smollm2
    inputs = [encode_chat(tokenizer, p.prompt) for p in first_of_each_category()[2:]]
    # the reference runs eagerly, as the loop does: a compiled graph rounds bf16 activations its own way
    hf_accel.patch(model, quantize="int8", keep_original=True, speculative=None, compile=None)
    try:
        expected = [greedy(model, x, 48) for x in inputs]
    finally:
        hf_accel.unpatch(model)
    hf_accel.patch(model, quantize="int8", keep_original=True)
    try:
        assert hf_accel.report(model)["speculative"].backend == "ngram"
        for x, want in zip(inputs, expected):
            assert torch.equal(greedy(model, x, 48), want)
    finally:
        hf_accel.unpatch(model)


def test_the_example_script_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "one_line_patch.py"
    # Without the compile plugins: compiling costs this one 48-token call a minute or more, and the test above
    # already runs the default patch compiled.
    env = {**os.environ, "HF_ACCEL_DISABLE_PLUGINS": "compile_inductor,compile_onednn"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hf_accel report" in result.stdout


def test_eager_static_cache_equals_stock(smollm2):
    model, tokenizer = smollm2
    inputs = [encode_chat(tokenizer, p.prompt) for p in first_of_each_category()[::3]]
    expected = [greedy(model, x, 32) for x in inputs]
    hf_accel.patch(model, kv_cache="static", compile=None, speculative=None)
    try:
        for x, want in zip(inputs, expected):
            assert torch.equal(greedy(model, x, 32), want)
    finally:
        hf_accel.unpatch(model)


def test_compiled_decode_step_equals_stock_and_does_not_recompile(smollm2):
    model, tokenizer = smollm2
    inputs = [encode_chat(tokenizer, p.prompt) for p in first_of_each_category()]
    expected = [greedy(model, x, 40 + 8 * i) for i, x in enumerate(inputs)]
    hf_accel.patch(model, kv_cache="static", compile="inductor", speculative=None)
    try:
        longest = max(range(len(inputs)), key=lambda i: inputs[i]["input_ids"].shape[1] + 8 * i)
        greedy(model, inputs[longest], 40 + 8 * longest)  # sizes the cache: later calls fit in it
        details = hf_accel.report(model)["compile"].details
        graphs = details["graphs_compiled"]
        for i, (x, want) in enumerate(zip(inputs, expected)):  # other prompt lengths and max_new_tokens
            assert torch.equal(greedy(model, x, 40 + 8 * i), want)
        assert details["failure"] is None and details["graphs_compiled"] == graphs >= 1
        assert details["check_error"] < 1e-4 and details["compile_seconds"] > 0
    finally:
        hf_accel.unpatch(model)


def test_int4_with_embeddings_and_head_meets_its_memory_and_quality_targets(smollm2):
    from hf_accel.quality import perplexity

    model, tokenizer = smollm2
    fp32 = perplexity(model, tokenizer)
    hf_accel.patch(model, quantize="int4", include=["embed_tokens", "lm_head", r"layers\."], keep_original=True,
                   speculative=None, compile=None)
    try:
        report = hf_accel.report(model).to_dict()["quantize"]
        assert report["weight_bytes_after"] <= 0.20 * report["weight_bytes_before"]
        assert perplexity(model, tokenizer) <= 1.10 * fp32
    finally:
        hf_accel.unpatch(model)
