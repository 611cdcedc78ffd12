"""Quantized copies of the target that draft for it (int8 or int4 Linear layers, the rest shared), and what
they cost; shared by the self-draft backends."""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from hf_accel.plugin import PatchContext, linear_children, object_request_problem, weight_and_bias
from hf_accel_plugins.int4_layers import Int4WeightLinear
from hf_accel_plugins.int4_layers import bytes_per_weight as int4_bytes_per_weight
from hf_accel_plugins.int8_layers import Int8WeightLinear


def vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()  # possibly a quantized module without a .weight
    return getattr(head, "out_features", None) or head.weight.shape[0]


def quantized_copy(model: PreTrainedModel, bits: int) -> nn.Module:
    """A copy of ``model`` sharing its non-Linear tensors (embeddings, norms), whose Linear layers are int8
    per output channel (``bits=8``), or int4 in groups of 32 (``bits=4``), each where its kernel takes the
    layer's shape (int8 in an int4 copy otherwise; a layer neither takes stays in float: the target's own
    weight, or a packed target layer's unpacked copy).
    Where the target's head holds a plain weight, the copy's head picks its best logits from it
    (:class:`TopLogitsExact`), and an int4 copy's head is int4 too; otherwise the head stays int8 (float where
    neither kernel takes it), whose own rounding then decides the draft."""
    with torch.device("meta"):
        draft = type(model)(copy.deepcopy(model.config))
    share_tensors(model, draft)
    draft.tie_weights()
    head = draft.get_output_embeddings()
    target_head = model.get_output_embeddings()
    exact_head = TopLogitsExact.rows_of(target_head, head) is not None
    # One layer at a time, from the target's layer of the same name: a packed target holds no plain weights,
    # and unpacking them all at once would cost a full copy of them.
    for parent, name, qualified, linear in list(linear_children(draft)):
        weight, bias = weight_and_bias(model.get_submodule(qualified))
        linear.weight = nn.Parameter(weight.t() if isinstance(linear, Conv1D) else weight, requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        kind = copied_kind(bits, weight, linear is head, exact_head)
        if kind == "float":
            continue  # neither kernel takes its shape: the layer keeps the target's float weight
        setattr(parent, name, Int4WeightLinear(linear, 32) if kind == "int4" else Int8WeightLinear(linear))
        linear.weight = linear.bias = None  # the list above still holds the module: free its plain copy now
    for name, tensor in [*draft.named_parameters(), *draft.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"could not copy {name} into the quantized draft")
    quantized_head = draft.get_output_embeddings()
    if exact_head and isinstance(quantized_head, (Int4WeightLinear, Int8WeightLinear)):  # a float head is exact
        parent, _, leaf = next(name for name, m in draft.named_modules() if m is quantized_head).rpartition(".")
        setattr(draft.get_submodule(parent), leaf, TopLogitsExact(quantized_head, target_head))
    return draft.eval()


def copied_kind(bits: int, weight: torch.Tensor, is_head: bool, exact_head: bool) -> str:
    """What a copy's Linear layer of this ``[out, in]`` weight becomes: ``"int4"`` in an int4 copy where the
    kernel takes its shape (the head only where its best logits are recomputed: alone, an int4 head's rounding
    costs too many drafts), else ``"int8"`` where that kernel takes it, else ``"float"``."""
    if bits == 4 and (not is_head or exact_head) and Int4WeightLinear.takes(weight, 32):
        return "int4"
    return "int8" if Int8WeightLinear.takes(weight) else "float"


class TopLogitsExact(nn.Module):
    """A draft's quantized output head whose ``k`` highest logits at each position are recomputed from the
    target head's own plain weight (read from the target's head on every call, never copied or held), so that
    the draft picks among its best candidates as the target would. With the model-card settings the int8
    head's rounding made SmolLM2's int4 self-draft disagree with the target more than its int4 layers did:
    0.80 of its drafts accepted, 0.93 with the 4 best recomputed, 0.92 with an fp32 head. With the 8 best
    recomputed an int4 head agrees as often as the int8 one did with 4, and reads 18 MB a draft step
    instead of 28 (docs/benchmarks.md). Costs a top-k over the vocabulary and ``k`` rows of the head per
    position. Where the target's head holds no plain weight when the copy is made (an untied head packed for
    its kernel), the copy gets a plain int8 head instead; should the target's head lose its plain weight later
    (or be freed), the quantized logits are used as they are: slower drafts, never other output tokens."""

    def __init__(self, head: nn.Module, target_head: nn.Module, k: int = 8) -> None:
        super().__init__()
        self.head, self.k = head, k
        self.out_features, self.in_features = head.out_features, head.in_features
        # A weak reference: neither a module of the draft (saved, counted) nor a hold on the target's head
        # (a backend packing the target counts who else holds its layers).
        self._target_head = weakref.ref(target_head)

    def extra_repr(self) -> str:
        return f"top {self.k} logits from the target's head"

    @staticmethod
    def rows_of(target_head: nn.Module | None, head: nn.Module) -> torch.Tensor | None:
        """``target_head``'s weight as plain ``[vocab, hidden]`` rows matching ``head``, or None."""
        weight = getattr(target_head, "weight", None)  # a packed layer that keeps none raises AttributeError
        plain = (not isinstance(target_head, Conv1D) and isinstance(weight, torch.Tensor) and weight.dim() == 2
                 and weight.is_floating_point() and not weight.is_meta)  # Conv1D keeps [in, out]
        return weight.detach() if plain and tuple(weight.shape) == (head.out_features, head.in_features) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        target_head = self._target_head()
        rows = self.rows_of(target_head, self.head)
        if rows is None:
            return logits
        top = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices
        exact = (rows[top] @ x.to(rows.dtype)[..., None])[..., 0]
        bias = getattr(target_head, "bias", None)
        if isinstance(bias, torch.Tensor):
            exact = exact + bias.detach()[top]
        return logits.scatter(-1, top, exact.to(logits.dtype))


def draft_bytes(context: PatchContext, bits: int) -> int:
    """Estimated bytes a quantized copy adds: its Linear layers' codes and scales (int4 with bf16 scales and
    offsets per 32 weights, or int8 with a bf16 scale per row, layer by layer as :func:`quantized_copy`
    chooses; and each such layer's copy of its bias; a layer neither kernel takes shares the target's weight,
    or holds a packed target layer's unpacked copy), plus the largest layer unpacked and coded while copying."""
    with torch.device("meta"):  # shapes only: the target's own layers may be packed by now
        fresh = type(context.model)(copy.deepcopy(context.model.config))
    target = context.model
    head = fresh.get_output_embeddings()
    exact_head = TopLogitsExact.rows_of(target.get_output_embeddings(), head) is not None
    layers = [(weight_and_bias(linear)[0], linear is head, target.get_submodule(qualified))
              for _, _, qualified, linear in linear_children(fresh)]
    if not layers:
        return 0
    held = sum(_copied_bytes(copied_kind(bits, weight, is_head, exact_head), weight, layer, target.dtype)
               for weight, is_head, layer in layers)
    largest = max(weight.numel() for weight, _, _ in layers)
    return int(held + 8 * largest)  # fp32 plus int32 codes of one layer at a time


def _copied_bytes(kind: str, weight: torch.Tensor, target_layer: nn.Module, dtype: torch.dtype) -> float:
    """What :func:`quantized_copy` adds for one Linear layer of this ``kind`` (``weight``: its shape) copied from
    ``target_layer``."""
    if kind == "float":  # the target's own weight, or a packed target layer's unpacked copy
        plain = isinstance(getattr(target_layer, "weight", None), torch.Tensor)
        return 0 if plain else weight.numel() * dtype.itemsize
    bias = getattr(target_layer, "bias", None)
    codes = weight.numel() * int4_bytes_per_weight(32) if kind == "int4" else weight.numel() + 2 * weight.shape[0]
    return codes + (0 if bias is None else bias.numel() * bias.element_size())  # int8: a bf16 scale per row


def self_draft(context: PatchContext, bits: int) -> nn.Module:
    """The target's quantized copy (see :func:`quantized_copy`), its bytes accounted in the report."""
    draft = quantized_copy(context.model, bits)
    own = own_bytes(draft, context.model)
    context.account_memory("draft copy (its quantized layers)", lambda: own)
    return draft


def own_bytes(draft: nn.Module, model: nn.Module) -> int:
    """Bytes of ``draft``'s parameters and buffers that it does not share with ``model``."""
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()] if t.numel()}
    tensors = {id(t): t for t in [*draft.parameters(), *draft.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in tensors
               if t.numel() and t.untyped_storage().data_ptr() not in shared)


def share_tensors(model: nn.Module, draft: nn.Module) -> None:
    """Put each of ``model``'s parameters and buffers (non-persistent ones too: rotary tables) into the module
    of the same name in ``draft``, where that module has one of that name."""
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owner, _, leaf = name.rpartition(".")
        try:
            module = draft.get_submodule(owner)
        except AttributeError:
            continue
        if leaf in module._parameters:
            module._parameters[leaf] = tensor
        elif leaf in module._buffers:
            module._buffers[leaf] = tensor


def self_draft_problem(context: PatchContext) -> str | None:
    """Why a quantized copy cannot be made of this target (or would not be cheaper), or None."""
    problem = object_request_problem(context)
    if problem:
        return problem
    # Not hf_quantizer: a GGUF checkpoint loads through one, dequantized to floating point.
    quantized_weights = any(not p.is_floating_point() for p in context.model.parameters())
    if context.state.report["quantize"].backend is not None or quantized_weights:
        return "the target's weights are quantized already, so a quantized copy would not draft any cheaper"
    with torch.device("meta"):
        fresh = type(context.model)(copy.deepcopy(context.model.config))
    if {name for name, _ in fresh.named_modules()} != {name for name, _ in context.model.named_modules()}:
        return ("the model's modules differ from what its class builds from its config (adapters such as LoRA?), "
                "so a quantized copy cannot be made from it; merge the adapters first")
    return None


#: What each self-draft is, for the report.
SELF_DRAFTS = {8: "int8 per-channel copy of the target", 4: "int4 (groups of 32) copy of the target"}


def describe(draft: nn.Module, bits: int) -> str:
    """What a self-draft is, for the report."""
    head = draft.get_output_embeddings()
    inner = head.head if isinstance(head, TopLogitsExact) else head
    kind = {Int4WeightLinear: "int4", Int8WeightLinear: "int8"}.get(type(inner), "float")
    exact = f" (its best {head.k} logits from the target's head)" if isinstance(head, TopLogitsExact) else ""
    return f"{SELF_DRAFTS[bits]}, {kind} head{exact}"
