"""The speculative loop: greedy identity with stock generate, exact sampling, and generate's features.

Eager forwards here (``compile=None``) to keep the suite fast; test_speculative_compiled.py covers the
compiled ones."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import VOCAB, left_padded_batch, make_tiny_model
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
)

import hf_accel
from hf_accel import Backend, hookimpl
from hf_accel.runtime.speculative import loop as speculative_loop
from hf_accel.runtime.speculative.loop import Draft, DraftLength, accept_sampled
from hf_accel.runtime.speculative.plan import RIGHT_PADDED
from hf_accel.runtime.speculative.runner import install_runner
from hf_accel.testing.checks import chi_square_p_value


class ScriptedDrafter:
    """Proposes what the target will generate (from a reference run), corrupted every few tokens, so
    drafts are accepted in part, fully, and past EOS."""

    def __init__(self, reference: torch.Tensor, prompt_length: int, corrupt_every: int = 3) -> None:
        self.reference = reference
        self.prompt_length = prompt_length
        self.corrupt_every = corrupt_every

    def start(self, loop):
        pass

    def propose(self, loop, k):
        tokens = torch.zeros(len(loop.rows), k, dtype=torch.long)
        lengths = torch.zeros(len(loop.rows), dtype=torch.long)
        for b, row in enumerate(loop.rows):
            done = row.shape[0]
            truth = self.reference[b, done : done + k]
            tokens[b, : truth.numel()] = truth
            lengths[b] = truth.numel()
            position = done - self.prompt_length
            if position % self.corrupt_every == 0 and truth.numel() > 1:
                tokens[b, 1] = (truth[1] + 1) % VOCAB
        return Draft(tokens, lengths)

    def accepted(self, loop, draft, kept):
        pass


class RandomDrafter:
    """Samples drafts from a random distribution q (different from the target's), returning q, so exact
    speculative sampling has real rejections to correct."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, loop):
        pass

    def propose(self, loop, k):
        batch = len(loop.rows)
        q = torch.rand(batch, k, self.vocab, generator=self.generator) ** 2
        q = q / q.sum(-1, keepdim=True)
        tokens = torch.multinomial(q.view(-1, self.vocab), 1, generator=self.generator).view(batch, k)
        return Draft(tokens, torch.full((batch,), k), probs=q)

    def accepted(self, loop, draft, kept):
        pass


def drafter_plugin(make_drafter, k=4, low=1, high=8):
    class Plugin:
        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="test_drafter", feature="speculative", probe=None,
                             apply=lambda ctx: install_runner(ctx, make_drafter, DraftLength(k=k, low=low, high=high))))
    return Plugin()


class DivergingDrafter:
    """Row 0 drafts what the target will say (every draft accepted), every other row a wrong first token
    (every draft rejected), so rows advance at k + 1 and 1 tokens per step. Records, at each proposal,
    which rows had ended and how many real tokens the target's cache held per row."""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference = reference
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(self, loop):
        pass

    def propose(self, loop, k):
        self.seen.append((loop.finished.clone(), loop.target.mask.sum(-1)))
        tokens = torch.zeros(len(loop.rows), k, dtype=torch.long)
        lengths = torch.zeros(len(loop.rows), dtype=torch.long)
        for b, row in enumerate(loop.rows):
            truth = self.reference[b, row.shape[0] : row.shape[0] + k]
            tokens[b, : truth.numel()] = truth
            lengths[b] = truth.numel()
            if b > 0 and truth.numel():
                tokens[b, 0] = (truth[0] + 1) % VOCAB
        return Draft(tokens, lengths)

    def accepted(self, loop, draft, kept):
        pass


def greedy(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


def stats(model):
    return hf_accel.report(model)["speculative"].details


@pytest.mark.parametrize("kv_cache", ["static", None], ids=["static-cache", "own-growing-cache"])
@pytest.mark.parametrize("lengths", [(1,), (17,), (7, 3, 5)], ids=["len1", "len17", "batch3-left-padded"])
def test_greedy_ngram_is_token_identical_to_stock(tiny_model, lengths, kv_cache):
    ids, mask = left_padded_batch(tiny_model, lengths)
    expected = greedy(tiny_model, ids, mask, max_new_tokens=24)
    hf_accel.patch(tiny_model, compile=None, kv_cache=kv_cache, speculative="ngram")
    assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=24), expected)
    assert stats(tiny_model)["fallbacks_to_stock"] == 0


