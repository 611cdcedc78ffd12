"""What the ``hf-accel`` command's subcommands share: the one-line error, and the model they load."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from hf_accel.tools.models import default_model_file, load_default_model, load_model


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local model directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--gguf-file", help="the GGUF file inside --model")


def gguf_path(args: argparse.Namespace) -> Path:
    if importlib.util.find_spec("llama_cpp") is None:
        raise CLIError("--against llama.cpp needs llama-cpp-python: pip install llama-cpp-python")
    if args.model is None:
        return default_model_file()
    path = Path(args.model) / args.gguf_file if args.gguf_file else Path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise CLIError(f"--against llama.cpp needs a GGUF model; {path} is not a .gguf file")
    return path


def load_from_args(args: argparse.Namespace):
    """The model and tokenizer ``--model``/``--gguf-file`` name, else the embedded default."""
    if args.model is None:
        return load_default_model()
    return load_model(args.model, gguf_file=args.gguf_file)
