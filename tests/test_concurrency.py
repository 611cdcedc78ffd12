"""Concurrent generate calls on one patched model return what they return one at a time."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_accel

#: (batch size, max_new_tokens, sampled): sampled calls keep only the top token, so their output is fixed.
CALLS = [(1, 24, False), (3, 16, False), (1, 30, True), (2, 20, False), (3, 12, True), (1, 8, False)]


def run(model, batch, n, sampled, ids, mask):
    kwargs = {"do_sample": True, "top_k": 1} if sampled else {"do_sample": False}
    return model.generate(input_ids=ids[:batch], attention_mask=mask[:batch], max_new_tokens=n, **kwargs)


@pytest.mark.parametrize("options", [{}, {"compile": None}, {"speculative": None}],
                         ids=["defaults", "eager loop", "no speculation"])
def test_four_threads_get_what_they_would_get_one_at_a_time(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = [run(model, *call, ids, mask) for call in CALLS]
    hf_accel.patch(model, **options)
    failures: list[str] = []

    def worker(offset: int) -> None:
        for round_ in range(3):
            for i in range(len(CALLS)):
                j = (i + offset) % len(CALLS)
                if not torch.equal(run(model, *CALLS[j], ids, mask), expected[j]):
                    failures.append(f"thread {offset}, round {round_}, call {CALLS[j]}")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


class GenerateInside(StoppingCriteria):
    """A stopping criterion that, at the outer call's third decode step, runs generate on other inputs of the
    same batch size (whose pooled cache the outer call is using)."""

    def __init__(self, model, ids, mask):
        self.model, self.ids, self.mask, self.steps, self.inner = model, ids, mask, 0, None

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.steps == 3:
            self.inner = self.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=10,
                                             do_sample=False)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("options", [{}, {"speculative": None}], ids=["defaults", "no speculation"])
def test_a_generate_call_made_inside_another_leaves_both_right(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    inner_ids, inner_mask = left_padded_batch(model, (5, 8, 3), seed=2)
    expected = run(model, 3, 16, False, ids, mask)
    expected_inner = model.generate(input_ids=inner_ids, attention_mask=inner_mask, max_new_tokens=10,
                                    do_sample=False)
    hf_accel.patch(model, **options)
    inside = GenerateInside(model, inner_ids, inner_mask)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([inside]))
    assert inside.steps > 3 and torch.equal(out, expected) and torch.equal(inside.inner, expected_inner)


def test_unpatch_from_inside_a_generate_call_is_refused(llama):
    class UnpatchInside(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            hf_accel.unpatch(llama)

    hf_accel.patch(llama, compile=None)
    ids, mask = left_padded_batch(llama, (9,))
    with pytest.raises(hf_accel.PatchError, match="from inside one of its generate calls"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                       stopping_criteria=StoppingCriteriaList([UnpatchInside()]))
    assert hasattr(llama, "_hf_accel_state")


def test_unpatch_waits_for_the_call_in_progress():
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = run(model, 3, 16, False, ids, mask)
    armed, started, release = threading.Event(), threading.Event(), threading.Event()

    seen = {}

    class Holds:
        @hf_accel.hookimpl(wrapper=True)
        def hf_accel_generate(self, call):
            if armed.is_set():  # the user's call, not the patch's own verification probes
                started.set()
                release.wait(10)
                seen["patched during the call"] = hasattr(call.model, "_hf_accel_state")
            return (yield)

    hf_accel.patch(model, plugins=[Holds()], compile=None)
    armed.set()
    result = {}
    caller = threading.Thread(target=lambda: result.setdefault("out", run(model, 3, 16, False, ids, mask)))
    caller.start()
    assert started.wait(10)
    undoer = threading.Thread(target=hf_accel.unpatch, args=(model,))
    undoer.start()
    undoer.join(0.3)  # an unpatch that did not wait would have undone everything by now
    release.set()
    caller.join()
    undoer.join()
    assert seen["patched during the call"] and torch.equal(result["out"], expected)
    assert not hasattr(model, "_hf_accel_state")


@pytest.mark.parametrize("options", [{}, {"compile": None, "speculative": None}], ids=["compiled step", "kv cache"])
def test_a_returned_output_does_not_hand_out_the_cache_the_next_call_reuses(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    hf_accel.patch(model, speculative=None, **{k: v for k, v in options.items() if k != "speculative"})
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         return_dict_in_generate=True)
    state = model._hf_accel_state
    pooled = [state.kv_cache] + ([c for _, c in state.compiled_step._caches.values()] if state.compiled_step else [])
    assert out.sequences.shape == (3, ids.shape[1] + 6) and not any(out.cache is c for c in pooled)
    assert out.get("cache") is None
