"""``hf-accel identity``: how often a patched model's greedy output is token-identical to stock's.

Runs a varied prompt set (chat, code, edits, and long inputs built from the shipped evaluation passages)
greedily through stock ``generate``, then through the same model after ``patch``: every prompt alone, and
again in left-padded batches that mix short and long prompts. A row counts as identical when every generated
token matches stock's for the same call (a batched row is compared with stock's output for the same batch).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Iterable

import torch

from hf_accel.tools.prompts import Prompt, load_prompts

#: How many evaluation passages a "long" prompt quotes at once.
PASSAGES_PER_LONG_PROMPT = 3


def identity_prompts() -> list[Prompt]:
    """The shipped identity set: 40 short prompts plus long ones quoting the evaluation passages."""
    short = load_prompts(resources.files("hf_accel").joinpath("data/identity_prompts.jsonl"))
    text = resources.files("hf_accel").joinpath("data/eval.txt").read_text(encoding="utf-8")
    passages = [p.strip() for p in text.split("\n") if p.strip()]
    long = []
    for i, passage in enumerate(passages, start=1):
        long.append(Prompt("long", f"summary{i}", f"Summarize this passage in two sentences:\n\n{passage}"))
        long.append(Prompt("long", f"facts{i}", f"List three facts stated in this passage:\n\n{passage}"))
    for start in range(0, len(passages) - PASSAGES_PER_LONG_PROMPT + 1, PASSAGES_PER_LONG_PROMPT):
        quoted = "\n\n".join(passages[start:start + PASSAGES_PER_LONG_PROMPT])
        long.append(Prompt("long", f"themes{start + 1}", f"What do these passages have in common?\n\n{quoted}"))
    return [*short, *long]


@dataclass
class RowResult:
    prompt: Prompt
    batch: int  # 1, or the size of the mixed batch the row ran in
    identical: bool
    first_difference: int | None  # index of the first generated token that differs


@dataclass
class IdentityResult:
    rows: list[RowResult] = field(default_factory=list)

    def rate(self, rows: Iterable[RowResult] | None = None) -> tuple[int, int]:
        chosen = list(self.rows if rows is None else rows)
        return sum(r.identical for r in chosen), len(chosen)

    def table(self) -> str:
        lines = [f"{'rows':<24} {'identical':>10} {'rate':>7}"]
        groups = {"every row": self.rows}
        for batch in sorted({r.batch for r in self.rows}):
            groups[f"batch {batch}"] = [r for r in self.rows if r.batch == batch]
        groups.update({f"category {c}": [r for r in self.rows if r.prompt.category == c]
                       for c in dict.fromkeys(r.prompt.category for r in self.rows)})
        for name, rows in groups.items():
            same, total = self.rate(rows)
            lines.append(f"{name:<24} {f'{same}/{total}':>10} {same / total:>7.1%}")
        for r in self.rows:
            if not r.identical:
                lines.append(f"differs: {r.prompt.category}/{r.prompt.name} (batch {r.batch}) from generated token "
                             f"{r.first_difference}")
        return "\n".join(lines)


def mixed_batches(prompts: list[Prompt], size: int, seed: int = 0) -> list[list[Prompt]]:
    """The prompts in a fixed shuffled order, cut into batches of ``size``: short and long prompts share batches."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return [order[i:i + size] for i in range(0, len(order), size)]


def run_identity(model: Any, tokenizer: Any, prompts: list[Prompt], patch: Callable[[Any], Any],
                 max_new_tokens: int = 64, batch_size: int = 4,
                 progress: Callable[[Iterable, str], Iterable] = lambda items, desc: items) -> IdentityResult:
    """Stock, then ``patch(model)``, over each prompt alone and in mixed batches of ``batch_size``."""
    calls = [[p] for p in prompts] + (mixed_batches(prompts, batch_size) if batch_size > 1 else [])
    encoded = [_encode(tokenizer, [p.prompt for p in call]) for call in calls]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate_all(desc: str) -> list[torch.Tensor]:
        outputs = []
        for inputs in progress(encoded, desc):
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            outputs.append(out[:, inputs["input_ids"].shape[1]:])
        return outputs

    stock = generate_all("stock generate")
    patch(model)
    patched = generate_all("patched generate")
    result = IdentityResult()
    for call, ours, theirs in zip(calls, patched, stock):
        for row, prompt in enumerate(call):
            result.rows.append(_compare(prompt, len(call), ours[row], theirs[row]))
    return result


def _compare(prompt: Prompt, batch: int, ours: torch.Tensor, theirs: torch.Tensor) -> RowResult:
    width = max(ours.numel(), theirs.numel())
    padded = [torch.nn.functional.pad(t, (0, width - t.numel()), value=-1) for t in (ours, theirs)]
    differs = (padded[0] != padded[1]).nonzero()
    first = int(differs[0, 0]) if differs.numel() else None
    return RowResult(prompt, batch, first is None, first)


def _encode(tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded chat-formatted inputs for one call."""
    tokenizer.padding_side = "left"
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=False) for t in texts]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    else:
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return {k: encoded[k] for k in ("input_ids", "attention_mask")}
