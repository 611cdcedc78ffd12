"""The pytest plugin (entry point ``pytest11``): ``pytest --hf-accel-backend NAME`` runs the conformance suite
of NAME's feature against it, for any installed backend. pytest loads it in every run where hf_accel is
installed, so it imports only pytest until the option is used."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The module collected when the option is given (see :func:`requested_features`).
SUITE_MODULE = Path(__file__).with_name("collected_suite.py")
#: The features of the backends named on the command line, set once the option has been read.
_requested: dict[str, list[str]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hf_accel", "hf_accel backend conformance")
    group.addoption("--hf-accel-backend", action="append", dest="hf_accel_backend", default=[], metavar="NAME",
                    help="run hf_accel's conformance suite against the registered backend NAME (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    names = config.getoption("hf_accel_backend")
    if not names:
        return
    from hf_accel.patching.plugin_manager import get_plugin_manager
    from hf_accel.patching.registry import BackendRegistry

    registry = BackendRegistry.collect(get_plugin_manager())
    unknown = [name for name in names if registry.get(name) is None]
    if unknown:
        known = ", ".join(sorted(b.name for b in registry))
        raise pytest.UsageError(f"--hf-accel-backend {', '.join(unknown)}: no backend of that name is registered "
                                f"(installed: {known}); install its plugin (`hf-accel plugins` lists what is loaded)")
    _requested.clear()
    for name in names:
        _requested.setdefault(registry.get(name).feature, []).append(name)
    if str(SUITE_MODULE) not in config.args:
        config.args.append(str(SUITE_MODULE))


def requested_backends() -> dict[str, list[str]]:
    """The backends named with ``--hf-accel-backend``, by feature."""
    return {feature: list(names) for feature, names in _requested.items()}
