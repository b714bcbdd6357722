"""Direct calls into the CPU's C kernels, shared by the CPU forwards (cpu_llama.py, cpu_head.py).

A forward checks its tensors once per step and then calls the kernels without their Python wrappers' checks
and allocations, which cost more than the kernels at batch 1.
"""

from dataclasses import dataclass

import torch

from kernels import linear_cpu
from kernels.cpu_build import DTYPE_CODES
from worker_service.runtime.fast_linear import PackedLinear


@dataclass
class KernelLinear:
    """A packed projection: its kernel arguments, ready for a direct call."""

    weight_dtype: int
    weight: int  # packed weight's data pointer
    in_features: int
    out_features: int
    bias: int | None  # fp32 bias's data pointer
    tensors: tuple  # what the pointers point into, kept alive

    @classmethod
    def of(cls, module: PackedLinear) -> "KernelLinear":
        bias = module.bias
        return cls(
            module.weight_code,
            module.packed_weight.data_ptr(),
            module.in_features,
            module.out_features,
            bias.data_ptr() if bias is not None else None,
            (module.packed_weight, bias),
        )

    @classmethod
    def outputs(cls, module: PackedLinear, start: int, end: int) -> "KernelLinear | None":
        """The projection onto outputs [start, end) of `module` alone, on its packed weight's groups (each
        output's chain is the same, so each gets the same bits); None unless `start` begins a group (0 does)."""
        group = linear_cpu.group_out()
        if start % group:
            return None
        packed, bias = module.packed_weight[start // group : -(-end // group)], module.bias
        bias = bias[start:end] if bias is not None else None
        return cls(
            module.weight_code,
            packed.data_ptr(),
            module.in_features,
            end - start,
            bias.data_ptr() if bias is not None else None,
            (packed, bias),
        )


def project(layer: KernelLinear, source: torch.Tensor, target: torch.Tensor, target_stride: int | None = None) -> None:
    """target = source @ W.T + b, row by row: the packed linear kernel called directly (contiguous rows; the
    target's rows `target_stride` apart, default its width)."""
    status = linear_cpu.c_library().specdec_linear(
        DTYPE_CODES[source.dtype],
        source.data_ptr(),
        layer.in_features,
        source.shape[0],
        layer.in_features,
        layer.weight_dtype,
        layer.weight,
        layer.out_features,
        layer.bias,
        target.data_ptr(),
        target_stride or layer.out_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"linear_cpu failed (status {status}) for {source.shape[0]} rows")


class RopeTable:
    """A rotary embedding's cos and sin by position, as `rotary` (transformers' LlamaRotaryEmbedding) gives
    them: computed by the module over positions 0 .. n - 1 once, then indexed, so ten torch ops (~50 us a
    call on two cores) become two index_selects. Each element is the module's elementwise math on its own
    position (position x frequency, then cos and sin), so a row of the table is what calling the module on
    that position gives (tests/worker/runtime/test_fast_forward.py). The table doubles when a position
    passes its end. Rope types whose frequencies change with the longest position of a call ("dynamic" NTK,
    "longrope") call the module every time."""

    MIN_POSITIONS = 1024

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype):
        self.rotary, self.dtype = rotary, dtype
        rope_type = getattr(rotary, "rope_type", None)
        self.fixed = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        self.cos = self.sin = torch.empty((0, 0), dtype=dtype)

    def _module(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty((1, 1, 1), dtype=self.dtype)  # the module reads only its dtype and device
        cos, sin = self.rotary(probe, positions[None])
        return cos[0].contiguous(), sin[0].contiguous()

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `positions` ([T] int64 on the CPU): [T, head_dim] each, contiguous."""
        if not self.fixed:
            return self._module(positions)
        end = int(positions.max()) + 1 if positions.numel() else 0
        if end > self.cos.shape[0]:
            self.cos, self.sin = self._module(torch.arange(max(self.MIN_POSITIONS, 1 << (end - 1).bit_length())))
        return self.cos[positions], self.sin[positions]
