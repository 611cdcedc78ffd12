"""Converted copies of GGUF models, so that a GGUF file is dequantized once per machine, not once per process.

transformers reads a GGUF file slowly: SmolLM2-135M's 90 MB take ~30-40 s on this project's 2-core machine (its
reader parses the file's fields twice and rebuilds a tensor-name map for every tensor), where the same weights as
safetensors load in under a second. Every ``hf-accel demo``, ``generate``, ``bench`` and ``identity`` paid it. The
first load of a GGUF file through :func:`hf_accel.tools.models.load_model` now writes what it produced (weights as
safetensors, config, generation config, tokenizer) under ``<HF_ACCEL_CACHE>/models/``; later loads of the same file,
dtype and transformers version read that copy: the same tensors, config (its GGUF quantization entry included) and
tokenizer. ``hf-accel cache info`` shows the copies, ``hf-accel cache clear`` deletes them;
``HF_ACCEL_CONVERTED_MODELS=0`` turns the copies off. The fresh processes of ``bench --cold`` and ``--memory`` load
the GGUF file themselves, as a user's script would, and ``bench --processes`` turns the copies off, so those
measurements are unchanged.

Example::

    >>> store = ConvertedModels()
    >>> store.load(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), torch.float32)  # None until one was saved
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hf_accel.runtime.compile_cache import default_cache_dir

logger = logging.getLogger(__name__)

#: Written last into a copy's directory: a copy without it is incomplete and never read.
COMPLETE = "hf_accel_converted.txt"
#: What a copy holds and how; part of its key, so a change here makes new copies.
FORMAT = 1


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get("HF_ACCEL_CONVERTED_MODELS", "1").strip().lower() not in ("0", "false", "no", "off")


class ConvertedModels:
    """The converted copies under ``<root>/models`` (root: ``HF_ACCEL_CACHE``, else ``~/.cache/hf_accel``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.directory = (Path(root) if root is not None else default_cache_dir()) / "models"

    def __repr__(self) -> str:
        return f"<ConvertedModels {self.directory}>"

    def path_for(self, gguf: Path, dtype: torch.dtype) -> Path:
        """Where the copy of ``gguf`` in ``dtype`` lies: named by the file, its place (two installs of one file
        keep a copy each), and a key of its size, modification time, the transformers version that converts it
        and this store's format (a reinstalled or edited file, another converter or another writer: a new copy)."""
        import transformers

        gguf = gguf.absolute()
        stat = gguf.stat()
        state = f"{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{FORMAT}"
        return self.directory / f"{self._prefix(gguf, dtype)}{_digest(state)}"

    def load(self, gguf: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[Any, Any] | None:
        """The model and tokenizer from the copy of ``gguf``, or None where there is no complete copy or it
        cannot be read (a warning: the caller reads the GGUF file instead)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.path_for(gguf, dtype)
        if not enabled() or not (path / COMPLETE).is_file():
            return None
        logger.info("loading %s from its converted copy %s", gguf.name, path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        except Exception as exc:  # deleted while read, damaged: the GGUF file is still there
            logger.warning("hf_accel: the converted copy %s could not be read (%s: %s); reading %s instead "
                           "(`hf-accel cache clear` deletes the copies, HF_ACCEL_CONVERTED_MODELS=0 stops using them)",
                           path, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", gguf.name)
            return None
        model.name_or_path = model.config._name_or_path = str(gguf.parent)  # as the GGUF load names it
        return model, tokenizer

    def save(self, model: Any, tokenizer: Any, gguf: Path, dtype: torch.dtype) -> Path | None:
        """Write the copy of ``gguf`` that ``model`` and ``tokenizer`` were loaded from (older copies of the same
        file and dtype are deleted); None where it is not written: a model whose weights are not plain ``dtype``
        tensors (transformers kept them quantized), too little disk, or an error (a warning: the load stands)."""
        if not enabled():
            return None
        path = self.path_for(gguf, dtype)
        tensors = list(model.state_dict().values())
        if any(not t.is_floating_point() or t.dtype != dtype for t in tensors if t.numel()):
            logger.info("hf_accel: %s loaded with weights that are not plain %s tensors: no converted copy kept",
                        gguf.name, dtype)
            return None
        size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if free < 2 * size:
                raise OSError(f"{size / 2**20:.0f} MB needed, {free / 2**20:.0f} MB free")
            self._forget_abandoned_writes()
            logger.warning("hf_accel: keeping a converted copy of %s (%.0f MB) under %s, so that later loads skip "
                           "the GGUF conversion (HF_ACCEL_CONVERTED_MODELS=0 turns this off)", gguf.name, size / 2**20,
                           self.directory)
            scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=self.directory))
            try:
                _write(model, tokenizer, scratch)
                (scratch / COMPLETE).write_text(f"converted from {gguf.absolute()}\n")
                os.replace(scratch, path)  # another process's copy already there: keep that one
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        except Exception as exc:
            if (path / COMPLETE).is_file():
                return path
            logger.warning("hf_accel: could not keep a converted copy of %s under %s (%s: %s); the next process "
                           "converts it again (set HF_ACCEL_CACHE to a writable directory with room)", gguf.name,
                           self.directory, type(exc).__name__, exc)
            return None
        for other in self.directory.glob(f"{glob.escape(self._prefix(gguf.absolute(), dtype))}*"):
            if other != path:  # the same file's copy from before it changed (or another transformers)
                shutil.rmtree(other, ignore_errors=True)
        logger.info("kept a converted copy of %s at %s", gguf.name, path)
        return path

    @staticmethod
    def _prefix(gguf: Path, dtype: torch.dtype) -> str:
        return f"{gguf.stem}-{str(dtype).removeprefix('torch.')}-{_digest(str(gguf))[:8]}-"

    def _forget_abandoned_writes(self, older_than_s: float = 3600.0) -> None:
        """Scratch directories a killed process left (a live write is minutes old at most)."""
        now = time.time()
        for scratch in self.directory.glob(".writing-*"):
            with contextlib.suppress(OSError):
                if now - scratch.stat().st_mtime > older_than_s:
                    shutil.rmtree(scratch, ignore_errors=True)

    def entries(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if (p / COMPLETE).is_file())

    def size_bytes(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())

    def clear(self) -> int:
        """Delete every copy; the bytes freed."""
        size = self.size_bytes()
        shutil.rmtree(self.directory, ignore_errors=True)
        return size - self.size_bytes()


def _write(model: Any, tokenizer: Any, directory: Path) -> None:
    """Weights (a tensor shared by two names, such as a tied head, once), config, generation config, tokenizer.

    Not ``save_pretrained``: transformers refuses to save a model its GGUF quantizer loaded."""
    from safetensors.torch import save_model

    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
