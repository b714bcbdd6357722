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

Three implementations: Triton on a GPU (a program per sequence, KV head and tile of its query rows, the
tile's rows times the KV head's query heads in tensor-core products: GQA's heads read their K/V once, and a
verify's k + 1 rows share their keys' reads), the C kernel on the CPU (kernels/paged_attention_cpu.py), and
SDPA in PyTorch ops, the reference. The first two are batch invariant: a row's output does not depend on the
other rows of the call.
"""

import functools
import math

import torch
import torch.nn.functional as F

from kernels import paged_attention_cpu as cpu_kernel
from kernels._triton import HAS_TRITON, INTERPRETED, use_triton
from kernels.draft_tree import DraftTrees

LOG2_E = math.log2(math.e)

if HAS_TRITON:
    from kernels._triton import tl, triton

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
        qk_scale,  # the softmax scale times log2(e): scores are taken in base 2
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
        GROUP: tl.constexpr,  # query heads per KV head
        BLOCK_M: tl.constexpr,  # (query row, head) pairs per program: GROUP heads of BLOCK_M // GROUP rows
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One program per (sequence, KV head, tile of its query rows): the tile's rows times the KV head's
        GROUP query heads, as BLOCK_M rows of two tensor-core products per BLOCK_N keys, online softmax.

        Keys are read in order, BLOCK_N at a time from key 0, and each of a tile's rows masks the keys it does
        not see; a row's scores and sums are computed by the same instructions wherever it sits in a tile and
        whatever the other rows are. So its result depends only on its own keys: a row alone, beside other
        sequences, or among its sequence's k + 1 verify rows gets the same bits. A draft tree's row reads its
        logical keys (the prefix, then its path) and has a tile to itself, its GROUP heads."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        ctx_start = tl.load(seq_lens_ptr + seq) - q_len  # position of the sequence's first query row
        if HAS_TREES:
            tree_flag = tl.load(is_tree_ptr + seq)  # 0: a chain
            prefix_len = tl.load(prefix_lens_ptr + seq)
            rows_per_tile = tl.where(tree_flag != 0, 1, BLOCK_M // GROUP)
        else:
            tree_flag = 0
            prefix_len = 0
            rows_per_tile = BLOCK_M // GROUP
        row0 = tile * rows_per_tile
        if row0 < q_len:
            offs_m = tl.arange(0, BLOCK_M)  # tile row m: query row row0 + m // GROUP, head m % GROUP
            row = row0 + offs_m // GROUP
            row_ok = (offs_m // GROUP < rows_per_tile) & (row < q_len)
            token = (q_start + tl.where(row_ok, row, 0)).to(tl.int64)  # [BLOCK_M] packed row
            head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
            num_keys = ctx_start + row + 1  # causal bound: 0..position
            if HAS_TREES:
                depth = tl.load(depths_ptr + token, mask=row_ok, other=0)
                num_keys = tl.where(tree_flag != 0, prefix_len + depth + 1, num_keys)
            num_keys = tl.where(row_ok, num_keys, 1)  # padding rows see key 0, and are not stored
            tile_keys = tl.max(num_keys, axis=0)

            offs_d = tl.arange(0, BLOCK_D)
            is_d = offs_d < HEAD_DIM
            q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None] & is_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            if UPCAST:
                q = q.to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running numerator
            table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            path_row = paths_ptr + (q_start + row0).to(tl.int64) * stride_path  # a tree tile's one row
            for start in range(0, tile_keys, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical keys
                is_n = offs_n < tile_keys
                positions = offs_n  # [BLOCK_N] where they are
                if HAS_TREES:
                    on_path = is_n & (offs_n >= prefix_len) & (offs_n * 0 + tree_flag != 0)
                    node = tl.load(path_row + (offs_n - prefix_len), mask=on_path, other=0)
                    positions = tl.where(on_path, node, offs_n)
                block_ids = tl.load(table_row + positions // block_size, mask=is_n, other=0).to(tl.int64)
                in_block = (positions % block_size).to(tl.int64)  # [BLOCK_N]
                kv_mask = is_n[:, None] & is_d[None, :]  # [BLOCK_N, BLOCK_D]
                k_ptrs = key_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks
                k = tl.load(k_ptrs + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:  # Triton's interpreter multiplies bf16 wrongly; bf16 products are exact in fp32
                    k = k.to(tl.float32)
                if IEEE:
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
                else:
                    scores = tl.dot(q, tl.trans(k))
                scores = tl.where(offs_n[None, :] < num_keys[:, None], scores * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: key 0 is in every row's first tile
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v_ptrs = value_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs
                v = tl.load(v_ptrs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:  # FlashAttention's rounding: the probabilities in the cache's 16-bit type
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
            out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & is_d[None, :])


def attention_tile(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, query rows per chain tile) of the Triton kernel: a function of the model's heads alone, so
    every step runs each row with the same instructions. A KV head's query heads (GROUP) share a tile."""
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))  # tl.dot's least M
    return block_m, block_m // group


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    trees: DraftTrees | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Launch the Triton paged-attention kernel (see module docstring). max_query_len: the most query rows of
    a sequence (a bound: the kernel is launched for that many; None: the number of rows in all)."""
    assert HAS_TRITON, "triton is not importable"
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0
    assert key_cache.dtype == value_cache.dtype == query.dtype
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
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, rows_per_tile = attention_tile(num_heads, num_kv_heads)
    max_rows = num_tokens if max_query_len is None else max_query_len
    # a tree's rows have a tile each
    tiles = max_rows if trees is not None else -(-max_rows // rows_per_tile)
    upcast = INTERPRETED and query.dtype != torch.float32
    _paged_attention_kernel[(num_seqs, num_kv_heads, tiles)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        *tree_args,
        out,
        scale * LOG2_E,
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
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # keys per step: a function of the model alone (K and V tiles of 16 KB at head_dim 128)
        BLOCK_N=32 if query.dtype == torch.float32 or head_dim > 128 else 64,
        IEEE=query.dtype == torch.float32 or upcast,
        UPCAST=upcast,
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
    max_query_len: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Paged attention: Triton on an accelerator, the batch-invariant C kernel on the CPU, else SDPA.
    max_query_len: the most query rows of one sequence, where the caller knows it (Triton launches by it)."""
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
            max_query_len,
        )
    if cpu_kernel.supports(query, key_cache) and cpu_kernel.available():
        return cpu_kernel.paged_attention_cpu(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, trees
        )
    return paged_attention_sdpa(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, trees)
