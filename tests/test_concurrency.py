"""Concurrent generate calls on one patched model return what they return one at a time."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import left_padded_batch, make_tiny_model
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel.runtime.compile_gate import COMPILE_GATE, CompileGate, is_tracing

#: (batch size, max_new_tokens, sampled): sampled calls keep only the top token, so their output is fixed.
CALLS = [(1, 24, False), (3, 16, False), (1, 30, True), (2, 20, False), (3, 12, True), (1, 8, False)]


def run(model, batch, n, sampled, ids, mask):
    kwargs = {"do_sample": True, "top_k": 1} if sampled else {"do_sample": False}
    return model.generate(input_ids=ids[:batch], attention_mask=mask[:batch], max_new_tokens=n, **kwargs)


@pytest.mark.parametrize("options", [{}, {"compile": None}, {"speculative": None}],
                         ids=["defaults", "eager loop", "no speculation"])
def test_four_threads_get_what_they_would_get_one_at_a_time(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = [run(model, *call, ids, mask) for call in CALLS]
    hf_accel.patch(model, **options)
    failures: list[str] = []

    def worker(offset: int) -> None:
        for round_ in range(3):
            for i in range(len(CALLS)):
                j = (i + offset) % len(CALLS)
                if not torch.equal(run(model, *CALLS[j], ids, mask), expected[j]):
                    failures.append(f"thread {offset}, round {round_}, call {CALLS[j]}")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


class GenerateInside(StoppingCriteria):
    """A stopping criterion that, at the outer call's third decode step, runs generate on other inputs of the
    same batch size (whose pooled cache the outer call is using)."""

    def __init__(self, model, ids, mask):
        self.model, self.ids, self.mask, self.steps, self.inner = model, ids, mask, 0, None

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.steps == 3:
            self.inner = self.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=10,
                                             do_sample=False)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("options", [{}, {"speculative": None}], ids=["defaults", "no speculation"])
def test_a_generate_call_made_inside_another_leaves_both_right(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    inner_ids, inner_mask = left_padded_batch(model, (5, 8, 3), seed=2)
    expected = run(model, 3, 16, False, ids, mask)
    expected_inner = model.generate(input_ids=inner_ids, attention_mask=inner_mask, max_new_tokens=10,
                                    do_sample=False)
    hf_accel.patch(model, **options)
    inside = GenerateInside(model, inner_ids, inner_mask)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([inside]))
    assert inside.steps > 3 and torch.equal(out, expected) and torch.equal(inside.inner, expected_inner)


def test_unpatch_from_inside_a_generate_call_is_refused(llama):
    class UnpatchInside(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            hf_accel.unpatch(llama)

    hf_accel.patch(llama, compile=None)
    ids, mask = left_padded_batch(llama, (9,))
    with pytest.raises(hf_accel.PatchError, match="from inside one of its generate calls"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                       stopping_criteria=StoppingCriteriaList([UnpatchInside()]))
    assert hasattr(llama, "_hf_accel_state")


def test_unpatch_waits_for_the_call_in_progress():
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = run(model, 3, 16, False, ids, mask)
    armed, started, release = threading.Event(), threading.Event(), threading.Event()

    seen = {}

    class Holds:
        @hf_accel.hookimpl(wrapper=True)
        def hf_accel_generate(self, call):
            if armed.is_set():  # the user's call, not the patch's own verification probes
                started.set()
                release.wait(10)
                seen["patched during the call"] = hasattr(call.model, "_hf_accel_state")
            return (yield)

    hf_accel.patch(model, plugins=[Holds()], compile=None)
    armed.set()
    result = {}
    caller = threading.Thread(target=lambda: result.setdefault("out", run(model, 3, 16, False, ids, mask)))
    caller.start()
    assert started.wait(10)
    undoer = threading.Thread(target=hf_accel.unpatch, args=(model,))
    undoer.start()
    undoer.join(0.3)  # an unpatch that did not wait would have undone everything by now
    release.set()
    caller.join()
    undoer.join()
    assert seen["patched during the call"] and torch.equal(result["out"], expected)
    assert not hasattr(model, "_hf_accel_state")


@pytest.mark.parametrize("options", [{}, {"compile": None, "speculative": None}], ids=["compiled step", "kv cache"])
def test_a_returned_output_does_not_hand_out_the_cache_the_next_call_reuses(options, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    hf_accel.patch(model, speculative=None, **{k: v for k, v in options.items() if k != "speculative"})
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         return_dict_in_generate=True)
    state = model._hf_accel_state
    pooled = [state.kv_cache] + ([c for _, c in state.compiled_step._caches.values()] if state.compiled_step else [])
    assert out.sequences.shape == (3, ids.shape[1] + 6) and not any(out.cache is c for c in pooled)
    assert out.get("cache") is None


def test_no_patched_call_runs_while_another_patched_model_compiles(tmp_path, monkeypatch):
    """While a thread compiles, torch holds ``torch.compiler.is_compiling()`` True in every thread; code that
    branches on it (transformers' kernel wrappers on Llama's attention) fails in threads running meanwhile."""
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    compiling, running = make_tiny_model("llama"), make_tiny_model("llama")
    ids, mask = left_padded_batch(running, (9, 4, 7))
    hf_accel.patch(running, compile=None)
    hf_accel.patch(compiling, compile_when="first_use")
    seen: list[bool] = []
    for layer in running.model.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(torch.compiler.is_compiling()))
    stop = threading.Event()

    def keep_generating() -> None:
        while not stop.is_set():
            running.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    worker = threading.Thread(target=keep_generating, daemon=True)
    worker.start()
    try:
        for _ in range(3000):  # the other thread is generating (within 30 s)
            if seen or not worker.is_alive():
                break
            stop.wait(0.01)
        compiling.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive()
    assert hf_accel.report(compiling)["compile"].details["graphs_compiled"] > 0
    assert len(seen) > 0 and not any(seen)


def test_the_compile_gate_lets_a_compile_run_alone_and_calls_wait_for_it():
    gate, order = CompileGate(), []
    in_call, compile_waits = threading.Event(), threading.Event()

    def long_call() -> None:
        with gate.call():
            in_call.set()
            compile_waits.wait(5)
            order.append("long call ends")

    def call_inside_then_compile() -> None:
        in_call.wait(5)
        with gate.call(), gate.call():  # nested calls of this thread do not hold its own compile back
            compile_waits.set()
            with gate.compiling():
                order.append("compiles")
            order.append("its call goes on")

    def late_call() -> None:
        compile_waits.wait(5)
        while not gate._waiting and "compiles" not in order:  # the compile is queued before this call comes
            threading.Event().wait(0.001)
        with gate.call():
            order.append("late call")

    threads = [threading.Thread(target=f) for f in (long_call, call_inside_then_compile, late_call)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    # The compile waited for the other thread's call, and a call that came while it waited waited behind it.
    assert order.index("long call ends") < order.index("compiles") < order.index("late call")
    assert order.index("compiles") < order.index("its call goes on") and len(order) == 4
    assert not gate._calls and gate._compiling is None and not gate._waiting


def test_the_compile_gate_compiles_beside_a_call_that_outlasts_its_patience(caplog):
    gate, release = CompileGate(patience=0.05), threading.Event()
    in_call = threading.Event()

    def stuck_call() -> None:
        with gate.call():
            in_call.set()
            release.wait(5)

    thread = threading.Thread(target=stuck_call)
    thread.start()
    in_call.wait(5)
    with caplog.at_level("WARNING", logger="hf_accel"), gate.compiling():
        compiled_beside = thread.is_alive()
    release.set()
    thread.join(5)
    assert compiled_beside and not gate._calls and gate._compiling is None
    assert "compiling while 1 other threads' calls run" in caplog.text


def test_waiting_at_the_gate_is_neither_compile_time_nor_eager_time(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    hf_accel.patch(model, compile="inductor", speculative=None, compile_when="first_use")
    holding = threading.Event()

    def a_second_long_call() -> None:
        with COMPILE_GATE.call():
            holding.set()
            for _ in range(3000):  # until the compile waits for this call (within 30 s), then 2 s more
                if COMPILE_GATE._waiting:
                    break
                threading.Event().wait(0.01)
            threading.Event().wait(2.0)

    other = threading.Thread(target=a_second_long_call)
    other.start()
    holding.wait(10)
    run(model, 3, 6, False, ids, mask)  # compiles its shapes, each after the other thread's call has ended
    other.join(10)
    details = hf_accel.report(model)["compile"].details
    # The eager steps' own time is ~0.3 s here; the 2 s at the gate are in neither figure but their own.
    assert details["gate_seconds"] >= 2.0 and details["eager_seconds"] < 1.0


@pytest.mark.parametrize("tracer", ["dynamo", "make_fx", "make_fx pre-dispatch (torch.export's default)"])
def test_is_tracing_only_in_the_thread_that_traces(tracer):
    tracing, done, seen = threading.Event(), threading.Event(), []

    def traced(x):
        seen.append(is_tracing())
        tracing.set()
        done.wait(10)  # the other thread looks meanwhile
        return x + 1

    trace = {"dynamo": lambda: torch.compile(traced, backend="eager")(torch.zeros(1)),
             "make_fx": lambda: make_fx(traced)(torch.zeros(1))}.get(
        tracer, lambda: make_fx(traced, pre_dispatch=True)(torch.zeros(1)))
    thread = threading.Thread(target=trace)
    thread.start()
    try:
        assert tracing.wait(30)
        elsewhere = is_tracing()
    finally:
        done.set()
        thread.join(30)
    assert seen[0] and not elsewhere and not is_tracing()


def test_a_compile_of_the_users_own_in_another_thread_leaves_the_compiled_step_in_use(tmp_path, monkeypatch):
    """torch's process-wide ``is_compiling()`` flag during another thread's compile must not turn the patch's
    routing of decoder layers to their compiled graphs off (it asks whether dynamo is tracing its own code)."""
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    ids, mask = left_padded_batch(model, (9, 4, 7))
    expected = run(model, 3, 12, False, ids, mask)
    hf_accel.patch(model, compile="inductor", compile_when="first_use")  # the loop runs the compiled step itself
    assert torch.equal(run(model, 3, 12, False, ids, mask), expected)  # compiles its shapes
    in_session, finish = threading.Event(), threading.Event()

    def slow_backend(graph, example_inputs):
        in_session.set()
        finish.wait(10)
        return graph.forward

    users = threading.Thread(target=lambda: torch.compile(lambda x: x + 1, backend=slow_backend)(torch.ones(2)))
    users.start()
    try:
        in_session.wait(10)
        before = dict(hf_accel.report(model)["compile"].details)
        assert torch.compiler.is_compiling() and not is_tracing()  # what this thread sees while the other compiles
        assert torch.equal(run(model, 3, 12, False, ids, mask), expected)
        after = hf_accel.report(model)["compile"].details
    finally:
        finish.set()
        users.join()
    assert after["compiled_steps"] > before["compiled_steps"] and after["eager_steps"] == before["eager_steps"]
