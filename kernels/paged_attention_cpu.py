"""The CPU paged attention: batch invariant, a C kernel (kernels/csrc/paged_attention_cpu.c).

Same contract as ``kernels.paged_attention`` (packed multi-token queries over
a paged KV cache, causal per sequence or along draft trees, GQA), with one more guarantee: a query
row's output does not depend on how many rows, heads or sequences share the
call. A (k+1)-token verify query therefore gets bitwise the attention output
k+1 single-token decode steps would (and a draft tree's row what a decode at
its position over its path gives), so greedy speculation emits exactly
plain decoding's tokens in bf16 too (the linear layers are batch invariant
as well: worker_service/runtime/fast_linear.py). SDPA is not: its blocking, and so
its rounding, depends on the number of query rows.

The kernel is built on first use (kernels/cpu_build.py); without a C
compiler ``available()`` is False and the dispatcher falls back to SDPA.
"""

import ctypes
import functools

import torch

from kernels.cpu_build import DTYPE_CODES, KernelBuildError, optional_library
from kernels.draft_tree import DraftTrees

MAX_HEAD_DIM = 256  # kernels/csrc/paged_attention_cpu.c keeps rows of this many floats on the stack
KEY_TILE = 16  # keys the C kernel scores side by side: a block_size multiple of it reads transposed keys whole


@functools.lru_cache(maxsize=1)
def kernel():
    """The C function, or None when it cannot be built here (logged once)."""
    return optional_library(
        "paged_attention_cpu", bind, "SDPA (greedy speculation in bf16/fp16 may then differ from plain decoding)"
    )


def bind(library: ctypes.CDLL):
    """The C function of a loaded build of kernels/csrc/paged_attention_cpu.c, its signature declared.
    KernelBuildError for a build from before the cache dtype argument (bench/bench_kernel_revisions.py builds
    old revisions): the CPU forward calls the function through a C pointer, with this signature."""
    if not hasattr(library, "specdec_paged_attention_takes_cache_dtype"):
        raise KernelBuildError("this build of the attention kernel predates its cache dtype argument")
    function = library.specdec_paged_attention
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    causal = [i32, i32, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float]
    function.restype = i32
    function.argtypes = [*causal, ptr, ptr, ptr, ptr, i64, i32, i32]
    return function


def available() -> bool:
    """True when the C kernel is built (or builds now) on this machine."""
    return kernel() is not None


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True for inputs the kernel takes: CPU tensors of one supported dtype (or a bf16 cache under fp32
    queries), head_dim <= MAX_HEAD_DIM."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPE_CODES
        and cache_dtype_fits(query.dtype, key_cache.dtype)
        and query.shape[-1] <= MAX_HEAD_DIM
    )


def cache_dtype_fits(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """True where the kernel reads a cache of `cache_dtype` under queries of `dtype`: the same dtype, or a bf16
    cache under fp32 queries (--kv-cache-dtype bfloat16 for an fp32 or block-quantized model)."""
    return cache_dtype == dtype or (dtype == torch.float32 and cache_dtype == torch.bfloat16)


def paged_attention_cpu(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], or [num_blocks, KVH, D, block_size] transposed
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    trees: DraftTrees | None = None,
    function=None,  # another build (bind()'s); default: this machine's
    keys_transposed: bool = False,
) -> torch.Tensor:  # [T, H, D], contiguous
    """Runs the C kernel (see the module docstring); ``available()`` must be True."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = value_cache.shape
    assert supports(query, value_cache) and key_cache.dtype == value_cache.dtype
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert num_heads % num_kv_heads == 0
    assert (
        key_cache.shape == (value_cache.shape[0], num_kv_heads, head_dim, block_size)
        if keys_transposed
        else (key_cache.shape == value_cache.shape)
    )
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    trees = contiguous_trees(trees, block_tables.shape[0], num_tokens)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)  # [T, H, D]
    if num_tokens == 0:
        return out
    status = (function or kernel())(
        DTYPE_CODES[query.dtype],
        DTYPE_CODES[key_cache.dtype],
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        block_tables.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        *tree_arguments(trees),
        keys_transposed,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged_attention_cpu failed (status {status}) for head_dim {head_dim}")
    return out


def contiguous_trees(trees: DraftTrees | None, num_seqs: int, num_tokens: int) -> DraftTrees | None:
    """`trees` as the kernel reads them (int32, contiguous), shapes checked; None stays None."""
    if trees is None:
        return None
    trees = DraftTrees(
        *(t.to(torch.int32).contiguous() for t in (trees.is_tree, trees.prefix_lens, trees.depths, trees.paths))
    )
    assert trees.is_tree.shape == trees.prefix_lens.shape == (num_seqs,)
    assert trees.depths.shape == (num_tokens,) and trees.paths.shape[0] == num_tokens
    return trees


def tree_arguments(trees: DraftTrees | None) -> tuple:
    """The kernel's five tree arguments for `contiguous_trees`' result (NULLs without trees)."""
    if trees is None:
        return None, None, None, None, 0
    return (
        trees.is_tree.data_ptr(),
        trees.prefix_lens.data_ptr(),
        trees.depths.data_ptr(),
        trees.paths.data_ptr(),
        trees.paths.stride(0),
    )
