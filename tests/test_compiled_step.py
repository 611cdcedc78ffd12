"""compile="inductor": decode steps whose decoder layers run compiled graphs, one per kind of layer and shape class."""

from __future__ import annotations

import gc
import traceback
import types
import weakref

import pytest
import torch
import transformers
from conftest import VOCAB, edit_index, left_padded_batch, make_tiny_model
from torch._C._dynamo.eval_frame import get_eval_frame_callback

import hf_accel
from hf_accel.runtime import compiled_step, graph_calls, layer_graphs
from hf_accel.runtime.regions import ShapeClass, cache_argument
from hf_accel_plugins import compile_inductor
from hf_accel_plugins.compile_inductor import InductorCompiler

#: Compile when a call first needs a shape: these tests are about the compiled graphs, not when to compile.
AT_ONCE = {"compile": "inductor", "speculative": None, "compile_when": "first_use"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled graphs are cached per code object, across model instances; each test counts its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def empty_store(tmp_path, monkeypatch):
    """No shape class compiled on this machine before: the policy's cold estimate applies. Its directory."""
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    return tmp_path


def compile_details(model) -> dict:
    return hf_accel.report(model)["compile"].details


def greedy(model, ids, mask=None, n=40):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


@pytest.fixture
def poisoned_free_slots(monkeypatch):
    """Once switched on (``poisoned_free_slots[0] = True``), during every decode step the static cache's slots
    past the ones the step fills hold NaN, put back after it: an attention that reads them, even masked, turns
    its output into NaN. Compiles check a new graph against the layer reading every slot, so they run before."""
    real = compiled_step.CompiledDecodeStep.__call__
    switch = [False]

    def call(step, *args, **kwargs):
        if not switch[0]:
            return real(step, *args, **kwargs)
        cache = cache_argument(args, kwargs)[1]
        start = int(cache.layers[0].cumulative_length) + kwargs["input_ids"].shape[1]
        free = [tensor[:, :, start:] for layer in cache.layers for tensor in (layer.keys, layer.values)]
        held = [tensor.clone() for tensor in free]
        for tensor in free:
            tensor.fill_(float("nan"))
        try:
            return real(step, *args, **kwargs)
        finally:
            for tensor, before in zip(free, held):
                tensor.copy_(before)

    monkeypatch.setattr(compiled_step.CompiledDecodeStep, "__call__", call)
    return switch


def test_compiled_layers_are_token_identical_batch_3_and_1_past_the_window(tiny_model, poisoned_free_slots):
    ids, mask = left_padded_batch(tiny_model)  # 7 + 40 tokens: past mistral's and gemma2's window of 16
    expected_batch, expected_single = greedy(tiny_model, ids, mask), greedy(tiny_model, ids[:1], n=30)
    hf_accel.patch(tiny_model, kv_cache="static", **AT_ONCE)
    assert torch.equal(greedy(tiny_model, ids, mask), expected_batch)
    assert torch.equal(greedy(tiny_model, ids[:1], n=30), expected_single)
    details = compile_details(tiny_model)
    assert details["failure"] is None and details["misses"] == 0
    kinds = {shape.split(",")[0] for shape in details["shapes"]}
    assert len(details["shapes"]) == 2 * len(kinds)  # batch 1 and batch > 1, single tokens, per kind of layer
    assert all(status.startswith("compiled in") for status in details["shapes"].values())
    assert details["compiled_steps"] == 39 + 29 - 2  # every decode step but the one that compiled its shape
    assert details["check_error"] < compiled_step.CHECK_TOLERANCE and details["compile_seconds"] > 0
    # Again with the cache's unfilled slots poisoned: attention over them is work for nothing (they are
    # masked), so the compiled layers read only the filled ones.
    poisoned_free_slots[0] = True
    assert torch.equal(greedy(tiny_model, ids, mask), expected_batch)
    assert torch.equal(greedy(tiny_model, ids[:1], n=30), expected_single)
    details = compile_details(tiny_model)
    assert details["failure"] is None and details["misses"] == 0 and details["compiled_steps"] == 2 * (39 + 29) - 2


def test_the_default_eager_layers_are_token_identical_batch_3_and_1_past_the_window(tiny_model, empty_store,
                                                                                     poisoned_free_slots):
    """compile_when="auto" with nothing compiled: every layer runs eagerly over the static cache's filled slots
    (the unfilled ones poisoned)."""
    ids, mask = left_padded_batch(tiny_model)
    expected_batch, expected_single = greedy(tiny_model, ids, mask), greedy(tiny_model, ids[:1], n=30)
    hf_accel.patch(tiny_model, compile="inductor", speculative=None)
    poisoned_free_slots[0] = True
    for _ in range(2):  # the second time after the policy has seen each shape run
        assert torch.equal(greedy(tiny_model, ids, mask), expected_batch)
        assert torch.equal(greedy(tiny_model, ids[:1], n=30), expected_single)
    details = compile_details(tiny_model)
    assert details["graphs_compiled"] == 0 and details["eager_steps"] == 2 * (39 + 29) and details["failure"] is None
    assert details["misses"] == 0
    assert all(status.startswith("eager for now") for status in details["shapes"].values())


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_speculative_loops_chunks_and_self_drafts_read_only_the_filled_slots(arch, poisoned_free_slots):
    """Verification chunks, drafts written past the target's slots in its own cache, rows realigned after
    accepting different numbers of tokens: every compiled forward reads only the filled slots."""
    model = make_tiny_model(arch)
    ids, mask = left_padded_batch(model)
    expected = greedy(model, ids, mask)
    hf_accel.patch(model, speculative="ngram_self_int4", compile="inductor", compile_when="first_use")
    greedy(model, ids, mask)  # compiles the verification chunks' and the draft's single tokens' graphs
    poisoned_free_slots[0] = True
    assert torch.equal(greedy(model, ids, mask), expected)
    speculative = hf_accel.report(model)["speculative"].details
    assert speculative["sources"]["model_accepted"] > 0
    for details in (compile_details(model), speculative["compiled"]["draft"]):
        assert details["failure"] is None and details["misses"] == 0 and details["compiled_steps"] > 0


def test_calls_whose_inputs_cannot_be_cut_are_a_shape_class_of_their_own(empty_store):
    """A 256-wide head makes the rotary tables as wide as a 256-slot cache: such calls read every slot (a table's
    width cannot be told from a per-slot input's), calls over longer caches only the filled ones. Each kind is
    compiled for itself, and calls of either kind after the other's graph exists run their own (no miss)."""
    model = make_tiny_model("llama")
    model.config.head_dim = 256
    model = type(model)(model.config).eval()
    ids, mask = left_padded_batch(model, (9, 6, 8))
    calls = [(1, 20), (1, 300), (3, 300), (2, 20)]  # slots: 256, 512 (batch 1); 512, then 256 (batch > 1)
    expected = [greedy(model, ids[:b], mask[:b], n=n) for b, n in calls]
    hf_accel.patch(model, **AT_ONCE)
    for (b, n), tokens in zip(calls, expected):
        assert torch.equal(greedy(model, ids[:b], mask[:b], n=n), tokens)
    details = compile_details(model)
    assert details["failure"] is None and details["misses"] == 0 and details["graphs_compiled"] == 4
    assert sorted(details["shapes"]) == [f"LlamaDecoderLayer, batch {rows}, 1 token{every}"
                                         for rows in ("1", "> 1") for every in ("", ", every cache slot")]


def test_which_layer_inputs_let_attention_read_only_the_filled_slots():
    cache = types.SimpleNamespace(max_cache_len=256, keys=torch.zeros(1), cumulative_length=torch.tensor(10))
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)

    def reads_filled(hidden_size=64, table_width=16, **extra):
        hidden = torch.zeros(1, 1, hidden_size)
        table = torch.zeros(1, 1, table_width)
        kwargs = {"attention_mask": mask, "position_embeddings": (table, table), "cache": None, **extra}
        return layer_graphs.reads_filled_slots(cache, "cache", (hidden,), kwargs)

    assert reads_filled()
    assert reads_filled(hidden_size=256)  # hidden states as wide as the cache are not per-slot inputs
    assert not reads_filled(table_width=256)  # a rotary table as wide: cannot be told from a per-slot one
    assert not reads_filled(alibi=torch.zeros(4, 1, 256))  # a per-key bias that is not a 4-D mask
    _, kwargs, filled = layer_graphs.cut_to_filled(cache, (torch.zeros(1, 1, 64),), {"attention_mask": mask})
    assert filled == 11 and kwargs["attention_mask"].shape == (1, 1, 1, 11)


