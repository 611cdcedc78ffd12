"""hf_accel: one line to make a Hugging Face transformers model generate faster.

Example::

    import hf_accel
    model = hf_accel.patch(model)          # then model.generate(...) as before
    print(hf_accel.report(model))

Plugin authors: everything a backend needs is in :mod:`hf_accel.plugin` (the names re-exported here for
plugins, ``Backend`` to ``hookimpl``, stay for those written against them).

The names below are imported on first use, so ``import hf_accel`` alone (the ``hf-accel`` command, the pytest
plugin every pytest run loads) does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_accel.version import __version__

#: Each public name and the module it comes from.
_EXPORTS = {
    **dict.fromkeys(("BackendStatus", "available_backends", "check_arguments", "patch", "report", "unpatch"),
                    "hf_accel.patching.api"),
    **dict.fromkeys(("Backend", "Capabilities", "Option", "PatchContext"), "hf_accel.patching.backends"),
    **dict.fromkeys(("BackendUnavailableError", "PatchError", "VerificationError"), "hf_accel.patching.errors"),
    **dict.fromkeys(("FEATURE_NAMES", "FEATURES"), "hf_accel.patching.features"),
    "hookimpl": "hf_accel.patching.hookspecs",
    **dict.fromkeys(("FeatureReport", "PatchReport"), "hf_accel.patching.report"),
}

__all__ = [
    "Backend", "BackendStatus", "BackendUnavailableError", "Capabilities", "FEATURES", "FEATURE_NAMES",
    "FeatureReport", "Option", "PatchContext", "PatchError", "PatchReport", "VerificationError", "available_backends",
    "__version__", "check_arguments", "hookimpl", "patch", "report", "unpatch",
]

if TYPE_CHECKING:
    from hf_accel.patching.api import BackendStatus, available_backends, check_arguments, patch, report, unpatch
    from hf_accel.patching.backends import Backend, Capabilities, Option, PatchContext
    from hf_accel.patching.errors import BackendUnavailableError, PatchError, VerificationError
    from hf_accel.patching.features import FEATURE_NAMES, FEATURES
    from hf_accel.patching.hookspecs import hookimpl
    from hf_accel.patching.report import FeatureReport, PatchReport


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
