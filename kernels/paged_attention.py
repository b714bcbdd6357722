"""Attention for a packed batch of multi-token queries over a paged KV cache.

Sequence b owns query tokens query_start_loc[b] .. query_start_loc[b+1]-1,
i.e. q_len = query_start_loc[b+1] - query_start_loc[b] >= 1 of them, at
positions seq_lens[b] - q_len .. seq_lens[b] - 1. Their K/V are already in the
cache, so ``seq_lens`` counts them. The query at position p attends causally
to positions 0..p of its own sequence, read through its block-table row.
Block-table entries past a sequence's last block may hold any padding (e.g.
-1): the kernel never reads them, the reference reads block 0 and masks it.
Prefill chunks, single-token decodes and (k+1)-token speculative queries all
follow this one rule and may share a batch. GQA: head h reads KV head
h // (H // KVH).

A sequence's query rows may instead form a draft tree (``trees``, see
kernels/draft_tree.py): a row then sees the cached prefix and its own path from
the root only. Every implementation takes the same ``trees``.
"""

import functools

import torch
import torch.nn.functional as F

from kernels import paged_attention_cpu as cpu_kernel
from kernels._triton import HAS_TRITON, num_search_steps, use_triton
from kernels.draft_tree import DraftTrees

if HAS_TRITON:
    from kernels._triton import find_sequence, tl, triton

    @triton.jit
    def _paged_attention_kernel(
        query_ptr,  # [T, H, D]
        key_cache_ptr,  # [num_blocks, block_size, KVH, D]
        value_cache_ptr,  # [num_blocks, block_size, KVH, D]
        block_tables_ptr,  # [B, max_blocks] int32
        query_start_loc_ptr,  # [B+1] int32
        seq_lens_ptr,  # [B] int32
        is_tree_ptr,  # [B] int32 (HAS_TREES)
        prefix_lens_ptr,  # [B] int32 (HAS_TREES)
        depths_ptr,  # [T] int32 (HAS_TREES)
        paths_ptr,  # [T, P] int32 (HAS_TREES)
        out_ptr,  # [T, H, D]
        scale,
        num_seqs,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bt,
        stride_path,
        block_size,
        HAS_TREES: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        NUM_SEARCH_STEPS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program per (query token, head): online softmax over its keys, read in order: 0..position, or
        for a draft tree's row the cached prefix then its path (logical key j -> the position it is at)."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        seq = find_sequence(query_start_loc_ptr, token, num_seqs, NUM_SEARCH_STEPS)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_end = tl.load(query_start_loc_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_start = seq_len - (q_end - q_start)  # position of the sequence's first query row
        num_keys = ctx_start + (token - q_start) + 1  # causal bound: 0..position
        if HAS_TREES:
            tree_flag = tl.load(is_tree_ptr + seq)  # 0: a chain
            prefix_len = tl.where(tree_flag != 0, tl.load(prefix_lens_ptr + seq), ctx_start)
            num_keys = tl.where(tree_flag != 0, prefix_len + tl.load(depths_ptr + token) + 1, num_keys)

        offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        is_d = offs_d < HEAD_DIM
        q = tl.load(query_ptr + token * stride_qt + head * stride_qh + offs_d, mask=is_d, other=0.0)
        q = q.to(tl.float32) * scale  # [BLOCK_D]

        m_i = tl.full([], float("-inf"), tl.float32)  # running max of the scores
        l_i = tl.full([], 0.0, tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running numerator
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(0, num_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical keys
            is_n = offs_n < num_keys
            positions = offs_n  # [BLOCK_N] where they are
            if HAS_TREES:
                on_path = is_n & (offs_n >= prefix_len) & (offs_n * 0 + tree_flag != 0)
                node = tl.load(
                    paths_ptr + token.to(tl.int64) * stride_path + (offs_n - prefix_len), mask=on_path, other=0
                )
                positions = tl.where(on_path, node, offs_n)
            block_ids = tl.load(table_row + positions // block_size, mask=is_n, other=0).to(tl.int64)
            in_block = (positions % block_size).to(tl.int64)  # [BLOCK_N]
            kv_mask = is_n[:, None] & is_d[None, :]  # [BLOCK_N, BLOCK_D]
            k_ptrs = (
                key_cache_ptr
                + block_ids[:, None] * stride_kb
                + in_block[:, None] * stride_ks
                + kv_head * stride_kh
                + offs_d[None, :]
            )
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            scores = tl.sum(k * q[None, :], axis=1)  # [BLOCK_N]
            scores = tl.where(is_n, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))  # finite: each tile has a valid key
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)  # [BLOCK_N]
            v_ptrs = (
                value_cache_ptr
                + block_ids[:, None] * stride_vb
                + in_block[:, None] * stride_vs
                + kv_head * stride_vh
                + offs_d[None, :]
            )
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i  # [BLOCK_D]
        out_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=is_d)


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    trees: DraftTrees | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Launch the Triton paged-attention kernel (see module docstring)."""
    assert HAS_TRITON, "triton is not importable"
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0
    assert key_cache.dtype == value_cache.dtype
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,)
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    tensors = (key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    assert all(t.device == query.device for t in tensors), "all inputs must be on one device"
    if trees is not None:
        assert trees.paths.device == query.device and trees.paths.stride(1) == 1
        assert trees.is_tree.shape == trees.prefix_lens.shape == (num_seqs,) and trees.depths.shape == (num_tokens,)
    tree_args = (trees.is_tree, trees.prefix_lens, trees.depths, trees.paths) if trees is not None else (seq_lens,) * 4
    out = torch.empty_like(query)  # [T, H, D]
    if num_tokens == 0:
        return out
    _paged_attention_kernel[(num_tokens, num_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        *tree_args,
        out,
        scale,
        num_seqs,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        trees.paths.stride(0) if trees is not None else 0,
        block_size,
        HAS_TREES=trees is not None,
        HEAD_DIM=head_dim,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        NUM_SEARCH_STEPS=num_search_steps(num_seqs),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=32,
    )
    return out


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_ids: torch.Tensor,  # [B, NB] int32 or int64
    max_len: int,
) -> torch.Tensor:  # [B, KVH, L, D]
    """Copy the first ``max_len`` positions of each sequence's blocks into a dense tensor."""
    num_seqs, num_blocks = block_ids.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    dense = cache.index_select(0, block_ids.reshape(-1))  # [B*NB, block_size, KVH, D]
    dense = dense.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)  # [B, NB*bs, KVH, D]
    return dense[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]


