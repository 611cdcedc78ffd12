"""The patch transaction: restore, idempotence, rollback, validation, independence, wrappers."""

from __future__ import annotations

import copy
import io
import json
import logging
import pickle
import re

import pytest
import torch
from conftest import assert_same_state, left_padded_batch, make_tiny_model, state_dict_copy

import hf_accel
from hf_accel import Backend, hookimpl
from hf_accel.patching.state import get_state


def greedy(model, ids, mask, n=6):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def snapshot(model):
    return {
        "state": state_dict_copy(model),
        "attn": model.config._attn_implementation,
        "generation_config": model.generation_config.to_dict(),
        "has_instance_generate": "generate" in vars(model),
    }


def assert_restored(model, before):
    assert_same_state(before["state"], state_dict_copy(model))
    assert model.config._attn_implementation == before["attn"]
    assert model.generation_config.to_dict() == before["generation_config"]
    assert ("generate" in vars(model)) == before["has_instance_generate"]
    assert get_state(model) is None


class ExplodingPlugin:
    """Changes the model (config and a weight), then fails: patch() must leave no trace."""

    @hookimpl
    def hf_accel_register_backends(self, register):
        register(Backend(name="explode", feature="kv_cache", apply=self.apply))

    @staticmethod
    def apply(context):
        context.changes.setattr(context.model.config, "_attn_implementation_internal", "eager")
        head = context.model.get_output_embeddings()
        context.changes.setattr(head, "weight", torch.nn.Parameter(head.weight * 0))
        raise RuntimeError("boom")


class CorruptingPlugin:
    """An attention backend that looks best but changes the outputs."""

    @hookimpl
    def hf_accel_register_backends(self, register):
        register(Backend(name="wrong", feature="attention", apply=self.apply, priority=100))

    @staticmethod
    def apply(context):
        head = context.model.get_output_embeddings()
        context.changes.setattr(head, "weight", torch.nn.Parameter(head.weight * 1.5))


def test_patch_then_unpatch_restores_state_and_outputs(tiny_model):
    ids, mask = left_padded_batch(tiny_model)
    expected = greedy(tiny_model, ids, mask)
    before = snapshot(tiny_model)
    assert hf_accel.patch(tiny_model) is tiny_model
    assert torch.equal(greedy(tiny_model, ids, mask), expected)
    assert hf_accel.unpatch(tiny_model) is tiny_model
    assert_restored(tiny_model, before)
    assert torch.equal(greedy(tiny_model, ids, mask), expected)


@pytest.mark.parametrize("copier", ["copy.deepcopy", "copy.copy", "pickle.dumps", "torch.save"])
def test_copying_a_patched_model_says_to_copy_before_patching(llama, copier):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask)
    copy_it = {"copy.deepcopy": copy.deepcopy, "copy.copy": copy.copy, "pickle.dumps": pickle.dumps,
               "torch.save": lambda model: torch.save(model, io.BytesIO())}[copier]
    hf_accel.patch(llama)
    with pytest.raises(TypeError, match=r"patched LlamaForCausalLM cannot be copied or pickled.*before "
                                        r"hf_accel\.patch.*hf_accel\.unpatch.*save_pretrained"):
        copy_it(llama)
    assert torch.equal(greedy(llama, ids, mask), expected)  # the failed copy left the patched model working
    hf_accel.unpatch(llama)
    copy_it(llama)
    assert torch.equal(greedy(copy.deepcopy(llama), ids, mask), expected)


def test_patch_twice_with_the_same_arguments_is_a_logged_no_op(llama, caplog):
    hf_accel.patch(llama, attention="eager", cache_capacity=64)
    state = get_state(llama)
    with caplog.at_level(logging.INFO, logger="hf_accel"):
        assert hf_accel.patch(llama, cache_capacity=64, attention="eager") is llama
    assert get_state(llama) is state and "already patched" in caplog.text


@pytest.mark.parametrize("again", [{"attention": "sdpa"}, {"attention": "eager", "speculative": None},
                                   {"attention": "eager", "cache_capacity": 128}])
def test_patching_a_patched_model_with_other_arguments_says_to_unpatch_first(llama, again):
    hf_accel.patch(llama, attention="eager")
    state = get_state(llama)
    with pytest.raises(ValueError, match="already patched with .*attention='eager'.*hf_accel.unpatch"):
        hf_accel.patch(llama, **again)
    assert get_state(llama) is state and llama.config._attn_implementation == "eager"


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative": 42}, "speculative=42 is not valid"),
    ({"attention": 123}, "attention=123 is not valid"),
    ({"compile": 1}, "compile=1 is not valid"),
    ({"kv_cache": ["static"]}, "kv_cache=['static'] is not valid"),
    ({"cache_bucket": 0}, "cache_bucket=0 is not valid: expected an integer from 1 to 65536"),
    ({"cache_capacity": "big"}, "cache_capacity='big' is not valid: expected an integer from 1 to 1048576"),
    ({"num_draft_tokens": 0}, "num_draft_tokens=0 is not valid: expected an integer from 1 to 64"),
    ({"num_draft_tokens": 10 ** 6}, "num_draft_tokens=1000000 is not valid: expected an integer from 1 to 64"),
    ({"compile_cache": 1}, "compile_cache=1 is not valid: expected True, False, None or a directory path"),
    ({"verify": "yes"}, "verify='yes' is not valid: expected True or False"),
    ({"plugins": "my_plugin"}, "plugins='my_plugin' is not valid: expected a list of plugin objects"),
    ({"ngram_size": 1.5}, "ngram_size=1.5 is not valid"),
    ({"compile_when": "soon"}, "compile_when='soon' is not valid: expected one of 'auto', 'first_use'"),
    ({"group_size": 48}, "group_size=48 is not valid: expected one of 32, 64, 128, 256"),
    ({"prepack": "yes"}, "prepack='yes' is not valid: expected True or False"),
    ({"keep_original": 1}, "keep_original=1 is not valid: expected True or False"),
    ({"include": 3}, "include=3 is not valid"),
    ({"draft_model": "small"}, "draft_model='small' is not valid"),
])
def test_bad_values_are_refused_before_anything_changes(llama, kwargs, message):
    before = snapshot(llama)
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_accel.patch(llama, **kwargs)
    assert_restored(llama, before)
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_accel.check_arguments(**kwargs)  # the same error without a model


