"""The docs stay in step with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from hf_accel.patching import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs"


def hookspec_functions():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("hf_accel_") and callable(fn)}


def test_every_hookspec_is_documented_with_its_parameters():
    text = (DOCS / "hooks.md").read_text()
    sections = dict(re.findall(r"^## (hf_accel_\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    specs = hookspec_functions()
    assert specs, "no hookspecs found"
    assert set(sections) == set(specs), "docs/hooks.md and hf_accel/patching/hookspecs.py list different hooks"
    for name, fn in specs.items():
        for param in inspect.signature(fn).parameters:
            assert f"`{param}`" in sections[name], f"{name}: parameter {param!r} undocumented"


def test_every_hookspec_is_prefixed_typed_and_documented_in_code():
    for name, fn in hookspec_functions().items():
        assert fn.__doc__ and ":param" in fn.__doc__, name
        assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(fn).parameters.values())


ROOT = DOCS.parent
RUNNABLE = re.compile(r"^```python run\n(.*?)^```", flags=re.M | re.S)


def runnable_blocks():
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for number, code in enumerate(RUNNABLE.findall(path.read_text()), start=1):
            yield pytest.param(code, id=f"{path.name}#{number}")


@pytest.mark.parametrize("code", list(runnable_blocks()))
def test_runnable_code_blocks_run(code):
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})


def test_docs_have_runnable_blocks():
    assert len(list(runnable_blocks())) >= 2
