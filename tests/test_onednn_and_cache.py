"""The oneDNN-prepacked Linear backend and the preallocated KV cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import assert_same_state, left_padded_batch, make_tiny_model, state_dict_copy

import hf_accel
from hf_accel.patching.verify import ProbeInputs
from hf_accel.runtime.generation import cache_keyword
from hf_accel.runtime.kv_cache import PreallocatedCache, PreallocatedLayer
from hf_accel_plugins.kv_cache_static import Int8Layer
from hf_accel_plugins.onednn_packing import PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def test_packed_linears_keep_state_dict_and_tied_weights():
    model = make_tiny_model("gemma2")  # ties lm_head to the embeddings
    before = state_dict_copy(model)
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert_same_state(before, state_dict_copy(model))
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    report = hf_accel.report(model)["compile"]
    assert report.backend == "onednn_prepack" and report.verification.passed
    assert report.details["packed_linears"] == len(report.modules) > 0


def test_packed_model_matches_stock_logits_and_greedy_tokens(tiny_model):
    ids, mask = left_padded_batch(tiny_model)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    expected = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch(tiny_model, compile="onednn_prepack", speculative=None)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(input_ids=ids, attention_mask=mask).logits, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False),
                      expected)


def test_training_still_backpropagates_through_packed_linears(llama):
    """With keep_original=True the plain weights stay Parameters and get gradients; by default they are freed
    (not Parameters any more), and the packed product still passes stock's gradients to everything else."""
    ids, mask = left_padded_batch(llama, (5,))
    llama(input_ids=ids, labels=ids).loss.backward()
    stock = llama.model.embed_tokens.weight.grad.clone()
    llama.zero_grad()
    hf_accel.patch(llama, compile="onednn_prepack", speculative=None, keep_original=True)
    llama(input_ids=ids, labels=ids).loss.backward()
    assert llama.model.layers[0].mlp.up_proj.weight.grad is not None
    hf_accel.unpatch(llama)
    llama.zero_grad()
    hf_accel.patch(llama, compile="onednn_prepack", speculative=None)
    llama(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(llama.model.embed_tokens.weight.grad, stock, rtol=1e-4, atol=1e-6)


def test_onednn_refuses_non_fp32_models_with_a_reason():
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(hf_accel.BackendUnavailableError, match="float32"):
        hf_accel.patch(model, compile="onednn_prepack")


def kv(batch=2, length=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_preallocated_layer_appends_in_place_grows_and_crops():
    layer = PreallocatedLayer(capacity=4)
    k1, v1 = kv(length=3)
    keys, values = layer.update(k1, v1)
    assert torch.equal(keys, k1) and layer.get_seq_length() == 3
    buffer = layer._stores["keys"][0]
    k2, v2 = kv(length=1, seed=1)
    keys, _ = layer.update(k2, v2)
    assert layer._stores["keys"][0] is buffer and torch.equal(keys, torch.cat([k1, k2], dim=2))  # written in place
    k3, v3 = kv(length=300, seed=2)
    keys, values = layer.update(k3, v3)  # grows, keeping what was there
    assert layer.capacity >= 304 and torch.equal(keys, torch.cat([k1, k2, k3], dim=2))
    layer.crop(-300)
    assert layer.get_seq_length() == 4 and torch.equal(layer.keys, torch.cat([k1, k2], dim=2))


def test_preallocated_cache_is_reused_after_reset(llama):
    cache = PreallocatedCache(llama.config, capacity=64)
    ids, mask = left_padded_batch(llama, (9,))
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         **{cache_keyword(llama): cache})
    assert torch.equal(out, expected)
    buffers = [layer._stores["keys"][0] for layer in cache.layers]
    cache.reset()
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         **{cache_keyword(llama): cache})
    assert torch.equal(out, expected) and all(a is layer._stores["keys"][0] for a, layer in zip(buffers, cache.layers))


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_static_kv_cache_is_token_identical_and_reused(tiny_model, speculative):
    ids, mask = left_padded_batch(tiny_model)
    short, short_mask = left_padded_batch(tiny_model, (4, 2, 3), seed=5)
    calls = [(ids, mask, 30), (short, short_mask, 7), (ids[:1], mask[:1], 25)]  # batch 3 past the window, batch 1
    expected = [tiny_model.generate(input_ids=i, attention_mask=m, max_new_tokens=n, do_sample=False)
                for i, m, n in calls]
    hf_accel.patch(tiny_model, kv_cache="static", compile=None, speculative=speculative, cache_capacity=64)
    cache = tiny_model._hf_accel_state.kv_cache
    got = [tiny_model.generate(input_ids=i, attention_mask=m, max_new_tokens=n, do_sample=False)
           for i, m, n in calls]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert tiny_model._hf_accel_state.kv_cache is cache and cache.capacity == 256  # 64 rounded up, never grown


