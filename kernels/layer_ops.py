"""The row-wise ops of a Llama decoder layer as Triton kernels, for the GPU forward
(worker_service/runtime/backends/gpu_llama.py): residual add + RMSNorm, RoPE fused with the K/V write into the
paged cache, and SiLU(gate) * up. Each is one launch for the whole step (a graphed step replays them), and each
row is computed alone, so they are batch invariant by construction. They round where `transformers`' Llama
code rounds (fp32 math, every intermediate that `transformers` keeps in the model's dtype rounded to it), as
kernels/layer_ops_cpu.py does on the CPU. Each has a PyTorch reference of the same signature (`*_ref`).
"""

import torch

from kernels._triton import HAS_TRITON

if HAS_TRITON:
    from kernels._triton import rounded_to, split_sums_added, tl, triton

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr,
        residual_ptr,
        w_ptr,
        y_ptr,
        H,
        stride_h,
        stride_r,
        stride_y,
        eps,
        num_rows,
        HAS_H: tl.constexpr,
        H_SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Row r: residual += h (rounded to the dtype, stored); y = w * (residual / sqrt(mean(residual^2) + eps)),
        the normed row rounded to the dtype before the weight, as LlamaRMSNorm. With H_SPLITS, h is a linear's
        split sums (invariant_ops.linear_split_sums, [H_SPLITS, rows, H] fp32), added in order from zero and
        rounded to the dtype first, as invariant_ops' _sum_splits_kernel would have stored h."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        if HAS_H:
            if H_SPLITS > 0:
                total = split_sums_added(h_ptr, row * stride_h + cols, ok, H_SPLITS, num_rows, stride_h)
                h = rounded_to(total, x.dtype)
            else:
                h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
            x = rounded_to(x.to(tl.float32) + h, x.dtype).to(x.dtype)
            tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
        x = x.to(tl.float32)
        variance = tl.sum(x * x, axis=0) / H
        normed = rounded_to(x / tl.sqrt(variance + eps), y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_write_kv_kernel(
        qkv_ptr,  # [T, (H + 2 KVH) D], or a linear's split sums of it [SPLITS, T, (H + 2 KVH) D] fp32
        q_ptr,  # [T, H D]: the rotated query heads (qkv itself when it is not split sums: in place)
        cos_ptr,  # [T, D]
        sin_ptr,  # [T, D]
        slots_ptr,  # [T] int64
        key_cache_ptr,  # [slots, KVH, D] (a paged cache's blocks, flat)
        value_cache_ptr,
        stride_qkv,
        stride_q,
        stride_cos,
        num_rows,
        SPLITS: tl.constexpr,
        HEADS: tl.constexpr,  # query heads
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,  # head_dim // 2
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        """Token t: its query and key heads rotated (q * cos + rotate_half(q) * sin, each product and the sum
        rounded to the dtype, as apply_rotary_pos_emb); the queries into q, the keys and values into the cache
        at slots[t]. With SPLITS, qkv is a linear's split sums, added in order from zero and rounded to the
        dtype first, as the linear's own second kernel would (invariant_ops.linear_split_sums)."""
        t = tl.program_id(0).to(tl.int64)
        dtype = key_cache_ptr.dtype.element_ty
        heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BH, 1]: query heads, then key heads
        d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BD]
        ok = (heads < HEADS + KV_HEADS) & (d < HALF)
        v_heads = tl.arange(0, BLOCK_HEADS)[:, None]  # the value heads
        v_cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        v_ok = (v_heads < KV_HEADS) & (v_cols < 2 * HALF)
        first_at = heads * (2 * HALF) + d  # [BH, BD]: x1 of each head; x2 HALF further
        v_at = (HEADS + KV_HEADS + v_heads) * (2 * HALF) + v_cols
        if SPLITS > 0:
            row = t * stride_qkv
            x1 = rounded_to(split_sums_added(qkv_ptr, row + first_at, ok, SPLITS, num_rows, stride_qkv), dtype)
            x2 = rounded_to(split_sums_added(qkv_ptr, row + first_at + HALF, ok, SPLITS, num_rows, stride_qkv), dtype)
            v = rounded_to(split_sums_added(qkv_ptr, row + v_at, v_ok, SPLITS, num_rows, stride_qkv), dtype).to(dtype)
        else:
            row = qkv_ptr + t * stride_qkv
            x1 = tl.load(row + first_at, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(row + first_at + HALF, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(row + v_at, mask=v_ok, other=0.0)
        cos1 = tl.load(cos_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + t * stride_cos + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        # rotate_half(x) = [-x2, x1]
        out1 = rounded_to(rounded_to(x1 * cos1, dtype) + rounded_to(-x2 * sin1, dtype), dtype).to(dtype)
        out2 = rounded_to(rounded_to(x2 * cos2, dtype) + rounded_to(x1 * sin2, dtype), dtype).to(dtype)
        is_q = heads < HEADS
        tl.store(q_ptr + t * stride_q + first_at, out1, mask=ok & is_q)
        tl.store(q_ptr + t * stride_q + first_at + HALF, out2, mask=ok & is_q)
        slot = tl.load(slots_ptr + t)
        kv = slot * (KV_HEADS * 2 * HALF) + (heads - HEADS) * (2 * HALF) + d  # [BH, BD] for the key heads
        is_k = ok & (heads >= HEADS)
        tl.store(key_cache_ptr + kv, out1, mask=is_k)
        tl.store(key_cache_ptr + kv + HALF, out2, mask=is_k)
        tl.store(value_cache_ptr + slot * (KV_HEADS * 2 * HALF) + v_heads * (2 * HALF) + v_cols, v, mask=v_ok)

    @triton.jit
    def _silu_mul_kernel(
        gate_up_ptr, out_ptr, N, stride_in, stride_out, num_rows, SPLITS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """out[r] = silu(gate[r]) * up[r], gate_up = [gate | up]: silu rounded to the dtype, then the product.
        With SPLITS, gate_up is a linear's split sums ([SPLITS, rows, 2N] fp32, invariant_ops.linear_split_sums),
        added in order from zero and rounded to the dtype first, as the linear's own second kernel would."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        dtype = out_ptr.dtype.element_ty
        if SPLITS > 0:
            at = row * stride_in + cols
            g = rounded_to(split_sums_added(gate_up_ptr, at, ok, SPLITS, num_rows, stride_in), dtype)
            up = rounded_to(split_sums_added(gate_up_ptr, at + N, ok, SPLITS, num_rows, stride_in), dtype)
        else:
            g = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(gate_up_ptr + row * stride_in + N + cols, mask=ok, other=0.0).to(tl.float32)
        silu = rounded_to(g / (1.0 + tl.exp(-g)), dtype)
        tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, "rows of a 2-D tensor, each contiguous"
    return x


def _linear_output(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A linear's output as the row kernels read it: (its rows, 2-D; how many split sums (0: none); rows per
    split sum). [splits, T, N] fp32 split sums (invariant_ops.linear_split_sums) are read as [splits x T, N]."""
    if t.dim() == 3:
        assert t.dtype == torch.float32 and t.is_contiguous()
        return t.view(-1, t.shape[2]), t.shape[0], t.shape[1]
    return _rows(t), 0, t.shape[0]


def add_rms_norm_triton(h: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += h in place (h None: the first layer's norm, residual unchanged); returns
    LlamaRMSNorm(residual) with weight w. [T, hidden] each; a program per row. h may also be a linear's split
    sums, [splits, T, hidden] fp32 (invariant_ops.linear_split_sums): the same as adding the h they sum to."""
    assert HAS_TRITON, "triton is not importable"
    _rows(residual)
    num_rows, hidden = residual.shape
    assert w.shape == (hidden,) and w.device == residual.device
    splits = 0
    if h is not None:
        h, splits, h_rows = _linear_output(h)
        assert h_rows == num_rows and h.shape[1] == hidden and (splits or h.dtype == residual.dtype)
    y = torch.empty_like(residual)
    block = triton.next_power_of_2(hidden)
    if num_rows:
        _add_rms_norm_kernel[(num_rows,)](
            h if h is not None else residual,
            residual,
            w,
            y,
            hidden,
            h.stride(0) if h is not None else 0,
            residual.stride(0),
            y.stride(0),
            eps,
            num_rows,
            HAS_H=h is not None,
            H_SPLITS=splits,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return y


def add_rms_norm_ref(h: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`transformers`' residual add and LlamaRMSNorm.forward."""
    if h is not None:
        residual += h
    hidden = residual.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return w * hidden.to(residual.dtype)


def rope_write_kv_triton(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) D], or a linear's split sums of it [splits, T, (H + 2 KVH) D] fp32
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    num_heads: int,
    slots: torch.Tensor,  # [T] int64
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
) -> torch.Tensor:  # [T, H D]
    """RoPE on qkv's query heads; its rotated key heads and its value heads written into the cache at `slots`.
    Returns the rotated queries: qkv's own columns, rotated in place, or from split sums (invariant_ops.
    linear_split_sums) a new tensor in the cache's dtype. A program per token."""
    assert HAS_TRITON, "triton is not importable"
    _, _, num_kv_heads, head_dim = key_cache.shape
    width, q_width = (num_heads + 2 * num_kv_heads) * head_dim, num_heads * head_dim
    qkv, splits, num_tokens = _linear_output(qkv)
    if splits:
        query = torch.empty((num_tokens, q_width), dtype=key_cache.dtype, device=qkv.device)
    else:
        assert key_cache.dtype == qkv.dtype
        query = qkv[:, :q_width]
    assert qkv.shape[1] == width and head_dim % 2 == 0
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.dtype == key_cache.dtype
    assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.stride(1) == 1 and cos.stride() == sin.stride()
    assert slots.dtype == torch.int64 and slots.shape == (num_tokens,)
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens,)](
            qkv,
            query,
            cos,
            sin,
            slots,
            key_cache,
            value_cache,
            qkv.stride(0),
            query.stride(0),
            cos.stride(0),
            num_tokens,
            SPLITS=splits,
            HEADS=num_heads,
            KV_HEADS=num_kv_heads,
            HALF=head_dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(num_heads + num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return query


def rope_write_kv_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> None:
    """The same through `transformers`' apply_rotary_pos_emb and index_copy_ (KVCache.write's)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_tokens = qkv.shape[0]
    _, _, num_kv_heads, head_dim = key_cache.shape
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].view(num_tokens, num_heads, head_dim).transpose(0, 1)[None]  # [1, H, T, D]
    k = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)[None]
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    v = qkv[:, q_width + kv_width :].reshape(num_tokens, num_kv_heads, head_dim)
    qkv[:, :q_width] = q_rot[0].transpose(0, 1).reshape(num_tokens, q_width)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k_rot[0].transpose(0, 1))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def silu_mul_triton(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, 2N] = [gate | up] -> silu(gate) * up, [T, N]. gate_up may also be a linear's split sums,
    [splits, T, 2N] fp32 (invariant_ops.linear_split_sums), with the model's dtype: the same as from the
    gate_up they sum to."""
    assert HAS_TRITON, "triton is not importable"
    gate_up, splits, num_rows = _linear_output(gate_up)
    assert dtype is not None if splits else dtype in (None, gate_up.dtype)
    n = gate_up.shape[1] // 2
    out = torch.empty((num_rows, n), dtype=dtype or gate_up.dtype, device=gate_up.device)
    block = min(4096, triton.next_power_of_2(n))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), num_rows, SPLITS=splits, BLOCK=block
        )
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
