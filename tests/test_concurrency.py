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
