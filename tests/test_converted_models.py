"""Converted copies of GGUF models (hf_accel.tools.converted): the copy loads the model the GGUF load gave."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import assert_same_state
from transformers import AutoTokenizer

from hf_accel.testing import make_tiny_model
from hf_accel.tools import cli
from hf_accel.tools.converted import COMPLETE, ConvertedModels


@pytest.fixture
def gguf(tmp_path):
    """A stand-in for a GGUF file: the store keys a copy on the file's place, size and time, never its bytes."""
    path = tmp_path / "models" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    return path


def comparable_config(model) -> dict:
    return {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("gpt2", True), ("qwen3", False)])
def test_the_copy_loads_the_same_weights_config_and_tokenizer(arch, tied, gguf, tiny_model_dir, tmp_path):
    model = make_tiny_model(arch, seed=3)
    model.config.tie_word_embeddings = tied
    model.tie_weights()
    model.generation_config.repetition_penalty = 1.1  # a model-card setting survives the copy
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = ConvertedModels(tmp_path / "cache")
    assert store.load(gguf, torch.float32) is None  # nothing kept yet
    path = store.save(model, tokenizer, gguf, torch.float32)
    assert path is not None and (path / COMPLETE).is_file() and store.entries() == [path]
    copy, copy_tokenizer = store.load(gguf, torch.float32)
    assert_same_state(model.state_dict(), copy.state_dict())
    assert comparable_config(copy) == comparable_config(model) and copy.name_or_path == str(gguf.parent)
    head, embeddings = copy.get_output_embeddings().weight, copy.get_input_embeddings().weight
    assert (head.data_ptr() == embeddings.data_ptr()) == tied
    assert copy.generation_config.repetition_penalty == 1.1
    text = "w1 w2 w3 w40 w5"
    assert copy_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert copy_tokenizer.chat_template == tokenizer.chat_template
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    assert torch.equal(copy.generate(ids, max_new_tokens=8, do_sample=False),
                       model.eval().generate(ids, max_new_tokens=8, do_sample=False))


def test_a_changed_file_gets_a_new_copy_and_the_old_one_is_deleted(gguf, tiny_model_dir, tmp_path):
    model, tokenizer = make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir)
    store = ConvertedModels(tmp_path / "cache")
    old = store.save(model, tokenizer, gguf, torch.float32)
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # a reinstalled package
    assert store.load(gguf, torch.float32) is None
    new = store.save(model, tokenizer, gguf, torch.float32)
    assert new != old and store.entries() == [new] and not old.exists()
    bf16 = store.save(model.to(torch.bfloat16), tokenizer, gguf, torch.bfloat16)  # another dtype: its own copy
    assert sorted(store.entries()) == sorted([new, bf16])


def test_an_incomplete_copy_is_never_read(gguf, tiny_model_dir, tmp_path):
    store = ConvertedModels(tmp_path / "cache")
    path = store.save(make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir), gguf, torch.float32)
    (path / COMPLETE).unlink()  # a process killed while writing leaves no marker (it is written last)
    assert store.load(gguf, torch.float32) is None and store.entries() == []


def test_copies_can_be_turned_off(gguf, tiny_model_dir, tmp_path, monkeypatch):
    store = ConvertedModels(tmp_path / "cache")
    model, tokenizer = make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir)
    store.save(model, tokenizer, gguf, torch.float32)
    monkeypatch.setenv("HF_ACCEL_CONVERTED_MODELS", "0")
    assert store.load(gguf, torch.float32) is None
    other = ConvertedModels(tmp_path / "other")
    assert other.save(model, tokenizer, gguf, torch.float32) is None and not other.directory.exists()


def test_an_unwritable_cache_costs_a_warning_not_the_load(gguf, tiny_model_dir, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    store = ConvertedModels(blocker / "cache")  # under a file: cannot be created
    with caplog.at_level(logging.WARNING):
        assert store.save(make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir), gguf,
                          torch.float32) is None
    assert "could not keep a converted copy of tiny.Q4_1.gguf" in caplog.text and "HF_ACCEL_CACHE" in caplog.text


def test_cache_info_lists_the_copies_and_clear_deletes_them(gguf, tiny_model_dir, tmp_path, capsys):
    store = ConvertedModels(tmp_path / "cache")
    path = store.save(make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir), gguf, torch.float32)
    assert cli.main(["cache", "info", "--dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "converted GGUF models" in out and "(1 copy," in out and path.name in out
    assert cli.main(["cache", "clear", "--dir", str(tmp_path / "cache")]) == 0
    assert store.entries() == [] and not path.exists()


def test_the_same_file_name_in_two_places_keeps_a_copy_each(gguf, tiny_model_dir, tmp_path):
    other = tmp_path / "other-venv" / gguf.name  # a second install of the same package
    other.parent.mkdir()
    other.write_bytes(b"GGUF")
    model, tokenizer = make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir)
    store = ConvertedModels(tmp_path / "cache")
    first = store.save(model, tokenizer, gguf, torch.float32)
    second = store.save(model, tokenizer, other, torch.float32)
    assert first != second and sorted(store.entries()) == sorted([first, second])


def test_a_damaged_copy_is_passed_over_with_a_warning(gguf, tiny_model_dir, tmp_path, caplog):
    store = ConvertedModels(tmp_path / "cache")
    path = store.save(make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir), gguf, torch.float32)
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING):
        assert store.load(gguf, torch.float32) is None  # the caller reads the GGUF file instead
    assert "could not be read" in caplog.text and "hf-accel cache clear" in caplog.text


def test_weights_that_are_not_plain_tensors_of_the_dtype_are_not_kept(gguf, tiny_model_dir, tmp_path):
    store = ConvertedModels(tmp_path / "cache")
    model = make_tiny_model("llama").to(torch.bfloat16)  # transformers kept other weights than asked for
    assert store.save(model, AutoTokenizer.from_pretrained(tiny_model_dir), gguf, torch.float32) is None
    assert store.entries() == []


def test_scratch_left_by_a_killed_writer_is_removed_by_the_next_write(gguf, tiny_model_dir, tmp_path):
    store = ConvertedModels(tmp_path / "cache")
    abandoned, recent = store.directory / ".writing-abandoned", store.directory / ".writing-in-progress"
    for scratch in (abandoned, recent):
        scratch.mkdir(parents=True)
        (scratch / "model.safetensors").write_bytes(b"half")
    os.utime(abandoned, (0, 0))
    store.save(make_tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model_dir), gguf, torch.float32)
    assert not abandoned.exists() and recent.exists()  # another process may be writing that one now
