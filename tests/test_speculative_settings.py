"""Generation settings under speculation: each covered one gives stock's tokens; the others fall back to stock
generate visibly; docs/features.md's table is the code's."""

from __future__ import annotations

import inspect
import itertools
import logging
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, left_padded_batch, make_tiny_model, word_tokenizer
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import stopping_criteria
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

import hf_accel
from hf_accel.runtime.speculative import loop as speculative_loop
from hf_accel.runtime.speculative.plan import _GENERATE_ARGS, unsupported_setting
from hf_accel.runtime.speculative.processing import RowProcessors
from hf_accel.runtime.speculative.settings import SETTINGS, blocking_settings, known_fields, settings_table
from hf_accel_plugins.drafters import ModelDrafter


def one_word_per_token():
    """A tokenizer with one word per token id of the tiny models (w4 ... w511 by their ids), after the word
    stock's stop-string matcher probes every tokenizer with."""
    return word_tokenizer(["abcdef"] + [f"w{i}" for i in range(4, VOCAB)])


#: Per covered setting, generate arguments made from a reference greedy run (so that they bite on its tokens).
CASES = {
    "repetition_penalty": lambda ref, n: {"repetition_penalty": 1.3},
    "encoder_repetition_penalty": lambda ref, n: {"encoder_repetition_penalty": 1.5},
    "no_repeat_ngram_size": lambda ref, n: {"no_repeat_ngram_size": 2},
    "min_new_tokens": lambda ref, n: {"eos_token_id": int(ref[0, n + 1]), "min_new_tokens": 9},
    "min_length": lambda ref, n: {"eos_token_id": int(ref[1, n + 2]), "min_length": n + 10},
    "min_new_tokens over min_length": lambda ref, n: {"eos_token_id": int(ref[0, n]), "min_new_tokens": 1,
                                                      "min_length": n + 15},  # stock: min_new_tokens wins
    "several eos ids": lambda ref, n: {"eos_token_id": [int(ref[0, n + 5]), int(ref[1, n + 2])], "min_new_tokens": 4},
    "bad_words_ids": lambda ref, n: {"bad_words_ids": [[int(ref[0, n + 3])], [int(ref[1, n + 4]), int(ref[1, n + 5])]]},
    "sequence_bias": lambda ref, n: {"sequence_bias": {(int(ref[0, n + 2]),): -4.0, (int(ref[2, n + 6]),): 3.0}},
    "suppress_tokens": lambda ref, n: {"suppress_tokens": [int(ref[2, n + 1]), int(ref[0, n + 5])]},
    "begin_suppress_tokens": lambda ref, n: {"begin_suppress_tokens": [int(ref[0, n]), int(ref[1, n])]},
    "forced_eos_token_id": lambda ref, n: {"forced_eos_token_id": 7},
    "exponential_decay_length_penalty": lambda ref, n: {"eos_token_id": int(ref[2, n + 8]),
                                                        "exponential_decay_length_penalty": (3, 1.6)},
    "prefix_allowed_tokens_fn": lambda ref, n: {
        "prefix_allowed_tokens_fn": lambda row, ids: list(range(3 + 100 * row, 103 + 100 * row))},
    "max_time": lambda ref, n: {"max_time": 1e-9},  # stops after the first token, as stock does
    "several": lambda ref, n: {"repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "min_new_tokens": 6,
                               "eos_token_id": int(ref[0, n + 1])},
}


def recorded_proposals(monkeypatch) -> list[tuple[int, int, list[int]]]:
    """Every proposal of a :class:`ModelDrafter` from now on: (row, where its draft starts, the drafted tokens),
    for the rows still running."""
    proposals = []
    propose = ModelDrafter.propose

    def recording(drafter, loop, k):
        draft = propose(drafter, loop, k)
        proposals.extend((b, row.numel(), draft.tokens[b, : int(draft.lengths[b])].tolist())
                         for b, row in enumerate(loop.rows) if not bool(loop.finished[b]))
        return draft

    monkeypatch.setattr(ModelDrafter, "propose", recording)
    return proposals


