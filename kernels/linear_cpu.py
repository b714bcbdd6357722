"""The CPU linear layer: batch invariant by construction, a C kernel (kernels/csrc/linear_cpu.c).

``linear_cpu(x, pack_weight(w), out_features, bias)`` is ``F.linear(x, w,
bias)`` where every output element is one fixed chain of fp32 fused
multiply-adds over the input features, in order. Its bits therefore depend on
that row's input and the weights only: not on how many rows share the call,
nor on the CPU's vector width (AVX-512, AVX2 and scalar code give the same
result). Library GEMMs (oneDNN, MKL) pick kernels, blockings and split sums by
the shape and the CPU, so a row's rounding changes with the batch: a verify
step's logits would differ from the decode steps it replaces.

The kernel is built on first use (kernels/cpu_build.py); without a C
compiler ``available()`` is False and callers use ``F.linear``.
"""

import ctypes
import functools

import torch

from kernels.cpu_build import DTYPE_CODES, optional_library


@functools.lru_cache(maxsize=1)
def c_library():
    """The C library, or None when it cannot be built here (logged once)."""
    return optional_library(
        "linear_cpu", bind, "torch's linear (greedy speculation may then differ from plain decoding)"
    )


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the C signatures on a loaded build of kernels/csrc/linear_cpu.c."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.specdec_linear.argtypes = [i32, ptr, i64, i64, i64, i32, ptr, i64, ptr, ptr, i64, i32]
    library.specdec_linear.restype = i32
    library.specdec_linear_group_out.restype = i32
    library.specdec_linear_quant_block.restype = i32
    return library


def available() -> bool:
    """True when the C kernel is built (or builds now) on this machine."""
    return c_library() is not None


def group_out() -> int:
    """Outputs per packed weight group (the kernel's GROUP_OUT)."""
    return c_library().specdec_linear_group_out()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [G, in, GROUP_OUT], bf16: [G, in/2, GROUP_OUT, 2]
    """`weight` [out, in] laid out for the kernel: groups of GROUP_OUT outputs (zero-padded), each
    [in, GROUP_OUT]; in bf16 each [ceil(in / 2), GROUP_OUT, 2], input pairs side by side (in padded to even)."""
    out_features, in_features = weight.shape
    group = group_out()
    num_groups = -(-out_features // group)
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded_in = -(-in_features // pair) * pair
    padded = torch.zeros((num_groups * group, padded_in), dtype=weight.dtype)  # [G * GROUP_OUT, in']
    padded[:out_features, :in_features] = weight
    packed = padded.view(num_groups, group, padded_in // pair, pair).permute(0, 2, 1, 3).contiguous()
    return packed if pair == 2 else packed.squeeze(-1)  # [G, in'/pair, GROUP_OUT(, pair)]


def linear_cpu(
    x: torch.Tensor,  # [..., in]
    packed_weight: torch.Tensor,  # pack_weight's, or for block-quantized weights kernels/quantized.pack's
    out_features: int,
    bias: torch.Tensor | None,  # [out] fp32, or None
    library: ctypes.CDLL | None = None,  # another build (bind()); default: this machine's
    weight_code: int | None = None,  # kernels/csrc/dtypes.h; default: the packed weight's dtype's
) -> torch.Tensor:  # [..., out], x's dtype
    """Runs the C kernel (see the module docstring); ``available()`` must be True."""
    in_features = x.shape[-1]
    assert x.device.type == "cpu" and x.dtype in DTYPE_CODES and packed_weight.is_contiguous()
    if weight_code is None:
        assert packed_weight.dtype in DTYPE_CODES
        assert packed_weight.dtype != torch.bfloat16 or x.dtype == torch.bfloat16
        pair = 2 if packed_weight.dim() == 4 else 1
        assert packed_weight.shape[1] == -(-in_features // pair), "the packed weight has another number of inputs"
        weight_code = DTYPE_CODES[packed_weight.dtype]
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == out_features)
    rows = x.reshape(-1, in_features)  # [N, in]: a view where the layout allows
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype)  # [N, out]
    if num_rows:
        status = (library or c_library()).specdec_linear(
            DTYPE_CODES[x.dtype],
            rows.data_ptr(),
            rows.stride(0),
            num_rows,
            in_features,
            weight_code,
            packed_weight.data_ptr(),
            out_features,
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"linear_cpu failed (status {status}: 1 is no scratch memory) for {num_rows} rows")
    return out.view(*x.shape[:-1], out_features)
