"""hf_accel: one line to make a Hugging Face transformers model generate faster.

Example::

    import hf_accel
    model = hf_accel.patch(model)          # then model.generate(...) as before
    print(hf_accel.report(model))
"""

from .backends import Backend, Capabilities, Option, PatchContext
from .errors import BackendUnavailableError, PatchError, VerificationError
from .features import FEATURE_NAMES, FEATURES
from .hookspecs import hookimpl
from .patching import BackendStatus, available_backends, check_arguments, patch, report, unpatch
from .report import FeatureReport, PatchReport

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendStatus", "BackendUnavailableError", "Capabilities", "FEATURES", "FEATURE_NAMES",
    "FeatureReport", "Option", "PatchContext", "PatchError", "PatchReport", "VerificationError", "available_backends",
    "check_arguments",
    "hookimpl", "patch", "report", "unpatch",
]
