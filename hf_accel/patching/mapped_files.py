"""Weights that are a file's pages: letting the ones a patch replaced leave resident memory.

transformers loads a safetensors checkpoint on the CPU as tensors over one memory mapping of the file: each
parameter's bytes are the file's pages, resident once read. A patch that replaces weights (packing them,
quantizing them) drops those parameters, but the mapping lives as long as any tensor in it does (the
embeddings, the norms), and with it every page that loading and patching read: freeing the weights would free
nothing. Here the pages no model tensor reads any more are advised out (``MADV_PAGEOUT``): the kernel drops the
file's clean pages, and whatever reads them again gets the same bytes back; pages this process wrote to go to
swap or stay. No value ever changes, so this is safe whoever else holds those tensors.

The kernel only drops a page no other process maps, of a file this process owns or may write (a read-only,
root-owned model directory keeps its pages resident). Linux only (``/proc/self/maps``); elsewhere nothing is
done.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import ctypes
import functools
import logging
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("hf_accel")

PAGE = mmap.PAGESIZE
MADV_PAGEOUT = 21  # Linux 5.4+, the same number on every architecture (4, MADV_DONTNEED, would discard)


@dataclass(frozen=True)
class FileMapping:
    """One file's pages mapped into this process, ``[start, end)`` (the file's adjacent parts joined)."""

    start: int
    end: int
    path: str


class FileMappings:
    """This process's file mappings at one moment, by address.

    Example::

        >>> FileMappings.now().find(model.model.embed_tokens.weight.data_ptr())
        FileMapping(start=..., end=..., path='/models/smollm2/model.safetensors')
    """

    def __init__(self, mappings: list[FileMapping]) -> None:
        self.mappings = sorted(mappings, key=lambda mapping: mapping.start)
        self._starts = [mapping.start for mapping in self.mappings]

    @classmethod
    def now(cls, maps: Path = Path("/proc/self/maps")) -> FileMappings:
        """Read from ``/proc/self/maps``; parts of one file (same device and inode, file offsets continuing)
        are joined; empty where it cannot be read."""
        try:
            lines = maps.read_bytes().splitlines()
        except OSError:
            return cls([])
        mappings: list[FileMapping] = []
        last_file = None
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == b"0" or not fields[5].startswith(b"/"):
                continue  # anonymous memory, the heap, the stack, [vdso]
            start, end = (int(address, 16) for address in fields[0].split(b"-"))
            file = (fields[3], fields[4], int(fields[2], 16) - start)  # device, inode, offset less address
            if mappings and last_file == file and mappings[-1].end == start:
                mappings[-1] = FileMapping(mappings[-1].start, end, mappings[-1].path)
            else:
                mappings.append(FileMapping(start, end, fields[5].decode(errors="replace")))
            last_file = file
        return cls(mappings)

    def find(self, address: int) -> FileMapping | None:
        """The mapping that holds ``address``, or None."""
        index = bisect.bisect_right(self._starts, address) - 1
        return self.mappings[index] if index >= 0 and address < self.mappings[index].end else None


_PHASE_MAPPINGS: contextvars.ContextVar[FileMappings | None] = contextvars.ContextVar("hf_accel_mappings",
                                                                                     default=None)


@contextlib.contextmanager
def mappings_read_once() -> Iterator[None]:
    """Inside, :func:`free_weight` reads the file mappings once, not once per weight (~1.5 ms each). A mapping
    that goes meanwhile (its last tensor freed) costs at most a useless advice: none changes a value."""
    token = _PHASE_MAPPINGS.set(FileMappings.now())
    try:
        yield
    finally:
        _PHASE_MAPPINGS.reset(token)


def extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[first, last)`` of the bytes a strided ``tensor`` reads."""
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + elements * tensor.element_size()


def free_weight(parameter: torch.Tensor) -> None:
    """Free ``parameter``'s bytes, keeping the object (it holds an empty tensor afterwards, for an undo to
    refill). Where the bytes are pages of a memory-mapped checkpoint, which the model's other tensors keep
    mapped, the whole pages it held are advised out of resident memory too.

    Example (a backend that keeps a packed copy of a weight in its place)::

        packed = pack(linear.weight)
        free_weight(linear.weight)
    """
    if _on_pages(parameter):
        first, last = extent(parameter)
        mapping = (_PHASE_MAPPINGS.get() or FileMappings.now()).find(first)
        if mapping is not None:
            page_out(first, min(last, mapping.end))
    parameter.data = parameter.data.new_empty(0)


def page_out(first: int, last: int) -> int:
    """Advise the kernel to drop the whole pages inside ``[first, last)``, part of one file's mapping; the bytes
    asked for (the kernel keeps pages another process maps, and those of a file this one may not write)."""
    start, end = -(-first // PAGE) * PAGE, last // PAGE * PAGE
    if end <= start or _madvise is None:
        return 0
    if _madvise(start, end - start, MADV_PAGEOUT) != 0:
        logger.debug("hf_accel: madvise(MADV_PAGEOUT) over %d bytes failed: errno %d", end - start, ctypes.get_errno())
        return 0
    return end - start


def release_replaced_pages(model: nn.Module) -> int:
    """Advise out the parts of every file mapping holding some of ``model``'s tensors that none of them reads
    (weights a patch replaced); the bytes asked for. Pages shared with a tensor the model still reads stay.
    Best effort: a tensor whose bytes cannot be located is passed over, and no error leaves here."""
    try:
        return _advise_unread_pages(model)
    except Exception:  # noqa: BLE001 - freeing memory must never fail a patch that worked
        logger.debug("hf_accel: releasing replaced weights' pages failed", exc_info=True)
        return 0


def _advise_unread_pages(model: nn.Module) -> int:
    mappings = FileMappings.now()
    read: dict[FileMapping, list[tuple[int, int]]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not _on_pages(tensor):
            continue
        first, last = extent(tensor)
        mapping = mappings.find(first)
        if mapping is not None:
            read.setdefault(mapping, []).append((first // PAGE * PAGE, -(-last // PAGE) * PAGE))
    asked = 0
    for mapping, ranges in read.items():
        edge = mapping.start
        for first, last in sorted(ranges):
            if first > edge:
                asked += page_out(edge, first)
            edge = max(edge, last)
        asked += page_out(edge, mapping.end)
    if asked:
        logger.debug("hf_accel: advised %.0f MiB of checkpoint pages the model no longer reads out of memory",
                     asked / 2**20)
    return asked


def _on_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are plain CPU memory it can say the address of (not meta, sparse, mkldnn or
    a subclass without storage)."""
    try:
        return tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.numel() > 0 and \
            tensor.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def pageout_supported() -> bool:
    """Whether this kernel takes ``MADV_PAGEOUT`` (Linux 5.4+; not every sandbox's kernel does)."""
    if _madvise is None:
        return False
    page = mmap.mmap(-1, PAGE)
    try:
        view = ctypes.c_char.from_buffer(page)
        supported = _madvise(ctypes.addressof(view), PAGE, MADV_PAGEOUT) == 0
        del view  # before close: mmap refuses to close while a view of it is alive
    finally:
        page.close()
    return supported


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()
