"""What the patch holds in memory: the report's accounting matches the tensors held, nothing is held twice,
and a backend whose memory would not fit is skipped with the reason."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

import hf_accel
from hf_accel.patching import memory
from hf_accel_plugins.onednn_packing import PACKED, PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_reports_bytes_are_the_tensors_each_feature_holds():
    model = make_tiny_model("llama")
    linear_bytes = nbytes(m.weight for m in model.modules() if isinstance(m, torch.nn.Linear))
    hf_accel.patch(model)  # compiling when it pays: eager here, over the compiled step's caches all the same
    ids, mask = left_padded_batch(model)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    report = hf_accel.report(model)
    state = model._hf_accel_state
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert report["compile"].memory["oneDNN-packed weights"] == nbytes(PACKED[id(m.packed_handle)].packed
                                                                       for m in packed)
    assert report["compile"].memory["plain weights freed"] == -linear_bytes  # nothing held twice
    step_caches = [t for _, cache in state.compiled_step._caches.values() for layer in cache.layers
                   for t in (layer.keys, layer.values)]
    assert report["compile"].memory["compiled step's static caches"] == nbytes(step_caches) > 0
    assert report["kv_cache"].memory["KV cache"] == 0  # the compiled step's caches serve every call here
    (draft,) = state.runner.drafts
    quantized = [t for name, t in draft.named_buffers()
                 if name.endswith(("packed_weight", "scales_and_zeros", "qweight", "scale"))]
    assert report["speculative"].memory["draft copy (its quantized layers)"] == nbytes(quantized) > 0
    assert report.memory_bytes == sum(sum(f.memory.values()) for f in report.features.values())
    assert "memory held beyond the unpatched model" in str(report)
    assert report.to_dict()["memory_bytes"] == report.memory_bytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared and tied ones once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def test_the_reports_total_is_what_the_patch_holds_in_tensors():
    """Counted from the storages themselves, not from what the report reads: the model's and the draft copy's
    tensors (a freed weight holds none), the compiled steps' cache buffers, the KV cache, plus the packed
    copies (opaque oneDNN tensors: their bytes are what they report)."""
    model = make_tiny_model("llama")
    before = storage_bytes([*model.parameters(), *model.buffers()])
    hf_accel.patch(model, compile_when="first_use")
    for lengths in ((7, 3, 5), (4,)):
        ids, mask = left_padded_batch(model, lengths)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    state = model._hf_accel_state
    (draft,) = state.runner.drafts
    steps = [state.compiled_step, *state.runner._compiled.values()]
    kv = [t for layer in state.kv_cache.layers if layer._stores for parts in layer._stores.values() for t in parts]
    tensors = [*model.parameters(), *model.buffers(), *draft.parameters(), *draft.buffers(), *kv,
               *(buffer for step in steps for buffer in step._pool._buffers.values())]
    packed = [PACKED[id(m.packed_handle)].packed for m in model.modules() if isinstance(m, PackedLinear)]
    held = storage_bytes(tensors) + nbytes(packed) - before
    assert hf_accel.report(model).memory_bytes == held
    assert sum(step.cache_bytes() for step in steps) > 0


def test_quantization_reports_what_it_holds_and_what_it_freed():
    model = make_tiny_model("llama")
    before = nbytes([*model.parameters(), *model.buffers()])
    hf_accel.patch(model, quantize="int8", compile=None, speculative=None, kv_cache=None)
    memory_items = hf_accel.report(model)["quantize"].memory
    after = nbytes([*model.parameters(), *model.buffers()])
    assert sum(memory_items.values()) == after - before < 0


def test_a_backend_that_would_not_fit_is_skipped_with_the_reason(monkeypatch):
    """With 1 KiB free, packing and a quantized draft copy do not fit: the compiled step runs on the plain
    weights and prompt lookup drafts; the report says why."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)
    model = make_tiny_model("llama")
    hf_accel.patch(model)
    report = hf_accel.report(model)
    assert report["compile"].backend == "inductor"
    assert report["compile"].details["prepacked"].startswith("no: needs ~")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert report["speculative"].backend == "ngram"
    skipped = {s["backend"]: s["reason"] for s in report["speculative"].skipped}
    assert "MiB are free on cpu" in skipped["ngram_self_int4"]
    with pytest.raises(hf_accel.BackendUnavailableError, match="MiB are free"):
        hf_accel.unpatch(model)
        hf_accel.patch(model, compile="onednn_prepack")