def test_a_new_graph_is_checked_against_the_layer_reading_every_slot(monkeypatch):
    """A graph that read the wrong slots would agree with an eager layer cut the same wrong way: the check's
    reference reads them all, so a wrong cut is refused."""
    real = layer_graphs.cut_masks

    def one_slot_short(layer_cache, args, kwargs):
        cut = real(layer_cache, args, kwargs)
        return cut[0], cut[1], cut[2] - 1

    monkeypatch.setattr(layer_graphs, "cut_masks", one_slot_short)
    model = make_tiny_model("llama")
    ids = left_padded_batch(model, (9,))[0]
    hf_accel.patch(model, **AT_ONCE)
    greedy(model, ids, n=5)
    assert "differs from eager" in compile_details(model)["failure"]


def test_a_nan_anywhere_is_an_infinite_disagreement():
    x, nan = torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])
    assert layer_graphs.disagreement([x, x], [x, nan]) == float("inf")  # max() alone keeps a NaN only when first
    assert layer_graphs.disagreement([x, x], [x, x]) == 0.0


@pytest.mark.parametrize("when", ["auto", "first_use"])
def test_a_per_key_bias_over_the_cache_keeps_its_layers_reading_every_slot(when, empty_store):
    """Bloom adds an alibi bias as long as the cache to its attention scores: eager layers cannot cut the keys
    to the filled slots there, so they read them all."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_batch(model)
    expected = greedy(model, ids, mask, n=20)
    hf_accel.patch(model, compile="inductor", speculative=None, compile_when=when)
    assert torch.equal(greedy(model, ids, mask, n=20), expected)
    assert compile_details(model)["failure"] is None


def test_one_graph_serves_every_layer_of_a_kind():
    model = make_tiny_model("llama")
    model.config.num_hidden_layers = 4
    model = type(model)(model.config).eval()  # four identical layers
    ids = left_padded_batch(model, (9,))[0]
    expected = greedy(model, ids, n=12)
    hf_accel.patch(model, **AT_ONCE)
    assert torch.equal(greedy(model, ids, n=12), expected)
    assert compile_details(model)["graphs_compiled"] == 1 and compile_details(model)["misses"] == 0


def test_new_batch_sizes_prompt_lengths_and_lengths_run_the_graphs_already_compiled(llama):
    ids, mask = left_padded_batch(llama, (12, 5, 9, 7, 3))
    expected = {(b, n): greedy(llama, ids[:b], mask[:b], n) for b, n in ((2, 20), (1, 9), (3, 35), (5, 6), (4, 300))}
    hf_accel.patch(llama, **AT_ONCE)
    assert torch.equal(greedy(llama, ids[:2], mask[:2], 20), expected[2, 20])  # compiles batch > 1
    assert torch.equal(greedy(llama, ids[:1], mask[:1], 9), expected[1, 9])  # compiles batch 1
    graphs, steps = compile_details(llama)["graphs_compiled"], compile_details(llama)["compiled_steps"]
    assert graphs == 2
    for batch, n in ((3, 35), (5, 6), (4, 300)):  # new batch sizes, prompt lengths, and a longer cache (512)
        assert torch.equal(greedy(llama, ids[:batch], mask[:batch], n), expected[batch, n])
    details = compile_details(llama)
    assert details["graphs_compiled"] == graphs and details["misses"] == 0
    assert details["compiled_steps"] == steps + 34 + 5 + 299
    # The longest call grew the shared buffers: the caches of other batch sizes went with the old ones.
    assert list(llama._hf_accel_state.compiled_step._caches) == [4]


def test_the_cache_is_reused_while_it_fits_and_grows_once():
    model = make_tiny_model("llama")
    ids, _ = left_padded_batch(model, (10,))
    expected = greedy(model, ids, n=60)
    hf_accel.patch(model, cache_bucket=32, **AT_ONCE)
    step = model._hf_accel_state.compiled_step
    greedy(model, ids, n=12)  # 22 positions: a 32-position cache
    length, first = step._caches[1]
    assert length == 32
    greedy(model, ids, n=20)
    assert step._caches[1][1] is first
    assert torch.equal(greedy(model, ids, n=60), expected)  # 70 positions: grows to 96, same graph
    assert step._caches[1][0] == 96 and step._caches[1][1] is not first
    assert compile_details(model)["graphs_compiled"] == 1


def test_caches_of_every_batch_size_share_one_buffer_and_the_most_recent_are_kept(llama, empty_store):
    """A server sees many batch sizes: one fixed-length cache each would grow without bound. The caches view
    one buffer pool (the largest batch x length asked for), each call refilling what it uses: calls that
    alternate batch sizes, each overwriting what the others' caches view, still get stock's tokens."""
    from hf_accel.runtime.kv_cache import CACHES_KEPT

    hf_accel.patch(llama, cache_bucket=32, **AT_ONCE)  # compiled graphs, not eager layers, over the pool
    step = llama._hf_accel_state.compiled_step
    sizes = list(range(1, CACHES_KEPT + 3))
    stock = make_tiny_model("llama")
    for batch in [*sizes, *sizes[::-1], 3, 5, 2]:
        ids, mask = left_padded_batch(llama, (6,) * batch, seed=batch)
        expected = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(greedy(llama, ids, mask, n=8), expected), batch
    details = compile_details(llama)
    # compiled graphs served every step but the two that checked each shape class's new graph against eager
    assert details["compiled_steps"] > 100 and details["misses"] == 0 and details["eager_steps"] == 2
    assert details["cached_batch_sizes"] == [1, 3, 5, 2] == list(step._caches)
    config = llama.config  # 32 positions x layers x (keys + values) x kv heads x head dim x fp32, per row
    per_row = 32 * config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size // 4) * 4
    assert details["cache_bytes"] == per_row * max(sizes)  # the largest batch's, whatever else was cached


def test_compiled_graphs_compute_with_weights_loaded_after_they_were_compiled(llama):
    other = make_tiny_model("llama", seed=5)
    ids, mask = left_padded_batch(llama, (9, 4))
    expected = greedy(other, ids, mask, n=12)
    hf_accel.patch(llama, **AT_ONCE)
    greedy(llama, ids, mask, n=12)
    graphs = compile_details(llama)["graphs_compiled"]
    llama.load_state_dict(other.state_dict())
    assert torch.equal(greedy(llama, ids, mask, n=12), expected)
    assert compile_details(llama)["graphs_compiled"] == graphs > 0  # the same graphs, not recompiled


def test_a_failed_compile_falls_back_to_eager_with_the_reason(llama, monkeypatch):
    def no_compiler(self, graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(InductorCompiler, "__call__", no_compiler)
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, **AT_ONCE)
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)
    details = compile_details(llama)
    assert "no C++ compiler found" in details["failure"] and details["compiled_steps"] == 0
    assert details["eager_steps"] == 9


def test_a_graph_that_disagrees_with_eager_is_refused(llama, monkeypatch):
    def off_by_one(self, graph, example_inputs):
        self.graphs += 1
        return lambda *inputs: [out + 1.0 if out.is_floating_point() else out for out in graph(*inputs)]

    monkeypatch.setattr(InductorCompiler, "__call__", off_by_one)
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, **AT_ONCE)
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)
    assert "differs from eager" in compile_details(llama)["failure"]
    assert compile_details(llama)["compiled_steps"] == 0


def test_a_graph_that_raises_when_it_runs_falls_back_to_eager_with_the_reason(llama, monkeypatch):
    direct = []  # per failing run: whether graph_calls ran the graph's code itself, outside dynamo's own call

    def breaks_after_its_check(self, graph, example_inputs):
        self.graphs += 1
        runs = []

        def run(*inputs):
            runs.append(1)
            if len(runs) > 1:  # the compile's own run (the check) passes; the next one fails
                direct.append(any(frame.filename == graph_calls.__file__ and "lead.function(" in frame.line
                                  for frame in traceback.extract_stack()))
                raise RuntimeError("out of memory")
            return graph(*inputs)
        return run

    monkeypatch.setattr(InductorCompiler, "__call__", breaks_after_its_check)
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, **AT_ONCE)
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)  # the cache's index was put back
    details = compile_details(llama)
    assert "running the compiled" in details["failure"] and "out of memory" in details["failure"]
    assert details["compiled_steps"] == 0
    # A direct call sets dynamo's frame callback to run-only around the graph; raising, it still puts it back
    assert direct == [True] and get_eval_frame_callback() is None


def test_calls_the_step_does_not_serve_run_stock(llama):
    ids, mask = left_padded_batch(llama)
    hf_accel.patch(llama, **AT_ONCE)
    expected = llama._hf_accel_state.original_generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                       num_beams=2, do_sample=False)
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False)
    assert torch.equal(out, expected)
    llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, disable_compile=True)
    assert compile_details(llama)["graphs_compiled"] == 0


def test_outside_a_decode_step_the_layers_run_their_own_forward(llama):
    ids, mask = left_padded_batch(llama)
    with torch.no_grad():
        expected = llama(input_ids=ids, attention_mask=mask).logits
    hf_accel.patch(llama, **AT_ONCE)
    with torch.no_grad():
        assert torch.equal(llama(input_ids=ids, attention_mask=mask).logits, expected)
    assert compile_details(llama)["graphs_compiled"] == 0


def test_unpatch_removes_the_compiled_call_and_the_layer_routing(llama):
    hf_accel.patch(llama, compile="inductor")
    assert "get_compiled_call" in vars(llama)
    assert all("forward" in vars(layer) for layer in llama.model.layers)
    hf_accel.unpatch(llama)
    assert "get_compiled_call" not in vars(llama) and not hasattr(llama, "_hf_accel_state")
    assert not any("forward" in vars(layer) for layer in llama.model.layers)


def test_a_model_whose_layers_are_wrapped_on_the_instance_is_declined(llama):
    for layer in llama.model.layers:
        layer.forward = layer.forward  # what accelerate's hooks do
    with pytest.raises(hf_accel.BackendUnavailableError, match="wrapped on the instance"):
        hf_accel.patch(llama, compile="inductor")


def test_without_a_compiler_auto_prepacks_and_inductor_says_what_to_install(llama, monkeypatch):
    monkeypatch.setattr(compile_inductor, "_cpp_compiler", lambda: None)
    with pytest.raises(hf_accel.BackendUnavailableError, match="C\\+\\+ compiler"):
        hf_accel.patch(llama, compile="inductor")
    hf_accel.patch(llama, speculative=None)
    report = hf_accel.report(llama)["compile"]
    assert report.backend == "onednn_prepack" and [s["backend"] for s in report.skipped] == ["inductor"]


def test_compile_off_keeps_the_static_cache_eager(llama):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=10)
    hf_accel.patch(llama, kv_cache="static", compile=False, speculative=None)
    assert llama._hf_accel_state.compiled_step is None
    assert torch.equal(greedy(llama, ids, mask, n=10), expected)


# -- when to compile -----------------------------------------------------------------------------------------
def test_auto_runs_a_first_short_call_eagerly_and_says_why(llama, empty_store):
    ids, mask = left_padded_batch(llama)
    expected = greedy(llama, ids, mask, n=12)
    hf_accel.patch(llama, compile="inductor", speculative=None)
    assert torch.equal(greedy(llama, ids, mask, n=12), expected)
    details = compile_details(llama)
    assert details["when"] == "auto" and details["graphs_compiled"] == 0 and details["eager_steps"] == 11
    shape = str(ShapeClass("LlamaDecoderLayer", single_row=False, single_token=True))
    assert details["shapes"][shape].startswith("eager for now: compiling is expected to take ~10.0 s")


@pytest.fixture
def steady_clock(monkeypatch):
    """Every eager decode step of the compiled step takes 10 ms: each read of its clock is 10 ms later."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(compiled_step, "_clock", lambda: next(ticks) * 0.01)


