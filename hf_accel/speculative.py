"""The speculative draft/verify loop that replaces ``generate`` (greedy and sampling, batch > 1).

Each step: the drafter proposes up to ``k`` tokens per row; the target scores the row's newest token plus
all drafted ones in one forward pass; each row keeps its longest agreeing prefix plus one token from the
target; the caches forget the rest. Greedy output is the target's own greedy output. Sampling uses exact
speculative sampling (accept with min(1, p/q), else resample from max(p - q, 0)), so tokens follow the
target's distribution.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cached_lm import CachedLM, can_share
from .compiled_step import CHECK_TOLERANCE
from .generation import generated_length
from .speculative_settings import blocking_settings

logger = logging.getLogger(__name__)

#: Model inputs a call may pass besides the token ids (anything else falls back to stock generate).
_MODEL_INPUTS = frozenset({"input_ids", "attention_mask", "logits_to_keep"})
#: How far a draft model's compiled graph may move its logits (relative) before it is refused.
DRAFT_CHECK_TOLERANCE = 5e-2


@dataclass
class Draft:
    """Up to ``k`` proposed tokens per row. ``probs`` is the drafter's distribution at each position (for
    exact sampling); ``None`` means the tokens were proposed deterministically (a point mass)."""

    tokens: torch.Tensor  # [batch, k] long
    lengths: torch.Tensor  # [batch] long: how many of the k are real proposals
    probs: torch.Tensor | None = None  # [batch, k, vocab]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def only(self, rows: torch.Tensor) -> Draft:
        """The same proposals for ``rows`` (``[batch]`` bool), none for the others."""
        return Draft(self.tokens, self.lengths.masked_fill(~rows, 0), self.probs)

    def trimmed(self, limit: int) -> Draft:
        """At most ``limit`` tokens per row, without columns no row uses (the target need not verify them)."""
        lengths = self.lengths.clamp_max(limit)
        width = int(lengths.max()) if lengths.numel() else 0
        probs = None if self.probs is None else self.probs[:, :width]
        return Draft(self.tokens[:, :width], lengths, probs)


class Drafter(Protocol):
    """What a speculative backend provides: a fresh one per ``generate`` call (see ``DrafterFactory``)."""

    def start(self, loop: SpeculativeLoop) -> None:
        """Called once, after the target's prefill; ``loop.rows[b]`` is row b's prompt plus its first token."""

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        """Up to ``k`` tokens per row that continue ``loop.rows[b]``."""

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        """Row ``b`` kept the first ``kept[b]`` tokens of ``draft``, then received one from the target."""


class DrafterFactory(Protocol):
    def __call__(self, model: torch.nn.Module, config: GenerationConfig) -> Drafter: ...


class LMFactory(Protocol):
    def __call__(self, model: torch.nn.Module, role: str = "target", over: CachedLM | None = None) -> CachedLM:
        """``model`` with a cache for this call; ``role``: ``"target"`` or ``"draft"``. With ``over`` (a model of
        the same shapes and dtype), it runs over ``over``'s cache where it can (see ``CachedLM.owner``),
        else over a cache of its own."""


def eager_lm(model: torch.nn.Module, role: str = "target", over: CachedLM | None = None) -> CachedLM:  # noqa: ARG001
    """The plain :class:`LMFactory`: eager forwards, a new growing cache each (or ``over``'s)."""
    return CachedLM(model, over=over if over is not None and can_share(over, model) else None)


@dataclass
class SpeculativeStats:
    """Counts over every generate call of one patched model (``report(model)["speculative"].details``).
    Forwards are counted per row, so ``tokens_per_forward`` is what one row gains from one target pass."""

    calls: int = 0
    fallbacks: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0

    def add(self, call: SpeculativeStats) -> None:
        """Count one call's loop (calls and fallbacks are counted by the runner)."""
        self.target_forwards += call.target_forwards
        self.drafted += call.drafted
        self.accepted += call.accepted
        self.generated += call.generated

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    def as_details(self) -> dict[str, Any]:
        return {"calls": self.calls, "fallbacks_to_stock": self.fallbacks, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_target_forward": round(self.tokens_per_forward, 3),
                "target_forwards_saved": max(self.generated - self.target_forwards, 0)}


@dataclass
class DraftLength:
    """Adapts ``k``: grow by 2 after a fully accepted draft, shrink by 1 after a rejection. ``extra``: how
    many tokens a drafter may propose beyond ``k`` (a lookup extending a model's draft)."""

    k: int = 4
    low: int = 1
    high: int = 16
    extra: int = 0

    def update(self, draft: Draft, kept: torch.Tensor, active: torch.Tensor) -> None:
        proposed = active & (draft.lengths > 0)
        if bool(proposed.any()):
            full = bool((kept[proposed] >= draft.lengths[proposed]).all())
            self.k = min(self.k + 2, self.high) if full else max(self.k - 1, self.low)


def unsupported_setting(config: GenerationConfig, model_kwargs: dict[str, Any]) -> str | None:
    """What in a call the loop cannot reproduce exactly (see :mod:`hf_accel.speculative_settings`), or None."""
    blocking = blocking_settings(config, with_values=False)  # one reason per setting, whatever its value
    if blocking:
        return f"generation setting {blocking[0]}"
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_INPUTS and v is not None)
    return f"generate argument {extra[0]!r}" if extra else None


