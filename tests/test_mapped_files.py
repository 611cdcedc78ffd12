"""A checkpoint transformers memory-maps (safetensors, on the CPU): the weights a patch replaces leave resident
memory, though the model's other tensors keep the file mapped, and no value changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import left_padded_batch

import hf_accel
from hf_accel.patching.mapped_files import PAGE, FileMapping, extent, file_mappings, free_weight, mapping_of, page_out
from hf_accel.testing.models import tiny_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self (Linux)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A llama whose Linear weights span many pages (7 of its 7.4 MiB), saved as safetensors."""
    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size = 256, 1024
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mapped")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load(checkpoint: Path) -> tuple[transformers.PreTrainedModel, FileMapping]:
    """The model, every page of its file read (as a first generate call reads them), and the file's mapping."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.sum()
    mapping = mapping_of(model.model.embed_tokens.weight.data_ptr(), file_mappings())
    assert mapping is not None  # what the rest relies on: transformers maps the file
    return model, mapping


def resident_bytes(mapping: FileMapping) -> int:
    """This process's resident bytes of ``mapping`` (its lines of /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-")[0], 16)
            inside = mapping.start <= start < mapping.end
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def used_pages(model: torch.nn.Module, mapping: FileMapping) -> int:
    """Bytes of the whole pages the model's tensors in ``mapping`` lie on."""
    pages = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        first, last = extent(tensor)
        if tensor.numel() and mapping.start <= first < mapping.end:
            pages |= set(range(first // PAGE, -(-last // PAGE)))
    return len(pages) * PAGE


def test_every_weight_of_a_loaded_checkpoint_lies_in_its_file_mapping(checkpoint):
    model, mapping = load(checkpoint)
    mappings = file_mappings()
    assert all(mapping_of(p.data_ptr(), mappings) == mapping for p in model.parameters())
    assert mapping_of(torch.randn(1 << 20).data_ptr(), mappings) is None  # the heap is no file's


def test_freeing_a_mapped_weight_releases_its_pages_and_no_other_value_changes(checkpoint):
    model, mapping = load(checkpoint)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weight = model.model.layers[0].mlp.up_proj.weight
    resident = resident_bytes(mapping)
    free_weight(weight)
    assert weight.numel() == 0 and isinstance(weight, torch.nn.Parameter)
    assert resident - resident_bytes(mapping) >= before["model.layers.0.mlp.up_proj.weight"].nbytes - 2 * PAGE
    after = model.state_dict()
    for name, value in before.items():
        if name != "model.layers.0.mlp.up_proj.weight":
            assert torch.equal(after[name], value), name


def test_paged_out_pages_read_back_the_files_bytes(checkpoint):
    model, mapping = load(checkpoint)
    weight = model.model.layers[1].mlp.down_proj.weight
    expected = weight.detach().clone()
    resident = resident_bytes(mapping)
    assert page_out(*extent(weight)) >= weight.nbytes - 2 * PAGE
    assert resident_bytes(mapping) < resident - weight.nbytes // 2  # gone from memory ...
    assert torch.equal(weight, expected)  # ... and read back from the file, unchanged


@pytest.mark.parametrize("options", [
    {"compile": "onednn_prepack"},  # packs and frees one weight at a time
    {"quantize": "int8", "compile": None},  # drops the plain weights once the patch has succeeded
], ids=["packed", "int8"])
def test_a_patch_leaves_resident_only_the_file_pages_the_model_still_reads(checkpoint, options):
    model, mapping = load(checkpoint)
    ids, mask = left_padded_batch(model)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert resident_bytes(mapping) >= 0.9 * (mapping.end - mapping.start)  # the whole file was read
    hf_accel.patch(model, attention=None, kv_cache=None, speculative=None, **options)
    # the embeddings, the head, the norms, and a few pages the kernel may keep (a file just written)
    assert resident_bytes(mapping) <= used_pages(model, mapping) + 2**20 < 3 * 2**20
    actual = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    if "quantize" not in options:
        assert torch.equal(actual, expected)
