"""The pieces the compiled decode step is built from: the graph compiler's contract, what compiling cost, the
compiled graphs of one kind of decoder layer, a layer call (eager, or a graph's arguments) cut to its cache's
filled slots, and the checks of a new graph."""

from __future__ import annotations

import math
import types
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol

import torch
from torch import nn
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from hf_accel.runtime.compile_gate import is_tracing
from hf_accel.runtime.graph_calls import StepGuardedCalls, TrustedLayers, shared_inputs
from hf_accel.runtime.regions import (
    FilledLayerView,
    LayerCacheView,
    Region,
    hidden_states_of,
    side_inputs,
    with_cache,
    without_cache,
)


class GraphCompiler(Protocol):
    """What compiles the decoder layers' graphs: a ``torch.compile`` backend that counts what it compiles. A
    compile backend's plugin provides one (e.g. inductor's)."""

    #: As in ``torch.compile`` (``"reduce-overhead"`` turns on CUDA graphs); part of what identifies a stored graph.
    mode: str | None
    #: Graphs compiled so far.
    graphs: int

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any: ...

    def fresh(self) -> GraphCompiler:
        """One with the same settings and a count of its own (for a draft model's step)."""
        ...

    def caching_in(self, directory: Path) -> AbstractContextManager[None]:
        """While a compile runs: keep the code it produces under ``directory`` (the compile store's), and
        reuse what is there."""
        ...


#: What a layer's graph is called with (see :func:`graph_arguments`): part of a stored graph's key, so that
#: entries stored for graphs called otherwise are not taken for ones compiled before.
GRAPH_INPUTS = "layer, cache layer, cache slot, filled span, arguments"


@dataclass
class CompileStats:
    """What compiling has cost and done so far, for the report."""

    graphs_compiled: int = 0
    compile_seconds: float = 0.0
    gate_seconds: float = 0.0  # before compiling, waiting for other threads' calls to end (see compile_gate)
    compiled_steps: int = 0  # forwards whose every layer ran a compiled graph
    eager_steps: int = 0  # forwards with a layer whose shape class was not compiled (yet)
    eager_seconds: float = 0.0  # the time of those forwards: what running eagerly has cost so far
    misses: int = 0  # layer calls of a compiled shape class that matched no graph (ran eagerly)
    check_error: float | None = None  # worst relative error of a new graph against the eager layer
    failure: str | None = None  # why the step fell back to eager for good


class RegionGraphs:
    """The compiled graphs of one kind of layer. A function of its own (dynamo keeps graphs, and its limit on
    recompiles, per code object), compiled on purpose through ``compile`` and otherwise run through
    ``run``, which only looks graphs up (checking their guards once per step: see
    :class:`~hf_accel.runtime.graph_calls.StepGuardedCalls`): a call that matches none runs eagerly and is
    counted."""

    def __init__(self, name: str, backend: Callable[..., Any], trusted: TrustedLayers) -> None:
        self.misses = [0]
        self.body = _function_named(_region_body(self.misses), name)
        self.compile = torch.compile(self.body, backend=backend, dynamic=None)
        self.run = StepGuardedCalls(self.body, torch._dynamo.run(self.body), trusted)


def _region_body(misses: list[int]) -> Callable[..., Any]:
    def region(layer: nn.Module, layer_cache: Any, cache_slot: int | str, span: torch.Tensor | None, *args: Any,
               **kwargs: Any) -> Any:
        if not is_tracing():  # only runs as Python when no graph matched
            misses[0] += 1
        view = LayerCacheView(layer_cache) if span is None else FilledLayerView(layer_cache, span.shape[0])
        args, kwargs = with_cache(args, kwargs, cache_slot, view)
        return type(layer).forward(layer, *args, **kwargs)

    return region


