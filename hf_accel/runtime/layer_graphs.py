"""The pieces the compiled decode step is built from: the graph compiler's contract, what compiling cost, the
compiled graphs of one kind of decoder layer, a layer's eager forward over its cache's filled slots, and the
checks of a new graph."""

from __future__ import annotations

import types
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from hf_accel.runtime.regions import (
    FilledLayerView,
    LayerCacheView,
    Region,
    hidden_states_of,
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


@dataclass
class CompileStats:
    """What compiling has cost and done so far, for the report."""

    graphs_compiled: int = 0
    compile_seconds: float = 0.0
    compiled_steps: int = 0  # forwards whose every layer ran a compiled graph
    eager_steps: int = 0  # forwards with a layer whose shape class was not compiled (yet)
    eager_seconds: float = 0.0  # the time of those forwards: what running eagerly has cost so far
    misses: int = 0  # layer calls of a compiled shape class that matched no graph (ran eagerly)
    check_error: float | None = None  # worst relative error of a new graph against the eager layer
    failure: str | None = None  # why the step fell back to eager for good


class RegionGraphs:
    """The compiled graphs of one kind of layer. A function of its own (dynamo keeps graphs, and its limit on
    recompiles, per code object), compiled on purpose through ``compile`` and otherwise run through
    ``run``, which only looks graphs up: a call that matches none runs eagerly and is counted."""

    def __init__(self, name: str, backend: Callable[..., Any]) -> None:
        self.misses = [0]
        self.body = _function_named(_region_body(self.misses), name)
        self.compile = torch.compile(self.body, backend=backend, dynamic=None)
        self.run = torch._dynamo.run(self.body)


def _region_body(misses: list[int]) -> Callable[..., Any]:
    def region(layer: nn.Module, layer_cache: Any, cache_slot: int | str, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():  # only runs as Python when no graph matched
            misses[0] += 1
        args, kwargs = with_cache(args, kwargs, cache_slot, LayerCacheView(layer_cache))
        return type(layer).forward(layer, *args, **kwargs)

    return region


def _function_named(function: types.FunctionType, name: str) -> types.FunctionType:
    """``function`` with a code object of its own, named ``name``."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


def eager_layer(region: Region, layer_cache: Any, slot: int | str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    """The layer's own forward. Its attention reads only the cache's filled slots (the rest are masked: same
    result, less work) where every input that spans the cache's length is a 4-D mask that can be cut with the
    keys and values; otherwise (a per-key bias such as Bloom's alibi, a mask object) it reads them all."""
    length = layer_cache.max_cache_len
    rest_args, rest_kwargs = without_cache(args, kwargs, slot)
    if not all(cuttable(value, length) for value in (*rest_args, *rest_kwargs.values())):
        return type(region.layer).forward(region.layer, *args, **kwargs)
    filled = int(layer_cache.cumulative_length) + hidden_states_of(args, kwargs).shape[1]

    def cut(value: Any) -> Any:
        return value[..., :filled] if isinstance(value, torch.Tensor) and value.dim() == 4 else value

    args, kwargs = with_cache(tuple(map(cut, rest_args)), {k: cut(v) for k, v in rest_kwargs.items()}, slot,
                              FilledLayerView(layer_cache))
    return type(region.layer).forward(region.layer, *args, **kwargs)


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
    """The largest relative error between corresponding tensors; infinite where the structures differ."""
    if len(reference) != len(actual) or any(r.shape != a.shape for r, a in zip(reference, actual)):
        return float("inf")
    return max(relative_error(r, a) for r, a in zip(reference, actual))


def relative_error(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.float(), actual.float()
    return ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
