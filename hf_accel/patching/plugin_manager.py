"""The plugin manager, created on first use: the plugins of the ``hf_accel`` entry-point group that the environment
lets through (``HF_ACCEL_LOAD_PLUGINS``, ``HF_ACCEL_DISABLE_PLUGINS``), each broken one reported and skipped, and
every hook call traced under ``HF_ACCEL_TRACE``."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Iterable, Literal, Sequence

import pluggy

from hf_accel.patching import hookspecs
from hf_accel.patching.hookspecs import hookimpl
from hf_accel.runtime.generation import GenerateCall

if TYPE_CHECKING:
    from hf_accel.patching.backends import Backend, PatchContext

logger = logging.getLogger(__name__)
trace_logger = logging.getLogger("hf_accel.trace")

ENTRY_POINT_GROUP = "hf_accel"
CORE_PLUGIN = "hf_accel.core"
LOAD_VARIABLE = "HF_ACCEL_LOAD_PLUGINS"
DISABLE_VARIABLE = "HF_ACCEL_DISABLE_PLUGINS"
TRACE_VARIABLE = "HF_ACCEL_TRACE"
#: What HF_ACCEL_LOAD_PLUGINS replaced (it filtered built-ins too, which could leave a feature with no backend).
REPLACED_VARIABLE = "HF_ACCEL_PLUGINS"
#: The distribution whose entry points are the built-in plugins, normalized as in ``_normalized``.
OWN_DISTRIBUTION = "hf-accel"

Phase = Literal["load", "register", "backends"]
_PHASES: dict[str, str] = {"load": "importing it", "register": "registering its hooks",
                           "backends": "registering its backends"}


@dataclass(frozen=True)
class PluginOrigin:
    """The distribution that installed an entry-point plugin, and whether it is hf_accel's own (built-in)."""

    distribution: str
    version: str
    builtin: bool


@dataclass(frozen=True)
class PluginProblem:
    """An entry-point plugin (or one of its backends) that failed and was skipped; ``hf-accel plugins`` and
    ``hf-accel doctor`` list them.

    :param plugin: the entry point's name.
    :param distribution: the distribution that provides it; ``version`` its version.
    :param phase: ``"load"`` (importing it raised), ``"register"`` (pluggy refused its hook implementations) or
        ``"backends"`` (its ``hf_accel_register_backends`` raised, or a backend it registered was refused).
    :param error: the exception, as ``"Type: message"``.
    :param skipped: what was skipped when not the whole plugin (``"backend 'sdpa'"``); empty for the plugin.
    """

    plugin: str
    distribution: str
    version: str
    phase: Phase
    error: str
    skipped: str = ""

    def __str__(self) -> str:
        where = f"plugin {self.plugin!r} ({' '.join(filter(None, (self.distribution, self.version)))})"
        what = f"{where}: {self.skipped}" if self.skipped else where
        return f"{what} skipped while {_PHASES[self.phase]}: {' '.join(self.error.split())}"


