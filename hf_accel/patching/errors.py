"""Errors that name the plugin, the phase and the fix."""

from __future__ import annotations


class PatchError(RuntimeError):
    """patch() failed; the model was restored to exactly what it was before the call."""

    def __init__(self, message: str, *, feature: str | None = None, backend: str | None = None,
                 plugin: str | None = None):
        super().__init__(message)
        self.feature = feature
        self.backend = backend
        self.plugin = plugin


class BackendUnavailableError(PatchError):
    """A backend was asked for by name but cannot run for this model on this machine."""


class VerificationError(PatchError):
    """A backend changed the model's outputs beyond what it promised."""
