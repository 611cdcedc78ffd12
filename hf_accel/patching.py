"""patch / unpatch / report: one transaction of backend phases per model instance."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from .backends import Backend, BackendRegistry, PatchContext
from .changes import Changes
from .errors import BackendUnavailableError, PatchError, VerificationError
from .features import FEATURE_NAMES, get_feature
from .generation import make_patched_generate, run_generate
from .plugins import get_plugin_manager, plugin_manager_with
from .report import FeatureReport, PatchReport, Verification
from .state import STATE_ATTR, PatchState, get_state
from .unwrap import unwrap_model
from .verify import (LOSSLESS_TOLERANCE, ProbeInputs, compare_logits, compare_tokens, execution_device,
                     forward_logits, greedy_tokens)

logger = logging.getLogger("hf_accel")

_OFF = (None, False)


def patch(
    model: Any,
    *,
    attention: Any = "auto",
    kv_cache: Any = "auto",
    quantize: Any = None,
    speculative: Any = "auto",
    compile: Any = "auto",
    verify: bool = True,
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
    :param verify: check each backend with a short probe against the model before it; fall back on mismatch.
    :param plugins: plugin objects to use for this call only, next to the registered ones.
    :param options: backend options (see ``hf_accel.available_backends()``); unknown names raise ``ValueError``.
    """
    target = unwrap_model(model)
    requests = {"quantize": quantize, "attention": attention, "kv_cache": kv_cache, "compile": compile,
                "speculative": speculative}
    _validate_call(verify, plugins)
    plugins = tuple(plugins)  # once: a generator would be empty the second time
    arguments = {**requests, "verify": verify, "plugins": plugins, **options}
    with _patch_lock(target):  # two threads patching one model: the second sees the first's patch
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
    transaction = _Transaction(target, pm, registry, options, verify, arguments)
    try:
        for feature in FEATURE_NAMES:
            transaction.run_phase(feature, requests[feature])
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
        _undo_all(state.changes)
    return model


def report(model: Any) -> PatchReport:
    """What ``patch`` chose for each feature and why. An unpatched model gets a report saying so."""
    target = unwrap_model(model)
    state = get_state(target)
    if state is not None:
        for feature, items in state.memory.items():
            state.report[feature].memory = {item: int(bytes_now()) for item, bytes_now in items.items()}
        return state.report
    empty = _empty_report(target)
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
    _validate_call(arguments.pop("verify", True), plugins)
    _validate(requests, arguments, BackendRegistry.collect(plugin_manager_with(plugins)))


def _validate_call(verify: Any, plugins: Any) -> None:
    if not isinstance(verify, bool):
        raise ValueError(f"patch() argument verify={verify!r} is not valid: expected True or False")
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


def _empty_report(model: torch.nn.Module) -> PatchReport:
    param = next(model.parameters(), None)
    try:
        device = str(execution_device(model))  # where it runs, not "meta" for an offloaded first layer
    except ValueError:
        device = str(param.device) if param is not None else "?"
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "?"
    return PatchReport(model=type(model).__name__, device=device, dtype=dtype,
                       features={name: FeatureReport(name) for name in FEATURE_NAMES})


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


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    return execution_device(model), next(model.parameters()).dtype  # meta weights keep their dtype


def _undo_all(changes: list[Changes]) -> None:
    while changes:
        changes.pop().undo()


