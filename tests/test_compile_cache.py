"""The compile cache: compiled shape classes kept between processes, validated whenever they are read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import edit_index, left_padded_batch, make_tiny_model

import hf_accel
from hf_accel.runtime.compile_policy import WARM_COMPILE_SECONDS
from hf_accel.tools import cli
from hf_accel_plugins.compile_inductor import InductorCompiler

AT_ONCE = {"compile": "inductor", "speculative": None, "compile_when": "first_use"}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty compile cache of this test's; its ``compile`` directory."""
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    return tmp_path / "compile"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def generate_patched(seed: int = 0, **options) -> tuple[torch.nn.Module, dict]:
    """A tiny llama patched with ``options``: whether one greedy call equals stock, and the compile report.
    ``torch._dynamo.reset()`` first, as a new process would start: only what is on disk carries over."""
    torch._dynamo.reset()
    model = make_tiny_model("llama", seed=seed)
    ids, mask = left_padded_batch(model, (9,))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch(model, **options)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, expected)
    return model, hf_accel.report(model)["compile"].details


def entries(store) -> dict:
    return json.loads((store / "index.json").read_text())["entries"]


SHAPE = "LlamaDecoderLayer, batch 1, 1 token"


def test_a_compiled_shape_is_kept_and_a_later_model_of_the_architecture_expects_a_cache_hit(store):
    _, details = generate_patched(**AT_ONCE)
    assert details["shapes"][SHAPE].startswith("compiled in")
    (entry,) = entries(store).values()
    assert entry["shape"] == SHAPE and entry["cold_seconds"] > 0 and "warm_seconds" not in entry
    assert entry["fingerprint"]["model"] == "LlamaForCausalLM" and entry["fingerprint"]["linears"] == ["PackedLinear"]
    assert (store / "code").is_dir()  # the compiled code lives in the store, not in inductor's default place

    _, details = generate_patched(seed=1, compile="inductor", speculative=None)  # other weights, default policy
    assert details["shapes"][SHAPE].startswith(
        f"eager for now: compiling is expected to take ~{WARM_COMPILE_SECONDS:.1f} s (compiled before on this machine)")
    _, details = generate_patched(seed=2, **AT_ONCE)
    assert details["failure"] is None and entries(store)[next(iter(entries(store)))]["warm_seconds"] > 0


def test_another_architecture_or_layer_layout_gets_entries_of_its_own(store):
    generate_patched(**AT_ONCE)
    torch._dynamo.reset()
    model = make_tiny_model("qwen2")
    ids, mask = left_padded_batch(model, (9,))
    hf_accel.patch(model, **AT_ONCE)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert sorted(e["fingerprint"]["model"] for e in entries(store).values()) == ["LlamaForCausalLM",
                                                                                  "Qwen2ForCausalLM"]


def test_a_stale_entry_is_discarded_with_a_log_line(store, caplog):
    generate_patched(**AT_ONCE)
    edit_index(store, lambda entry: entry["versions"].update(torch="1.0.0"))
    caplog.set_level(logging.INFO, logger="hf_accel")
    _, details = generate_patched(**AT_ONCE)
    assert "discarding compile cache entry" in caplog.text and "torch 1.0.0" in caplog.text
    assert "not compiled on this machine before" in caplog.text  # the compile did not count on it
    assert details["failure"] is None
    (entry,) = entries(store).values()
    assert entry["versions"]["torch"] == torch.__version__  # recorded anew
    assert any((store / "code").rglob("*.py"))  # compiled code is torch's to key: none of it was deleted


def test_another_install_of_torch_keeps_entries_of_its_own_side_by_side(store, monkeypatch):
    """Inductor compiles its C++ anew for another torch install (another virtual environment): a compile there
    is not warm, and neither environment's entries replace the other's in a shared cache directory."""
    elsewhere = "/another/venv/lib/python3.11/site-packages/torch/__init__.py"
    with monkeypatch.context() as m:
        m.setattr(torch, "__file__", elsewhere)
        generate_patched(**AT_ONCE)
    _, details = generate_patched(compile="inductor", speculative=None)  # this install: never compiled here
    assert details["shapes"][SHAPE].startswith("eager for now: compiling is expected to take ~10.0 s "
                                               "(not compiled on this machine before)")
    generate_patched(**AT_ONCE)
    assert sorted(e["fingerprint"]["torch_at"] for e in entries(store).values()) == sorted(
        ["/another/venv/lib/python3.11/site-packages/torch", str(Path(torch.__file__).resolve().parent)])


@pytest.mark.parametrize("damage", [lambda e: None, lambda e: {**e, "warm_seconds": "soon"},
                                    lambda e: {**e, "fingerprint": "LlamaForCausalLM"},
                                    lambda e: {**e, "median_saving": 1.5}, lambda e: {**e, "median_saving": 0},
                                    lambda e: {**e, "median_saving": False}],
                         ids=["null", "seconds not a number", "fingerprint not a mapping", "saving over 1",
                              "saving of nothing (auto would never compile)", "saving not a number"])
def test_a_malformed_entry_is_discarded_with_a_log_line(store, caplog, damage):
    generate_patched(**AT_ONCE)
    index = json.loads((store / "index.json").read_text())
    index["entries"] = {key: damage(entry) for key, entry in index["entries"].items()}
    (store / "index.json").write_text(json.dumps(index))
    _, details = generate_patched(**AT_ONCE)
    assert "it is malformed" in caplog.text and details["failure"] is None
    assert cli.main(["cache", "info"]) == 0  # and the listing copes


