"""A linear layer and an RMSNorm whose every row is computed the same way whatever the number of rows.

cuBLAS chooses its kernel, its tiles and whether to split the reduction (split-K) by the matrix's shape, and
torch's reductions choose their thread layout by the number of rows: so on a GPU a row's result changes with
how many rows share the step, and greedy speculation (k + 1 rows per sequence) stops matching plain decoding
(one row). Measured on an H200 (bench/results/gpu_check.json, invariance): bf16 logits differ from a row's
logits alone once 128 decode rows (or 32 verify chains) share the forward, fp32 ones from 2 rows on; holding
cuBLAS's workspace to no split-K made bf16 worse (from 8 rows on).

Here the shapes are ours:
- `linear_triton`: y = x @ w.T (+ b). K is cut in splits (k_splits, by N and K alone); each split's sum is
  taken over its K in BLOCK_K steps, in fp32, for a BLOCK_M x BLOCK_N tile of y (the tile's shape fixed,
  BLOCK_N by N alone), and the splits' sums are added in order. So each output element's sum is taken in the
  same order for any M, and no program's work depends on another row. A step of few rows (a decode) runs a
  program per split, so that its few tiles still spread the weight reads over the GPU; more rows run a
  program per tile over all its splits: the same operations either way.
  fp32 inputs are multiplied in full fp32 ("ieee"), never TF32.
- `rms_norm_triton`: `transformers`' LlamaRMSNorm, one program per row, the whole row in one block.

Each has a PyTorch reference of the same signature (`linear_ref`, `rms_norm_ref`) for the tests; neither
reference is batch invariant on a GPU, which is why the kernels exist.
"""

import torch

from kernels._triton import HAS_TRITON, INTERPRETED

BLOCK_M = 64  # fixed: the tensor-core instruction, and so each row's arithmetic, must not change with M
BLOCK_K = 64
# Splits of K (k_splits): enough programs for a decode step's few rows, pieces of at least 4 blocks, in
# weights of at least 2M elements (smaller ones read in less time than the second kernel's launch costs);
# up to SPLIT_ROWS rows (one row tile) run a program per split.
SPLIT_PROGRAMS = 512
MIN_SPLIT_BLOCKS = 4
MIN_SPLIT_WEIGHTS = 1 << 21
SPLIT_ROWS = BLOCK_M

