"""What the ``hf-accel`` command's subcommands share: the one-line error, the model they load, and the line that
says which machine a table was measured on."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
from pathlib import Path

import torch

from hf_accel.tools.models import default_model_file, load_default_model, load_model


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def error_lines(exc: BaseException) -> list[str]:
    """An error's message as lines (its type's name where it has none): the first is what a table or a one-line
    error shows."""
    return str(exc).strip().splitlines() or [type(exc).__name__]


def machine_line() -> str:
    """The machine a measurement ran on, in one line: CPU, usable CPUs, torch's threads (this process's), the
    vector instructions its CPU kernels use, GPUs, library versions. This project's cloud VMs are AVX-512 on some
    days and AVX2 on others, and the same code has measured up to ~1.9x apart on them (patch(model), int4
    steps), so every table says which it was.

    Example::

        >>> machine_line()  # doctest: +SKIP
        'machine: AMD EPYC, 2 CPUs, 2 torch threads, CPU kernels AVX2, torch 2.13.0+cpu, transformers 5.24.0'
    """
    import transformers

    try:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a CUDA that fails to initialise must not cost the table printed before this line
        gpus = [f"CUDA unreadable ({type(exc).__name__})"]
    flags = cpu_flags()
    parts = [cpu_name(), f"{usable_cpus()} CPUs", f"{torch.get_num_threads()} torch threads",
             f"CPU kernels {torch.backends.cpu.get_cpu_capability()}"
             + (f" ({' '.join(flags)})" if flags else ""), *gpus,
             f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    return "machine: " + ", ".join(parts)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: CPU flags that set this machine's kernels apart (oneDNN, inductor and llama.cpp use them where torch's own
#: capability level says only AVX2 or AVX512).
NOTABLE_FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of :data:`NOTABLE_FLAGS` the CPU has, from ``/proc/cpuinfo`` (none known elsewhere)."""
    present = set(_cpuinfo("flags").split())
    return [flag for flag in NOTABLE_FLAGS if flag in present]


def cpu_name() -> str:
    """The CPU's model name as the OS reports it (``/proc/cpuinfo`` on Linux)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def _cpuinfo(field: str) -> str:
    """The first CPU's ``field`` in ``/proc/cpuinfo``; empty where there is none (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local model directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--gguf-file", help="the GGUF file inside --model")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the weights' dtype")
    parser.add_argument("--random-weights", action="store_true",
                        help="the model's architecture with seeded random weights (a directory needs only its config "
                             "and tokenizer): speed and identity where the weights are not at hand; what speculation "
                             "accepts then says nothing about the real model")


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
    """The model and tokenizer ``--model``/``--gguf-file`` name, else the embedded default, on ``--device`` in
    ``--dtype``, with random weights if ``--random-weights``."""
    device = args.device
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise CLIError(f"--device {device!r} is not a device: pass cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: this PyTorch sees no CUDA device; pass --device cpu")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise CLIError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                       f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    settings = {"dtype": DTYPES[args.dtype], "device": device, "random_weights": args.random_weights}
    if args.model is None:
        return load_default_model(**settings)
    return load_model(args.model, gguf_file=args.gguf_file, **settings)


def only_default_model_settings(args: argparse.Namespace, mode: str) -> None:
    """Refuse ``--device``/``--dtype``/``--random-weights`` where ``mode`` loads the model in fresh processes."""
    if args.device != "cpu" or args.dtype != "float32" or args.random_weights:
        raise CLIError(f"--device, --dtype and --random-weights apply to the steady-state bench, not to {mode}; "
                       "leave them out")
