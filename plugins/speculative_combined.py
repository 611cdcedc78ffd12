"""``speculative="ngram_self_int4"``: prompt lookup where it has a match, the target's int4 copy elsewhere.

Prompt lookup costs nothing but only drafts where the output repeats the input; a quantized copy of the
target drafts anywhere but costs a forward pass per drafted token. This drafter asks the lookup first and,
for a step where some row has no 2-token match, runs the int4 copy instead, after feeding it the tokens
it missed while the lookup was drafting.

On SmolLM2 (2-core CPU, the 8 shipped prompts, 128 tokens) it beat ``ngram`` on chat and code (2.35x and
2.11x stock against 1.77x and 1.88x, per-category geometric means) and lost to it on summaries and edits
of quoted text (1.71x and 2.14x against 1.90x and 2.34x); 2.07x against 1.96x over all eight, inside this
machine's noise. ``speculative="auto"`` stays with ``ngram``, which needs no second copy of the weights;
ask for this one by name for open-ended generation.
"""

from __future__ import annotations

import torch

from hf_accel import Backend, Capabilities, PatchContext, hookimpl
from hf_accel.speculative import Draft, DraftLength, ModelDrafter, SpeculativeLoop, install_runner
from hf_accel_plugins.quantize_int4 import kernel_problem
from hf_accel_plugins.speculative_model import SELF_DRAFTS, quantized_copy, self_draft_problem, vocab_size
from hf_accel_plugins.speculative_ngram import NgramDrafter


#: The shortest n-gram match the lookup drafts from; shorter ones predicted worse than the int4 copy.
MIN_MATCH = 2
#: The most tokens the int4 copy drafts at once (each costs a forward pass of the copy).
MODEL_K = 4


class LookupThenModelDrafter:
    """An :class:`NgramDrafter` for steps where every active row has a match, a :class:`ModelDrafter`
    otherwise. ``held[b]``: how many of row b's tokens the model drafter's cache holds."""

    def __init__(self, lookup: NgramDrafter, model: ModelDrafter, counts: dict[str, int],
                 model_k: int = MODEL_K) -> None:
        self.lookup, self.model = lookup, model
        self.model_k = model_k
        self.counts = counts  # steps per source, and the model's drafted / accepted tokens (the report's)
        self.held: list[int] = []
        self.used_model = False
        self.active = torch.ones(0, dtype=torch.bool)

    def start(self, loop: SpeculativeLoop) -> None:
        self.lookup.start(loop)
        self.model.start(loop)
        self.held = [row.numel() - 1 for row in loop.rows]

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        draft = self.lookup.propose(loop, k)
        self.active = ~loop.finished
        self.used_model = not bool((draft.lengths[self.active] > 0).all())
        self.counts["model_steps" if self.used_model else "lookup_steps"] += 1
        if not self.used_model:
            return draft
        self._catch_up(loop)
        return self.model.propose(loop, min(k, self.model_k))

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        if self.used_model:
            self.counts["model_drafted"] += int(draft.lengths[self.active].sum())
            self.counts["model_accepted"] += int(kept[self.active].sum())
            self.model.accepted(loop, draft, kept)
            self.held = [row.numel() - 1 for row in loop.rows]
        else:
            self.lookup.accepted(loop, draft, kept)

    def _catch_up(self, loop: SpeculativeLoop) -> None:
        """Append to the model drafter's cache each row's tokens it has not seen (all but the newest);
        rows with fewer get masked slots first."""
        missing = [row.numel() - 1 - held for row, held in zip(loop.rows, self.held)]
        width = max(missing)
        if width <= 0:
            return
        ids = loop.rows[0].new_zeros(len(missing), width)
        valid = torch.zeros_like(ids)
        for b, (row, held, n) in enumerate(zip(loop.rows, self.held, missing)):
            if n > 0:
                ids[b, width - n:] = row[held: held + n]
                valid[b, width - n:] = 1
        self.model.lm.extend(ids, valid)
        self.model.lm.keep(torch.full((len(missing),), width, device=ids.device))
        self.held = [row.numel() - 1 for row in loop.rows]


def install(context: PatchContext) -> None:
    draft = quantized_copy(context.model, bits=4)
    vocab = vocab_size(context.model)
    max_ngram = int(context.option("ngram_size", 3))
    counts = dict.fromkeys(("lookup_steps", "model_steps", "model_drafted", "model_accepted"), 0)
    install_runner(context,
                   lambda model, config: LookupThenModelDrafter(NgramDrafter(max_ngram, min_ngram=MIN_MATCH),
                                                                ModelDrafter(draft, config, vocab), counts),
                   DraftLength(k=6, low=2, high=12))
    context.report.details["draft"] = f"prompt lookup (2+ token matches), else an {SELF_DRAFTS[4]}"
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
        priority=1,
        options={"ngram_size": 3},
        description="prompt lookup where it matches, an int4 copy of the target elsewhere",
    ))