@functools.lru_cache(maxsize=8)
def packed_causal_mask(
    seq_lens: tuple[int, ...], q_len: int, group: int, device: torch.device
) -> torch.Tensor:  # [B or 1, 1, G*Q, L] bool
    """Which keys each packed query row (g, i) of each sequence may see.

    Row g*Q + i holds query i of sequence b, at position seq_lens[b] - Q + i;
    it sees keys 0..position. Equal lengths give one broadcast row block.
    Cached: every layer of a forward pass asks for the same mask (a few
    distinct q_lens per step; at most G*Q*L bytes per sequence each).
    """
    max_len = max(seq_lens)
    lens = seq_lens[:1] if min(seq_lens) == max_len else seq_lens
    row_query = torch.arange(group * q_len, device=device) % q_len  # [G*Q] query index i of row (g, i)
    positions = torch.tensor(lens, device=device)[:, None] - q_len + row_query  # [B or 1, G*Q]
    keys = torch.arange(max_len, device=device)  # [L]
    return (keys <= positions[:, :, None]).unsqueeze(1)  # [B or 1, 1, G*Q, L]


def attend_uniform(
    query: torch.Tensor,  # [B, Q, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: list[int],
    scale: float,
    visible: torch.Tensor | None = None,  # [B, Q, L] bool: the keys each query row sees; default causal
) -> torch.Tensor:  # [B, Q, H, D]
    """Attention for B sequences that all have Q query tokens: one batched SDPA call.

    The G = H // KVH query heads that share a KV head are packed into the query
    rows ([B, KVH, G*Q, D]), as ``transformers`` does for decodes: on a CPU this
    is faster than ``enable_gqa`` or repeating K/V, by ~7x for bf16 decodes.
    """
    num_seqs, q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    block_ids = block_tables[:, :num_blocks].to(key_cache.device)  # [B, NB] int32
    if min(seq_lens) != max_len:
        # Shorter rows are padded (e.g. with -1): read block 0 there, the mask hides it.
        block_ids = block_ids.clamp(min=0)
    key = gather_kv(key_cache, block_ids, max_len).to(query.dtype)  # [B, KVH, L, D]
    value = gather_kv(value_cache, block_ids, max_len).to(query.dtype)  # [B, KVH, L, D]
    packed = query.reshape(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(num_seqs, num_kv_heads, group * q_len, head_dim)  # [B, KVH, G*Q, D] rows (g, q)
    mask = None  # a lone query of full length sees every key
    if visible is not None:
        mask = visible.to(query.device).repeat(1, group, 1).unsqueeze(1)  # [B, 1, G*Q, L] rows (g, q)
    elif q_len > 1 or min(seq_lens) != max_len:
        mask = packed_causal_mask(tuple(seq_lens), q_len, group, query.device)  # [B or 1, 1, G*Q, L]
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)  # [B, KVH, G*Q, D]
    out = out.view(num_seqs, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, KVH, G, D]
    return out.reshape(num_seqs, q_len, num_heads, head_dim)  # head h = kv_head * G + g


