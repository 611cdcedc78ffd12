"""A kind of layer's compiled graphs, dynamo's guards checked once per step (hf_accel.runtime.graph_calls)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model

import hf_accel
from hf_accel.runtime.graph_calls import StepGuardedCalls, TrustedLayers, Undescribable, signature, step_signature
from hf_accel.runtime.layer_graphs import _function_named


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CacheLayer:
    def __init__(self, index: int) -> None:
        self.index, self.keys, self.bias = index, torch.zeros(1), torch.full((4,), float(index))


def _body(layer, layer_cache, cache_slot, span, *args, **kwargs):
    return layer(args[0]) + layer_cache.bias * kwargs["scale"]


def _breaking_body(layer, layer_cache, cache_slot, span, *args, **kwargs):
    hidden = layer(args[0])
    torch._dynamo.graph_break()
    return hidden + layer_cache.bias


def _breaks_inside(layer, hidden):
    hidden = layer(hidden)
    torch._dynamo.graph_break()
    return hidden * 2


def _breaking_at_return_body(layer, layer_cache, cache_slot, span, *args, **kwargs):
    return _breaks_inside(layer, args[0] + layer_cache.bias)  # as a layer's forward that breaks: no resume


class Counted:
    """``torch._dynamo.run(body)``, counting the calls it serves."""

    def __init__(self, body) -> None:
        self.run, self.calls = torch._dynamo.run(body), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.run(*args, **kwargs)


class CountingBackend:
    """Compiles nothing: runs each graph as traced, counting the runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, graph, example_inputs):
        def run(*args):
            self.runs += 1
            return graph(*args)
        return run


def compiled_calls(body, name: str, *inputs, backend="eager", **kwargs) -> StepGuardedCalls:
    """Calls of ``body`` (a function of its own, its graph compiled from one call of ``inputs``) in an open
    ``generate`` call; ``.dynamo_run.calls`` counts those dynamo's own lookup served."""
    body = _function_named(body, name)
    torch.compile(body, backend=backend, dynamic=False)(*inputs, **kwargs)
    trusted = TrustedLayers()
    trusted.open()
    return StepGuardedCalls(body, Counted(body), trusted)


def run_steps(calls, layers, caches, x, steps=3, check=_body, **kwargs):
    for _ in range(steps):
        leads = {}
        for layer, cache in zip(layers, caches):
            out = calls(leads, layer, cache, "cache", None, x, **kwargs)
            assert torch.equal(out, check(layer, cache, 0, None, x, **kwargs))


def test_later_calls_of_a_step_alike_its_first_skip_the_guards_and_compute_the_same():
    layers, caches, x = [torch.nn.Linear(4, 4) for _ in range(3)], [CacheLayer(i) for i in range(3)], torch.randn(2, 4)
    calls = compiled_calls(_body, "alike", layers[0], caches[0], "cache", None, x, scale=2.0)
    run_steps(calls, layers, caches, x, scale=2.0)
    # Step 1: the lead chose its graph, each later layer was checked in full once; steps 2 and 3: those two direct.
    assert calls.trusted.direct_calls == 4 and calls.trusted.guard_checks == 3 + 2
    assert calls.dynamo_run.calls == 0
    calls.trusted.close()
    calls({}, layers[1], caches[1], "cache", None, x, scale=2.0)  # outside a call: dynamo's lookup
    assert calls.dynamo_run.calls == 1 and calls.trusted.direct_calls == 4


def test_a_layer_its_graphs_guards_reject_runs_through_dynamo_every_time():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)]  # the second: no bias, a guard fails
    caches, x = [CacheLayer(0), CacheLayer(1)], torch.randn(2, 4)
    calls = compiled_calls(_body, "rejected", layers[0], caches[0], "cache", None, x, scale=1.0)
    run_steps(calls, layers, caches, x, scale=1.0)
    assert calls.dynamo_run.calls == 3 and calls.trusted.direct_calls == 0


