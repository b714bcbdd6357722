"""The row-wise ops of a Llama decoder layer as C kernels (kernels/csrc/layer_ops_cpu.c): residual add +
RMSNorm, rotary embedding in place, SiLU(gate) * up, and the K/V write into the paged cache. Batch invariant
by construction (each row alone, in a fixed order), rounded as `transformers`' Llama code rounds. Built on
first use like the other CPU kernels; ``available()`` is False without a C compiler, and callers then keep
the `transformers` forward.

The functions below check their tensors and state each kernel's contract (the tests call them);
worker_service/runtime/backends/cpu_llama.py checks its tensors once per step and runs a step's decoder layers
in one call, ``specdec_llama_layers`` (its arguments: ``StepArgs`` and ``LayerArgs`` below, as the C declares
them).
"""

import ctypes
import functools

import torch

from kernels.cpu_build import DTYPE_CODES, optional_library


@functools.lru_cache(maxsize=1)
def c_library():
    """The C library (its argument types declared), or None when it cannot be built here (logged once).
    Callers that validated their tensors once may call its functions directly
    (worker_service/runtime/backends/cpu_llama.py)."""
    return optional_library("layer_ops_cpu", bind, "the transformers forward")


class LinearArgs(ctypes.Structure):
    """A packed projection (kernels/linear_cpu.py's layout): struct LinearArgs of layer_ops_cpu.c."""

    _fields_ = [
        ("w_dtype", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class LayerArgs(ctypes.Structure):
    """One decoder layer's weights: struct LayerArgs of layer_ops_cpu.c."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", LinearArgs),
        ("o", LinearArgs),
        ("gate_up", LinearArgs),
        ("down", LinearArgs),
        ("scaling", ctypes.c_float),
    ]


_SHAPES = ("dtype", "num_tokens", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "num_threads")
_BUFFERS = ("residual", "x", "h", "attn", "qkv", "gate_up", "act", "cos", "sin")


class StepArgs(ctypes.Structure):
    """A step's shapes, buffers, cache and kernels: struct StepArgs of layer_ops_cpu.c (its comments say what
    each is)."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in _SHAPES),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in _BUFFERS),
        ("slot_mapping", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("query_start_loc", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        *((name, ctypes.c_void_p) for name in ("is_tree", "prefix_lens", "depths", "paths")),
        ("path_stride", ctypes.c_int64),
        ("key_caches", ctypes.c_void_p),
        ("value_caches", ctypes.c_void_p),
        ("cache_dtype", ctypes.c_int64),
        ("keys_transposed", ctypes.c_int64),
        ("linear", ctypes.c_void_p),
        ("attention", ctypes.c_void_p),
        ("aux", ctypes.c_void_p),
        ("aux_layers", ctypes.c_void_p),
        ("num_aux", ctypes.c_int64),
        ("failed_status", ctypes.c_int64),
    ]


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the C signatures on a loaded build of kernels/csrc/layer_ops_cpu.c."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    library.specdec_llama_layers.argtypes = [ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs), i64]
    library.specdec_add_rms_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32, i32]
    library.specdec_rope.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, ptr, i64, i32]
    library.specdec_silu_mul.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i32]
    library.specdec_write_kv.argtypes = [i32, i32, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i32]
    for function in (
        library.specdec_add_rms_norm,
        library.specdec_rope,
        library.specdec_silu_mul,
        library.specdec_write_kv,
        library.specdec_llama_layers,
    ):
        function.restype = i32
    return library


def available() -> bool:
    """True when the C kernels are built (or build now) on this machine."""
    return c_library() is not None


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPE_CODES


def add_rms_norm(
    x: torch.Tensor | None,  # [N, dim], or None: residual is the input as it is
    residual: torch.Tensor,  # [N, dim], updated in place to residual + x
    weight: torch.Tensor,  # [dim]
    eps: float,
    library: ctypes.CDLL | None = None,  # another build (bind()); default: this machine's
) -> torch.Tensor:  # [N, dim]: RMSNorm(residual) * weight
    """`residual += x` (rounded to the dtype), then the Llama RMSNorm of the sum."""
    assert _rows(residual) and weight.is_contiguous() and weight.dtype == residual.dtype
    assert x is None or (_rows(x) and x.shape == residual.shape and x.dtype == residual.dtype)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    num_rows, dim = residual.shape
    (library or c_library()).specdec_add_rms_norm(
        DTYPE_CODES[residual.dtype],
        x.data_ptr() if x is not None else None,
        x.stride(0) if x is not None else 0,
        residual.data_ptr(),
        residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out


def rope_(
    x: torch.Tensor,  # [N, >= num_heads * head_dim]: the heads to rotate at the start of each row
    num_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:  # [N, head_dim] each, x's dtype
    """Rotates the first num_heads heads of every row in place (Llama's rotate_half convention)."""
    assert _rows(x) and x.shape[1] >= num_heads * head_dim
    assert cos.shape == sin.shape == (x.shape[0], head_dim) and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert cos.dtype == sin.dtype == x.dtype
    status = c_library().specdec_rope(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        num_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"rope: head_dim {head_dim} must be even and at most 1024")


def silu_mul(
    gate_up: torch.Tensor,  # [N, 2 * dim]
    library: ctypes.CDLL | None = None,  # another build (bind()); default: this machine's
) -> torch.Tensor:  # [N, dim]
    """SiLU(gate) * up for rows holding gate then up (a fused gate/up projection's output)."""
    assert _rows(gate_up) and gate_up.shape[1] % 2 == 0
    num_rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, dim), dtype=gate_up.dtype)
    (library or c_library()).specdec_silu_mul(
        DTYPE_CODES[gate_up.dtype],
        gate_up.data_ptr(),
        gate_up.stride(0),
        num_rows,
        dim,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,  # [N, KVH, D] each, rows of one stride, heads contiguous
    slot_mapping: torch.Tensor,  # [N] int64
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], or [num_blocks, KVH, D, block_size] transposed
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    keys_transposed: bool = False,
) -> None:
    """Stores row i's K and V at cache slot slot_mapping[i] (what KVCache.write does with index_copy_), in the
    caches' dtype: k's, or bf16 from fp32 (rounded as torch rounds)."""
    assert k.shape == v.shape and k.stride() == v.stride() and k.stride(1) == k.shape[2] and k.stride(2) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.shape[2:] == k.shape[1:]
    assert key_cache.numel() == value_cache.numel()
    assert k.dtype == v.dtype in DTYPE_CODES and key_cache.dtype == value_cache.dtype in DTYPE_CODES
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == k.shape[:1]
    c_library().specdec_write_kv(
        DTYPE_CODES[k.dtype],
        DTYPE_CODES[key_cache.dtype],
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k.shape[0],
        k.shape[1] * k.shape[2],
        slot_mapping.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        value_cache.shape[1],
        keys_transposed,
    )
