"""Batch-invariant CPU linear layers: weights packed once for our C kernel (kernels/linear_cpu.py).

Why our own kernel: a library GEMM picks its kernel, blocking and summation
order by the shape and the CPU, so a row's rounding depends on how many rows
share the call. oneDNN's bf16 linear on the Intel (AMX) kind changed 17 of 40
rows between a 40-row call and smaller ones, and greedy bf16 speculation then
differed from plain decoding. kernels/csrc/linear_cpu.c computes every output
element as one fixed chain of fp32 multiply-adds, so a verify query's logits
are bitwise those of step-by-step decoding on any CPU, in fp32, bf16 and
fp16 (with the batch-invariant attention, kernels/paged_attention_cpu.py;
`tests/worker/runtime/test_fast_linear.py`, `tests/worker/runtime/test_forward_invariance.py`).

Projections that read the same input are fused: q/k/v of attention and
gate/up of the MLP become one packed matmul each (SHARED_INPUT_GROUPS), 4
calls per layer instead of 7, each with its own dispatch and thread fork/join.

A linear given llama.cpp's weight blocks (--dtype q8_0 / q4_1,
worker_service/runtime/quantization.py) is packed from those blocks instead
(kernels/quantized.py). With int8 activations (the default,
QUANTIZED_ACTIVATIONS) each row's inputs are quantized to 8 bits per block of
32 and multiplied in integers (kernels/csrc/linear_int8.h): a fixed chain per
element still, so still batch invariant, and an extra row costs a fraction of
the fp32 chain's; with fp32 activations it computes bitwise what the fp32
kernel computes on the blocks' dequantised weights.

Other devices keep `torch.nn.Linear` (cuBLAS on a GPU), and so does a CPU
without a C compiler (kernels/linear_cpu.py warns then).
"""

import collections
import logging

import torch

from kernels import linear_cpu, quantized
from kernels.cpu_build import DTYPE_CODES
from kernels.quantized import BlockWeight
from worker_service.runtime.dtypes import DEFAULT_QUANTIZED_ACTIVATIONS, QUANTIZED_ACTIVATIONS

logger = logging.getLogger(__name__)

# Sibling projections a `transformers` decoder layer calls one after another on the same tensor
# (Llama, Mistral, Qwen2/3 names): each group is fused into one matmul (see SharedInputLinears).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
BLOCK_WEIGHT = "block_weight"  # the attribute of a torch.nn.Linear that holds its BlockWeight (block_weight())


def block_weight(linear: torch.nn.Linear) -> BlockWeight | None:
    """The block-quantized weight a linear is served with (worker_service/runtime/quantization.py sets it), or None."""
    return getattr(linear, BLOCK_WEIGHT, None)


def quantize_linear(linear: torch.nn.Linear, format: str) -> BlockWeight:
    """Gives an fp32 linear blocks of `format` made from its weight (llama.cpp's quantizer), and sets the
    weight to their dequantised values (what the kernel computes with), in place."""
    blocks = BlockWeight.quantize(linear.weight, format)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())  # in place: a tied embedding keeps sharing it
    setattr(linear, BLOCK_WEIGHT, blocks)
    return blocks


class PackedLinear(torch.nn.Module):
    """`torch.nn.Linear` with its weight packed for kernels/linear_cpu.py; rows are computed independently.

    A linear that carries a BlockWeight (block_weight()) is packed from its blocks: its `weight` then holds
    their dequantised values, which the kernel reproduces exactly with fp32 activations, and to within the
    activations' 8-bit rounding with int8 ones (QUANTIZED_ACTIVATIONS)."""

    def __init__(self, linear: torch.nn.Linear, activations: str = DEFAULT_QUANTIZED_ACTIVATIONS):
        super().__init__()
        assert activations in QUANTIZED_ACTIVATIONS
        self.in_features, self.out_features = linear.in_features, linear.out_features
        blocks = block_weight(linear)
        if blocks is not None:
            fmt, group = quantized.FORMATS[blocks.format], linear_cpu.group_out()
            if activations == "int8":
                packed = quantized.pack_int8(blocks, group)  # [G, in / QBLOCK, record bytes]
                self.weight_format, self.weight_code = f"{blocks.format} x int8", fmt.int8_code
            else:
                packed = quantized.pack(blocks, group)  # [G, in / QBLOCK, record bytes]
                self.weight_format, self.weight_code = blocks.format, fmt.code
        else:
            packed = linear_cpu.pack_weight(linear.weight.detach())  # [G, in, GROUP_OUT]
            self.weight_format, self.weight_code = (
                str(linear.weight.dtype).removeprefix("torch."),
                DTYPE_CODES[linear.weight.dtype],
            )
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None  # [out] fp32
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_cpu.linear_cpu(
            x, self.packed_weight, self.out_features, self.bias, weight_code=self.weight_code
        )  # [..., out]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weights={self.weight_format}"
        )