def drafted_tokens_stock_made(proposals, expected: torch.Tensor, prompt_length: int, eos: set[int]) -> int:
    """Asserts that every drafted token inside a row's output is the one ``expected`` holds there; how many were."""
    made = [row[prompt_length:].tolist() for row in expected]
    ends = [prompt_length + next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in made]
    checked = 0
    for b, start, tokens in proposals:
        for j, token in enumerate(tokens[: max(ends[b] - start, 0)]):
            assert token == int(expected[b, start + j]), (b, start + j, token, expected[b, prompt_length:ends[b]])
            checked += 1
    return checked


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_covered_setting_gives_stocks_tokens_with_speculation(case, drafter, monkeypatch):
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model)
    n = ids.shape[1]
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    setting = CASES[case](reference, n)
    kwargs = {"max_new_tokens": 20, "do_sample": False, **setting}
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    # The setting itself changes stock's output (against the same call with only its EOS): identity is not trivial.
    same_eos = {k: v for k, v in kwargs.items() if k in ("max_new_tokens", "do_sample", "eos_token_id")}
    assert not torch.equal(expected, model.generate(input_ids=ids, attention_mask=mask, **same_eos))
    speculative = make_tiny_model("llama") if drafter == "draft_model" else "ngram"
    hf_accel.patch(model, compile=None, speculative=speculative)
    before = dict(hf_accel.report(model)["speculative"].details)  # patch's own check ran a call
    proposals = recorded_proposals(monkeypatch)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    details = hf_accel.report(model)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["calls"] == before["calls"] + 1
    if case == "max_time":  # which stops every row at its first token, before any draft
        return
    assert details["drafted"] > before["drafted"]
    # The user's prefix_allowed_tokens_fn is asked only about the prefixes stock asks about: drafts skip it.
    if drafter == "draft_model" and case != "prefix_allowed_tokens_fn":
        # A draft model with the target's weights whose logits pass the same processors drafts, inside each
        # row's output, exactly stock's tokens; one that skipped the processors failed 12 of these cases.
        eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
        eos = set(eos if isinstance(eos, list) else [eos])
        assert drafted_tokens_stock_made(proposals, expected, n, eos) >= 8


def test_a_model_cards_settings_apply_and_the_calls_own_override_them(llama):
    ids, mask = left_padded_batch(llama)
    reference = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    llama.generation_config.repetition_penalty = 1.3
    llama.generation_config.no_repeat_ngram_size = 2
    from_card = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    overridden = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                repetition_penalty=1.6)
    assert not torch.equal(from_card, reference) and not torch.equal(overridden, from_card)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False),
                       from_card)
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                      repetition_penalty=1.6), overridden)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["accepted"] > 0


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "top-1 sampling"])
def test_the_keep_decisions_made_while_processing_are_the_ones_applied(llama, monkeypatch, do_sample):
    """Processing stops at a row's first rejected draft, so positions after it hold unprocessed scores: the
    tokens kept must be the ones processing decided on, never a second reading of those scores. Here every
    decision is a rejection (the drafts themselves, the target's own weights, would all be right)."""
    ids, mask = left_padded_batch(llama)
    kwargs = dict(max_new_tokens=12, do_sample=do_sample, repetition_penalty=1.3, **({"top_k": 1} if do_sample else {}))
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))
    before = dict(hf_accel.report(llama)["speculative"].details)  # patch's own check ran a call
    monkeypatch.setattr(speculative_loop.SpeculativeLoop, "_keeps", lambda *args: False)
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    details = hf_accel.report(llama)["speculative"].details
    assert details["drafted"] > before["drafted"] and details["accepted"] == before["accepted"]


def test_a_call_without_a_length_makes_as_many_new_tokens_as_stock(llama):
    ids, mask = left_padded_batch(llama)  # generation_config.max_length 20: stock makes 20 new tokens
    expected = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 20 and torch.equal(out, expected)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_no_bigram_of_the_prompt_again(llama, drafter):
    """encoder_no_repeat_ngram_size, on a prompt that ends in the model's own (repetitive) continuation, so
    that the ban bites."""
    ids, mask = left_padded_batch(llama)
    ids = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    mask = torch.cat([mask, torch.ones(len(ids), 12, dtype=mask.dtype)], dim=1)
    reference = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              encoder_no_repeat_ngram_size=2)
    assert not torch.equal(expected, reference)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama") if drafter == "draft_model" else "ngram")
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                      encoder_no_repeat_ngram_size=2), expected)
    assert hf_accel.report(llama)["speculative"].details["fallbacks_to_stock"] == 0


def test_a_forced_first_token_after_a_one_token_prompt(llama):
    """forced_bos_token_id forces the token after a length-1 input (where an encoder-decoder starts)."""
    ids, mask = left_padded_batch(llama, (1, 1))
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              forced_bos_token_id=5)
    assert expected[:, 1].tolist() == [5, 5]
    hf_accel.patch(llama, compile=None, speculative="ngram")
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      forced_bos_token_id=5), expected)
    assert hf_accel.report(llama)["speculative"].details["fallbacks_to_stock"] == 0