def test_auto_compiles_at_the_start_of_a_call_long_enough_to_pay_for_it(llama, empty_store, steady_clock):
    ids, mask = left_padded_batch(llama, (9,))
    expected = {n: greedy(llama, ids, mask, n) for n in (9, 6, 300)}
    hf_accel.patch(llama, compile="inductor", speculative=None)
    step = llama._hf_accel_state.compiled_step
    # Compiling costs what 0.6 s of eager decoding loses: more than 14 decode steps, less than 300.
    step.policy = compiled_step.CompilePolicy(cold_estimate=0.6 * step.policy.saved_fraction)
    assert torch.equal(greedy(llama, ids, mask, 9), expected[9])  # eager: 8 steps; 0.08 s per 9 tokens
    assert torch.equal(greedy(llama, ids, mask, 6), expected[6])  # eager: 0.13 s so far + 0.05 s expected
    assert compile_details(llama)["graphs_compiled"] == 0
    assert torch.equal(greedy(llama, ids, mask, 300), expected[300])  # 0.13 s + ~2.5 s expected: compiles now
    details = compile_details(llama)
    decode_steps = expected[300].shape[1] - ids.shape[1] - 1  # the random model may stop at EOS
    assert details["graphs_compiled"] == 1 and details["compiled_steps"] == decode_steps - 1  # all but the first
    status = details["shapes"][str(ShapeClass("LlamaDecoderLayer", single_row=True, single_token=True))]
    assert status.startswith("compiled in")