class SpeculativeLoop:
    """One ``generate`` call's worth of speculative decoding over a batch.

    ``rows[b]`` holds row b's left-padded prompt and every token generated so far; the target's cache holds
    all of them but the newest, which is verified together with the next draft.
    """

    def __init__(self, model: torch.nn.Module, drafter: Drafter, config: GenerationConfig,
                 processors: list[LogitsProcessorList], stopping: StoppingCriteriaList | None, streamer: Any,
                 max_new_tokens: int, draft_length: DraftLength, make_lm: LMFactory | None = None,
                 draft_processors: list[LogitsProcessorList] | None = None) -> None:
        #: Makes the :class:`CachedLM` a model of this call runs in (the target here, a draft model in a drafter).
        self.make_lm = make_lm or eager_lm
        self.target = self.make_lm(model, "target")
        self.drafter = drafter
        self.config = config
        #: Row b's logits processors (stock's, built for that row: some hold per-row state such as its padding).
        self.processors = processors
        #: What a drafter applies to its own proposals: the same, less the user's processors (built-in ones are
        #: functions of the prefix; a user's may count its calls, and stock makes none for drafts).
        self.draft_processors = processors if draft_processors is None else draft_processors
        self.stopping = stopping
        self.streamer = streamer
        self.max_new_tokens = max_new_tokens
        self.draft_length = draft_length
        eos = config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.rows: list[torch.Tensor] = []
        self.prompt_length = 0
        self.scores: list[list[torch.Tensor]] = []
        self.logits: list[list[torch.Tensor]] = []
        #: (row, length) -> whether a stopping criterion ended the row there, for the current step's prefixes.
        self._stop_checked: dict[tuple[int, int], bool] = {}
        self.stats = SpeculativeStats()

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.prompt_length = input_ids.shape[1]
        self.prompt_mask = attention_mask
        self.rows = list(input_ids)
        self.scores = [[] for _ in self.rows]
        self.logits = [[] for _ in self.rows]
        self.finished = torch.zeros(len(self.rows), dtype=torch.bool, device=input_ids.device)
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        empty = Draft(input_ids.new_zeros(len(self.rows), 0), input_ids.new_zeros(len(self.rows)))
        logits = self.target.prefill(input_ids, attention_mask)[:, None]
        self.stats.target_forwards += len(self.rows)
        kept, tokens, scores = self._accept(logits, empty)
        self._append(tokens, kept + 1, scores, logits)
        if not bool(self.finished.all()):
            self.drafter.start(self)
        while not bool(self.finished.all()):
            self._step()
        if self.streamer is not None:
            self.streamer.end()
        return self._sequences()

    def _step(self) -> None:
        length = self.draft_length
        active = ~self.finished
        draft = self.drafter.propose(self, length.k).only(active)
        draft = draft.trimmed(length.k + length.extra)  # what the caches have room for
        chunk = torch.cat([torch.stack([row[-1] for row in self.rows])[:, None], draft.tokens], dim=1)
        logits = self.target.extend(chunk)  # position j predicts what follows chunk[:, j]
        kept, tokens, scores = self._accept(logits, draft)
        # Running rows keep the previous newest token and the accepted drafts; rows that ended keep nothing.
        self.target.keep(torch.where(active, kept + 1, 0))
        self.stats.target_forwards += int(active.sum())
        self.stats.drafted += int(draft.lengths[active].sum())
        self.stats.accepted += int(kept[active].sum())
        self._append(tokens, kept + 1, scores, logits)
        self.drafter.accepted(self, draft, kept)
        self.draft_length.update(draft, kept, active)

    # -- acceptance ---------------------------------------------------------------------------------------
    def _accept(self, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: how many drafted tokens to keep, the row's new tokens (kept drafts, then one from the
        target, at index ``kept``), and the processed scores at each position."""
        width = draft.width
        in_draft = torch.arange(width, device=logits.device)[None, :] < draft.lengths[:, None]
        # Drawn first: with processors, each row is processed only up to its first rejection, decided by these.
        draws = torch.rand(len(self.rows), width, device=logits.device) if self.config.do_sample else None
        scores = self._process(logits, draft, draws)
        if self.config.do_sample:
            kept, extra = accept_sampled(scores.softmax(-1), draft, in_draft, draws)
        else:
            choice = scores.argmax(-1)
            kept = ((choice[:, :width] == draft.tokens) & in_draft).long().cumprod(-1).sum(-1)
            extra = choice.gather(1, kept[:, None])[:, 0]
        tokens = torch.cat([draft.tokens, extra[:, None]], dim=1)
        tokens.scatter_(1, kept[:, None], extra[:, None])
        return kept, tokens, scores

    def _process(self, logits: torch.Tensor, draft: Draft, draws: torch.Tensor | None) -> torch.Tensor:
        """The logits processors at each position with the prefix stock generate would pass, row by row, up to
        the row's first rejected draft: later positions hold prefixes stock never builds (a processor may
        keep state or refuse them), and their scores are never used."""
        self._stop_checked = {}
        if not any(self.processors):
            return logits
        out = logits.clone()
        for b, row in enumerate(self.rows):
            prefix = row
            for j in range(logits.shape[1]):
                stops = j > 0 and self._stops(b, prefix, out[b, :j])  # asked after every token, as stock asks
                if bool(self.finished[b]) or self._ends(prefix, with_token=j > 0) or stops:
                    break  # stock makes no more tokens for this row
                out[b, j] = self.processors[b](prefix[None], logits[b, j][None].clone())[0]
                if j >= int(draft.lengths[b]) or not self._keeps(out[b, j], draft, b, j, draws):
                    break
                prefix = torch.cat([prefix, draft.tokens[b, j : j + 1]])
        return out

    def _ends(self, prefix: torch.Tensor, with_token: bool) -> bool:
        """Whether a row whose tokens are ``prefix`` has ended (its last token, if new, is EOS; or its budget
        is spent)."""
        spent = prefix.shape[0] - self.prompt_length >= self.max_new_tokens
        return spent or (with_token and int(prefix[-1]) in self.eos)

    def _keeps(self, scores: torch.Tensor, draft: Draft, b: int, j: int, draws: torch.Tensor | None) -> bool:
        """Whether row b keeps draft token j, by the rule ``_accept`` applies (the same draw when sampling)."""
        token = draft.tokens[b, j]
        if draws is None:
            return bool(scores.argmax() == token)
        p = scores.softmax(-1)[token]
        q = scores.new_tensor(1.0) if draft.probs is None else draft.probs[b, j, token].to(p.dtype)
        return bool((draws[b, j] * q < p) & (q > 0))

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _append(self, tokens: torch.Tensor, count: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """Row ``b`` gains ``tokens[b, :count[b]]``, up to its EOS, stopping criterion or token budget."""
        for b in range(len(self.rows)):
            if bool(self.finished[b]):
                continue
            for j in range(int(count[b])):
                self.rows[b] = torch.cat([self.rows[b], tokens[b, j : j + 1]])
                if self.config.output_scores:  # copies, so a chunk's [batch, k+1, vocab] tensor is not kept
                    self.scores[b].append(scores[b, j].clone())
                if self.config.output_logits:
                    self.logits[b].append(logits[b, j].clone())
                self.stats.generated += 1
                if self.streamer is not None:
                    self.streamer.put(tokens[b, j : j + 1].cpu())
                if self._row_done(b):
                    self.finished[b] = True
                    break

    def _row_done(self, b: int) -> bool:
        """After a token was appended to row b: its EOS, its budget, or a stopping criterion."""
        stops = self._stops(b, self.rows[b])  # asked after every token, the last one too, as stock asks
        return self._ends(self.rows[b], with_token=True) or stops

    def _stops(self, b: int, prefix: torch.Tensor, pending: torch.Tensor | None = None) -> bool:
        """Whether a stopping criterion (stock's or the user's) ends row ``b`` at ``prefix``. Criteria get what
        stock passes them: every step's scores so far when the call returns them (``pending``: scores of
        positions not appended yet), else None."""
        if not self.stopping:
            return False
        if (b, prefix.shape[0]) in self._stop_checked:  # asked while processing this step (criteria may count)
            return self._stop_checked[b, prefix.shape[0]]
        scores = None
        if self.config.return_dict_in_generate and self.config.output_scores:
            scores = tuple(s[None] for s in [*self.scores[b], *([] if pending is None else pending)])
        stops = self._stop_checked[b, prefix.shape[0]] = bool(self.stopping(prefix[None], scores).any())
        return stops

    def _sequences(self) -> torch.Tensor:
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else min(self.eos, default=0)
        width = max(row.shape[0] for row in self.rows)
        out = self.rows[0].new_full((len(self.rows), width), pad)
        for b, row in enumerate(self.rows):
            out[b, : row.shape[0]] = row
        return out

    def per_step(self, per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """Stock's layout for scores/logits: one ``[batch, vocab]`` tensor per step; ``-inf`` after a row ended."""
        steps = max(len(r) for r in per_row)
        vocab = per_row[0][0].shape[-1]
        out = []
        for s in range(steps):
            column = [r[s] if s < len(r) else per_row[0][0].new_full((vocab,), float("-inf")) for r in per_row]
            out.append(torch.stack(column))
        return tuple(out)