def _function_named(function: types.FunctionType, name: str) -> types.FunctionType:
    """``function`` with a code object of its own, named ``name``."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


def eager_layer(region: Region, layer_cache: Any, slot: int | str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    """The layer's own forward, its attention over the cache's filled slots where the call can be cut to them
    (see :func:`cut_to_filled`), else over them all."""
    cut = cut_to_filled(layer_cache, *without_cache(args, kwargs, slot))
    if cut is None:
        return type(region.layer).forward(region.layer, *args, **kwargs)
    rest_args, rest_kwargs, filled = cut
    args, kwargs = with_cache(rest_args, rest_kwargs, slot, FilledLayerView(layer_cache, filled))
    return type(region.layer).forward(region.layer, *args, **kwargs)


def graph_arguments(layer_cache: Any, slot: int | str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    filled_slots: bool) -> tuple[Any, ...]:
    """What a layer's graph is called with after the layer, its cache layer and the cache's slot: the span of
    filled slots its attention reads (a zero-byte ``[filled, 0]`` tensor, whose length the graph leaves
    dynamic; None for all of them), then the call's arguments without the cache, cut to match.
    ``filled_slots``: :func:`reads_filled_slots` of the call, judged once for its shape class."""
    rest_args, rest_kwargs = without_cache(args, kwargs, slot)
    if not filled_slots:
        return None, rest_args, rest_kwargs
    rest_args, rest_kwargs, filled = cut_masks(layer_cache, rest_args, rest_kwargs)
    return layer_cache.keys.new_empty(filled, 0), rest_args, rest_kwargs


class StepArguments:
    """One decode step's graph arguments (:func:`reads_filled_slots`, :func:`graph_arguments`), worked out once
    for the layers called with the same inputs but their hidden states
    (:func:`~hf_accel.runtime.graph_calls.shared_inputs`): each layer of a step gets the same mask, positions and
    rotary tables, so the mask is cut and the span made once, and every layer's graph gets the same objects
    (which :class:`~hf_accel.runtime.graph_calls.StepGuardedCalls` then describes once a step too). Those inputs
    are assumed not to change in place between two layers of the step. One per step: it holds the inputs it has
    seen (not the hidden states), so that their ids stay theirs while it lives."""

    def __init__(self) -> None:
        self._filled_slots: dict[Hashable, bool] = {}
        self._arguments: dict[Hashable, tuple[Any, ...]] = {}  # the span, the arguments after the hidden states
        self._held: dict[Hashable, tuple[Any, ...]] = {}  # shared_inputs' ids -> the objects they are the ids of

    def reads_filled_slots(self, layer_cache: Any, slot: int | str, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> bool:
        shared = shared_inputs(args, kwargs)
        if shared is None:
            return reads_filled_slots(layer_cache, slot, args, kwargs)
        key = (shared, slot, layer_cache.max_cache_len, layer_cache.keys.device)
        if key not in self._filled_slots:
            self._filled_slots[key] = reads_filled_slots(layer_cache, slot, args, kwargs)
            self._hold(shared, args, kwargs)
        return self._filled_slots[key]

    def graph_arguments(self, layer_cache: Any, slot: int | str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        filled_slots: bool) -> tuple[Any, ...]:
        shared = shared_inputs(args, kwargs)
        if shared is None:
            return graph_arguments(layer_cache, slot, args, kwargs, filled_slots)
        hidden, keys = args[0], layer_cache.keys
        # Each cache layer's own count: the layers of a step are filled alike, but nothing here relies on it.
        filled = int(layer_cache.cumulative_length) + hidden.shape[1] if filled_slots else None
        key = (shared, slot, filled_slots, filled, layer_cache.max_cache_len, keys.dtype, keys.device)
        if key not in self._arguments:
            span, rest_args, rest_kwargs = graph_arguments(layer_cache, slot, args, kwargs, filled_slots)
            # Hidden states are never cut (see cut_masks); the caller's dict is not kept (a cache passed by position
            # leaves it as it was).
            self._arguments[key] = span, rest_args[1:], dict(rest_kwargs)
            self._hold(shared, args, kwargs)
        span, after_hidden, rest_kwargs = self._arguments[key]
        return span, (hidden, *after_hidden), rest_kwargs

    def _hold(self, shared: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._held.setdefault(shared, (args[1:], tuple(kwargs.values())))


def reads_filled_slots(layer_cache: Any, slot: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a layer call's graph reads only the cache's filled slots (see :func:`graph_arguments`): part of
    its shape class, since a graph serves calls of one kind only.

    On CPU only: there reading the slots is the cost, while on a GPU reading the filled count would wait for
    the device, and CUDA graphs want fixed shapes."""
    return layer_cache.keys.device.type == "cpu" and _cuttable_call(layer_cache, *without_cache(args, kwargs, slot))


