"""The ``hf-accel bench``, ``bench-attention``, ``bench-step`` and ``identity`` commands: arguments checked,
then the runs of :mod:`hf_accel.tools.bench`, printed as tables."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from hf_accel import BackendUnavailableError, available_backends, check_arguments, patch, report, unpatch
from hf_accel.tools.common import CLIError, gguf_path, load_from_args, machine_line, only_default_model_settings
from hf_accel.tools.models import default_model_file
from hf_accel.tools.prompts import load_prompts, one_per_category


def cmd_bench(args: argparse.Namespace) -> int:
    status = run_bench_command(args)
    print(f"\n{machine_line()}")
    return status


def run_bench_command(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_accel.tools.bench.steady import GenerateSet, default_configs, run_bench
    from hf_accel.tools.bench.tables import format_table, plot, summary_table, write_json

    for flag, mode in ((args.processes is not None, "--processes"), (args.cold, "--cold"), (args.memory, "--memory")):
        if flag:
            only_default_model_settings(args, mode)
    if args.processes is not None:
        return bench_processes(args)
    if args.batch_size is not None or args.job is not None:
        raise CLIError("--batch-size and --job go with --processes N")
    if args.cold:
        return bench_cold(args)
    if args.memory:
        return bench_memory(args)
    if args.max_new_tokens < 1 or args.repeat < 1:
        raise CLIError("--max-new-tokens and --repeat must be at least 1")
    prompts = load_prompts(args.prompts)
    if args.prompts is None and not args.all_prompts:
        prompts = one_per_category(prompts)
    available = {b.feature for b in available_backends() if b.available}
    quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if quantize and "quantize" not in available:
        raise CLIError("--quantize: no quantize backend can run here (see `hf-accel doctor`)")
    for scheme in quantize:
        check_arguments(quantize=scheme)
    configs = default_configs(available, quantize) + [patch_config(text) for text in args.patch]
    generate_sets = [GenerateSet(text.strip(), key_values(text, "--generate") if text.strip() else {})
                     for text in args.generate]
    for i, each in enumerate(generate_sets):
        if any(each.kwargs == earlier.kwargs for earlier in generate_sets[:i]):
            raise CLIError(f"--generate {each.label!r} asks for the same settings as an earlier --generate: "
                           "give each set once")
    if args.configs:
        wanted = [w.strip() for w in args.configs.split(",")]
        configs = [c for c in configs if c.group == "stock" or any(w in c.name for w in wanted)]
    if args.against and args.random_weights:
        raise CLIError("--against llama.cpp runs the GGUF's real weights: it cannot be set against --random-weights")
    if args.against and any(each.kwargs for each in generate_sets):
        raise CLIError("--against llama.cpp takes no --generate settings: llama.cpp's calls would not get them")
    gguf = gguf_path(args) if args.against else None
    model, tokenizer = load_from_args(args)
    bar = tqdm(total=(len(configs) + bool(gguf)) * len(prompts), desc="bench", unit="run")

    def progress(label: str) -> None:
        bar.set_postfix_str(label[:60])
        bar.update(1)

    rows = run_bench(model, tokenizer, prompts, configs, args.max_new_tokens, args.repeat, progress, gguf,
                     perplexity=not args.random_weights, generate_sets=generate_sets)
    bar.close()
    print(f"\n{summary_table(rows)}\n\n{format_table(rows)}")
    if args.json:
        write_json(rows, args.json, machine_line())
    if args.plot:
        plot(rows, args.plot)
    return 0


def fresh_process_setup(args: argparse.Namespace) -> tuple[list[Any], str, str | None]:
    """The configurations (stock, patch(model), each --patch) and the model a fresh-process bench loads."""
    from hf_accel.tools.bench.cold import ColdConfig

    configs = [ColdConfig("stock", None), ColdConfig("patch(model)", {})]
    configs += [ColdConfig(c.name.removeprefix("hf_accel "), c.patch_kwargs) for c in map(patch_config, args.patch)]
    if args.model is None:
        gguf = default_model_file()
        return configs, str(gguf.parent), gguf.name
    path = Path(args.model)
    model_dir, gguf_file = (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), args.gguf_file)
    return configs, model_dir, gguf_file


def bench_memory(args: argparse.Namespace) -> int:
    import json

    from tqdm.auto import tqdm

    from hf_accel.tools.bench.memory import MIXED_CALLS, format_memory_table, memory_rows, run_memory_bench

    configs, model_dir, gguf_file = fresh_process_setup(args)
    prompts = [p.prompt for p in load_prompts(args.prompts)]
    bar = tqdm(total=len(configs), desc="bench --memory", unit="process")

    def progress(label: str) -> None:
        bar.set_postfix_str(label[:60])
        bar.update(1)

    with tempfile.TemporaryDirectory(prefix="hf_accel_memory_") as scratch:
        runs = run_memory_bench(model_dir, gguf_file, prompts, configs, scratch, progress=progress)
    bar.close()
    print(f"\nPeak resident memory, each configuration in a fresh process, over the same {len(MIXED_CALLS)} "
          f"calls (batch sizes 1-4, 32-128 new tokens):\n\n{format_memory_table(runs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(memory_rows(runs), indent=2))
    return 0


def bench_processes(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_accel.tools.bench.processes import (
        EXAMPLE_JOB,
        LaunchError,
        format_processes_table,
        run_processes_bench,
        write_processes_json,
    )

    batch_size = 2 if args.batch_size is None else args.batch_size
    if min(args.processes, batch_size, args.max_new_tokens, args.repeat) < 1:
        raise CLIError("--processes, --batch-size, --max-new-tokens and --repeat must be at least 1")
    if args.model is not None or args.gguf_file is not None:
        raise CLIError("--processes runs examples/accelerate_generate.py, which loads the embedded model; "
                       "drop --model/--gguf-file, or edit the job's load() for yours and pass it with --job")
    ignored = [flag for flag, given in [("--cold", args.cold), ("--memory", args.memory), ("--patch", args.patch),
                                        ("--lengths", args.lengths),
                                        ("--quantize", args.quantize), ("--configs", args.configs),
                                        ("--generate", args.generate), ("--all-prompts", args.all_prompts),
                                        ("--against", args.against), ("--plot", args.plot)] if given]
    if ignored:
        raise CLIError(f"--processes runs the job as it is, stock and patch(model); it takes no {', '.join(ignored)}")
    load_prompts(args.prompts)  # a bad file is reported now, not after N processes have loaded the model
    job = Path(args.job) if args.job else EXAMPLE_JOB  # the runner refuses a missing one before any launch
    if torch.cuda.is_available() and args.processes > torch.cuda.device_count():
        raise CLIError(f"--processes {args.processes}: torchrun gives each process a GPU of its own, and this machine "
                       f"has {torch.cuda.device_count()}")
    flags = ["--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(batch_size)]
    if args.prompts:
        flags += ["--prompts", args.prompts]
    bar = tqdm(total=2 * args.repeat, desc=f"bench --processes {args.processes}", unit="job")

    def progress(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)

    with tempfile.TemporaryDirectory(prefix="hf_accel_processes_") as scratch:
        try:
            runs = run_processes_bench(args.processes, flags, scratch, args.repeat, job, progress)
        except (FileNotFoundError, LaunchError) as exc:
            raise CLIError(str(exc)) from None
    bar.close()
    print(f"\nThe job stock and patched, {args.processes} processes each (torchrun), medians of {args.repeat} "
          f"launch(es):\n\n{format_processes_table(runs)}")
    if args.json:
        write_processes_json(runs, args.json)
    return 0


def bench_cold(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_accel.tools.bench.cold import (
        format_break_even,
        format_calls_table,
        format_cold_table,
        run_calls_bench,
        run_cold_bench,
        write_cold_json,
    )

    try:
        lengths = [int(n) for n in (args.lengths or "32,128,512").split(",")]
    except ValueError:
        raise CLIError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if len(lengths) < 2 or min(lengths) < 1:
        raise CLIError("--lengths needs at least two lengths, each at least 1 (the break-even is a fitted line)")
    configs, model_dir, gguf_file = fresh_process_setup(args)
    prompts = load_prompts(args.prompts)
    bar = tqdm(total=len(configs) * (1 + 2 * len(lengths)) + 2, desc="bench --cold", unit="process")

    def progress(label: str) -> None:
        bar.set_postfix_str(label[:60])
        bar.update(1)

    with tempfile.TemporaryDirectory(prefix="hf_accel_cold_") as scratch:
        runs = run_cold_bench(model_dir, gguf_file, prompts[0].prompt, lengths, configs, scratch, progress)
        pairs = run_calls_bench(model_dir, gguf_file, [p.prompt for p in prompts], configs[1].patch, scratch,
                                progress=progress)
    bar.close()
    print(f"\nA short script, in fresh processes (prompt {prompts[0].category}:{prompts[0].name}):\n\n"
          f"{format_cold_table(runs)}\n\n{format_break_even(runs)}\n\n"
          f"Calls with new shapes in one long-running process, stock then {configs[1].name}:\n\n"
          f"{format_calls_table(pairs)}")
    if args.json:
        write_cold_json(runs, pairs, args.json)
    return 0


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from hf_accel.tools.bench.attention import bench_attention, format_attention_table

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise CLIError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if args.repeat < 1 or any(n < 1 for n in lengths):
        raise CLIError("--repeat and every length must be at least 1")
    print(format_attention_table(bench_attention(lengths, repeat=args.repeat, queries=args.queries)))
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    from hf_accel.tools.bench.step import format_step_table, memory_read_gb_s, profile_generate_step, profile_step

    if min(args.context, args.chunk, args.steps) < 1:
        raise CLIError("--context, --chunk and --steps must be at least 1")
    if args.device != "cpu":
        raise CLIError(f"--device {args.device}: bench-step profiles CPU kernels; time a GPU with hf-accel bench")
    schemes = [q.strip() for q in args.quantize.split(",") if q.strip()]
    for scheme in schemes:
        check_arguments(quantize=scheme)
    model, _ = load_from_args(args)
    if args.chunk == 1:  # a decode step inside generate, where a compiled step runs
        measure = lambda name: profile_generate_step(model, name, args.context, args.steps)
    else:  # a verification chunk, as the speculative loop runs it (eager)
        measure = lambda name: profile_step(model, name, args.context, args.chunk, args.steps)
    rows = [measure("stock")]
    off = {"attention": None, "kv_cache": None, "speculative": None}
    configs = [("hf_accel kv_cache only (eager)", {**off, "compile": None, "kv_cache": "auto"})]
    # Each compile backend alone, where it serves a model without the static cache (one that only repacks
    # weights runs eagerly), then what auto chooses with the cache.
    configs += [(f"hf_accel compile={b.name} alone", {**off, "compile": b.name})
                for b in available_backends() if b.feature == "compile" and b.available]
    configs += [("hf_accel kv_cache + compile", {**off, "kv_cache": "auto", "compile": "auto"}),
                ("hf_accel patch(model) without speculation", {"speculative": None})]
    configs += [(f"hf_accel quantize={q} + kv_cache + compile", {"quantize": q, "speculative": None,
                                                                  "keep_original": True}) for q in schemes]
    from hf_accel.tools.bench.steady import compile_at_once

    for name, kwargs in configs:
        try:
            patch(model, **{**compile_at_once(), **kwargs})  # a compiled step measures compiled, not waiting to be
        except BackendUnavailableError as exc:  # a compile backend that needs the static cache, asked alone
            print(f"{name}: skipped: {str(exc).splitlines()[0]}")
            continue
        try:
            row = measure(name)
            row.compile_s = report(model)["compile"].details.get("compile_seconds")
            rows.append(row)
        finally:
            unpatch(model)
    print(format_step_table(rows, memory_read_gb_s()))
    print(machine_line())
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_accel.tools.bench.identity import identity_prompts, run_identity

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise CLIError("--max-new-tokens and --batch-size must be at least 1")
    kwargs = patch_config(args.patch).patch_kwargs if args.patch else {}
    model, tokenizer = load_from_args(args)
    prompts = identity_prompts()
    result = run_identity(model, tokenizer, prompts, lambda m: patch(m, **kwargs), args.max_new_tokens,
                          args.batch_size, progress=lambda items, desc: tqdm(items, desc=desc))
    print(f"greedy identity of patch(model{', ' + args.patch if args.patch else ''}) with stock generate, "
          f"{args.max_new_tokens} new tokens, {len(prompts)} prompts alone and in mixed batches of {args.batch_size}:")
    print(result.table())
    print(f"\n{report(model)}")  # what ran: which backends, compiled or eager steps
    return 0


def patch_config(text: str):
    """``--patch speculative=self_int8,compile=none`` as a bench configuration, checked before any loading."""
    from hf_accel.tools.bench.steady import BenchConfig

    kwargs = key_values(text, "--patch")
    check_arguments(**kwargs)
    return BenchConfig(f"hf_accel patch({text})", "hf_accel", patch_kwargs=kwargs)


def key_values(text: str, flag: str) -> dict:
    """``a=1,b=x`` as ``{"a": 1, "b": "x"}``."""
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"{flag} expects KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = option_value(value.strip())
    return pairs


def option_value(text: str):
    """``none`` -> None, ``true``/``false`` -> bool, ``16`` -> int, ``1.1`` -> float, anything else a string."""
    words = {"none": None, "true": True, "false": False}
    if text.lower() in words:
        return words[text.lower()]
    if text.isdigit():
        return int(text)
    try:
        return float(text) if any(c.isdigit() for c in text) else text
    except ValueError:
        return text
