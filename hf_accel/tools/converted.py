"""Converted copies of GGUF models, so that a GGUF file is dequantized once per machine, not once per process.

transformers reads a GGUF file slowly: SmolLM2-135M's 90 MB take ~28-34 s on one thread of this project's
2-core machine (its reader parses the file's fields twice and rebuilds a tensor-name map for every tensor), where
the same weights as safetensors load in under a second. Every ``hf-accel demo``, every bench in fresh processes
and every test process that loads the embedded model paid it. The first load of a GGUF file now writes what it
produced (weights as safetensors, config, generation config, tokenizer) under
``<HF_ACCEL_CACHE>/models/``; later loads of the same file, dtype and transformers version read that copy: the
same tensors, config (its GGUF quantization entry included) and tokenizer. ``hf-accel cache info`` shows the
copies, ``hf-accel cache clear`` deletes them; ``HF_ACCEL_CONVERTED_MODELS=0`` turns the copies off.

Example::

    >>> store = ConvertedModels()
    >>> store.load(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), torch.float32)  # None until one was saved
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hf_accel.runtime.compile_cache import default_cache_dir

logger = logging.getLogger(__name__)

#: Written last into a copy's directory: a copy without it is incomplete and never read.
COMPLETE = "hf_accel_converted.txt"


def enabled() -> bool:
    return os.environ.get("HF_ACCEL_CONVERTED_MODELS", "1").strip().lower() not in ("0", "false", "no", "off")


class ConvertedModels:
    """The converted copies under ``<root>/models`` (root: ``HF_ACCEL_CACHE``, else ``~/.cache/hf_accel``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.directory = (Path(root) if root is not None else default_cache_dir()) / "models"

    def __repr__(self) -> str:
        return f"<ConvertedModels {self.directory}>"

    def path_for(self, gguf: Path, dtype: torch.dtype) -> Path:
        """Where the copy of ``gguf`` in ``dtype`` lies: named by the file, and keyed by its place, size and
        modification time and the transformers version that converts it (a reinstalled or edited file, or
        another converter, makes a new copy)."""
        import transformers

        gguf = gguf.resolve()
        stat = gguf.stat()
        key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.directory / f"{gguf.stem}-{str(dtype).removeprefix('torch.')}-{digest}"

    def load(self, gguf: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[Any, Any] | None:
        """The model and tokenizer from the copy of ``gguf``, or None where there is no complete copy."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.path_for(gguf, dtype)
        if not enabled() or not (path / COMPLETE).is_file():
            return None
        logger.info("loading %s from its converted copy %s", gguf.name, path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        model.name_or_path = model.config._name_or_path = str(gguf.parent)  # as the GGUF load names it
        return model, tokenizer

    def save(self, model: Any, tokenizer: Any, gguf: Path, dtype: torch.dtype) -> Path | None:
        """Write the copy of ``gguf`` that ``model`` and ``tokenizer`` were loaded from (others of the same file
        and dtype are deleted); None, with a warning, where it cannot be written (the load itself stands)."""
        if not enabled():
            return None
        path = self.path_for(gguf, dtype)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=self.directory))
            try:
                _write(model, tokenizer, scratch)
                (scratch / COMPLETE).write_text(f"converted from {gguf.resolve()}\n")
                os.replace(scratch, path)  # another process's copy already there: keep that one
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        except OSError as exc:
            if (path / COMPLETE).is_file():
                return path
            logger.warning("hf_accel: could not keep a converted copy of %s under %s (%s); the next process "
                           "converts it again (set HF_ACCEL_CACHE to a writable directory)", gguf.name,
                           self.directory, exc)
            return None
        for other in self.directory.glob(f"{gguf.stem}-{str(dtype).removeprefix('torch.')}-*"):
            if other != path:
                shutil.rmtree(other, ignore_errors=True)
        logger.info("kept a converted copy of %s at %s", gguf.name, path)
        return path

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
