"""Tiny random models built from configs (no download), and the real SmolLM2 model for slow tests."""

from __future__ import annotations

import pytest
import torch

from hf_accel.patching.plugin_manager import reset_plugin_manager
from hf_accel.testing.models import TINY_ARCHITECTURES, VOCAB, left_padded_batch, make_tiny_model  # noqa: F401


@pytest.fixture(params=sorted(TINY_ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return make_tiny_model(arch)


@pytest.fixture
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_of_the_session(tmp_path_factory):
    """Compiled graphs persist in a directory of this test session's, never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ACCEL_CACHE", str(tmp_path_factory.mktemp("hf_accel_cache")))
        yield


@pytest.fixture(autouse=True)
def _fresh_plugin_manager(monkeypatch):
    """Each test sees the plugins as installed, unaffected by another test's environment or registrations."""
    for variable in ("HF_ACCEL_LOAD_PLUGINS", "HF_ACCEL_DISABLE_PLUGINS", "HF_ACCEL_TRACE", "HF_ACCEL_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, loaded once per session."""
    from hf_accel.tools.models import load_default_model

    model, tokenizer = load_default_model()
    return model, tokenizer


def state_dict_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