def test_auto_compiles_once_eager_calls_have_cost_as_much_as_compiling(llama, empty_store, steady_clock):
    ids, mask = left_padded_batch(llama, (9,))
    expected = greedy(llama, ids, mask, 20)
    hf_accel.patch(llama, compile="inductor", speculative=None)
    step = llama._hf_accel_state.compiled_step
    step.policy = compiled_step.CompilePolicy(cold_estimate=0.05 * step.policy.saved_fraction)
    assert torch.equal(greedy(llama, ids, mask, 20), expected)  # the first call: nothing known per token
    details = compile_details(llama)
    # Five eager steps (0.05 s) pay for it; the sixth compiles (and runs eagerly); the other 13 run compiled.
    assert details["graphs_compiled"] == 1 and details["eager_steps"] == 6 and details["compiled_steps"] == 13



def test_the_policy_weighs_eager_time_lost_against_the_compile_estimate():
    from hf_accel.runtime.compile_policy import CompilePolicy

    policy = CompilePolicy(saved_fraction=0.2)
    assert not policy.decide((5.0, "cold"), eager_seconds=10.0).compile  # lost 2 s < 5 s
    assert policy.decide((5.0, "cold"), eager_seconds=10.0, call_remaining=15.0).compile  # lost 5 s
    assert "waiting has lost ~2.0 s so far (" in policy.decide((5.0, "cold"), eager_seconds=10.0).reason
    assert "~2.0 s so far and would lose ~3.0 s more in this call, more than the ~5.0 s" in policy.decide(
        (5.0, "cold"), eager_seconds=10.0, call_remaining=15.0).reason
    assert CompilePolicy(when="first_use").decide((500.0, "cold"), eager_seconds=0).compile
    with pytest.raises(ValueError, match="compile_when='soon' is not one of 'auto', 'first_use'"):
        CompilePolicy(when="soon")