if HAS_TRITON:
    from kernels._triton import rounded_to, split_sums_added, tl, triton

    @triton.jit
    def _split_sum(
        x_rows,
        w_rows,
        row_ok,
        col_ok,
        k_lo,
        K,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K,
    ):
        """One split's sum over k in [k_lo, k_lo + SPLIT_K) & [0, K), BLOCK_K at a time, ascending, from zero."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(k_lo, tl.minimum(k_lo + SPLIT_K, K), BLOCK_K):
            k = start + ks
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            if UPCAST:  # Triton's interpreter multiplies bf16 wrongly; bf16 products are exact in fp32
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit
    def _linear_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        b_ptr,  # [N] (read only when HAS_BIAS)
        y_ptr,  # [M, N] (output, when ALL_SPLITS)
        part_ptr,  # [SPLITS, M, N] fp32 (output, when not ALL_SPLITS)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        SPLITS,
        SPLIT_K,  # K's elements per split, a multiple of BLOCK_K
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        ALL_SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program per (BLOCK_N columns, BLOCK_M rows) tile. ALL_SPLITS: y = ((0 + s_0) + s_1) + ... (+ b),
        s_i split i's sum (_split_sum); else one program per (tile, split) stores s_i into part[i], and
        _sum_splits_kernel adds them in the same order: the same fp32 operations either way."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        if ALL_SPLITS:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(0, SPLITS):
                total += _split_sum(
                    x_rows,
                    w_rows,
                    row_ok,
                    col_ok,
                    split * SPLIT_K,
                    K,
                    IEEE,
                    UPCAST,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    SPLIT_K,
                )
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
            dtype = y_ptr.dtype.element_ty  # rounded on the bits, as _sum_splits_kernel rounds
            tl.store(y, rounded_to(total, dtype).to(dtype), mask=row_ok[:, None] & col_ok[None, :])
        else:
            split = tl.program_id(2)
            acc = _split_sum(
                x_rows, w_rows, row_ok, col_ok, split * SPLIT_K, K, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
            )
            part = part_ptr + (split.to(tl.int64) * M + rows.to(tl.int64)[:, None]) * N + cols[None, :]
            tl.store(part, acc, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(
        part_ptr, b_ptr, y_ptr, M, N, SPLITS, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """y[m, n] = ((0 + part[0, m, n]) + part[1, m, n]) + ... (+ b[n]), _linear_kernel's ALL_SPLITS order."""
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = index < M * N
        total = split_sums_added(part_ptr, index, ok, SPLITS, M, N)
        col = index % N
        if HAS_BIAS:
            total += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty  # rounded on the bits: the same as a consumer of the splits (layer_ops)
        tl.store(y_ptr + (index // N) * stride_ym + col, rounded_to(total, dtype).to(dtype), mask=ok)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK_H: tl.constexpr):
        """Row r: y = w * (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype first, as LlamaRMSNorm does."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H]
        variance = tl.sum(x * x, axis=0) / H
        normed = rounded_to(x / tl.sqrt(variance + eps), y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def block_n(n: int) -> int:
    """Columns per program: a function of N alone (never of M), small enough that a decode step's few rows
    still spread the weight reads over the GPU's multiprocessors."""
    return 32 if n <= 8192 else 64


def k_splits(n: int, k: int) -> tuple[int, int]:
    """(splits, elements of K per split): K's reduction cut in pieces so that a step of few rows runs at least
    SPLIT_PROGRAMS programs (the weight reads of a decode spread over every multiprocessor, several programs
    each), no piece under MIN_SPLIT_BLOCKS blocks of BLOCK_K, no split of a weight under MIN_SPLIT_WEIGHTS.
    A function of N and K alone, so each output element's sum is cut the same way for any M."""
    tiles, blocks = -(-n // block_n(n)), -(-k // BLOCK_K)
    if n * k < MIN_SPLIT_WEIGHTS:
        return 1, blocks * BLOCK_K
    splits = 1
    while tiles * splits < SPLIT_PROGRAMS and blocks // (2 * splits) >= MIN_SPLIT_BLOCKS:
        splits *= 2
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split * BLOCK_K


def linear_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ b [N]) -> [..., N] in x's dtype; batch invariant (module docstring)."""
    return _linear(x, w, b, sum_splits=True)


def linear_split_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T as linear_triton computes it, but where it would add the splits' sums with a
    second kernel, those sums themselves: [S, M, N] fp32, for a consumer that adds them in order, from zero, and
    rounds the total to x's dtype, as that kernel does (layer_ops.add_rms_norm_triton); else y [M, N]."""
    assert x.dim() == 2
    return _linear(x, w, None, sum_splits=False)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, sum_splits: bool) -> torch.Tensor:
    assert HAS_TRITON, "triton is not importable"
    assert w.dim() == 2 and w.stride(1) == 1 and x.shape[-1] == w.shape[1]
    assert x.dtype == w.dtype and x.device == w.device
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return y.view(*x.shape[:-1], n)
    bn = block_n(n)
    splits, split_k = k_splits(n, k)
    # Few rows: a program per (tile, split), the splits summed by a second kernel. More rows fill the GPU with
    # row tiles: a program per tile sums its splits in turn. The same operations in the same order either way.
    all_splits = splits == 1 or m > SPLIT_ROWS
    part = y if all_splits else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, BLOCK_M), 1 if all_splits else splits)
    _linear_kernel[grid](
        rows,
        w,
        b if b is not None else w,
        y,
        part,
        m,
        n,
        k,
        rows.stride(0),
        w.stride(0),
        y.stride(0),
        splits,
        split_k,
        HAS_BIAS=b is not None,
        IEEE=x.dtype == torch.float32,
        UPCAST=INTERPRETED and x.dtype != torch.float32,
        ALL_SPLITS=all_splits,
        BLOCK_M=BLOCK_M,
        BLOCK_N=bn,
        BLOCK_K=BLOCK_K,
    )
    if not all_splits and not sum_splits:
        return part
    if not all_splits:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, b if b is not None else w, y, m, n, splits, y.stride(0), HAS_BIAS=b is not None, BLOCK=block
        )
    return y.view(*x.shape[:-1], n)


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The same function through torch (in fp32, then rounded to x's dtype)."""
    y = x.float() @ w.float().T
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm(x) over the last dimension, one program per row; batch invariant (module docstring)."""
    assert HAS_TRITON, "triton is not importable"
    assert w.dim() == 1 and x.shape[-1] == w.shape[0] and x.device == w.device
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    h = rows.shape[1]
    block = triton.next_power_of_2(h)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, w, y, h, rows.stride(0), y.stride(0), eps, BLOCK_H=block, num_warps=min(16, max(1, block // 256))
        )
    return y.view(x.shape)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`transformers`' LlamaRMSNorm.forward."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return w * hidden.to(x.dtype)