@pytest.mark.parametrize("where", ["model's generation config", "generation_config argument", "call argument"])
def test_a_max_length_set_anywhere_counts_the_prompt_as_stock_counts_it(llama, where):
    ids, mask = left_padded_batch(llama)  # 7 wide: max_length 12 leaves 5 new tokens
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    if where == "model's generation config":
        llama.generation_config.max_length = 12
    elif where == "generation_config argument":
        kwargs["generation_config"] = GenerationConfig(max_length=12, do_sample=False)
    else:
        kwargs["max_length"] = 12
    expected = llama.generate(**kwargs)
    assert expected.shape[1] == 12
    hf_accel.patch(llama, compile=None, speculative="ngram")
    assert torch.equal(llama.generate(**kwargs), expected)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


def test_allowed_tokens_by_prompt_and_prefix_with_several_sequences_per_prompt(llama):
    """prefix_allowed_tokens_fn is asked with the prompt's index (as stock numbers expanded rows) and the
    row's prefix; three sequences per prompt."""
    ids, mask = left_padded_batch(llama)
    asked = set()

    def allowed(batch_id, prefix):
        asked.add(batch_id)
        last = int(prefix[-1])
        return [(last * 7 + batch_id * 13 + i) % 500 + 3 for i in range(5)]

    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=1, num_return_sequences=3,
                  prefix_allowed_tokens_fn=allowed)
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    stock_asked, asked = asked, set()
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))  # the target's weights: drafts kept
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    assert asked == stock_asked == {0, 1, 2}
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "top-1 sampling"])
def test_a_trie_of_allowed_continuations_is_asked_only_about_prefixes_stock_builds(llama, do_sample, drafter):
    """A constraint that allows exactly one path and returns [] off it (which the processor refuses): drafts
    that leave the path are rejected without the function being asked about the prefixes they make, and a
    draft model drafts without asking it."""
    ids, mask = left_padded_batch(llama)
    width = ids.shape[1]
    path = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    asked = set()

    def allowed(batch_id, prefix):
        asked.add((batch_id, tuple(prefix.tolist())))
        n = prefix.shape[0]
        return [int(path[batch_id, n])] if n < path.shape[1] and torch.equal(prefix, path[batch_id, :n]) else []

    kwargs = dict(max_new_tokens=16, prefix_allowed_tokens_fn=allowed, do_sample=do_sample,
                  **({"top_k": 1} if do_sample else {}))
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(expected[:, width:], path[:, width:])
    stock_asked, asked = asked, set()
    draft = make_tiny_model("llama", seed=3) if drafter == "draft_model" else "ngram"  # drafts off the path
    hf_accel.patch(llama, compile=None, speculative=draft)
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    assert asked <= stock_asked and hf_accel.report(llama)["speculative"].details["drafted"] > 0


def test_rows_a_stop_string_ends_without_an_eos_token_run_stock(llama):
    """Without an EOS token stock pads no row: one that a stop string ended keeps generating until all have
    ended, which the loop does not do."""
    llama.generation_config.eos_token_id = None
    ids, mask = left_padded_batch(llama)
    tokenizer = one_word_per_token()
    hf_accel.patch(llama, compile=None, speculative="ngram")
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, stop_strings=["w9"],
                   tokenizer=tokenizer)
    assert hf_accel.report(llama)["speculative"].details["fallback_reasons"] == {
        "stop_strings with batch > 1 and no eos_token_id": 1}


@pytest.mark.parametrize("settings", [{"renormalize_logits": True}, {"remove_invalid_values": True}])
def test_settings_that_reshape_scores_give_stocks_scores(llama, settings):
    ids, mask = left_padded_batch(llama, (9,))
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, **settings)
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))  # scores at drafted positions too
    out = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0
    for ours, stock in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", [{"guidance_scale": 1.0}, {"low_memory": True}, {"penalty_alpha": 0.0},
                                      {"use_cache": False}])
def test_settings_that_do_nothing_do_not_turn_speculation_off(llama, settings):
    ids, mask = left_padded_batch(llama)
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **settings)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **settings)
    assert torch.equal(out, expected)
    assert hf_accel.report(llama)["speculative"].details["fallbacks_to_stock"] == 0


def test_several_returned_sequences_are_expanded_as_stock_expands_them(llama):
    ids, mask = left_padded_batch(llama)
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3)  # top-1: comparable
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert out.shape[0] == 9 and torch.equal(out, expected)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


class Recorder(LogitsProcessor, StoppingCriteria):
    """A user's processor and stopping criterion that records every prefix it is asked about; as a processor it
    also bans one token, so that it changes the output."""

    def __init__(self, banned: int, stop_after: int | None = None) -> None:
        self.banned, self.stop_after = banned, stop_after
        self.prefixes: list[tuple[int, ...]] = []

    def __call__(self, input_ids, scores):
        self.prefixes.append(tuple(input_ids[0].tolist()))
        if isinstance(scores, torch.Tensor) and scores.dim() == 2:  # called as a processor
            return scores.index_fill(-1, torch.tensor([self.banned]), -float("inf"))
        return torch.tensor([self.stop_after is not None and len(self.prefixes) >= self.stop_after])