def test_the_timer_measures_a_saving_once_enough_steps_of_each_kind_ran_and_tells_it_once():
    from hf_accel.runtime.compile_policy import KEPT_STEPS, MEASURED_STEPS, CompilePolicy, StepTimer

    timer = StepTimer()
    for _ in range(MEASURED_STEPS):
        timer.add(["a", "b"], 0.04, compiled=False)
    for _ in range(MEASURED_STEPS - 1):
        timer.add(["a", "b"], 0.03, compiled=True)
    assert list(timer.measured({"a", "b"})) == []  # one compiled step short
    timer.add(["a", "b"], 0.03, compiled=True)
    assert list(timer.measured({"a"})) == [("a", 0.25)]  # b was never compiled: nothing to tell of it
    assert list(timer.measured({"a"})) == []  # told once
    slower = StepTimer()
    for compiled, seconds in [(False, 0.1)] * 8 + [(True, 0.2)] * 8:
        slower.add(["a"], seconds, compiled)
    assert list(slower.measured({"a"})) == [("a", 0.05)]  # the floor: auto still compiles, late, and measures anew
    outliers = StepTimer()  # a process's first eager step, and one compiled step of a busy moment
    for compiled, seconds in [(False, 0.3)] + [(False, 0.04)] * 8 + [(True, 0.03)] * 7 + [(True, 1.0)]:
        outliers.add(["a"], seconds, compiled)
    assert list(outliers.measured({"a"})) == [("a", 0.25)]
    nearest = StepTimer()  # the latest eager steps and the first compiled ones: nearest each other in context
    for compiled, seconds in ([(False, 0.01)] * KEPT_STEPS + [(False, 0.04)] * KEPT_STEPS
                              + [(True, 0.03)] * KEPT_STEPS + [(True, 0.05)] * KEPT_STEPS):
        nearest.add(["a"], seconds, compiled)
    assert list(nearest.measured({"a"})) == [("a", 0.25)]
    policy = CompilePolicy(saved_fraction=0.1)
    assert not policy.decide((1.0, "warm"), eager_seconds=4.0).compile  # 0.4 s lost at the assumed 10%
    decision = policy.decide((1.0, "warm"), eager_seconds=4.0, measured_saving=0.3)  # 1.2 s at the measured 30%
    assert decision.compile and "(a compiled step measured 30% faster here)" in decision.reason


