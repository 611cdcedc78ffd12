"""Tiny random models built from configs (no download), and the real SmolLM2 model for slow tests."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_accel.patching.plugin_manager import reset_plugin_manager

VOCAB = 512
#: Per architecture: the config class and what differs from the shared tiny shape.
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "head_dim": 16, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
}
_SHARED = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """A freshly initialised 2-layer model of this architecture, in eval mode, with its own config."""
    class_name, overrides = TINY_ARCHITECTURES[arch]
    config = getattr(transformers, class_name)(**{**_SHARED, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


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
    monkeypatch.delenv("HF_ACCEL_PLUGINS", raising=False)
    monkeypatch.delenv("HF_ACCEL_DISABLE_PLUGINS", raising=False)
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


def left_padded_batch(model, lengths=(7, 3, 5), seed: int = 1):
    """A left-padded batch with rows of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), model.generation_config.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask

