"""Tiny random causal LMs built from configs (no download) and the prompts the conformance suite feeds them."""

from __future__ import annotations

from typing import Any

import torch
import transformers

VOCAB = 512
#: Per architecture: the config class and what differs from the shared tiny shape. Together they cover
#: grouped-query attention (all but gpt2), sliding windows (mistral, gemma2), logit soft-capping (gemma2),
#: a head dimension other than hidden/heads (qwen3, gemma2), fused projections (phi3) and Conv1D (gpt2).
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "head_dim": 16, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512,
                            "num_key_value_heads": None}),  # multi-head attention, as GPT-2's own configs
}
_SHARED = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: Prompt shapes by name: the lengths of a batch's rows (left-padded to the longest). The long prompt is
#: past the sliding windows above and several chunks of a chunked kernel.
PROMPTS: dict[str, tuple[int, ...]] = {
    "batch3-left-padded": (7, 3, 5),
    "length1": (1,),
    "batch2-unpadded": (9, 9),  # no padding: transformers may pass no mask, and the kernel's causal rule applies
    "long-left-padded": (200, 40, 120),
}


def make_tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **config_overrides: Any) -> transformers.PreTrainedModel:
    """A freshly initialised 2-layer model of this architecture, in eval mode, with its own config
    (``config_overrides`` set on it first: other sizes, tied embeddings; set on the built config, so fields it
    derived, such as ``head_dim`` or ``layer_types``, keep their values).

    Example::

        model = make_tiny_model("gemma2")          # sliding window and soft-capping, 512-token vocabulary
        odd = make_tiny_model("llama", intermediate_size=136)    # an MLP no int4 kernel takes
    """
    config = tiny_config(arch)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def left_padded_batch(model: transformers.PreTrainedModel, lengths: tuple[int, ...] = (7, 3, 5),
                      seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (below :data:`VOCAB`) and attention mask of a left-padded batch whose rows have these lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), model.generation_config.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    """The configuration :func:`make_tiny_model` builds ``arch`` from."""
    class_name, overrides = TINY_ARCHITECTURES[arch]
    settings = {key: value for key, value in {**_SHARED, **overrides}.items() if value is not None}
    return getattr(transformers, class_name)(**settings)
