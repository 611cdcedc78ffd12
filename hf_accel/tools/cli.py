"""The ``hf-accel`` command: doctor, plugins, demo, generate."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from hf_accel import __version__, available_backends, check_arguments, patch, report
from hf_accel.patching.errors import PatchError
from hf_accel.patching.plugin_manager import plugin_problems
from hf_accel.tools.bench.commands import cmd_bench, cmd_bench_attention, cmd_bench_step, cmd_identity
from hf_accel.tools.common import (
    CLIError,
    add_model_arguments,
    cpu_flags,
    cpu_name,
    error_lines,
    load_from_args,
    usable_cpus,
)
from hf_accel.tools.models import ModelNotFoundError, load_default_model
from hf_accel.tools.plugins import cmd_plugins
from hf_accel.tools.prompts import encode_chat, load_prompts, one_per_category
from hf_accel.tools.timing import timed_generate


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (CLIError, ModelNotFoundError, ValueError, PatchError) as exc:
        if args.verbose:
            raise
        lines = error_lines(exc)
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

    plugins = sub.add_parser("plugins", help="each loaded plugin: its distribution, backends and hooks; the plugins "
                                             "skipped because they failed; the environment's filters")
    plugins.add_argument("--json", action="store_true", help="print it as JSON")
    plugins.set_defaults(func=cmd_plugins)

    demo = sub.add_parser("demo", help="the default model, stock and patched, side by side")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--prompts", type=int, default=4, help="how many built-in prompts to run, one per category")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="stock, transformers-native and hf_accel configurations side by side")
    add_model_arguments(bench)
    bench.add_argument("--prompts", help="a JSONL file of prompts (default: the shipped set, one per category)")
    bench.add_argument("--all-prompts", action="store_true", help="every shipped prompt, not one per category")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeat", type=int, default=1, help="timed runs per prompt; the median is reported")
    bench.add_argument("--configs", help="comma-separated substrings: run only configurations whose name matches")
    bench.add_argument("--quantize", default="", help="comma-separated quantize schemes to add (e.g. int8,int4)")
    bench.add_argument("--patch", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                       help="add a configuration patch(model, KEY=VALUE, ...); repeatable, e.g. speculative=self_int8")
    bench.add_argument("--generate", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                       help="generate() settings for every call, stock and patched (e.g. repetition_penalty=1.1; "
                            "'' for none). Repeatable: each prompt then runs under every set in turn, and the summary "
                            "gives the share of the first set's speedup over stock that each set keeps")
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
    add_model_arguments(step)
    step.add_argument("--context", type=int, default=300, help="prompt length before the step")
    step.add_argument("--chunk", type=int, default=1, help="tokens per step (>1: a speculative verification)")
    step.add_argument("--steps", type=int, default=32, help="decode steps measured")
    step.add_argument("--quantize", default="", help="comma-separated quantize schemes to add")
    step.set_defaults(func=cmd_bench_step)

    identity = sub.add_parser("identity", help="how often the patched model's greedy output is stock's, token "
                                               "for token, over 54 varied prompts alone and in mixed batches")
    add_model_arguments(identity)
    identity.add_argument("--max-new-tokens", type=int, default=64)
    identity.add_argument("--batch-size", type=int, default=4, help="rows per mixed batch (1: prompts alone only)")
    identity.add_argument("--patch", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                          help="patch() arguments (default: patch(model))")
    identity.set_defaults(func=cmd_identity)

    cache = sub.add_parser("cache", help="the compile cache and converted GGUF models: what they hold (info), "
                                          "or empty them (clear)")
    cache.add_argument("action", choices=["info", "clear"])
    cache.add_argument("--dir", help="the cache directory (default: HF_ACCEL_CACHE, else ~/.cache/hf_accel)")
    cache.set_defaults(func=cmd_cache)

    gen = sub.add_parser("generate", help="generate from one prompt, then print tokens/s and the report")
    gen.add_argument("--prompt", required=True)
    add_model_arguments(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--no-patch", action="store_true", help="run stock transformers")
    for feature, default in (("attention", "auto"), ("kv-cache", "auto"), ("compile", "auto"),
                             ("speculative", "auto"), ("quantize", "none")):
        gen.add_argument(f"--{feature}", default=default, help=f"backend name, auto or none (default {default})")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.set_defaults(func=cmd_generate)
    return parser


def cmd_doctor(args: argparse.Namespace) -> int:
    import transformers

    if args.model and not Path(args.model).is_dir():
        raise CLIError(f"--model {args.model!r} is not a local directory: pass the directory a model was saved or "
                       "downloaded to (for a Hub id, `hf download ID` prints where)")
    print(f"hf_accel {__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}")
    devices = ["cpu"] + [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    print(f"devices: {', '.join(devices)}   threads: {torch.get_num_threads()}")
    print(f"CPU: {cpu_name()}, {usable_cpus()} CPUs, kernels {torch.backends.cpu.get_cpu_capability()} "
          f"(flags: {' '.join(cpu_flags()) or 'no AVX-512 or AMX'})")
    from hf_accel.runtime.compile_cache import CompileStore

    store = CompileStore()
    print(f"compile cache: {store.directory} ({len(store.entries())} compiled shapes; `hf-accel cache info`)")
    rows = [("feature", "backend", "plugin", "available", "why not")]
    rows += [(b.feature, b.name, b.plugin, "yes" if b.available else "no", b.reason) for b in available_backends()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    problems = plugin_problems()
    if problems:
        print(f"plugin problems ({len(problems)}; `hf-accel plugins` lists the plugins):")
        for problem in problems:
            print(f"  {problem}")
    if args.model:
        _print_speculation_blockers(args.model)
    return 0


def _print_speculation_blockers(model_dir: str) -> None:
    from hf_accel.runtime.speculative.settings import batch_blocking_settings, blocking_settings

    if _is_encoder_decoder(model_dir):
        print(f"{model_dir}: an encoder-decoder model: every generate call runs without speculation (the loop "
              "drafts for decoder-only models only)")
        return
    config = _generation_config_of(model_dir)
    blocking, batches = blocking_settings(config), batch_blocking_settings(config)
    if not blocking and not batches:
        print(f"{model_dir}: its generation config leaves speculative decoding on for every call")
    without = "run without speculation (stock generate, with the patch's cache and compiled step)"
    for settings, calls in ((blocking, "every generate call"), (batches, "generate calls with batch > 1")):
        if settings:
            print(f"{model_dir}: these settings of its generation config make {calls} {without}:")
            for setting in settings:
                print(f"  {setting}")


def _is_encoder_decoder(model_dir: str) -> bool:
    """What the model's ``config.json`` says (False where it has none to read: the generation config decides)."""
    from transformers import AutoConfig

    try:
        return bool(AutoConfig.from_pretrained(model_dir).is_encoder_decoder)
    except (OSError, ValueError):
        return False