def test_long_prompt_past_the_sliding_window():
    model = make_tiny_model("mistral")  # window 16
    ids, mask = left_padded_batch(model, (300, 40, 120))
    expected = greedy(model, ids, mask, max_new_tokens=30)
    hf_accel.patch(model, compile=None, speculative="ngram")
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30), expected)


@pytest.mark.parametrize("stop_at", [4, 9])
def test_partially_accepted_drafts_and_eos_inside_a_draft(tiny_model, stop_at):
    ids, mask = left_padded_batch(tiny_model)
    reference = greedy(tiny_model, ids, mask, max_new_tokens=20)
    eos = int(reference[1, ids.shape[1] + stop_at])  # row 1 stops there; drafts run past it
    tiny_model.generation_config.eos_token_id = eos
    expected = greedy(tiny_model, ids, mask, max_new_tokens=20)
    drafter = lambda model, config: ScriptedDrafter(reference, ids.shape[1])
    hf_accel.patch(tiny_model, compile=None, speculative="test_drafter", plugins=[drafter_plugin(drafter)])
    assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=20), expected)
    details = stats(tiny_model)
    assert 0 < details["accepted"] < details["drafted"]


def test_generate_features_pass_through_unchanged(llama):
    ids, mask = left_padded_batch(llama, (9,))
    banned = int(greedy(llama, ids, mask, max_new_tokens=3)[0, -1])

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, banned] = -float("inf")
            return scores

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 11, dtype=torch.bool)

    kwargs = dict(max_new_tokens=30, logits_processor=LogitsProcessorList([Ban()]), stopping_criteria=[StopAfter()],
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = greedy(llama, ids, mask, **kwargs)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = greedy(llama, ids, mask, **kwargs)
    assert torch.equal(out.sequences, expected.sequences) and out.sequences.shape[1] == ids.shape[1] + 11
    assert stats(llama)["fallbacks_to_stock"] == 0  # batch 1: the loop's own scores
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(expected, name)) == 11
        for ours, theirs in zip(getattr(out, name), getattr(expected, name)):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_streamer_receives_prompt_then_every_token(llama):
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids, mask = left_padded_batch(llama, (6,))
    expected = greedy(llama, ids, mask, max_new_tokens=12)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    recorder = Recorder()
    greedy(llama, ids, mask, max_new_tokens=12, streamer=recorder)
    assert recorder.ended and recorder.chunks[0] == ids[0].tolist()
    assert sum(recorder.chunks[1:], []) == expected[0, ids.shape[1]:].tolist()


def test_uncovered_generation_modes_fall_back_to_stock(llama, caplog):
    ids, mask = left_padded_batch(llama, (6,))
    expected = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=2, do_sample=False)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with caplog.at_level("INFO", logger="hf_accel"):
        out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=2, do_sample=False)
    assert torch.equal(out, expected) and stats(llama)["fallbacks_to_stock"] == 1
    assert "num_beams" in caplog.text


