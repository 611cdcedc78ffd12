"""Tiny random models built from configs (no download), and the real SmolLM2 model for slow tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_accel.patching.plugin_manager import reset_plugin_manager
from hf_accel.testing.models import TINY_ARCHITECTURES, VOCAB, left_padded_batch, make_tiny_model  # noqa: F401


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs a worker per core) each worker, and every process it
    launches, computes on one thread: two workers of two threads each would fight over the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests on the real model first: under xdist's work stealing the other worker then takes the
    many short tests from the back of the queue, and no long test is left running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(params=sorted(TINY_ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return make_tiny_model(arch)


@pytest.fixture
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_of_the_session(tmp_path_factory):
    """Compiled graphs persist in a directory of this test session's, never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ACCEL_CACHE", str(tmp_path_factory.mktemp("hf_accel_cache")))
        yield


@pytest.fixture(autouse=True)
def _fresh_plugin_manager(monkeypatch):
    """Each test sees the plugins as installed, unaffected by another test's environment or registrations."""
    for variable in ("HF_ACCEL_LOAD_PLUGINS", "HF_ACCEL_DISABLE_PLUGINS", "HF_ACCEL_TRACE", "HF_ACCEL_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer: ``[UNK]`` (also padding), ``<s>``, ``</s>``, then ``words``, one id each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   pad_token="[UNK]")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama and a word-level tokenizer (its chat template: the messages' text, as plain encoding gives it)
    saved as a local model directory."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = word_tokenizer([f"w{i}" for i in range(VOCAB - 3)])
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    make_tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, loaded once per session."""
    from hf_accel.tools.models import load_default_model

    model, tokenizer = load_default_model()
    return model, tokenizer


def edit_index(store: Path, change) -> None:
    """Apply ``change`` to every entry of the compile cache index in ``store`` (its ``compile`` directory)."""
    index = json.loads((store / "index.json").read_text())
    for entry in index["entries"].values():
        change(entry)
    (store / "index.json").write_text(json.dumps(index))


def state_dict_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def resident_bytes(mapping) -> int:
    """This process's resident bytes of a :class:`~hf_accel.patching.mapped_files.FileMapping` (its lines of
    /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = mapping.start <= int(head.split("-")[0], 16) < mapping.end
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def pages_read(model: torch.nn.Module, mapping) -> int:
    """Bytes of the whole pages of ``mapping`` that the model's tensors lie on."""
    from hf_accel.patching.mapped_files import PAGE, extent

    pages = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        first, last = extent(tensor) if tensor.numel() else (0, 0)
        if mapping.start <= first < mapping.end:
            pages |= set(range(first // PAGE, -(-last // PAGE)))
    return len(pages) * PAGE
