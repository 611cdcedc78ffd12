"""Quantized Linear weights: which modules, bytes, reversibility, errors, and all features together."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import VOCAB, assert_same_state, left_padded_batch, make_tiny_model, state_dict_copy

import hf_accel
from hf_accel_plugins.int4_layers import Int4Embedding, Int4WeightLinear
from hf_accel_plugins.int8_layers import Int8Embedding, Int8WeightLinear

QUANTIZED_TYPES = (Int8WeightLinear, Int8Embedding, Int4WeightLinear, Int4Embedding)


def quantized_names(model):
    return sorted(name for name, m in model.named_modules() if isinstance(m, QUANTIZED_TYPES))


def test_int8_quantizes_decoder_linears_and_reports_bytes(tiny_model):
    ids, mask = left_padded_batch(tiny_model)
    hf_accel.patch(tiny_model, quantize="int8", speculative=None)
    report = hf_accel.report(tiny_model)["quantize"]
    assert report.backend == "int8_weight_only" and report.verification.passed
    assert sorted(report.modules) == quantized_names(tiny_model) and "lm_head" not in report.modules
    assert report.weight_bytes_after < report.weight_bytes_before
    data = hf_accel.report(tiny_model).to_dict()["quantize"]
    assert data["weight_bytes_before"] == report.weight_bytes_before and data["weight_bytes_after"] > 0
    layer = tiny_model.get_submodule(report.modules[0])
    assert layer.qweight.dtype == torch.int8 and layer.scale.dtype == torch.bfloat16
    out = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 6)


def test_include_and_skip_patterns_choose_modules(llama):
    hf_accel.patch(llama, quantize="int8", include=[r"mlp\.", "lm_head"], skip=[r"layers\.1\."], speculative=None)
    names = quantized_names(llama)
    assert "lm_head" in names and all("mlp" in n or n == "lm_head" for n in names)
    assert not any(".layers.1." in n for n in names)
    assert llama.get_input_embeddings().weight.dtype == torch.float32  # the tied embedding keeps its weights


def test_unpatch_refuses_without_originals_and_restores_with_them(llama):
    hf_accel.patch(llama, quantize="int8", speculative=None)
    with pytest.raises(hf_accel.PatchError, match="keep_original=True"):
        hf_accel.unpatch(llama)

    model = make_tiny_model("llama")
    before = state_dict_copy(model)
    hf_accel.patch(model, quantize="int8", keep_original=True)
    hf_accel.unpatch(model)
    assert_same_state(before, state_dict_copy(model))
    assert not quantized_names(model)


@pytest.mark.parametrize("scheme, message", [("int3", "Unknown quantize backend 'int3'"),
                                             ("int8_weight_only", None)])
def test_unsupported_schemes_and_dtypes_fail_clearly(scheme, message):
    model = make_tiny_model("llama", dtype=torch.float16)
    expected_error = ValueError if message else hf_accel.BackendUnavailableError
    with pytest.raises(expected_error, match=message or "float16"):
        hf_accel.patch(model, quantize=scheme)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_all_four_features_together(tiny_model, scheme):
    ids, mask = left_padded_batch(tiny_model)
    hf_accel.patch(tiny_model, quantize=scheme, keep_original=True, speculative="ngram")
    # the reference is the quantized model's own greedy output without speculation or the cache
    reference = tiny_model._hf_accel_state.original_generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                                            do_sample=False)
    report = hf_accel.report(tiny_model)
    assert report["quantize"].backend == f"{scheme}_weight_only" and report["attention"].backend
    assert report["kv_cache"].backend == "static" and report["speculative"].backend == "ngram"
    out = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("scheme", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bitsandbytes_converts_loaded_weights(arch, scheme):
    pytest.importorskip("bitsandbytes")
    model = make_tiny_model(arch)
    ids, mask = left_padded_batch(model)
    before = state_dict_copy(model)
    hf_accel.patch(model, quantize="bnb", bnb_quant_type=scheme, keep_original=True, speculative=None)
    report = hf_accel.report(model)["quantize"]
    assert report.backend == "bnb" and report.details["scheme"] == f"bitsandbytes {scheme}"
    assert report.weight_bytes_after < report.weight_bytes_before
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 5)
    hf_accel.unpatch(model)
    assert_same_state(before, state_dict_copy(model))


@pytest.mark.parametrize("scheme", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_saved_bitsandbytes_model_reloads_as_the_floats_it_computes_with(arch, scheme, tmp_path):
    pytest.importorskip("bitsandbytes")
    from hf_accel_plugins.quantize_bnb import dequantized

    model, original = make_tiny_model(arch), make_tiny_model(arch)
    hf_accel.patch(model, quantize="bnb", bnb_quant_type=scheme, speculative=None)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # bitsandbytes' CPU kernel repacks 4-bit codes (and computes in bf16) from here on
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    with torch.no_grad():  # saving left the layers as they were (bitsandbytes' own state_dict does not)
        assert torch.equal(model(ids).logits, logits)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    # Within the scheme's rounding of the original weights (NF4: half the widest gap between its levels,
    # 0.152 of a block's absmax; LLM.int8: a step of 1/127 of a row's absmax, weights rounded to fp16 first),
    # not bitsandbytes' codes read as numbers.
    bound = {"nf4": 0.16, "fp4": 0.26, "int8": 1 / 127}[scheme]  # FP4: coarser levels than NF4
    for name in hf_accel.report(model)["quantize"].modules:
        weight, before = reloaded.get_submodule(name).weight, original.get_submodule(name).weight
        assert (weight - before).abs().max() <= bound * before.abs().max(), name
        assert torch.equal(weight.t() if arch == "gpt2" else weight, dequantized(model.get_submodule(name)))
    with torch.no_grad():  # the float model computes what the quantized one does, up to its bf16 activations
        torch.testing.assert_close(reloaded.eval()(ids).logits, logits, rtol=0.05, atol=0.05)
    with pytest.raises(RuntimeError, match="load them before patching"):
        model.load_state_dict(reloaded.state_dict())


def test_nf4_is_served_by_bitsandbytes_and_int8_prefers_the_fast_cpu_kernel(llama):
    pytest.importorskip("bitsandbytes")
    hf_accel.patch(llama, quantize="nf4", speculative=None)
    assert hf_accel.report(llama)["quantize"].backend == "bnb"
    other = make_tiny_model("llama")
    hf_accel.patch(other, quantize="int8", speculative=None)
    assert hf_accel.report(other)["quantize"].backend == "int8_weight_only"


def test_including_embeddings_quantizes_the_table_and_keeps_a_tied_head_tied():
    from hf_accel_plugins.int8_layers import Int8Embedding

    model = make_tiny_model("qwen2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids, mask = left_padded_batch(model)
    hf_accel.patch(model, quantize="int8", include=["embed_tokens", "lm_head", r"layers\."], speculative=None)
    report = hf_accel.report(model)["quantize"]
    assert isinstance(model.get_input_embeddings(), Int8Embedding) and "model.embed_tokens" in report.modules
    assert model.lm_head.qweight is model.get_input_embeddings().qweight  # one int8 table for both
    assert report.weight_bytes_after < 0.35 * report.weight_bytes_before
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 6)


def test_scaled_embeddings_are_left_alone():
    model = make_tiny_model("gemma2")  # its embedding multiplies by sqrt(hidden): not a plain nn.Embedding
    hf_accel.patch(model, quantize="int8", include=["embed_tokens", r"layers\."], speculative=None)
    assert "model.embed_tokens" not in hf_accel.report(model)["quantize"].modules


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_matches_its_dequantized_weights(group_size):
    from hf_accel_plugins.int4_layers import Int4WeightLinear, quantize_groups

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96)
    module = Int4WeightLinear(linear, group_size)
    codes, scale, minimum = quantize_groups(linear.weight.detach(), group_size)
    assert codes.min() >= 0 and codes.max() <= 15 and scale.shape == (96, 128 // group_size)
    dequantized = (codes.reshape(96, -1, group_size) * scale[..., None] + minimum[..., None]).reshape(96, 128)
    assert (dequantized - linear.weight).abs().max() <= scale.max() / 2 + 1e-6
    x = torch.randn(2, 5, 128)
    expected = torch.nn.functional.linear(x, dequantized, linear.bias)
    assert module(x).shape == (2, 5, 96) and module(x).dtype == torch.float32
    assert ((module(x) - expected).abs().max() / expected.abs().max()) < 0.01  # bf16 activations


def test_int4_packs_a_large_layer_block_by_block_as_in_one_piece(monkeypatch):
    # Coded a block of rows at a time (to bound the memory coding a head takes), the packed bytes and scales
    # must be those of one piece: the packer lays out blocks of 64 rows (32 below AVX-512) each on its own.
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 16 * 11)
    whole = Int4WeightLinear(linear, 32)
    assert Int4WeightLinear.PACK_ROWS % 64 == 0  # what layers of more rows are packed by
    monkeypatch.setattr(Int4WeightLinear, "PACK_ROWS", 64)  # 2 full blocks and a partial one of 48 rows
    blocks = Int4WeightLinear(linear, 32)
    assert torch.equal(blocks.packed_weight, whole.packed_weight)
    assert torch.equal(blocks.scales_and_zeros, whole.scales_and_zeros)
    x = torch.randn(3, 64)
    assert torch.equal(blocks(x), whole(x))


def test_int4_quantizes_every_architecture(tiny_model):
    from hf_accel_plugins.int4_layers import Int4WeightLinear

    ids, mask = left_padded_batch(tiny_model)
    hf_accel.patch(tiny_model, quantize="int4", speculative=None)
    report = hf_accel.report(tiny_model)["quantize"]
    assert report.backend == "int4_weight_only" and report.verification.passed
    names = sorted(n for n, m in tiny_model.named_modules() if isinstance(m, Int4WeightLinear))
    assert names == sorted(report.modules) and "lm_head" not in names
    assert report.weight_bytes_after < report.weight_bytes_before
    for length in (1, ids.shape[1]):
        out = tiny_model.generate(input_ids=ids[:, -length:], attention_mask=mask[:, -length:], max_new_tokens=5,
                                  do_sample=False)
        assert out.shape == (3, length + 5)


def test_int4_embedding_and_head_with_a_tied_table():
    from hf_accel_plugins.int4_layers import Int4Embedding, Int4WeightLinear

    model = make_tiny_model("qwen2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids, mask = left_padded_batch(model)
    table = model.get_input_embeddings().weight.detach().clone()
    hf_accel.patch(model, quantize="int4", include=["embed_tokens", "lm_head", r"layers\."], group_size=64,
                   speculative=None)
    report = hf_accel.report(model)["quantize"]
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, Int4Embedding) and isinstance(model.lm_head, Int4WeightLinear)
    looked_up = embedding(torch.tensor([[3, 7]]))
    assert looked_up.shape == (1, 2, 64) and (looked_up[0] - table[[3, 7]]).abs().max() < table.abs().max() / 8
    assert report.weight_bytes_after < 0.2 * report.weight_bytes_before
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 6)


@pytest.mark.parametrize("scheme, left, kind", [
    ("int4", ("gate_proj", "up_proj", "down_proj"), Int4WeightLinear),  # outputs of 136 rows, inputs of 136
    ("int8", ("down_proj",), Int8WeightLinear),  # inputs of 136: its kernel read past them (or crashed)
])
def test_layers_the_kernel_cannot_take_stay_in_full_precision(scheme, left, kind):
    # Before: int4's packer failed the whole patch; int8's kernel gave wrong values or a segmentation fault.
    model = make_tiny_model("llama", intermediate_size=136)
    ids, mask = left_padded_batch(model)
    hf_accel.patch(model, quantize=scheme, compile=None, speculative=None)
    report = hf_accel.report(model)["quantize"]
    assert report.verification.passed
    names = report.details["left_in_full_precision"]
    assert sorted(names) == sorted(f"model.layers.{i}.mlp.{name}" for i in range(2) for name in left)
    assert all(isinstance(model.get_submodule(name), torch.nn.Linear) for name in names)
    assert isinstance(model.model.layers[0].self_attn.q_proj, kind)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 4)


@pytest.mark.parametrize("scheme, size", [("int8", {"hidden_size": 72}),  # a head of 72 inputs
                                          ("int4", {"vocab_size": 520})])  # a head of 520 outputs
def test_an_embedding_tied_to_a_head_the_kernel_cannot_take_stays_with_it(scheme, size):
    # Before, the tied embedding alone was quantized and the tie silently broken (a saved model would reload
    # with other outputs); now both stay, and the error says why nothing was quantized.
    model = make_tiny_model("qwen2", tie_word_embeddings=True, **size)
    before = state_dict_copy(model)
    with pytest.raises(hf_accel.PatchError, match=r"every module selected has a shape this scheme's kernel cannot "
                                                  r"take \(model\.embed_tokens, lm_head\); choose another quantize="):
        hf_accel.patch(model, quantize=scheme, include=["embed_tokens", "lm_head"], speculative=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_state(before, state_dict_copy(model))


@pytest.mark.parametrize("refuse", ["embedding", "head"])
def test_a_kernel_selection_leaves_both_sides_of_a_tie_whichever_side_the_kernel_refuses(refuse):
    import types

    from hf_accel.plugin import kernel_selection

    model = make_tiny_model("qwen2", tie_word_embeddings=True)
    options = {"include": ["embed_tokens", "lm_head", r"layers\.0\.mlp\.up_proj"]}
    context = types.SimpleNamespace(model=model, option=lambda name, default=None: options.get(name, default))
    embeddings, linears, left = kernel_selection(context, lambda weight: refuse != "head" or weight.shape[0] != VOCAB,
                                                 lambda embedding: refuse != "embedding")
    assert embeddings == [] and [qualified for _, _, qualified, _ in linears] == ["model.layers.0.mlp.up_proj"]
    assert left == ["model.embed_tokens", "lm_head"]  # embeddings first


def test_int4_rejects_a_group_size_the_kernel_cannot_run(llama):
    with pytest.raises(ValueError, match="group_size=48 is not valid: expected one of 32, 64, 128, 256"):
        hf_accel.patch(llama, quantize="int4", group_size=48)
    assert not quantized_names(llama) and not hasattr(llama, "_hf_accel_state")


def quantized_tensors(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.named_buffers() if any(
        isinstance(model.get_submodule(name.rpartition(".")[0]), kind) for kind in QUANTIZED_TYPES)}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])  # GPT-2's Conv1D layout; Gemma2's tied head
@pytest.mark.parametrize("scheme, options", [("int8", {}), ("int4", {}),
                                             ("int8", {"include": ["embed_tokens|wte", "mlp"]}),
                                             ("int4", {"include": ["embed_tokens|wte", "mlp"]})],
                         ids=["int8", "int4", "int8-embeddings", "int4-embeddings"])
def test_a_saved_quantized_model_reloads_and_quantizes_back_to_the_same_weights(arch, scheme, options, tmp_path):
    model = make_tiny_model(arch)
    hf_accel.patch(model, quantize=scheme, speculative=None, **options)
    ids, mask = left_padded_batch(model)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    quantized = quantized_tensors(model)
    model.save_pretrained(tmp_path)

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing (randomly initialised) or unexpected weights
    for name in hf_accel.report(model)["quantize"].modules:  # stock transformers computes with these values
        module, weight = model.get_submodule(name), reloaded.get_submodule(name).weight
        assert torch.equal(weight.t() if arch == "gpt2" and name != "transformer.wte" else weight,
                           module.dequantized())
    hf_accel.patch(reloaded.eval(), quantize=scheme, speculative=None, **options)
    again = quantized_tensors(reloaded)
    assert again.keys() == quantized.keys() and all(torch.equal(again[k], quantized[k]) for k in quantized)
    assert torch.equal(reloaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
                       expected)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_loading_other_weights_into_a_quantized_model_quantizes_them(scheme):
    model, other, reference = (make_tiny_model("llama", seed=seed) for seed in (0, 3, 3))
    for m in (model, reference):
        hf_accel.patch(m, quantize=scheme, speculative=None, include=["embed_tokens", "proj"])
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert quantized_tensors(model).keys() == quantized_tensors(reference).keys()
    assert all(torch.equal(a, b) for a, b in zip(quantized_tensors(model).values(),
                                                   quantized_tensors(reference).values()))
    ids, mask = left_padded_batch(model)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
                       reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    with pytest.raises(RuntimeError, match="qweight"):  # a checkpoint in the old layout is refused, not ignored
        model.load_state_dict({**other.state_dict(), "model.layers.0.mlp.up_proj.qweight": torch.zeros(1)})
