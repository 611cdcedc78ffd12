"""``hf-accel bench``: stock, transformers-native and hf_accel configurations side by side, in one process.

Every configuration runs the same prompts with the same ``max_new_tokens``, greedily, on the same model
object; hf_accel configurations patch it and unpatch it afterwards. Given several sets of ``generate`` settings
(:class:`GenerateSet`), each configuration runs every prompt under each set in turn, run by run, so that the
sets' speeds are measured side by side rather than minutes apart. This is steady state: hf_accel
configurations compile in their warm-up call (``compile_when="first_use"`` unless the configuration says
otherwise), and warm-up (and compile) time is reported apart from the timed runs. Start-up, as a short
script meets it, is ``hf-accel bench --cold`` (:mod:`hf_accel.tools.bench.cold`).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from hf_accel import PatchError, patch, report, unpatch
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.plugin.quantize import tensor_bytes
from hf_accel.tools.common import error_lines
from hf_accel.tools.prompts import Prompt, encode_chat
from hf_accel.tools.quality import perplexity
from hf_accel.tools.timing import timed_generate

_ALL_OFF = {name: None for name in FEATURE_NAMES}


@dataclass(frozen=True)
class BenchConfig:
    """One way of running generate. ``patch_kwargs`` is None for configurations that do not use hf_accel."""

    name: str
    group: str  # "stock", "native" or "hf_accel"
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    patch_kwargs: dict[str, Any] | None = None
    warmup_each_prompt: bool = False  # compiled configurations recompile for each prompt length


class GenerateSet(NamedTuple):
    """``generate`` settings every configuration's calls get (one ``--generate``), and how tables name them."""

    label: str
    kwargs: dict[str, Any]


NO_GENERATE_SET = GenerateSet("", {})

#: The configuration name of the llama.cpp rows (``--against llama.cpp``).
LLAMA_CPP = "llama.cpp (GGUF as shipped)"


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
    settings: str = ""  # the label of the generate settings the calls had (:class:`GenerateSet`)


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
              llama_cpp_gguf: str | Path | None = None, perplexity: bool = True,
              generate_sets: list[GenerateSet] | None = None) -> list[Row]:
    """Run every configuration on every prompt (then llama.cpp on the GGUF file, if given); rows come back
    with ratios and identity to stock filled in. ``perplexity``: measure it for stock and quantized
    configurations (it means nothing for random weights). ``generate_sets``: each prompt's runs alternate
    between them (a row per set; ratios and identity against stock's under the same set); llama.cpp's rows stand
    beside the first set's."""
    generate_sets = generate_sets or [NO_GENERATE_SET]
    if len({s.label for s in generate_sets}) < len(generate_sets):
        raise ValueError(f"two generate sets share a label: {[s.label for s in generate_sets]}")
    session = BenchSession(model, tokenizer, prompts, max_new_tokens, repeat, progress, measure_quality=perplexity,
                           generate_sets=generate_sets)
    rows = []
    for config in configs:
        try:
            rows += session.run(config)
        except PatchError as exc:  # one configuration that cannot run here costs its rows, not the others'
            print(f"{config.name}: skipped: {error_lines(exc)[0]}", file=sys.stderr)
    if llama_cpp_gguf is not None:
        first = generate_sets[0].label
        stock = {key: tokens for (label, key), tokens in session.stock_tokens.items() if label == first}
        llama_rows = run_llama_cpp(llama_cpp_gguf, session.encoded, prompts, max_new_tokens, repeat, stock, progress)
        rows += [replace(row, settings=first) for row in llama_rows]
    _fill_ratios(rows)
    return rows


