"""The docs stay in step with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from hf_accel import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs"


def hookspec_functions():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("hf_accel_") and callable(fn)}


def test_every_hookspec_is_documented_with_its_parameters():
    text = (DOCS / "hooks.md").read_text()
    sections = dict(re.findall(r"^## (hf_accel_\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    specs = hookspec_functions()
    assert specs, "no hookspecs found"
    assert set(sections) == set(specs), "docs/hooks.md and hf_accel/hookspecs.py list different hooks"
    for name, fn in specs.items():
        for param in inspect.signature(fn).parameters:
            assert f"`{param}`" in sections[name], f"{name}: parameter {param!r} undocumented"


def test_every_hookspec_is_prefixed_typed_and_documented_in_code():
    for name, fn in hookspec_functions().items():
        assert fn.__doc__ and ":param" in fn.__doc__, name
        assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(fn).parameters.values())