def side_graph_arguments(layer_cache: Any, slot: int | str, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`graph_arguments` for compiling on the side: copies of the arguments with every size that varies
    between calls marked dynamic (see :func:`~hf_accel.runtime.regions.side_inputs`), and the scratch cache
    layer the compiled graph writes instead of the real one (last)."""
    filled_slots = reads_filled_slots(layer_cache, slot, args, kwargs)
    span, args, kwargs = graph_arguments(layer_cache, slot, args, kwargs, filled_slots)
    if span is not None:
        torch._dynamo.maybe_mark_dynamic(span, 0)
    side_args, side_kwargs, scratch = side_inputs(args, kwargs, layer_cache, layer_cache.max_cache_len,
                                                  None if span is None else len(span))
    return span, side_args, side_kwargs, scratch


def cut_to_filled(layer_cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """:func:`cut_masks` where the call can be cut; None where an input spanning the cache's length cannot be
    cut with the keys and values (a per-key bias such as Bloom's alibi, a mask object)."""
    return cut_masks(layer_cache, args, kwargs) if _cuttable_call(layer_cache, args, kwargs) else None


def cut_masks(layer_cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A layer call's arguments (the cache left out) with every 4-D mask over the cache's slots cut to the
    filled ones (this call's included), and their count."""
    length = layer_cache.max_cache_len
    filled = int(layer_cache.cumulative_length) + hidden_states_of(args, kwargs).shape[1]

    def cut(value: Any) -> Any:  # contiguous, as the graph was compiled from (its guards check strides)
        spans_cache = isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[-1] == length
        return value[..., :filled].contiguous() if spans_cache else value

    return tuple(map(cut, args)), {name: cut(value) for name, value in kwargs.items()}, filled


def _cuttable_call(layer_cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every input of a layer call (the cache left out) can follow the keys and values when they are cut
    to the filled slots. The hidden states never span the cache, whatever their width (a hidden size is often
    a bucket's length, 1024 or 2048)."""
    hidden = hidden_states_of(args, kwargs)
    return all(value is hidden or cuttable(value, layer_cache.max_cache_len) for value in (*args, *kwargs.values()))


def cuttable(value: Any, length: int) -> bool:
    """Whether an input of a layer call can follow the keys and values when they are cut to the filled slots."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, torch.Tensor):
        return (value.dim() == 4 and value.shape[-1] == length) or length not in value.shape
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, torch.Tensor) and length not in v.shape for v in value)
    return False  # a mask object, a dict of masks, anything else: leave the call as it is


def compileable(layer_cache: Any) -> bool:
    """Full-length static layers (the caches this step makes), once the prompt has filled them."""
    return (isinstance(layer_cache, StaticLayer) and not isinstance(layer_cache, StaticSlidingWindowLayer)
            and layer_cache.is_initialized)


def separate_symbols() -> Any:
    """Give every dynamic size its own symbol: by default dynamo reads two equal sizes (a batch of 3 and a
    chunk of 3 tokens) as one, and the graph would serve only calls where they stay equal."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


def describe_failure(exc: Exception) -> str:
    """The exception that caused it all (dynamo wraps a backend's error), as ``Type: first line``."""
    inner = getattr(exc, "inner_exception", None) or exc
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0] if text else ''}"


def disagreement(reference: list[torch.Tensor], actual: list[torch.Tensor]) -> float:
    """The largest relative error between corresponding tensors; infinite where the structures differ or an
    error is NaN (``max`` would drop a NaN that is not first)."""
    if len(reference) != len(actual) or any(r.shape != a.shape for r, a in zip(reference, actual)):
        return float("inf")
    errors = [relative_error(r, a) for r, a in zip(reference, actual)]
    return float("inf") if any(math.isnan(e) for e in errors) else max(errors)


def relative_error(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.float(), actual.float()
    return ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
