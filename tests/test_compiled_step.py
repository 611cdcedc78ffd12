"""compile="inductor": the decode step of stock generate compiled over a fixed-shape static cache."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

import hf_accel
from hf_accel import compiled_step
from hf_accel_plugins import compile_inductor


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled graphs are cached per code object, across model instances; each test counts its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_details(model) -> dict:
    return hf_accel.report(model)["compile"].details


def greedy(model, ids, mask=None, n=40):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def test_compiled_step_is_token_identical_batch_3_and_1_past_the_window(tiny_model):
    ids, mask = left_padded_batch(tiny_model)  # 7 + 40 tokens: past mistral's and gemma2's window of 16
    expected_batch, expected_single = greedy(tiny_model, ids, mask), greedy(tiny_model, ids[:1], n=30)
    hf_accel.patch(tiny_model, kv_cache="static", compile="inductor", speculative=None)
    assert torch.equal(greedy(tiny_model, ids, mask), expected_batch)
    assert torch.equal(greedy(tiny_model, ids[:1], n=30), expected_single)
    details = compile_details(tiny_model)
    assert details["failure"] is None and details["graphs_compiled"] >= 2  # one per batch size at least
    assert details["compiled_steps"] >= 39 + 29 - 2 and details["compile_seconds"] > 0
    assert details["check_error"] < compiled_step.CHECK_TOLERANCE


def test_other_prompt_lengths_and_max_new_tokens_do_not_recompile(llama):
    hf_accel.patch(llama, compile="inductor", speculative=None)
    ids, _ = left_padded_batch(llama, lengths=(12,))
    greedy(llama, ids[:, :7], n=20)
    graphs, steps = compile_details(llama)["graphs_compiled"], compile_details(llama)["compiled_steps"]
    greedy(llama, ids, n=35)
    greedy(llama, ids[:, :3], n=5)
    assert compile_details(llama)["graphs_compiled"] == graphs == 1
    assert compile_details(llama)["compiled_steps"] == steps + 34 + 4


def test_the_cache_is_reused_while_it_fits_and_grows_once():
    model = make_tiny_model("llama")
    ids, _ = left_padded_batch(model, lengths=(10,))
    expected = greedy(model, ids, n=60)
    hf_accel.patch(model, compile="inductor", cache_bucket=32, speculative=None)
    step = model._hf_accel_state.compiled_step
    greedy(model, ids, n=12)  # 22 positions: a 32-position cache
    length, first = step._caches[1, False]
    assert length == 32
    greedy(model, ids, n=20)
    assert step._caches[1, False][1] is first
    assert torch.equal(greedy(model, ids, n=60), expected)  # 70 positions: grows to 96
    assert step._caches[1, False][0] == 96 and step._caches[1, False][1] is not first


def test_sliding_window_layers_get_a_window_sized_cache():
    model = make_tiny_model("gemma2")  # alternating sliding (window 16) and full layers
    hf_accel.patch(model, compile="inductor", speculative=None)
    greedy(model, left_padded_batch(model)[0][:1], n=30)
    cache = model._hf_accel_state.compiled_step._caches[1, False][1]
    sizes = [(layer.is_sliding, layer.max_cache_len) for layer in cache.layers]
    assert sizes == [(True, 16), (False, 256)]


def test_a_failed_compile_falls_back_to_eager_with_the_reason(llama, monkeypatch):
    def no_compiler(self, graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled_step.CountingBackend, "__call__", no_compiler)
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, compile="inductor", speculative=None)
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)
    details = compile_details(llama)
    assert "no C++ compiler found" in details["failure"] and details["compiled_steps"] == 0
    assert details["eager_steps"] == 9


def test_a_graph_that_disagrees_with_eager_is_refused(llama):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, compile="inductor", speculative=None)
    step = llama._hf_accel_state.compiled_step
    compiled = step.compiled

    def wrong(*args, **kwargs):
        out = compiled(*args, **kwargs)
        out.logits = out.logits + 1.0
        return out

    step.compiled = wrong
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)
    assert "differ from eager" in compile_details(llama)["failure"]


def test_calls_the_step_does_not_serve_run_stock(llama):
    ids, mask = left_padded_batch(llama)
    hf_accel.patch(llama, compile="inductor", speculative=None)
    expected = llama._hf_accel_state.original_generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                       num_beams=2, do_sample=False)
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False)
    assert torch.equal(out, expected)
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, disable_compile=True)
    assert compile_details(llama)["graphs_compiled"] == 0


def test_unpatch_removes_the_compiled_call(llama):
    hf_accel.patch(llama, compile="inductor", speculative=None)
    assert "get_compiled_call" in vars(llama)
    hf_accel.unpatch(llama)
    assert "get_compiled_call" not in vars(llama) and not hasattr(llama, "_hf_accel_state")


def test_without_a_compiler_auto_prepacks_and_inductor_says_what_to_install(llama, monkeypatch):
    monkeypatch.setattr(compile_inductor, "_cpp_compiler", lambda: None)
    with pytest.raises(hf_accel.BackendUnavailableError, match="C\\+\\+ compiler"):
        hf_accel.patch(llama, compile="inductor")
    hf_accel.patch(llama, speculative=None)
    report = hf_accel.report(llama)["compile"]
    assert report.backend == "onednn_prepack" and [s["backend"] for s in report.skipped] == ["inductor"]


def test_compile_off_keeps_the_static_cache_eager(llama):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, kv_cache="static", compile=False, speculative=None)
    assert llama._hf_accel_state.compiled_step is None
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)
