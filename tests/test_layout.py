"""The layout's rules (docs/architecture.md): plugins reach hf_accel only through the plugin API, the core names no
backend, the library never imports its tooling, generate time never imports the patch pipeline, modules stay
small, and the linter is clean."""

from __future__ import annotations

import ast
import importlib
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_accel
from hf_accel.patching.plugin_manager import get_plugin_manager
from hf_accel.patching.registry import BackendRegistry

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "hf_accel"
PLUGINS = ROOT / "plugins"

#: Strings in the core that name a backend but mean something else (transformers' and torch's own names):
#: (backend name, file, the whole string).
NOT_BACKENDS = {
    ("static", "tools/bench/steady.py", "static"): "transformers' cache_implementation, the native configuration",
    ("eager", "tools/bench/attention.py", "eager"): "transformers' eager attention function",
    ("inductor", "tools/bench/cold.py", "inductor"): "torch inductor's default cache directory, kept apart",
    ("inductor", "runtime/compile_cache.py", "inductor"): "where the compile store's format 1 kept code; cleared",
    ("eager", "testing/suite.py", "eager"): "transformers' eager attention, the reference attention is checked against",
    ("draft_model", "testing/suite.py", "draft_model"): "the patch() option a drafter backend may declare",
}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included), each name of a ``from``
    import too (it may be a module: ``from hf_accel_plugins import quantize_int4``), relative ones resolved."""
    package = "hf_accel_plugins" if path.is_relative_to(PLUGINS) else ".".join(
        ("hf_accel", *path.relative_to(LIBRARY).parent.parts)) if path.is_relative_to(LIBRARY) else path.parent.name
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return modules


def entry_point_plugins() -> set[str]:
    """The built-in plugin modules setup.cfg registers in the ``hf_accel`` entry-point group."""
    section = ROOT.joinpath("setup.cfg").read_text().split("\nhf_accel =\n", 1)[1]
    lines = itertools.takewhile(lambda line: line.startswith("    "), section.splitlines())
    return {line.split("=")[1].strip() for line in lines if "=" in line}


def test_plugins_import_hf_accel_only_through_the_plugin_api_and_no_other_plugin():
    import hf_accel.plugin

    api = {"hf_accel.plugin", *(f"hf_accel.plugin.{name}" for name in hf_accel.plugin.__all__)}
    wrong = {f"{path.name}: {module}" for path in python_files(PLUGINS) for module in imported_modules(path)
             if (module == "hf_accel" or module.startswith("hf_accel.")) and module not in api}
    assert not wrong, f"plugins import hf_accel modules other than hf_accel.plugin: {sorted(wrong)}"
    plugins = entry_point_plugins()
    assert {"hf_accel_plugins.compile_inductor", "hf_accel_plugins.quantize_int4"} <= plugins
    crossing = {f"{path.name}: {module}" for path in python_files(PLUGINS) for module in imported_modules(path)
                if module in plugins}
    assert not crossing, f"plugins import each other (shared code goes in a helper module): {sorted(crossing)}"


def test_the_plugin_template_imports_hf_accel_only_through_the_plugin_api():
    template = ROOT / "examples" / "plugin_template"
    def outside(module: str, allowed: tuple[str, ...]) -> bool:
        return module.split(".")[0] == "hf_accel" and not any(module == a or module.startswith(a + ".")
                                                               for a in allowed)

    wrong = {f"{path.name}: {module}" for path in python_files(template / "hf_accel_example")
             for module in imported_modules(path) if outside(module, ("hf_accel.plugin",))}
    wrong |= {f"tests/{path.name}: {module}" for path in python_files(template / "tests")
              for module in imported_modules(path) if outside(module, ("hf_accel.plugin", "hf_accel.testing"))}
    assert not wrong, f"the template imports hf_accel modules other than hf_accel.plugin: {sorted(wrong)}"
    assert "hf_accel.plugin" in {m for p in python_files(template / "hf_accel_example") for m in imported_modules(p)}


@pytest.mark.parametrize("package", ["hf_accel", "hf_accel.testing"])
def test_every_name_a_lazy_package_exports_is_there(package):
    module = importlib.import_module(package)
    assert set(module.__all__) == set(module._EXPORTS) | ({"__version__"} if package == "hf_accel" else set())
    assert all(getattr(module, name) is not None for name in module.__all__)


def test_every_name_the_plugin_api_exports_is_there():
    import hf_accel.plugin

    missing = [name for name in hf_accel.plugin.__all__ if not hasattr(hf_accel.plugin, name)]
    assert not missing and len(set(hf_accel.plugin.__all__)) == len(hf_accel.plugin.__all__)


def test_the_core_names_no_registered_backend():
    backends = [status.name for status in hf_accel.available_backends()]
    assert {"inductor", "onednn_prepack", "ngram", "static", "sdpa_flash", "self_int4"} <= set(backends)  # it bites
    registry = BackendRegistry.collect(get_plugin_manager())
    names = set(backends) | {variant for backend in registry for variant in backend.variants}
    found, excused = set(), set()
    for path in python_files(LIBRARY):
        relative = path.relative_to(LIBRARY).as_posix()
        tree = ast.parse(path.read_text())
        prose = {id(node) for node in prose_strings(tree)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in prose:
                continue
            for name in names:
                if names_backend(node.value, name):
                    if (name, relative, node.value) in NOT_BACKENDS:
                        excused.add((name, relative, node.value))
                    else:
                        found.add(f"{relative}:{node.lineno}: {node.value!r}")
    assert not found, f"the core names backends (it should find them through the registry): {sorted(found)}"
    assert excused == set(NOT_BACKENDS), f"excuses no longer needed: {sorted(set(NOT_BACKENDS) - excused)}"


def names_backend(text: str, name: str) -> bool:
    """The string is the name, a list of names (``"int8,int4"``), or sets or quotes it (``compile=name``)."""
    listed = text.split(",") if " " not in text else [text]
    return name in listed or any(form in text for form in (f"={name}", f"'{name}'", f"`{name}`", f'"{name}"'))


def prose_strings(tree: ast.AST) -> list[ast.Constant]:
    """Docstrings and argparse ``help=`` texts: where a user-facing example may name a backend."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.append(first.value)
        if isinstance(node, ast.keyword) and node.arg == "help":
            found += [n for n in ast.walk(node.value) if isinstance(n, ast.Constant)]
    return found


def test_the_library_never_imports_its_tooling():
    wrong = {f"{path.relative_to(LIBRARY)}: {module}" for path in python_files(LIBRARY)
             if path.relative_to(LIBRARY).parts[0] != "tools"
             for module in imported_modules(path) if module.startswith("hf_accel.tools")}
    assert not wrong, sorted(wrong)


def test_generate_time_never_imports_the_patch_pipeline():
    pipeline = ("hf_accel.patching.api", "hf_accel.patching.transaction", "hf_accel.patching.plugin_manager",
                "hf_accel.patching.hookspecs")
    wrong = {f"{path.relative_to(LIBRARY)}: {module}" for path in python_files(LIBRARY / "runtime")
             for module in imported_modules(path) if module.startswith(pipeline) or module == "hf_accel"}
    assert not wrong, sorted(wrong)


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files(LIBRARY) + python_files(PLUGINS)
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_linter_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: `pip install -e '.[dev]'` (the dev extras) installs it")
    done = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
