"""The speculative loop over compiled forwards: fixed-length rollback caches, for the target and a draft model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from test_speculative import DivergingDrafter, ScriptedDrafter, drafter_plugin, greedy

import hf_accel
from hf_accel.runtime import compiled_step
from hf_accel.runtime.cached_lm import CachedLM
from hf_accel.runtime.kv_cache import PreallocatedCache, RollbackStaticCache
from hf_accel.runtime.speculative import loop as speculative_loop
from hf_accel.runtime.speculative import runner as speculative_runner
from hf_accel_plugins.drafters import SelfDrafter


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


#: Compile when a call first needs a shape: these tests are about the compiled loop, not when to compile.
AT_ONCE = {"compile": "inductor", "compile_when": "first_use"}


def compiled(model, role="target") -> dict:
    """The target runs the patch's compiled step (the compile report); a draft model a step of its own."""
    if role == "target":
        return hf_accel.report(model)["compile"].details
    return hf_accel.report(model)["speculative"].details["compiled"][role]


def test_rollback_cache_matches_the_growing_cache_through_rollbacks_and_realignment(tiny_model):
    """Eager forwards over both caches, through the steps the loop takes: rows keep different counts."""
    ids, mask = left_padded_batch(tiny_model, (7, 3, 5))
    chunks = torch.randint(3, 400, (4, 3, 5), generator=torch.Generator().manual_seed(0))
    kept = [torch.tensor(k) for k in ([5, 2, 1], [1, 1, 1], [3, 5, 4], [2, 1, 5])]
    logits = []
    for cache in (PreallocatedCache(tiny_model.config), RollbackStaticCache(tiny_model.config, max_cache_len=64)):
        lm = CachedLM(tiny_model, cache)
        with torch.no_grad():
            steps = [lm.prefill(ids, mask)[:, None]]
            for chunk, keep in zip(chunks, kept):
                steps.append(lm.extend(chunk))
                lm.keep(keep)
        logits.append(torch.cat(steps, dim=1))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_the_rollback_cache_compacts_instead_of_overflowing_when_rows_diverge(tmp_path, monkeypatch):
    """Row 0 accepts every draft, row 1 none: the cache's mask grows by the larger acceptance each step,
    past the room the fixed-length cache has for either row's tokens."""
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))  # "auto" with nothing compiled before: eager layers
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (6, 6))
    reference = greedy(model, ids, mask, max_new_tokens=60)
    expected = greedy(model, ids, mask, max_new_tokens=40)
    drafter = DivergingDrafter(reference)
    hf_accel.patch(model, speculative="test_drafter", compile="inductor", compile_when="auto", cache_bucket=8,
                   plugins=[drafter_plugin(lambda m, config: drafter, k=4, low=4, high=4)])
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=40), expected)
    cache = model._hf_accel_state.compiled_step.cache_for(2, 0)
    assert cache.max_cache_len == 56  # 6 + 40 + 4 + 2 rounded up to the bucket: no room for the padding
    details = hf_accel.report(model)["speculative"].details
    assert details["fallbacks_to_stock"] == 0 and details["accepted"] >= 32


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2"])  # holes move sliding windows: drafts only
def test_compaction_keeps_the_logits_of_rows_with_holes(tiny_model):
    """A drafter's cache: rows append different numbers of real tokens (masked holes in between); a small
    fixed-length cache compacts them where a growing one does not, and the logits agree."""
    ids, mask = left_padded_batch(tiny_model, (5, 2))
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(3, 400, (2, 3), generator=g) for _ in range(12)]
    valid = [torch.tensor([[1, 1, 1], [0, 0, 1]]) if i % 2 else torch.tensor([[0, 1, 1], [1, 1, 1]])
             for i in range(12)]
    logits = []
    for cache in (PreallocatedCache(tiny_model.config), RollbackStaticCache(tiny_model.config, max_cache_len=40)):
        lm = CachedLM(tiny_model, cache)
        with torch.no_grad():
            lm.prefill(ids, mask)
            steps = []
            for chunk, v in zip(chunks, valid):
                steps.append(lm.extend(chunk, v)[v.bool()])
                lm.keep(torch.tensor([3, 3]))
        logits.append(torch.cat(steps))
    assert lm.mask.shape[1] <= 40 and lm.realignments > 0  # 5 + 36 slots written into 40
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("when", ["first_use", "auto"])  # compiled graphs; eager layers over the static caches
def test_compiled_loop_is_token_identical_with_per_row_rollback_and_eos(tiny_model, when, tmp_path, monkeypatch):
    if when == "auto":  # nothing compiled before, so nothing compiles; "first_use" may reuse the session's graphs
        monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    ids, mask = left_padded_batch(tiny_model)  # 7 + 40 tokens: past mistral's and gemma2's window of 16
    reference = greedy(tiny_model, ids, mask, max_new_tokens=40)
    eos = int(reference[1, ids.shape[1] + 9])  # row 1 ends inside a draft
    tiny_model.generation_config.eos_token_id = eos
    expected = greedy(tiny_model, ids, mask, max_new_tokens=40)
    drafter = lambda model, config: ScriptedDrafter(reference, ids.shape[1])
    hf_accel.patch(tiny_model, speculative="test_drafter", plugins=[drafter_plugin(drafter)], compile="inductor",
                   compile_when=when)
    assert torch.equal(greedy(tiny_model, ids, mask, max_new_tokens=40), expected)
    details = hf_accel.report(tiny_model)["speculative"].details
    assert 0 < details["accepted"] < details["drafted"]
    target = compiled(tiny_model)
    assert target["failure"] is None and target["misses"] == 0
    if when == "first_use":
        assert target["compiled_steps"] > 0 and target["check_error"] < 1e-3
    else:
        assert target["graphs_compiled"] == 0 and target["eager_steps"] > 0


def test_later_calls_reuse_the_compiled_graphs(llama):
    ids, _ = left_padded_batch(llama, (30,))
    expected = [greedy(llama, ids[:, :n], torch.ones_like(ids[:, :n]), max_new_tokens=24) for n in (30, 12)]
    hf_accel.patch(llama, speculative="ngram", **AT_ONCE)
    assert torch.equal(greedy(llama, ids, torch.ones_like(ids), max_new_tokens=24), expected[0])
    graphs = compiled(llama)["graphs_compiled"]
    assert 1 <= graphs <= 2  # one graph for single tokens, one for every wider chunk
    short = ids[:, :12]
    assert torch.equal(greedy(llama, short, torch.ones_like(short), max_new_tokens=24), expected[1])
    assert compiled(llama)["graphs_compiled"] == graphs


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_compiled_int4_self_draft_is_token_identical(arch):
    """The default patch on CPU (compiled, the int4 self-draft with its head's best logits exact, extended by
    lookup), plain and with the settings a chat model card sets: every draft and verified position processed."""
    model = make_tiny_model(arch)
    ids, mask = left_padded_batch(model)
    reference = greedy(model, ids, mask, max_new_tokens=30)
    card = dict(repetition_penalty=1.1, min_new_tokens=16, no_repeat_ngram_size=4,
                eos_token_id=int(reference[1, ids.shape[1] + 4]))  # an EOS the minimum holds back in row 1
    with_card = greedy(model, ids, mask, max_new_tokens=30, **card)
    assert not torch.equal(with_card, greedy(model, ids, mask, max_new_tokens=30, eos_token_id=card["eos_token_id"]))
    hf_accel.patch(model, speculative="ngram_self_int4", **AT_ONCE)
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30), reference)
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30, **card), with_card)
    draft = compiled(model, "draft")
    assert draft["failure"] is None and draft["compiled_steps"] > 0
    details = hf_accel.report(model)["speculative"].details
    assert details["sources"]["model_accepted"] > 0 and details["fallbacks_to_stock"] == 0


