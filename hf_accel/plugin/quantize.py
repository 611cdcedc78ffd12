"""Helpers for quantization backends: which Linear layers to replace, and what they weigh."""

from __future__ import annotations

import gc
import logging
import re
import sys
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_accel.patching.backends import Option, PatchContext

#: Module types that are a matrix product with a weight: nn.Linear, and GPT-2's Conv1D (weight stored [in, out]).
LINEAR_TYPES = (nn.Linear, Conv1D)

logger = logging.getLogger(__name__)


Child = tuple[nn.Module, str, str, nn.Module]  # (parent, child name, qualified name, child)


def children_of_type(model: nn.Module, types: tuple[type, ...]) -> Iterator[Child]:
    """Every submodule whose type is exactly one of ``types`` (subclasses may change what forward does)."""
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) in types:
                yield parent, name, f"{parent_name}.{name}".lstrip("."), child


def held_outside(model: nn.Module, types: tuple[type, ...] = (nn.Linear,)) -> dict[int, str]:
    """The submodules of ``model`` of exactly one of ``types`` that something outside the model also holds,
    the module itself or one of its parameters (id -> qualified name): another model sharing the layer (a draft
    model given the target's head), an optimizer, a variable, a live autograd graph. A backend must not free
    those layers' weights or take the layers apart.

    Counted, not searched: a layer has as many references as a fresh one in a container, plus one for each
    further place in the model that holds it (a head tied to the embeddings); any beyond those are from
    outside. Garbage is collected first when some layer looks held, so that dead cycles do not count.

    Example: ``held = held_outside(model)`` before replacing layers; keep the weights of those in ``held``.
    """
    (_, _, fresh_layer, [(_, fresh_parameter)]), = _reference_counts(nn.Sequential(nn.Linear(1, 1, bias=False)),
                                                                      (nn.Linear,))
    held = _beyond(model, types, fresh_layer, fresh_parameter)
    if held:
        gc.collect()
        held = _beyond(model, types, fresh_layer, fresh_parameter)
    return held


def _beyond(model: nn.Module, types: tuple[type, ...], fresh_layer: int, fresh_parameter: int) -> dict[int, str]:
    in_model = Counter(id(x) for m in model.modules() for d in (m._modules, m._parameters) for x in d.values())
    return {key: name for key, name, count, parameters in _reference_counts(model, types)
            if count - fresh_layer > in_model[key] - 1
            or any(n - fresh_parameter > in_model[p] - 1 for p, n in parameters)}


def _reference_counts(model: nn.Module, types: tuple[type, ...]) -> list[tuple[int, str, int, list[tuple[int, int]]]]:
    """For each layer of ``types`` in ``model``: its id, name and references, and its parameters' ids and
    references, counted the same way for every model (so a fresh layer's counts are the baseline)."""
    layers = [(name, m) for name, m in model.named_modules() if type(m) in types]
    return [(id(layer), name, sys.getrefcount(layer),
             [(id(p), sys.getrefcount(p)) for p in layer._parameters.values() if p is not None])
            for name, layer in layers]


