"""patch / unpatch / report: one transaction of backend phases per model instance."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from hf_accel.patching.errors import PatchError
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.patching.mapped_files import mappings_read_once, release_replaced_pages
from hf_accel.patching.plugin_manager import get_plugin_manager, plugin_manager_with
from hf_accel.patching.registry import BackendRegistry
from hf_accel.patching.report import PatchReport
from hf_accel.patching.state import get_state
from hf_accel.patching.transaction import Transaction, empty_report, undo_all
from hf_accel.patching.unwrap import unwrap_model
from hf_accel.runtime.compile_gate import COMPILE_GATE

logger = logging.getLogger("hf_accel")

def patch(
    model: Any,
    *,
    attention: Any = "auto",
    kv_cache: Any = "auto",
    quantize: Any = None,
    speculative: Any = "auto",
    compile: Any = "auto",
    verify: bool = True,
    strict: bool = False,
    plugins: Iterable[Any] = (),
    **options: Any,
) -> Any:
    """Make ``model.generate`` faster, in place, and return ``model``.

    Each feature takes ``None``/``False`` (off), ``"auto"`` (the plugins pick for this model, device and
    dtype) or a backend name (forced). Every default is lossless; ``quantize`` is off unless asked for.
    If anything fails, the model is left exactly as it was and the error says which plugin, phase and why.

    Example::

        >>> model = hf_accel.patch(AutoModelForCausalLM.from_pretrained(path))
        >>> model.generate(**inputs, max_new_tokens=128)        # unchanged call, faster
        >>> print(hf_accel.report(model))

    :param model: a ``PreTrainedModel``, or one wrapped by accelerate, DDP, ``torch.compile`` or PEFT.
    :param verify: check each backend with a short probe against the model before it (and each module it
        replaces against the original); fall back on mismatch.
    :param strict: raise instead of falling back: when a backend ``auto`` chose fails its verification, when a
        requested variant (``quantize="int8"``) finds no backend, and when a generate call would run stock
        ``generate`` instead of the speculative loop. For plugin authors who want to know.
    :param plugins: plugin objects to use for this call only, next to the registered ones.
    :param options: backend options (see ``hf_accel.available_backends()``); unknown names raise ``ValueError``.
    """
    target = unwrap_model(model)
    requests = {"quantize": quantize, "attention": attention, "kv_cache": kv_cache, "compile": compile,
                "speculative": speculative}
    _validate_call(verify, plugins, strict)
    plugins = tuple(plugins)  # once: a generator would be empty the second time
    arguments = {**requests, "verify": verify, "strict": strict, "plugins": plugins, **options}
    # Two threads patching one model: the second sees the first's patch. The gate keeps the patch's probes from
    # running while another patched model compiles.
    with _patch_lock(target), COMPILE_GATE.call():
        return _patch(model, target, requests, arguments, verify, plugins, options)


_PATCH_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_PATCH_LOCKS_LOCK = threading.Lock()


def _patch_lock(model: Any) -> threading.RLock:
    """Held while ``model`` is being patched (other models patch in parallel)."""
    with _PATCH_LOCKS_LOCK:
        return _PATCH_LOCKS.setdefault(model, threading.RLock())


def _patch(model: Any, target: Any, requests: dict[str, Any], arguments: dict[str, Any], verify: bool,
           plugins: Iterable[Any], options: dict[str, Any]) -> Any:
    pm = plugin_manager_with(plugins)
    registry = BackendRegistry.collect(pm)
    _validate(requests, options, registry)
    existing = get_state(target)
    if existing is not None:
        if _same_arguments(existing.arguments, arguments):
            logger.info("%s is already patched with these arguments", type(target).__name__)
            return model
        raise ValueError(f"{type(target).__name__} is already patched with {_argument_text(existing.arguments)}; call "
                         f"hf_accel.unpatch(model) first to patch it with {_argument_text(arguments)}")
    transaction = Transaction(target, pm, registry, options, verify, arguments, strict=arguments["strict"])
    try:
        for feature in FEATURE_NAMES:
            with mappings_read_once():
                transaction.run_phase(feature, requests[feature])
            # A checkpoint transformers memory-mapped stays mapped while any of its tensors lives: the weights
            # this phase replaced must leave memory now, before a later phase adds its own.
            release_replaced_pages(target)
        transaction.install()
    except BaseException:
        transaction.rollback()
        raise
    for changes in transaction.state.changes:
        changes.commit()
    logger.info("patched %s: %s", type(target).__name__,
                ", ".join(f"{f}={transaction.state.report[f].backend}" for f in FEATURE_NAMES))
    return model


def unpatch(model: Any) -> Any:
    """Undo everything ``patch`` changed on this model (weights, attention, generation config, ``generate``).

    Example::

        >>> hf_accel.unpatch(model) is model
        True
    """
    target = unwrap_model(model)
    state = get_state(target)
    if state is None:
        logger.info("%s is not patched; nothing to undo", type(target).__name__)
        return model
    reasons = [c.irreversible for c in state.changes if c.irreversible]
    if reasons:
        raise PatchError(f"cannot unpatch {type(target).__name__}: {'; '.join(reasons)}. Reload the model instead.")
    with state.lock:  # after the generate call in progress, if any
        if state.depth:
            raise PatchError(f"unpatch({type(target).__name__}) was called from inside one of its generate calls "
                             "(a hook, streamer or stopping criterion); call it after generate returns")
        undo_all(state.changes)
    return model


def report(model: Any) -> PatchReport:
    """What ``patch`` chose for each feature and why. An unpatched model gets a report saying so."""
    target = unwrap_model(model)
    state = get_state(target)
    if state is not None:
        for feature, items in state.memory.items():
            state.report[feature].memory = {item: int(bytes_now()) for item, bytes_now in items.items()}
        return state.report
    empty = empty_report(target)
    for feat in empty.features.values():
        feat.reason = "model not patched"
    return empty


@dataclass
class BackendStatus:
    name: str
    feature: str
    plugin: str
    available: bool
    reason: str
    lossless: bool
    priority: int
    description: str


def available_backends() -> list[BackendStatus]:
    """Every registered backend, its feature, and whether it can run on this machine (and why not)."""
    registry = BackendRegistry.collect(get_plugin_manager())
    rows = []
    for backend in registry:
        problem = backend.machine_problem()
        rows.append(BackendStatus(backend.name, backend.feature, backend.plugin, problem is None, problem or "",
                                  backend.lossless, backend.priority, backend.description))
    order = {name: i for i, name in enumerate(FEATURE_NAMES)}
    return sorted(rows, key=lambda r: (order[r.feature], -r.priority, r.name))


def check_arguments(plugins: Iterable[Any] = (), **arguments: Any) -> None:
    """Raise the ``ValueError`` that ``patch(model, **arguments)`` would raise for an unknown backend or
    option, without a model (e.g. before spending time loading one).

    Example::

        >>> hf_accel.check_arguments(attention="flashy")
        Traceback (most recent call last):
        ValueError: Unknown attention backend 'flashy'; valid values: None, 'auto', 'eager', 'sdpa'. ...
    """
    requests = {f: arguments.pop(f) for f in FEATURE_NAMES if f in arguments}
    _validate_call(arguments.pop("verify", True), plugins, arguments.pop("strict", False))
    _validate(requests, arguments, BackendRegistry.collect(plugin_manager_with(plugins)))


def _validate_call(verify: Any, plugins: Any, strict: Any = False) -> None:
    for name, value in (("verify", verify), ("strict", strict)):
        if not isinstance(value, bool):
            raise ValueError(f"patch() argument {name}={value!r} is not valid: expected True or False")
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Iterable):
        raise ValueError(f"patch() argument plugins={plugins!r} is not valid: expected a list of plugin objects")


def _validate(requests: Mapping[str, Any], options: Mapping[str, Any], registry: BackendRegistry) -> None:
    for feature, request in requests.items():
        valid = registry.valid_requests(feature)
        if isinstance(request, str) and request not in valid:
            raise ValueError(
                f"Unknown {feature} backend {request!r}; valid values: None, {', '.join(map(repr, valid))}. "
                "Run `hf-accel doctor` to see every registered backend."
            )
        if not isinstance(request, (str, bool, type(None))) and not _is_draft_model(feature, request):
            draft = " or a draft model (a transformers PreTrainedModel)" if feature == "speculative" else ""
            raise ValueError(f"patch() argument {feature}={request!r} is not valid: expected None, False, True, "
                             f"{', '.join(map(repr, valid))}{draft}")
    unknown = sorted(set(options) - registry.option_names())
    if unknown:
        valid = ", ".join(sorted(registry.option_names())) or "none"
        raise ValueError(f"Unknown patch() option(s) {', '.join(map(repr, unknown))}; valid options: {valid}")
    for name, value in options.items():
        problem = registry.option_problem(name, value)
        if problem:
            raise ValueError(f"patch() option {name}={value!r} is not valid: {problem}")


def _is_draft_model(feature: str, request: Any) -> bool:
    from transformers import PreTrainedModel

    return feature == "speculative" and isinstance(request, PreTrainedModel)


def _same_arguments(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal keys and values (objects such as draft models compared by identity)."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if x is not y and (type(x) is not type(y) or not isinstance(x, (str, int, float, bool, tuple, list))
                           or x != y):
            return False
    return True


def _argument_text(arguments: Mapping[str, Any]) -> str:
    shown = {k: v for k, v in arguments.items() if k != "plugins" or v}
    return ", ".join(f"{k}={v!r}" if not isinstance(v, torch.nn.Module) else f"{k}=<{type(v).__name__}>"
                     for k, v in shown.items())
