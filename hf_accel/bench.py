"""``hf-accel bench``: stock, transformers-native and hf_accel configurations side by side, in one process.

Every configuration runs the same prompts with the same ``max_new_tokens``, greedily, on the same model
object; hf_accel configurations patch it and unpatch it afterwards. This is steady state: hf_accel
configurations compile in their warm-up call (``compile_when="first_use"`` unless the configuration says
otherwise), and warm-up (and compile) time is reported apart from the timed runs. Start-up, as a short
script meets it, is ``hf-accel bench --cold`` (:mod:`hf_accel.bench_cold`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import patch, report, unpatch
from .features import FEATURE_NAMES
from .prompts import Prompt, encode_chat
from .quality import perplexity
from .quantize import tensor_bytes
from .timing import timed_generate

_ALL_OFF = {name: None for name in FEATURE_NAMES}


@dataclass(frozen=True)
class BenchConfig:
    """One way of running generate. ``patch_kwargs`` is None for configurations that do not use hf_accel."""

    name: str
    group: str  # "stock", "native" or "hf_accel"
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    patch_kwargs: dict[str, Any] | None = None
    warmup_each_prompt: bool = False  # compiled configurations recompile for each prompt length


@dataclass
class Row:
    config: str
    group: str
    prompt: str
    prompt_category: str
    tokens: int
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    ttft_s: float
    warmup_s: float
    speedup: float = 1.0
    vs_best_native: float | None = None
    identical: bool = True
    agreement: float | None = None  # share of positions where the greedy tokens equal stock's
    acceptance: float | None = None
    peak_rss_mb: float | None = None
    perplexity: float | None = None  # on hf_accel/data/eval.txt; stock and quantized configurations
    weight_mb: float | None = None  # parameters and quantized buffers; stock and quantized configurations
    compile_s: float | None = None  # time spent compiling the decode step, over all of the configuration's calls


def native_static_compile() -> dict[str, Any]:
    """What a knowledgeable transformers user writes for a compiled decode step: a static cache and
    ``compile_config`` (allowed on CPU, where transformers does not compile by default)."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default", fullgraph=False)
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def default_configs(features_available: set[str], quantize: list[str]) -> list[BenchConfig]:
    configs = [
        BenchConfig("stock", "stock"),
        BenchConfig("native: static cache + compile", "native", native_static_compile(), warmup_each_prompt=True),
        BenchConfig("native: prompt lookup", "native", {"prompt_lookup_num_tokens": 10}),
    ]
    for feature in FEATURE_NAMES:
        if feature in features_available and feature not in ("quantize", "compile"):
            configs.append(BenchConfig(f"hf_accel {feature} only", "hf_accel",
                                       patch_kwargs={**_ALL_OFF, feature: "auto"}))
        if feature == "compile" and feature in features_available:  # the compiled step runs over a static cache
            configs.append(BenchConfig("hf_accel kv_cache + compile", "hf_accel",
                                       patch_kwargs={**_ALL_OFF, "kv_cache": "auto", "compile": "auto"}))
    configs.append(BenchConfig("hf_accel patch(model)", "hf_accel", patch_kwargs={}))
    for scheme in quantize:
        configs.append(BenchConfig(f"hf_accel quantize={scheme} only", "hf_accel",
                                   patch_kwargs={**_ALL_OFF, "quantize": scheme, "keep_original": True}))
        if "compile" in features_available:
            configs.append(BenchConfig(f"hf_accel quantize={scheme} + kv_cache + compile", "hf_accel",
                                       patch_kwargs={**_ALL_OFF, "quantize": scheme, "kv_cache": "auto",
                                                     "compile": "auto", "keep_original": True}))
        configs.append(BenchConfig(f"hf_accel patch(model, quantize={scheme})", "hf_accel",
                                   patch_kwargs={"quantize": scheme, "keep_original": True}))
    return configs


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter for this process (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mb(field: str = "VmHWM") -> float | None:
    """This process's resident memory from /proc (``VmHWM``: peak since the last reset; ``VmRSS``: now)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _acceptance(model) -> tuple[int, int]:
    details = report(model)["speculative"].details
    return details.get("drafted", 0), details.get("accepted", 0)


def run_bench(model, tokenizer, prompts: list[Prompt], configs: list[BenchConfig], max_new_tokens: int = 128,
              repeat: int = 1, progress: Callable[[str], None] | None = None,
              llama_cpp_gguf: str | Path | None = None) -> list[Row]:
    """Run every configuration on every prompt (then llama.cpp on the GGUF file, if given); rows come back
    with ratios and identity to stock filled in."""
    encoded = [encode_chat(tokenizer, p.prompt, model.device) for p in prompts]
    rows: list[Row] = []
    stock_tokens: dict[str, torch.Tensor] = {}
    for config in configs:
        config_rows = _run_config(model, config, prompts, encoded, max_new_tokens, repeat, stock_tokens, progress,
                                  tokenizer)
        rows += config_rows
    if llama_cpp_gguf is not None:
        rows += run_llama_cpp(llama_cpp_gguf, encoded, prompts, max_new_tokens, repeat, stock_tokens, progress)
    _fill_ratios(rows)
    return rows


def _run_config(model, config, prompts, encoded, max_new_tokens, repeat, stock_tokens, progress,
                tokenizer) -> list[Row]:
    reset_peak_rss()
    start = time.perf_counter()
    name = config.name
    if config.patch_kwargs is not None:
        # Steady state: compile in the warm-up, as a server that warms up would (compile_when="first_use");
        # `hf-accel bench --cold` measures how the default gets there.
        patch(model, **{**compile_at_once(), **config.patch_kwargs})
        name += _not_applied(model, config.patch_kwargs)
    setup = time.perf_counter() - start
    rows = []
    try:
        warm = _warm_up(model, max(encoded, key=_prompt_length), config, max_new_tokens) + setup
        for prompt, inputs in zip(prompts, encoded):
            if progress:
                progress(f"{config.name} / {prompt.category}:{prompt.name}")
            if config.warmup_each_prompt and inputs is not encoded[0]:
                warm = _warm_up(model, inputs, config, max_new_tokens)
            before = _acceptance(model) if config.patch_kwargs is not None else (0, 0)
            runs = [timed_generate(model, inputs, max_new_tokens, **config.generate_kwargs) for _ in range(repeat)]
            after = _acceptance(model) if config.patch_kwargs is not None else (0, 0)
            tokens = runs[0].tokens
            speeds = [run.tokens_per_s for run in runs]
            key = f"{prompt.category}:{prompt.name}"
            if config.group == "stock":
                stock_tokens[key] = tokens
            drafted = after[0] - before[0]
            rows.append(Row(
                config=name, group=config.group, prompt=key, prompt_category=prompt.category,
                tokens=tokens.shape[-1], tokens_per_s=statistics.median(speeds), tokens_per_s_min=min(speeds),
                tokens_per_s_max=max(speeds), ttft_s=statistics.median(r.ttft_s for r in runs), warmup_s=warm,
                identical=key in stock_tokens and torch.equal(tokens, stock_tokens[key]),
                agreement=_agreement(tokens, stock_tokens.get(key)),
                acceptance=(after[1] - before[1]) / drafted if drafted else None, peak_rss_mb=None))
            warm = 0.0
        peak = rss_mb()
        quality = _quality(model, tokenizer) if config.group == "stock" or _quantized(config) else (None, None)
        compile_s = _compile_seconds(model) if config.patch_kwargs is not None else None
        for row in rows:
            row.peak_rss_mb = peak
            row.perplexity, row.weight_mb = quality
            row.compile_s = compile_s
    finally:
        if config.patch_kwargs is not None:
            unpatch(model)
    return rows


def compile_at_once() -> dict[str, Any]:
    """``compile_when="first_use"`` where a registered backend takes that option (none may: a plugin disabled)."""
    from .backends import BackendRegistry
    from .plugins import get_plugin_manager

    known = "compile_when" in BackendRegistry.collect(get_plugin_manager()).option_names()
    return {"compile_when": "first_use"} if known else {}


def _not_applied(model, patch_kwargs: dict[str, Any]) -> str:
    """A label for features this configuration asked for by name that no backend ended up serving."""
    missing = [f"{feature} not applied: {report(model)[feature].reason}"
               for feature, value in patch_kwargs.items()
               if feature in FEATURE_NAMES and isinstance(value, str) and value != "auto"
               and report(model)[feature].backend is None]
    return f" ({'; '.join(missing)})" if missing else ""


def _agreement(tokens: torch.Tensor, reference: torch.Tensor | None) -> float | None:
    """Share of positions (over the longer of the two) where the tokens equal the reference's."""
    if reference is None:
        return None
    ours, theirs = tokens[0].tolist(), reference[0].tolist()
    longest = max(len(ours), len(theirs))
    return sum(a == b for a, b in zip(ours, theirs)) / longest if longest else 1.0


def _quantized(config: BenchConfig) -> bool:
    return bool((config.patch_kwargs or {}).get("quantize"))


def _quality(model, tokenizer) -> tuple[float, float]:
    return perplexity(model, tokenizer), tensor_bytes(model) / 2**20


def _warm_up(model, inputs, config: BenchConfig, max_new_tokens: int) -> float:
    """Untimed first call(s): compiled configurations compile here. hf_accel's is a whole call on the
    longest prompt, so its fixed-length caches are sized once for every prompt and the speculative loop
    meets most chunk widths."""
    start = time.perf_counter()
    whole = config.warmup_each_prompt or config.patch_kwargs is not None
    timed_generate(model, inputs, max_new_tokens if whole else 8, **config.generate_kwargs)
    return time.perf_counter() - start


def _prompt_length(inputs: dict[str, torch.Tensor]) -> int:
    return inputs["input_ids"].shape[-1]


def _compile_seconds(model) -> float | None:
    """Time spent compiling: stock generate's decode step and the speculative loop's forwards."""
    details = report(model)
    seconds = [details["compile"].details.get("compile_seconds")]
    seconds += [d.get("compile_seconds") for d in details["speculative"].details.get("compiled", {}).values()]
    seconds = [s for s in seconds if s is not None]
    return sum(seconds) if seconds else None


def run_llama_cpp(gguf_file: str | Path, encoded: list[dict[str, torch.Tensor]], prompts: list[Prompt],
                  max_new_tokens: int, repeat: int, stock_tokens: dict[str, torch.Tensor],
                  progress: Callable[[str], None] | None = None) -> list[Row]:
    """The same prompt token ids through llama.cpp (``llama-cpp-python``) on the same GGUF file, greedy,
    with as many threads as torch uses. Its weights stay in the file's quantized format, so its tokens are
    not expected to equal the fp32 model's; ``identical`` says whether they do."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise ValueError("--against llama.cpp needs llama-cpp-python: pip install llama-cpp-python") from exc
    reset_peak_rss()
    start = time.perf_counter()
    llm = Llama(model_path=str(gguf_file), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)
    load_s = time.perf_counter() - start
    rows = []
    for prompt, inputs in zip(prompts, encoded):
        key = f"{prompt.category}:{prompt.name}"
        if progress:
            progress(f"llama.cpp / {key}")
        ids = inputs["input_ids"][0].tolist()
        runs = [_llama_cpp_once(llm, ids, max_new_tokens) for _ in range(repeat)]
        speeds = [len(tokens) / seconds for tokens, seconds, _ in runs]
        tokens = runs[0][0]
        reference = stock_tokens[key][0].tolist() if key in stock_tokens else None
        rows.append(Row(config="llama.cpp (GGUF as shipped)", group="other", prompt=key,
                        prompt_category=prompt.category, tokens=len(tokens), tokens_per_s=statistics.median(speeds),
                        tokens_per_s_min=min(speeds), tokens_per_s_max=max(speeds),
                        ttft_s=statistics.median(r[2] for r in runs), warmup_s=load_s,
                        identical=reference is not None and tokens == reference))
        load_s = 0.0
    peak = rss_mb()
    for row in rows:
        row.peak_rss_mb = peak
    return rows


def _llama_cpp_once(llm, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
    start, first, tokens = time.perf_counter(), None, []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        tokens.append(int(token))
        if token == llm.token_eos() or len(tokens) >= max_new_tokens:
            break
    return tokens, time.perf_counter() - start, (first or time.perf_counter()) - start


def _fill_ratios(rows: list[Row]) -> None:
    stock = {r.prompt: r.tokens_per_s for r in rows if r.group == "stock"}
    native: dict[str, float] = {}
    for r in rows:
        if r.group == "native":
            native[r.prompt] = max(native.get(r.prompt, 0.0), r.tokens_per_s)
    for r in rows:
        r.speedup = r.tokens_per_s / stock[r.prompt] if r.prompt in stock else float("nan")
        r.vs_best_native = r.tokens_per_s / native[r.prompt] if r.prompt in native else None


def format_table(rows: list[Row]) -> str:
    header = ("config", "prompt", "tok/s", "min-max", "TTFT s", "warm-up s", "compile s", "vs stock", "vs native",
              "accept", "peak RSS MB", "identical")
    lines = [header]
    for r in rows:
        lines.append((r.config, r.prompt, f"{r.tokens_per_s:.1f}", f"{r.tokens_per_s_min:.1f}-{r.tokens_per_s_max:.1f}",
                      f"{r.ttft_s:.2f}", f"{r.warmup_s:.1f}", "-" if r.compile_s is None else f"{r.compile_s:.1f}",
                      f"{r.speedup:.2f}x",
                      "-" if r.vs_best_native is None else f"{r.vs_best_native:.2f}x",
                      "-" if r.acceptance is None else f"{r.acceptance:.0%}",
                      "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}", "yes" if r.identical else "no"))
    lines = [tuple(_cell(c) for c in line) for line in lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(out)


def summary_table(rows: list[Row]) -> str:
    """Per configuration: geometric-mean speedup over the prompts, and whether every output was identical."""
    by_config: dict[str, list[Row]] = {}
    for r in rows:
        by_config.setdefault(r.config, []).append(r)
    quality = any(r.perplexity is not None for r in rows)
    head = ("| config | mean tok/s | speedup (geo-mean) | identical | compile s |"
            + (" perplexity | weights MB |" if quality else ""))
    lines = [head, "| --- " * (5 + 2 * quality) + "|"]
    for name, group in by_config.items():
        geo = statistics.geometric_mean(r.speedup for r in group)
        tps = statistics.mean(r.tokens_per_s for r in group)
        same = sum(r.identical for r in group)
        agreement = [r.agreement for r in group if r.agreement is not None]
        line = f"| {_cell(name)} | {tps:.1f} | {geo:.2f}x | {same}/{len(group)}"
        line += f" ({statistics.mean(agreement):.0%} of tokens) |" if agreement and same < len(group) else " |"
        line += f" {'-' if group[0].compile_s is None else f'{group[0].compile_s:.1f}'} |"
        if quality:
            ppl, mb = group[0].perplexity, group[0].weight_mb
            line += f" {'-' if ppl is None else f'{ppl:.3f}'} | {'-' if mb is None else f'{mb:.0f}'} |"
        lines.append(line)
    return "\n".join(lines)


def _cell(value: object) -> str:
    """Table cell text; a literal ``|`` (in a regex option, say) would split a Markdown cell."""
    return str(value).replace("|", "\\|")


def write_json(rows: list[Row], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def plot(rows: list[Row], path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'hf_accel[plot]'") from exc
    configs = list(dict.fromkeys(r.config for r in rows))
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    speed = {(r.config, r.prompt): r.tokens_per_s for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(prompts) * len(configs) / 3), 5))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        xs = [p + i * width for p in range(len(prompts))]
        ax.bar(xs, [speed.get((config, p), 0) for p in prompts], width, label=config)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(len(prompts))], prompts, rotation=20, ha="right")
    ax.set_ylabel("tokens/s (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