@pytest.mark.parametrize("loop_fails", [False, True], ids=["call made its tokens", "call raised"])
def test_every_compiled_step_of_a_call_hears_it_end_even_if_each_raises(llama, loop_fails, monkeypatch):
    """The target's compiled step and the draft's each end the call, in the order they began it (closing the
    layers they trusted for it, learning its length), though each end_call raises; the caller gets the last
    error, chained to the one before and, if the call itself raised, to that."""
    hf_accel.patch(llama, speculative="ngram_self_int4", compile="inductor")  # compiles later: eager steps here
    begun, ended = [], []
    begin_call, end_call = compiled_step.CompiledDecodeStep.begin_call, compiled_step.CompiledDecodeStep.end_call

    def recorded_begin(self, new_tokens):
        begun.append(self)
        begin_call(self, new_tokens)

    def raising_end(self, tokens):
        end_call(self, tokens)
        ended.append(self)
        raise RuntimeError(f"end_call {len(ended)} failed")

    monkeypatch.setattr(compiled_step.CompiledDecodeStep, "begin_call", recorded_begin)
    monkeypatch.setattr(compiled_step.CompiledDecodeStep, "end_call", raising_end)
    if loop_fails:
        monkeypatch.setattr(SelfDrafter, "propose", lambda *args: 1 / 0)  # after both steps began the call
    ids, mask = left_padded_batch(llama)
    with pytest.raises(RuntimeError, match="end_call 2 failed") as raised:
        greedy(llama, ids, mask, max_new_tokens=8)
    assert len(begun) == 2 and begun[0] is not begun[1] and ended == begun
    first = raised.value.__context__
    assert isinstance(first, RuntimeError) and str(first) == "end_call 1 failed"
    assert isinstance(first.__context__, ZeroDivisionError) if loop_fails else first.__context__ is None


def test_without_compile_the_loop_runs_eagerly_over_the_patch_cache(llama):
    hf_accel.patch(llama, compile=None, speculative="ngram")
    ids, mask = left_padded_batch(llama)
    greedy(llama, ids, mask, max_new_tokens=8)
    assert "compiled" not in hf_accel.report(llama)["speculative"].details
    assert llama._hf_accel_state.kv_cache.layers[0].length > 0  # the loop ran in the patch's own cache


def test_a_compiled_draft_model_is_token_identical(llama):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, max_new_tokens=30)
    hf_accel.patch(llama, speculative=make_tiny_model("llama", seed=1), **AT_ONCE)
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=30), expected)
    draft = compiled(llama, "draft")  # reads the prompt itself and catches up rows of different lengths
    assert draft["failure"] is None and draft["compiled_steps"] > 0


def test_a_draft_model_shared_by_two_patched_targets_drafts_for_both(llama):
    other = make_tiny_model("llama", seed=2)
    draft = make_tiny_model("llama", seed=1)
    ids, mask = left_padded_batch(llama)
    expected = [greedy(m, ids, mask, max_new_tokens=20) for m in (llama, other)]
    hf_accel.patch(llama, speculative=draft, **AT_ONCE)
    hf_accel.patch(other, speculative=draft, **AT_ONCE)  # the draft's layers are routed already: shared
    for model, want in zip((llama, other), expected):
        assert torch.equal(greedy(model, ids, mask, max_new_tokens=20), want)
        assert compiled(model, "draft")["failure"] is None and compiled(model, "draft")["compiled_steps"] > 0


def test_a_draft_model_whose_layers_cannot_be_routed_drafts_eagerly(llama):
    draft = make_tiny_model("llama", seed=1)
    for layer in draft.model.layers:
        layer.forward = layer.forward  # wrapped on the instance by someone else (accelerate's hooks, say)
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, max_new_tokens=20)
    hf_accel.patch(llama, speculative=draft, **AT_ONCE)
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=20), expected)
    assert "wraps it" in compiled(llama, "draft")["failure"]


class SecondChoiceForLaterRows(SelfDrafter):
    """A copy of the target drafting: row 0 drafts the copy's choices (mostly accepted); every later row its
    second choice (all rejected), so rows advance at up to k + 1 and 1 tokens per step."""

    def start(self, loop):
        super().start(loop)
        self.target_cache = loop.target.cache

    def _scores(self, loop, logits, drafted):
        scores = super()._scores(loop, logits, drafted).clone()
        scores[1:].scatter_(-1, scores[1:].argmax(-1, keepdim=True), -float("inf"))
        return scores