def right_padded_batch(model) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`left_padded_batch`'s rows padded on the right instead, as a tokenizer with padding_side="right"
    pads them."""
    ids, mask = left_padded_batch(model)
    shifts = [int(n) - mask.shape[1] for n in mask.sum(-1)]
    return (torch.stack([row.roll(shift) for row, shift in zip(ids, shifts)]),
            torch.stack([row.roll(shift) for row, shift in zip(mask, shifts)]))


def test_a_right_padded_batch_runs_stock_generate_and_says_to_pad_on_the_left(tiny_model, caplog):
    # Stock generate continues each row's positions from its last column, a pad's, where the loop counts the
    # row's tokens.
    ids, mask = right_padded_batch(tiny_model)
    expected = greedy(tiny_model, ids, mask, max_new_tokens=16)
    hf_accel.patch(tiny_model, compile=None, speculative="ngram")
    with caplog.at_level("WARNING", logger="hf_accel"):
        assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=16), expected)
    assert list(stats(tiny_model)["fallback_reasons"]) == [RIGHT_PADDED.reason]
    assert "padding_side='left'" in caplog.text


def test_a_right_padded_call_stock_refuses_gets_stocks_error_even_with_strict(llama):
    ids, mask = right_padded_batch(llama)
    # Stock refuses stop strings without a tokenizer before it generates, and a min_p above 1 as it builds its
    # warpers.
    refused = (dict(do_sample=False, stop_strings=["x"]), dict(do_sample=True, min_p=2.0))
    call = lambda **kwargs: llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    stock = []
    for kwargs in refused:
        with pytest.raises(ValueError) as error:
            call(**kwargs)
        stock.append(str(error.value))
    hf_accel.patch(llama, compile=None, speculative="ngram", strict=True)
    for kwargs, message in zip(refused, stock):
        with pytest.raises(ValueError) as error:
            call(**kwargs)
        assert str(error.value) == message
    with pytest.raises(hf_accel.PatchError, match="padded on the right.*strict=True"):
        call(do_sample=False)


@pytest.mark.parametrize("copies", [0, -1])
def test_num_return_sequences_below_one_gives_one_row_per_prompt_as_stock(llama, copies):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, max_new_tokens=12, num_return_sequences=copies)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=12, num_return_sequences=copies), expected)
    sampled = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                             num_return_sequences=copies)
    assert sampled.shape[0] == ids.shape[0] and torch.equal(sampled[:, :ids.shape[1]], ids)
    assert stats(llama)["fallbacks_to_stock"] == 0


@pytest.mark.parametrize("mask", ["4d-causal", "narrower", "another-batch"])
def test_an_attention_mask_not_shaped_as_the_ids_gets_stocks_error(llama, mask, caplog):
    ids, fitting = left_padded_batch(llama, (6,))
    mask = {"4d-causal": torch.ones(6, 6, dtype=torch.bool).tril()[None, None], "narrower": fitting[:, 1:],
            "another-batch": fitting.repeat(2, 1)}[mask]
    with pytest.raises(Exception) as stock:
        greedy(llama, ids, mask, max_new_tokens=4)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    with caplog.at_level("WARNING", logger="hf_accel"), pytest.raises(type(stock.value)) as ours:
        greedy(llama, ids, mask, max_new_tokens=4)
    assert str(ours.value) == str(stock.value) and "hf_accel" not in caplog.text


def few_token_llama_config(vocab: int) -> LlamaConfig:
    """A 2-layer llama over ``vocab`` tokens and no special ones, for the distribution tests: few enough tokens
    that every continuation's exact probability can be computed."""
    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def exact_continuations(model, prompt: torch.Tensor, mask: torch.Tensor, processors, vocab: int,
                        n: int) -> torch.Tensor:
    """The probability of each of the vocab**n continuations of the left-padded ``prompt`` under ``processors``
    (row-major index: first token most significant), from the model's own forwards over every prefix. The
    processors see the padding, as in stock generate."""
    joint = torch.ones(1, dtype=torch.float64)
    for depth in range(n):
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * depth).reshape(-1, depth) if depth else \
            torch.zeros(1, 0, dtype=torch.long)
        ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)
        full_mask = torch.cat([mask.expand(len(prefixes), -1), torch.ones_like(prefixes)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(ids, attention_mask=full_mask, position_ids=positions).logits[:, -1]
        probs = torch.stack([processors(ids[i:i + 1], logits[i:i + 1].clone())[0] for i in range(len(ids))])
        joint = (joint[:, None] * probs.double().softmax(-1)).reshape(-1)
    return joint


def padded_after(joint: torch.Tensor, vocab: int, n: int, eos: int) -> torch.Tensor:
    """``joint`` (see :func:`exact_continuations`) over the outcomes ``generate`` returns when it pads with a
    symbol of its own (``vocab``) after a row's first ``eos``: indexed in base ``vocab + 1``."""
    digits = torch.cartesian_prod(*[torch.arange(vocab)] * n).reshape(-1, n)
    ended = (digits == eos).long().cummax(-1).values.bool()
    after = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1)
    index = (digits.masked_fill(after, vocab) * (vocab + 1) ** torch.arange(n - 1, -1, -1)).sum(-1)
    return joint.new_zeros((vocab + 1) ** n).index_add_(0, index, joint)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "top_k": 0}, {"temperature": 0.7, "top_k": 3},
                                      {"top_p": 0.7, "top_k": 0}, {"bad_words_ids": [[3], [1, 2]], "top_k": 0},
                                      {"min_p": 0.15, "top_k": 0}, {"typical_p": 0.8, "top_k": 0},
                                      {"top_h": 0.9, "top_k": 0}, {"epsilon_cutoff": 0.1, "top_k": 0},
                                      {"eta_cutoff": 0.1, "top_k": 0},
                                      {"repetition_penalty": 1.8, "top_k": 0}, {"no_repeat_ngram_size": 2, "top_k": 0},
                                      {"suppress_tokens": [2], "top_k": 0},
                                      {"sequence_bias": {(1,): -1.5, (3, 2): 2.0}, "top_k": 0},
                                      {"top_p": 0.9, "top_k": 0, "sequences": True},
                                      {"min_new_tokens": 3, "eos_token_id": 3, "top_k": 0},
                                      {"min_length": 7, "eos_token_id": 3, "top_k": 0},
                                      {"exponential_decay_length_penalty": (1, 2.0), "eos_token_id": 3, "top_k": 0},
                                      {"encoder_repetition_penalty": 2.0, "top_k": 0},
                                      {"encoder_no_repeat_ngram_size": 2, "top_k": 0},
                                      {"forced_eos_token_id": 2, "max_length": 8, "top_k": 0},
                                      {"prefix_allowed_tokens_fn": lambda batch_id, ids: [t for t in range(4)
                                                                                          if t != int(ids[-1])],
                                       "top_k": 0}],
                         ids=["plain", "temperature-topk", "top-p", "bad-words", "min-p", "typical-p", "top-h",
                              "epsilon", "eta", "repetition-penalty", "no-repeat-ngram", "suppress", "sequence-bias",
                              "num-return-sequences", "min-new-tokens", "min-length", "length-penalty",
                              "encoder-repetition-penalty", "encoder-no-repeat-ngram", "forced-eos", "allowed-tokens"])
