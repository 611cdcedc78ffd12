"""A log of reversible edits to a model, undone in reverse order."""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import nn

logger = logging.getLogger(__name__)


class Changes:
    """Records each edit a backend makes so that it can be reverted, even when the backend fails half-way.

    Example::

        changes = Changes()
        changes.setattr(model.config, "_attn_implementation_internal", "eager")
        changes.undo()   # the config is as it was
    """

    def __init__(self, check_replacement: Callable[[nn.Module, str, nn.Module, nn.Module], None] | None = None) -> None:
        #: Called as ``check_replacement(parent, name, original, replacement)`` before a module is swapped in;
        #: raises to refuse it (the transaction compares their outputs: :class:`~hf_accel.patching.verify.LayerCheck`).
        self.check_replacement = check_replacement
        self._undos: list[Callable[[], None]] = []
        self._irreversible_on_commit: str | None = None
        self._on_commit: list[Callable[[], None]] = []
        self.irreversible: str | None = None

    def __len__(self) -> int:
        return len(self._undos)

    def __repr__(self) -> str:
        return f"<Changes: {len(self)} edits>"

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when these changes are undone (after every later edit has been reverted)."""
        self._undos.append(fn)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, restoring the old value (or its absence) on undo."""
        self._undos.append(_restorer(obj, name))
        setattr(obj, name, value)

    def set_submodule(self, parent: nn.Module, name: str, module: nn.Module) -> None:
        """Replace the child module ``parent.<name>``; the original comes back on undo, unless the user has put
        another module there since (``resize_token_embeddings``, pruning): that one stays. When verifying, the
        replacement is first checked against the original (see ``check_replacement``)."""
        if name not in parent._modules:
            raise KeyError(f"{type(parent).__name__} has no child module {name!r}")
        original = parent._modules[name]
        if self.check_replacement is not None:
            self.check_replacement(parent, name, original, module)
        self._undos.append(lambda: _put_back(parent, name, module, original))
        hook = getattr(original, "_hf_hook", None)
        if hook is not None and getattr(module, "_hf_hook", None) is None:
            # accelerate moves this module's inputs to its device (a device_map over several devices): the
            # replacement must keep doing so. Offloading hooks never get here: what replaces modules needs
            # whole weights in place, and offloaded models are refused that.
            from accelerate.hooks import add_hook_to_module

            add_hook_to_module(module, hook)
        setattr(parent, name, module)

    def mark_irreversible(self, reason: str) -> None:
        """Say that undoing cannot restore the model exactly (e.g. quantized weights without originals)."""
        self.irreversible = reason

    def forget_on_commit(self, reason: str) -> None:
        """Keep what undo needs only until patch() succeeds, then free it (e.g. the original fp32 weights a
        quantized model no longer needs); afterwards ``unpatch`` refuses with ``reason``."""
        self._irreversible_on_commit = reason

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once patch() has succeeded (e.g. free what the verification probe filled)."""
        self._on_commit.append(fn)

    def commit(self) -> None:
        """Called once patch() has succeeded."""
        for fn in self._on_commit:
            fn()
        self._on_commit.clear()
        if self._irreversible_on_commit is not None:
            self._undos.clear()
            self.mark_irreversible(self._irreversible_on_commit)

    def undo(self) -> None:
        """Revert every recorded edit, newest first. Keeps going past a failing step, then re-raises it."""
        first_error: BaseException | None = None
        while self._undos:
            try:
                self._undos.pop()()
            except BaseException as exc:  # noqa: BLE001 - keep restoring; report the first failure
                logger.exception("hf_accel: an undo step failed")
                first_error = first_error or exc
        if first_error is not None:
            raise first_error


_MISSING = object()


def _restorer(obj: Any, name: str) -> Callable[[], None]:
    if isinstance(obj, nn.Module) and any(name in d for d in (obj._modules, obj._parameters, obj._buffers)):
        old = getattr(obj, name)
        return lambda: setattr(obj, name, old)
    old = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
    if old is _MISSING:
        return lambda: _delete_if_present(obj, name)
    return lambda: setattr(obj, name, old)


def _delete_if_present(obj: Any, name: str) -> None:
    if name in vars(obj):
        delattr(obj, name)


def _put_back(parent: nn.Module, name: str, ours: nn.Module, original: nn.Module) -> None:
    if parent._modules.get(name) is ours:
        setattr(parent, name, original)
    else:
        logger.info("hf_accel: %s.%s was replaced after the patch; keeping the new module", type(parent).__name__, name)
