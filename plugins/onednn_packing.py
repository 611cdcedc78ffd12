"""Linear layers on oneDNN-packed copies of their fp32 weights: the copies (replacing the plain weights, or
kept beside them and checked against them where the plain weight must stay: ``keep_original=True``, a tied
head, a layer held outside the model), ``torch.ops.hf_accel.onednn_linear`` (``F.linear`` over a packed copy,
opaque to torch.compile), ``PackedLinear`` and ``pack_linears``. Shared by the packing backend and the
inductor backend, whose graphs call the op."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.plugin import PatchContext, PatchError, children_of_type, free_weight, held_outside, is_tracing, shortfall

logger = logging.getLogger(__name__)

#: The row count oneDNN is told to expect when it packs: measured fastest for 1-16 rows on 2 cores.
PACK_FOR_ROWS = 8
#: Packed copies by the ``id`` of the weight tensor they were packed from (the module's own Parameter: the
#: compiled graphs pass it to the op below as it is). An entry leaves when its tensor dies, or at unpatch.
PACKED: dict[int, PackedWeight] = {}
#: Values of each weight compared at every generate call (a head of 49152 rows read whole took 5 ms).
SAMPLED_VALUES = 256


@dataclass
class PackedWeight:
    """A oneDNN-packed copy of a weight, and what the weight was when it was packed: its address (a new one
    after ``weight.data = ...``), shape and version counter (bumped by in-place edits and
    ``load_state_dict``), and a sample of its values (for edits through ``weight.data``, which bump none)."""

    packed: torch.Tensor
    address: int
    shape: torch.Size
    version: int
    rows: torch.Tensor  # where the sampled values are
    columns: torch.Tensor
    sample: torch.Tensor

    def current(self, weight: torch.Tensor) -> bool:
        return (self.address == weight.data_ptr() and self.shape == weight.shape
                and self.version == _version(weight))

    def edited(self, weight: torch.Tensor) -> bool:
        return not (self.current(weight) and torch.equal(self.sample, weight.detach()[self.rows, self.columns]))


def packed_copy(weight: torch.Tensor, pack_for_rows: int = PACK_FOR_ROWS) -> torch.Tensor:
    """The packed copy of ``weight``, packed again if the weight changed since (see :class:`PackedWeight`)."""
    entry = PACKED.get(id(weight))
    if entry is None or not entry.current(weight):
        if weight.shape[-1] == 0:  # a handle whose packed copy went with an unpatch
            raise PatchError("this oneDNN-packed layer was unpatched; call the module unpatch handed back")
        entry = _pack(weight, pack_for_rows)
    return entry.packed


def _pack(weight: torch.Tensor, pack_for_rows: int) -> PackedWeight:
    rows, columns = weight.shape
    index = torch.linspace(0, rows - 1, min(rows, SAMPLED_VALUES), device=weight.device).long()
    sampled_columns = (index * 7919) % columns
    entry = PACKED[id(weight)] = PackedWeight(
        reorder(weight.detach(), pack_for_rows), weight.data_ptr(), weight.shape,
        _version(weight), index, sampled_columns, weight.detach()[index, sampled_columns].clone())
    _watch(weight)  # the old copy of a repacked weight is replaced above; a dead tensor's copy goes there
    return entry


def reorder(weight: torch.Tensor, pack_for_rows: int) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout for products of about ``pack_for_rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, pack_for_rows)


def hold(handle: torch.Tensor, packed: torch.Tensor) -> None:
    """Make ``packed`` the copy the product uses for ``handle`` (a layer whose plain weight was freed): never
    compared with the handle, which holds no values."""
    empty = handle.new_empty(0).long()
    PACKED[id(handle)] = PackedWeight(packed, handle.data_ptr(), handle.shape, _version(handle), empty, empty,
                                       handle.new_empty(0))
    _watch(handle)


def drop_if_edited(weight: torch.Tensor) -> None:
    """Forget the packed copy of ``weight`` if it no longer matches the weight, the sampled values included:
    the next product packs it again."""
    entry = PACKED.get(id(weight))
    if entry is not None and entry.edited(weight):
        PACKED.pop(id(weight), None)


def forget(weight: torch.Tensor) -> None:
    PACKED.pop(id(weight), None)


#: One finalizer per tensor that has (or had) a packed copy, so that patching and unpatching the same weights
#: again and again does not add one each time.
_WATCHERS: dict[int, weakref.finalize] = {}


def _watch(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s packed copy when the tensor dies (before its id can be reused)."""
    watcher = _WATCHERS.get(id(tensor))
    if watcher is None or not watcher.alive:
        _WATCHERS[id(tensor)] = weakref.finalize(tensor, _forget_id, id(tensor))


