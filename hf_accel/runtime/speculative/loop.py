"""The speculative draft/verify loop that replaces ``generate`` (greedy and sampling, batch > 1).

Each step: the drafter proposes up to ``k`` tokens per row; the target scores the row's newest token plus
all drafted ones in one forward pass; each row keeps its longest agreeing prefix plus one token from the
target; the caches forget the rest. Greedy output is the target's own greedy output. Sampling uses exact
speculative sampling (accept with min(1, p/q), else resample from max(p - q, 0)), so tokens follow the
target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from transformers import GenerationConfig, MaxTimeCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_accel.runtime.cached_lm import CachedLM, can_share
from hf_accel.runtime.speculative.processing import RowProcessors


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


def eager_lm(model: torch.nn.Module, role: str = "target", over: CachedLM | None = None) -> CachedLM:
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


class SpeculativeLoop:
    """One ``generate`` call's worth of speculative decoding over a batch.

    ``rows[b]`` holds row b's left-padded prompt and every token generated so far; the target's cache holds
    all of them but the newest, which is verified together with the next draft.
    """

    def __init__(self, model: torch.nn.Module, drafter: Drafter, config: GenerationConfig,
                 processors: Sequence[RowProcessors], stopping: StoppingCriteriaList | None, streamer: Any,
                 max_new_tokens: int, draft_length: DraftLength, make_lm: LMFactory | None = None,
                 draft_processors: Sequence[RowProcessors] | None = None) -> None:
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
        # max_time is asked once per step for the whole batch (see _check_deadline); the rest per row and token.
        self.stopping, self.deadline = split_deadline(stopping)
        self.streamer = streamer
        self.max_new_tokens = max_new_tokens
        self.draft_length = draft_length
        eos = config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.rows: list[torch.Tensor] = []
        self.prompt_length = 0
        # Per-step scores and logits are kept only where the call returns them, as stock keeps them.
        self.keeps_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.keeps_logits = bool(config.return_dict_in_generate and config.output_logits)
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
        self._check_deadline()
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
        self._check_deadline()  # after the drafter saw the step: it ends the loop, and may cut rows

    # -- acceptance ---------------------------------------------------------------------------------------
    def _accept(self, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: how many drafted tokens to keep, the row's new tokens (kept drafts, then one from the
        target, at index ``kept``), and the processed scores at each position."""
        width = draft.width
        in_draft = torch.arange(width, device=logits.device)[None, :] < draft.lengths[:, None]
        # Drawn first: with processors, each row is processed only up to its first rejection, decided by these.
        draws = torch.rand(len(self.rows), width, device=logits.device) if self.config.do_sample else None
        scores, decided = self._process(logits, draft, draws)
        if self.config.do_sample:
            kept, extra = accept_sampled(scores.softmax(-1), draft, in_draft, draws, kept=decided)
        else:
            choice = scores.argmax(-1)
            kept = decided if decided is not None else (
                ((choice[:, :width] == draft.tokens) & in_draft).long().cumprod(-1).sum(-1))
            extra = choice.gather(1, kept[:, None])[:, 0]
        tokens = torch.cat([draft.tokens, extra[:, None]], dim=1)
        tokens.scatter_(1, kept[:, None], extra[:, None])
        return kept, tokens, scores

    def _process(self, logits: torch.Tensor, draft: Draft,
                 draws: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits processors at each position with the prefix stock generate would pass, row by row, up to
        the row's first rejected draft: later positions hold prefixes stock never builds (a processor may
        keep state or refuse them), and their scores are never used. Also how many drafts each row keeps:
        decided here, where the processing stops, so that the two can never disagree (None without
        processors)."""
        self._stop_checked = {}
        if not any(self.processors):
            return logits, None
        out = logits.clone()
        kept = torch.zeros(len(self.rows), dtype=torch.long, device=logits.device)
        for b, row in enumerate(self.rows):
            prefix = row
            for j in range(logits.shape[1]):
                stops = j > 0 and self._stops(b, prefix, out[b, :j])  # asked after every token, as stock asks
                if bool(self.finished[b]) or self._ends(prefix, with_token=j > 0) or stops:
                    out[b, j] = 0  # stock makes no more tokens for this row: a finite row to draw a discarded one
                    break
                # The logits themselves, as stock passes them: what a processor writes in place (a user's ban)
                # is in the logits the call returns, as in stock's.
                out[b, j] = self.processors[b](prefix[None], logits[b, j][None])[0]
                if j >= int(draft.lengths[b]) or not self._keeps(out[b, j], draft, b, j, draws):
                    break
                kept[b] = j + 1
                prefix = torch.cat([prefix, draft.tokens[b, j : j + 1]])
        return out, kept

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
                if self.keeps_scores:  # copies, so that a chunk's [batch, k+1, vocab] tensor is not kept
                    self.scores[b].append(scores[b, j].clone())
                if self.keeps_logits:
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
        if self.keeps_scores:
            scores = tuple(s[None] for s in [*self.scores[b], *([] if pending is None else pending)])
        stops = self._stop_checked[b, prefix.shape[0]] = bool(self.stopping(prefix[None], scores).any())
        return stops

    def _check_deadline(self) -> None:
        """Stock asks ``max_time`` after each step for the whole batch, so every row still running ends at the
        same length; here rows gain different numbers of tokens per step, so once the time is up every row is
        cut to the shortest running row's length: with greedy decoding, what stock returns when its time runs out
        at that step (with sampling the length also depends on the tokens drawn). ``stats.accepted`` keeps the
        drafts verified before the cut; ``stats.generated`` counts only the tokens returned."""
        if self.deadline is None or bool(self.finished.all()):
            return
        if not bool(self.deadline(self.rows[0][None], None).any()):  # the same answer for every row
            return
        length = min(row.shape[0] for row, done in zip(self.rows, self.finished.tolist()) if not done)
        for b in range(len(self.rows)):
            self.stats.generated -= max(self.rows[b].shape[0] - length, 0)
            self.rows[b] = self.rows[b][:length]
            del self.scores[b][length - self.prompt_length:], self.logits[b][length - self.prompt_length:]
        self.finished[:] = True

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


def split_deadline(
        stopping: StoppingCriteriaList | None) -> tuple[StoppingCriteriaList | None, StoppingCriteriaList | None]:
    """``stopping`` without its ``max_time`` criteria (transformers' own class: a subclass may do more), and
    those criteria (None where there are none)."""
    if not stopping:
        return stopping, None
    timed = [c for c in stopping if type(c) is MaxTimeCriteria]
    rest = StoppingCriteriaList([c for c in stopping if type(c) is not MaxTimeCriteria])
    return rest, StoppingCriteriaList(timed) if timed else None


def accept_sampled(p: torch.Tensor, draft: Draft, in_draft: torch.Tensor, draws: torch.Tensor | None = None,
                   kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling. ``p``: the target's probabilities at each of the k+1 positions.

    Draft token x at position j is accepted with probability min(1, p(x) / q(x)); at the first rejection the
    token is resampled from max(p - q, 0), normalised; if every draft is accepted, one more is sampled from p.
    ``draws``: the uniform draws ``u`` (``[batch, k]``); ``kept``: what the caller decided with them already.
    """
    batch, width = draft.tokens.shape
    vocab = p.shape[-1]
    if draft.probs is None:  # deterministic drafter: q is a point mass on the drafted token
        q = torch.zeros(batch, width, vocab, device=p.device, dtype=p.dtype)
        q.scatter_(2, draft.tokens[..., None], 1.0)
    else:
        q = draft.probs.to(p.dtype)
    if kept is None:
        p_x = p[:, :width].gather(2, draft.tokens[..., None])[..., 0]
        q_x = q.gather(2, draft.tokens[..., None])[..., 0]
        u = torch.rand(batch, width, device=p.device) if draws is None else draws
        ok = u * q_x < p_x  # u < p/q (u in [0, 1)) without dividing by zero
        ok &= in_draft & (q_x > 0)
        kept = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=p.device)
    target = p[rows, kept]
    rejected = kept < draft.lengths
    drafted = q[rows, kept.clamp_max(width - 1)] if width else 0
    residual = (target - torch.where(rejected[:, None], drafted, 0)).clamp_min(0)
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