def _generation_config_of(model_dir: str) -> Any:
    """The generation config ``from_pretrained`` gives the model: its ``generation_config.json``, else the
    generation settings of its ``config.json`` (older checkpoints keep them there)."""
    from transformers import AutoConfig, GenerationConfig

    if (Path(model_dir) / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise CLIError(f"--model {model_dir}: its generation_config.json cannot be read ({exc}); fix or "
                           "remove it") from None
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    except (OSError, ValueError) as exc:
        raise CLIError(f"--model {model_dir}: neither a generation_config.json nor a config.json to read "
                       f"({exc}); pass a local model directory") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_accel.tools.bench.steady import compile_seconds

    if args.max_new_tokens < 1 or args.prompts < 1:
        raise CLIError("--max-new-tokens and --prompts must be at least 1")
    print("Loading the default model (SmolLM2-135M-Instruct, fp32)...")
    model, tokenizer = load_default_model()
    prompts = one_per_category(load_prompts())[: args.prompts]
    encoded = [encode_chat(tokenizer, p.prompt) for p in prompts]
    timed_generate(model, encoded[0], 4)  # warm-up, so the first timed call is not charged for it
    stock = [timed_generate(model, e, args.max_new_tokens) for e in tqdm(encoded, desc="stock generate")]
    patch(model)
    # A whole call on the longest prompt: the patch's fixed-length caches are sized for every prompt here.
    # The default compile policy runs these first calls eagerly (compiling would not pay for itself yet).
    print("Warming up the patched model (one call)...")
    timed_generate(model, max(encoded, key=lambda e: e["input_ids"].shape[-1]), args.max_new_tokens)
    patched, compiling = [], []
    for e in tqdm(encoded, desc="patched generate"):
        before = compile_seconds(model) or 0.0
        patched.append(timed_generate(model, e, args.max_new_tokens))
        compiling.append((compile_seconds(model) or 0.0) - before)

    for prompt, s, p in zip(prompts, stock, patched):
        print(f"\n=== {prompt.category}/{prompt.name}: {prompt.prompt[:70]!r}...")
        print(f"--- stock:\n{tokenizer.decode(s.tokens[0], skip_special_tokens=True)}")
        if not torch.equal(s.tokens, p.tokens):
            print(f"--- patched:\n{tokenizer.decode(p.tokens[0], skip_special_tokens=True)}")
    print(f"\n{demo_table(prompts, stock, patched, compiling)}")
    print(f"\n{report(model)}")
    return 0


def demo_table(prompts, stock, patched, compiling: list[float]) -> str:
    """The demo's table: per prompt, stock's and the patched model's tok/s, and the seconds a patched call spent
    compiling (charged to it: ``compile_when="auto"`` compiles inside the call where it starts to pay)."""
    rows = [("prompt", "stock tok/s", "patched tok/s", "speedup", "identical", "compiling s")]
    for prompt, s, p, seconds in zip(prompts, stock, patched, compiling):
        rows.append((f"{prompt.category}/{prompt.name}", f"{s.tokens_per_s:.1f}", f"{p.tokens_per_s:.1f}",
                     f"{p.tokens_per_s / s.tokens_per_s:.2f}x", "yes" if torch.equal(s.tokens, p.tokens) else "NO",
                     f"{seconds:.1f}" if seconds > 0.05 else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    if any(seconds > 0.05 for seconds in compiling):
        lines.append("(a call that compiled the decode step is charged for it; the calls after it run compiled)")
    return "\n".join(lines)


def cmd_cache(args: argparse.Namespace) -> int:
    from hf_accel.runtime.compile_cache import CompileStore
    from hf_accel.tools.converted import ConvertedModels

    store, models = CompileStore(args.dir), ConvertedModels(args.dir)
    if args.action == "clear":
        freed = store.clear()
        print(f"emptied {store.directory} ({freed / 2**20:.1f} MB freed)")
        print(f"emptied {models.directory} ({models.clear() / 2**20:.1f} MB freed)")
        return 0
    entries = store.entries()
    print(f"hf_accel compile cache: {store.directory}  ({len(entries)} entries, {store.size_bytes() / 2**20:.1f} MB)")
    rows = [("model (its Linear layers)", "compiled shape class", "cold s", "warm s", "created")]
    rows += [(e.model, e.shape, _seconds(e.cold_seconds), _seconds(e.warm_seconds), e.created) for e in entries]
    if entries:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"compiled code: {store.code_directory} (the compiler's own cache, used for hf_accel's compiles only)")
    copies = models.entries()
    count = f"{len(copies)} {'copy' if len(copies) == 1 else 'copies'}"
    print(f"converted GGUF models: {models.directory}  ({count}, {models.size_bytes() / 2**20:.1f} MB)")
    for copy in copies:
        print(f"  {copy.name}")
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    choices = {f: getattr(args, f) for f in ("attention", "kv_cache", "compile", "speculative", "quantize")}
    choices = {f: None if value.lower() == "none" else value for f, value in choices.items()}
    check_arguments(**choices)
    model, tokenizer = load_from_args(args)
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
