"""Concurrent generate calls on one patched model return what they return one at a time."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

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


class Nested:
    """A plugin whose generate hook calls generate again, on other inputs, before letting the call run."""

    def __init__(self, ids, mask):
        self.ids, self.mask, self.inner = ids, mask, None

    @hf_accel.hookimpl(wrapper=True)
    def hf_accel_generate(self, call):
        if self.inner is None:
            self.inner = call.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=10,
                                             do_sample=False)
        return (yield)


@pytest.mark.parametrize("options", [{}, {"speculative": None}], ids=["defaults", "no speculation"])
def test_a_generate_call_made_inside_another_leaves_both_right(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    inner_ids, inner_mask = left_padded_batch(model, (5, 8, 3), seed=2)  # same batch size: same pooled cache
    expected = run(model, 3, 16, False, ids, mask)
    expected_inner = model.generate(input_ids=inner_ids, attention_mask=inner_mask, max_new_tokens=10,
                                    do_sample=False)
    plugin = Nested(inner_ids, inner_mask)
    hf_accel.patch(model, plugins=[plugin], **options)
    assert torch.equal(run(model, 3, 16, False, ids, mask), expected)
    assert torch.equal(plugin.inner, expected_inner)


def test_unpatch_waits_for_the_call_in_progress():
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = run(model, 3, 16, False, ids, mask)
    started, release = threading.Event(), threading.Event()

    class Holds:
        @hf_accel.hookimpl(wrapper=True)
        def hf_accel_generate(self, call):
            started.set()
            release.wait(10)
            return (yield)

    hf_accel.patch(model, plugins=[Holds()], compile=None)
    result = {}
    caller = threading.Thread(target=lambda: result.setdefault("out", run(model, 3, 16, False, ids, mask)))
    caller.start()
    assert started.wait(10)
    undoer = threading.Thread(target=hf_accel.unpatch, args=(model,))
    undoer.start()
    undoer.join(0.3)
    assert undoer.is_alive()  # blocked while the call runs
    release.set()
    caller.join()
    undoer.join()
    assert torch.equal(result["out"], expected) and not hasattr(model, "_hf_accel_state")


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
