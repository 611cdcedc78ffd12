"""Prompt sets by category (chat, code, summarize a quoted passage, edit a quoted code block)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

CATEGORIES = ("chat", "code", "summarize", "edit")
#: Categories whose answers quote their input, where prompt lookup drafts well.
INPUT_GROUNDED = ("summarize", "edit")


@dataclass(frozen=True)
class Prompt:
    category: str
    name: str
    prompt: str


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The shipped prompt set, or a JSONL file with one ``{"prompt": ..., "category": ..., "name": ...}`` a line.

    :raises ValueError: a line that is not JSON, or has no ``prompt`` string; the message names the line.
    """
    if path is None:
        text = resources.files("hf_accel").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
        source = "hf_accel/data/prompts.jsonl"
    else:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"No prompts file at {path}")
        text, source = path.read_text(encoding="utf-8"), str(path)
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{source}:{number}: expected an object with a "prompt" string')
        prompts.append(Prompt(str(row.get("category", "custom")), str(row.get("name", f"line{number}")), row["prompt"]))
    if not prompts:
        raise ValueError(f"{source}: no prompts found")
    return prompts


def encode_chat(tokenizer, text: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for one user turn, through the tokenizer's chat template if it has one."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
    else:
        encoded = tokenizer(text, return_tensors="pt")
    return {k: v.to(device) for k, v in encoded.items() if k in ("input_ids", "attention_mask")}


def one_per_category(prompts):
    firsts = {}
    for prompt in prompts:
        firsts.setdefault(prompt.category, prompt)
    return list(firsts.values())