@pytest.fixture
def eager_layers_cost_5_ms(monkeypatch):
    """A clock on which each read is 10 ms later and each eager layer call costs 5 ms more: an eager decode
    step of the tiny llama (2 layers) takes 20 ms, a compiled one 10 ms."""
    state = {"reads": 0, "eager": 0}

    def clock():
        state["reads"] += 1
        return state["reads"] * 0.01 + state["eager"] * 0.005

    def eager_layer(*args, **kwargs):
        state["eager"] += 1
        return real(*args, **kwargs)

    real = compiled_step.eager_layer
    monkeypatch.setattr(compiled_step, "_clock", clock)
    monkeypatch.setattr(compiled_step, "eager_layer", eager_layer)


def test_what_compiling_saved_is_kept_and_a_later_process_compiles_sooner_for_it(empty_store, eager_layers_cost_5_ms):
    """A process that ran a shape class eagerly and then compiled measures what a compiled step saved (here half
    of an eager one, not the 11% assumed): the store keeps it, and the next process's ``auto`` counts with it."""
    from hf_accel.runtime.compile_cache import CompileStore

    def patched():
        torch._dynamo.reset()  # as a new process: only the store carries over
        model = make_tiny_model("llama")
        hf_accel.patch(model, compile="inductor", speculative=None)
        step = model._hf_accel_state.compiled_step
        # Compiling costs what 10 eager steps of 20 ms lose at the assumed 11%
        step.policy = compiled_step.CompilePolicy(cold_estimate=0.2 * step.policy.saved_fraction,
                                                  warm_estimate=0.2 * step.policy.saved_fraction)
        return model

    first = patched()
    ids, mask = left_padded_batch(first, (9,))
    expected = greedy(make_tiny_model("llama"), ids, mask, 40)
    assert torch.equal(greedy(first, ids, mask, 40), expected)
    details = compile_details(first)
    assert details["graphs_compiled"] == 1 and details["eager_steps"] == 11 and details["compiled_steps"] >= 8
    shape = ShapeClass("LlamaDecoderLayer", single_row=True, single_token=True)
    store, fingerprint = CompileStore(), first._hf_accel_state.compiled_step._fingerprint(shape.kind)
    assert store.lookup(fingerprint, shape).saved_fraction == 0.5  # 10 ms compiled against 20 ms eager

    # A first call of 6 tokens (5 decode steps; no forecast yet): at 50% it pays after 3 eager steps, compiles
    # at the 4th and runs the 5th compiled; at the assumed 11% it needs 10 and stays eager.
    second = patched()
    assert torch.equal(greedy(second, ids, mask, 6), expected[:, :ids.shape[1] + 6])
    details = compile_details(second)
    assert (details["graphs_compiled"], details["eager_steps"], details["compiled_steps"]) == (1, 4, 1)
    edit_index(empty_store / "compile", lambda entry: entry.pop("median_saving"))  # the same store, unmeasured
    third = patched()
    assert torch.equal(greedy(third, ids, mask, 6), expected[:, :ids.shape[1] + 6])
    assert (compile_details(third)["graphs_compiled"], compile_details(third)["eager_steps"]) == (0, 5)