@pytest.mark.parametrize("stop_after", [20, None], ids=["criterion-stops", "budget-stops"])
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "top-1 sampling"])
def test_a_users_processor_and_stopping_criterion_see_exactly_stocks_calls(drafter, do_sample, stop_after):
    """With one row, a user's processor is asked once per new token about the prefix before it, and the user's
    criterion once per token about the prefix after it, in order: as in stock, drafts never reach them."""
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (13,))  # its greedy continuation repeats a cycle: lookups are kept
    n = ids.shape[1]
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)

    def run(target):
        processor, criterion = Recorder(int(reference[0, n + 14])), Recorder(0, stop_after=stop_after)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=do_sample,
                              logits_processor=LogitsProcessorList([processor]),
                              stopping_criteria=StoppingCriteriaList([criterion]),
                              **({"top_k": 1} if do_sample else {}))
        return out, processor.prefixes, criterion.prefixes

    expected, stock_processed, stock_stopped = run(model)
    assert expected.shape[1] == n + (stop_after or 24)  # the user's criterion ended it, or the budget
    assert not torch.equal(expected, reference[:, :expected.shape[1]])  # the ban changed it
    hf_accel.patch(model, compile=None, speculative=make_tiny_model("llama") if drafter == "draft_model" else "ngram")
    out, processed, stopped = run(model)
    assert torch.equal(out, expected)
    assert processed == stock_processed and stopped == stock_stopped
    details = hf_accel.report(model)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["accepted"] > 0


@pytest.mark.parametrize("argument", ["logits_processor", "stopping_criteria"])
def test_a_users_processor_or_criterion_with_a_batch_runs_stock(llama, argument, caplog):
    """Built for the whole batch, it may read rows by index or keep per-row state: the loop does not call it
    one row at a time."""
    ids, mask = left_padded_batch(llama)
    def user():  # a fresh one per call: the criterion counts its calls
        return {"logits_processor": LogitsProcessorList([Recorder(5)]),
                "stopping_criteria": StoppingCriteriaList([Recorder(0, stop_after=6)])}[argument]

    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              **{argument: user()})
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             **{argument: user()})
    assert torch.equal(out, expected)
    reasons = hf_accel.report(llama)["speculative"].details["fallback_reasons"]
    assert reasons == {f"a {argument} of your own with batch > 1 (the loop calls it one row at a time)": 1}
    assert argument in caplog.text


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_stop_strings_end_each_row_where_stock_ends_it(drafter):
    """Two stop strings taken from the reference output, so that two rows stop at different lengths (one on a
    drafted token, one on a string that spans two tokens) and the third runs to its budget; the rows that
    stopped are padded as stock pads them."""
    tokenizer = one_word_per_token()
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model)
    n = ids.shape[1]
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    word = tokenizer.convert_ids_to_tokens
    stops = [word(int(reference[0, n + 4])),  # decoded, tokens are space-separated: the second spans two
             word(int(reference[2, n + 10]))[1:] + " " + word(int(reference[2, n + 11]))]
    kwargs = dict(max_new_tokens=20, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    stopped = (expected[:, n:] == model.generation_config.pad_token_id).any(-1)
    assert stopped.tolist() == [True, False, True]
    pad = model.generation_config.pad_token_id  # row 2 ended by the two-token string:
    assert torch.equal(expected[2, :n + 12], reference[2, :n + 12]) and (expected[2, n + 12:] == pad).all()
    speculative = make_tiny_model("llama") if drafter == "draft_model" else "ngram"
    hf_accel.patch(model, compile=None, speculative=speculative)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    details = hf_accel.report(model)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


@pytest.mark.parametrize("eos", ["the model's", "none", "one row's early token"])
def test_max_time_ends_every_row_at_one_step_with_stocks_tokens(llama, monkeypatch, eos):
    """``max_time`` on a clock that moves one second per reading, asked once per step as stock asks it: the
    call ends early, mid-loop, and every row holds stock's tokens up to one length (stock's step when its time
    ran out), though the rows had gained different numbers of tokens by then. Without an EOS token too (no row
    ends before the others, so none needs padding), and with one that ends a row before the cut (padded)."""
    ids, mask = left_padded_batch(llama)
    n, budget = ids.shape[1], 24
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=budget, do_sample=False)
    if eos == "none":
        llama.generation_config.eos_token_id = None
    elif eos == "one row's early token":
        call["eos_token_id"] = int(llama.generate(**call)[1, n + 1])
    reference = llama.generate(**call)
    readings = itertools.count()
    monkeypatch.setattr(stopping_criteria, "time", types.SimpleNamespace(time=lambda: float(next(readings))))
    hf_accel.patch(llama, compile=None, speculative="ngram")
    before = dict(hf_accel.report(llama)["speculative"].details)  # patch's own check ran a call
    at_the_cut = []
    check = speculative_loop.SpeculativeLoop._check_deadline

    def recording(loop):
        lengths = [row.shape[0] for row in loop.rows]
        check(loop)
        if [row.shape[0] for row in loop.rows] != lengths:  # the cut shortened a row
            at_the_cut.append(lengths)

    monkeypatch.setattr(speculative_loop.SpeculativeLoop, "_check_deadline", recording)
    out = llama.generate(**call, max_time=4.0)
    made = out.shape[1] - n
    assert 2 <= made < budget and torch.equal(out, reference[:, : n + made]), (made, out[:, n:], reference[:, n:])
    assert len(at_the_cut) == 1 and len(set(at_the_cut[0])) > 1  # the rows were not level: the cut made them so
    if eos == "one row's early token":
        assert (out[1, n + 2:] == llama.generation_config.pad_token_id).all()
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["calls"] == before["calls"] + 1
    assert details["accepted"] > before["accepted"]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "top-1 sampling"])
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_invalid_logits_are_removed_as_stock_removes_them(drafter, do_sample):
    """A head that gives one token NaN logits: greedy stock picks it, unless ``remove_invalid_values`` turns
    them into zeros; the loop must process them the same way at every position, and never draw from a
    position it left unprocessed (a row's budget ends inside drafts of the target's own weights; a row that
    ended early rides along in the draft model's batch)."""
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model)
    n = ids.shape[1]
    eos = int(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[1, n + 3])
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                               eos_token_id=eos)

    def nan_column(module, args, out):
        return out.index_fill(-1, torch.tensor([9]), float("nan"))

    model.lm_head.register_forward_hook(nan_column)
    kwargs = dict(max_new_tokens=16, do_sample=do_sample, remove_invalid_values=True, eos_token_id=eos,
                  **({"top_k": 1} if do_sample else {}))
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(expected, reference)  # NaN made zero: below the best logit everywhere here
    unprocessed = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert (unprocessed[:, n:] == 9).all()  # without the processor, NaN wins every argmax
    draft = make_tiny_model("llama")
    draft.lm_head.register_forward_hook(nan_column)
    hf_accel.patch(model, compile=None, speculative=draft if drafter == "draft_model" else "ngram")
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    details = hf_accel.report(model)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


