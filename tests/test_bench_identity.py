"""``hf-accel identity``: the prompt set, mixed batches, and a comparison that notices a changed token."""

from __future__ import annotations

import torch
from conftest import VOCAB, make_tiny_model

import hf_accel
from hf_accel.tools.bench.identity import identity_prompts, mixed_batches, run_identity


class ByteTokenizer:
    """Bytes as token ids (3..258 folded into the tiny vocabulary), left padding with id 0."""

    pad_token_id, eos_token_id, chat_template, padding_side = 0, 2, None, "left"

    def __call__(self, texts, return_tensors="pt", padding=True, **kwargs):
        rows = [[3 + b % (VOCAB - 3) for b in text.encode()][:40] for text in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        return {"input_ids": ids, "attention_mask": (torch.arange(width) >= width - torch.tensor(
            [len(r) for r in rows])[:, None]).long()}


def test_the_identity_set_has_at_least_50_varied_prompts_and_batches_mix_lengths():
    prompts = identity_prompts()
    assert len(prompts) >= 50 and {p.category for p in prompts} == {"chat", "code", "edit", "long"}
    assert min(len(p.prompt) for p in prompts if p.category == "long") > 400
    batches = mixed_batches(prompts, 4)
    assert sorted(p.name for b in batches for p in b) == sorted(p.name for p in prompts)
    assert sum(len({p.category for p in b}) > 1 for b in batches) > len(batches) // 2


def test_identical_rows_are_counted_and_a_changed_token_is_located():
    prompts = identity_prompts()[:6]
    model = make_tiny_model("llama")
    result = run_identity(model, ByteTokenizer(), prompts, lambda m: hf_accel.patch(m, compile=None),
                          max_new_tokens=8, batch_size=3)
    assert result.rate() == (12, 12) and {r.batch for r in result.rows} == {1, 3}

    def break_it(m):  # a "patch" that changes the model's output
        with torch.no_grad():
            m.lm_head.weight.mul_(-1)

    result = run_identity(make_tiny_model("llama"), ByteTokenizer(), prompts, break_it, max_new_tokens=8, batch_size=3)
    same, total = result.rate()
    assert total == 12 and same < 12
    assert all(r.first_difference is not None for r in result.rows if not r.identical)
    assert "differs:" in result.table()