def accept_sampled(p: torch.Tensor, draft: Draft, in_draft: torch.Tensor,
                   draws: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling. ``p``: the target's probabilities at each of the k+1 positions.

    Draft token x at position j is accepted with probability min(1, p(x) / q(x)); at the first rejection the
    token is resampled from max(p - q, 0), normalised; if every draft is accepted, one more is sampled from p.
    ``draws``: the uniform draws ``u`` (``[batch, k]``), when the caller decided with them already.
    """
    batch, width = draft.tokens.shape
    vocab = p.shape[-1]
    if draft.probs is None:  # deterministic drafter: q is a point mass on the drafted token
        q = torch.zeros(batch, width, vocab, device=p.device, dtype=p.dtype)
        q.scatter_(2, draft.tokens[..., None], 1.0)
    else:
        q = draft.probs.to(p.dtype)
    p_x = p[:, :width].gather(2, draft.tokens[..., None])[..., 0]
    q_x = q.gather(2, draft.tokens[..., None])[..., 0]
    u = torch.rand(batch, width, device=p.device) if draws is None else draws
    ok = u * q_x < p_x  # u < p/q (u in [0, 1)) without dividing by zero
    ok &= in_draft & (q_x > 0)
    kept = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=p.device)
    target = p[rows, kept]
    rejected = kept < draft.lengths
    residual = (target - torch.where(rejected[:, None], q[rows, kept.clamp_max(width - 1)] if width else 0, 0)).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    extra = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1)[:, 0]
    return kept, extra


def to_output(loop: SpeculativeLoop, config: GenerationConfig) -> Any:
    sequences = loop._sequences()
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=loop.per_step(loop.scores) if config.output_scores else None,
        logits=loop.per_step(loop.logits) if config.output_logits else None,
    )


# -- a drafter for any causal LM that shares the target's tokenizer -------------------------------------------
class ModelDrafter:
    """Drafts by running a (cheaper) causal LM with its own cache: a small model of the same family, or a
    quantized copy of the target. Its logits go through the call's processors (each row's, with that row's
    prefix and the tokens drafted so far), so a repetition penalty or banned words shape the drafts as they
    shape the target. Greedy when the call is greedy; otherwise it samples from that distribution and reports
    it, for exact acceptance.

    ``held[b]`` counts the tokens of ``loop.rows[b]`` its cache holds. Each proposal first feeds every row
    what it has not seen (the target's newest token; after a fully accepted draft also the last drafted one;
    after steps drafted by someone else, all of theirs) in one forward, then drafts token by token. The last
    drafted token is never fed: only the next step knows whether it was kept.
    """

    def __init__(self, model: torch.nn.Module, config: GenerationConfig, vocab_size: int) -> None:
        self.model = model
        self.sample = bool(config.do_sample)
        self.vocab_size = vocab_size
        self.held: list[int] = []

    def start(self, loop: SpeculativeLoop) -> None:
        self.lm = loop.make_lm(self.model, "draft")
        prompt = torch.stack(loop.rows)[:, :-1]
        self.lm.prefill(prompt, loop.prompt_mask)
        self.held = [prompt.shape[1]] * len(loop.rows)

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        logits = self._catch_up(loop)
        tokens, probs = [], []
        for i in range(k):
            scores = self._scores(loop, logits, tokens)
            if self.sample:
                q = scores.softmax(-1)
                token = torch.multinomial(q, 1)[:, 0]
                probs.append(q)
            else:
                token = scores.argmax(-1)
            tokens.append(token)
            if i < k - 1:
                logits = self.lm.extend(token[:, None])[:, -1]
        stacked = torch.stack(tokens, dim=1)
        return Draft(stacked, torch.full_like(stacked[:, 0], k), torch.stack(probs, 1) if probs else None)

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        fed = kept.clamp_max(draft.width - 1)  # its cache holds drafts 1..k-1 (after the catch-up)
        self.lm.keep(fed)
        # A row that ended takes no more tokens, whatever its cache kept.
        self.held = [min(held + int(n), row.numel()) for held, n, row in zip(self.held, fed, loop.rows)]

    def _catch_up(self, loop: SpeculativeLoop) -> torch.Tensor:
        """Feed each row the tokens it has not seen, right-aligned in one chunk (rows with fewer get masked
        slots first); the logits after each row's newest token, ``[batch, vocab]``."""
        missing = [row.numel() - held for row, held in zip(loop.rows, self.held)]
        width = max(missing)
        ids = loop.rows[0].new_zeros(len(missing), width)
        valid = torch.zeros_like(ids)
        for b, (row, held, n) in enumerate(zip(loop.rows, self.held, missing)):
            ids[b, width - n:] = row[held:]
            valid[b, width - n:] = 1
        logits = self.lm.extend(ids, None if min(missing) == width else valid)[:, -1]
        self.lm.keep(torch.full((len(missing),), width, device=ids.device))
        self.held = [row.numel() for row in loop.rows]
        return logits

    def _scores(self, loop: SpeculativeLoop, logits: torch.Tensor, drafted: list[torch.Tensor]) -> torch.Tensor:
        """``logits`` (``[batch, vocab]``, after each row's prefix and ``drafted``) through the call's processors."""
        if logits.shape[-1] != self.vocab_size:  # a draft vocabulary padded differently from the target's
            logits = logits[..., : self.vocab_size]
            if logits.shape[-1] < self.vocab_size:
                logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=-float("inf"))
        if not any(loop.draft_processors):
            return logits
        out = torch.empty_like(logits)
        for b, row in enumerate(loop.rows):
            prefix = torch.cat([row, *(token[b:b + 1] for token in drafted)])
            out[b] = loop.draft_processors[b](prefix[None], logits[b:b + 1].clone())[0]
        return out