def test_stop_strings_without_a_tokenizer_fail_as_in_stock(llama):
    ids, mask = left_padded_batch(llama, (5,))
    with pytest.raises(ValueError, match="tokenizer") as stock_error:
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, stop_strings=["x"])
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with pytest.raises(ValueError, match="tokenizer") as patched_error:
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, stop_strings=["x"])
    assert str(patched_error.value) == str(stock_error.value)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("positional, call, match", [
    ((), {"max_length": 3}, "max_length"),  # 7 wide: max_length 3 leaves nothing to generate
    ((), {"max_new_token": 4}, "max_new_token"),  # misspelt
    ((), {"inputs": "the ids"}, "inputs"),  # the token ids twice
    (("the ids",), {"inputs": "the ids"}, "multiple values"),  # both positionally and by name
    (("the ids",) + (None,) * (len(_GENERATE_ARGS) - 1) + ("one more",), {}, "positional argument"),  # too many
], ids=["nothing-to-generate", "misspelt", "inputs-twice", "positional-and-named", "too-many-positional"])
def test_a_call_stock_refuses_gets_stocks_error_without_a_warning(llama, caplog, strict, positional, call, match):
    ids, mask = left_padded_batch(llama)
    positional = tuple(ids if v == "the ids" else v for v in positional)
    call = {k: ids if v == "the ids" else v for k, v in call.items()}
    if not positional:
        call["input_ids"] = ids
    with pytest.raises((ValueError, TypeError), match=match) as stock_error:
        llama.generate(*positional, attention_mask=mask, do_sample=False, **call)
    hf_accel.patch(llama, compile=None, speculative="ngram", strict=strict)
    with caplog.at_level(logging.WARNING, logger="hf_accel"), pytest.raises((ValueError, TypeError)) as patched_error:
        llama.generate(*positional, attention_mask=mask, do_sample=False, **call)
    assert type(patched_error.value) is type(stock_error.value)
    assert str(patched_error.value) == str(stock_error.value)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_model_class_with_its_own_generate_keeps_speculation_for_positional_ids(llama, caplog):
    """A class's generate(self, *args, **kwargs) over stock's (as some model classes and remote code have): the
    token ids passed by position are still read as stock's ``inputs``."""
    ids, mask = left_padded_batch(llama)
    expected = llama.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)

    class OwnGenerate(type(llama)):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    llama.__class__ = OwnGenerate
    hf_accel.patch(llama, compile=None, speculative="ngram")
    before = dict(hf_accel.report(llama)["speculative"].details)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        assert torch.equal(llama.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), expected)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == before["fallbacks_to_stock"] and details["calls"] == before["calls"] + 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_fallback_warns_once_per_reason_and_is_counted(llama, caplog):
    ids, mask = left_padded_batch(llama, (5,))
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        for _ in range(2):
            llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "num_beams" in r.getMessage()]
    assert len(warnings) == 1 and "drop num_beams=2 from the call" in warnings[0].getMessage()
    reasons = hf_accel.report(llama)["speculative"].details["fallback_reasons"]
    assert reasons == {"generation setting num_beams (beam search)": 2}
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)
    assert hf_accel.report(llama)["speculative"].details["fallback_reasons"] == {
        "generation setting num_beams (beam search)": 3}  # one reason per setting, whatever its value


