"""The registry: every backend the registered plugins offer, by name, collected through the
``hf_accel_register_backends`` hook (a broken entry-point plugin reported and left out)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable, Mapping

import pluggy

from hf_accel.patching.backends import Backend, Option
from hf_accel.patching.plugin_manager import PluginOrigin, plugin_origin, report_backend_problem


class BackendRegistry:
    """The backends all registered plugins offer, by name."""

    def __init__(self, backends: Mapping[str, Backend]) -> None:
        self._backends = dict(backends)

    @classmethod
    def collect(cls, pm: pluggy.PluginManager) -> BackendRegistry:
        """The backends every plugin registers. An entry-point plugin whose hook raises (or registers something
        not a ``Backend``) has all its backends left out, one registering a name already taken that backend; each
        is reported (``plugin_problems``), not raised. Built-ins' backends come first, so they keep their names,
        then the first loaded's. A plugin passed in code gets the error raised: its caller wants to know."""
        backends: dict[str, Backend] = {}
        impls = pm.hook.hf_accel_register_backends.get_hookimpls()
        for impl in sorted(impls, key=lambda impl: _precedence(plugin_origin(impl.plugin_name))):
            if plugin_origin(impl.plugin_name) is None:
                for backend in _registered_by(pm, impl):
                    _add(backends, backend)
            else:
                _collect_entry_point(pm, impl, backends)
        return cls(backends)

    def __iter__(self):
        return iter(self._backends.values())

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def for_feature(self, feature: str) -> list[Backend]:
        """This feature's backends, highest priority first."""
        found = [b for b in self._backends.values() if b.feature == feature]
        return sorted(found, key=lambda b: -b.priority)

    def valid_requests(self, feature: str) -> list[str]:
        """Every string a user may pass for this feature."""
        values = {"auto"}
        for backend in self.for_feature(feature):
            values.add(backend.name)
            values.update(backend.variants)
        return sorted(values)

    def option_names(self) -> set[str]:
        return {name for backend in self for name in backend.options}

    def option_problem(self, name: str, value: Any) -> str | None:
        """Why ``patch(..., name=value)`` is not valid for every backend that declares the option, or None."""
        for backend in self:
            spec = backend.options.get(name)
            if isinstance(spec, Option) and not spec.accepts(value):
                return f"expected {spec.expected} (backend {backend.name!r})"
        return None


def _precedence(origin: PluginOrigin | None) -> int:
    """Built-in plugins first, then other entry points, then plugins passed in code."""
    return 2 if origin is None else 0 if origin.builtin else 1


class _Register:
    """The ``register`` one plugin's hook is called with; it names the plugin in ``HF_ACCEL_TRACE``'s trace."""

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin
        self.offered: list[Backend] = []

    def __call__(self, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"plugin {self.plugin!r} registered {backend!r}; expected an hf_accel.Backend")
        self.offered.append(replace(backend, plugin=self.plugin))

    def __repr__(self) -> str:
        return f"<register for plugin {self.plugin!r}>"


def _registered_by(pm: pluggy.PluginManager, impl: pluggy.HookImpl) -> list[Backend]:
    """What one plugin's ``hf_accel_register_backends`` registers, called through pluggy (so ``HF_ACCEL_TRACE``
    shows it) with only that plugin's implementation."""
    register = _Register(impl.plugin_name)
    hook = pm.hook.hf_accel_register_backends
    if all(isinstance(other.plugin, Hashable) for other in hook.get_hookimpls()):  # pluggy sets them apart in a set
        others = [other.plugin for other in hook.get_hookimpls() if other.plugin is not impl.plugin]
        pm.subset_hook_caller(hook.name, others)(register=register)
    else:
        impl.function(register=register)
    return register.offered


def _collect_entry_point(pm: pluggy.PluginManager, impl: pluggy.HookImpl, backends: dict[str, Backend]) -> None:
    """Add an entry-point plugin's backends, reporting (not raising) what fails."""
    try:
        offered = _registered_by(pm, impl)
    except Exception as exc:  # a broken third-party plugin must not break every patch
        report_backend_problem(impl.plugin_name, exc)
        return
    for backend in offered:
        clash = _clash(backends, backend)
        if clash:
            kept = backends[backend.name].plugin
            report_backend_problem(impl.plugin_name, ValueError(
                f"{clash}; {kept!r} keeps it (built-in plugins' backends come first, then the first loaded's)"),
                skipped=f"backend {backend.name!r}")
        else:
            backends[backend.name] = backend


def _add(backends: dict[str, Backend], backend: Backend) -> None:
    """Add a backend of a plugin passed in code; a name already taken is raised, to the code that passed it."""
    clash = _clash(backends, backend)
    if clash:
        raise ValueError(f"{clash}; rename one, or disable one with HF_ACCEL_DISABLE_PLUGINS")
    backends[backend.name] = backend


def _clash(backends: Mapping[str, Backend], backend: Backend) -> str | None:
    """Why ``backend`` cannot be added: another plugin's backend has its name; None when the name is free."""
    other = backends.get(backend.name)
    if other is None:
        return None
    return f"Backend name {backend.name!r} is registered by both {other.plugin!r} and {backend.plugin!r}"
