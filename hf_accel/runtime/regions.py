"""Decoder layers as compile regions: one graph per kind of layer and shape class, shared by every layer.

A causal LM repeats one decoder block (``LlamaDecoderLayer`` x 30 in SmolLM2). Compiling the model's whole
forward traces every layer: on a 2-core CPU ~35 s per graph with inductor's on-disk cache warm, ~90 s cold.
Compiling one layer's code and running that graph for each layer of the same kind costs one layer's
tracing (~0.5 s warm, ~4-13 s cold), and with the batch size, chunk width, cache length and filled slots left
dynamic, one graph serves every later call.

Each layer gets an instance-level ``forward`` (:func:`routed_forward`) that runs the class's own forward,
unless a :class:`RegionRun` is active in this context (a compiled decode step is running): then the run
decides per layer between the compiled graph and the eager forward.

The graph never sees the model's cache object: it gets one layer of it, behind :class:`LayerCacheView`, so
no layer index is specialized and every layer of a kind matches the same guards.
"""

from __future__ import annotations

import contextvars
import types
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from transformers.cache_utils import Cache

from hf_accel.runtime.compile_gate import is_tracing

#: The compiled step whose layers run through regions in this context (thread, task), or None.
ACTIVE_RUN: contextvars.ContextVar[Any] = contextvars.ContextVar("hf_accel_region_run", default=None)


@dataclass(frozen=True)
class Region:
    """One decoder layer: the module, its slot in the KV cache, and the kind of layer it is."""

    layer: nn.Module
    cache_index: int
    kind: str  # layers of one kind share graphs: the class name, plus the layer type where the config has one


@dataclass(frozen=True)
class ShapeClass:
    """What a graph is specialized on besides the kind of layer: a batch or chunk of one, or more (sizes of
    one are always specialized by dynamo; larger ones are dynamic)."""

    kind: str
    single_row: bool
    single_token: bool
    #: Whether its attention reads only the cache's filled slots (see ``layer_graphs.graph_arguments``).
    filled_slots: bool = True

    def __str__(self) -> str:
        rows = "batch 1" if self.single_row else "batch > 1"
        tokens = "1 token" if self.single_token else "chunks"
        return f"{self.kind}, {rows}, {tokens}{'' if self.filled_slots else ', every cache slot'}"


def decoder_layers(model: nn.Module) -> list[Region]:
    """The model's repeated decoder layers: the longest ``nn.ModuleList`` whose children share one class and
    each know their slot in the KV cache (the ``layer_idx`` transformers gives a layer or its attention).

    :raises ValueError: the model has no such list (nothing to compile regionally).
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    # A decoder's layers know their slot in the KV cache (layer_idx); a vision tower's blocks, longer in some
    # multimodal models, do not.
    decoders = [m for m in lists if all(_cache_index(layer) is not None for layer in m)]
    if not decoders:
        raise ValueError(f"{type(model).__name__} has no list of repeated decoder layers to compile one at a time")
    layers = max(decoders, key=len)
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if config is not None else None
    layer_types = getattr(text_config, "layer_types", None)
    regions = []
    for layer in layers:
        index = _cache_index(layer)
        kind = type(layer).__name__
        if layer_types and index < len(layer_types):
            kind += f"/{layer_types[index]}"
        regions.append(Region(layer, index, kind))
    return regions


def _cache_index(layer: nn.Module) -> int | None:
    """The layer's slot in the KV cache: the ``layer_idx`` transformers gives the layer or its attention."""
    for module in layer.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


class RegionRun:
    """One decode step of a compiled step (``ACTIVE_RUN`` while it runs): which layers are its, and whether
    any of them ran eagerly because its shape class has no graph yet."""

    def __init__(self, step: Any, arguments: Any) -> None:
        self.step = step
        self.arguments = arguments  # the step's layer graph arguments, made once (layer_graphs.StepArguments)
        self.compiled_layers = 0
        self.eager_layers = 0
        self.waiting: set[ShapeClass] = set()  # shape classes whose layers ran eagerly, not compiled (yet)
        self.compiled: set[ShapeClass] = set()  # shape classes whose layers ran their graphs
        self.decisions: dict[ShapeClass, Any] = {}  # the compile policy asked once per class per step
        self.graph_calls: dict[Hashable, Any] = {}  # what the step's graph calls keep (graph_calls.StepGuardedCalls)


def route(layer: nn.Module) -> Callable[..., Any]:
    """The instance-level ``forward`` that lets a running compiled step take the layer over."""
    return types.MethodType(routed_forward, layer)


def is_routed(layer: nn.Module) -> bool:
    """Whether the layer's instance-level ``forward`` is hf_accel's routing (another step of ours may use it)."""
    return getattr(vars(layer).get("forward"), "__func__", None) is routed_forward