def test_static_kv_cache_grows_for_a_long_call():
    model = make_tiny_model("mistral")
    ids, mask = left_padded_batch(model, (300,))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    hf_accel.patch(model, kv_cache="static", compile=None, speculative=None, cache_capacity=16)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)
    assert model._hf_accel_state.kv_cache.capacity >= 320


def test_a_call_with_its_own_cache_is_left_alone(llama):
    from transformers import DynamicCache

    hf_accel.patch(llama, kv_cache="static", compile=None, speculative=None)
    ids, mask = left_padded_batch(llama, (5,))
    own, ours = DynamicCache(), llama._hf_accel_state.kv_cache.layers[0]
    before = ours.length
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **{cache_keyword(llama): own})
    assert own.get_seq_length() > 0 and ours.length == before


def test_static_int8_cache_stores_a_third_of_the_bytes_and_reports_its_cost(tiny_model, arch):
    ids, mask = left_padded_batch(tiny_model)
    hf_accel.patch(tiny_model, kv_cache="static-int8", speculative=None)
    details = hf_accel.report(tiny_model)["kv_cache"].details
    assert details["bytes_per_token"] < 0.35 * details["bytes_per_token_full_precision"]
    assert 0 < details["logit_error_vs_full_precision_cache"] < 0.05 and details["top1_agreement"] >= 0.9
    stock = make_tiny_model(arch)  # the same weights: what the report says, and the output, recomputed
    probe = ProbeInputs.for_model(stock).input_ids[:1]
    caches = (PreallocatedCache(stock.config), PreallocatedCache(stock.config, layer_class=Int8Layer))
    full, int8 = (stock.generate(input_ids=probe, attention_mask=torch.ones_like(probe), max_new_tokens=16,
                                 do_sample=False, **{cache_keyword(stock): cache})[0, probe.shape[1]:]
                  for cache in caches)
    assert details["greedy_agreement_16_tokens"] == round((full == int8).float().mean().item(), 4)
    expected = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              **{cache_keyword(stock): PreallocatedCache(stock.config, layer_class=Int8Layer)})
    out = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, expected)
    compile_report = hf_accel.report(tiny_model)["compile"]  # the compiled step would bypass the int8 cache
    assert compile_report.backend != "inductor" and "static-int8" in str(compile_report.skipped)


def test_auto_never_picks_the_lossy_cache(llama):
    hf_accel.patch(llama)
    assert hf_accel.report(llama)["kv_cache"].backend == "static"


def test_int8_layer_round_trips_within_half_a_step_of_its_scale():
    layer = Int8Layer(capacity=8)
    k, v = kv(length=5)
    keys, values = layer.update(k, v)
    scale = k.abs().amax(-1, keepdim=True) / 127
    assert ((keys - k).abs() <= scale / 2 + 1e-6).all()
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.keys.shape[2] == 3


def _reassign(weight: torch.Tensor, values: torch.Tensor) -> None:
    weight.data = values  # new storage, same tensor object, version counter not bumped (PEFT's safe merge)


WEIGHT_CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(make_tiny_model("llama", seed=4).state_dict()),
    "in-place edit": lambda m: m.model.layers[0].mlp.down_proj.weight.mul_(3),
    "edit through .data (PEFT's merge)": lambda m: m.model.layers[1].self_attn.q_proj.weight.data.add_(0.05),
    ".data reassigned": lambda m: _reassign(m.model.layers[0].self_attn.o_proj.weight,
                                            m.model.layers[0].self_attn.o_proj.weight * 2),
    ".data reassigned again": lambda m: _reassign(m.model.layers[0].self_attn.o_proj.weight,
                                                  m.model.layers[0].self_attn.o_proj.weight - 0.01),
    "new Parameter": lambda m: setattr(m.lm_head, "weight",
                                       torch.nn.Parameter(m.lm_head.weight * -1, requires_grad=False)),
}


@pytest.mark.parametrize("options", [{"compile": "onednn_prepack"}, {}], ids=["onednn_prepack", "default"])
def test_packed_linears_follow_weight_changes_after_patch(options):
    """After each change, the next generate call and direct forwards compute with the new weights, like an
    unpatched model given the same change; unpatch keeps the changed weights."""
    model, stock = make_tiny_model("llama"), make_tiny_model("llama")
    hf_accel.patch(model, speculative=None, keep_original=True, **options)
    assert isinstance(model.lm_head, PackedLinear)
    ids, mask = left_padded_batch(model)
    for name, change in WEIGHT_CHANGES.items():
        with torch.no_grad():  # as in generate: the packed path runs only without autograd
            change(model)
            change(stock)
        expected = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
                           expected), name
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                       stock(ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4, msg=name)
    hf_accel.unpatch(model)
    assert_same_state(state_dict_copy(stock), state_dict_copy(model))


def packed_copies_of(model) -> int:
    from hf_accel_plugins.onednn_packing import PACKED

    gc.collect()
    return sum(id(p) in PACKED for p in model.parameters())


def test_a_weight_reassigned_through_data_is_repacked_on_direct_forwards_too():
    """No generate call in between: the product itself notices new storage, including storage at an address
    a freed one had (PEFT's safe merge and unmerge assign .data back and forth)."""
    model, stock = make_tiny_model("llama"), make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None, keep_original=True)
    ids, mask = left_padded_batch(model)
    originals = [m.lm_head.weight.data for m in (model, stock)]
    with torch.no_grad():
        for scale in range(2, 12):
            for values in ([w * scale for w in originals], originals):  # the scaled storage is freed, then reused
                for m, v in zip((model, stock), values):
                    _reassign(m.lm_head.weight, v)
                torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                           stock(ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)


def test_replaced_weights_leave_no_packed_copies_behind():
    model = make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None, keep_original=True)
    ids, mask = left_padded_batch(model)
    linears = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert packed_copies_of(model) == linears
    from hf_accel_plugins.onednn_packing import PACKED

    before = len(PACKED)
    with torch.no_grad():
        for _ in range(5):
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight), requires_grad=False)
            up = model.model.layers[0].mlp.up_proj.weight
            _reassign(up, torch.randn_like(up))
            model(ids, attention_mask=mask)
    gc.collect()
    assert packed_copies_of(model) == linears and len(PACKED) == before  # one copy per weight, old ones gone
    hf_accel.unpatch(model)
    assert packed_copies_of(model) == 0


def test_a_module_replaced_after_the_patch_stays_at_unpatch():
    model = make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    new_head = torch.nn.Linear(64, 512, bias=False)
    model.lm_head = new_head  # what resize_token_embeddings does to an untied head
    hf_accel.unpatch(model)
    assert model.lm_head is new_head
    assert isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    assert model.model.layers[0].mlp.up_proj.weight is not None


def test_a_model_made_in_inference_mode_can_be_prepacked():
    with torch.inference_mode():
        model = make_tiny_model("llama")
        ids, mask = left_padded_batch(model)
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    with torch.inference_mode():
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
                           expected)


