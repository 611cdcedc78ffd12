"""The plugin manager, created on first use, loading every plugin of the ``hf_accel`` entry-point group."""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import pluggy

from hf_accel.patching import hookspecs
from hf_accel.patching.hookspecs import hookimpl
from hf_accel.runtime.generation import GenerateCall

if TYPE_CHECKING:
    from hf_accel.patching.backends import Backend, PatchContext

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hf_accel"
_pm: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built-in and third-party plugins alike), created on first call."""
    global _pm
    if _pm is None:
        _pm = _create_plugin_manager()
    return _pm


def reset_plugin_manager() -> None:
    """Forget the plugin manager, so the next use re-reads entry points and the environment filters."""
    global _pm
    _pm = None


def _create_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("hf_accel")
    pm.add_hookspecs(hookspecs)
    pm.register(CoreHooks(), name="hf_accel.core")
    for name, plugin in _entry_point_plugins():
        pm.register(plugin, name=name)
    return pm


def _entry_point_plugins() -> Iterator[tuple[str, Any]]:
    only = _names_from_env("HF_ACCEL_PLUGINS")
    disabled = _names_from_env("HF_ACCEL_DISABLE_PLUGINS") or set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if (only is not None and ep.name not in only) or ep.name in disabled:
            logger.debug("hf_accel: plugin %s filtered out by the environment", ep.name)
            continue
        try:
            yield ep.name, ep.load()
        except Exception as exc:  # a broken third-party plugin must not break every patch
            logger.warning("hf_accel: could not load plugin %r (%s): %s", ep.name, ep.value, exc)


def _names_from_env(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def plugin_manager_with(plugins: Iterable[Any]) -> pluggy.PluginManager:
    """The process-wide plugin manager; with ``plugins``, a manager of their own that holds the process-wide
    plugins and these. A model patched with it keeps it, so its ``generate`` calls reach these plugins too,
    and the process-wide manager (other models, other threads) never sees them."""
    plugins = list(plugins)
    base = get_plugin_manager()
    if not plugins:
        return base
    pm = pluggy.PluginManager("hf_accel")
    pm.add_hookspecs(hookspecs)
    for name, plugin in base.list_name_plugin():
        pm.register(plugin, name=name)
    for plugin in plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin)
    return pm


def plugin_names() -> list[str]:
    """Names of the registered plugins, the core excluded."""
    pm = get_plugin_manager()
    return sorted(name for name, _ in pm.list_name_plugin() if name != "hf_accel.core")


class CoreHooks:
    """The core's own hook implementations; each runs last, so any plugin can take precedence."""

    @hookimpl(trylast=True)
    def hf_accel_generate(self, call: GenerateCall) -> Any:
        runner = call.state.runner
        return runner(call) if runner is not None else call.run_stock()

    @hookimpl(trylast=True)
    def hf_accel_select_backend(self, feature: str, candidates: Sequence[Backend],
                                context: PatchContext) -> Backend | None:
        return candidates[0] if candidates else None  # the best by priority