def test_a_call_unlike_its_steps_first_is_checked_in_full():
    layer, cache, x = torch.nn.Linear(4, 4), CacheLayer(0), torch.randn(2, 4)
    calls = compiled_calls(_body, "unlike", layer, cache, "cache", None, x, scale=1.0)
    leads = {}
    calls(leads, layer, cache, "cache", None, x, scale=1.0)
    wider = torch.randn(3, 4)  # another shape: the graph was compiled for a batch of 2 only (dynamic=False)
    out = calls(leads, layer, cache, "cache", None, wider, scale=1.0)
    assert torch.equal(out, _body(layer, cache, 0, None, wider, scale=1.0))
    checks = calls.trusted.guard_checks
    calls(leads, layer, cache, "cache", None, wider, scale=1.0)  # the step knows no graph serves it: not checked again
    assert calls.trusted.guard_checks == checks
    out = calls(leads, layer, cache, "cache", None, x, scale=3.0)  # a constant the graph was specialized on
    assert torch.equal(out, _body(layer, cache, 0, None, x, scale=3.0))
    assert calls.dynamo_run.calls == 3 and calls.trusted.direct_calls == 0


def nested_layer() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU()))


def test_a_module_assigned_into_a_layer_mid_call_has_it_checked_again():
    layers, caches, x = [nested_layer() for _ in range(2)], [CacheLayer(0), CacheLayer(1)], torch.randn(2, 4)
    calls = compiled_calls(_body, "assigned", layers[0], caches[0], "cache", None, x, scale=1.0)
    run_steps(calls, layers, caches, x, steps=2, scale=1.0)
    assert calls.trusted.direct_calls == 1
    layers[1][1][0] = torch.nn.Tanh()  # into a grandchild, as a streamer might between two steps of one call
    run_steps(calls, layers, caches, x, steps=2, scale=1.0)  # layer 1 fails the graph's guards: dynamo, eagerly
    assert calls.trusted.direct_calls == 1 and calls.dynamo_run.calls == 2


def test_a_parameter_assigned_or_training_flipped_mid_call_has_the_layer_checked_again():
    layers, caches, x = [nested_layer() for _ in range(2)], [CacheLayer(0), CacheLayer(1)], torch.randn(2, 4)
    calls = compiled_calls(_body, "flipped", layers[0], caches[0], "cache", None, x, scale=1.0)
    run_steps(calls, layers, caches, x, steps=2, scale=1.0)
    checks = calls.trusted.guard_checks
    layers[1][0].weight = torch.nn.Parameter(layers[1][0].weight.detach().clone(), requires_grad=False)
    run_steps(calls, layers, caches, x, steps=1, scale=1.0)  # its requires_grad fails a guard
    assert calls.trusted.guard_checks == checks + 2 and calls.dynamo_run.calls == 1
    layers[1][0].weight.requires_grad_(True)
    run_steps(calls, layers, caches, x, steps=1, scale=1.0)  # still distrusted: every call of it checked (and passes)
    checks, direct = calls.trusted.guard_checks, calls.trusted.direct_calls
    layers[1].train(False)
    run_steps(calls, layers, caches, x, steps=2, scale=1.0)  # its training flag: checked once more, then direct
    assert calls.trusted.guard_checks == checks + 2 + 1 and calls.trusted.direct_calls == direct + 1


@pytest.mark.parametrize("body", [_breaking_body, _breaking_at_return_body], ids=["mid-body", "at-return"])
def test_a_graph_that_breaks_runs_its_later_graphs_too_when_called_directly(body):
    """The code after a graph break (a resume function, or a layer forward called at the return) runs its own
    compiled graphs, as under dynamo's lookup: the direct call runs in dynamo's run-only mode."""
    layers, caches, x = [torch.nn.Linear(4, 4) for _ in range(2)], [CacheLayer(0), CacheLayer(1)], torch.randn(2, 4)
    backend = CountingBackend()
    calls = compiled_calls(body, f"breaking_{body.__name__}", layers[0], caches[0], "cache", None, x, backend=backend)
    run_steps(calls, layers, caches, x, steps=2, check=body)
    assert calls.trusted.direct_calls == 1
    runs = backend.runs
    calls.dynamo_run(layers[1], caches[1], "cache", None, x)
    per_lookup, runs = backend.runs - runs, backend.runs
    run_steps(calls, layers[1:], caches[1:], x, steps=1, check=body)
    assert backend.runs - runs == per_lookup and per_lookup >= 2  # graphs before the break and after it


