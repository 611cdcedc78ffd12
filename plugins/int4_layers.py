"""int4 weights in groups along the input dimension (bf16 scale and offset each), their Linear and Embedding
modules and the CPU kernel they run; shared by ``quantize="int4"`` and the int4 self-draft."""

from __future__ import annotations

import torch
from torch import nn

from hf_accel.plugin import SavedAsFloat, weight_and_bias

GROUP_SIZES = (32, 64, 128, 256)


def bytes_per_weight(group_size: int) -> float:
    """What one weight takes: its 4-bit code and its share of its group's bf16 scale and offset."""
    return 0.5 + 4 / group_size


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes ``q`` in 0..15 (int32, ``[out, in]``), and per group the scale and minimum
    (``[out, in // group_size]``), so that ``weight ≈ q * scale + minimum``."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    minimum, maximum = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((maximum - minimum) / 15).clamp_min(1e-8)
    codes = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(rows, columns), scale, minimum


def unpack_int4(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The ``[rows, columns]`` codes that ``_convert_weight_to_int4pack_for_cpu`` packed into ``packed``.

    The packed layout is the kernel's and undocumented, so it is read off the packer itself: packing each
    base-16 digit of every position's index tells where each position's nibble lands.
    """
    count = rows * columns
    index = torch.arange(count, dtype=torch.int64).view(rows, columns)
    source = torch.zeros(2 * packed.numel(), dtype=torch.int64)
    for shift in range(0, max(count - 1, 1).bit_length(), 4):
        digits = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> shift) & 15).to(torch.int32), 1)
        source |= _nibbles(digits).to(torch.int64) << shift
    codes = torch.empty(count, dtype=torch.int32)
    codes[source] = _nibbles(packed.cpu()).to(torch.int32)
    return codes.view(rows, columns).to(packed.device)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten()


class Int4WeightLinear(SavedAsFloat):
    """``y = x @ dequant(W)^T + b`` through aten's int4 CPU kernel. Built from an ``nn.Linear`` or ``Conv1D``
    whose input size is a multiple of ``group_size`` and output size a multiple of 16 (:meth:`takes`)."""

    #: The packing kernel takes output sizes in multiples of this.
    OUT_MULTIPLE = 16
    #: Rows coded and packed at a time, so that coding a large head holds ~12 bytes a weight of only this many
    #: rows. The packer lays out each block of 64 rows (32 below AVX-512) on its own, so any multiple of 64
    #: packs the same bytes as the whole weight at once.
    PACK_ROWS = 4096

    @classmethod
    def takes(cls, weight: torch.Tensor, group_size: int) -> bool:
        """Whether the kernel takes a ``[out, in]`` weight of this shape in groups of ``group_size``."""
        rows, columns = weight.shape
        return columns % group_size == 0 and rows % cls.OUT_MULTIPLE == 0

    def __init__(self, linear: nn.Module, group_size: int) -> None:
        super().__init__()
        self.remember_layout(linear)
        weight, bias = weight_and_bias(linear)
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        packed, scales_and_zeros = self._pack(weight)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, columns = weight.shape
        packed = torch.empty(rows, columns // 2, dtype=torch.uint8, device=weight.device)
        scales_and_zeros = torch.empty(columns // self.group_size, rows, 2, dtype=torch.bfloat16, device=weight.device)
        for start in range(0, rows, self.PACK_ROWS):
            block = slice(start, start + self.PACK_ROWS)
            codes, scale, minimum = quantize_groups(weight[block], self.group_size)
            # The kernel computes (q - 8) * scale + zero, so its "zero" is the value of the middle code.
            scales_and_zeros[:, block] = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1)
            packed[block] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return packed, scales_and_zeros

    def dequantized(self) -> torch.Tensor:
        codes = unpack_int4(self.packed_weight, self.out_features, self.in_features).float()
        scale, zero = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [out, groups] each
        groups = codes.unflatten(-1, (-1, self.group_size)) - 8
        return (groups * scale[..., None] + zero[..., None]).flatten(-2)

    def quantize_from(self, weight: torch.Tensor) -> None:
        packed, scales_and_zeros = self._pack(weight)
        self.packed_weight.copy_(packed)
        self.scales_and_zeros.copy_(scales_and_zeros)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {self.group_size}, bf16 activations")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, self.group_size,
                                                          self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Embedding(SavedAsFloat):
    """An embedding table as 4-bit codes, two per byte, with a bf16 scale and minimum per group of columns."""

    def __init__(self, embedding: nn.Embedding, group_size: int) -> None:
        super().__init__()
        self.remember_layout(embedding)
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.padding_idx = embedding.padding_idx
        self.group_size = group_size
        for name, tensor in zip(("nibbles", "scale", "minimum"), self._encode(embedding.weight.detach())):
            self.register_buffer(name, tensor)

    def _encode(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, scale, minimum = quantize_groups(weight, self.group_size)
        nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        return nibbles, scale.to(torch.bfloat16), minimum.to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 groups of {self.group_size}"

    def dequantized_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def dequantized(self) -> torch.Tensor:
        return self.forward(torch.arange(self.num_embeddings, device=self.nibbles.device))

    def quantize_from(self, weight: torch.Tensor) -> None:
        for buffer, tensor in zip((self.nibbles, self.scale, self.minimum), self._encode(weight)):
            buffer.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nibbles = self.nibbles[ids]
        codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).flatten(-2).float()
        groups = codes.unflatten(-1, (-1, self.group_size))
        values = groups * self.scale[ids].float()[..., None] + self.minimum[ids].float()[..., None]
        return values.flatten(-2)


def kernel_problem() -> str | None:
    try:
        codes = torch.zeros(16, 64, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, 64, dtype=torch.bfloat16), packed, 32,
                                                  torch.ones(2, 16, 2, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"this PyTorch build has no CPU int4 weight-only kernel ({exc})"
    return None
