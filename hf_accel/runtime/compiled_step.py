"""A compiled decode step: stock ``generate``'s decode steps, and the chunks the speculative loop verifies and
drafts, with the model's decoder layers running compiled graphs over fixed-length caches.

``generate`` runs the prompt eagerly, then calls ``model.get_compiled_call(...)`` for every decode step when
the cache is a compileable one. :class:`CompiledDecodeStep` is what that call returns on a patched model.
It runs the model's own forward; its decoder layers (see :mod:`hf_accel.runtime.regions`) run one compiled graph per
kind of layer and shape class, compiled on the side from a real call's inputs, checked against the eager
layer on that call, and afterwards only looked up: a call never compiles by surprise. Until a shape class
is compiled its layers run eagerly, and :class:`~hf_accel.runtime.compile_policy.CompilePolicy` decides when
compiling pays; a :class:`~hf_accel.runtime.compile_cache.CompileStore` keeps what it compiled for later processes.

Shapes stay fixed per cache: its length is a bucket (a multiple of :data:`BUCKET`) reused by every later call
that fits. Batch size, chunk width, cache length and (on CPU) the filled slots attention reads are dynamic in
the graphs, so other prompts, batch sizes and ``max_new_tokens`` run the graphs already compiled.

Example::

    step = CompiledDecodeStep(model, compiler)                          # compiler: a GraphCompiler
    step.install(Changes())                                            # route the decoder layers
    kwargs = step.generate_kwargs(batch_size=1, needed_length=400)     # cache + compile config
    model.generate(**inputs, max_new_tokens=128, **kwargs)
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from transformers.generation import CompileConfig

from hf_accel.patching.changes import Changes
from hf_accel.runtime.compile_cache import CompileStore, Stored, fingerprint
from hf_accel.runtime.compile_gate import COMPILE_GATE
from hf_accel.runtime.compile_policy import CompilePolicy, Decision, StepTimer
from hf_accel.runtime.generation import cache_keyword
from hf_accel.runtime.graph_calls import TrustedLayers
from hf_accel.runtime.kv_cache import BucketedCaches
from hf_accel.runtime.layer_graphs import (
    CompileStats,
    GraphCompiler,
    RegionGraphs,
    StepArguments,
    compileable,
    describe_failure,
    disagreement,
    eager_layer,
    separate_symbols,
    side_graph_arguments,
)
from hf_accel.runtime.regions import (
    ACTIVE_RUN,
    Region,
    RegionRun,
    ShapeClass,
    cache_argument,
    decoder_layers,
    hidden_states_of,
    is_routed,
    route,
    shape_class,
    tensors_in,
)

logger = logging.getLogger(__name__)

_FROM_STORE = "compiled before on this machine"
#: What the step times its eager decode steps and compiles with (tests substitute a clock of their own).
_clock = time.perf_counter
#: Cache lengths are rounded up to a multiple of this, and a cache serves every later call that fits in it.
BUCKET = 256
#: Relative error above which a freshly compiled graph is refused: exact fp32 graphs measure ~1e-6.
CHECK_TOLERANCE = 1e-3
#: The same where activations are rounded to bf16 (quantized Linear kernels): inductor fuses the casts, which
#: moves outputs by about one bf16 rounding (SmolLM2 int4: 5.5e-3 on the logits).
BF16_CHECK_TOLERANCE = 2e-2


class CompiledDecodeStep(BucketedCaches):
    """The model's forward for decode steps, its decoder layers compiled one kind at a time, and the
    fixed-length caches it runs over.

    :param compiler: what compiles the layers' graphs (a compile backend's :class:`GraphCompiler`).
    :param policy: when to compile a shape class (default: once what a graph would have saved exceeds the
        compile's expected time; see :mod:`hf_accel.runtime.compile_policy`).
    :param store: where compiled artifacts persist between processes (None: nowhere).
    """

    def __init__(self, model: nn.Module, compiler: GraphCompiler, bucket: int = BUCKET,
                 details: dict[str, Any] | None = None, tolerance: float = CHECK_TOLERANCE,
                 policy: CompilePolicy | None = None, store: CompileStore | None = None) -> None:
        self.model = model
        self.tolerance = tolerance
        self.details = {} if details is None else details  # kept up to date with the stats (the report's)
        self.bucket = bucket
        self.policy = policy or CompilePolicy()
        self.store = store
        self.backend = compiler
        self.regions = {id(region.layer): region for region in decoder_layers(model)}
        self.stats = CompileStats()
        self.compile_config = CompileConfig()  # turns on transformers' switch to get_compiled_call; settings unused
        self.compile_config._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
        self._graphs: dict[str, RegionGraphs] = {}
        self._trusted = TrustedLayers()  # what the graphs checked this call (see graph_calls)
        self._compiled: dict[ShapeClass, float] = {}  # shape class -> seconds its compile took
        self._decisions: dict[ShapeClass, Decision] = {}
        self._waited: dict[ShapeClass, float] = {}  # eager seconds of decode steps that waited for each class
        self._timer = StepTimer()  # what compiling saved of a step here, for the store
        self._stored: dict[ShapeClass, Stored | None] = {}  # what the store knows of each shape class
        self._fingerprints: dict[str, dict[str, Any]] = {}
        self._init_caches()
        self._installed: Changes | None = None
        self._call_start = 0.0  # eager seconds when the current call began
        self._call_forecast = 0.0  # eager seconds the current call is expected to take
        self._seconds_per_token: float | None = None  # measured on the last call that ran eagerly
        self._derived: list[CompiledDecodeStep] = []
        self._publish()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<CompiledDecodeStep of {type(self.model).__name__}: {len(self._compiled)} shape classes compiled "
                f"({s.graphs_compiled} graphs, {s.compile_seconds:.1f}s), {s.compiled_steps} compiled / "
                f"{s.eager_steps} eager steps{', failed: ' + s.failure if s.failure else ''}>")

    # -- installing -----------------------------------------------------------------------------------------
    def install(self, changes: Changes) -> None:
        """Route the model's decoder layers through this step (undone with ``changes``). Layers another step
        of hf_accel routes already are shared as they are."""
        for region in self.regions.values():
            if "forward" in vars(region.layer) and not is_routed(region.layer):
                raise ValueError(f"{type(region.layer).__name__} already has a forward of its own on this instance "
                                 "(another library wraps it), which compiled regions would bypass")
        for region in self.regions.values():
            if not is_routed(region.layer):
                changes.setattr(region.layer, "forward", route(region.layer))
        self._installed = changes

    def release(self) -> None:
        """Undo the routing of every model this step made a compiled forward for (see :meth:`for_model`)."""
        while self._derived:
            step = self._derived.pop()
            if step._installed is not None:
                step._installed.undo()

    def for_model(self, model: nn.Module, details: dict[str, Any] | None = None,
                  tolerance: float | None = None) -> CompiledDecodeStep | None:
        """A compiled forward with this one's settings for ``model`` (a draft model), with graphs, caches and
        statistics of its own, its decoder layers routed until this step's :meth:`release` (at unpatch).
        None, with the reason in ``details``, for a model whose layers cannot be routed: it runs eagerly."""
        try:
            step = CompiledDecodeStep(model, self.backend.fresh(), bucket=self.bucket, details=details,
                                      tolerance=self.tolerance if tolerance is None else tolerance,
                                      policy=self.policy, store=self.store)
            step.install(Changes())
        except ValueError as exc:
            if details is not None:
                details["failure"] = f"not compiled: {exc}"
            logger.info("hf_accel: %s runs eagerly: %s", type(model).__name__, exc)
            return None
        self._derived.append(step)
        return step

    # -- what generate is given ---------------------------------------------------------------------------
    def generate_kwargs(self, batch_size: int, needed_length: int) -> dict[str, Any]:
        """The cache (``cache=``, or ``past_key_values=`` before transformers 5.24) and ``compile_config`` for a
        ``generate`` call of this batch size and length."""
        return {cache_keyword(self.model): self.cache_for(batch_size, needed_length),
                "compile_config": self.compile_config}

    def begin_call(self, new_tokens: int) -> None:
        """A ``generate`` call asking for up to ``new_tokens`` tokens starts: the compile policy weighs what the
        rest of it would cost eagerly (once this model's eager seconds per token are known)."""
        self._call_start = self.stats.eager_seconds
        self._call_forecast = new_tokens * self._seconds_per_token if self._seconds_per_token else 0.0
        self._trusted.open()

    def end_call(self, tokens: int) -> None:
        """The call made ``tokens`` tokens (per row); its eager time per token updates the forecast."""
        self._trusted.close()  # the next call checks every layer in full again
        spent = self.stats.eager_seconds - self._call_start
        if spent > 0 and tokens > 0:
            self._seconds_per_token = spent / tokens
        self._call_forecast = 0.0
        for shape, saving in self._timer.measured(self._compiled) if self.store is not None else ():
            self.store.record_saving(self._fingerprint(shape.kind), shape, saving)  # for later processes
        self._publish()

    def get_compiled_call(self, compile_config: Any = None) -> CompiledDecodeStep:
        """Stands in for ``PreTrainedModel.get_compiled_call`` on the patched instance."""
        return self

    # -- one decode step ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._installed is None:
            return self.model(*args, **kwargs)
        run = RegionRun(self, StepArguments())
        token = ACTIVE_RUN.set(run)
        busy_before, start = self._busy_seconds(), _clock()
        try:
            out = self.model(*args, **kwargs)
        finally:
            ACTIVE_RUN.reset(token)
        elapsed = _clock() - start
        if run.compiled_layers and not run.eager_layers:
            self.stats.compiled_steps += 1
        else:
            self.stats.eager_steps += 1
        busy = self._busy_seconds() - busy_before
        if not busy:  # all eager (waiting), or all compiled
            timed = run.waiting if not run.compiled_layers else run.compiled if not run.eager_layers else ()
            self._timer.add(timed, elapsed, compiled=bool(run.compiled_layers))
        if run.waiting:  # time spent compiling is not time lost running eagerly
            waited = elapsed - busy
            self.stats.eager_seconds += waited
            for shape in run.waiting:  # two kinds of layer waiting in one step share its time
                self._waited[shape] = self._waited.get(shape, 0.0) + waited / len(run.waiting)
        s = self.stats  # the counters only: the rest of the report changes when a decision or a compile does
        self.details.update(compiled_steps=s.compiled_steps, eager_steps=s.eager_steps, eager_seconds=s.eager_seconds,
                            misses=s.misses, direct_calls=self._trusted.direct_calls)
        return out

    def _busy_seconds(self) -> float:
        """Time this step has spent compiling, or waiting to compile: not part of any step's own time."""
        return self.stats.compile_seconds + self.stats.gate_seconds

    def layer_forward(self, run: RegionRun, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One decoder layer inside a decode step: its compiled graph, a compile on the side, or eager."""
        found = cache_argument(args, kwargs)
        hidden = hidden_states_of(args, kwargs)
        layers = found[1].layers if found is not None else ()
        layer_cache = layers[region.cache_index] if region.cache_index < len(layers) else None
        if hidden is None or not compileable(layer_cache):
            run.eager_layers += 1
            return type(region.layer).forward(region.layer, *args, **kwargs)
        slot = found[0]
        if self.stats.failure is not None:
            run.eager_layers += 1
            return eager_layer(region, layer_cache, slot, args, kwargs)
        shape = shape_class(region, hidden, run.arguments.reads_filled_slots(layer_cache, slot, args, kwargs))
        graphs = self._graphs_for(region.kind)
        if shape in self._compiled:
            return self._run_graph(graphs, shape, run, region, layer_cache, slot, args, kwargs)
        run.waiting.add(shape)
        run.eager_layers += 1
        if shape not in run.decisions:
            run.decisions[shape] = self._decide(shape)
        if run.decisions[shape].compile:
            return self._compile_and_check(graphs, shape, region, layer_cache, slot, args, kwargs)
        return eager_layer(region, layer_cache, slot, args, kwargs)

    def _run_graph(self, graphs: RegionGraphs, shape: ShapeClass, run: RegionRun, region: Region, layer_cache: Any,
                   slot: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled graph (looked up, never compiled here). If it raises, the cache's index is put back,
        the layer runs eagerly, and the step stays eager from then on."""
        misses, written_from = graphs.misses[0], layer_cache.cumulative_length.clone()
        span, rest_args, rest_kwargs = run.arguments.graph_arguments(layer_cache, slot, args, kwargs,
                                                                     shape.filled_slots)
        try:
            out = graphs.run(run.graph_calls, region.layer, layer_cache, slot, span, *rest_args, **rest_kwargs)
        except Exception as exc:  # an inductor runtime assert, out of memory, ...
            layer_cache.cumulative_length.copy_(written_from)  # the eager run rewrites the same slots
            self._fail(f"running the compiled {shape} graph raised {describe_failure(exc)}")
            run.eager_layers += 1
            return eager_layer(region, layer_cache, slot, args, kwargs)
        missed = graphs.misses[0] - misses
        if not missed:
            run.compiled.add(shape)
        self.stats.misses += missed
        run.eager_layers += missed
        run.compiled_layers += 1 - missed
        return out

    # -- compiling ----------------------------------------------------------------------------------------
    def _decide(self, shape: ShapeClass) -> Decision:
        # Each shape class pays for itself: time lost on batch 1 does not buy a compile of batch > 1.
        spent_in_call = self.stats.eager_seconds - self._call_start
        stored = self._stored_for(shape)
        decision = self.policy.decide(self._estimate(shape), self._waited.get(shape, 0.0),
                                      max(self._call_forecast - spent_in_call, 0.0),
                                      stored.saved_fraction if stored is not None else None)
        if self._decisions.get(shape) != decision:
            self._decisions[shape] = decision
            logger.debug("%s, %s: %s", type(self.model).__name__, shape, decision.reason)
            self._publish()
        return decision

    def _stored_for(self, shape: ShapeClass) -> Stored | None:
        """What the compile store knows of ``shape``, read once per shape class (later changes are not seen)."""
        if shape not in self._stored and self.store is not None:
            self._stored[shape] = self.store.lookup(self._fingerprint(shape.kind), shape)
        return self._stored.get(shape)

    def _estimate(self, shape: ShapeClass) -> tuple[float, str]:
        stored = self._stored_for(shape)
        if stored is not None:
            return stored.warm_seconds or self.policy.warm_estimate, _FROM_STORE
        return self.policy.cold_estimate, "not compiled on this machine before"

    def _compile_and_check(self, graphs: RegionGraphs, shape: ShapeClass, region: Region, layer_cache: Any,
                           slot: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Compile ``shape`` from copies of this call's inputs, run the real call eagerly over every slot, and keep
        the graph if it reproduced that output and those cache writes."""
        estimate, why = self._estimate(shape)
        warm = why == _FROM_STORE
        log = logger.warning if estimate >= 10 else logger.info
        log("hf_accel: compiling %s's decode step (%s; %s: about %.0f s)...", type(self.model).__name__, shape, why,
            estimate)
        # Other threads' patched calls end first and wait meanwhile (they would see is_compiling() True); the
        # clock starts once they have, so that the store keeps what compiling took.
        queued, start = _clock(), None
        try:
            with COMPILE_GATE.compiling():
                graphs_before, start = self.backend.graphs, _clock()
                self.stats.gate_seconds += start - queued
                compiled, scratch = self._compile_on_the_side(graphs, region, layer_cache, slot, args, kwargs, warm)
                seconds = _clock() - start
        except Exception as exc:  # a missing compiler, an op inductor cannot lower, an attention it cannot trace
            if start is not None:  # a compile that failed took time too, not time lost running eagerly
                self.stats.compile_seconds += _clock() - start
            self._fail(f"compiling {shape} raised {describe_failure(exc)}")
            return type(region.layer).forward(region.layer, *args, **kwargs)
        eager = type(region.layer).forward(region.layer, *args, **kwargs)  # over every slot: checks the graph's cut
        error = disagreement([*tensors_in(eager), layer_cache.keys, layer_cache.values],
                              [*tensors_in(compiled), scratch.keys, scratch.values])
        self.stats.check_error = max(error, self.stats.check_error or 0.0)
        self.stats.graphs_compiled += self.backend.graphs - graphs_before
        self.stats.compile_seconds += seconds
        if not error <= self.tolerance:
            self._fail(f"the compiled {shape} layer differs from eager by {error:.2e} (limit {self.tolerance:.0e})")
            return eager
        self._compiled[shape] = seconds
        logger.info("hf_accel: compiled %s in %.1f s", shape, seconds)
        if self.store is not None:  # warm if the store still has it (it is emptied when compiling from it fails)
            fp = self._fingerprint(shape.kind)
            self.store.record(fp, shape, seconds, warm=warm and self.store.lookup(fp, shape) is not None)
        self._publish()
        return eager

    def _compile_on_the_side(self, graphs: RegionGraphs, region: Region, layer_cache: Any, slot: int | str,
                             args: tuple[Any, ...], kwargs: dict[str, Any], from_store: bool) -> tuple[Any, Any]:
        """Compile and run the graph on copies of a call's inputs (the real call runs eagerly), inside the store
        when there is one. If the store had this shape class and compiling from it fails, the store is
        emptied and the compile retried once."""
        def attempt() -> tuple[Any, Any]:
            span, side_args, side_kwargs, scratch = side_graph_arguments(layer_cache, slot, args, kwargs)
            with separate_symbols(), (self.store.compiling(self.backend) if self.store is not None else nullcontext()):
                return graphs.compile(region.layer, scratch, slot, span, *side_args, **side_kwargs), scratch

        try:
            return attempt()
        except Exception as exc:
            if self.store is None or not from_store:
                raise
            self.store.reset(f"compiling from it raised {describe_failure(exc)}")
            torch._dynamo.reset_code(graphs.body.__code__)
            return attempt()

    def _graphs_for(self, kind: str) -> RegionGraphs:
        if kind not in self._graphs:
            name = f"decoder_layer_{id(self.model):x}_{len(self._graphs)}"
            self._graphs[kind] = RegionGraphs(name, self.backend, self._trusted)
        return self._graphs[kind]

    def _fingerprint(self, kind: str) -> dict[str, Any]:
        if kind not in self._fingerprints:
            layer = next(r.layer for r in self.regions.values() if r.kind == kind)
            self._fingerprints[kind] = fingerprint(self.model, layer, kind, compiler=type(self.backend).__name__,
                                                   mode=self.backend.mode, tolerance=self.tolerance)
        return self._fingerprints[kind]

    def _fail(self, reason: str) -> None:
        self.stats.failure = reason
        self._publish()
        logger.warning("hf_accel: the compiled decode step is off, running eager: %s", reason)

    def _publish(self) -> None:
        shapes = {str(shape): f"compiled in {seconds:.1f} s" for shape, seconds in self._compiled.items()}
        for shape, decision in self._decisions.items():
            shapes.setdefault(str(shape), decision.reason)
        self.details.update(asdict(self.stats), direct_calls=self._trusted.direct_calls, bucket=self.bucket,
                            mode=self.backend.mode or "default", when=self.policy.when, shapes=shapes,
                            cache_bytes=self.cache_bytes(), cached_batch_sizes=list(self._caches))
