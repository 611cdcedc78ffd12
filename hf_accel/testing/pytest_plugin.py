"""The pytest plugin (entry point ``pytest11``): ``pytest --hf-accel-backend NAME`` runs the conformance suite
of NAME's feature against it, for any installed backend. Loaded in every pytest run where hf_accel is
installed, so it imports nothing heavy until the option is used."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The module collected when the option is given: one class per feature, parametrized by the names given.
SUITE_MODULE = Path(__file__).with_name("collected_suite.py")


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
    if str(SUITE_MODULE) not in config.args:
        config.args.append(str(SUITE_MODULE))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the suite's tests for features no named backend serves (pytest made each one item that would skip
    for its empty parameter set)."""
    if not config.getoption("hf_accel_backend"):
        return
    empty = [item for item in items if item.path.samefile(SUITE_MODULE) and _unparametrized(item)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        dropped = set(empty)
        items[:] = [item for item in items if item not in dropped]


def _unparametrized(item: pytest.Item) -> bool:
    skip = item.get_closest_marker("skip")
    return skip is not None and str(skip.kwargs.get("reason", "")).startswith("got empty parameter set")
