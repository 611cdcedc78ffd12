"""Plugin discovery: entry points, inline objects, environment filters, and the hooks."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

import hf_accel
from hf_accel import Backend, hookimpl
from hf_accel.patching.plugin_manager import get_plugin_manager, plugin_names, reset_plugin_manager


def backend_names():
    return {b.name for b in hf_accel.available_backends()}


def test_builtin_backends_come_from_entry_points():
    assert "attention_transformers" in plugin_names()
    plugins = {b.name: b.plugin for b in hf_accel.available_backends()}
    assert plugins["sdpa"] == plugins["eager"] == "attention_transformers"


@pytest.fixture
def third_party_package(tmp_path, monkeypatch):
    """An installed distribution declaring a plugin in the hf_accel entry-point group, as pip would leave it."""
    (tmp_path / "acme_accel.py").write_text(textwrap.dedent("""
        from hf_accel import Backend, hookimpl

        @hookimpl
        def hf_accel_register_backends(register):
            register(Backend(name="acme_eager", feature="attention",
                             apply=lambda ctx: ctx.model.set_attn_implementation("eager")))
    """))
    dist = tmp_path / "acme_accel-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-accel\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[hf_accel]\nacme = acme_accel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugin_manager()


def test_third_party_entry_point_plugin_is_discovered(third_party_package):
    assert "acme" in plugin_names()
    assert "acme_eager" in backend_names()


def test_env_disable_filters_plugins(third_party_package, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_DISABLE_PLUGINS", "acme")
    reset_plugin_manager()
    assert "acme_eager" not in backend_names() and "sdpa" in backend_names()


def test_env_allow_list_filters_plugins(third_party_package, monkeypatch, llama):
    monkeypatch.setenv("HF_ACCEL_PLUGINS", "acme")
    reset_plugin_manager()
    assert backend_names() == {"acme_eager"}
    with pytest.raises(ValueError, match="sdpa"):
        hf_accel.patch(llama, attention="sdpa")


class EagerPreferred:
    """Overrides selection for attention only."""

    @hookimpl
    def hf_accel_select_backend(self, feature, candidates, context):
        if feature == "attention":
            return next(b for b in candidates if b.name == "eager")
        return None


def test_plugin_object_for_one_call_and_selection_override(llama):
    plugin = EagerPreferred()
    hf_accel.patch(llama, plugins=[plugin])
    assert hf_accel.report(llama)["attention"].backend == "eager"
    assert not get_plugin_manager().is_registered(plugin)


class CountingGenerate:
    def __init__(self):
        self.calls = 0

    @hookimpl(wrapper=True)
    def hf_accel_generate(self, call):
        self.calls += 1
        result = yield
        assert call.model is not None
        return result


def test_generate_passes_through_wrapper_hooks(llama):
    counter = CountingGenerate()
    get_plugin_manager().register(counter)
    try:
        ids, mask = left_padded_batch(llama)
        expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert counter.calls == 0  # unpatched models never go through the hook
        hf_accel.patch(llama, verify=False)
        out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert counter.calls == 1 and torch.equal(out, expected)
    finally:
        get_plugin_manager().unregister(counter)


def test_duplicate_backend_names_are_refused(llama):
    class Clash:
        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="sdpa", feature="attention", apply=lambda ctx: None))

    with pytest.raises(ValueError, match="registered by both"):
        hf_accel.patch(llama, plugins=[Clash()])


def test_backend_with_unknown_feature_is_refused():
    with pytest.raises(ValueError, match="unknown feature"):
        Backend(name="x", feature="warp_drive", apply=lambda ctx: None)


def test_backend_options_are_accepted_and_passed(llama):
    seen = {}

    class WithOption:
        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="opt", feature="kv_cache", probe=None, options={"block_size": 16},
                             apply=lambda ctx: seen.update(block_size=ctx.option("block_size", 16))))

    hf_accel.patch(llama, kv_cache="opt", block_size=64, plugins=[WithOption()])
    assert seen == {"block_size": 64}


def test_plugins_given_to_patch_see_the_models_generate_calls_and_nobody_elses(llama):
    class Counter:
        calls = 0

        @hf_accel.hookimpl(wrapper=True)
        def hf_accel_generate(self, call):
            Counter.calls += 1
            return (yield)

    counter = Counter()
    ids, mask = left_padded_batch(llama)
    hf_accel.patch(llama, plugins=[counter], speculative=None, compile=None)
    Counter.calls = 0  # the patch's own verification probes generated too
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert Counter.calls == 1
    assert not get_plugin_manager().is_registered(counter)  # the process-wide manager never held it
    other = make_tiny_model("llama", seed=3)
    hf_accel.patch(other, speculative=None, compile=None)
    other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert Counter.calls == 1