class SelfDrafter(ModelDrafter):
    """A :class:`ModelDrafter` for a cheaper copy of the target itself (same layers and shapes, e.g. with
    quantized weights). It never runs its own model over the prompt or the accepted tokens: it copies the
    target's keys and values for them (exact ones, which also help it draft), and feeds only each row's
    newest token before drafting."""

    def start(self, loop: SpeculativeLoop) -> None:
        # Over the target's own cache where it can: the copy's drafts go into the slots past the target's,
        # which the target's next verification overwrites, and nothing is copied.
        self.lm = loop.make_lm(self.model, "draft", over=loop.target)
        self.lm.mirror(loop.target)
        self._synced, self._realignments = self.lm.mask.shape[1], self._moves(loop)

    def propose(self, loop: SpeculativeLoop, k: int) -> Draft:
        if self.lm.borrowed:  # the target packs its rows now if the draft's k slots would not fit
            loop.target.make_room(k)
        draft = super().propose(loop, k)
        if self.lm.borrowed:  # the drafted slots are the target's to overwrite
            self.lm.give_back()
        return draft

    def _moves(self, loop: SpeculativeLoop) -> tuple[int, int]:
        """How often either cache moved its slots (realigned or compacted): then every slot may differ."""
        return loop.target.realignments, self.lm.realignments

    def _catch_up(self, loop: SpeculativeLoop) -> torch.Tensor:
        target = loop.target
        start = self._synced if self._moves(loop) == self._realignments else 0
        self.lm.mirror(target, min(start, target.mask.shape[1]))
        self._synced, self._realignments = target.mask.shape[1], self._moves(loop)
        newest = torch.stack([row[-1] for row in loop.rows])[:, None]
        return self.lm.extend(newest)[:, -1]

    def accepted(self, loop: SpeculativeLoop, draft: Draft, kept: torch.Tensor) -> None:
        pass  # the next proposal copies what the target kept


