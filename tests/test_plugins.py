"""Plugin discovery: entry points, inline objects, environment filters, broken plugins, tracing, and the hooks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

import hf_accel
from hf_accel import Backend, hookimpl
from hf_accel.patching.plugin_manager import (
    get_plugin_manager,
    plugin_discovery,
    plugin_names,
    plugin_problems,
    reset_plugin_manager,
)
from hf_accel.tools.cli import main


def backend_names():
    return {b.name for b in hf_accel.available_backends()}


def builtin_plugins() -> set[str]:
    """The entry points hf_accel's own distribution declares (setup.cfg)."""
    return {ep.name for ep in entry_points(group="hf_accel")
            if ep.dist.name.replace("_", "-").lower() == "hf-accel"}


def test_builtin_backends_come_from_entry_points():
    assert "attention_transformers" in plugin_names()
    plugins = {b.name: b.plugin for b in hf_accel.available_backends()}
    assert plugins["sdpa"] == plugins["eager"] == "attention_transformers"


def install_distribution(tmp_path, monkeypatch, distribution: str, version: str, entry_point: str, module: str,
                         source: str) -> None:
    """An installed distribution declaring one plugin in the hf_accel entry-point group, as pip would leave it:
    its module and its ``.dist-info``, in a directory of its own put first on ``sys.path``."""
    root = tmp_path / distribution
    root.mkdir()
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(f"[hf_accel]\n{entry_point} = {module}\n")
    monkeypatch.delitem(sys.modules, module, raising=False)  # a module of the same name from another test
    monkeypatch.syspath_prepend(str(root))
    reset_plugin_manager()


def eager_backend_plugin(backend: str) -> str:
    """A plugin module's source registering one attention backend named ``backend``."""
    return f"""
        from hf_accel import Backend, hookimpl

        @hookimpl
        def hf_accel_register_backends(register):
            register(Backend(name={backend!r}, feature="attention",
                             apply=lambda ctx: ctx.model.set_attn_implementation("eager")))
    """


@pytest.fixture
def third_party_package(tmp_path, monkeypatch):
    """An installed distribution ``acme-accel`` 1.0 whose entry point ``acme`` registers ``acme_eager``."""
    install_distribution(tmp_path, monkeypatch, "acme-accel", "1.0", "acme", "acme_accel",
                         eager_backend_plugin("acme_eager"))


@pytest.fixture
def two_third_party_packages(third_party_package, tmp_path, monkeypatch):
    """``acme`` as above, and ``other-accel`` 0.5 whose entry point ``other`` registers ``other_eager``."""
    install_distribution(tmp_path, monkeypatch, "other-accel", "0.5", "other", "other_accel",
                         eager_backend_plugin("other_eager"))


def test_third_party_entry_point_plugin_is_discovered(third_party_package):
    assert "acme" in plugin_names()
    assert "acme_eager" in backend_names()