def test_a_new_batch_size_waits_for_its_own_compile_to_pay(llama, empty_store, steady_clock):
    """Time lost waiting on batch 1 does not pay for compiling batch > 1: a server's first batch of three runs
    eagerly, as fast as before, instead of stopping for a compile."""
    ids, mask = left_padded_batch(llama, (9, 5, 7))
    expected = [greedy(llama, ids[:1], mask[:1], 20), greedy(llama, ids, mask, 4)]
    hf_accel.patch(llama, compile="inductor", speculative=None)
    step = llama._hf_accel_state.compiled_step
    step.policy = compiled_step.CompilePolicy(cold_estimate=0.05 * step.policy.saved_fraction)
    assert torch.equal(greedy(llama, ids[:1], mask[:1], 20), expected[0])  # batch 1 waits 0.05 s, compiles
    assert torch.equal(greedy(llama, ids, mask, 4), expected[1])
    shapes = compile_details(llama)["shapes"]
    assert shapes[str(ShapeClass("LlamaDecoderLayer", single_row=True, single_token=True))].startswith("compiled")
    assert shapes[str(ShapeClass("LlamaDecoderLayer", single_row=False, single_token=True))].startswith("eager for now")
    assert compile_details(llama)["graphs_compiled"] == 1


def test_several_sequences_per_prompt_get_a_cache_with_a_row_each():
    """Stock expands each prompt into num_return_sequences rows before the cache sees them: the cache is for
    that many rows, and a later call of one row gets its own."""
    model, stock = make_tiny_model("llama"), make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (6,))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=1,
                  num_return_sequences=4)
    expected = stock.generate(**kwargs)
    hf_accel.patch(model, speculative=None, compile_when="auto")
    assert torch.equal(model.generate(**kwargs), expected)
    assert list(model._hf_accel_state.compiled_step._caches) == [4]
    assert torch.equal(greedy(model, ids, mask, n=8), greedy(stock, ids, mask, n=8))


