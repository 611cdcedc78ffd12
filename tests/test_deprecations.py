"""Our own calls into transformers use its current arguments: no deprecation warning comes from hf_accel's code,
so the next transformers release that removes the old names breaks nobody."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import left_padded_batch

import hf_accel

OURS = tuple(str(Path(p).resolve()) for p in (hf_accel.__file__.rsplit("/", 1)[0],
                                               __import__("hf_accel_plugins").__file__.rsplit("/", 1)[0]))


@pytest.mark.parametrize("options", [
    {"speculative": None, "compile": None},                         # stock generate over the static cache
    {"speculative": None, "compile_when": "first_use"},             # stock generate, compiled decode step
    {"speculative": "ngram", "compile": None},                      # the loop, eager
    {"speculative": "ngram", "compile_when": "first_use"},          # the loop, compiled
    {"kv_cache": "static-int8", "speculative": None, "compile": None},
], ids=["static", "compiled", "loop", "compiled loop", "int8 cache"])
def test_no_deprecation_warning_comes_from_our_calls(llama, options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    ids, mask = left_padded_batch(llama)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_accel.patch(llama, **options)
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        torch._dynamo.reset()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, (DeprecationWarning, FutureWarning))
            and (w.filename.startswith(OURS) or "past_key_values" in str(w.message))]  # forward's: torch's line
    assert not ours


def test_stock_generate_itself_raises_none_of_these(llama):
    """So the test above measures our calls, not transformers' own."""
    ids, mask = left_padded_batch(llama)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