def test_packing_frees_the_plain_weights_and_unpatch_refills_the_same_parameters():
    """The packed copy replaces the weight: the plain one's storage is freed, the state dict still holds the
    exact values, and unpatch gives the same Parameter objects back with the same values."""
    model = make_tiny_model("llama")
    before = state_dict_copy(model)
    # Weak references: a Parameter this test held would be one held outside the model, which keeps its weight.
    params = {name: weakref.ref(p) for name, p in model.named_parameters()
              if name.endswith("proj.weight") or "lm_head" in name}
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    assert all(p().numel() == 0 for p in params.values())
    assert hf_accel.report(model)["compile"].details["plain_weights_kept"] == 0
    assert_same_state(before, state_dict_copy(model))
    assert list(model.state_dict()) == list(before)  # same keys, same order
    with pytest.raises(AttributeError, match="keep_original=True"):
        model.model.layers[0].mlp.up_proj.weight  # noqa: B018
    assert torch.equal(model.model.layers[0].mlp.up_proj.dense_weight(), before["model.layers.0.mlp.up_proj.weight"])
    hf_accel.unpatch(model)
    assert {name: p for name, p in model.named_parameters() if name in params} == {  # the same objects
        name: ref() for name, ref in params.items()}
    assert_same_state(before, state_dict_copy(model))


def test_a_tied_head_keeps_its_shared_weight_and_the_tie():
    model = make_tiny_model("gemma2")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    assert model.lm_head.holds_weight and model.lm_head.weight is model.get_input_embeddings().weight
    assert hf_accel.report(model)["compile"].details["plain_weights_kept"] == 1


FREED_WEIGHT_CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(make_tiny_model("llama", seed=4).state_dict()),
    "new Parameter": lambda m: setattr(m.model.layers[0].mlp.up_proj, "weight", torch.nn.Parameter(
        torch.randn(128, 64), requires_grad=False)),
}


@pytest.mark.parametrize("change", sorted(FREED_WEIGHT_CHANGES))
def test_weights_loaded_or_assigned_into_freed_layers_take_effect(change):
    model, stock = make_tiny_model("llama"), make_tiny_model("llama")
    hf_accel.patch(model, speculative=None)
    ids, mask = left_padded_batch(model)
    torch.manual_seed(0)
    FREED_WEIGHT_CHANGES[change](model)
    torch.manual_seed(0)
    FREED_WEIGHT_CHANGES[change](stock)
    expected = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False), expected)
    assert_same_state(state_dict_copy(stock), state_dict_copy(model))
    hf_accel.unpatch(model)
    assert_same_state(state_dict_copy(stock), state_dict_copy(model))


def test_a_plain_tensor_assigned_as_a_freed_layers_weight_is_refused_as_nn_linear_refuses_it():
    model = make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    with pytest.raises(TypeError, match="Parameter"):
        model.model.layers[0].mlp.up_proj.weight = torch.randn(128, 64)
    ids, mask = left_padded_batch(model)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)  # the layer still works
    hf_accel.unpatch(model)


def test_a_layer_that_fails_to_pack_leaves_the_model_as_it_was(monkeypatch):
    from hf_accel_plugins import onednn_packing

    model = make_tiny_model("llama")
    before = state_dict_copy(model)
    calls = []

    def failing(weight, rows):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    monkeypatch.setattr(onednn_packing, "reorder", failing)
    with pytest.raises(hf_accel.PatchError):
        hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert_same_state(before, state_dict_copy(model))


def test_a_wrong_shape_loaded_into_a_freed_layer_is_refused_by_name():
    model = make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    with pytest.raises(RuntimeError, match="size mismatch for model.layers.0.mlp.up_proj.weight"):
        model.load_state_dict({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, strict=False)


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.model.half(),
                                     lambda m: m.model.layers[0].mlp.half()],
                         ids=["half", "to-bf16", "base-model-embeddings-first", "mlp"])
def test_changing_a_packed_models_dtype_is_refused_before_anything_changes(convert):
    model = make_tiny_model("llama")
    hf_accel.patch(model, compile="onednn_prepack", speculative=None)
    before = state_dict_copy(model)
    with pytest.raises(hf_accel.PatchError, match="unpatch"):
        convert(model)
    assert_same_state(before, state_dict_copy(model))
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())
    assert model.float() is model and model.to("cpu") is model  # conversions that change nothing are fine
