"""``hf-accel plugins``: each loaded plugin, where it comes from, its backends and hooks; the plugins skipped
because they failed; and the environment's filters."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import pluggy

from hf_accel.patching import plugin_manager as manager
from hf_accel.patching.registry import BackendRegistry

IN_CODE = "(registered in code)"
#: Each variable, and what leaving it unset means.
VARIABLES = {manager.LOAD_VARIABLE: "every installed plugin loads", manager.DISABLE_VARIABLE: "none disabled",
             manager.TRACE_VARIABLE: "hook calls are not traced"}


@dataclass(frozen=True)
class PluginRow:
    """One loaded plugin, as listed."""

    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    backends: list[dict[str, str]]
    hooks: list[str]


def plugin_rows(pm: pluggy.PluginManager) -> list[PluginRow]:
    """Every plugin ``pm`` holds, the core's own hooks excluded: built-ins first, then by name."""
    registry = BackendRegistry.collect(pm)  # first: it reports the plugins whose backends fail
    rows = []
    for name, plugin in pm.list_name_plugin():
        if name == manager.CORE_PLUGIN or plugin is None:
            continue
        origin = manager.plugin_origin(name)
        backends = [{"name": b.name, "feature": b.feature} for b in registry if b.plugin == name]
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())
        rows.append(PluginRow(name, origin and origin.distribution, origin and origin.version,
                              bool(origin and origin.builtin), backends, hooks))
    return sorted(rows, key=lambda row: (not row.builtin, row.name))


def environment(discovery: manager.Discovery) -> dict[str, Any]:
    """The filters in effect: each variable's value (None when unset), what they left out, and the names
    ``HF_ACCEL_LOAD_PLUGINS`` gives that no installed plugin has."""
    values = {variable: os.environ.get(variable) for variable in VARIABLES}
    return {**values, "left_out": sorted(discovery.left_out), "unknown": list(discovery.unknown)}


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = plugin_rows(manager.get_plugin_manager())
    discovery = manager.plugin_discovery()
    if args.json:
        print(json.dumps({"plugins": [asdict(row) for row in rows],
                          "problems": [asdict(problem) for problem in discovery.problems],
                          "environment": environment(discovery)}, indent=2))
        return 0
    _print_plugins(rows)
    print("\nproblems (plugins or backends skipped):" if discovery.problems else "\nproblems: none")
    for problem in discovery.problems:
        print(f"  {problem}")
    _print_environment(environment(discovery))
    return 0


def _print_plugins(rows: list[PluginRow]) -> None:
    print(f"{len(rows)} plugins loaded:")
    for row in rows:
        kind = "built-in" if row.builtin else "third-party"
        source = f"{row.distribution} {row.version}, {kind}" if row.distribution else IN_CODE
        backends = ", ".join(f"{b['name']} ({b['feature']})" for b in row.backends) or "none"
        print(f"  {row.name}  [{source}]")
        print(f"      backends: {backends}")
        print(f"      hooks: {', '.join(row.hooks) or 'none'}")


def _print_environment(values: dict[str, Any]) -> None:
    print("\nenvironment:")
    for variable, unset in VARIABLES.items():
        value = values[variable]
        print(f"  {variable}: {f'unset ({unset})' if value is None else repr(value)}")
    if values["left_out"]:
        print(f"  left out by these: {', '.join(values['left_out'])}")
    if values["unknown"]:
        print(f"  named in {manager.LOAD_VARIABLE} but not installed: {', '.join(values['unknown'])}")
