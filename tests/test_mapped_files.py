"""A checkpoint transformers memory-maps (safetensors, on the CPU): the weights a patch replaces leave resident
memory, though the model's other tensors keep the file mapped; the pages the model still reads, and other
files' pages, stay; no value changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import left_padded_batch, pages_read, resident_bytes

import hf_accel
from hf_accel.patching.mapped_files import (
    PAGE,
    FileMapping,
    FileMappings,
    extent,
    free_weight,
    page_out,
    pageout_supported,
)
from hf_accel.testing.models import tiny_config

pytestmark = pytest.mark.skipif(not (Path("/proc/self/smaps").exists() and pageout_supported()),
                                reason="needs Linux's /proc/self and MADV_PAGEOUT (Linux 5.4+)")
#: Pages the kernel may keep though advised to drop them (a file just written: still being written back).
KEPT = 2**20


def save_llama(path: Path, seed: int) -> Path:
    """A llama whose Linear weights span many pages (7 of its 7.4 MiB), saved as safetensors."""
    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size = 256, 1024
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("mapped"), seed=0)


def load(checkpoint: Path) -> tuple[transformers.PreTrainedModel, FileMapping]:
    """The model, every page of its file read (as a first generate call reads them), and the file's mapping."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.sum()
    mapping = FileMappings.now().find(model.model.embed_tokens.weight.data_ptr())
    assert mapping is not None and mapping.path.endswith("model.safetensors")  # transformers maps the file
    assert resident_bytes(mapping) >= 0.9 * (mapping.end - mapping.start)
    return model, mapping


def test_every_weight_of_a_loaded_checkpoint_lies_in_its_file_mapping(checkpoint):
    model, mapping = load(checkpoint)
    mappings = FileMappings.now()
    assert all(mappings.find(p.data_ptr()) == mapping for p in model.parameters())
    assert mappings.find(torch.randn(1 << 20).data_ptr()) is None  # the heap is no file's


def test_only_parts_of_one_file_that_continue_each_other_are_joined(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000002000 r--p 00000000 fe:00 11   /m/a.safetensors\n"
        "7f0000002000-7f0000005000 r--p 00002000 fe:00 11   /m/a.safetensors\n"  # a's next part: joined
        "7f0000005000-7f0000006000 r--p 00000000 fe:00 12   /m/b.safetensors\n"  # adjacent, another file
        "7f0000006000-7f0000007000 r--p 00009000 fe:00 12   /m/b.safetensors\n"  # b, but not where it left off
        "7f0000007000-7f0000008000 rw-p 00000000 00:00 0 \n"  # anonymous
        "7f0000008000-7f0000009000 rw-p 00000000 00:00 0    [heap]\n")
    assert FileMappings.now(maps).mappings == [
        FileMapping(0x7F0000000000, 0x7F0000005000, "/m/a.safetensors"),
        FileMapping(0x7F0000005000, 0x7F0000006000, "/m/b.safetensors"),
        FileMapping(0x7F0000006000, 0x7F0000007000, "/m/b.safetensors")]
    assert FileMappings.now(tmp_path / "missing").mappings == []


def test_freeing_a_mapped_weight_releases_its_pages_alone_and_no_other_value_changes(checkpoint):
    model, mapping = load(checkpoint)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weight = model.model.layers[0].mlp.up_proj.weight
    size, resident = weight.nbytes, resident_bytes(mapping)
    free_weight(weight)
    assert weight.numel() == 0 and isinstance(weight, torch.nn.Parameter)
    assert size - 2 * PAGE - KEPT <= resident - resident_bytes(mapping) <= size
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
def test_a_patch_leaves_resident_the_file_pages_the_model_reads_and_no_others(checkpoint, tmp_path, options):
    model, mapping = load(checkpoint)
    # Another model's file, mapped beside it: none of its pages go.
    other, other_mapping = load(save_llama(tmp_path, seed=1))
    ids, mask = left_padded_batch(model)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    hf_accel.patch(model, attention=None, kv_cache=None, speculative=None, **options)
    read = pages_read(model, mapping)
    assert read < 2 * 2**20  # the embeddings, the head, the norms
    assert read <= resident_bytes(mapping) <= read + KEPT  # what it reads stays, what it replaced goes
    assert resident_bytes(other_mapping) >= 0.9 * (other_mapping.end - other_mapping.start)
    actual = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    if "quantize" not in options:
        assert torch.equal(actual, expected)
    del other
