"""A linear layer and an RMSNorm whose every row is computed the same way whatever the number of rows.

cuBLAS chooses its kernel, its tiles and whether to split the reduction (split-K) by the matrix's shape, and
torch's reductions choose their thread layout by the number of rows: so on a GPU a row's result changes with
how many rows share the step, and greedy speculation (k + 1 rows per sequence) stops matching plain decoding
(one row). Measured on an H200 (bench/results/gpu_check.json, invariance): bf16 logits differ from a row's
logits alone once 128 decode rows (or 32 verify chains) share the forward, fp32 ones from 2 rows on; holding
cuBLAS's workspace to no split-K made bf16 worse (from 8 rows on).

Here the shapes are ours:
- `linear_triton`: y = x @ w.T (+ b). One program computes a BLOCK_M x BLOCK_N tile of y with one loop over
  K in BLOCK_K steps, accumulating in fp32. The tile shape is fixed (BLOCK_N by N alone), so each output
  element's sum is taken in the same order for any M, and no program's work depends on another row.
  fp32 inputs are multiplied in full fp32 ("ieee"), never TF32.
- `rms_norm_triton`: `transformers`' LlamaRMSNorm, one program per row, the whole row in one block.

Each has a PyTorch reference of the same signature (`linear_ref`, `rms_norm_ref`) for the tests; neither
reference is batch invariant on a GPU, which is why the kernels exist.
"""

import os

import torch

from kernels._triton import HAS_TRITON

# Under Triton's interpreter (the CPU tests) half-precision operands are multiplied in fp32 (see the kernel).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_M = 64  # fixed: the tensor-core instruction, and so each row's arithmetic, must not change with M
BLOCK_K = 64

if HAS_TRITON:
    from kernels._triton import tl, triton

    @triton.jit
    def _linear_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        b_ptr,  # [N] (read only when HAS_BIAS)
        y_ptr,  # [M, N] (output)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program per (BLOCK_N columns, BLOCK_M rows) tile: acc += x[rows, k] @ w[cols, k].T, k ascending."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK_H: tl.constexpr):
        """Row r: y = w * (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype first, as LlamaRMSNorm does."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H]
        variance = tl.sum(x * x, axis=0) / H
        normed = (x / tl.sqrt(variance + eps)).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def block_n(n: int) -> int:
    """Columns per program: a function of N alone (never of M), small enough that a decode step's few rows
    still spread the weight reads over the GPU's multiprocessors."""
    return 32 if n <= 8192 else 64


def linear_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ b [N]) -> [..., N] in x's dtype; batch invariant (module docstring)."""
    assert HAS_TRITON, "triton is not importable"
    assert w.dim() == 2 and w.stride(1) == 1 and x.shape[-1] == w.shape[1]
    assert x.dtype == w.dtype and x.device == w.device
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        bn = block_n(n)
        grid = (triton.cdiv(n, bn), triton.cdiv(m, BLOCK_M))
        _linear_kernel[grid](
            rows,
            w,
            b if b is not None else w,
            y,
            m,
            n,
            k,
            rows.stride(0),
            w.stride(0),
            y.stride(0),
            HAS_BIAS=b is not None,
            IEEE=x.dtype == torch.float32,
            UPCAST=INTERPRETED and x.dtype != torch.float32,
            BLOCK_M=BLOCK_M,
            BLOCK_N=bn,
            BLOCK_K=BLOCK_K,
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