def test_a_fallback_names_every_setting_that_blocks_the_call(llama, caplog):
    ids, mask = left_padded_batch(llama, (5,))
    hf_accel.patch(llama, compile=None, speculative="ngram")
    llama.generation_config.guidance_scale = 1.5  # a model card's, beside the call's own
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "drop num_beams=2, guidance_scale=1.5 from the call" in warnings[0], warnings
    long = unsupported_setting(llama, GenerationConfig(dola_layers=list(range(0, 40, 2)), num_beams=2), {})
    assert long.remedy.startswith("drop num_beams=2, dola_layers=[0, 2, 4, 6, ...] from the call")


THREE_ROWS, ONE_PROMPT = (7, 3, 5), (5,)


@pytest.mark.parametrize("call, remedy, lengths", [
    ({"output_scores": True, "return_dict_in_generate": True}, "call generate with one row at a time, or without",
     THREE_ROWS),
    ({"stop_strings": ["w9"], "tokenizer": one_word_per_token(),
      "eos_token_id": []}, "eos_token_id", THREE_ROWS),
    ({"logits_processor": LogitsProcessorList([Recorder(5)])}, "call generate with one row at a time", THREE_ROWS),
    # One prompt made rows by num_return_sequences: "one row at a time" would not help.
    ({"output_scores": True, "return_dict_in_generate": True, "do_sample": True, "num_return_sequences": 2},
     "one prompt at a time and num_return_sequences=1", ONE_PROMPT),
], ids=["scores", "no-eos", "users-processor", "expanded-rows"])
def test_a_fallback_that_no_setting_causes_says_what_to_change_instead(llama, caplog, call, remedy, lengths):
    ids, mask = left_padded_batch(llama, lengths)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **{"do_sample": False, **call})
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert remedy in warning and "drop " not in warning
    assert hf_accel.report(llama)["speculative"].details["fallbacks_to_stock"] == 1


@pytest.mark.parametrize("strict", [False, True])
def test_arguments_stock_pops_or_renames_are_not_taken_for_misspelt_ones(llama, caplog, strict):
    from transformers import DynamicCache

    ids, mask = left_padded_batch(llama, (5,))
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    hf_accel.patch(llama, compile=None, speculative="ngram", strict=strict)
    # trust_remote_code: stock pops it first (it lets custom_generate load code), so speculation stays.
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      trust_remote_code=False), expected)
    assert hf_accel.report(llama)["speculative"].details["fallbacks_to_stock"] == 0
    # past_key_values: stock renames it to cache and takes it; the loop cannot, so it warns (or, strict, refuses).
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache())
    if strict:
        with pytest.raises(hf_accel.PatchError, match="past_key_values.*strict=True"):
            llama.generate(**call)
        return
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        assert torch.equal(llama.generate(**call), expected)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "generate argument 'past_key_values'" in warning and "drop past_key_values=" in warning


def test_synced_gpus_false_is_stocks_default_and_keeps_speculation(llama):
    ids, mask = left_padded_batch(llama)
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                      synced_gpus=False), expected)
    details = hf_accel.report(llama)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["drafted"] > 0


def test_a_seeded_sampled_call_draws_the_same_tokens_whatever_ran_before(llama):
    ids, mask = left_padded_batch(llama)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))

    def seeded(max_new_tokens):
        torch.manual_seed(0)
        return llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True)

    first = seeded(16)
    seeded(40)  # long enough for the draft length to move
    assert torch.equal(seeded(16), first)


