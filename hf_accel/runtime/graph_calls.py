"""Calling one kind of layer's compiled graphs with dynamo's guards checked once per decode step, not per layer.

Every decoder layer of a kind runs one compiled graph (see :class:`~hf_accel.runtime.layer_graphs.RegionGraphs`),
and dynamo checks that graph's guards (the layer's modules and weights, each input's dtype, shape and strides,
global state) before every call: SmolLM2's int4 draft layer on a 2-core CPU takes 292 us a call through dynamo,
240 us this way, 208 us the graph's code alone (docs/benchmarks.md). But a layer does not change while a
``generate`` call runs, and the layers of one step are called alike: the same mask and rotary tables, hidden
states of one shape. So :class:`StepGuardedCalls` checks the guards in full only

- for a step's first call of a kind (its lead), choosing the graph as dynamo would: the first cached one whose
  guards pass;
- for each layer and cache layer, once per ``generate`` call and graph (the layer's own part of the guards),
  and again after a module, parameter or buffer is assigned into one of the layer's modules (torch's global
  registration hooks tell) or its ``training`` flips;

and runs the chosen graph's code (dynamo's transformed bytecode, in dynamo's run-only mode as a lookup would)
for the step's later calls whose inputs match the lead's (:func:`step_signature`: :func:`signature`, with the
inputs every layer of the step shares described once a step). Everything else goes through dynamo's
own lookup: calls outside a ``generate`` call, off the CPU (CUDA graphs count dynamo's calls), under a compile or
a stance other than the default, or with inputs :func:`signature` cannot describe.

What is assumed beyond dynamo's guards: while a call runs, nothing but an assignment the hooks see (or the layer's
own ``training``) changes what a layer's graph was checked against; a streamer that calls ``model.to(...)``, sets
``param.data`` or a plain attribute of a submodule mid-call is not seen, nor another thread changing process-wide
state such as the default dtype. Nor is an input that a step's layers share (the mask, positions, rotary tables,
an item of a list or dict among them, a mask's values) changed in place between two layers of the step: its
description, whether the layers read only the filled slots, and a mask's cut to them are made once a step.
Between calls every layer is checked in full again.

Example::

    trusted = TrustedLayers()                     # one per compiled step, for all its kinds of layer
    calls = StepGuardedCalls(body, torch._dynamo.run(body), trusted)
    trusted.open()                                # a generate call begins
    out = calls(per_step, layer, layer_cache, slot, span, hidden, **kwargs)  # per_step: one dict a step
    trusted.close()                               # it ends: every layer is checked in full again next time
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo.eval_frame as dynamo_frames
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, get_eval_frame_callback, set_eval_frame
from torch.nn.modules import module as nn_module

_PLAIN = (bool, int, float, str, type(None), torch.device, torch.dtype)
_RUN_ONLY = False  # dynamo's eval-frame callback that looks up compiled frames and never compiles


class Undescribable(Exception):
    """An input :func:`signature` cannot stand for (an object whose contents dynamo may guard on)."""


def signature(*values: Any) -> tuple[Hashable, ...]:
    """What dynamo's guards on these inputs look at: each tensor's type, dtype, device, shape, strides,
    requires_grad, its inference, conjugate and negative bits, and which inputs are one tensor; every other
    value (numbers, strings, None, devices, dtypes, and tuples, lists and dicts of them) itself; and grad and
    inference mode. Raises :class:`Undescribable` for anything else."""
    tensors: dict[int, int] = {}
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *(_describe(value, tensors) for value in values))


def _describe(value: Any, tensors: dict[int, int]) -> Hashable:
    if isinstance(value, torch.Tensor):
        first = tensors.setdefault(id(value), len(tensors))  # aliasing: dynamo guards on it
        return (type(value), value.dtype, value.device, value.shape, value.stride(), value.requires_grad,
                value.is_inference(), value.is_conj(), value.is_neg(), first)
    if isinstance(value, _PLAIN):
        return type(value), value
    if type(value) in (tuple, list):
        return type(value), *(_describe(item, tensors) for item in value)
    if type(value) is dict:
        return dict, *((key, _describe(item, tensors)) for key, item in value.items())
    raise Undescribable(type(value).__name__)


def shared_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
    """What identifies a layer call's inputs but its hidden states (its first argument, ``[batch, tokens, hidden]``):
    the objects every decoder layer of a decode step is called with (the mask, positions, rotary tables). None
    where the hidden states are not the first argument."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
        return None
    return tuple(map(id, args[1:])), tuple(kwargs), tuple(map(id, kwargs.values()))


