"""What a backend is: its capabilities, options and the context it is applied in (the registry that collects
them from plugins is :mod:`hf_accel.patching.registry`)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

import torch

from hf_accel.patching.changes import Changes
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.patching.memory import shortfall

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_accel.patching.report import FeatureReport
    from hf_accel.patching.state import PatchState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve. The core checks these before calling the backend's own checks.

    :param devices: device types it runs on (``"cpu"``, ``"cuda"``, ...); empty means any.
    :param dtypes: parameter dtypes it accepts; empty means any.
    :param sliding_window: whether it handles sliding-window attention layers.
    :param softcap: whether it handles attention logit soft-capping.
    :param grouped_query: whether it handles grouped-query (and multi-query) attention: fewer key/value heads
        than query heads.
    :param partial_weights: whether it serves a model whose weights are not all whole and in place on this
        process: sharded across processes (``DTensor`` parameters: transformers' ``tp_plan``) or offloaded by
        accelerate (``device_map`` with ``"disk"``/``"cpu"`` offload: meta parameters, loaded per layer as it
        runs). Backends that read, repack or copy whole weight matrices do not.
    :param split_devices: whether it serves a model whose layers ``device_map`` placed on several devices,
        making what it makes (caches, quantized weights) on each layer's own device. ``partial_weights``
        implies it.
    :param padded_masks: (attention) whether it takes the padded masks of a fixed-shape KV cache, as a compiled
        decode step gives them; flash-style kernels that take unpadded sequences do not. Not checked against the
        model: a compile plugin's selection hook reads it to keep its step on.
    """

    devices: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    sliding_window: bool = True
    softcap: bool = True
    grouped_query: bool = True
    partial_weights: bool = False
    split_devices: bool = False
    padded_masks: bool = True


@dataclass(frozen=True)
class Option:
    """A backend option of ``patch()``: its default, and which values it takes (checked at ``patch`` time,
    before anything changes).

    :param default: what the backend uses when the user passes nothing.
    :param accepts: whether a value is valid.
    :param expected: the valid values in words, for the error ("an integer of at least 1").

    Example::

        Backend(..., options={"cache_bucket": Option.integer(256), "compile_when": Option.choice("auto", "first_use")})
    """

    default: Any
    accepts: Callable[[Any], bool]
    expected: str

    @classmethod
    def integer(cls, default: int, minimum: int = 1, maximum: int | None = None) -> Option:
        if maximum is None:
            return cls(default, lambda v: _is_int(v) and v >= minimum, f"an integer of at least {minimum}")
        return cls(default, lambda v: _is_int(v) and minimum <= v <= maximum,
                   f"an integer from {minimum} to {maximum}")

    @classmethod
    def choice(cls, default: Any, *choices: Any) -> Option:
        """One of ``default`` and ``choices``."""
        values = (default, *choices)
        return cls(default, lambda v: any(v == c and type(v) is type(c) for c in values),
                   f"one of {', '.join(map(repr, values))}")

    @classmethod
    def flag(cls, default: bool) -> Option:
        return cls(default, lambda v: isinstance(v, bool), "True or False")

    @classmethod
    def any_of(cls, default: Any, accepts: Callable[[Any], bool], expected: str) -> Option:
        return cls(default, accepts, expected)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PatchContext:
    """Everything a backend sees while it is chosen and applied.

    A backend records every edit it makes in ``changes`` so that patch() can undo it, and fills in
    ``report`` (modules touched, bytes, details) as it goes.
    """

    model: PreTrainedModel
    feature: str
    request: Any
    options: Mapping[str, Any]
    state: PatchState
    changes: Changes
    report: FeatureReport

    def __repr__(self) -> str:  # short: HF_ACCEL_TRACE prints it at every selection
        request = self.request if isinstance(self.request, (str, bool, type(None))) else type(self.request).__name__
        return (f"<PatchContext {self.feature}={request!r} for {type(self.model).__name__} "
                f"({self.state.device}, {str(self.state.dtype).removeprefix('torch.')})>")

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def dtype(self) -> torch.dtype:
        return self.state.dtype

    def before_each_call(self, check: Callable[[], None]) -> None:
        """Run ``check`` at the start of every ``generate`` call of the patched model (under its lock), until
        unpatch: for a backend to notice that something it prepared no longer matches the model (weights
        edited since, for example) and bring it up to date."""
        checks = self.state.call_checks
        checks.append(check)
        self.changes.on_undo(lambda: checks.remove(check))

    def account_memory(self, item: str, bytes_now: Callable[[], int]) -> None:
        """Say what this backend holds beyond the unpatched model: ``bytes_now()`` gives its bytes whenever
        ``hf_accel.report(model)`` is read (negative: bytes it freed, such as plain weights a packed copy
        replaced). Example: ``context.account_memory("KV cache", cache.stored_bytes)``."""
        items = self.state.memory.setdefault(self.feature, {})
        items[item] = bytes_now
        self.changes.on_undo(lambda: items.pop(item, None))

    def option(self, name: str, default: Any = None) -> Any:
        """The user's ``patch(..., name=value)``, or ``default`` (checked against the backends' :class:`Option`
        declarations before any backend runs)."""
        return self.options.get(name, default)