@pytest.mark.parametrize("settings", [{**AT_ONCE, "cache_bucket": 8}, {"compile": None}], ids=["compiled", "eager"])
def test_a_self_draft_drafts_in_the_targets_own_cache_and_holds_none(llama, settings, monkeypatch):
    """The copy writes its drafts past the target's slots (overwritten at verification) and gives them back;
    the target packs its rows before a draft would not fit (rows diverge: the fixed-length cache fills)."""
    ids, mask = left_padded_batch(llama, (6, 6))
    expected = greedy(llama, ids, mask, max_new_tokens=40)
    draft, drafters = copy.deepcopy(llama), []
    with torch.no_grad():  # keys and values of its own: a target reading the copy's slots would go wrong
        for layer in draft.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.1)
            layer.self_attn.v_proj.weight.mul_(1.1)
    compactions = []
    compact = CachedLM._compact
    monkeypatch.setattr(CachedLM, "_compact", lambda lm: (compactions.append(lm.borrowed), compact(lm))[1])

    def make_drafter(model, config):
        drafters.append(SecondChoiceForLaterRows(draft, config, llama.config.vocab_size))
        return drafters[-1]

    hf_accel.patch(llama, speculative="test_drafter", plugins=[drafter_plugin(make_drafter, k=4, low=4, high=4)],
                   **settings)
    assert torch.equal(greedy(llama, ids, mask, max_new_tokens=40), expected)
    lm = drafters[-1].lm
    assert lm.borrowed and lm.cache is drafters[-1].target_cache
    details = hf_accel.report(llama)["speculative"].details
    assert details["accepted"] >= 20 and details["fallbacks_to_stock"] == 0
    assert hf_accel.report(llama)["speculative"].memory["draft models' static caches"] == 0
    if settings["compile"]:
        assert compiled(llama, "draft")["compiled_steps"] > 0
        assert compactions and not any(compactions)  # the target packed its rows, never the draft


@pytest.mark.parametrize("fixed", [True, False], ids=["rollback-cache", "growing-cache"])
def test_a_cachedlm_over_another_ones_cache_gives_its_slots_back_and_never_moves_them(tiny_model, fixed):
    ids, mask = left_padded_batch(tiny_model, (5, 2))
    cache = RollbackStaticCache(tiny_model.config, max_cache_len=8) if fixed else PreallocatedCache(tiny_model.config)
    owner = CachedLM(tiny_model, cache)
    with torch.no_grad():
        owner.prefill(ids, mask)
        guest = CachedLM(tiny_model, over=owner)
        with pytest.raises(RuntimeError, match="cannot fill from a prompt"):
            guest.prefill(ids, mask)
        guest.mirror(owner)
        guest.extend(ids[:, :2])
        guest.extend(ids[:, :1])
        assert int(cache.get_seq_length()) == 8
        guest.give_back()  # wherever the guest left the write position, it goes back to the owner's length
        assert int(cache.get_seq_length()) == 5 and torch.equal(guest.mask, owner.mask)
        if fixed:
            guest.extend(ids[:, :3])
            with pytest.raises(RuntimeError, match="owner makes room first"):
                guest.extend(ids[:, :3])


def test_only_a_model_of_the_same_layer_shapes_and_dtype_runs_over_anothers_cache(tiny_model):
    from hf_accel.runtime.speculative.loop import eager_lm

    owner = CachedLM(tiny_model)
    config = copy.deepcopy(tiny_model.config)
    config.num_hidden_layers = 1
    for other in (type(tiny_model)(config).eval(), copy.deepcopy(tiny_model).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="cannot run over the cache"):
            CachedLM(other, over=owner)
        assert not eager_lm(other, "draft", over=owner).borrowed  # the loop's factory gives it its own
    assert eager_lm(copy.deepcopy(tiny_model), "draft", over=owner).cache is owner.cache


@pytest.mark.parametrize("settings", [AT_ONCE, {"compile": None}], ids=["compiled", "eager"])
def test_a_self_draft_that_cannot_share_the_targets_cache_mirrors_it(settings, monkeypatch):
    """Where the copy cannot run over the target's cache (another dtype, a cache that cannot seek; a bf16
    model's compiled copy beside its eager target), it keeps a cache of its own and copies the target's slots."""
    for module in (speculative_loop, speculative_runner):
        monkeypatch.setattr(module, "can_share", lambda owner, model: False)
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model)
    expected = greedy(model, ids, mask, max_new_tokens=30)
    hf_accel.patch(model, speculative="self_int4", **settings)
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30), expected)
    report = hf_accel.report(model)["speculative"]
    assert report.details["accepted"] > 0
    if settings["compile"]:
        assert compiled(model, "draft")["compiled_steps"] > 0
        assert report.memory["draft models' static caches"] > 0