def step_signature(per_step: dict[Hashable, Any], slot: int | str, span: torch.Tensor | None, args: tuple[Any, ...],
                   kwargs: dict[str, Any], cache_tensors: tuple[Any, ...]) -> tuple[Hashable, ...]:
    """:func:`signature` of a layer call's graph inputs, with what every layer of a decode step shares (all but
    its hidden states and its cache layer's tensors: the same objects for each layer, see
    :class:`~hf_accel.runtime.layer_graphs.StepArguments`) described once a step and kept in ``per_step``,
    the step's own dict, with those objects (so that their ids stay theirs). The same information as
    :func:`signature`, its tensors numbered in another order, so two calls' signatures are equal exactly when
    theirs would be; assumed, as the module says, that the shared inputs are not changed in place between two
    layers of a step."""
    shared = shared_inputs(args, kwargs)
    if shared is None:
        return signature(slot, span, args, kwargs, cache_tensors)
    key = ("described", slot, id(span), shared)
    described = per_step.get(key)
    if described is None:
        numbered: dict[int, int] = {}
        description = tuple(_describe(value, numbered) for value in (slot, span, args[1:], kwargs))
        described = per_step[key] = (description, numbered, (span, args[1:], tuple(kwargs.values())))
    description, numbered, _ = described
    numbered = dict(numbered)  # this call's hidden states and cache tensors are numbered after the shared ones
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), description,
            _describe(args[0], numbered), _describe(cache_tensors, numbered))


def split_cache_layer(layer_cache: Any) -> tuple[tuple[Any, ...], tuple[Hashable, ...]]:
    """A cache layer's tensors (whose metadata must match the lead's; their contents change every step) and
    its other attributes (index, length, pool: the same while the layer stays trusted)."""
    tensors, constants = [], []
    for name, value in vars(layer_cache).items():
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        else:
            constants.append((name, value if isinstance(value, _PLAIN) else id(value)))
    return tuple(tensors), tuple(constants)


_open: list[TrustedLayers] = []  # those inside a generate call, which the registration hooks tell of assignments


def _assigned(module: torch.nn.Module, name: str, value: Any) -> None:
    for trusted in tuple(_open):
        trusted.assigned_into(module)


def _watch_assignments() -> None:
    """Have torch's global registration hooks report every module, parameter and buffer assignment (registered
    once per process; a call costs a set lookup per open :class:`TrustedLayers`)."""
    if getattr(_watch_assignments, "done", False):
        return
    for register in (nn_module.register_module_module_registration_hook,
                     nn_module.register_module_parameter_registration_hook,
                     nn_module.register_module_buffer_registration_hook):
        register(_assigned)
    _watch_assignments.done = True  # type: ignore[attr-defined]


class TrustedLayers:
    """The layers a compiled step's graphs have checked in full during the current ``generate`` call (None
    between calls), shared by its kinds of layer; and what the checks and direct calls have counted."""

    def __init__(self) -> None:
        self._checked: set[tuple[Hashable, ...]] | None = None  # (graph code, layer, its flags, its cache layer)
        self._watched: set[int] = set()  # the trusted layers' modules
        self._stale = False  # something was assigned into one of them
        self.direct_calls = 0
        self.guard_checks = 0

    def open(self) -> None:
        """A ``generate`` call begins: every layer is checked in full once more."""
        _watch_assignments()
        self._checked, self._watched, self._stale = set(), set(), False
        if self not in _open:
            _open.append(self)

    def close(self) -> None:
        self._checked = None
        if self in _open:
            _open.remove(self)

    def current(self) -> set[tuple[Hashable, ...]] | None:
        """The layers checked in this call (none, if a module, parameter or buffer was assigned into one of
        them since); None between calls."""
        if self._stale and self._checked is not None:  # the freed modules' ids go too: a new module may take one
            self._checked, self._watched, self._stale = set(), set(), False
        return self._checked

    def trust(self, key: tuple[Hashable, ...], layer: torch.nn.Module) -> None:
        assert self._checked is not None
        self._checked.add(key)
        self._watched.update(map(id, layer.modules()))

    def assigned_into(self, module: torch.nn.Module) -> None:
        if id(module) in self._watched:
            self._stale = True


@dataclass(frozen=True)
class Lead:
    """A step's first call of a kind: its inputs' signature and the graph whose guards it passed."""

    signature: tuple[Hashable, ...]
    code: types.CodeType | None  # dynamo's transformed code for that graph (None: no graph's guards passed);
    guards: Any  # the graph's guard manager (held, not the cache entry: that is dynamo's to free)
    function: Callable[..., Any] | None  # the code as a function: gathers the graph's inputs, runs it, replays effects