def routed_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward on a patched model: the class's forward, or the active run's choice.

    A module-level function bound to the layer, so ``copy.deepcopy`` of a model binds it to the copy."""
    run = None if is_tracing() else ACTIVE_RUN.get()  # a user's own torch.compile traces through
    if run is not None:
        region = run.step.regions.get(id(layer))
        if region is not None:
            return run.step.layer_forward(run, region, args, kwargs)
    return type(layer).forward(layer, *args, **kwargs)


class LayerCacheView:
    """One layer of a static KV cache, standing in for the whole cache inside a compiled layer.

    transformers' attention calls ``cache.update(keys, values, self.layer_idx, ...)``; the view ignores the
    index (it holds the layer already), so the graph does not specialize on it."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        return self.layer.get_seq_length()

    @property
    def is_compileable(self) -> bool:
        return True


class FilledLayerView(LayerCacheView):
    """One static cache layer whose attention reads only its first ``filled`` slots (those written so far, this
    call's included), not the whole fixed length: the slots past them are masked, so the result is the same at
    a fraction of the work. ``filled`` is an int in an eager call, a size the graph leaves dynamic in a
    compiled one."""

    def __init__(self, layer: Any, filled: Any) -> None:
        super().__init__(layer)
        self.filled = filled

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layer.update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.filled], values[:, :, : self.filled]


def cache_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, Cache] | None:
    """Where a layer call holds the model's KV cache, found by type rather than by name: a position (GPT-2
    passes it second) or a keyword (``past_key_values``, or ``cache`` from transformers 5.24)."""
    for slot, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, Cache):
            return slot, value
    return None


Arguments = tuple[tuple[Any, ...], dict[str, Any]]


def without_cache(args: tuple[Any, ...], kwargs: dict[str, Any], slot: int | str) -> Arguments:
    """The call's arguments with the cache left out (a ``None`` in its place if it was positional)."""
    if isinstance(slot, int):
        return (*args[:slot], None, *args[slot + 1:]), kwargs
    return args, {name: value for name, value in kwargs.items() if name != slot}


def with_cache(args: tuple[Any, ...], kwargs: dict[str, Any], slot: int | str, cache: Any) -> Arguments:
    """The call's arguments with ``cache`` put back where the model's cache was."""
    if isinstance(slot, int):
        return (*args[:slot], cache, *args[slot + 1:]), kwargs
    return args, {**kwargs, slot: cache}


def hidden_states_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A decoder layer's input, ``[batch, tokens, hidden]`` (its first argument), or None."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None


def shape_class(region: Region, hidden: torch.Tensor, filled_slots: bool = True) -> ShapeClass:
    return ShapeClass(region.kind, hidden.shape[0] == 1, hidden.shape[1] == 1, filled_slots)


def side_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], layer_cache: Any, cache_length: int,
                filled: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Copies of a layer call's inputs for compiling on the side (the real call runs eagerly), with the batch,
    chunk-width and cache-length dimensions (and a 4-D mask's last one, cut to ``filled`` slots) marked
    dynamic so that one graph serves every size.

    Dimensions are told apart by position, not only size: a layer's inputs are ``[batch, ...]`` with the chunk
    width or the cache length further on (hidden states, position ids, rotary tables, the 4-D mask), and the
    cache's keys and values are ``[batch, heads, length, dim]``, whose heads may equal the batch size."""
    batch, width = hidden_states_of(args, kwargs).shape[:2]

    def mark(tensor: torch.Tensor, dims: Iterator[int]) -> torch.Tensor:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return tensor

    def dynamic_dims(shape: torch.Size) -> Iterator[int]:
        for dim, size in enumerate(shape):
            if dim == 0 and len(shape) > 1:
                if size == batch and batch > 1:
                    yield dim
            elif size == cache_length or (size == width and width > 1) or (dim == 3 and size == filled):
                yield dim

    def duplicate(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return mark(value.clone(), dynamic_dims(value.shape))
        if isinstance(value, (tuple, list)):
            return type(value)(duplicate(v) for v in value)
        if isinstance(value, dict):
            return {k: duplicate(v) for k, v in value.items()}
        return value

    def copy_cache_tensor(value: torch.Tensor) -> torch.Tensor:
        if value.dim() != 4:
            return value.clone()
        return mark(value.clone(), [0, 2] if batch > 1 else [2])

    scratch = object.__new__(type(layer_cache))
    scratch.__dict__.update({name: copy_cache_tensor(value) if isinstance(value, torch.Tensor) else value
                             for name, value in vars(layer_cache).items()})
    return duplicate(args), duplicate(kwargs), scratch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) layer output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif hasattr(value, "to_tuple"):  # a ModelOutput
        yield from tensors_in(value.to_tuple())
