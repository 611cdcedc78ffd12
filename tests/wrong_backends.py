"""Three deliberately wrong backends, a plugin of the ``hf_accel`` entry-point group in tests: the conformance
suite must fail each with a readable message, and patch-time validation must refuse the first two.

- ``no_causal_mask``: attention that keeps the padding mask but lets every token see the tokens after it;
- ``zeroing_int8``: a "quantizer" that replaces one MLP projection with zeros (declaring a 0.1 tolerance);
- ``biased_drafter``: a drafter that samples its tokens uniformly but reports other probabilities, so the
  loop's acceptance rule corrects for the wrong distribution (greedy output stays exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import sdpa_mask

from hf_accel.plugin import (
    Backend,
    Draft,
    DraftLength,
    hookimpl,
    install_runner,
    linear_children,
    register_implementation,
    set_attention,
)

NO_CAUSAL = "hf_accel_test_no_causal"


def attention_without_causal_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = attention_mask[..., : key.shape[-2]].any(dim=-2, keepdim=True)  # padding only
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_attention_without_causal_mask(context):
    register_implementation(NO_CAUSAL, attention_without_causal_mask, sdpa_mask)
    set_attention(context, NO_CAUSAL)


def zero_one_projection(context):
    for parent, name, qualified, linear in list(linear_children(context.model)):
        if qualified.endswith("layers.0.mlp.down_proj") or qualified.endswith("h.0.mlp.c_proj"):
            zeros = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            nn.init.zeros_(zeros.weight)
            if zeros.bias is not None:
                nn.init.zeros_(zeros.bias)
            context.changes.set_submodule(parent, name, zeros)


class BiasedDrafter:
    """Draws each draft token uniformly, but tells the loop it drew it from ``CLAIMED``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(0)

    def start(self, loop):
        pass

    def propose(self, loop, k):
        batch = len(loop.rows)
        tokens = torch.randint(0, self.vocab, (batch, k), generator=self.generator)
        claimed = torch.full((batch, k, self.vocab), 0.1 / max(self.vocab - 1, 1))
        claimed[..., 0] = 0.9
        return Draft(tokens, torch.full((batch,), k), probs=claimed)

    def accepted(self, loop, draft, kept):
        pass


def install_biased_drafter(context):
    vocab = context.model.config.vocab_size
    install_runner(context, lambda model, config: BiasedDrafter(vocab), DraftLength(k=2, low=2, high=2))


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(name="no_causal_mask", feature="attention", apply=use_attention_without_causal_mask))
    register(Backend(name="zeroing_int8", feature="quantize", apply=zero_one_projection, lossless=False,
                     tolerance=0.1))
    register(Backend(name="biased_drafter", feature="speculative", apply=install_biased_drafter, probe="generate"))
