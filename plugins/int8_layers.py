"""int8 weights, one scale per output row, their Linear and Embedding modules and the kernel check; shared by
``quantize="int8"`` and the int8 self-draft."""

from __future__ import annotations

import torch
from torch import nn

from hf_accel.plugin import SavedAsFloat, weight_and_bias


class Int8Rows(SavedAsFloat):
    """Int8 codes ``qweight`` ``[rows, columns]`` with one bf16 ``scale`` per row; saved and loaded as floats."""

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def quantize_from(self, weight: torch.Tensor) -> None:
        quantized, scale = quantize_rows(weight)
        self.qweight.copy_(quantized)  # in place: a head tied to this table shares these tensors
        self.scale.copy_(scale)


class Int8WeightLinear(Int8Rows):
    """``y = x @ (q * scale)^T + b`` with ``q`` int8 ``[out, in]`` and one bf16 ``scale`` per output.
    Built from an ``nn.Linear`` or GPT-2's ``Conv1D`` whose input size the kernel takes (:meth:`takes`)."""

    #: The kernel reads inputs 16 values at a time with aligned loads (8 below AVX-512): other input sizes
    #: read past each row and give wrong values, or crash the process.
    IN_MULTIPLE = 16

    @classmethod
    def takes(cls, weight: torch.Tensor) -> bool:
        """Whether the kernel takes a ``[out, in]`` weight of this shape."""
        return weight.shape[1] % cls.IN_MULTIPLE == 0

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.remember_layout(linear)
        weight, bias = weight_and_bias(linear)
        if not self.takes(weight):
            raise ValueError(f"the int8 kernel cannot take {weight.shape[1]} inputs (a multiple of "
                             f"{self.IN_MULTIPLE} is needed); leave this layer in full precision")
        self.out_features, self.in_features = weight.shape
        quantized, scale = quantize_rows(weight.float())
        self.register_buffer("qweight", quantized)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, bf16 activations"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.qweight, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Embedding(Int8Rows):
    """An embedding table in int8 with one bf16 scale per row; rows are dequantized as they are looked up."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.remember_layout(embedding)
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.padding_idx = embedding.padding_idx
        quantized, scale = quantize_rows(embedding.weight.detach().float())
        self.register_buffer("qweight", quantized)
        self.register_buffer("scale", scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row"

    def dequantized_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(torch.float32) * self.scale[ids].to(torch.float32)[..., None]


def quantize_rows(weight: torch.Tensor, rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row (output channel), a block of ``rows`` at a time: no full-size
    temporaries (a 49152-row head took 0.17 s through them, 0.06 s this way, same values)."""
    scale = (torch.linalg.vector_norm(weight, ord=float("inf"), dim=1) / 127).clamp_min(1e-12)
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        block = weight[start:start + rows] / scale[start:start + rows, None]
        quantized[start:start + rows] = block.round_().clamp_(-127, 127)
    return quantized, scale.to(torch.bfloat16)


def kernel_problem() -> str | None:
    try:
        torch._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(8, 32, dtype=torch.int8),
                                  torch.ones(8, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError) as exc:
        return f"this PyTorch build has no CPU int8 weight-only kernel ({exc})"
    return None