class SharedInputLinears(torch.nn.Module):
    """Linear layers that read one input, as one PackedLinear over their stacked weights.

    The layer's code still calls each projection (a SharedInputSlice); the
    first call computes them all and the others take their slice, as long as
    they are handed the very same tensor object (`is`) and each takes its
    slice once: anything else is computed afresh, so a caller that does not
    follow the pattern is slower, never wrong. Once every slice is taken the
    group lets go of the input and the outputs (after a long prefill they are
    large, and the next step may be far off).
    """

    def __init__(self, linears: list[torch.nn.Linear], activations: str = DEFAULT_QUANTIZED_ACTIVATIONS):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(out), in]
        fused = torch.nn.Linear(
            weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device="meta"
        )  # no initialisation: the parameters are set below
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        if block_weight(linears[0]) is not None:  # fuse_shared_inputs groups only linears of one format
            setattr(fused, BLOCK_WEIGHT, BlockWeight.cat([block_weight(linear) for linear in linears]))
        if fused.bias is not None:
            fused.bias = torch.nn.Parameter(
                torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False
            )
        self.fused = PackedLinear(fused, activations)
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = []

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or self._outputs[index] is None:
            self._input, self._outputs = x, list(self.fused(x).split(self.sizes, dim=-1))
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input, self._outputs = None, []
        return out


class SharedInputSlice(torch.nn.Module):
    """One projection of a SharedInputLinears group, where the model calls it."""

    def __init__(self, group: SharedInputLinears, index: int):
        super().__init__()
        self.in_features, self.out_features = group.fused.in_features, group.sizes[index]
        self.index = index
        self._group = (group,)  # a tuple, not a submodule: the group is registered once, on the parent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group[0].output(x, self.index)


def fuse_shared_inputs(model: torch.nn.Module, activations: str = DEFAULT_QUANTIZED_ACTIVATIONS) -> int:
    """Fuses every SHARED_INPUT_GROUPS group of plain, same-shaped linears in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for names in SHARED_INPUT_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear for m in linears):
                continue
            formats = {
                (m.in_features, m.weight.dtype, m.bias is None, getattr(block_weight(m), "format", None))
                for m in linears
            }
            if len(formats) != 1:
                continue
            group = SharedInputLinears(linears, activations)
            setattr(parent, "_".join(names), group)
            for index, name in enumerate(names):
                setattr(parent, name, SharedInputSlice(group, index))
            count += 1
    return count


def can_pack(model: torch.nn.Module) -> bool:
    """True for a CPU model in a dtype the C kernel takes, once the kernel is built (it builds now)."""
    return model.device.type == "cpu" and model.dtype in linear_cpu.DTYPE_CODES and linear_cpu.available()


def pack_linears(model: torch.nn.Module, activations: str = DEFAULT_QUANTIZED_ACTIVATIONS) -> int:
    """Replaces every `torch.nn.Linear` of a CPU model by a PackedLinear in place, fusing the groups of
    SHARED_INPUT_GROUPS first; returns how many linears it replaced. `activations`: how block-quantized ones
    take their inputs (QUANTIZED_ACTIVATIONS)."""
    if not can_pack(model):
        return 0
    num_fused = fuse_shared_inputs(model, activations)
    targets = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module, activations))
    num_grouped = sum(len(m.sizes) for m in model.modules() if isinstance(m, SharedInputLinears))
    formats = collections.Counter(m.weight_format for m in model.modules() if isinstance(m, PackedLinear))
    logger.info(
        "packed %d linear layers for the batch-invariant kernel (weights: %s), %d of them in %d fused groups",
        len(targets) + num_grouped,
        ", ".join(f"{n} {f}" for f, n in formats.items()),
        num_grouped,
        num_fused,
    )
    return len(targets) + num_grouped