@dataclass(frozen=True)
class Backend:
    """One way to provide a feature. Plugins create these and pass them to ``register``.

    Example::

        @hookimpl
        def hf_accel_register_backends(register):
            register(Backend(name="eager", feature="attention", apply=use_eager))

    :param name: unique across all plugins; what users pass to force it (``attention="eager"``).
    :param feature: which feature it provides (see ``hf_accel.FEATURES``).
    :param apply: makes the change, recording every edit in ``context.changes``.
    :param why_unavailable: returns why it cannot run on this machine (a missing package, no GPU), or None.
    :param why_unsuitable: returns why it cannot serve this model, or None.
    :param capabilities: devices, dtypes and model needs it serves, checked by the core.
    :param priority: ``auto`` tries higher first.
    :param lossless: False if outputs may change; ``auto`` then skips it unless the feature is opt-in.
    :param tolerance: the verification bound for a lossy backend (relative logit error).
    :param probe: how verification exercises it: a ``"forward"`` pass, a short greedy ``"generate"``, or not at all.
    :param variants: other values of the feature that select it (``quantize="int8"``).
    :param options: extra ``patch()`` keyword options it reads: an :class:`Option` (default and valid values,
        checked at ``patch`` time) or a bare default (not checked).
    :param install: what to install when ``why_unavailable`` says something is missing.
    :param memory_needed: bytes it adds to the process once applied (or at its peak while applying, if higher),
        estimated before it runs; where they would not fit in the free memory it is skipped with the reason.
    """

    name: str
    feature: str
    apply: Callable[[PatchContext], None]
    why_unavailable: Callable[[], str | None] | None = None
    why_unsuitable: Callable[[PatchContext], str | None] | None = None
    capabilities: Capabilities = Capabilities()
    priority: int = 0
    lossless: bool = True
    tolerance: float | None = None
    probe: Literal["forward", "generate"] | None = "forward"
    variants: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    install: str = ""
    memory_needed: Callable[[PatchContext], int] | None = None
    plugin: str = ""

    def __post_init__(self) -> None:
        if self.feature not in FEATURE_NAMES:
            raise ValueError(
                f"Backend {self.name!r} names unknown feature {self.feature!r}; valid: {', '.join(FEATURE_NAMES)}"
            )

    def __repr__(self) -> str:
        return f"<Backend {self.name!r} feature={self.feature!r} plugin={self.plugin!r}>"

    def machine_problem(self) -> str | None:
        """Why this backend cannot run on this machine at all, or None."""
        devices = self.capabilities.devices
        if devices and not any(_device_present(d) for d in devices):
            return f"needs a {' or '.join(devices)} device, none present"
        reason = _asked(self.why_unavailable) if self.why_unavailable else None
        if reason and self.install:
            reason = f"{reason} (install: {self.install})"
        return reason

    def model_problem(self, context: PatchContext) -> str | None:
        """Why this backend cannot serve ``context.model`` here, or None."""
        reason = self.machine_problem()
        if reason:
            return reason
        caps = self.capabilities
        if caps.devices and context.device.type not in caps.devices:
            return f"runs on {'/'.join(caps.devices)}, the model is on {context.device.type}"
        if caps.dtypes and context.dtype not in caps.dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in caps.dtypes)
            return f"needs {names} weights, the model is {str(context.dtype).removeprefix('torch.')}"
        for need, used in model_needs(context.model.config).items():
            if used and not getattr(caps, need):
                return f"does not support {NEEDS_IN_WORDS[need]}, which this model uses"
        where = None if caps.partial_weights else partial_weights(context.model)
        if where:
            return f"needs whole weight matrices in place; this model's are {where}"
        devices = [] if caps.partial_weights or caps.split_devices else weight_devices(context.model)
        if len(devices) > 1:
            return (f"needs the model on one device; device_map split it across {', '.join(devices)} (load it "
                    "onto one device for this feature)")
        reason = _asked(self.why_unsuitable, context) if self.why_unsuitable else None
        if reason is None and self.memory_needed is not None:
            needed = _asked(self.memory_needed, context)
            reason = needed if isinstance(needed, str) else shortfall(context.device, needed)
        return reason


def _asked(check: Callable[..., Any], *args: Any) -> Any:
    """A backend's own check, called; one that raises answers with why instead (a broken plugin's backend is
    then skipped with that reason, not the whole patch)."""
    try:
        return check(*args)
    except Exception as exc:
        name = getattr(check, "__name__", "a check")
        return f"its check {name} raised {type(exc).__name__}: {exc}"


def partial_weights(model: torch.nn.Module) -> str | None:
    """Where a model's weights are when not all of them are whole and in place here (see
    ``Capabilities.partial_weights``), in words; None when they are."""
    tensors = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor can exist
    if tensors is not None and any(isinstance(p, tensors.DTensor) for p in model.parameters()):
        return "sharded across processes (tp_plan)"
    if any(p.is_meta for p in model.parameters()):
        return ("offloaded until each layer runs (device_map with CPU or disk offload; load the model without "
                "offload for this feature)")
    return None


def weight_devices(model: torch.nn.Module) -> list[str]:
    """The devices the model's weights are on, sorted (more than one: ``device_map`` split it)."""
    return sorted({str(p.device) for p in model.parameters()})


def model_needs(config: Any) -> dict[str, bool]:
    """The attention features a model's config asks for (keys: the :class:`Capabilities` that serve them), read
    from the config's data, not its class."""
    config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = bool(getattr(config, "sliding_window", None)) and (
        "sliding_attention" in layer_types or getattr(config, "use_sliding_window", True) is not False
    )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {
        "sliding_window": sliding,
        "softcap": getattr(config, "attn_logit_softcapping", None) is not None,
        "grouped_query": bool(heads and kv_heads and kv_heads < heads),
    }


NEEDS_IN_WORDS = {"sliding_window": "sliding-window attention", "softcap": "attention logit soft-capping",
                  "grouped_query": "grouped-query attention"}


def _device_present(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    module = getattr(torch, device_type, None)
    return bool(module and getattr(module, "is_available", lambda: False)())