def test_sampling_follows_the_target_at_every_draft_position_and_the_bonus_token(sampling, monkeypatch):
    """A left-padded batch of two prompts, 2000 rows each, samples 4 tokens from a 4-token vocabulary with
    drafts of 2: the first token comes from the prompt, the next two from draft positions 0 and 1 (or their
    resampling) and the fourth from the bonus token or a later draft. Each prompt's 256 outcomes are compared
    with the target's exact distribution by a chi-square test at significance level 0.001 (seeded). With an
    EOS token, a row that drew it is padded from there, in the outcomes and in the exact distribution. Each
    setting moves that exact distribution away from plain sampling's (checked), so a loop that ignored it
    would be held to the wrong distribution."""
    vocab, rows, new = 4, 2000, 4
    prompts = [torch.tensor([[1, 3, 2, 3]]), torch.tensor([[0, 0, 2, 1]])]  # the second left-padded
    masks = [torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]])]
    config = few_token_llama_config(vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # a peaked target, unlike the drafter's q
    sampling = dict(sampling)
    # The same rows, asked for as num_return_sequences per prompt (the loop expands them as stock does).
    sequences = sampling.pop("sequences", False)
    allowed = sampling.get("prefix_allowed_tokens_fn")
    settings = GenerationConfig(do_sample=True, num_beams=1, num_return_sequences=1,
                                **{k: v for k, v in sampling.items() if v is not allowed})
    model._prepare_special_tokens(settings, True, "cpu")  # as generate does before building processors
    exact = [exact_continuations(model, p, m, model._get_logits_processor(  # stock's, for that prompt's padding
        settings, input_ids_seq_length=p.shape[1], encoder_input_ids=p, prefix_allowed_tokens_fn=allowed,
        model_kwargs={"attention_mask": m}), vocab, new) for p, m in zip(prompts, masks)]
    # After an EOS a row is padded: with a symbol no token uses, so that padding is told apart from tokens.
    eos = sampling.get("eos_token_id")
    pad, base = (vocab, vocab + 1) if eos is not None else (0, vocab)
    if eos is not None:
        exact = [padded_after(joint, vocab, new, eos) for joint in exact]
    if sampling != {"temperature": 1.0, "top_k": 0}:  # the setting shapes the distribution the test holds to
        plain = GenerationConfig(do_sample=True, num_beams=1, top_k=0, eos_token_id=eos)
        model._prepare_special_tokens(plain, True, "cpu")
        unset = [exact_continuations(model, p, m, model._get_logits_processor(
            plain, input_ids_seq_length=p.shape[1], encoder_input_ids=p, model_kwargs={"attention_mask": m}),
            vocab, new) for p, m in zip(prompts, masks)]
        if eos is not None:
            unset = [padded_after(joint, vocab, new, eos) for joint in unset]
        # Total variation distance from the distribution without it: 0.11-0.95 over these cases.
        assert max(0.5 * float((a - b).abs().sum()) for a, b in zip(exact, unset)) > 0.1

    ids = torch.cat([p.expand(1 if sequences else rows, -1) for p in prompts])
    mask = torch.cat([m.expand(1 if sequences else rows, -1) for m in masks])
    if sequences:
        sampling["num_return_sequences"] = rows
    hf_accel.patch(model, compile=None, speculative="test_drafter",
                   plugins=[drafter_plugin(lambda m, c: RandomDrafter(vocab), k=2, low=2, high=2)])
    kept_counts = []

    def recording(p, draft, in_draft, draws=None, kept=None):
        kept, extra = accept_sampled(p, draft, in_draft, draws, kept)
        kept_counts.append(kept[draft.lengths == 2])
        return kept, extra

    monkeypatch.setattr(speculative_loop, "accept_sampled", recording)
    torch.manual_seed(1)
    out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new, pad_token_id=pad,
                         **sampling)[:, 4:]
    kept = torch.bincount(torch.cat(kept_counts), minlength=3)
    assert (kept > 100).all(), kept  # rejections at draft positions 0 and 1, and bonus tokens, each often
    index = sum(out[:, j] * base ** (new - 1 - j) for j in range(new))
    for i in range(len(prompts)):
        observed = torch.bincount(index[i * rows:(i + 1) * rows], minlength=base ** new).double()
        assert observed[exact[i] == 0].sum() == 0  # nothing the processors ruled out
        assert chi_square_p_value(observed, exact[i] * rows) > 0.001


