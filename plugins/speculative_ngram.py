"""Prompt lookup: draft tokens by finding the latest n-gram in the prompt and output so far that matches
the row's last n tokens, and proposing what followed it. No extra model; strongest on input-grounded
prompts (summaries, edits of quoted text, code)."""

from __future__ import annotations

import torch

from hf_accel import Backend, Capabilities, Option, PatchContext, hookimpl
from hf_accel.speculative import Draft, DraftLength, SpeculativeLoop, install_runner, object_request_problem


class NgramDrafter:
    """Proposes, per row, the continuation of the latest earlier match of its last ``n`` tokens
    (``n`` from ``max_ngram`` down to ``min_ngram``)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, loop: SpeculativeLoop) -> None:
        pass

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        found = [lookup(row, k, self.max_ngram, self.min_ngram) for row in loop.rows]
        tokens = loop.rows[0].new_zeros(len(found), k)
        for b, continuation in enumerate(found):
            tokens[b, : continuation.numel()] = continuation
        lengths = torch.tensor([c.numel() for c in found], device=tokens.device)
        return Draft(tokens, lengths)

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        pass


def lookup(row: torch.Tensor, k: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``row``'s last n tokens."""
    length = row.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = row[: length - 1].unfold(0, n, 1)  # each window must be followed by at least one token
        hits = (windows == row[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return row[start : start + k]
    return row[:0]


def install(context: PatchContext) -> None:
    max_ngram = int(context.option("ngram_size", 3))
    k = int(context.option("num_draft_tokens", 10))
    install_runner(context, lambda model, config: NgramDrafter(max_ngram),
                   DraftLength(k=k, low=max(1, k // 4), high=max(k, 2 * k)))


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="ngram",
        feature="speculative",
        apply=install,
        why_unsuitable=object_request_problem,
        capabilities=Capabilities(partial_weights=True),  # drafts from the tokens; the target runs as it is
        probe="generate",
        priority=10,
        options={"ngram_size": Option.integer(3, maximum=64), "num_draft_tokens": Option.integer(10, maximum=64)},
        description="prompt lookup: drafts copied from earlier in the prompt and output",
    ))
