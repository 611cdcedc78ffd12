"""Weights that are a file's pages: letting the ones a patch replaced leave resident memory.

transformers loads a safetensors checkpoint on the CPU as tensors over one memory mapping of the file: each
parameter's bytes are the file's pages, resident once read. A patch that replaces weights (packing them,
quantizing them) drops those parameters, but the mapping lives as long as any tensor in it does (the
embeddings, the norms), and with it every page that loading and patching read: freeing the weights would free
nothing. Here the pages no model tensor uses any more are paged out (``MADV_PAGEOUT``): the kernel drops them
(they are the file's, unchanged), and anything that reads them again gets the same bytes back from the file.
It never changes a value, so it is safe whoever else holds those tensors.

Linux only (the mappings are read from ``/proc/self``); elsewhere nothing is done.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger("hf_accel")

PAGE = mmap.PAGESIZE
MADV_PAGEOUT = 21  # Linux 5.4: reclaim these pages now; file pages are read back from the file when touched


@dataclass(frozen=True)
class FileMapping:
    """File pages mapped into this process, ``[start, end)`` (adjacent mappings joined)."""

    start: int
    end: int


def file_mappings() -> list[FileMapping]:
    """This process's mappings of files, by address, adjacent ones joined (a file mapped in parts with different
    protections has one per part). Empty where ``/proc`` cannot be read."""
    ranges = sorted(_file_ranges())
    mappings: list[FileMapping] = []
    for start, end in ranges:
        if mappings and mappings[-1].end == start:
            mappings[-1] = FileMapping(mappings[-1].start, end)
        else:
            mappings.append(FileMapping(start, end))
    return mappings


def _file_ranges() -> list[tuple[int, int]]:
    # /proc/self/map_files names each file mapping "start-end" (listed in ~0.5 ms: once per freed weight);
    # /proc/self/maps (~1.5 ms, every mapping) where that directory cannot be listed.
    try:
        names = os.listdir("/proc/self/map_files")
    except OSError:
        try:
            lines = Path("/proc/self/maps").read_bytes().splitlines()
        except OSError:
            return []
        names = [line.split(maxsplit=1)[0].decode() for line in lines if b" /" in line]
    return [(int(start, 16), int(end, 16)) for start, end in (name.split("-") for name in names)]


def mapping_of(address: int, mappings: list[FileMapping]) -> FileMapping | None:
    """The mapping (sorted, as :func:`file_mappings` gives them) that holds ``address``, or None."""
    index = bisect.bisect_right([mapping.start for mapping in mappings], address) - 1
    return mappings[index] if index >= 0 and address < mappings[index].end else None


def extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[first, last)`` of the bytes ``tensor`` reads."""
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + elements * tensor.element_size()


def free_weight(parameter: torch.Tensor) -> None:
    """Free ``parameter``'s bytes, keeping the object (it holds an empty tensor afterwards, to be refilled by
    an undo). Where the bytes are pages of a memory-mapped checkpoint, which the model's other tensors keep
    mapped, the pages it held whole leave resident memory too.

    Example (a backend that keeps a packed copy of a weight in its place)::

        packed = pack(linear.weight)
        free_weight(linear.weight)
    """
    if parameter.device.type == "cpu" and parameter.numel():
        first, last = extent(parameter)
        mapping = mapping_of(first, file_mappings())
        if mapping is not None:
            page_out(first, min(last, mapping.end))
    parameter.data = parameter.data.new_empty(0)


def page_out(first: int, last: int) -> int:
    """Advise the kernel to drop the whole pages inside ``[first, last)``, which must be a file's mapping; the
    bytes advised (0 where the advice is not available)."""
    start, end = -(-first // PAGE) * PAGE, last // PAGE * PAGE
    if end <= start or _madvise is None:
        return 0
    return end - start if _madvise(start, end - start, MADV_PAGEOUT) == 0 else 0


def release_replaced_pages(model: nn.Module) -> int:
    """Page out the parts of every file mapping that holds some of ``model``'s tensors that none of them uses
    (weights a patch replaced); the bytes advised. Pages shared with a tensor the model still uses stay."""
    mappings = file_mappings()
    used: dict[FileMapping, list[tuple[int, int]]] = {}
    for tensor in _cpu_tensors(model.parameters(), model.buffers()):
        first, last = extent(tensor)
        mapping = mapping_of(first, mappings)
        if mapping is not None:
            used.setdefault(mapping, []).append((first // PAGE * PAGE, -(-last // PAGE) * PAGE))
    advised = 0
    for mapping, ranges in used.items():
        edge = mapping.start
        for first, last in sorted(ranges):
            if first > edge:
                advised += page_out(edge, first)
            edge = max(edge, last)
        advised += page_out(edge, mapping.end)
    if advised:
        logger.debug("hf_accel: paged out %.0f MiB of checkpoint file pages the model no longer uses", advised / 2**20)
    return advised


def _cpu_tensors(*groups: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    for group in groups:
        for tensor in group:
            if tensor.device.type == "cpu" and tensor.numel():
                yield tensor


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()