@dataclass(frozen=True)
class PluginFilters:
    """What the environment says about plugins, read when the plugin manager is created.

    :param load: ``HF_ACCEL_LOAD_PLUGINS``: the third-party plugins to load (built-ins always load); None when
        unset (every installed plugin loads).
    :param disabled: ``HF_ACCEL_DISABLE_PLUGINS``: plugins never loaded, built-ins included.
    :param trace: ``HF_ACCEL_TRACE``: whether every hook call is logged to ``hf_accel.trace``.
    """

    load: frozenset[str] | None = None
    disabled: frozenset[str] = frozenset()
    trace: bool = False

    @classmethod
    def from_environment(cls) -> PluginFilters:
        if REPLACED_VARIABLE in os.environ:
            logger.warning("hf_accel: %s is no longer read; use %s=name1,name2 to load only these third-party "
                           "plugins (built-ins always load), or %s to leave plugins out", REPLACED_VARIABLE,
                           LOAD_VARIABLE, DISABLE_VARIABLE)
        load = _names_from_env(LOAD_VARIABLE)
        trace = os.environ.get(TRACE_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")
        return cls(load, _names_from_env(DISABLE_VARIABLE) or frozenset(), trace)

    def admits(self, name: str, builtin: bool) -> bool:
        """Whether the entry point ``name`` loads."""
        if name in self.disabled:
            return False
        return builtin or self.load is None or name in self.load


@dataclass
class Discovery:
    """What creating the process-wide plugin manager found: the filters it applied, where each loaded
    entry-point plugin comes from, what the filters left out, and the problems (more may be added when the
    plugins' backends are collected)."""

    filters: PluginFilters
    origins: dict[str, PluginOrigin] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    problems: list[PluginProblem] = field(default_factory=list)


_pm: pluggy.PluginManager | None = None
_discovery: Discovery | None = None
_lock = threading.RLock()  # one manager per process even when threads patch their first models at once


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built-in and third-party plugins alike), created on first call."""
    global _pm, _discovery
    with _lock:
        if _pm is None:
            _discovery = Discovery(PluginFilters.from_environment())
            _pm = _create_plugin_manager(_discovery)
        return _pm


def reset_plugin_manager() -> None:
    """Forget the plugin manager and its problems, so the next use re-reads entry points and the environment."""
    global _pm, _discovery
    with _lock:
        _pm = None
        _discovery = None


def plugin_discovery() -> Discovery:
    """What the process-wide plugin manager found when it was created (creating it if need be)."""
    get_plugin_manager()
    with _lock:
        assert _discovery is not None
        return _discovery


def plugin_problems() -> list[PluginProblem]:
    """The plugins, or plugins' backends, skipped so far because they failed."""
    return list(plugin_discovery().problems)


def plugin_origin(name: str) -> PluginOrigin | None:
    """Where the entry-point plugin registered as ``name`` comes from; None for a plugin passed in code."""
    return plugin_discovery().origins.get(name)


def report_backend_problem(plugin: str, error: BaseException, skipped: str = "") -> None:
    """Record and log that an entry-point plugin's backends (or the one named by ``skipped``) were left out."""
    origin = plugin_origin(plugin) or PluginOrigin("an unknown distribution", "", False)
    _report(_problem(plugin, origin, "backends", error, skipped))


def _create_plugin_manager(discovery: Discovery) -> pluggy.PluginManager:
    pm = _new_manager(discovery.filters.trace)
    installed = list(entry_points(group=ENTRY_POINT_GROUP))
    _warn_of_unknown_names(discovery, installed)
    for ep in installed:
        origin = _origin(ep)
        if discovery.filters.admits(ep.name, origin.builtin):
            _register_entry_point(pm, ep, origin, discovery)
        else:
            discovery.left_out.append(ep.name)
            logger.debug("hf_accel: plugin %s left out by %s / %s", ep.name, LOAD_VARIABLE, DISABLE_VARIABLE)
    # Last: of the trylast implementations, pluggy calls the last registered last, so the core's come after any
    # plugin's, trylast ones included (a plugin's fallback choice still precedes the core's plain ranking).
    pm.register(CoreHooks(), name=CORE_PLUGIN)
    return pm


def _register_entry_point(pm: pluggy.PluginManager, ep: EntryPoint, origin: PluginOrigin,
                          discovery: Discovery) -> None:
    """Load and register one plugin; a failure is reported and the plugin skipped, never raised: one broken
    plugin must not take ``patch`` or the other plugins down with it."""
    try:
        plugin = ep.load()
    except Exception as exc:
        _report(_problem(ep.name, origin, "load", exc), discovery)
        return
    try:
        pm.register(plugin, name=ep.name)
    except Exception as exc:
        if pm.get_plugin(ep.name) is plugin:  # a pluggy that registers before validating may leave a part behind
            pm.unregister(name=ep.name)
        _report(_problem(ep.name, origin, "register", exc), discovery)
        return
    discovery.origins[ep.name] = origin


