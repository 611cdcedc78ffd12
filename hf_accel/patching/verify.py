"""Probes that check a backend left the model's outputs as they were (or within its stated loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from hf_accel.patching.report import Verification

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Relative logit error allowed for a lossless backend, by parameter dtype.
LOSSLESS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
_PROBE_LENGTH = 8
_PROBE_PADDING = 3
_PROBE_NEW_TOKENS = 4


@dataclass
class ProbeInputs:
    """Two rows: one full, one left-padded, so padding handling is exercised too."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pad_token_id: int

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> ProbeInputs:
        config = model.config.get_text_config()
        pad = _pad_token_id(model)
        generator = torch.Generator().manual_seed(0)
        high = min(config.vocab_size, 32_000)
        ids = torch.randint(min(10, high - 1), high, (2, _PROBE_LENGTH), generator=generator)
        mask = torch.ones_like(ids)
        ids[1, :_PROBE_PADDING] = pad
        mask[1, :_PROBE_PADDING] = 0
        device = execution_device(model)
        return cls(ids.to(device), mask.to(device), pad)


def execution_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: its first weight's device or, when accelerate offloaded that weight (meta
    until its layer runs), the device accelerate's hook on that layer runs it on.

    :raises ValueError: the weights are on the meta device and no accelerate hook says where they run.
    """
    name, param = next(iter(model.named_parameters()), (None, None))
    if param is None:
        raise ValueError(f"{type(model).__name__} has no parameters to patch")
    if not param.is_meta:
        return param.device
    path = name.split(".")[:-1]
    for depth in range(len(path), -1, -1):  # the weight's own module first, then each module around it
        device = _hook_execution_device(model.get_submodule(".".join(path[:depth])))
        if device is not None:
            return device
    raise ValueError(f"{type(model).__name__} has weights on the meta device and no device_map that places them; "
                     "load it fully (from_pretrained without device_map='meta') before hf_accel.patch")


def _hook_execution_device(module: torch.nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    for each in getattr(hook, "hooks", (hook,)):  # accelerate's SequentialHook holds several
        device = getattr(each, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def _pad_token_id(model: PreTrainedModel) -> int:
    for source in (model.generation_config, model.config.get_text_config()):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


def forward_logits(model: PreTrainedModel, probe: ProbeInputs) -> torch.Tensor:
    """fp32 logits of the probe's non-padded positions, shape ``[n_real_tokens, vocab]``."""
    with torch.no_grad(), _eval_mode(model):
        out = model(input_ids=probe.input_ids, attention_mask=probe.attention_mask, use_cache=False)
    return out.logits[probe.attention_mask.bool()].float()


def greedy_tokens(generate: Callable[..., torch.Tensor], probe: ProbeInputs) -> torch.Tensor:
    with torch.no_grad():
        return generate(
            input_ids=probe.input_ids,
            attention_mask=probe.attention_mask,
            max_new_tokens=_PROBE_NEW_TOKENS,
            do_sample=False,
            pad_token_id=probe.pad_token_id,
            # Eager: a compiled forward checks each new graph against eager on first use, and compiling for
            # the probe's shapes would cost a compile (minutes on a small CPU) that no later call reuses.
            disable_compile=True,
        )


def compare_logits(reference: torch.Tensor, actual: torch.Tensor, tolerance: float) -> Verification:
    error = ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    agreement = (actual.argmax(-1) == reference.argmax(-1)).float().mean().item()
    passed = error <= tolerance and bool(torch.isfinite(actual).all())
    return Verification(probe="forward", passed=passed, error=error, tolerance=tolerance, top1_agreement=agreement)


def compare_tokens(reference: torch.Tensor, actual: torch.Tensor) -> Verification:
    passed = reference.shape == actual.shape and bool((reference == actual).all())
    detail = "" if passed else f"expected {reference.tolist()}, got {actual.tolist()}"
    return Verification(probe="generate", passed=passed, detail=detail)


class _eval_mode:
    """Run the probe without dropout, then put the model back in the mode it was in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.was_training = model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)