# -- the runner a speculative backend installs ------------------------------------------------------------
_GENERATE_ARGS = ("inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                  "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
                  "negative_prompt_attention_mask", "custom_generate")
#: Calls stock ``generate`` refuses: the fallback lets it raise its own error, without a warning first.
STOCK_RAISES_FOR_STOP_STRINGS = "stop_strings without tokenizer= (stock generate raises for it)"
STOCK_RAISES_FOR_SEQUENCES = "num_return_sequences > 1 without sampling (stock generate raises for it)"
_NOT_COVERED = ("synced_gpus", "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
                "custom_generate", "assistant_tokenizer")


@dataclass
class CallPlan:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    config: GenerationConfig
    processors: list[LogitsProcessorList]  # one list per row
    draft_processors: list[LogitsProcessorList]  # the same without the user's own (a drafter's calls are extra)
    stopping: StoppingCriteriaList | None
    streamer: Any
    max_new_tokens: int


def plan_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan | str:
    """Read a ``generate`` call as stock would; a string says why the loop cannot run it exactly."""
    named = dict(zip(_GENERATE_ARGS, args))
    if len(args) > len(_GENERATE_ARGS) or set(named) & set(kwargs):
        return "positional arguments beyond generate's signature"
    named.update(kwargs)
    for name in _NOT_COVERED:
        if named.pop(name, None) is not None:
            return f"generate argument {name!r}"
    input_ids = named.pop("inputs", None)
    if input_ids is None:
        input_ids = named.pop("input_ids", None)
    else:
        named.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return "inputs other than a [batch, length] tensor of token ids"
    if model.config.is_encoder_decoder:
        return "encoder-decoder models"
    extra = {k: named.pop(k, None)
             for k in ("logits_processor", "stopping_criteria", "streamer", "prefix_allowed_tokens_fn", "tokenizer")}
    call_settings = dict(named)
    config, model_kwargs = model._prepare_generation_config(named.pop("generation_config", None), **named)
    attention_mask = model_kwargs.pop("attention_mask", None)
    why = unsupported_setting(config, model_kwargs)
    if why:
        return why
    max_new = generated_length(model, config, call_settings, input_ids)  # sets min_length as stock does too
    if max_new < 1:
        return "no tokens to generate (max_length <= prompt length)"
    if config.pad_token_id is None:
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, config)
    if config.num_return_sequences > 1:
        if not config.do_sample:  # stock refuses it without beams; let it say so
            return STOCK_RAISES_FOR_SEQUENCES
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
    if extra["streamer"] is not None and input_ids.shape[0] > 1:
        return "a streamer with batch > 1 (streamers take one row)"
    if (config.output_scores or config.output_logits) and input_ids.shape[0] > 1:
        # Stock keeps scoring rows that ended (on padding) until the last row ends; the loop stops running them.
        return "output_scores/output_logits with batch > 1"
    if extra["tokenizer"] is None and config.stop_strings:
        return STOCK_RAISES_FOR_STOP_STRINGS
    if input_ids.shape[0] > 1 and config.eos_token_id in (None, []) and (config.stop_strings or config.max_time):
        # Without an EOS token stock pads no row: a row a stop string or the clock ended keeps generating real
        # tokens until every row has ended; the loop would stop it.
        return "stop_strings or max_time with batch > 1 and no eos_token_id"
    for name in ("logits_processor", "stopping_criteria"):
        if extra[name] and input_ids.shape[0] > 1:
            # Built-in processors are built per row; a user's object is one for the whole batch and may read
            # rows by index or keep per-row state, so calling it one row at a time could change its answers.
            return f"a {name} of your own with batch > 1 (the loop calls it one row at a time)"
    model._prepare_special_tokens(config, True, input_ids.device)
    # Each row's processors are built and called as a batch of one (the prompt row it came from, for
    # prefix_allowed_tokens_fn: stock numbers expanded rows by their prompt).
    row_config = copy.copy(config)
    row_config.num_return_sequences = 1
    processors = [_row_processors(model, row_config, input_ids, attention_mask, b, b // config.num_return_sequences,
                                  extra) for b in range(len(input_ids))]
    # The user's processors and prefix_allowed_tokens_fn see exactly stock's calls; a drafter's would be extra
    # ones, about prefixes stock never builds (past an EOS, or a draft later rejected).
    users = {"logits_processor": None, "prefix_allowed_tokens_fn": None}
    draft_processors = processors if not any(extra[k] for k in users) else [
        _row_processors(model, row_config, input_ids, attention_mask, b, b // config.num_return_sequences,
                        {**extra, **users}) for b in range(len(input_ids))]
    # Stock's criteria (lengths, EOS, stop strings, time) merged with the user's as stock merges them; the loop
    # checks them per row after each token.
    stopping = model._get_stopping_criteria(config, StoppingCriteriaList(extra["stopping_criteria"] or []),
                                            tokenizer=extra["tokenizer"])
    return CallPlan(input_ids, attention_mask, config, processors, draft_processors, stopping, extra["streamer"],
                    max_new)