@pytest.mark.parametrize("lengths", [(9,), (7, 3, 5)], ids=["batch1", "batch3-left-padded"])
def test_draft_model_drafter_is_token_identical(tiny_model, arch, lengths):
    ids, mask = left_padded_batch(tiny_model, lengths)
    expected = greedy(tiny_model, ids, mask, max_new_tokens=20)
    draft = make_tiny_model(arch, seed=1)  # same architecture, other weights: agrees sometimes
    hf_accel.patch(tiny_model, compile=None, speculative=draft)
    assert hf_accel.report(tiny_model)["speculative"].backend == "draft_model"
    assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=20), expected)
    assert stats(tiny_model)["drafted"] > 0


def test_draft_model_with_itself_accepts_everything(llama):
    ids, mask = left_padded_batch(llama, (7, 3, 5))
    expected = greedy(llama, ids, mask, max_new_tokens=20)
    hf_accel.patch(llama, compile=None, speculative=make_tiny_model("llama"))  # identical weights: every draft is right
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=20), expected)
    assert stats(llama)["acceptance_rate"] == 1.0


@pytest.mark.parametrize("settings", [{}, {"repetition_penalty": 1.8, "top_p": 0.9}],
                         ids=["plain", "processed-drafts"])
def test_draft_model_sampling_follows_the_target_distribution(settings):
    """Same check as above with a real draft model's q, which passes the call's processors too (significance
    level 0.001)."""
    vocab, rows, prompt = 6, 3000, torch.tensor([[1, 4, 2, 5]])
    torch.manual_seed(0)
    model = LlamaForCausalLM(few_token_llama_config(vocab)).eval()  # a config each: patching the target sets its own
    draft = LlamaForCausalLM(few_token_llama_config(vocab)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        draft.lm_head.weight.mul_(4)
    mask = torch.ones_like(prompt)
    processors = model._get_logits_processor(GenerationConfig(do_sample=True, top_k=0, **settings),
                                             model_kwargs={"attention_mask": mask})
    exact = exact_continuations(model, prompt, mask, processors, vocab, 2)
    hf_accel.patch(model, compile=None, speculative=draft)
    torch.manual_seed(2)
    out = model.generate(prompt.repeat(rows, 1), attention_mask=mask.repeat(rows, 1), do_sample=True, top_k=0,
                         max_new_tokens=2, pad_token_id=0, **settings)
    observed = torch.bincount(out[:, 4] * vocab + out[:, 5], minlength=vocab * vocab).double()
    assert 0 < stats(model)["accepted"] < stats(model)["drafted"]
    assert observed[exact == 0].sum() == 0
    assert chi_square_p_value(observed, exact * rows) > 0.001


def test_int4_self_draft_extended_by_lookup_samples_the_target_distribution():
    """Model-drafted tokens carry the copy's q, lookup-appended ones a point mass (significance level 0.001)."""
    vocab, rows, prompt = 6, 3000, torch.tensor([[1, 4, 2, 5, 1, 4, 2, 5]])  # repeats: the lookup extends
    config = few_token_llama_config(vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        first = model(prompt).logits[0, -1].softmax(-1)
        seconds = torch.stack([model(torch.cat([prompt, torch.tensor([[t]])], 1)).logits[0, -1].softmax(-1)
                               for t in range(vocab)])
    exact = (first[:, None] * seconds).reshape(-1)
    hf_accel.patch(model, compile=None, speculative="ngram_self_int4")
    torch.manual_seed(3)
    out = model.generate(prompt.repeat(rows, 1), attention_mask=torch.ones(rows, 8, dtype=torch.long),
                         do_sample=True, top_k=0, max_new_tokens=2, pad_token_id=0)
    observed = torch.bincount(out[:, 8] * vocab + out[:, 9], minlength=vocab * vocab).double()
    sources = stats(model)["sources"]
    assert sources["lookup_drafted"] > 0 and 0 < sources["model_accepted"] < sources["model_drafted"]
    assert chi_square_p_value(observed, exact.double() * rows) > 0.001


def test_draft_model_must_share_the_vocabulary(llama):
    other = make_tiny_model("gpt2")
    other.resize_token_embeddings(4096)
    with pytest.raises(hf_accel.BackendUnavailableError, match="vocabularies differ"):
        hf_accel.patch(llama, compile=None, speculative="draft_model", draft_model=other)


@pytest.mark.parametrize("backend, draft", [("self_int8", "int8"), ("self_int4", "int4"),
                                            ("ngram_self_int4", "prompt lookup")])
def test_self_drafters_are_token_identical(tiny_model, backend, draft):
    ids, mask = left_padded_batch(tiny_model)
    expected = greedy(tiny_model, ids, mask, max_new_tokens=30)
    hf_accel.patch(tiny_model, compile=None, speculative=backend)
    assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=30), expected)
    details = stats(tiny_model)
    assert details["accepted"] > 0 and draft in details["draft"]