def test_scores_are_kept_only_for_calls_that_return_them(llama, monkeypatch):
    loops = []
    run = speculative_loop.SpeculativeLoop.run
    monkeypatch.setattr(speculative_loop.SpeculativeLoop, "run",
                        lambda self, *a: (loops.append(self), run(self, *a))[1])
    ids, mask = left_padded_batch(llama, (5,))
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                         output_logits=True)
    assert isinstance(out, torch.Tensor) and loops[-1].stats.generated == 8
    assert loops[-1].scores == [[]] and loops[-1].logits == [[]]  # stock keeps none: nothing to return them in


def test_a_model_cards_settings_that_block_speculation_are_listed(tmp_path, capsys):
    from hf_accel.tools.cli import main

    GenerationConfig(repetition_penalty=1.1, num_beams=3, guidance_scale=1.5,
                     cache_implementation="hybrid").save_pretrained(tmp_path)  # generate drops "hybrid" itself
    assert sorted(map(str, blocking_settings(GenerationConfig.from_pretrained(tmp_path)))) == [
        "guidance_scale=1.5 (classifier-free guidance runs a second, unconditional pass with its own state)",
        "num_beams=3 (beam search)"]
    assert main(["doctor", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "num_beams=3" in out and "guidance_scale=1.5" in out and "repetition_penalty" not in out
    assert "cache_implementation" not in out


def test_a_model_cards_settings_that_block_batches_are_listed_apart(tmp_path, capsys):
    from hf_accel.tools.cli import main

    GenerationConfig(return_dict_in_generate=True, output_scores=True, stop_strings=["w9"], max_time=5.0,
                     eos_token_id=None).save_pretrained(tmp_path)
    assert main(["doctor", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every generate call" not in out and "generate calls with batch > 1" in out
    assert "output_scores=True" in out and "stop_strings=['w9'] without an eos_token_id" in out
    assert "max_time" not in out  # the clock ends every row at once: nothing to pad


def test_a_model_without_a_generation_config_is_read_from_its_config(tmp_path, capsys):
    from hf_accel.tools.cli import main

    make_tiny_model("llama").config.save_pretrained(tmp_path)  # config.json only, as older checkpoints ship
    assert main(["doctor", "--model", str(tmp_path)]) == 0
    assert "leaves speculative decoding on for every call" in capsys.readouterr().out


def test_doctor_says_what_it_cannot_read_and_that_encoder_decoders_run_stock(tmp_path, capsys):
    from transformers import T5Config

    from hf_accel.tools.cli import main

    assert main(["doctor", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 2  # a Hub id is not read
    assert "is not a local directory" in capsys.readouterr().err
    T5Config(vocab_size=64, d_model=8, d_ff=16, num_layers=1, num_heads=1).save_pretrained(tmp_path)
    assert main(["doctor", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "encoder-decoder" in out and "leaves speculative decoding on" not in out


#: Where each setting the table calls covered is checked against stock, besides ``CASES`` (greedy identity above).
SAMPLED = "test_speculative.py::test_sampling_follows_the_target_at_every_draft_position_and_the_bonus_token"
COVERED_BY = {
    **{key: SAMPLED for key in ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "top_h",
                                "epsilon_cutoff", "eta_cutoff")},
    "encoder_no_repeat_ngram_size": "test_no_bigram_of_the_prompt_again",
    "forced_bos_token_id": "test_a_forced_first_token_after_a_one_token_prompt",
    "max_length": "test_a_max_length_set_anywhere_counts_the_prompt_as_stock_counts_it",
    "max_new_tokens": "test_each_covered_setting_gives_stocks_tokens_with_speculation",
    "eos_token_id": "test_speculative.py::test_partially_accepted_drafts_and_eos_inside_a_draft",
    "pad_token_id": SAMPLED,  # rows padded with an id of their own after their EOS
    "max_time": "test_max_time_ends_every_row_at_one_step_with_stocks_tokens",
    "stop_strings": "test_stop_strings_end_each_row_where_stock_ends_it",
    "num_return_sequences": "test_several_returned_sequences_are_expanded_as_stock_expands_them",
    "remove_invalid_values": "test_invalid_logits_are_removed_as_stock_removes_them",
    "renormalize_logits": "test_settings_that_reshape_scores_give_stocks_scores",
    "output_scores": "test_speculative.py::test_generate_features_pass_through_unchanged",
    "output_logits": "test_speculative.py::test_generate_features_pass_through_unchanged",
    "return_dict_in_generate": "test_speculative.py::test_generate_features_pass_through_unchanged",
}


def test_every_setting_called_covered_has_a_test_against_stock():
    import test_speculative

    covered = {key for key, (status, _) in SETTINGS.items() if status == "covered"}
    tested = {key for key in CASES if key in SETTINGS} | set(COVERED_BY)
    assert covered == tested, (covered - tested, tested - covered)
    for key, where in COVERED_BY.items():
        module, _, name = where.rpartition("::")
        test = getattr(test_speculative if module else sys.modules[__name__], name)
        assert key in inspect.getsource(test), f"{where} does not use {key}"


def test_every_generation_config_field_is_classified_and_the_docs_table_is_the_codes():
    assert set(SETTINGS) == known_fields()
    text = (Path(__file__).resolve().parent.parent / "docs" / "features.md").read_text()
    table = re.search(r"<!-- generation-settings -->\n(.*?)\n<!-- /generation-settings -->", text, re.S)
    assert table and table.group(1) == settings_table()


class _MinNewTokensAndMore(MinNewTokensLengthLogitsProcessor):
    """Does more than its base past the minimum: must never be skipped."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, scores) - 0.5


class _MinLengthAndMore(MinLengthLogitsProcessor):
    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, scores) * 2


def _count_calls(processor, calls):
    """Make ``processor`` append its class to ``calls`` whenever it is called."""
    base = type(processor)

    def call(self, input_ids, scores):
        calls.append(base)
        return base.__call__(self, input_ids, scores)

    processor.__class__ = type(f"Counted{base.__name__}", (base,), {"__call__": call})


# A prompt of 8 (the loop's prefixes never get shorter); min_length reached at 10, min_new_tokens at 8 + 5.
@pytest.mark.parametrize("length", [8, 9, 10, 12, 13, 14, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_processors_score_exactly_as_the_list_they_wrap(length, dtype):
    torch.manual_seed(length)
    vocab, prompt = 50, 8
    user = MinLengthLogitsProcessor(30, eos_token_id=6)  # the user's own: stock calls it every time
    processors = LogitsProcessorList([
        MinLengthLogitsProcessor(10, eos_token_id=[4]),
        MinNewTokensLengthLogitsProcessor(prompt, 5, eos_token_id=3),
        RepetitionPenaltyLogitsProcessor(1.3),
        NoRepeatNGramLogitsProcessor(2),
        _MinNewTokensAndMore(prompt, 1, eos_token_id=5),
        _MinLengthAndMore(9, eos_token_id=7),
        user,
    ])
    row = RowProcessors(processors, always_called=[user])
    ids = torch.randint(0, vocab, (1, length))
    scores = torch.randn(1, vocab).to(dtype)
    ours, stock = row(ids, scores.clone()), processors(ids, scores.clone())
    assert ours.dtype == stock.dtype == dtype and torch.equal(ours, stock)
    # Which processors ran: the two built-in minimums only before their minimum, the others always.
    calls = []
    for processor in processors:
        _count_calls(processor, calls)
    row(ids, scores.clone())
    expected = [MinLengthLogitsProcessor] * (length < 10) + [MinNewTokensLengthLogitsProcessor] * (length < 13) + [
        RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, _MinNewTokensAndMore, _MinLengthAndMore,
        MinLengthLogitsProcessor]
    assert Counter(calls) == Counter(expected)


class _BanInPlace(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 2] = -float("inf")
        return scores


# Before and past the minimum of 8 + 2: a processor that writes in place after a minimum-length one writes into
# that one's copy in stock, so the logits passed in stay as they were (the loop returns them as the raw logits).
@pytest.mark.parametrize("length", [9, 10, 12])
def test_row_processors_leave_their_input_as_stock_leaves_it(length):
    ban = _BanInPlace()
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(8, 2, eos_token_id=1), ban])
    ids, logits = torch.zeros(1, length, dtype=torch.long), torch.randn(1, 5)
    ours_in, stock_in = logits.clone(), logits.clone()
    ours, stock = RowProcessors(processors, always_called=[ban])(ids, ours_in), processors(ids, stock_in)
    assert torch.equal(ours, stock) and ours[0, 2] == -float("inf")
    assert torch.equal(ours_in, stock_in) and torch.equal(ours_in, logits)


def test_row_processors_read_a_minimum_changed_during_the_call():
    processor = MinNewTokensLengthLogitsProcessor(4, 2, eos_token_id=1)
    row = RowProcessors(LogitsProcessorList([processor]))
    ids, scores = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 3)
    assert row(ids, scores.clone())[0, 1] == 0  # past the minimum
    processor.min_new_tokens = 9
    assert row(ids, scores.clone())[0, 1] == -float("inf")


def test_row_processors_with_a_processor_that_wants_more_arguments_fail_as_stock_fails():
    class NeedsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return scores

    processors = LogitsProcessorList([NeedsMore()])
    ids, scores = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 5)
    with pytest.raises(ValueError, match="required parameters") as stock:
        processors(ids, scores)
    with pytest.raises(ValueError, match="required parameters") as ours:
        RowProcessors(processors)(ids, scores)
    assert str(ours.value) == str(stock.value)
