"""One patch as a transaction: each feature's backend applied and verified against the model before it,
every change recorded so that a failure, or ``unpatch``, puts the model back exactly."""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import torch

from hf_accel.patching.backends import Backend, PatchContext
from hf_accel.patching.changes import Changes
from hf_accel.patching.errors import BackendUnavailableError, PatchError, VerificationError
from hf_accel.patching.features import FEATURE_NAMES, get_feature
from hf_accel.patching.registry import BackendRegistry
from hf_accel.patching.report import FeatureReport, PatchReport, Verification
from hf_accel.patching.state import STATE_ATTR, PatchState
from hf_accel.patching.verify import (
    LOSSLESS_TOLERANCE,
    LayerCheck,
    LayerMismatch,
    ProbeInputs,
    compare_logits,
    compare_tokens,
    execution_device,
    forward_logits,
    greedy_tokens,
)
from hf_accel.runtime.generation import make_patched_generate, run_generate

logger = logging.getLogger("hf_accel")

_OFF = (None, False)


def empty_report(model: torch.nn.Module) -> PatchReport:
    param = next(model.parameters(), None)
    try:
        device = str(execution_device(model))  # where it runs, not "meta" for an offloaded first layer
    except ValueError:
        device = str(param.device) if param is not None else "?"
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "?"
    return PatchReport(model=type(model).__name__, device=device, dtype=dtype,
                       features={name: FeatureReport(name) for name in FEATURE_NAMES})


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    return execution_device(model), next(model.parameters()).dtype  # meta weights keep their dtype


def undo_all(changes: list[Changes]) -> None:
    while changes:
        changes.pop().undo()


class Transaction:
    """Applies one feature after another, verifying each, and can roll all of them back."""

    def __init__(self, model, pm, registry: BackendRegistry, options: Mapping[str, Any], verify: bool,
                 arguments: Mapping[str, Any], strict: bool = False) -> None:
        device, dtype = _model_device_dtype(model)
        self.model = model
        self.registry = registry
        self.options = options
        self.verify = verify
        self.strict = strict
        self.state = PatchState(model=model, pm=pm, device=device, dtype=dtype, report=empty_report(model),
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
            raise _refusal(backend, verification, "Pass verify=False to keep it anyway, or choose another backend.")
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
            if self.strict:
                raise _refusal(chosen, verification, "strict=True turns this fallback into an error; pass "
                               "strict=False to let hf_accel try the next backend.")
            report.skip(chosen.name, f"failed verification ({verification} {verification.detail})".strip())
            available.remove(chosen)
        if not wanted:
            report.reason = f"no {feature} backend registered for {request!r}"
        else:
            report.reason = "no backend can serve this model here (see skipped)"
        if self.strict and request not in (True, "auto"):
            skipped = "; ".join(f"{s['backend']}: {s['reason']}" for s in report.skipped) or report.reason
            raise BackendUnavailableError(f"{feature}={request!r} found no backend ({skipped}); strict=True turns "
                                          "this fallback into an error", feature=feature)

    def _context(self, feature: str, request: Any, report: FeatureReport) -> PatchContext:
        return PatchContext(model=self.model, feature=feature, request=request, options=self.options,
                            state=self.state, changes=Changes(), report=report)

    def _apply(self, backend: Backend, context: PatchContext) -> Verification | None:
        probe = backend.probe if self.verify else None
        reference = self._reference_for(probe) if probe else None
        if probe:
            context.changes.check_replacement = LayerCheck(self.model, self._tolerance(backend))
        self.state.changes.append(context.changes)  # registered first, so a half-done apply is rolled back
        try:
            backend.apply(context)
        except LayerMismatch as mismatch:
            self.state.changes.pop().undo()
            context.report.verification = mismatch.verification()
            return context.report.verification
        except Exception as exc:
            raise PatchError(
                f"plugin {backend.plugin!r} failed in the {backend.feature} phase (backend {backend.name!r}): "
                f"{type(exc).__name__}: {exc}. The model was left unchanged.",
                feature=backend.feature, backend=backend.name, plugin=backend.plugin) from exc
        context.changes.check_replacement = None  # swaps made later (at commit, before a call) are not checked
        if probe is None:
            return None
        try:
            verification = self._check(backend, probe, reference)
        except Exception as exc:  # a backend that breaks the model fails verification; it does not crash patch()
            logger.debug("verification of %s raised", backend.name, exc_info=True)
            verification = Verification(probe=probe, passed=False,
                                        detail=f"the probe raised {type(exc).__name__}: {exc}")
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
        verification = compare_logits(reference, actual, self._tolerance(backend), inputs)
        if verification.passed:  # later phases compare against this model, not the original
            self._reference = {"forward": actual}
        return verification

    def _tolerance(self, backend: Backend) -> float:
        """The relative error ``backend`` may cause: its own for a lossy one, rounding for a lossless one."""
        if backend.tolerance is not None:
            return backend.tolerance
        return LOSSLESS_TOLERANCE.get(self.state.dtype, 3e-2)

    # -- install / rollback -----------------------------------------------------------------------------
    def install(self) -> None:
        changes = Changes()
        self.state.changes.append(changes)
        changes.setattr(self.model, STATE_ATTR, self.state)
        patched = make_patched_generate(self.model, self.state.original_generate)
        changes.setattr(self.model, "generate", patched)
        # copy.deepcopy, pickle and torch.save(model) look these up on the instance first
        refuse_copy = functools.partial(_refuse_copy, type(self.model).__name__)
        changes.setattr(self.model, "__deepcopy__", refuse_copy)
        changes.setattr(self.model, "__reduce_ex__", refuse_copy)

    def rollback(self) -> None:
        undo_all(self.state.changes)


def _refuse_copy(model_class: str, *_: Any) -> None:
    raise TypeError(
        f"hf_accel: a patched {model_class} cannot be copied or pickled: its patch holds compiled graphs, caches "
        "and plugins that belong to this instance. Copy the model before hf_accel.patch and patch the copy, or "
        "call hf_accel.unpatch(model) first; to store the model, use model.save_pretrained(...).")


def _refusal(backend: Backend, verification: Verification, what_to_do: str) -> VerificationError:
    """The error for a backend whose verification failed: the backend, where and by how much, what to do."""
    return VerificationError(
        f"{backend.feature}={backend.name!r} (plugin {backend.plugin!r}) changed the model's outputs: "
        f"{verification} {verification.detail}".rstrip() + f". {what_to_do}",
        feature=backend.feature, backend=backend.name, plugin=backend.plugin)


def _answers(backend: Backend, request: Any) -> bool:
    """Whether ``backend`` is a candidate for a non-name request: ``"auto"``/True, one of its variants, or an object."""
    if request is True or request == "auto":
        return True
    if isinstance(request, str):
        return request in backend.variants
    return True  # an object (e.g. a draft model): each backend's why_unsuitable decides
