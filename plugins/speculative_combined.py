"""``speculative="ngram_self_int4"``: the target's int4 copy drafts, prompt lookup extends its draft.

A quantized copy of the target drafts well anywhere (on SmolLM2 ~85-95% of its tokens are accepted) but
costs a forward pass per token; prompt lookup costs nothing but only drafts where the output repeats the
input. Here the copy drafts ``k`` tokens, then each row's draft is extended by what followed the latest
earlier occurrence of its last tokens (2 or 3 of them, draft included), so a step that enters a passage
being copied (a quoted sentence, a code line kept in an edit) verifies up to :data:`EXTENSION` more
tokens in the same target pass. The copy reads the target's keys and values for the prompt and every
accepted token (:class:`~hf_accel_plugins.drafters.SelfDrafter`), so it never runs over the prompt itself.

Where the int4 kernel or the copy is not possible (no CPU int4 kernel, a quantized target), ``auto``
falls back to plain ``ngram``.
"""

from __future__ import annotations

import torch

from hf_accel.plugin import (
    Backend,
    Capabilities,
    Draft,
    DraftLength,
    Option,
    PatchContext,
    SpeculativeLoop,
    hookimpl,
    install_runner,
)
from hf_accel_plugins.drafters import SelfDrafter, lookup
from hf_accel_plugins.int4_layers import kernel_problem
from hf_accel_plugins.self_drafts import describe, draft_bytes, self_draft, self_draft_problem, vocab_size

#: The shortest n-gram match the lookup extends a draft from; single tokens predicted poorly.
MIN_MATCH = 2
#: The most tokens the lookup adds to a model draft.
EXTENSION = 10


class ModelThenLookupDrafter:
    """A :class:`SelfDrafter`'s ``k`` tokens, each row extended by prompt lookup on its row plus draft."""

    def __init__(self, model: SelfDrafter, max_ngram: int, counts: dict[str, int], extension: int = EXTENSION) -> None:
        self.model = model
        self.max_ngram = max_ngram
        self.extension = extension
        self.counts = counts  # drafted / accepted tokens per source (the report's)
        self.model_width = 0
        self.active = torch.ones(0, dtype=torch.bool)  # rows still generating when the draft was made

    def start(self, loop: SpeculativeLoop) -> None:
        self.model.start(loop)

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        draft = self.model.propose(loop, k)
        self.active = ~loop.finished
        found = [lookup(torch.cat([row, tokens]), self.extension, self.max_ngram, MIN_MATCH)
                 for row, tokens in zip(loop.rows, draft.tokens)]
        self.model_width = draft.width
        longest = max(f.numel() for f in found)
        if longest == 0:
            return draft
        tokens = torch.cat([draft.tokens, draft.tokens.new_zeros(len(found), longest)], dim=1)
        for b, continuation in enumerate(found):
            tokens[b, draft.width: draft.width + continuation.numel()] = continuation
        added = torch.tensor([f.numel() for f in found], device=tokens.device)
        return Draft(tokens, draft.lengths + added, _with_point_masses(draft.probs, tokens, draft.width))

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        active = self.active
        from_model = kept.clamp_max(self.model_width)
        self.counts["model_drafted"] += self.model_width * int(active.sum())
        self.counts["model_accepted"] += int(from_model[active].sum())
        self.counts["lookup_drafted"] += int((draft.lengths - self.model_width).clamp_min(0)[active].sum())
        self.counts["lookup_accepted"] += int((kept - from_model)[active].sum())
        self.model.accepted(loop, draft, kept)


def _with_point_masses(probs: torch.Tensor | None, tokens: torch.Tensor, model_width: int) -> torch.Tensor | None:
    """The model's draft distributions, then a point mass on each lookup token (it is chosen for certain)."""
    if probs is None:
        return None
    extra = tokens[:, model_width:]
    point = probs.new_zeros(*extra.shape, probs.shape[-1]).scatter_(2, extra[..., None], 1.0)
    return torch.cat([probs, point], dim=1)


def install(context: PatchContext) -> None:
    draft = self_draft(context, bits=4)
    vocab = vocab_size(context.model)
    max_ngram = int(context.option("ngram_size", 3))
    counts = dict.fromkeys(("model_drafted", "model_accepted", "lookup_drafted", "lookup_accepted"), 0)
    length = DraftLength(k=4, low=1, high=8, extra=EXTENSION)
    install_runner(context, lambda model, config: ModelThenLookupDrafter(SelfDrafter(draft, config, vocab),
                                                                         max_ngram, counts, length.extra), length,
                   drafts=(draft,))
    context.report.details["draft"] = f"an {describe(draft, 4)}, extended by prompt lookup"
    context.report.details["sources"] = counts


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="ngram_self_int4",
        feature="speculative",
        apply=install,
        why_unavailable=kernel_problem,
        why_unsuitable=self_draft_problem,
        capabilities=Capabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16)),
        probe="generate",
        priority=15,
        options={"ngram_size": Option.integer(3, maximum=64)},
        memory_needed=lambda context: draft_bytes(context, 4),
        description="an int4 copy of the target drafts, prompt lookup extends its drafts",
    ))