def test_a_self_draft_reads_what_every_source_drafted_from_the_target(monkeypatch):
    from hf_accel_plugins import speculative_combined

    # With the target itself as the "int4 copy", every model draft is accepted, unless the copy's cache missed
    # tokens that came from the lookup's extensions or the target (or got them in the wrong slots).
    monkeypatch.setattr(speculative_combined, "self_draft", lambda context, bits: context.model)
    model = make_tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 9, 10, 9, 10, 9, 10, 9, 10],
                        [0, 0, 0, 0, 11, 12, 13, 11, 12, 13]])  # repeats, so the lookup extends drafts
    mask = (ids != 0).long()
    expected = greedy(model, ids, mask, max_new_tokens=30)
    hf_accel.patch(model, compile=None, speculative="ngram_self_int4")
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30), expected)
    sources = stats(model)["sources"]
    assert sources["lookup_drafted"] > 0
    assert sources["model_accepted"] == sources["model_drafted"] > 0


def test_self_drafts_refuse_a_quantized_target_with_the_reason(llama):
    with pytest.raises(hf_accel.BackendUnavailableError, match="quantized already"):
        hf_accel.patch(llama, compile=None, quantize="int8", speculative="self_int4")
    hf_accel.patch(llama, compile=None, quantize="int8")  # auto still finds a drafter
    assert hf_accel.report(llama)["speculative"].backend == "ngram"


def test_a_checkpoint_loaded_through_a_quantizer_into_floats_can_self_draft(llama):
    from types import SimpleNamespace

    llama.hf_quantizer = SimpleNamespace(is_compileable=True)  # as a GGUF checkpoint has, dequantized at load
    hf_accel.patch(llama, compile=None, speculative="self_int4")
    assert hf_accel.report(llama)["speculative"].backend == "self_int4"


def test_a_draft_token_the_target_gives_no_probability_is_rejected_even_when_the_draw_is_zero(monkeypatch):
    """u < p/q with u in [0, 1): a token with p = 0 (banned by a processor) must never be accepted."""
    from hf_accel.runtime.speculative.loop import Draft, accept_sampled

    p = torch.zeros(1, 2, 4)
    p[0, :, 1] = 1.0  # the target puts all its mass on token 1
    draft = Draft(tokens=torch.tensor([[3]]), lengths=torch.tensor([1]))  # the drafter proposed token 3
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape))
    kept, extra = accept_sampled(p, draft, torch.ones(1, 1, dtype=torch.bool))
    assert kept.tolist() == [0] and extra.tolist() == [1]