def _forget_id(key: int) -> None:
    PACKED.pop(key, None)
    _WATCHERS.pop(key, None)


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else weight._version  # inference tensors keep no version counter


# An opaque op, so torch.compile calls it as it is (inductor cannot trace a oneDNN-layout tensor). Defined
# through a plain Library rather than torch.library.custom_op: ~12 us less per call, ~2.5 ms per SmolLM2 step.
_LIBRARY = torch.library.Library("hf_accel", "DEF")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed copy of ``weight``."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_copy(weight), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


_LIBRARY.impl("onednn_linear", onednn_linear, "CPU")


@torch.library.register_fake("hf_accel::onednn_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs on a oneDNN-packed copy of its weight.

    By default the packed copy *replaces* the weight: the plain one is freed (its Parameter object is kept
    empty, and refilled from the packed copy, exactly, on ``unpatch``), so the layer costs no more memory than
    before. ``state_dict()`` gives the plain weight under the usual key (unpacked for the call) and
    ``load_state_dict`` packs what it is given; reading ``.weight`` raises with what to do instead.

    With ``keep_original=True``, or where the weight is shared with another module (a head tied to the
    embeddings), it holds the original Parameter as ``weight`` beside the packed copy and packs again when
    that weight changes. A layer ``held_outside`` the model (by a draft model, an optimizer, a variable) is
    also left whole, weight and bias, for whoever else runs it. Falls back to ``F.linear`` when autograd
    needs the graph.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool, held_outside: bool = False) -> None:
        super().__init__()
        keep_weight = keep_weight or held_outside
        weight = linear.weight
        # Everything that can fail (packing: out of memory) before the original module is touched.
        packed = None if keep_weight else reorder(weight.detach(), PACK_FOR_ROWS)
        if keep_weight:
            packed_copy(weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        # Lists, so that neither is registered: the original module, and (when freed) its weight Parameter, which
        # goes back at unpatch refilled.
        self.original, self.original_weight = [linear], [] if keep_weight else [weight]
        if keep_weight:
            self.weight = weight
        else:
            # What the product and its compiled graphs are handed in place of the weight: no bytes, the weight's
            # shape on its first dimension; its packed copy is found by its id.
            self.register_buffer("packed_handle", weight.new_empty(self.out_features, 0), persistent=False)
            hold(self.packed_handle, packed)
        if not held_outside:  # else left whole: something outside the model still runs it
            linear.weight, linear.bias = None, None
        if not keep_weight:
            free_weight(weight)

    @property
    def holds_weight(self) -> bool:
        """Whether a plain ``weight`` is held beside the packed copy."""
        return "weight" in self._parameters

    def dense_weight(self) -> torch.Tensor:
        """The weight the product computes with, ``[out, in]``: the held one, or a plain copy of the packed one."""
        if self.holds_weight:
            return self.weight.detach()
        return PACKED[id(self.packed_handle)].packed.to_dense()

    def packed_bytes(self) -> int:
        entry = PACKED.get(id(self.weight if self.holds_weight else self.packed_handle))
        return 0 if entry is None else entry.packed.numel() * entry.packed.element_size()

    def plain_bytes(self) -> int:
        """What the plain weight takes (or took, before it was freed)."""
        return self.in_features * self.out_features * 4

    def hand_back(self) -> nn.Linear:
        """The original module, holding the weight and bias this one computes with (they may have been replaced
        since the patch); the packed copy is dropped."""
        original = self.original[0]
        if self.holds_weight:
            original.weight = self.weight
            forget(self.weight)
        else:
            weight = self.original_weight[0]
            weight.data = self.dense_weight()
            original.weight = weight
            forget(self.packed_handle)
        original.bias = self.bias
        return original

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        raise AttributeError(
            "hf_accel packed this layer's weight into oneDNN's layout and freed the plain copy, to save memory: "
            "use .dense_weight() for a copy (state_dict() holds it too), load_state_dict() or assign "
            ".weight to change it, or patch(..., keep_original=True) to keep the plain weight") from None

    def __setattr__(self, name: str, value) -> None:
        if name == "weight" and "packed_handle" in self._buffers:
            if not isinstance(value, nn.Parameter):  # as nn.Linear refuses it
                raise TypeError(f"cannot assign {type(value).__name__} as parameter 'weight' (torch.nn.Parameter "
                                "expected)")
            forget(self.packed_handle)  # the assigned weight is held from now on, and packed again when it changes
            del self._buffers["packed_handle"]
            self.original_weight.clear()
        super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.holds_weight:  # first: nn.Linear's order is weight, then bias
            destination[prefix + "weight"] = self.dense_weight()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if not self.holds_weight:
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != (self.out_features, self.in_features):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)}, the layer holds "
                                  f"{(self.out_features, self.in_features)}")
            else:
                value = state_dict[key].detach().to(torch.float32)
                hold(self.packed_handle, reorder(value.contiguous(), PACK_FOR_ROWS))
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        refuse_conversion(fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        held = "weight held beside it" if self.holds_weight else "plain weight freed"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"oneDNN-packed ({held})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = self.weight if self.holds_weight else self.packed_handle
        if torch.is_grad_enabled():
            if self.holds_weight and (x.requires_grad or self.weight.requires_grad):
                return F.linear(x, self.weight, self.bias)
            if not self.holds_weight and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
                return _PackedProduct.apply(x, self, self.bias)
        if is_tracing():
            return torch.ops.hf_accel.onednn_linear(x, key, self.bias)
        return onednn_linear(x, key, self.bias)


class _PackedProduct(torch.autograd.Function):
    """A freed layer's product under autograd: forward on the packed copy; backward gives the input (and the
    bias) their gradients, unpacking the weight only while it needs it. The weight gets none: it is no longer
    a Parameter (``keep_original=True`` keeps it trainable)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.layer = layer
        return onednn_linear(x, layer.packed_handle, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad @ ctx.layer.dense_weight() if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


def refuse_conversion(fn) -> None:
    """Raise before ``model.to()``, ``.half()``, ``.cuda()``... (``Module._apply(fn)``) would convert a
    packed layer: its copy is float32 in oneDNN's CPU layout."""
    probe = torch.empty(0)
    converted = fn(probe)
    if converted is not probe and (converted.dtype, converted.device) != (probe.dtype, probe.device):
        raise PatchError("this model's Linear layers hold oneDNN-packed float32 weights for the CPU; call "
                         "hf_accel.unpatch(model) before changing its dtype or device, then patch it again",
                         backend="onednn_prepack", feature="compile")


def _prefixes(name: str) -> list[str]:
    """"a.b.c" -> ["", "a", "a.b"]: the qualified names of the modules above it."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def _guard_conversions(context: PatchContext, module: nn.Module) -> None:
    convert = module._apply
    context.changes.setattr(module, "_apply", lambda fn, recurse=True: (refuse_conversion(fn), convert(fn, recurse))[1])


def linear_children(model: nn.Module):
    """Every plain ``nn.Linear`` (Conv1D layers keep their own kernel)."""
    return children_of_type(model, (nn.Linear,))


def shared_weights(model: nn.Module) -> set[int]:
    """ids of Parameters that more than one module holds (a head tied to the embeddings)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def pack_linears(context: PatchContext) -> None:
    packed: list[PackedLinear] = []
    # Registered first, so that a patch failing half-way gives every original its weights back (undo runs
    # newest first: this runs last, after the modules are back in place).
    context.changes.on_undo(lambda: [module.hand_back() for module in packed])
    keep, shared = context.option("keep_original", False), shared_weights(context.model)
    # Layers (or weights) that another model, an optimizer or a variable also holds keep their plain weights.
    elsewhere = held_outside(context.model)
    if elsewhere:
        logger.warning("hf_accel: %d Linear layers (%s) are also held outside the model, by an optimizer, another "
                       "model, a variable or the graph of an output computed with gradients on: their plain weights "
                       "stay beside the packed copies (a compiled step may run them uncompiled); drop those references "
                       "before patching to save the memory.",
                       len(elsewhere), ", ".join(sorted(elsewhere.values())[:3]) + (", ..." * (len(elsewhere) > 3)))
    for parent, name, qualified, linear in list(linear_children(context.model)):
        # One at a time: each plain weight is freed as soon as its packed copy exists.
        packed.append(PackedLinear(linear, keep or id(linear.weight) in shared, id(linear) in elsewhere))
        context.changes.set_submodule(parent, name, packed[-1])
        context.report.modules.append(qualified)
    context.before_each_call(lambda: [drop_if_edited(module.weight) for module in packed if module.holds_weight])
    # Refused before any layer is converted, on the model or on any module above a packed layer (children are
    # converted one by one: refusing at the first packed layer would leave earlier ones converted).
    ancestors = {name.rpartition(".")[0] for name in context.report.modules}
    ancestors |= {parent for name in ancestors for parent in _prefixes(name)}
    for name in sorted(ancestors):
        _guard_conversions(context, context.model.get_submodule(name))
    context.report.details["packed_linears"] = len(context.report.modules)
    context.report.details["plain_weights_kept"] = sum(module.holds_weight for module in packed)
    context.report.details["held_outside_the_model"] = sorted(elsewhere.values())
    context.account_memory("oneDNN-packed weights", lambda: sum(module.packed_bytes() for module in packed))
    context.account_memory("plain weights freed", lambda: -sum(module.plain_bytes() for module in packed
                                                               if not module.holds_weight))


def packing_bytes(model: nn.Module) -> int:
    """Bytes packing adds: a copy of each weight something else also holds (a tied head, a layer held outside
    the model), and, while packing, the largest one (each plain weight is freed once its copy exists)."""
    linears = [linear for _, _, _, linear in linear_children(model)]
    if not linears:
        return 0
    shared, elsewhere = shared_weights(model), held_outside(model)
    kept = sum(linear.weight.nbytes for linear in linears if id(linear.weight) in shared or id(linear) in elsewhere)
    return kept + max(linear.weight.nbytes for linear in linears)


def packing_needed(context: PatchContext) -> int:
    """Bytes packing adds here: :func:`packing_bytes`, or a copy of every weight with ``keep_original=True``."""
    if context.option("keep_original", False):
        return sum(linear.weight.nbytes for _, _, _, linear in linear_children(context.model))
    return packing_bytes(context.model)


def packing_problem(context: PatchContext) -> str | None:
    """Why the weights cannot be packed here (no oneDNN, not fp32 on the CPU, not enough free memory), or None."""
    reason = why_unavailable()
    if reason:
        return reason
    if context.device.type != "cpu" or context.dtype != torch.float32:
        return "packs float32 weights on the CPU"
    return shortfall(context.device, packing_needed(context))


def why_unavailable() -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    return None
