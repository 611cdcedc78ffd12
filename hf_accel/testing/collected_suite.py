"""What ``pytest --hf-accel-backend NAME`` collects: the conformance class of each named backend's feature,
parametrized with the backends named for it (see :mod:`hf_accel.testing.pytest_plugin`)."""

from hf_accel.testing.pytest_plugin import requested_backends
from hf_accel.testing.suite import CONFORMANCE

for _feature, _names in requested_backends().items():
    _base = CONFORMANCE[_feature]
    _name = "Test" + _base.__name__.removesuffix("Conformance")
    globals()[_name] = type(_name, (_base,), {"__module__": __name__, "backends_from_option": tuple(_names)})