def test_rows_that_ended_are_not_drafted_and_keep_nothing_more(llama):
    ids, mask = left_padded_batch(llama, (6, 6))
    reference = greedy(llama, ids, mask, max_new_tokens=60)  # row 0's truth runs past its own end
    expected = greedy(llama, ids, mask, max_new_tokens=30)
    drafter = DivergingDrafter(reference)
    hf_accel.patch(llama, compile=None, speculative="test_drafter",
                   plugins=[drafter_plugin(lambda model, config: drafter, k=4, low=4, high=4)])
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=30), expected)
    after_row0_ended = [held[0] for finished, held in drafter.seen if finished[0]]
    assert len(after_row0_ended) > 10 and len(set(map(int, after_row0_ended))) == 1


def test_output_scores_of_a_batch_match_stock_for_rows_that_ended(llama):
    ids, mask = left_padded_batch(llama)
    reference = greedy(llama, ids, mask, max_new_tokens=12)
    llama.generation_config.eos_token_id = int(reference[1, ids.shape[1] + 3])  # row 1 ends early
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = greedy(llama, ids, mask, **kwargs)
    hf_accel.patch(llama, compile=None, speculative="ngram")
    out = greedy(llama, ids, mask, **kwargs)
    assert torch.equal(out.sequences, expected.sequences) and stats(llama)["fallbacks_to_stock"] == 1
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(expected, name))
        for ours, stock in zip(getattr(out, name), getattr(expected, name)):
            torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-4)


def test_a_user_warper_is_merged_with_the_ones_generate_builds_as_stock_merges_it(llama):
    """The loop takes stock's own processor list, so a user's TemperatureLogitsWarper and temperature=
    combine as stock combines them (transformers 5.24 applies both: scores divided by 0.25, not 0.5)."""
    from transformers import TemperatureLogitsWarper

    ids, mask = left_padded_batch(llama, (9,))
    kwargs = dict(do_sample=True, temperature=0.5, max_new_tokens=1, return_dict_in_generate=True,
                  output_scores=True, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    expected = llama.generate(input_ids=ids, attention_mask=mask, **kwargs).scores[0]
    hf_accel.patch(llama, compile=None, speculative="ngram")
    scores = llama.generate(input_ids=ids, attention_mask=mask, **kwargs).scores[0]
    assert stats(llama)["fallbacks_to_stock"] == 0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_a_self_drafts_best_logits_come_from_the_targets_head_rows():
    from hf_accel_plugins.int8_layers import Int8WeightLinear
    from hf_accel_plugins.self_drafts import TopLogitsExact

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 300)
    head = TopLogitsExact(Int8WeightLinear(linear), linear, k=4)
    x = torch.randn(2, 3, 64)
    rounded, refined = head.head(x), head(x)
    exact = linear(x).detach()
    top = rounded.topk(4, dim=-1).indices
    torch.testing.assert_close(refined.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-6)
    elsewhere = torch.ones_like(refined, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(refined[elsewhere], rounded[elsewhere])
    assert not torch.equal(rounded.gather(-1, top), exact.gather(-1, top))  # the int8 head alone is off there
    assert set(head.state_dict()) == {f"head.{name}" for name in head.head.state_dict()}  # nothing of the target's
    linear.bias.data += 1.0  # the target's weight and bias, read on every call
    torch.testing.assert_close(head(x).gather(-1, top), linear(x).detach().gather(-1, top), rtol=1e-6, atol=1e-6)


def test_the_int8_heads_rounding_no_longer_decides_the_draft():
    from hf_accel_plugins.int8_layers import Int8WeightLinear
    from hf_accel_plugins.self_drafts import TopLogitsExact

    # Row 0's large first weight gives it a coarse int8 scale, which rounds its second weight (0.35) to 0.
    # (Sizes the int8 kernel takes: 8 rows of 32.)
    linear = torch.nn.Linear(32, 8, bias=False)
    linear.weight.data = torch.zeros(8, 32) - 1.0
    linear.weight.data[0, :2] = torch.tensor([100.0, 0.35])
    linear.weight.data[1, :2] = torch.tensor([0.0, 1.2])
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([0.01, 1.0])
    head = TopLogitsExact(Int8WeightLinear(linear), linear, k=4)  # fewer than its 8 rows: a real choice
    assert int(linear(x).argmax()) == 0 and int(head.head(x).argmax()) == 1
    assert int(head(x).argmax()) == 0


def _llama_with_layers_the_int4_kernel_cannot_take(vocab: int):
    return make_tiny_model("llama", vocab_size=vocab, intermediate_size=136)  # MLP sizes int4 (and int8) cannot take


@pytest.mark.parametrize("model_of", [lambda: _llama_with_layers_the_int4_kernel_cannot_take(512),
                                      lambda: _llama_with_layers_the_int4_kernel_cannot_take(1000),  # and head
                                      lambda: make_tiny_model("gpt2"), lambda: make_tiny_model("qwen2")],
                         ids=["llama-mlp-int8", "llama-mlp-and-head-int8", "gpt2-conv1d-biases", "qwen2-biases"])
def test_a_self_drafts_estimated_bytes_are_the_layers_it_builds(model_of):
    from hf_accel.plugin import linear_children
    from hf_accel_plugins.self_drafts import TopLogitsExact, draft_bytes, own_bytes, quantized_copy

    model = model_of()
    largest = max(linear.weight.numel() for *_, linear in linear_children(model))
    vocab = model.config.vocab_size
    for bits in (4, 8):
        draft = quantized_copy(model, bits)
        head = draft.get_output_embeddings()
        assert isinstance(head, TopLogitsExact)
        assert type(head.head).__name__ == ("Int4WeightLinear" if bits == 4 and vocab % 16 == 0 else "Int8WeightLinear")
        if model.config.model_type == "llama":
            mlp = draft.model.layers[0].mlp
            assert type(mlp.up_proj).__name__ == "Int8WeightLinear"  # 136 outputs: int4 cannot
            down = mlp.down_proj  # 136 inputs: neither kernel can; the target's own weight
            assert type(down) is torch.nn.Linear
            assert down.weight.data_ptr() == model.model.layers[0].mlp.down_proj.weight.data_ptr()
            assert type(draft.model.layers[0].self_attn.q_proj).__name__ == f"Int{bits}WeightLinear"
        estimate = draft_bytes(types.SimpleNamespace(model=model), bits) - 8 * largest  # less the copying's peak
        assert estimate == own_bytes(draft, model)


def test_an_int4_self_draft_with_int8_and_plain_layers_drafts_the_targets_tokens():
    model = _llama_with_layers_the_int4_kernel_cannot_take(1000)
    ids, mask = left_padded_batch(model)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch(model, compile=None, speculative="self_int4")
    assert "int8 head" in hf_accel.report(model)["speculative"].details["draft"]
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)
    assert stats(model)["fallbacks_to_stock"] == 0 and stats(model)["accepted"] > 0


