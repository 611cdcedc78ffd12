"""What the patch holds in memory: the report's accounting matches the tensors held, nothing is held twice,
and a backend whose memory would not fit is skipped with the reason."""

from __future__ import annotations

import gc

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


def live_tensor_bytes() -> int:
    """Bytes of every tensor alive in this process that Python can reach, each storage once (an emptied
    weight counts nothing, a plain weight kept anywhere counts whole), plus the opaque oneDNN tensors' own
    size (element count, as the report counts them). Found through the garbage collector, not through the
    objects the report reads."""
    gc.collect()
    storages, opaque = {}, 0
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            continue  # compilers' fake tensors own no memory
        if obj.is_mkldnn:
            opaque += obj.numel() * obj.element_size()
        elif obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values()) + opaque


# llama's decode steps through compiled graphs (what those keep is not in the report, and must stay small), without
# a draft to compile; gemma2 (its head tied to its embeddings) with the whole default patch, eagerly
# (compile_when="auto" compiles nothing in calls this short): compiling all its graph kinds took 96 s.
@pytest.mark.parametrize("arch, options", [("llama", {"compile_when": "first_use", "speculative": None}),
                                           ("gemma2", {})], ids=["llama-compiled", "gemma2-default"])
def test_the_reports_total_is_what_the_process_holds_in_tensors(arch, options):
    """Every tensor Python can reach, counted before the patch and after calls of two batch sizes: the
    difference is the report's total (within 1%: small tensors the report leaves out, such as the sampled
    values each packed weight is checked against); unpatch gives the memory back."""
    warm = make_tiny_model(arch)  # whatever torch and hf_accel create once per process, created before counting
    hf_accel.patch(warm, **options)
    warm.generate(**dict(zip(("input_ids", "attention_mask"), left_padded_batch(warm))), max_new_tokens=2)
    hf_accel.unpatch(warm)
    del warm
    model = make_tiny_model(arch)
    before = live_tensor_bytes()
    hf_accel.patch(model, **options)
    for lengths in ((7, 3, 5), (4,)):
        ids, mask = left_padded_batch(model, lengths)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    del ids, mask
    held, reported = live_tensor_bytes() - before, hf_accel.report(model).memory_bytes
    assert model._hf_accel_state.compiled_step.cache_bytes() > 0
    assert (hf_accel.report(model)["compile"].details["compiled_steps"] > 0) == ("compile_when" in options)
    assert reported > 0 and abs(held - reported) <= 0.01 * reported
    hf_accel.unpatch(model)
    assert abs(live_tensor_bytes() - before) <= 1024


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


def test_layers_something_outside_the_model_holds_keep_their_weights():
    """A draft model given the target's head, and a variable holding one of its layers: packing frees neither
    weight (the layer must still run where it is also used) and leaves those layers whole."""
    target, draft = make_tiny_model("llama"), make_tiny_model("llama", seed=3)
    draft.lm_head = target.lm_head
    mlp = target.model.layers[0].mlp.down_proj
    ids, mask = left_padded_batch(target)
    x = torch.randn(2, mlp.in_features)
    with torch.no_grad():
        expected, draft_logits, mlp_out = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False), draft(ids).logits, mlp(x)
    hf_accel.patch(target, speculative=draft, compile="onednn_prepack")
    report = hf_accel.report(target)
    assert report["speculative"].backend == "draft_model"
    assert report["compile"].details["plain_weights_kept"] == 2  # the shared head and the held layer
    assert report["compile"].details["held_outside_the_model"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert torch.equal(target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False),
                       expected)
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, draft_logits) and torch.equal(mlp(x), mlp_out)
    assert hf_accel.report(target)["speculative"].details["drafted"] > 0
    hf_accel.unpatch(target)
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, draft_logits) and torch.equal(mlp(x), mlp_out)