def linear_children(model: nn.Module) -> Iterator[Child]:
    """Every plain ``nn.Linear`` or ``Conv1D``."""
    return children_of_type(model, LINEAR_TYPES)


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight as ``[out_features, in_features]`` and the bias, whichever layout the module stores (a layer
    a backend rewrote, holding its weight in another form, gives it through ``dense_weight()``)."""
    dense = getattr(module, "dense_weight", None)
    if callable(dense):
        return dense(), module.bias
    weight = module.weight.detach()
    return (weight.t() if isinstance(module, Conv1D) else weight), module.bias


class SavedAsFloat(nn.Module):
    """Base of a quantized module whose state dict is the float weight of the module it replaced.

    ``state_dict()`` (and so ``save_pretrained``) writes ``weight`` (and ``bias``) under the replaced module's
    keys, in its layout (``Conv1D`` stores ``[in, out]``) and dtype, holding the values the quantized product
    computes with. Any transformers loads that checkpoint as a float model; patching it again with the same
    options quantizes those values back to the same codes. ``load_state_dict`` of a float ``weight``
    quantizes it in place, so loading other weights into a patched model takes effect.

    A subclass calls :meth:`remember_layout` in ``__init__`` and implements :meth:`dequantized` and
    :meth:`quantize_from`.
    """

    def remember_layout(self, original: nn.Module) -> None:
        self._transposed = isinstance(original, Conv1D)
        self._float_dtype = original.weight.dtype

    def dequantized(self) -> torch.Tensor:
        """The weight the product computes with, ``[out, in]`` in fp32."""
        raise NotImplementedError

    def quantize_from(self, weight: torch.Tensor) -> None:
        """Replace the quantized weight, in place, by ``weight`` (``[out, in]``) quantized."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        weight = self.dequantized()
        destination[prefix + "weight"] = (weight.t() if self._transposed else weight).to(self._float_dtype)
        bias = getattr(self, "bias", None)
        if bias is not None:
            destination[prefix + "bias"] = bias if keep_vars else bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in ("weight", "bias") if getattr(self, "bias", None) is not None else ("weight",):
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if name == "bias":
                if value.shape != self.bias.shape:
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                      f"the module holds {tuple(self.bias.shape)}")
                    continue
                with torch.no_grad():
                    self.bias.copy_(value)
                continue
            weight = value.t() if self._transposed else value
            expected = tuple(self.dequantized_shape())
            if tuple(weight.shape) != expected:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the quantized module holds {expected} ([out, in])")
                continue
            with torch.no_grad():
                self.quantize_from(weight.detach().float())
        if strict:  # e.g. qweight/scale keys of a checkpoint saved before state dicts held float weights
            ours = {prefix + "weight", prefix + "bias"}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours
                                   and k[len(prefix):].split(".", 1)[0] not in self._modules)

    def dequantized_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features


def selected_linears(context: PatchContext) -> list[Child]:
    """The Linear layers to quantize: those of the decoder blocks by default (not the output head); the
    ``include`` / ``skip`` options (regular expressions on qualified names) override that."""
    head = context.model.get_output_embeddings()
    return _select(context, linear_children(context.model), default=lambda module: module is not head)


def quantized_bytes(context: PatchContext, bytes_per_weight: float) -> int:
    """Estimated bytes the quantized copies of the selected layers take (``bytes_per_weight``: codes and
    scales per weight), for :attr:`Backend.memory_needed`: the originals stay until patch() succeeds."""
    chosen = [*selected_linears(context), *selected_embeddings(context)]
    return int(sum(module.weight.numel() for _, _, _, module in chosen) * bytes_per_weight)


def selected_embeddings(context: PatchContext) -> list[Child]:
    """Plain ``nn.Embedding`` tables named by an ``include`` pattern (never by default); subclasses that
    change the lookup (e.g. scaled embeddings) are left alone."""
    return _select(context, children_of_type(context.model, (nn.Embedding,)), default=lambda module: False)


def kernel_selection(context: PatchContext, takes_weight: Callable[[torch.Tensor], bool],
                     takes_embedding: Callable[[nn.Embedding], bool] = lambda embedding: True,
                     ) -> tuple[list[Child], list[Child], list[str]]:
    """The selected embeddings and Linear layers a quantization kernel takes, and the qualified names of the
    selected ones it leaves in full precision, embeddings first (for :func:`record_quantization`).
    ``takes_weight`` gets a Linear layer's ``[out, in]`` weight, ``takes_embedding`` an embedding; a module tied
    to one left is left too: quantized alone, the tie would break.

    Example::

        embeddings, linears, left = kernel_selection(context, MyLinear.takes)
    """
    linears, embeddings = selected_linears(context), selected_embeddings(context)
    untaken = ({id(linear.weight) for *_, linear in linears if not takes_weight(weight_and_bias(linear)[0])}
               | {id(embedding.weight) for *_, embedding in embeddings if not takes_embedding(embedding)})
    left = [child[2] for child in (*embeddings, *linears) if id(child[3].weight) in untaken]
    return ([child for child in embeddings if id(child[3].weight) not in untaken],
            [child for child in linears if id(child[3].weight) not in untaken], left)


