"""Probes that check a backend left the model's outputs as they were (or within its stated loss)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from hf_accel.patching.report import Verification

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

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
    """fp32 logits of the probe's non-padded positions, shape ``[n_real_tokens, vocab]``: the padded batch's, then
    those of its first (unpadded) row run alone, which transformers may send to attention without a mask (the
    kernel's own causal rule then applies)."""
    with torch.no_grad(), _eval_mode(model):
        batch = model(input_ids=probe.input_ids, attention_mask=probe.attention_mask, use_cache=False)
        alone = model(input_ids=probe.input_ids[:1], attention_mask=probe.attention_mask[:1], use_cache=False)
    return torch.cat([batch.logits[probe.attention_mask.bool()], alone.logits[0]]).float()


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


def compare_logits(reference: torch.Tensor, actual: torch.Tensor, tolerance: float,
                   probe: ProbeInputs | None = None) -> Verification:
    """``actual`` against ``reference`` (``[n_real_tokens, vocab]``, from :func:`forward_logits` of ``probe``):
    the relative error, where it is largest, and how often the top token agrees."""
    difference = (actual - reference).abs().nan_to_num(float("inf")).amax(-1)
    error = (difference.max() / reference.abs().max().clamp_min(1e-6)).item()
    agreement = (actual.argmax(-1) == reference.argmax(-1)).float().mean().item()
    passed = error <= tolerance and bool(torch.isfinite(actual).all())
    where = _probe_position(probe, int(difference.argmax())) if probe is not None else ""
    return Verification(probe="forward", passed=passed, error=error, tolerance=tolerance, top1_agreement=agreement,
                        where=where)


def _probe_position(probe: ProbeInputs, token: int) -> str:
    """The probe's ``token``-th real token (in :func:`forward_logits`' order) in words."""
    in_batch = int(probe.attention_mask.sum())
    if token >= in_batch:
        first = " (its first token)" if token == in_batch else ""
        return f"token {token - in_batch}{first} of the forward probe's unpadded row run alone"
    row, column = probe.attention_mask.nonzero()[token].tolist()
    padding = int((probe.attention_mask[row, :column] == 0).sum())
    first = " (its first token)" if column == padding else ""
    return f"row {row}, token {column - padding}{first} of the forward probe"


class LayerMismatch(Exception):
    """A replacement module's output differs from the module it replaces beyond the bound."""

    def __init__(self, layer: str, error: float, tolerance: float, detail: str = "") -> None:
        super().__init__(f"layer {layer}: " + (detail or f"output error {error:.1e} (bound {tolerance:.0e})"))
        self.layer, self.error, self.tolerance, self.detail = layer, error, tolerance, detail

    def verification(self) -> Verification:
        if self.detail:
            return Verification(probe="layer", passed=False, detail=str(self))
        return Verification(probe="layer", passed=False, error=self.error, tolerance=self.tolerance,
                            where=f"layer {self.layer}")


class LayerCheck:
    """Compares a module a backend swaps in with the one it replaces, on a few rows of seeded random input,
    before the swap (as ``kernels`` validates a layer before replacing it): a replacement whose outputs move
    by more than ``tolerance`` (relative to the original's largest output) is refused, naming the layer.
    Layers whose original no longer holds its weights (a packed copy took them) are left to the model probe."""

    ROWS = 4

    def __init__(self, model: torch.nn.Module, tolerance: float) -> None:
        self.model = model
        self.tolerance = tolerance
        self._names: dict[int, str] | None = None

    def __call__(self, parent: torch.nn.Module, name: str, original: torch.nn.Module,
                 replacement: torch.nn.Module) -> None:
        probe = self._input_for(original)
        if probe is None:
            return
        try:
            with torch.no_grad():
                expected, actual = original(probe), replacement(probe)
        except Exception as exc:  # a module that takes other inputs than these rows: the model probe checks it
            logger.debug("hf_accel: %s not checked on its own (%s: %s)", self._qualified(parent, name),
                         type(exc).__name__, exc)
            return
        if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
            return
        if actual.shape != expected.shape:
            raise LayerMismatch(self._qualified(parent, name), float("inf"), self.tolerance,
                                f"output shape {tuple(actual.shape)} instead of {tuple(expected.shape)}")
        error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6))
        if not bool(error <= self.tolerance):  # NaN fails too
            raise LayerMismatch(self._qualified(parent, name), float(error.nan_to_num(float("inf"))),
                                self.tolerance)

    def _input_for(self, module: torch.nn.Module) -> torch.Tensor | None:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0 or weight.is_meta:
            return None
        generator = torch.Generator().manual_seed(0)
        if isinstance(module, torch.nn.Embedding):
            ids = torch.randint(0, weight.shape[0], (self.ROWS,), generator=generator)
            return ids.to(weight.device)
        if not weight.is_floating_point():
            return None
        from transformers.pytorch_utils import Conv1D

        features = weight.shape[0] if isinstance(module, Conv1D) else weight.shape[1]
        if not isinstance(module, (torch.nn.Linear, Conv1D)):
            return None
        return torch.randn(self.ROWS, features, generator=generator).to(weight.device, weight.dtype)

    def _qualified(self, parent: torch.nn.Module, name: str) -> str:
        if self._names is None:
            self._names = {id(module): path for path, module in self.model.named_modules()}
        prefix = self._names.get(id(parent), "")
        return f"{prefix}.{name}" if prefix else name


def compare_tokens(reference: torch.Tensor, actual: torch.Tensor) -> Verification:
    """Greedy tokens of the generate probe against the model's before; a mismatch says where it starts."""
    if reference.shape != actual.shape:
        return Verification(probe="generate", passed=False,
                            detail=f"output shape {tuple(actual.shape)} instead of {tuple(reference.shape)}")
    differ = (reference != actual).nonzero()
    if not len(differ):
        return Verification(probe="generate", passed=True)
    row, column = differ[0].tolist()
    new = column - (reference.shape[1] - _PROBE_NEW_TOKENS)
    return Verification(probe="generate", passed=False, where=f"row {row}, new token {new} of the generate probe",
                        detail=f"(new tokens expected {reference[row, column - new:].tolist()}, generated "
                               f"{actual[row, column - new:].tolist()})")


class _eval_mode:
    """Run the probe without dropout, then put the model back in the mode it was in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.was_training = model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)
