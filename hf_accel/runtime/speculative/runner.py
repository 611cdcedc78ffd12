"""The runner a speculative backend installs: each ``generate`` call planned, run through the loop with the
right caches and compiled forwards, or handed to stock generate with the reason counted."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from hf_accel.patching.errors import PatchError
from hf_accel.runtime.cached_lm import CachedLM, can_share
from hf_accel.runtime.compiled_step import CHECK_TOLERANCE
from hf_accel.runtime.contracts import Call, DecodeStep
from hf_accel.runtime.speculative.loop import DrafterFactory, DraftLength, SpeculativeLoop, SpeculativeStats, to_output
from hf_accel.runtime.speculative.plan import CallPlan, Fallback, plan_call

if TYPE_CHECKING:
    from hf_accel.patching.backends import PatchContext

logger = logging.getLogger(__name__)

#: How far a draft model's compiled graph may move its logits (relative) before it is refused.
DRAFT_CHECK_TOLERANCE = 5e-2


class SpeculativeRunner:
    """Installed as ``state.runner`` by a speculative backend; runs each generate call it can cover.

    Where the patch has a compiled decode step (``compile=``), the loop's forward passes after the prompt run
    through it over fixed-length :class:`~hf_accel.runtime.kv_cache.RollbackStaticCache` caches: the target's
    verification chunks through the patch's step, a draft model's steps through one of its own (their layers
    compiled when the compile policy says so, eager until then); otherwise eagerly over the patch's KV cache.
    """

    def __init__(self, make_drafter: DrafterFactory, details: dict[str, Any], draft_length: DraftLength,
                 drafts: tuple[torch.nn.Module, ...] = ()) -> None:
        self.make_drafter = make_drafter
        self.details = details
        self.draft_length = draft_length
        self.stats = SpeculativeStats()
        self._logged: set[str] = set()
        # The counts and the once-per-reason warnings: calls run one at a time per model, but one runner's
        # counts may be read (report) while a call adds to them.
        self._counting = threading.Lock()
        # id(draft model) -> its compiled forward (the target uses the patch's)
        self._compiled: dict[int, DecodeStep | None] = {}
        #: The models the drafters run (a quantized copy a backend made, a user's draft model).
        self.drafts = drafts

    def __repr__(self) -> str:
        return f"<SpeculativeRunner first_k={self.draft_length.k} {self.stats.as_details()}>"

    def cache_bytes(self) -> int:
        """Bytes the draft models' compiled steps keep in their caches (the target's are the compile report's)."""
        return sum(step.cache_bytes() for step in list(self._compiled.values()) if step is not None)

    def __call__(self, call: Call) -> Any:
        plan = plan_call(call.model, call.args, call.kwargs)
        with self._counting:
            self.stats.calls += 1
        if isinstance(plan, Fallback):
            return self._fallback(call, plan)
        drafter = self.make_drafter(call.model, plan.config)
        # Each call adapts a draft length of its own from the same start, so that a seeded sampled call draws
        # the same tokens whatever calls came before it (the draft length decides how the draws are used).
        draft_length = dataclasses.replace(self.draft_length)
        compiled: list[DecodeStep] = []  # the compiled forwards this call runs, told how long it was when it ends
        loop = None
        try:
            loop = SpeculativeLoop(call.model, drafter, plan.config, plan.processors, plan.stopping, plan.streamer,
                                   plan.max_new_tokens, draft_length,
                                   make_lm=lambda model, role="target", over=None: self._cached_lm(
                                       call, plan, model, role, compiled, over),
                                   draft_processors=plan.draft_processors)
            with torch.no_grad():
                loop.run(plan.input_ids, plan.attention_mask)
        finally:  # each compiled forward closes the layers it trusted for the call and learns how long it was
            rows, prompt = (loop.rows, loop.prompt_length) if loop is not None else ((), 0)
            made = max((row.shape[0] for row in rows), default=prompt) - prompt
            _end_call(compiled, made)
        with self._counting:
            self.stats.add(loop.stats)
            self.details.update(self.stats.as_details(), draft_length=draft_length.k)
        return to_output(loop, plan.config)

    def _cached_lm(self, call: Call, plan: CallPlan, model: torch.nn.Module, role: str,
                   compiled: list[DecodeStep], over: CachedLM | None = None) -> CachedLM:
        """``model`` (the target, or a draft) with its cache for this call: ``over``'s where that is the kind
        its forward runs on (fixed-length for a compiled one), else its own."""
        base = call.state.compiled_step
        # The target compiles only where its graphs reproduce eager to fp32 rounding: with bf16 activations
        # (quantized or bf16 weights) fused casts round differently, and greedy output could drift from the
        # model's own. Drafts may; their tokens are all verified.
        inexact = base is not None and base.tolerance > CHECK_TOLERANCE and role == "target"
        step = None if base is None or plan.config.disable_compile or inexact else self._step_for(base, model, role)
        if step is None:
            if over is not None and over.fixed_length is None and can_share(over, model):
                return CachedLM(model, over=over)
            return CachedLM(model, call.reusable_cache() if role == "target" else None)
        step.begin_call(plan.max_new_tokens)
        compiled.append(step)
        if over is not None and over.fixed_length is not None and can_share(over, model):
            return CachedLM(model, forward=step, over=over)
        batch, prompt = plan.input_ids.shape
        # Room for every token, plus a full draft verified past the budget's end.
        length = prompt + plan.max_new_tokens + self.draft_length.high + self.draft_length.extra + 2
        return CachedLM(model, step.cache_for(batch, length), forward=step)

    def _step_for(self, base: DecodeStep, model: torch.nn.Module, role: str) -> DecodeStep | None:
        """The compiled forward ``model`` runs: the patch's for the target, one of its own for a draft (None for
        a draft whose layers cannot be routed: it drafts eagerly)."""
        if model is base.model:
            return base
        if id(model) not in self._compiled:
            # A draft's graph only has to draft well: a loose check is enough (its tokens are all verified).
            self._compiled[id(model)] = base.for_model(
                model, details=self.details.setdefault("compiled", {}).setdefault(role, {}),
                tolerance=DRAFT_CHECK_TOLERANCE)
        return self._compiled[id(model)]

    def _fallback(self, call: Call, fallback: Fallback) -> Any:
        reason = fallback.reason
        if call.state.arguments.get("strict") and not fallback.stock_raises:
            raise PatchError(f"speculative decoding does not cover {reason}, and the model was patched with "
                             "strict=True, so this call is refused instead of running stock generate; to keep "
                             f"speculation: {fallback.remedy}; or patch with strict=False (docs/features.md lists "
                             "what is covered)", feature="speculative")
        with self._counting:
            self.stats.fallbacks += 1
            reasons = self.details.setdefault("fallback_reasons", {})
            reasons[reason] = reasons.get(reason, 0) + 1
            self.details.update(self.stats.as_details())
            warn = reason not in self._logged and not fallback.stock_raises
            self._logged.add(reason)
        if warn:
            logger.warning("hf_accel: speculative decoding does not cover %s, so this call (and any like it) runs "
                           "stock generate with the patch's cache and compiled step but no speculation; to keep "
                           "it: %s (docs/features.md lists what is covered)", reason, fallback.remedy)
        return call.run_stock()


def object_request_problem(context: PatchContext) -> str | None:
    """For drafters that need nothing from the user: refuse ``speculative=<some object>``."""
    if isinstance(context.request, (str, bool)):
        return None
    return f"speculative={type(context.request).__name__} asks for a draft-model backend"


def _end_call(steps: list[DecodeStep], made: int) -> None:
    """``end_call`` on every step, in order, each even if one before it raises: nested ``finally`` blocks, so an
    error keeps its own chain and a later one carries the earlier in it."""
    if steps:
        try:
            steps[0].end_call(made)
        finally:
            _end_call(steps[1:], made)


def install_runner(context: PatchContext, make_drafter: DrafterFactory, draft_length: DraftLength,
                   drafts: tuple[torch.nn.Module, ...] = ()) -> None:
    """What a speculative backend's ``apply`` does: route this model's generate calls through the loop.
    ``drafts``: the models its drafters run (a quantized copy the backend made, a user's draft model)."""
    runner = SpeculativeRunner(make_drafter, context.report.details, draft_length, drafts)
    context.changes.setattr(context.state, "runner", runner)
    context.account_memory("draft models' static caches", runner.cache_bytes)