def _select(context: PatchContext, candidates: Iterator[Child], default) -> list[Child]:
    """Candidates named by an ``include`` pattern (or, with none given, those ``default`` accepts), less
    those named by a ``skip`` pattern."""
    include = _patterns(context.option("include"))
    skip = _patterns(context.option("skip"))
    chosen = []
    for child in candidates:
        qualified, module = child[2], child[3]
        wanted = any(p.search(qualified) for p in include) if include else default(module)
        if wanted and not any(p.search(qualified) for p in skip):
            chosen.append(child)
    return chosen


def record_quantization(context: PatchContext, scheme: str, left: Sequence[str] = ()) -> None:
    """What every quantization backend does once its modules are replaced: report the selected modules it
    ``left`` in full precision (shapes its kernel cannot take), refuse an empty selection, report the bytes
    after and the scheme, and (unless ``keep_original=True``) free the originals once patch() has succeeded.
    Set ``context.report.weight_bytes_before`` before replacing anything."""
    named = ", ".join(left[:5]) + (" ..." if len(left) > 5 else "")
    if left:
        context.report.details["left_in_full_precision"] = list(left)
        logger.info("%s: %d modules left in full precision (shapes its kernel cannot take): %s", scheme, len(left),
                    named)
    if not context.report.modules:
        if left:
            raise ValueError(f"every module selected has a shape this scheme's kernel cannot take ({named}); "
                             "choose another quantize= scheme or other modules")
        raise ValueError("no module matched; check the include=/skip= patterns")
    context.report.weight_bytes_after = after = tensor_bytes(context.model)
    context.report.details["scheme"] = scheme
    quantized = sum(tensor_bytes(context.model.get_submodule(name)) for name in context.report.modules)
    originals = context.report.weight_bytes_before - (after - quantized)  # what the replaced modules held
    context.account_memory("quantized weights", lambda: quantized)
    if not context.option("keep_original", False):
        context.account_memory("original weights freed", lambda: -originals)
        context.changes.forget_on_commit(
            f"its weights were quantized ({scheme}) and the originals freed; "
            "patch with keep_original=True to be able to unpatch")


def _is_patterns(value: object) -> bool:
    """None, a regular expression, or a list of them, each one that compiles."""
    if value is None:
        return True
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) for p in items):
        return False
    try:
        [re.compile(p) for p in items]
    except re.error:
        return False
    return True


#: The options every quantization backend reads: which modules (regular expressions on qualified names) and
#: whether to keep the originals so that ``unpatch`` can restore them.
SELECTION_OPTIONS = {
    "include": Option.any_of(None, _is_patterns, "None, a regular expression or a list of them"),
    "skip": Option.any_of(None, _is_patterns, "None, a regular expression or a list of them"),
    "keep_original": Option.flag(False),
}


def _patterns(value: str | Sequence[str] | None) -> list[re.Pattern]:
    if value is None:
        return []
    return [re.compile(p) for p in ([value] if isinstance(value, str) else value)]


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, packed quantized weights included; shared tensors once."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers(), *_packed_tensors(module)]:
        key = (tensor.untyped_storage().data_ptr(), tensor.numel()) if not tensor.is_quantized else id(tensor)
        if key not in seen:
            seen.add(key)
            total += _nbytes(tensor)
    return total


def _packed_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Quantization metadata that is neither a parameter nor a buffer: bitsandbytes' block scales
    (``quant_state``, nested for double quantization) and LLM.int8 row scales (``SCB``)."""
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        state = getattr(weight, "quant_state", None)
        while state is not None:
            yield state.absmax
            state = getattr(state, "state2", None)
        scales = getattr(weight, "SCB", None)
        if isinstance(scales, torch.Tensor):
            yield scales


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.is_quantized:
        scales = tensor.q_per_channel_scales().numel() * 12 if tensor.qscheme() in (
            torch.per_channel_affine, torch.per_channel_symmetric) else 12
        return tensor.numel() * tensor.element_size() + scales
    return tensor.numel() * tensor.element_size()