def _warn_of_unknown_names(discovery: Discovery, installed: Sequence[EntryPoint]) -> None:
    if discovery.filters.load is None:
        return
    names = {ep.name for ep in installed}
    discovery.unknown = sorted(discovery.filters.load - names)
    if discovery.unknown:
        third_party = sorted(ep.name for ep in installed if not _origin(ep).builtin)
        logger.warning("hf_accel: %s names %s, which no installed plugin has; installed third-party plugins: %s",
                       LOAD_VARIABLE, ", ".join(map(repr, discovery.unknown)), ", ".join(third_party) or "none")


def _origin(ep: EntryPoint) -> PluginOrigin:
    dist = ep.dist
    if dist is None:
        return PluginOrigin("an unknown distribution", "", False)
    name = dist.name or "an unnamed distribution"
    return PluginOrigin(name, dist.version or "", _normalized(name) == OWN_DISTRIBUTION)


def _normalized(distribution: str) -> str:
    """A distribution name as packaging compares them: ``HF_Accel`` and ``hf.accel`` are ``hf-accel``."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _problem(plugin: str, origin: PluginOrigin, phase: Phase, error: BaseException,
             skipped: str = "") -> PluginProblem:
    return PluginProblem(plugin, origin.distribution, origin.version, phase, f"{type(error).__name__}: {error}",
                         skipped)


def _report(problem: PluginProblem, discovery: Discovery | None = None) -> None:
    """Keep ``problem`` and log it, once: backends are collected at every ``patch``."""
    discovery = discovery or plugin_discovery()
    with _lock:
        if problem in discovery.problems:
            return
        discovery.problems.append(problem)
    logger.warning("hf_accel: %s. Fix or update %s, or leave the plugin out with %s=%s (`hf-accel plugins` lists "
                   "every problem)", problem, problem.distribution, DISABLE_VARIABLE, problem.plugin)


def _names_from_env(variable: str) -> frozenset[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _new_manager(trace: bool) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("hf_accel")
    pm.add_hookspecs(hookspecs)
    if trace:
        pm.trace.root.setwriter(_write_trace)
        pm.enable_tracing()
        _make_trace_visible()
    return pm


def _write_trace(message: str) -> None:
    trace_logger.info("%s", message.rstrip("\n"))


def _make_trace_visible() -> None:
    """``HF_ACCEL_TRACE=1`` alone shows the trace: INFO unless the logger was given a level, and on stderr
    unless some handler up its chain takes it."""
    if trace_logger.level == logging.NOTSET:
        trace_logger.setLevel(logging.INFO)
    if not trace_logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        trace_logger.addHandler(handler)


def plugin_manager_with(plugins: Iterable[Any]) -> pluggy.PluginManager:
    """The process-wide plugin manager; with ``plugins``, a manager of their own that holds the process-wide
    plugins and these. A model patched with it keeps it, so its ``generate`` calls reach these plugins too,
    and the process-wide manager (other models, other threads) never sees them."""
    plugins = list(plugins)
    base = get_plugin_manager()
    if not plugins:
        return base
    pm = _new_manager(plugin_discovery().filters.trace)
    for name, plugin in base.list_name_plugin():
        pm.register(plugin, name=name)
    for plugin in plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin, name=_name_in_code(pm, plugin))  # a refusal is raised to the caller, not skipped
    return pm


def _name_in_code(pm: pluggy.PluginManager, plugin: Any) -> str:
    """A name for a plugin passed in code that says what it is (its module's or class's name), where pluggy's
    own would be its ``id``; numbered when taken."""
    base = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    name, number = base, 1
    while pm.has_plugin(name):
        number += 1
        name = f"{base}#{number}"
    return name


def plugin_names() -> list[str]:
    """Names of the registered plugins, the core excluded."""
    pm = get_plugin_manager()
    return sorted(name for name, _ in pm.list_name_plugin() if name != CORE_PLUGIN)


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