class FilledCacheLayer:
    """What a step's graph arguments read of a static cache layer."""

    def __init__(self, filled: int, length: int = 16) -> None:
        self.keys, self.max_cache_len = torch.zeros(1, 2, length, 4), length
        self.cumulative_length = torch.tensor(filled)


def test_a_steps_layers_called_alike_share_one_cut_of_their_arguments_and_one_filled_otherwise_gets_its_own():
    arguments, mask, cache = layer_graphs.StepArguments(), torch.randn(1, 1, 3, 16), object()
    cuts, spans = [], []
    for layer in (FilledCacheLayer(5), FilledCacheLayer(5), FilledCacheLayer(7)):
        hidden = torch.randn(1, 3, 4)
        kwargs = {"attention_mask": mask, "past_key_values": cache}  # a dict of its own, the step's objects
        assert arguments.reads_filled_slots(layer, "past_key_values", (hidden,), kwargs)
        span, args, rest = arguments.graph_arguments(layer, "past_key_values", (hidden,), kwargs, True)
        expected_span, _, expected = layer_graphs.graph_arguments(layer, "past_key_values", (hidden,), kwargs, True)
        assert args == (hidden,) and args[0] is hidden and "past_key_values" not in rest
        assert span.shape == expected_span.shape and torch.equal(rest["attention_mask"], expected["attention_mask"])
        cuts.append(rest["attention_mask"])
        spans.append(span)
    assert cuts[0] is cuts[1] and spans[0] is spans[1] and cuts[2] is not cuts[0]
    held = weakref.ref(kwargs.pop("attention_mask"))  # the ids it keys on stay the inputs' while it lives
    del mask, kwargs
    gc.collect()
    assert held() is not None
    mask = held()
    assert [cut.shape[-1] for cut in cuts] == [8, 8, 10] and torch.equal(cuts[2], mask[..., :10])
    # Hidden states passed by name: worked out per call, as before
    by_name = {"hidden_states": torch.randn(1, 3, 4), "attention_mask": mask, "past_key_values": cache}
    span, args, rest = arguments.graph_arguments(FilledCacheLayer(5), "past_key_values", (), by_name, True)
    assert args == () and rest["hidden_states"] is by_name["hidden_states"] and rest["attention_mask"] is not cuts[0]


@pytest.mark.parametrize("filled_slots", [True, False])
def test_a_cache_passed_by_position_keeps_its_place_and_each_layer_its_own_hidden_states(filled_slots):
    """As GPT-2 passes it: the cache second, None in its place in the graph's arguments."""
    arguments, mask, cache = layer_graphs.StepArguments(), torch.randn(1, 1, 3, 16), object()
    made = []
    for _ in range(2):
        hidden = torch.randn(1, 3, 4)
        span, args, rest = arguments.graph_arguments(FilledCacheLayer(5), 1, (hidden, cache, mask), {}, filled_slots)
        assert args[0] is hidden and args[1] is None and rest == {}
        made.append((span, args[2]))
    assert made[0][0] is made[1][0] and made[0][1] is made[1][1]
    if filled_slots:
        assert made[0][0].shape == (8, 0) and torch.equal(made[0][1], mask[..., :8])
    else:
        assert made[0][0] is None and made[0][1] is mask
