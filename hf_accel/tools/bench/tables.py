"""The tables and chart ``hf-accel bench`` prints and saves from its rows."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from hf_accel.tools.bench.steady import LLAMA_CPP, Row
from hf_accel.tools.prompts import INPUT_GROUNDED


def format_table(rows: list[Row]) -> str:
    several = _several_settings(rows)
    header = ("config", *(("settings",) if several else ()), "prompt", "tok/s", "min-max", "TTFT s", "warm-up s",
              "compile s", "vs stock", "vs native", "accept", "peak RSS MB", "identical")
    lines = [header]
    for r in rows:
        lines.append((r.config, *((_settings_cell(r),) if several else ()), r.prompt, f"{r.tokens_per_s:.1f}",
                      f"{r.tokens_per_s_min:.1f}-{r.tokens_per_s_max:.1f}",
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
    """Per configuration (and generate set): geometric-mean speedup over the prompts, and whether every output
    was identical. With several generate sets, also the share of the first set's speedup each set keeps: the
    geometric mean over the prompts of its speedup over the first set's (the first set is the first row's; stock,
    1.00x by definition, shows "-"). With llama.cpp rows, also the geometric mean of each prompt's tok/s over
    llama.cpp's, over every prompt and over the input-grounded ones (:data:`~hf_accel.tools.prompts.INPUT_GROUNDED`)."""
    by_config: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by_config.setdefault((r.config, r.settings), []).append(r)
    llama = {r.prompt: r.tokens_per_s for r in rows if r.config == LLAMA_CPP}
    quality = any(r.perplexity is not None for r in rows)
    several = _several_settings(rows)
    first = rows[0].settings if rows else ""
    head = ("| config |" + (" settings |" if several else "") + " mean tok/s | speedup (geo-mean) |"
            + (" speedup vs the first set |" if several else "") + " identical | compile s |"
            + (" vs llama.cpp (geo-mean) | input-grounded |" if llama else "")
            + (" perplexity | weights MB |" if quality else ""))
    lines = [head, "| --- " * (5 + 2 * several + 2 * bool(llama) + 2 * quality) + "|"]
    for (name, settings), group in by_config.items():
        geo = statistics.geometric_mean(r.speedup for r in group)
        tps = statistics.mean(r.tokens_per_s for r in group)
        same = sum(r.identical for r in group)
        agreement = [r.agreement for r in group if r.agreement is not None]
        line = f"| {_cell(name)} |" + (f" {_cell(_settings_cell(group[0]))} |" if several else "")
        line += f" {tps:.1f} | {geo:.2f}x |"
        if several:
            first_speedups = {r.prompt: r.speedup for r in by_config.get((name, first), ())}
            is_reference = settings == first or group[0].group == "stock"
            vs_first = "-" if is_reference else _against(group, first_speedups, key=lambda r: r.speedup)
            line += f" {vs_first} |"
        line += f" {same}/{len(group)}"
        line += f" ({statistics.mean(agreement):.0%} of tokens) |" if agreement and same < len(group) else " |"
        line += f" {'-' if group[0].compile_s is None else f'{group[0].compile_s:.1f}'} |"
        if llama:
            grounded = [r for r in group if r.prompt_category in INPUT_GROUNDED]
            line += f" {_against(group, llama)} | {_against(grounded, llama)} |"
        if quality:
            ppl, mb = group[0].perplexity, group[0].weight_mb
            line += f" {'-' if ppl is None else f'{ppl:.3f}'} | {'-' if mb is None else f'{mb:.0f}'} |"
        lines.append(line)
    return "\n".join(lines)


def _against(group: list[Row], reference: dict[str, float],
             key: Callable[[Row], float] = lambda r: r.tokens_per_s) -> str:
    """The geometric mean of each row's ``key`` over the reference's on the same prompt ("-" with none to
    compare)."""
    ratios = [key(r) / reference[r.prompt] for r in group if reference.get(r.prompt)]
    return f"{statistics.geometric_mean(ratios):.2f}x" if ratios else "-"


def _several_settings(rows: list[Row]) -> bool:
    return len({r.settings for r in rows}) > 1


def _settings_cell(row: Row) -> str:
    return row.settings or "(none)"


def _cell(value: object) -> str:
    """Table cell text; a literal ``|`` (in a regex option, say) would split a Markdown cell."""
    return str(value).replace("|", "\\|")


def write_json(rows: list[Row], path: str | Path, machine: str | None = None) -> None:
    """The rows as a JSON list; ``machine`` (:func:`~hf_accel.tools.common.machine_line`) goes into each row, so
    a file read on another day still says which kind of machine measured it."""
    extra = {"machine": machine} if machine is not None else {}
    Path(path).write_text(json.dumps([{**asdict(r), **extra} for r in rows], indent=1))


def plot(rows: list[Row], path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'hf_accel[plot]'") from exc
    several = _several_settings(rows)
    name = (lambda r: f"{r.config} [{_settings_cell(r)}]") if several else (lambda r: r.config)
    configs = list(dict.fromkeys(map(name, rows)))
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    speed = {(name(r), r.prompt): r.tokens_per_s for r in rows}
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