class StepGuardedCalls:
    """Runs a kind of layer's compiled graphs, checking dynamo's guards once per step (see the module's doc).

    :param body: the function dynamo compiled the graphs from (its code object holds the cached graphs).
    :param dynamo_run: ``torch._dynamo.run(body)``: dynamo's own lookup, for every call not served directly.
    :param trusted: the compiled step's, opened and closed with each ``generate`` call."""

    def __init__(self, body: types.FunctionType, dynamo_run: Callable[..., Any], trusted: TrustedLayers) -> None:
        self.body, self.dynamo_run, self.trusted = body, dynamo_run, trusted
        self._arguments = body.__code__.co_varnames[:body.__code__.co_argcount + 2]  # + *args, **kwargs
        self._cells = dict(zip(body.__code__.co_freevars, (cell.cell_contents for cell in body.__closure__ or ())))
        self._functions: dict[types.CodeType, Callable[..., Any]] = {}

    def __call__(self, per_step: dict[Hashable, Any], layer: torch.nn.Module, layer_cache: Any, slot: int | str,
                 span: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        """One layer call of a decode step. ``per_step``: the step's own dict (empty at its start), where its
        calls keep each kind's lead and the description of the inputs its layers share."""
        inputs, checked = (layer, layer_cache, slot, span, args, kwargs), self.trusted.current()
        if checked is None or not _direct_calls_allowed(layer_cache):
            return self.dynamo_run(layer, layer_cache, slot, span, *args, **kwargs)
        try:
            cache_tensors, cache_constants = split_cache_layer(layer_cache)
            call_signature = step_signature(per_step, slot, span, args, kwargs, cache_tensors)
        except Exception:  # an object, a tensor without strides, a cache layer without attributes
            return self.dynamo_run(layer, layer_cache, slot, span, *args, **kwargs)
        lead = per_step.get(id(self))
        chosen = lead is None or lead.signature != call_signature
        if chosen:
            # The guards in full, as dynamo checks them
            lead = per_step[id(self)] = self._choose(inputs, call_signature)
        if lead.code is None:  # no graph: so for the step's later calls alike, without looking again
            return self.dynamo_run(layer, layer_cache, slot, span, *args, **kwargs)
        key = (lead.code, id(layer), layer.training, id(layer_cache), cache_constants)
        if chosen:
            self.trusted.trust(key, layer)
        elif key not in checked:  # the layer's first call of this graph
            self.trusted.guard_checks += 1
            if not lead.guards.check(self._frame(inputs)):
                return self.dynamo_run(layer, layer_cache, slot, span, *args, **kwargs)
            self.trusted.trust(key, layer)
        else:
            self.trusted.direct_calls += 1
        before = set_eval_frame(_RUN_ONLY)  # frames the graph's code calls (a graph break's) are looked up too
        try:
            return lead.function(layer, layer_cache, slot, span, *args, **kwargs)
        finally:
            set_eval_frame(before)

    def _choose(self, inputs: tuple[Any, ...], call_signature: tuple[Hashable, ...]) -> Lead:
        """The graph dynamo would run for these inputs: the first cached one whose guards pass (a lead without
        code if none does)."""
        frame = self._frame(inputs)
        for entry in _debug_get_cache_entry_list(self.body.__code__):
            self.trusted.guard_checks += 1
            if entry.guard_manager.check(frame):
                return Lead(call_signature, entry.code, entry.guard_manager, self._function(entry.code))
        return Lead(call_signature, None, None, None)

    def _frame(self, inputs: tuple[Any, ...]) -> dict[str, Any]:
        """The frame's locals as dynamo's guards read them at the call: the arguments and the closure's cells."""
        return {**self._cells, **dict(zip(self._arguments, inputs))}

    def _function(self, code: types.CodeType) -> Callable[..., Any]:
        if code not in self._functions:
            self._functions[code] = types.FunctionType(code, self.body.__globals__, self.body.__name__,
                                                       self.body.__defaults__, self.body.__closure__)
        return self._functions[code]


def _direct_calls_allowed(layer_cache: Any) -> bool:
    """On the CPU (CUDA graph trees count dynamo's calls), not under a compile, at dynamo's default stance."""
    keys = getattr(layer_cache, "keys", None)
    return (isinstance(keys, torch.Tensor) and keys.device.type == "cpu" and get_eval_frame_callback() is None
            and getattr(getattr(dynamo_frames, "_stance", None), "stance", None) == "default")
