"""Drafters that run a causal LM sharing the target's tokenizer: a small model of the same family, or a
cheaper copy of the target itself. Shared by the speculative plugins."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from hf_accel.plugin import Draft, SpeculativeLoop


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
        # Rows that ended stay 0: their drafts are dropped unverified (Draft.only), so they are not worth
        # processing, but they must be finite to sample from (raw logits may hold what remove_invalid_values removes).
        out = torch.zeros_like(logits)
        for b, row in enumerate(loop.rows):
            if bool(loop.finished[b]):
                continue
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