class _Transaction:
    """Applies one feature after another, verifying each, and can roll all of them back."""

    def __init__(self, model, pm, registry: BackendRegistry, options: Mapping[str, Any], verify: bool,
                 arguments: Mapping[str, Any]) -> None:
        device, dtype = _model_device_dtype(model)
        self.model = model
        self.registry = registry
        self.options = options
        self.verify = verify
        self.state = PatchState(model=model, pm=pm, device=device, dtype=dtype, report=_empty_report(model),
                                original_generate=model.generate, arguments=dict(arguments))
        self._probe: ProbeInputs | None = None
        self._reference: dict[str, torch.Tensor] = {}

    # -- phases -----------------------------------------------------------------------------------------
    def run_phase(self, feature: str, request: Any) -> None:
        report = self.state.report[feature]
        if request in _OFF:
            report.reason = f"off ({feature}={request})"
            return
        forced = self.registry.get(request) if isinstance(request, str) else None
        if forced is not None:
            self._run_forced(forced, request, report)
        else:
            self._run_auto(feature, request, report)

    def _run_forced(self, backend: Backend, request: Any, report: FeatureReport) -> None:
        context = self._context(backend.feature, request, report)
        problem = backend.model_problem(context)
        if problem:
            raise BackendUnavailableError(
                f"{backend.feature}={backend.name!r} cannot run here: {problem}. "
                f"Pass {backend.feature}='auto' to let hf_accel choose, or None to skip it.",
                feature=backend.feature, backend=backend.name, plugin=backend.plugin)
        verification = self._apply(backend, context)
        if verification is not None and not verification.passed:
            raise VerificationError(
                f"{backend.feature}={backend.name!r} (plugin {backend.plugin!r}) changed the model's outputs: "
                f"{verification} {verification.detail}".rstrip()
                + ". Pass verify=False to keep it anyway, or choose another backend.",
                feature=backend.feature, backend=backend.name, plugin=backend.plugin)
        report.backend, report.plugin, report.reason = backend.name, backend.plugin, "forced by the caller"

    def _run_auto(self, feature: str, request: Any, report: FeatureReport) -> None:
        wanted = [b for b in self.registry.for_feature(feature) if _answers(b, request)]
        if not get_feature(feature).opt_in_loss:
            wanted = [b for b in wanted if b.lossless]
        context = self._context(feature, request, report)
        available = []
        for backend in wanted:
            problem = backend.model_problem(context)
            if problem:
                report.skip(backend.name, problem)
            else:
                available.append(backend)
        while available:
            chosen = self.state.pm.hook.hf_accel_select_backend(feature=feature, candidates=tuple(available),
                                                                 context=context)
            if chosen is None:
                break
            if chosen not in available:
                raise PatchError(f"the {feature} selection hook returned {chosen!r}, which is not a candidate",
                                 feature=feature)
            verification = self._apply(chosen, self._context(feature, request, report))
            if verification is None or verification.passed:
                report.backend, report.plugin = chosen.name, chosen.plugin
                report.reason = f"auto: {chosen.description}" if chosen.description else "auto"
                return
            report.skip(chosen.name, f"failed verification ({verification} {verification.detail})".strip())
            available.remove(chosen)
        if not wanted:
            report.reason = f"no {feature} backend registered for {request!r}"
        else:
            report.reason = "no backend can serve this model here (see skipped)"

    def _context(self, feature: str, request: Any, report: FeatureReport) -> PatchContext:
        return PatchContext(model=self.model, feature=feature, request=request, options=self.options,
                            state=self.state, changes=Changes(), report=report)

    def _apply(self, backend: Backend, context: PatchContext) -> Verification | None:
        probe = backend.probe if self.verify else None
        reference = self._reference_for(probe) if probe else None
        self.state.changes.append(context.changes)  # registered first, so a half-done apply is rolled back
        try:
            backend.apply(context)
        except Exception as exc:
            raise PatchError(
                f"plugin {backend.plugin!r} failed in the {backend.feature} phase (backend {backend.name!r}): "
                f"{type(exc).__name__}: {exc}. The model was left unchanged.",
                feature=backend.feature, backend=backend.name, plugin=backend.plugin) from exc
        if probe is None:
            return None
        try:
            verification = self._check(backend, probe, reference)
        except Exception as exc:  # a backend that breaks the model fails verification; it does not crash patch()
            logger.debug("verification of %s raised", backend.name, exc_info=True)
            verification = Verification(probe=probe, passed=False, detail=f"the probe raised {type(exc).__name__}: {exc}")
        context.report.verification = verification
        if not verification.passed:
            self.state.changes.pop().undo()
        return verification

    # -- verification -----------------------------------------------------------------------------------
    def _probe_inputs(self) -> ProbeInputs:
        if self._probe is None:
            self._probe = ProbeInputs.for_model(self.model)
        return self._probe

    def _reference_for(self, probe: str) -> torch.Tensor:
        if probe not in self._reference:
            inputs = self._probe_inputs()
            if probe == "forward":
                self._reference[probe] = forward_logits(self.model, inputs)
            else:
                self._reference[probe] = greedy_tokens(self.state.original_generate, inputs)
        return self._reference[probe]

    def _check(self, backend: Backend, probe: str, reference: torch.Tensor) -> Verification:
        inputs = self._probe_inputs()
        if probe == "generate":
            actual = greedy_tokens(lambda **kw: run_generate(self.state, (), kw), inputs)
            return compare_tokens(reference, actual)
        actual = forward_logits(self.model, inputs)
        tolerance = backend.tolerance if backend.tolerance is not None else LOSSLESS_TOLERANCE.get(self.state.dtype, 3e-2)
        verification = compare_logits(reference, actual, tolerance)
        if verification.passed:  # later phases compare against this model, not the original
            self._reference = {"forward": actual}
        return verification

    # -- install / rollback -----------------------------------------------------------------------------
    def install(self) -> None:
        changes = Changes()
        self.state.changes.append(changes)
        changes.setattr(self.model, STATE_ATTR, self.state)
        patched = make_patched_generate(self.model, self.state.original_generate)
        changes.setattr(self.model, "generate", patched)

    def rollback(self) -> None:
        _undo_all(self.state.changes)


def _answers(backend: Backend, request: Any) -> bool:
    """Whether ``backend`` is a candidate for a non-name request: ``"auto"``/True, one of its variants, or an object."""
    if request is True or request == "auto":
        return True
    if isinstance(request, str):
        return request in backend.variants
    return True  # an object (e.g. a draft model): each backend's why_unsuitable decides