def test_env_disable_filters_plugins_builtins_included(third_party_package, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_DISABLE_PLUGINS", "acme, attention_transformers")
    reset_plugin_manager()
    assert not {"acme_eager", "sdpa", "eager"} & backend_names()
    assert "attention_flash" in plugin_names() and "attention_transformers" not in plugin_names()


def test_env_load_plugins_loads_the_named_third_party_plugins_and_every_builtin(two_third_party_packages,
                                                                                monkeypatch, llama):
    monkeypatch.setenv("HF_ACCEL_LOAD_PLUGINS", "acme")
    reset_plugin_manager()
    assert set(plugin_names()) == builtin_plugins() | {"acme"}
    assert {"acme_eager", "sdpa", "eager"} <= backend_names() and "other_eager" not in backend_names()
    assert plugin_discovery().left_out == ["other"]
    hf_accel.patch(llama, attention="sdpa", compile=None, speculative=None)
    assert hf_accel.report(llama)["attention"].backend == "sdpa"


def test_env_load_plugins_empty_loads_the_builtins_only(two_third_party_packages, monkeypatch, llama):
    monkeypatch.setenv("HF_ACCEL_LOAD_PLUGINS", "")
    reset_plugin_manager()
    assert "attention_transformers" in builtin_plugins() and len(builtin_plugins()) >= 10
    assert set(plugin_names()) == builtin_plugins()
    assert sorted(plugin_discovery().left_out) == ["acme", "other"]
    with pytest.raises(ValueError, match="acme_eager"):
        hf_accel.patch(llama, attention="acme_eager")


def test_env_load_plugins_warns_of_a_name_no_installed_plugin_has(two_third_party_packages, monkeypatch, caplog):
    monkeypatch.setenv("HF_ACCEL_LOAD_PLUGINS", "acme,acme_eager")
    reset_plugin_manager()
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        assert "acme" in plugin_names()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["hf_accel: HF_ACCEL_LOAD_PLUGINS names 'acme_eager', which no installed plugin has; "
                        "installed third-party plugins: acme, other"]
    assert plugin_discovery().unknown == ["acme_eager"]


#: A broken plugin of the distribution broken-accel 2.3: its module's source, the phase it fails in, the start of
#: the error recorded, and what is skipped when not the whole plugin.
BROKEN = {
    "raises-on-import": ("raise RuntimeError('broken_accel needs the acme driver')\n", "load",
                         "RuntimeError: broken_accel needs the acme driver", ""),
    "bad-hook-signature": ("""
        from hf_accel import hookimpl

        @hookimpl
        def hf_accel_register_backends(regster):
            pass
    """, "register", "PluginValidationError: Plugin 'broken' for hook 'hf_accel_register_backends'", ""),
    "register-hook-raises": ("""
        from hf_accel import hookimpl

        @hookimpl
        def hf_accel_register_backends(register):
            raise RuntimeError("no kernels for this CPU")
    """, "backends", "RuntimeError: no kernels for this CPU", ""),
    "registers-a-non-backend": ("""
        from hf_accel import hookimpl

        @hookimpl
        def hf_accel_register_backends(register):
            register("sdpa")
    """, "backends", "TypeError: plugin 'broken' registered 'sdpa'; expected an hf_accel.Backend", ""),
    "takes-a-builtins-name": (eager_backend_plugin("sdpa"), "backends",
                              "ValueError: Backend name 'sdpa' is registered by both 'attention_transformers' and "
                              "'broken'", "backend 'sdpa'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plugin_is_reported_and_skipped(case, third_party_package, tmp_path, monkeypatch, caplog, llama):
    source, phase, error, skipped = BROKEN[case]
    install_distribution(tmp_path, monkeypatch, "broken-accel", "2.3", "broken", f"broken_{case.replace('-', '_')}",
                         source)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        hf_accel.patch(llama, attention="acme_eager", compile=None, speculative=None)
        hf_accel.check_arguments(attention="sdpa")  # collects the backends again: reported once all the same
    assert hf_accel.report(llama)["attention"].backend == "acme_eager"  # another third-party plugin still works
    plugins = {b.name: b.plugin for b in hf_accel.available_backends()}
    assert plugins["sdpa"] == plugins["eager"] == "attention_transformers" and plugins["static"] == "kv_cache_static"
    [problem] = plugin_problems()
    assert (problem.plugin, problem.distribution, problem.version, problem.phase, problem.skipped) == (
        "broken", "broken-accel", "2.3", phase, skipped)
    assert problem.error.startswith(error)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"hf_accel: plugin 'broken' (broken-accel 2.3){': ' + skipped if skipped else ''} "
                              f"skipped while ")
    assert " ".join(error.split()) in warning and "HF_ACCEL_DISABLE_PLUGINS=broken" in warning


def test_doctor_and_plugins_print_the_problems(tmp_path, monkeypatch, capsys):
    source, *_ = BROKEN["register-hook-raises"]
    install_distribution(tmp_path, monkeypatch, "broken-accel", "2.3", "broken", "broken_for_the_cli", source)
    line = ("plugin 'broken' (broken-accel 2.3) skipped while registering its backends: RuntimeError: no kernels "
            "for this CPU")
    assert main(["doctor"]) == 0
    assert f"\n  {line}\n" in capsys.readouterr().out
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert f"problems (plugins or backends skipped):\n  {line}\n" in out
    assert "  broken  [broken-accel 2.3, third-party]\n      backends: none\n" in out


def test_plugins_command_lists_each_plugin_its_source_backends_and_hooks(third_party_package, monkeypatch, capsys):
    monkeypatch.setenv("HF_ACCEL_DISABLE_PLUGINS", "quantize_bnb")
    reset_plugin_manager()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert ("  acme  [acme-accel 1.0, third-party]\n      backends: acme_eager (attention)\n"
            "      hooks: hf_accel_register_backends\n") in out
    assert (f"  attention_transformers  [hf_accel {hf_accel.__version__}, built-in]\n"
            "      backends: sdpa (attention), eager (attention)\n") in out
    assert "hf_accel.core" not in out and "problems: none" in out
    assert "HF_ACCEL_DISABLE_PLUGINS: 'quantize_bnb'\n" in out and "left out by these: quantize_bnb" in out

    assert main(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    plugins = {p["name"]: p for p in listing["plugins"]}
    assert plugins["acme"] == {"name": "acme", "distribution": "acme-accel", "version": "1.0", "builtin": False,
                               "backends": [{"name": "acme_eager", "feature": "attention"}],
                               "hooks": ["hf_accel_register_backends"]}
    assert plugins["attention_transformers"]["builtin"] is True
    assert [b["name"] for b in plugins["attention_transformers"]["backends"]] == ["sdpa", "eager"]
    assert set(plugins) == builtin_plugins() - {"quantize_bnb"} | {"acme"}
    assert listing["problems"] == []
    assert listing["environment"] == {"HF_ACCEL_LOAD_PLUGINS": None, "HF_ACCEL_DISABLE_PLUGINS": "quantize_bnb",
                                      "HF_ACCEL_TRACE": None, "left_out": ["quantize_bnb"], "unknown": []}


def test_two_third_party_plugins_taking_one_name_the_first_keeps_it(tmp_path, monkeypatch):
    install_distribution(tmp_path, monkeypatch, "one-accel", "1.0", "one", "one_accel", eager_backend_plugin("fast"))
    install_distribution(tmp_path, monkeypatch, "two-accel", "1.0", "two", "two_accel", eager_backend_plugin("fast"))
    order = [ep.name for ep in entry_points(group="hf_accel")]
    first, second = sorted(("one", "two"), key=order.index)
    assert {b.name: b.plugin for b in hf_accel.available_backends()}["fast"] == first
    [problem] = plugin_problems()
    assert (problem.plugin, problem.skipped, problem.phase) == (second, "backend 'fast'", "backends")


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


def trace_of(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "hf_accel.trace")


@pytest.mark.parametrize("plugins", [[], [EagerPreferred()]], ids=["process-wide", "per-call"])
def test_trace_logs_each_hook_call_with_its_arguments_and_result(plugins, monkeypatch, caplog, llama):
    monkeypatch.setenv("HF_ACCEL_TRACE", "1")
    reset_plugin_manager()
    caplog.set_level(logging.INFO, logger="hf_accel.trace")
    hf_accel.patch(llama, compile=None, speculative=None, plugins=plugins)
    ids, mask = left_padded_batch(llama)
    caplog.clear()  # only the user's generate call below, not the patch's verification probes
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    generate = trace_of(caplog)
    assert generate.startswith("  hf_accel_generate [hook]\n      call: <GenerateCall LlamaForCausalLM(input_ids="
                               "tensor[3, 7] int64, attention_mask=tensor[3, 7] int64, max_new_tokens=2, "
                               "do_sample=False)>\n")
    assert f"  finish hf_accel_generate --> {out} [hook]".splitlines()[0] in generate
    caplog.clear()
    hf_accel.check_arguments(attention="sdpa", plugins=plugins)
    assert ("  hf_accel_register_backends [hook]\n      register: <register for plugin 'attention_transformers'>\n"
            "  finish hf_accel_register_backends --> [] [hook]") in trace_of(caplog)
    caplog.clear()
    hf_accel.unpatch(llama)
    hf_accel.patch(llama, compile=None, speculative=None, plugins=plugins)
    chosen = "eager" if plugins else hf_accel.report(llama)["attention"].backend
    select = trace_of(caplog)
    assert "  hf_accel_select_backend [hook]\n      feature: attention\n      candidates: (<Backend " in select
    assert f"  finish hf_accel_select_backend --> <Backend '{chosen}' feature='attention' " in select


def test_no_trace_without_the_variable(caplog, llama):
    caplog.set_level(logging.INFO, logger="hf_accel.trace")
    hf_accel.patch(llama, compile=None, speculative=None)
    assert trace_of(caplog) == ""


def test_the_trace_variable_alone_writes_the_trace_to_stderr():
    done = subprocess.run([sys.executable, "-c", "import hf_accel; hf_accel.check_arguments(attention='sdpa')"],
                          env={**os.environ, "HF_ACCEL_TRACE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("hf_accel.trace:   hf_accel_register_backends [hook]\n"
            "      register: <register for plugin 'quantize_int8'>\n"
            "hf_accel.trace:   finish hf_accel_register_backends --> [] [hook]\n") in done.stderr


def test_the_replaced_allow_list_variable_is_named_with_its_replacement(monkeypatch, caplog):
    monkeypatch.setenv("HF_ACCEL_PLUGINS", "acme")
    reset_plugin_manager()
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        assert "attention_transformers" in plugin_names()
    assert any("HF_ACCEL_PLUGINS is no longer read; use HF_ACCEL_LOAD_PLUGINS" in r.getMessage()
               for r in caplog.records)
