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
        details = hf_accel.report(model)["speculative"].details
        assert details["accepted"] > 0 and details["fallbacks_to_stock"] == 0
    finally:
        hf_accel.unpatch(model)


def test_speculation_on_a_quantized_model_is_lossless_for_that_model(smollm2):
    model, tokenizer = smollm2
    inputs = [encode_chat(tokenizer, p.prompt) for p in first_of_each_category()[2:]]
    hf_accel.patch(model, quantize="int8", keep_original=True, speculative=None)
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
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "one_line_patch.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hf_accel report" in result.stdout