def _row_processors(model: Any, config: GenerationConfig, input_ids: torch.Tensor, mask: torch.Tensor, row: int,
                    prompt: int, extra: dict[str, Any]) -> LogitsProcessorList:
    """Stock's processor list for one row of the call, as ``generate`` would build it for the batch: the user's
    merged with those the settings ask for. Built per row because some processors hold per-row state (the
    row's padding, for the repetition penalty) or ask a function about their row by index."""
    allowed = extra["prefix_allowed_tokens_fn"]
    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids[row:row + 1],
        prefix_allowed_tokens_fn=None if allowed is None else (lambda _, prefix: allowed(prompt, prefix)),
        logits_processor=LogitsProcessorList(extra["logits_processor"] or []), device=input_ids.device,
        model_kwargs={"attention_mask": mask[row:row + 1]})


def _infer_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Stock's rule: the pad token marks padding, unless it is also the EOS token."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


class SpeculativeRunner:
    """Installed as ``state.runner`` by a speculative backend; runs each generate call it can cover.

    Where the patch has a compiled decode step (``compile=``), the loop's forward passes after the prompt run
    through it over fixed-length :class:`~hf_accel.kv_cache.RollbackStaticCache` caches: the target's
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
        self._compiled: dict[int, Any] = {}  # id(draft model) -> its compiled forward (the target uses the patch's)
        #: The models the drafters run (a quantized copy a backend made, a user's draft model).
        self.drafts = drafts

    def __repr__(self) -> str:
        return f"<SpeculativeRunner k={self.draft_length.k} {self.stats.as_details()}>"

    def cache_bytes(self) -> int:
        """Bytes the draft models' compiled steps keep in their caches (the target's are the compile report's)."""
        return sum(step.cache_bytes() for step in list(self._compiled.values()) if step is not None)

    def __call__(self, call: Any) -> Any:
        plan = plan_call(call.model, call.args, call.kwargs)
        self.stats.calls += 1
        if isinstance(plan, str):
            return self._fallback(call, plan)
        drafter = self.make_drafter(call.model, plan.config)
        compiled: list[Any] = []  # the compiled forwards this call runs, told how long it was when it ends
        loop = SpeculativeLoop(call.model, drafter, plan.config, plan.processors, plan.stopping, plan.streamer,
                               plan.max_new_tokens, self.draft_length,
                               make_lm=lambda model, role="target", over=None: self._cached_lm(
                                   call, plan, model, role, compiled, over),
                               draft_processors=plan.draft_processors)
        try:
            with torch.no_grad():
                loop.run(plan.input_ids, plan.attention_mask)
        finally:  # each compiled forward learns how long the call was (its eager seconds per token)
            made = max((row.shape[0] for row in loop.rows), default=loop.prompt_length) - loop.prompt_length
            for step in compiled:
                step.end_call(made)
        self.stats.add(loop.stats)
        self.details.update(self.stats.as_details(), draft_length=self.draft_length.k)
        return to_output(loop, plan.config)

    def _cached_lm(self, call: Any, plan: CallPlan, model: torch.nn.Module, role: str, compiled: list[Any],
                   over: CachedLM | None = None) -> CachedLM:
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

    def _step_for(self, base: Any, model: torch.nn.Module, role: str) -> Any:
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

    def _fallback(self, call: Any, reason: str) -> Any:
        self.stats.fallbacks += 1
        reasons = self.details.setdefault("fallback_reasons", {})
        reasons[reason] = reasons.get(reason, 0) + 1
        self.details.update(self.stats.as_details())
        if reason not in self._logged and reason not in (STOCK_RAISES_FOR_STOP_STRINGS, STOCK_RAISES_FOR_SEQUENCES):
            self._logged.add(reason)
            logger.warning("hf_accel: speculative decoding does not cover %s, so this call (and any like it) runs "
                           "stock generate with the patch's cache and compiled step but no speculation; drop that "
                           "setting to keep it (docs/features.md lists what is covered)", reason)
        return call.run_stock()


def object_request_problem(context: Any) -> str | None:
    """For drafters that need nothing from the user: refuse ``speculative=<some object>``."""
    if isinstance(context.request, (str, bool)):
        return None
    return f"speculative={type(context.request).__name__} asks for a draft-model backend"


def install_runner(context: Any, make_drafter: DrafterFactory, draft_length: DraftLength,
                   drafts: tuple[torch.nn.Module, ...] = ()) -> None:
    """What a speculative backend's ``apply`` does: route this model's generate calls through the loop.
    ``drafts``: the models its drafters run (a quantized copy the backend made, a user's draft model)."""
    runner = SpeculativeRunner(make_drafter, context.report.details, draft_length, drafts)
    context.changes.setattr(context.state, "runner", runner)
    context.account_memory("draft models' static caches", runner.cache_bytes)