def paged_attention_sdpa(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    trees: DraftTrees | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Paged attention in PyTorch ops, built on SDPA: the reference of the other paths, and the CPU's
    fallback when the C kernel cannot be built (SDPA is not batch invariant).

    Sequences with equal q_len are attended together in one SDPA call (the
    whole batch in the common all-decode or all-(k+1)-token case); the only
    host syncs are one read each of ``query_start_loc`` and ``seq_lens``
    (and of ``trees`` when there are draft trees: each row's keys as a mask).
    """
    num_tokens, num_heads, head_dim = query.shape
    starts = query_start_loc.tolist()  # B+1 host ints
    lens = seq_lens.tolist()  # B host ints
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    if trees is not None and not trees.is_tree.any():
        trees = None  # chains only: the causal rule
    if trees is not None:
        trees = trees.to("cpu")
    if trees is None and len(set(q_lens)) == 1 and q_lens[0] > 0:  # fast path: the batch is already [B, Q, H, D]
        batched = query.reshape(len(q_lens), q_lens[0], num_heads, head_dim)  # [B, Q, H, D]
        out = attend_uniform(batched, key_cache, value_cache, block_tables, lens, scale)  # [B, Q, H, D]
        return out.reshape(num_tokens, num_heads, head_dim)
    out = torch.empty_like(query)  # [T, H, D]
    for q_len, seq_ids in group_by_q_len(q_lens).items():
        if q_len == 0:
            continue
        # The N sequences with this q_len, gathered into one [N, Q, H, D] batch.
        token_ids = [t for b in seq_ids for t in range(starts[b], starts[b + 1])]
        token_index = torch.tensor(token_ids, device=query.device)  # [N*Q]
        sub_query = query.index_select(0, token_index).view(len(seq_ids), q_len, num_heads, head_dim)
        sub_tables = block_tables[torch.tensor(seq_ids, device=block_tables.device)]  # [N, max_blocks]
        sub_lens = [lens[b] for b in seq_ids]
        visible = None
        if trees is not None:
            visible = torch.zeros(len(seq_ids), q_len, max(sub_lens), dtype=torch.bool)  # [N, Q, L]
            for n, b in enumerate(seq_ids):
                visible[n, :, : lens[b]] = trees.visible(starts, lens, b)
        sub_out = attend_uniform(
            sub_query, key_cache, value_cache, sub_tables, sub_lens, scale, visible
        )  # [N, Q, H, D]
        out.index_copy_(0, token_index, sub_out.reshape(-1, num_heads, head_dim))
    return out


def group_by_q_len(q_lens: list[int]) -> dict[int, list[int]]:
    """Sequence indices grouped by their number of query tokens."""
    groups: dict[int, list[int]] = {}
    for seq_id, q_len in enumerate(q_lens):
        groups.setdefault(q_len, []).append(seq_id)
    return groups


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    trees: DraftTrees | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Paged attention: Triton on an accelerator, the batch-invariant C kernel on the CPU, else SDPA."""
    if use_triton(query):
        device = query.device
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_tables.to(device),
            query_start_loc.to(device),
            seq_lens.to(device),
            scale,
            trees.to(device) if trees is not None else None,
        )
    if cpu_kernel.supports(query, key_cache) and cpu_kernel.available():
        return cpu_kernel.paged_attention_cpu(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, trees
        )
    return paged_attention_sdpa(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, trees)
