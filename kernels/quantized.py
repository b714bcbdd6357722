"""Block-quantized weights (llama.cpp's q8_0 and q4_1) for the CPU linear kernel (kernels/linear_cpu.py).

A weight [out, in] is a row of blocks per output, each block holding QBLOCK
(32) consecutive inputs in GGUF's bytes:

    q8_0  34 bytes: d (fp16), q[32] (int8)              w = d * q
    q4_1  20 bytes: d, m (fp16), 16 bytes of nibbles    w = d * q + m, q in 0..15
          (byte j: input j in its low nibble, input j + 16 in its high one)

These are the bytes a GGUF file holds, so a GGUF's tensors are served as
they are; other weights are quantized with gguf-py (llama.cpp's reference
quantizers, bit for bit). `dequantize` gives the fp32 values transformers
loads from a GGUF, and the kernel dequantises to exactly those values in
registers (kernels/csrc/linear_cpu.c), so a quantized linear is bitwise the
fp32 kernel on `dequantize()`'s weights, at 4.5 to 5 bits per weight.
"""

from dataclasses import dataclass

import gguf
import numpy as np
import torch

QBLOCK = 32  # inputs per block (kernels/csrc/linear_cpu.c's QBLOCK)


@dataclass(frozen=True)
class Format:
    code: int  # kernels/csrc/dtypes.h: packed by pack(), fp32 activations
    int8_code: int  # packed by pack_int8(), activations quantized to 8 bits (kernels/csrc/linear_int8.h)
    ggml: gguf.GGMLQuantizationType
    block_bytes: int


# The block formats the kernel serves, by --dtype name: one place for the list.
FORMATS = {
    "q8_0": Format(3, 5, gguf.GGMLQuantizationType.Q8_0, 34),
    "q4_1": Format(4, 6, gguf.GGMLQuantizationType.Q4_1, 20),
}
FORMAT_OF_GGML = {fmt.ggml: name for name, fmt in FORMATS.items()}


@dataclass(frozen=True)
class BlockWeight:
    """A linear layer's weight [out, in] as blocks of FORMATS[format]."""

    format: str
    blocks: torch.Tensor  # uint8 [out, in / QBLOCK * block_bytes]: GGUF's bytes, a row per output
    in_features: int

    def __post_init__(self) -> None:
        fmt = FORMATS[self.format]
        if (
            self.in_features % QBLOCK
            or self.blocks.dtype != torch.uint8
            or self.blocks.dim() != 2
            or self.blocks.shape[1] != self.in_features // QBLOCK * fmt.block_bytes
        ):
            raise ValueError(
                f"{self.format} blocks {tuple(self.blocks.shape)} do not hold {self.in_features} inputs "
                f"per row (a multiple of {QBLOCK})"
            )

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str) -> "BlockWeight":  # weight [out, in]
        """llama.cpp's reference quantization of `weight` (from fp32) to `format`; in % QBLOCK == 0."""
        values = weight.detach().float().contiguous().numpy()
        blocks = gguf.quants.quantize(values, FORMATS[format].ggml)  # [out, in / QBLOCK * block_bytes]
        return cls(format, torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1])

    def dequantize(self) -> torch.Tensor:  # [out, in] fp32
        """The weight's fp32 values, as gguf-py and transformers dequantise them."""
        values = gguf.quants.dequantize(self.blocks.numpy(), FORMATS[self.format].ggml)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def take_rows(self, rows: torch.Tensor) -> "BlockWeight":
        """The weight of outputs `rows` (int64), in that order: blocks never span outputs."""
        return BlockWeight(self.format, self.blocks[rows].contiguous(), self.in_features)

    @staticmethod
    def cat(weights: list["BlockWeight"]) -> "BlockWeight":
        """Weights of one format and input size stacked along the outputs (a fused projection)."""
        first = weights[0]
        assert all(w.format == first.format and w.in_features == first.in_features for w in weights)
        return BlockWeight(first.format, torch.cat([w.blocks for w in weights]), first.in_features)


