"""Prompt lookup: draft tokens by finding the latest n-gram in the prompt and output so far that matches
the row's last n tokens, and proposing what followed it. No extra model; strongest on input-grounded
prompts (summaries, edits of quoted text, code)."""

from __future__ import annotations

from hf_accel.plugin import (
    Backend,
    Capabilities,
    DraftLength,
    Option,
    PatchContext,
    hookimpl,
    install_runner,
    object_request_problem,
)
from hf_accel_plugins.drafters import NgramDrafter


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
