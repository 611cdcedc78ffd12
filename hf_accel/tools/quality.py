"""What a lossy patch costs: perplexity on a fixed English text and teacher-forced agreement with a reference."""

from __future__ import annotations

from importlib import resources

import torch

EVAL_TEXT = "data/eval.txt"


def eval_text() -> str:
    """About 600 words of plain English prose shipped with hf_accel, for quality measurements."""
    return resources.files("hf_accel").joinpath(EVAL_TEXT).read_text(encoding="utf-8")


def perplexity(model, tokenizer, text: str | None = None) -> float:
    """exp(mean next-token negative log-likelihood) of ``text``, teacher-forced in one forward pass.

    Example::

        >>> round(perplexity(model, tokenizer), 1)
        9.7
    """
    ids = tokenizer(text if text is not None else eval_text(), return_tensors="pt")["input_ids"].to(model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp())