def test_inputs_it_cannot_describe_a_stance_a_compile_or_a_gpu_leave_the_call_to_dynamo():
    layers, caches, x = [torch.nn.Linear(4, 4) for _ in range(2)], [CacheLayer(0), CacheLayer(1)], torch.randn(2, 4)
    calls = compiled_calls(_body, "left", layers[0], caches[0], "cache", None, x, scale=1.0, extra=None)
    run_steps(calls, layers, caches, x, steps=1, scale=1.0, extra=object())
    no_strides = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])  # .stride() raises
    run_steps(calls, layers, caches, x, steps=1, scale=1.0, extra=no_strides)
    torch._dynamo.run(lambda: run_steps(calls, layers, caches, x, steps=1, scale=1.0, extra=None))()
    with torch.compiler.set_stance("force_eager"):
        run_steps(calls, layers, caches, x, steps=1, scale=1.0, extra=None)
    caches[0].keys = torch.zeros(1, device="meta")  # a cache off the CPU
    run_steps(calls, layers[:1], caches[:1], x, steps=1, scale=1.0, extra=None)
    assert calls.trusted.direct_calls == 0 and calls.dynamo_run.calls == 2 + 2 + 2 + 2 + 1


def test_the_signature_tells_apart_what_guards_do_and_refuses_objects():
    x = torch.zeros(2, 3)
    assert signature(x, {"a": 1}) == signature(torch.ones(2, 3), {"a": 1})  # contents are not guarded
    complex_x = torch.zeros(2, 3, dtype=torch.cfloat)
    for other in (complex_x.conj(), torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, device="meta"),
                  torch.nn.Parameter(torch.zeros(2, 3))):
        assert signature(other) != signature(complex_x if other.is_complex() else x)
    assert signature(torch._neg_view(complex_x)) != signature(complex_x)
    with torch.inference_mode():
        inference_x = torch.zeros(2, 3)
    assert signature(inference_x) != signature(x)
    assert signature(x, x) != signature(x, torch.zeros(2, 3))  # one tensor twice, or two
    assert signature(x) != signature(x.t().contiguous().t())  # strides
    assert signature(x) != signature(x.double()) and signature((x, 1)) != signature((x, 2))
    with_grad = signature(x)
    with torch.no_grad():
        assert signature(x) != with_grad
    with pytest.raises(Undescribable):
        signature(object())