def _grouped_blocks(weight: BlockWeight, group_out: int) -> torch.Tensor:  # uint8 [G, O, B, block bytes]
    """The weight's blocks per group of `group_out` outputs (zero-padded: d = m = 0 gives zero weights)."""
    out_features = weight.out_features
    num_groups = -(-out_features // group_out)
    num_blocks = weight.in_features // QBLOCK
    block_bytes = FORMATS[weight.format].block_bytes
    blocks = torch.zeros((num_groups * group_out, num_blocks, block_bytes), dtype=torch.uint8)
    blocks[:out_features] = weight.blocks.view(out_features, num_blocks, block_bytes)
    return blocks.view(num_groups, group_out, num_blocks, block_bytes)


def _per_output(field: torch.Tensor) -> torch.Tensor:  # [G, O, B, n] -> [G, B, O * n]: output by output
    num_groups, _, num_blocks, _ = field.shape
    return field.permute(0, 2, 1, 3).reshape(num_groups, num_blocks, -1)


def pack_int8(weight: BlockWeight, group_out: int) -> torch.Tensor:  # uint8 [G, in / QBLOCK, record bytes]
    """The integer kernel's layout (kernels/csrc/linear_int8.h's header): per group and block of inputs, one
    record of the scales, the minimums (q4_1) and the values 4 inputs of an output to a 32-bit lane (q8_0:
    q + 128; q4_1: GGUF's own bytes, byte j holding inputs j and j + 16, regrouped by 4)."""
    blocks = _grouped_blocks(weight, group_out)  # [G, O, B, bytes]
    num_groups, _, num_blocks, _ = blocks.shape
    if weight.format == "q8_0":
        scales, values = [blocks[..., :2]], blocks[..., 2:] ^ 0x80  # q + 128 as a byte
    else:
        scales, values = [blocks[..., :2], blocks[..., 2:4]], blocks[..., 4:]
    lanes = values.reshape(num_groups, group_out, num_blocks, -1, 4).permute(0, 2, 3, 1, 4)  # [G, B, k, O, 4]
    fields = [_per_output(field) for field in scales] + [lanes.reshape(num_groups, num_blocks, -1)]
    return torch.cat(fields, dim=-1).contiguous()


def linear_int8_reference(
    x: torch.Tensor,  # [N, in] fp32
    weight: BlockWeight,
    bias: torch.Tensor | None,  # [out] fp32
) -> torch.Tensor:  # [N, out] fp32
    """What the integer kernel computes (kernels/csrc/linear_int8.h), in PyTorch: each row's blocks of
    activations quantized to 8 bits, exact integer block sums, their fp32 chain over the blocks. The chain's
    fused multiply-adds are taken in float64 and rounded once more to fp32, so rare elements may differ from
    the kernel's in the last bit."""
    num_rows, num_blocks = x.shape[0], weight.in_features // QBLOCK
    xb = x.float().view(num_rows, num_blocks, QBLOCK)  # [N, B, 32]
    amax = xb.abs().amax(dim=-1, keepdim=True)  # [N, B, 1]
    scale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(xb * scale)  # [N, B, 32]: torch rounds half to even, as the kernel does
    dx = (amax / 127.0).squeeze(-1)  # [N, B]
    mx = dx * qx.sum(-1)  # [N, B] fp32
    raw = weight.blocks.view(weight.out_features, num_blocks, -1)  # [O, B, bytes]
    d = raw[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # [O, B]
    if weight.format == "q8_0":
        q, m = raw[..., 2:].contiguous().view(torch.int8).double(), None  # [O, B, 32]
    else:
        m = raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)  # [O, B]
        q = torch.cat([raw[..., 4:] & 15, raw[..., 4:] >> 4], dim=-1).double()  # [O, B, 32]: inputs in order
    sums = torch.einsum("nbj,obj->nob", qx.double(), q)  # [N, O, B]: exact integers
    acc = torch.zeros(num_rows, weight.out_features, dtype=torch.float32)
    for b in range(num_blocks):
        step = (d[None, :, b] * dx[:, None, b]).double() * sums[:, :, b] + acc.double()
        acc = step.float()
        if m is not None:
            acc = (m[None, :, b].double() * mx[:, None, b].double() + acc.double()).float()
    return acc + bias if bias is not None else acc


def pack(weight: BlockWeight, group_out: int) -> torch.Tensor:  # uint8 [G, in / QBLOCK, record bytes]
    """The kernel's layout (kernels/csrc/linear_cpu.c's header): per group of `group_out` outputs (zero-padded:
    d = m = 0 gives zero weights) and block of inputs, one record of the scales, the minimums (q4_1) and
    the values input by input."""
    blocks = _grouped_blocks(weight, group_out)  # [G, O, B, bytes]
    num_groups, _, num_blocks, _ = blocks.shape
    if weight.format == "q8_0":
        values = blocks[..., 2:].permute(0, 2, 3, 1)  # [G, B, input, O] int8 bytes
        fields = [_per_output(blocks[..., :2]), values.reshape(num_groups, num_blocks, -1)]
    else:
        nibbles = blocks[..., 4:]  # [G, O, B, 16]
        values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).permute(0, 2, 3, 1)  # [G, B, input, O] 0..15
        halves = values.reshape(num_groups, num_blocks, QBLOCK, group_out // 32, 2, 16)  # o = 32 h + 16 hi + t
        packed = halves[..., 0, :] | (halves[..., 1, :] << 4)  # [G, B, input, h, t]
        fields = [
            _per_output(blocks[..., :2]),
            _per_output(blocks[..., 2:4]),
            packed.reshape(num_groups, num_blocks, -1),
        ]
    return torch.cat(fields, dim=-1).contiguous()