def test_a_saving_stored_from_means_is_not_read_and_a_new_one_replaces_it(store):
    """An earlier version stored ``saved_fraction`` from mean step times (one slow step could pin it at the
    floor): it is neither read nor kept once this version measures the class."""
    from hf_accel.runtime.compile_cache import CompileStore

    fp = {"model": "LlamaForCausalLM", "kind": "LlamaDecoderLayer"}
    compile_store = CompileStore()
    compile_store.code_directory.mkdir(parents=True)
    compile_store.record(fp, SHAPE, 3.0, warm=False)
    index = json.loads((store / "index.json").read_text())
    for entry in index["entries"].values():
        entry["saved_fraction"] = 0.05
    (store / "index.json").write_text(json.dumps(index))
    assert compile_store.lookup(fp, SHAPE).saved_fraction is None
    compile_store.record_saving(fp, SHAPE, 0.3)
    (entry,) = entries(store).values()
    assert "saved_fraction" not in entry and entry["median_saving"] == 0.3
    assert compile_store.lookup(fp, SHAPE).saved_fraction == 0.3


def test_a_corrupt_index_is_discarded_with_a_log_line(store, caplog):
    generate_patched(**AT_ONCE)
    (store / "index.json").write_text("{ not json")
    caplog.set_level(logging.INFO, logger="hf_accel")
    _, details = generate_patched(**AT_ONCE)
    assert "discarding the compile cache index" in caplog.text and "unreadable" in caplog.text
    assert details["failure"] is None and list(entries(store).values())[0]["shape"] == SHAPE


def test_an_entry_recording_another_model_under_this_key_is_discarded(store, caplog):
    generate_patched(**AT_ONCE)
    edit_index(store, lambda entry: entry["fingerprint"].update(model="GPT2LMHeadModel"))
    caplog.set_level(logging.INFO, logger="hf_accel")
    _, details = generate_patched(**AT_ONCE)
    assert "records another model (GPT2LMHeadModel)" in caplog.text
    assert details["failure"] is None and list(entries(store).values())[0]["fingerprint"]["model"] == "LlamaForCausalLM"


def test_corrupted_compiled_code_is_compiled_again_and_the_output_stays_right(store):
    generate_patched(**AT_ONCE)
    for path in (store / "code").rglob("*"):
        if path.is_file() and "lock" not in path.name:
            path.write_bytes(b"\x00garbage" * 16)
    _, details = generate_patched(**AT_ONCE)  # generate_patched asserts the output equals stock
    assert details["failure"] is None and details["shapes"][SHAPE].startswith("compiled in")


def test_a_compile_that_fails_from_the_store_empties_it_and_compiles_once_more(store, monkeypatch, caplog):
    generate_patched(**AT_ONCE)
    compile_fx = InductorCompiler.__call__
    calls = []

    def fails_first(self, graph, example_inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unreadable cache entry")
        return compile_fx(self, graph, example_inputs)

    monkeypatch.setattr(InductorCompiler, "__call__", fails_first)
    _, details = generate_patched(**AT_ONCE)
    assert "emptying the compile cache" in caplog.text and "unreadable cache entry" in caplog.text
    assert details["failure"] is None and len(calls) == 2
    (entry,) = entries(store).values()
    assert "warm_seconds" not in entry  # the store was emptied: recorded as a cold compile


def test_a_compile_that_fails_outside_the_store_leaves_it_alone(store, monkeypatch):
    generate_patched(**AT_ONCE)
    torch._dynamo.reset()
    model = make_tiny_model("qwen2")  # a shape class the store does not have

    def no_compiler(self, graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(InductorCompiler, "__call__", no_compiler)
    ids, mask = left_padded_batch(model, (9,))
    hf_accel.patch(model, **AT_ONCE)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert "no C++ compiler found" in hf_accel.report(model)["compile"].details["failure"]
    assert len(entries(store)) == 1 and (store / "code").is_dir()


def test_a_store_that_cannot_be_written_costs_compiles_only(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: cannot be created
    _, details = generate_patched(**AT_ONCE)
    assert details["failure"] is None and details["shapes"][SHAPE].startswith("compiled in")
    assert caplog.text.count("cannot be written") == 1


def test_without_a_home_directory_the_store_lives_in_the_temporary_directory(monkeypatch):
    from hf_accel.runtime.compile_cache import default_cache_dir

    for variable in ("HF_ACCEL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr("pathlib.Path.home", no_home)
    assert default_cache_dir().name.startswith("hf_accel-") and default_cache_dir().parent.is_dir()


def test_clearing_removes_what_the_store_made_and_nothing_else(store):
    generate_patched(**AT_ONCE)
    (store / "notes.txt").write_text("mine")
    assert cli.main(["cache", "clear"]) == 0
    assert not (store / "code").exists() and not (store / "index.json").exists()
    assert (store / "notes.txt").read_text() == "mine"


def test_compile_cache_false_keeps_nothing(store):
    generate_patched(compile_cache=False, **AT_ONCE)
    assert not store.exists()


def test_cache_info_and_clear_on_the_command_line(store, capsys):
    generate_patched(**AT_ONCE)
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"{store}  (1 entries" in out and "LlamaForCausalLM (PackedLinear)" in out and SHAPE in out
    assert cli.main(["cache", "clear"]) == 0
    assert f"emptied {store}" in capsys.readouterr().out and not (store / "code").exists()
    assert cli.main(["cache", "info"]) == 0
    assert "(0 entries, 0.0 MB)" in capsys.readouterr().out