@pytest.mark.parametrize("arch, compile", [("gemma2", "auto"), ("gpt2", "auto"), ("llama", None), ("llama", "auto")])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_self_draft_reads_the_targets_own_head_rows_where_it_holds_them(arch, compile, bits):
    from hf_accel_plugins.self_drafts import TopLogitsExact

    model = make_tiny_model(arch)
    hf_accel.patch(model, compile=compile, speculative=f"self_int{bits}")
    draft = model._hf_accel_state.runner.drafts[0]
    head = draft.get_output_embeddings()
    # A tied head (gemma2, gpt2) keeps its plain weight beside its packed copy; an untied one, packed, keeps none.
    rows = TopLogitsExact.rows_of(model.get_output_embeddings(), draft.get_output_embeddings())
    assert isinstance(head, TopLogitsExact) == (rows is not None)
    assert (rows is None) == (compile == "auto" and not model.config.tie_word_embeddings and "PackedLinear" in str(
        type(model.get_output_embeddings())))
    described = hf_accel.report(model)["speculative"].details["draft"]
    assert ("best 8 logits" in described) == (rows is not None)
    # An int4 copy's head is int4 only where its best logits are recomputed: alone, its rounding costs drafts.
    inner = head.head if rows is not None else head
    assert type(inner).__name__ == ("Int4WeightLinear" if bits == 4 and rows is not None else "Int8WeightLinear")
    assert f"{type(inner).__name__[:4].lower()} head" in described
    if rows is not None:
        assert rows.data_ptr() == model.get_output_embeddings().weight.data_ptr()  # the target's own, not a copy
        replaced = torch.nn.Parameter(torch.randn_like(rows), requires_grad=False)
        model.get_output_embeddings().weight = replaced  # read again on every call
        assert TopLogitsExact.rows_of(head._target_head(), head.head).data_ptr() == replaced.data_ptr()
