"""hf_accel: one line to make a Hugging Face transformers model generate faster.

Example::

    import hf_accel
    model = hf_accel.patch(model)          # then model.generate(...) as before
    print(hf_accel.report(model))

Plugin authors: everything a backend needs is in :mod:`hf_accel.plugin` (the names re-exported here for
plugins, ``Backend`` to ``hookimpl``, stay for those written against them).
"""

from hf_accel.patching.api import BackendStatus, available_backends, check_arguments, patch, report, unpatch
from hf_accel.patching.backends import Backend, Capabilities, Option, PatchContext
from hf_accel.patching.errors import BackendUnavailableError, PatchError, VerificationError
from hf_accel.patching.features import FEATURE_NAMES, FEATURES
from hf_accel.patching.hookspecs import hookimpl
from hf_accel.patching.report import FeatureReport, PatchReport
from hf_accel.version import __version__

__all__ = [
    "Backend", "BackendStatus", "BackendUnavailableError", "Capabilities", "FEATURES", "FEATURE_NAMES",
    "FeatureReport", "Option", "PatchContext", "PatchError", "PatchReport", "VerificationError", "available_backends",
    "__version__", "check_arguments", "hookimpl", "patch", "report", "unpatch",
]