def test_unpatch_of_unpatched_model_is_harmless(llama):
    before = snapshot(llama)
    hf_accel.unpatch(llama)
    assert_restored(llama, before)


def test_plugin_failing_mid_patch_leaves_model_unchanged(llama):
    before = snapshot(llama)
    with pytest.raises(hf_accel.PatchError) as info:
        hf_accel.patch(llama, attention="eager", kv_cache="explode", plugins=[ExplodingPlugin()])
    message = str(info.value)
    assert "kv_cache" in message and "explode" in message and "boom" in message
    assert info.value.plugin and info.value.feature == "kv_cache"
    assert_restored(llama, before)


def test_failed_verification_falls_back_to_next_candidate(llama):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask)
    usual = hf_accel.report(hf_accel.patch(make_tiny_model("llama")))["attention"].backend
    hf_accel.patch(llama, plugins=[CorruptingPlugin()])
    attention = hf_accel.report(llama)["attention"]
    assert attention.backend == usual != "wrong"
    assert any(s["backend"] == "wrong" and "verification" in s["reason"] for s in attention.skipped)
    assert torch.equal(greedy(llama, ids, mask), expected)


def test_forced_backend_failing_verification_raises_and_restores(llama):
    before = snapshot(llama)
    with pytest.raises(hf_accel.VerificationError, match="wrong"):
        hf_accel.patch(llama, attention="wrong", plugins=[CorruptingPlugin()])
    assert_restored(llama, before)


def test_verify_false_keeps_an_unverified_backend(llama):
    hf_accel.patch(llama, attention="wrong", verify=False, plugins=[CorruptingPlugin()])
    assert hf_accel.report(llama)["attention"].backend == "wrong"
    assert hf_accel.report(llama)["attention"].verification is None


@pytest.mark.parametrize("kwargs, names", [
    ({"attention": "flashy"}, ["flashy", "'sdpa'", "'eager'"]),
    ({"kv_cache": "nope"}, ["nope", "kv_cache"]),
    ({"turbo": True}, ["turbo", "valid options"]),
])
def test_unknown_backend_or_option_raises_value_error_listing_valid_ones(llama, kwargs, names):
    before = snapshot(llama)
    with pytest.raises(ValueError) as info:
        hf_accel.patch(llama, **kwargs)
    for name in names:
        assert name in str(info.value)
    assert_restored(llama, before)


def test_forced_backend_that_cannot_serve_the_model_says_why():
    gemma = make_tiny_model("gemma2")
    with pytest.raises(hf_accel.BackendUnavailableError, match="soft-capping"):
        hf_accel.patch(gemma, attention="sdpa")
    assert get_state(gemma) is None


def test_non_model_input_raises_type_error():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_accel.patch(torch.nn.Linear(2, 2))


def test_two_models_in_one_process_stay_independent():
    a, b = make_tiny_model("llama"), make_tiny_model("llama")
    ids, mask = left_padded_batch(a)
    expected = greedy(b, ids, mask)
    hf_accel.patch(a, attention="eager")
    assert a.config._attn_implementation == "eager" and b.config._attn_implementation == "sdpa"
    assert "generate" not in vars(b) and get_state(b) is None
    assert torch.equal(greedy(a, ids, mask), expected)
    assert torch.equal(greedy(b, ids, mask), expected)


@pytest.mark.parametrize("wrap", ["torch.compile", "DataParallel", "accelerate", "peft"])
def test_wrapped_models_are_patched_inside(llama, wrap):
    if wrap == "torch.compile":
        wrapped = torch.compile(llama)
    elif wrap == "DataParallel":
        wrapped = torch.nn.DataParallel(llama)
    elif wrap == "accelerate":
        accelerate = pytest.importorskip("accelerate")
        wrapped = accelerate.Accelerator(cpu=True).prepare(llama)
    else:
        peft = pytest.importorskip("peft")
        wrapped = peft.get_peft_model(llama, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert hf_accel.patch(wrapped, attention="eager") is wrapped
    assert get_state(llama) is not None and hf_accel.report(wrapped)["attention"].backend == "eager"
    hf_accel.unpatch(wrapped)
    assert get_state(llama) is None


def test_report_is_a_table_and_json_with_feature_keys(llama):
    hf_accel.patch(llama)
    rep = hf_accel.report(llama)
    data = json.loads(json.dumps(rep.to_dict()))
    for feature in hf_accel.FEATURE_NAMES:
        assert {"backend", "reason"} <= data[feature].keys()
    assert data["attention"]["backend"] == "sdpa_flash" and data["quantize"]["backend"] is None
    text = str(rep)
    assert "attention" in text and "sdpa_flash" in text and "LlamaForCausalLM" in repr(rep)


def test_report_of_unpatched_model_says_so(llama):
    assert all(f.reason == "model not patched" for f in hf_accel.report(llama).features.values())