@dataclass
class BenchSession:
    """One model's configurations, one after another: the prompts encoded once, stock's tokens kept per
    settings set and prompt (the stock configuration runs first) for the identity of the others."""

    model: Any
    tokenizer: Any
    prompts: list[Prompt]
    max_new_tokens: int = 128
    repeat: int = 1
    progress: Callable[[str], None] | None = None
    measure_quality: bool = True
    generate_sets: list[GenerateSet] = field(default_factory=lambda: [NO_GENERATE_SET])
    stock_tokens: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.encoded = [encode_chat(self.tokenizer, p.prompt, self.model.device) for p in self.prompts]

    def run(self, config: BenchConfig) -> list[Row]:
        """Every prompt through ``config`` (patched for it, and unpatched after), ``repeat`` timed runs each."""
        reset_peak_rss()
        start = time.perf_counter()
        name = config.name
        if config.patch_kwargs is not None:
            # Steady state: compile in the warm-up, as a server that warms up would (compile_when="first_use");
            # `hf-accel bench --cold` measures how the default gets there.
            patch(self.model, **{**compile_at_once(), **config.patch_kwargs})
            name += _not_applied(self.model, config.patch_kwargs)
        setup = time.perf_counter() - start
        try:
            warm = self._warm_ups(max(self.encoded, key=_prompt_length), config)
            warm[self.generate_sets[0].label] += setup
            rows = []
            for i, (prompt, inputs) in enumerate(zip(self.prompts, self.encoded)):
                if config.warmup_each_prompt and i:
                    warm = self._warm_ups(inputs, config)
                rows += self._timed(config, name, prompt, inputs, warm, turn=i)
                warm = dict.fromkeys(warm, 0.0)
            peak = rss_mb()
            measured = self.measure_quality and (config.group == "stock" or _quantized(config))
            quality = _quality(self.model, self.tokenizer) if measured else (None, None)
            compile_s = compile_seconds(self.model) if config.patch_kwargs is not None else None
            for row in rows:
                row.peak_rss_mb, (row.perplexity, row.weight_mb), row.compile_s = peak, quality, compile_s
        finally:
            if config.patch_kwargs is not None:
                unpatch(self.model)
        return rows

    def _warm_ups(self, inputs: dict[str, torch.Tensor], config: BenchConfig) -> dict[str, float]:
        """A warm-up under each generate set: its seconds by the set's label."""
        return {each.label: _warm_up(self.model, inputs, config, self.max_new_tokens, each.kwargs)
                for each in self.generate_sets}

    def _timed(self, config: BenchConfig, name: str, prompt: Prompt, inputs: dict[str, torch.Tensor],
               warm: dict[str, float], turn: int = 0) -> list[Row]:
        """One prompt's timed runs, the generate sets taking turns, the other way round on odd ``turn + round``
        (ABBA: a drift of the machine's speed favours no set, at any ``repeat``): a row per set (identity and
        acceptance against what was before)."""
        key = f"{prompt.category}:{prompt.name}"
        if self.progress:
            self.progress(f"{config.name} / {key}")
        patched = config.patch_kwargs is not None
        runs: dict[str, list[Any]] = {each.label: [] for each in self.generate_sets}
        counts = {each.label: [0, 0] for each in self.generate_sets}  # drafted, accepted
        for round_ in range(self.repeat):
            for each in self.generate_sets[::-1] if (turn + round_) % 2 else self.generate_sets:
                before = _acceptance(self.model) if patched else (0, 0)
                runs[each.label].append(timed_generate(self.model, inputs, self.max_new_tokens,
                                                       **{**config.generate_kwargs, **each.kwargs}))
                after = _acceptance(self.model) if patched else (0, 0)
                counts[each.label][0] += after[0] - before[0]
                counts[each.label][1] += after[1] - before[1]
        rows = []
        for label, timed in runs.items():
            tokens, speeds = timed[0].tokens, [run.tokens_per_s for run in timed]
            if config.group == "stock":
                self.stock_tokens[label, key] = tokens
            reference = self.stock_tokens.get((label, key))
            drafted, accepted = counts[label]
            rows.append(Row(config=name, group=config.group, prompt=key, prompt_category=prompt.category,
                            tokens=tokens.shape[-1], tokens_per_s=statistics.median(speeds),
                            tokens_per_s_min=min(speeds), tokens_per_s_max=max(speeds),
                            ttft_s=statistics.median(r.ttft_s for r in timed), warmup_s=warm[label],
                            identical=reference is not None and torch.equal(tokens, reference),
                            agreement=_agreement(tokens, reference),
                            acceptance=accepted / drafted if drafted else None, settings=label))
        return rows


def compile_at_once() -> dict[str, Any]:
    """``compile_when="first_use"`` where a registered backend takes that option (none may: a plugin disabled)."""
    from hf_accel.patching.plugin_manager import get_plugin_manager
    from hf_accel.patching.registry import BackendRegistry

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


def _warm_up(model, inputs, config: BenchConfig, max_new_tokens: int, settings: dict[str, Any]) -> float:
    """An untimed first call: compiled configurations compile here. hf_accel's is a whole call on the
    longest prompt, so its fixed-length caches are sized once for every prompt and the speculative loop
    meets most chunk widths."""
    start = time.perf_counter()
    kwargs = {**config.generate_kwargs, **settings}
    whole = config.warmup_each_prompt or config.patch_kwargs is not None
    tokens = max_new_tokens if whole else _short_call(kwargs, _prompt_length(inputs), max_new_tokens)
    timed_generate(model, inputs, tokens, **kwargs)
    return time.perf_counter() - start


def _short_call(generate_kwargs: dict[str, Any], prompt_length: int, max_new_tokens: int) -> int:
    """The new tokens of a warm-up that only has to run once: 8, or what the call's ``min_new_tokens`` or
    ``min_length`` ask for (a budget under them makes transformers warn that the settings cannot both hold),
    but never more than the timed calls' own budget when that is larger than 8."""
    wanted = max(8, int(generate_kwargs.get("min_new_tokens") or 0),
                 int(generate_kwargs.get("min_length") or 0) - prompt_length)
    return min(wanted, max(8, max_new_tokens))


def _prompt_length(inputs: dict[str, torch.Tensor]) -> int:
    return inputs["input_ids"].shape[-1]


def compile_seconds(model) -> float | None:
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
        rows.append(Row(config=LLAMA_CPP, group="other", prompt=key,
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
    """Each row against stock (and the best native configuration) on the same prompt under the same settings."""
    stock = {(r.settings, r.prompt): r.tokens_per_s for r in rows if r.group == "stock"}
    native: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.group == "native":
            native[r.settings, r.prompt] = max(native.get((r.settings, r.prompt), 0.0), r.tokens_per_s)
    for r in rows:
        key = r.settings, r.prompt
        r.speedup = r.tokens_per_s / stock[key] if key in stock else float("nan")
        r.vs_best_native = r.tokens_per_s / native[key] if key in native else None
