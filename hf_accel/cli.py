"""The ``hf-accel`` command: doctor, demo, generate."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from . import __version__, available_backends, check_arguments, patch, report, unpatch
from .errors import PatchError
from .models import ModelNotFoundError, default_model_file, load_default_model, load_model
from .prompts import encode_chat, load_prompts
from .timing import timed_generate


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (CLIError, ModelNotFoundError, ValueError, PatchError) as exc:
        if args.verbose:
            raise
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        more = " (more with -v)" if len(lines) > 1 else ""
        print(f"hf-accel {args.command}: error: {lines[0]}{more}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accel", description="Make Hugging Face models generate faster.")
    parser.add_argument("--version", action="version", version=f"hf_accel {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hf_accel does")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="versions, devices, and every backend with whether it can run here")
    doctor.add_argument("--model", help="a local model directory: also list the settings of its generation config "
                                        "that would make generate calls run without speculation")
    doctor.set_defaults(func=cmd_doctor)

    demo = sub.add_parser("demo", help="the default model, stock and patched, side by side")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--prompts", type=int, default=4, help="how many built-in prompts to run, one per category")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="stock, transformers-native and hf_accel configurations side by side")
    _add_model_arguments(bench)
    bench.add_argument("--prompts", help="a JSONL file of prompts (default: the shipped set, one per category)")
    bench.add_argument("--all-prompts", action="store_true", help="every shipped prompt, not one per category")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeat", type=int, default=1, help="timed runs per prompt; the median is reported")
    bench.add_argument("--configs", help="comma-separated substrings: run only configurations whose name matches")
    bench.add_argument("--quantize", default="", help="comma-separated quantize schemes to add (e.g. int8,int4)")
    bench.add_argument("--patch", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                       help="add a configuration patch(model, KEY=VALUE, ...); repeatable, e.g. speculative=self_int8")
    bench.add_argument("--generate", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                       help="generate() settings for every call, stock and patched (e.g. repetition_penalty=1.1)")
    bench.add_argument("--against", choices=["llama.cpp"], help="also run the GGUF model in llama.cpp")
    bench.add_argument("--json", help="write the rows to this JSON file")
    bench.add_argument("--plot", help="save a bar chart PNG here (needs matplotlib)")
    bench.add_argument("--cold", action="store_true",
                       help="start-up instead: a short script in fresh processes, stock and patched, with empty then "
                            "warm caches; total time, time to first token and the break-even length")
    bench.add_argument("--lengths", help="with --cold: comma-separated max_new_tokens (default 32,128,512)")
    bench.add_argument("--memory", action="store_true",
                       help="peak resident memory instead: each configuration (stock, patch(model), each --patch) "
                            "in a fresh process over the same 20 calls of mixed batch sizes and lengths")
    bench.add_argument("--processes", type=int, metavar="N",
                       help="a data-parallel job instead: examples/accelerate_generate.py on the embedded model, "
                            "stock then patched, each as N processes under torchrun; job time, throughput, identity")
    bench.add_argument("--batch-size", type=int, help="with --processes: prompts per generate call (default 2)")
    bench.add_argument("--job", help="with --processes: the job script (default: examples/ of this checkout)")
    bench.set_defaults(func=cmd_bench)

    attn = sub.add_parser("bench-attention", help="prefill attention per backend: time and extra memory")
    attn.add_argument("--lengths", default="512,2048,8192", help="comma-separated sequence lengths")
    attn.add_argument("--repeat", type=int, default=3)
    attn.add_argument("--queries", type=int, help="time a masked chunk of this many new tokens instead of prefill")
    attn.set_defaults(func=cmd_bench_attention)

    step = sub.add_parser("bench-step", help="one decode step, stock and patched: matmul vs everything else")
    _add_model_arguments(step)
    step.add_argument("--context", type=int, default=300, help="prompt length before the step")
    step.add_argument("--chunk", type=int, default=1, help="tokens per step (>1: a speculative verification)")
    step.add_argument("--steps", type=int, default=32, help="decode steps measured")
    step.add_argument("--quantize", default="", help="comma-separated quantize schemes to add")
    step.set_defaults(func=cmd_bench_step)

    identity = sub.add_parser("identity", help="how often the patched model's greedy output is stock's, token "
                                               "for token, over 54 varied prompts alone and in mixed batches")
    _add_model_arguments(identity)
    identity.add_argument("--max-new-tokens", type=int, default=64)
    identity.add_argument("--batch-size", type=int, default=4, help="rows per mixed batch (1: prompts alone only)")
    identity.add_argument("--patch", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                          help="patch() arguments (default: patch(model))")
    identity.set_defaults(func=cmd_identity)

    cache = sub.add_parser("cache", help="the compile cache: what it holds (info), or empty it (clear)")
    cache.add_argument("action", choices=["info", "clear"])
    cache.add_argument("--dir", help="the cache directory (default: HF_ACCEL_CACHE, else ~/.cache/hf_accel)")
    cache.set_defaults(func=cmd_cache)

    gen = sub.add_parser("generate", help="generate from one prompt, then print tokens/s and the report")
    gen.add_argument("--prompt", required=True)
    _add_model_arguments(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--no-patch", action="store_true", help="run stock transformers")
    for feature, default in (("attention", "auto"), ("kv-cache", "auto"), ("compile", "auto"),
                             ("speculative", "auto"), ("quantize", "none")):
        gen.add_argument(f"--{feature}", default=default, help=f"backend name, auto or none (default {default})")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.set_defaults(func=cmd_generate)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local model directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--gguf-file", help="the GGUF file inside --model")


def _gguf_path(args: argparse.Namespace) -> Path:
    if importlib.util.find_spec("llama_cpp") is None:
        raise CLIError("--against llama.cpp needs llama-cpp-python: pip install llama-cpp-python")
    if args.model is None:
        return default_model_file()
    path = Path(args.model) / args.gguf_file if args.gguf_file else Path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise CLIError(f"--against llama.cpp needs a GGUF model; {path} is not a .gguf file")
    return path


def _load(args: argparse.Namespace):
    if args.model is None:
        return load_default_model()
    return load_model(args.model, gguf_file=args.gguf_file)


def cmd_doctor(args: argparse.Namespace) -> int:
    import transformers

    print(f"hf_accel {__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}")
    devices = ["cpu"] + [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    print(f"devices: {', '.join(devices)}   threads: {torch.get_num_threads()}")
    from .compile_cache import CompileStore

    store = CompileStore()
    print(f"compile cache: {store.directory} ({len(store.entries())} compiled shapes; `hf-accel cache info`)")
    rows = [("feature", "backend", "plugin", "available", "why not")]
    rows += [(b.feature, b.name, b.plugin, "yes" if b.available else "no", b.reason) for b in available_backends()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if args.model:
        _print_speculation_blockers(args.model)
    return 0


def _print_speculation_blockers(model_dir: str) -> None:
    from transformers import GenerationConfig

    from .speculative_settings import blocking_settings

    try:
        config = GenerationConfig.from_pretrained(model_dir)
    except OSError as exc:
        raise CLIError(f"--model {model_dir}: no generation config to read ({exc})") from None
    blocking = blocking_settings(config)
    if not blocking:
        print(f"{model_dir}: its generation config leaves speculative decoding on for every call")
        return
    print(f"{model_dir}: these settings of its generation config make generate run without speculation "
          "(stock generate, with the patch's cache and compiled step):")
    for setting in blocking:
        print(f"  {setting}")


def cmd_demo(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    if args.max_new_tokens < 1 or args.prompts < 1:
        raise CLIError("--max-new-tokens and --prompts must be at least 1")
    print("Loading the default model (SmolLM2-135M-Instruct, fp32)...")
    model, tokenizer = load_default_model()
    prompts = _one_per_category(load_prompts())[: args.prompts]
    encoded = [encode_chat(tokenizer, p.prompt) for p in prompts]
    timed_generate(model, encoded[0], 4)  # warm-up, so the first timed call is not charged for it
    stock = [timed_generate(model, e, args.max_new_tokens) for e in tqdm(encoded, desc="stock generate")]
    patch(model)
    # A whole call on the longest prompt: the patch's fixed-length caches are sized for every prompt here.
    # The default compile policy runs these first calls eagerly (compiling would not pay for itself yet).
    print("Warming up the patched model (one call)...")
    timed_generate(model, max(encoded, key=lambda e: e["input_ids"].shape[-1]), args.max_new_tokens)
    patched = [timed_generate(model, e, args.max_new_tokens) for e in tqdm(encoded, desc="patched generate")]

    rows = [("prompt", "stock tok/s", "patched tok/s", "speedup", "identical")]
    for prompt, s, p in zip(prompts, stock, patched):
        same = torch.equal(s.tokens, p.tokens)
        rows.append((f"{prompt.category}/{prompt.name}", f"{s.tokens_per_s:.1f}", f"{p.tokens_per_s:.1f}",
                     f"{p.tokens_per_s / s.tokens_per_s:.2f}x", "yes" if same else "NO"))
        print(f"\n=== {prompt.category}/{prompt.name}: {prompt.prompt[:70]!r}...")
        print(f"--- stock:\n{tokenizer.decode(s.tokens[0], skip_special_tokens=True)}")
        if not same:
            print(f"--- patched:\n{tokenizer.decode(p.tokens[0], skip_special_tokens=True)}")
    print()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"\n{report(model)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bench import default_configs, format_table, plot, run_bench, summary_table, write_json

    if args.processes is not None:
        return _bench_processes(args)
    if args.batch_size is not None or args.job is not None:
        raise CLIError("--batch-size and --job go with --processes N")
    if args.cold:
        return _bench_cold(args)
    if args.memory:
        return _bench_memory(args)
    if args.max_new_tokens < 1 or args.repeat < 1:
        raise CLIError("--max-new-tokens and --repeat must be at least 1")
    prompts = load_prompts(args.prompts)
    if args.prompts is None and not args.all_prompts:
        prompts = _one_per_category(prompts)
    available = {b.feature for b in available_backends() if b.available}
    quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if quantize and "quantize" not in available:
        raise CLIError("--quantize: no quantize backend can run here (see `hf-accel doctor`)")
    for scheme in quantize:
        check_arguments(quantize=scheme)
    configs = default_configs(available, quantize) + [_patch_config(text) for text in args.patch]
    if args.generate:
        settings = _key_values(args.generate, "--generate")
        configs = [dataclasses.replace(c, generate_kwargs={**c.generate_kwargs, **settings}) for c in configs]
    if args.configs:
        wanted = [w.strip() for w in args.configs.split(",")]
        configs = [c for c in configs if c.group == "stock" or any(w in c.name for w in wanted)]
    gguf = _gguf_path(args) if args.against else None
    model, tokenizer = _load(args)
    bar = tqdm(total=(len(configs) + bool(gguf)) * len(prompts), desc="bench", unit="run")

    def progress(label: str) -> None:
        bar.set_postfix_str(label[:60])
        bar.update(1)

    rows = run_bench(model, tokenizer, prompts, configs, args.max_new_tokens, args.repeat, progress, gguf)
    bar.close()
    print(f"\n{summary_table(rows)}\n\n{format_table(rows)}")
    if args.json:
        write_json(rows, args.json)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _fresh_process_setup(args: argparse.Namespace) -> tuple[list[Any], str, str | None]:
    """The configurations (stock, patch(model), each --patch) and the model a fresh-process bench loads."""
    from .bench_cold import ColdConfig

    configs = [ColdConfig("stock", None), ColdConfig("patch(model)", {})]
    configs += [ColdConfig(c.name.removeprefix("hf_accel "), c.patch_kwargs) for c in map(_patch_config, args.patch)]
    if args.model is None:
        gguf = default_model_file()
        return configs, str(gguf.parent), gguf.name
    path = Path(args.model)
    model_dir, gguf_file = (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), args.gguf_file)
    return configs, model_dir, gguf_file


def _bench_memory(args: argparse.Namespace) -> int:
    import json

    from tqdm.auto import tqdm

    from .bench_memory import MIXED_CALLS, format_memory_table, memory_rows, run_memory_bench

    configs, model_dir, gguf_file = _fresh_process_setup(args)
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


def _bench_processes(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bench_processes import (EXAMPLE_JOB, LaunchError, format_processes_table, run_processes_bench,
                                  write_processes_json)

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
    job = Path(args.job) if args.job else EXAMPLE_JOB
    if not job.is_file():
        raise CLIError(f"no job at {job}: bench --processes runs examples/accelerate_generate.py from a checkout "
                       "of hf_accel; pass --job PATH to a copy of it")
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


def _bench_cold(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bench_cold import (format_break_even, format_calls_table, format_cold_table, run_calls_bench, run_cold_bench,
                             write_cold_json)

    try:
        lengths = [int(n) for n in (args.lengths or "32,128,512").split(",")]
    except ValueError:
        raise CLIError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if len(lengths) < 2 or min(lengths) < 1:
        raise CLIError("--lengths needs at least two lengths, each at least 1 (the break-even is a fitted line)")
    configs, model_dir, gguf_file = _fresh_process_setup(args)
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
    from .bench_attention import bench_attention, format_attention_table

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise CLIError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if args.repeat < 1 or any(n < 1 for n in lengths):
        raise CLIError("--repeat and every length must be at least 1")
    print(format_attention_table(bench_attention(lengths, repeat=args.repeat, queries=args.queries)))
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    from .bench_step import format_step_table, memory_read_gb_s, profile_generate_step, profile_step

    if min(args.context, args.chunk, args.steps) < 1:
        raise CLIError("--context, --chunk and --steps must be at least 1")
    schemes = [q.strip() for q in args.quantize.split(",") if q.strip()]
    for scheme in schemes:
        check_arguments(quantize=scheme)
    model, _ = _load(args)
    if args.chunk == 1:  # a decode step inside generate, where a compiled step runs
        measure = lambda name: profile_generate_step(model, name, args.context, args.steps)  # noqa: E731
    else:  # a verification chunk, as the speculative loop runs it (eager)
        measure = lambda name: profile_step(model, name, args.context, args.chunk, args.steps)  # noqa: E731
    rows = [measure("stock")]
    off = {"attention": None, "kv_cache": None, "speculative": None}
    configs = [("hf_accel kv_cache only (eager)", {**off, "compile": None, "kv_cache": "auto"}),
               ("hf_accel compile=onednn_prepack (eager)", {**off, "compile": "onednn_prepack"}),
               ("hf_accel kv_cache + compile", {**off, "kv_cache": "auto", "compile": "auto"}),
               ("hf_accel patch(model) without speculation", {"speculative": None})]
    configs += [(f"hf_accel quantize={q} + kv_cache + compile", {"quantize": q, "speculative": None,
                                                                  "keep_original": True}) for q in schemes]
    from .bench import compile_at_once

    for name, kwargs in configs:
        patch(model, **{**compile_at_once(), **kwargs})  # a compiled step measures compiled, not waiting to be
        try:
            row = measure(name)
            row.compile_s = report(model)["compile"].details.get("compile_seconds")
            rows.append(row)
        finally:
            unpatch(model)
    print(format_step_table(rows, memory_read_gb_s()))
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bench_identity import identity_prompts, run_identity

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise CLIError("--max-new-tokens and --batch-size must be at least 1")
    kwargs = _patch_config(args.patch).patch_kwargs if args.patch else {}
    model, tokenizer = _load(args)
    prompts = identity_prompts()
    result = run_identity(model, tokenizer, prompts, lambda m: patch(m, **kwargs), args.max_new_tokens,
                          args.batch_size, progress=lambda items, desc: tqdm(items, desc=desc))
    print(f"greedy identity of patch(model{', ' + args.patch if args.patch else ''}) with stock generate, "
          f"{args.max_new_tokens} new tokens, {len(prompts)} prompts alone and in mixed batches of {args.batch_size}:")
    print(result.table())
    print(f"\n{report(model)}")  # what ran: which backends, compiled or eager steps
    return 0


def _patch_config(text: str):
    """``--patch speculative=self_int8,compile=none`` as a bench configuration, checked before any loading."""
    from .bench import BenchConfig

    kwargs = _key_values(text, "--patch")
    check_arguments(**kwargs)
    return BenchConfig(f"hf_accel patch({text})", "hf_accel", patch_kwargs=kwargs)


def _key_values(text: str, flag: str) -> dict:
    """``a=1,b=x`` as ``{"a": 1, "b": "x"}``."""
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"{flag} expects KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = _option_value(value.strip())
    return pairs


def _option_value(text: str):
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


def _one_per_category(prompts):
    firsts = {}
    for prompt in prompts:
        firsts.setdefault(prompt.category, prompt)
    return list(firsts.values())


def cmd_cache(args: argparse.Namespace) -> int:
    from .compile_cache import CompileStore

    store = CompileStore(args.dir)
    if args.action == "clear":
        freed = store.clear()
        print(f"emptied {store.directory} ({freed / 2**20:.1f} MB freed)")
        return 0
    entries = store.entries()
    print(f"hf_accel compile cache: {store.directory}  ({len(entries)} entries, {store.size_bytes() / 2**20:.1f} MB)")
    rows = [("model (its Linear layers)", "compiled shape class", "cold s", "warm s", "created")]
    rows += [(e.model, e.shape, _seconds(e.cold_seconds), _seconds(e.warm_seconds), e.created) for e in entries]
    if entries:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"compiled code: {store.inductor_directory} (inductor's cache, used for hf_accel's compiles only)")
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    choices = {f: getattr(args, f) for f in ("attention", "kv_cache", "compile", "speculative", "quantize")}
    choices = {f: None if value.lower() == "none" else value for f, value in choices.items()}
    check_arguments(**choices)
    model, tokenizer = _load(args)
    if not args.no_patch:
        patch(model, **choices)
    inputs = encode_chat(tokenizer, args.prompt, model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    result = timed_generate(model, inputs, args.max_new_tokens, streamer=streamer)
    if streamer is None:
        print(tokenizer.decode(result.tokens[0], skip_special_tokens=True))
    print(f"\n{result.tokens.shape[-1]} tokens in {result.seconds:.2f} s: {result.tokens_per_s:.1f} tokens/s")
    if not args.no_patch:
        print(report(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
