"""A failure injected into each backend's apply, into verification and into the final install leaves the
model bit-identical to before; patch then unpatch does too, for every backend that serves the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from torch import nn

import hf_accel
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.patching.registry import BackendRegistry
from hf_accel.patching.transaction import Transaction
from hf_accel_plugins.onednn_packing import PACKED

#: Every backend that can run on this machine, by feature.
BACKENDS = [(status.feature, status.name) for status in hf_accel.available_backends() if status.available]
ALL_OFF = dict.fromkeys(FEATURE_NAMES)


class Injected(RuntimeError):
    pass


def request_for(feature: str, name: str) -> dict:
    """``patch`` arguments that force this one backend, every other feature off."""
    request = make_tiny_model("llama", seed=1) if name == "draft_model" else name
    extra = {"keep_original": True} if feature == "quantize" else {}
    return {**ALL_OFF, feature: request, **extra}


def snapshot(model: nn.Module) -> dict:
    """What the user can observe of a model: its weights, module tree, instance attributes, configs, outputs."""
    ids, mask = left_padded_batch(model)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "modules": [(name, type(m), id(m)) for name, m in model.named_modules()],
        "instance_attributes": {name: {k: id(v) if not k.startswith("_") else None for k, v in vars(m).items()}
                                for name, m in model.named_modules()},
        "config": model.config.to_dict(),
        "generation_config": model.generation_config.to_dict(),
        "logits": logits,
        "tokens": tokens,
        "packed_copies": sum(id(p) in PACKED for p in model.parameters()),  # process-wide, outside the model
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key, tensor in before["state"].items():
        assert torch.equal(tensor, after["state"][key]), key
    for name in ("modules", "instance_attributes", "config", "generation_config", "packed_copies"):
        assert before[name] == after[name], name
    assert torch.equal(before["logits"], after["logits"]) and torch.equal(before["tokens"], after["tokens"])


def fail_in_apply(monkeypatch, name: str, after_edits: int | None) -> list[int]:
    """The named backend's apply raises once it has recorded ``after_edits`` edits (None: at its end);
    returns a list that receives the number of edits it had made when it failed."""
    failed_at = []
    collect = BackendRegistry.collect.__func__

    def with_failing_backend(cls, pm):
        registry = collect(cls, pm)
        backend = registry.get(name)

        def apply(context):
            changes = context.changes
            for method in ("setattr", "set_submodule", "on_undo"):
                setattr(changes, method, failing_after(getattr(changes, method), changes))
            backend.apply(context)
            failed_at.append(len(changes))
            raise Injected(f"injected into {name}.apply")

        def failing_after(record, changes):
            def edit(*args, **kwargs):
                record(*args, **kwargs)
                if after_edits is not None and len(changes) >= after_edits and not failed_at:
                    failed_at.append(len(changes))
                    raise Injected(f"injected into {name}.apply")
            return edit

        registry._backends[name] = dataclasses.replace(backend, apply=apply)
        return registry

    monkeypatch.setattr(BackendRegistry, "collect", classmethod(with_failing_backend))
    return failed_at


@pytest.mark.parametrize("after_edits", [1, None], ids=["after-its-first-edit", "at-its-end"])
@pytest.mark.parametrize("feature, name", BACKENDS)
def test_a_failure_in_a_backend_apply_leaves_the_model_as_it_was(feature, name, after_edits, monkeypatch):
    model = make_tiny_model("llama")
    before = snapshot(model)
    failed_at = fail_in_apply(monkeypatch, name, after_edits)
    with pytest.raises(hf_accel.PatchError, match=f"injected into {name}.apply"):
        hf_accel.patch(model, **request_for(feature, name))
    assert len(failed_at) == 1 and (after_edits is None or failed_at == [after_edits])
    assert_unchanged(before, snapshot(model))


def test_a_failure_in_the_last_phase_undoes_every_phase_before_it(monkeypatch):
    """quantize, attention, kv_cache and compile applied; speculative's backend fails half-way."""
    model = make_tiny_model("llama")
    before = snapshot(model)
    fail_in_apply(monkeypatch, "ngram", after_edits=1)
    with pytest.raises(hf_accel.PatchError, match="injected into ngram.apply"):
        hf_accel.patch(model, quantize="int8", keep_original=True, attention="sdpa_flash", kv_cache="static",
                       compile="inductor", speculative="ngram")
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("feature, name", BACKENDS)
def test_a_failure_in_verification_leaves_the_model_as_it_was(feature, name, monkeypatch):
    model = make_tiny_model("llama")
    before = snapshot(model)

    def check(self, backend, probe, reference):
        raise Injected(f"injected into the verification of {backend.name}")

    monkeypatch.setattr(Transaction, "_check", check)
    try:
        hf_accel.patch(model, **request_for(feature, name))
    except hf_accel.VerificationError as exc:
        assert "injected into the verification" in str(exc)
    else:  # a draft model (an object, not a name) falls back when refused; a backend without a probe is not verified
        verified = hf_accel.report(model)[feature]
        assert verified.backend is None if verified.verification is not None else verified.backend == name
        hf_accel.unpatch(model)
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("arguments", [{}, {"quantize": "int8", "keep_original": True},
                                       {"speculative": "self_int4", "kv_cache": "static-int8"}],
                         ids=["default", "int8", "self-draft-int8-cache"])
def test_a_failure_after_every_phase_leaves_the_model_as_it_was(arguments, monkeypatch):
    model = make_tiny_model("llama")
    before = snapshot(model)

    def install(self):
        raise Injected("injected into install")

    monkeypatch.setattr(Transaction, "install", install)
    with pytest.raises(Injected):
        hf_accel.patch(model, **arguments)
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("feature, name", BACKENDS)
def test_unpatch_restores_the_model_after_each_backend(feature, name):
    model = make_tiny_model("llama")
    before = snapshot(model)
    try:
        hf_accel.patch(model, **request_for(feature, name))
    except hf_accel.BackendUnavailableError as exc:
        pytest.skip(str(exc))
    assert hf_accel.report(model)[feature].backend == name
    hf_accel.unpatch(model)
    assert_unchanged(before, snapshot(model))


def test_unpatch_restores_the_model_after_every_feature_together():
    model = make_tiny_model("llama")
    before = snapshot(model)
    hf_accel.patch(model, quantize="int8", keep_original=True, kv_cache="static", speculative="ngram")
    hf_accel.unpatch(model)
    assert_unchanged(before, snapshot(model))