def test_a_steps_signature_tells_calls_apart_exactly_where_the_full_one_does():
    """A step's layers share every input but their hidden states and cache tensors (the same objects): those are
    described once a step, and the verdicts stay those of the full signature."""
    mask, longer_mask, rotary = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 9), (torch.ones(2, 4), torch.ones(2, 4))
    span, other_span, cache = torch.empty(8, 0), torch.empty(9, 0), (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4))
    hidden, one, two = torch.randn(1, 2, 4), 1.0, 2.0  # as a step passes them: the same objects to every layer
    calls = {  # name -> (span, hidden states, mask, keyword arguments, cache tensors)
        "first": (span, hidden, mask, {"rotary": rotary, "scale": one}, cache),
        "another layer": (span, torch.randn(1, 2, 4), mask, {"rotary": rotary, "scale": one},
                          (torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4))),
        "hidden strides": (span, torch.randn(1, 4, 2).transpose(1, 2), mask, {"rotary": rotary, "scale": one}, cache),
        "hidden dtype": (span, hidden.double(), mask, {"rotary": rotary, "scale": one}, cache),
        "a mask alike": (span, hidden, mask.clone(), {"rotary": rotary, "scale": one}, cache),
        "a longer mask": (span, hidden, longer_mask, {"rotary": rotary, "scale": one}, cache),
        "another span": (other_span, hidden, mask, {"rotary": rotary, "scale": one}, cache),
        "another constant": (span, hidden, mask, {"rotary": rotary, "scale": two}, cache),
        "names swapped": (span, hidden, mask, {"scale": rotary, "rotary": one}, cache),
        "names reordered": (span, hidden, mask, {"scale": one, "rotary": rotary}, cache),
        "hidden also shared": (span, hidden, mask, {"rotary": rotary, "scale": one, "residual": hidden}, cache),
        "a fresh one shared": (span, torch.randn(1, 2, 4), mask,
                               {"rotary": rotary, "scale": one, "residual": torch.randn(1, 2, 4)}, cache),
        "cache is the mask": (span, hidden, mask, {"rotary": rotary, "scale": one}, (mask, cache[1])),
        "cache aliases hidden": (span, hidden, mask, {"rotary": rotary, "scale": one}, (cache[0], cache[0])),
        "cache shape": (span, hidden, mask, {"rotary": rotary, "scale": one}, (torch.zeros(1, 2, 9, 4), cache[1])),
        "cache by position": (span, hidden, mask, {"rotary": rotary, "scale": one}, cache),
        "a shared tensor by name": (span, hidden, mask, {"rotary": rotary, "scale": one, "bias": torch.zeros(4)},
                                    cache),
    }

    def both(step, name):
        span, hidden, mask, kwargs, cache_tensors = calls[name]
        slot = 1 if name == "cache by position" else "cache"
        return (step_signature(step, slot, span, (hidden, mask), kwargs, cache_tensors),
                signature(slot, span, (hidden, mask), kwargs, cache_tensors))

    step = {}
    ours, full = zip(*(both(step, name) for name in calls))
    for i, j in [(i, j) for i in range(len(calls)) for j in range(len(calls))]:
        assert (ours[i] == ours[j]) == (full[i] == full[j]), (list(calls)[i], list(calls)[j])
    assert ours[0] == ours[1] and ours[0] == ours[4] and ours[0] != ours[2]  # both kinds of verdict occur
    # One description per set of shared objects (a mask alike is another object), holding them: their ids stay
    # theirs for as long as the step lives.
    assert len(step) == 11
    described = [weakref.ref(calls.pop("a mask alike")[2]),
                 weakref.ref(calls.pop("a shared tensor by name")[3]["bias"])]
    gc.collect()
    assert all(ref() is not None for ref in described)
    with torch.no_grad():
        assert both(step, "first")[0] != ours[0]
    # No hidden states first (none, or not [batch, tokens, hidden]): the full signature, nothing kept
    for args in [(), (torch.zeros(2, 4), mask)]:
        empty = {}
        assert step_signature(empty, "cache", span, args, {"scale": one}, cache) == signature(
            "cache", span, args, {"scale": one}, cache) and not empty


def test_a_layer_changed_between_calls_runs_what_it_now_is():
    """After a call that trusted every layer, layer 2's activation is swapped: its graph (traced with the old
    one) must not run for it, as dynamo's guards on the module's type would not let it."""
    model = make_tiny_model("llama")
    model.config.num_hidden_layers = 4
    model = type(model)(model.config).eval()
    ids, mask = left_padded_batch(model, (9, 6))

    def logits():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        return torch.stack(out.logits)

    expected = logits()
    hf_accel.patch(model, compile="inductor", speculative=None, compile_when="first_use")
    torch.testing.assert_close(logits(), expected, atol=1e-4, rtol=1e-4)
    details = hf_accel.report(model)["compile"].details
    assert details["direct_calls"] > 0 and details["misses"] == 0
    model.model.layers[2].mlp.act_fn = torch.nn.Tanh()
    patched = logits()
    assert hf_accel.report(model)["compile"].details["misses"] > 0  # layer 2 ran eagerly: no graph for it
    hf_accel.unpatch(model)
    changed = logits()
    assert (changed - expected).abs().max() > 1e-2  # the change shows in the logits, far beyond the tolerance
    torch.testing.assert_close(patched, changed, atol=1e-4, rtol=1e-4)


def test_a_speculative_call_whose_setup_raises_still_closes_the_steps_trust(monkeypatch):
    from hf_accel.runtime.compiled_step import CompiledDecodeStep

    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 6))
    hf_accel.patch(model, compile="inductor", speculative="ngram", compile_when="first_use")
    step = model._hf_accel_state.compiled_step

    def out_of_memory(self, batch_size, needed_length):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(CompiledDecodeStep, "cache_for", out_of_memory)  # after the call's begin_call
    with pytest.raises(RuntimeError, match="out of memory"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert step._trusted.current() is None  # stock calls and a user's own cache get dynamo's lookup again
