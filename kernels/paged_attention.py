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
# The Triton kernel cuts a row's keys at multiples of SPLIT_KEYS (a multiple of its BLOCK_N) and merges the
# splits in order; splits run in programs of their own where their partial sums take at most PARALLEL_BYTES.
SPLIT_KEYS = 512
PARALLEL_BYTES = 64 << 20

if HAS_TRITON:
    from kernels._triton import tl, triton

    @triton.jit
    def _attend_keys(
        q,  # [BLOCK_M, BLOCK_D]
        lo,
        hi,  # logical keys lo .. hi - 1, BLOCK_N at a time
        num_keys,  # [BLOCK_M] each row's keys: 0 .. num_keys - 1
        table_row,
        path_row,
        tree_flag,
        prefix_len,
        key_cache_ptr,
        value_cache_ptr,
        kv_head,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        block_size,
        qk_scale,
        HAS_TREES: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """A split's online softmax from scratch: (running max m, denominator l, numerator acc) of each row
        over its keys in [lo, hi). A row with no key there gets m = -inf (its result is not used)."""
        offs_d = tl.arange(0, BLOCK_D)
        is_d = offs_d < HEAD_DIM
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running numerator
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical keys
            is_n = offs_n < hi
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
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite from a row's first tile with a key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ptrs = value_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs
            v = tl.load(v_ptrs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            # A tile reads up to its last row's keys: slots past a row's own may hold stale values (a graph's
            # padding rows reach past the step's real keys), and 0 * inf or 0 * nan in the product would
            # reach the row. Non-finite values become 0; finite ones are kept bit for bit.
            v = tl.where(tl.abs(v) < float("inf"), v, 0.0)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:  # FlashAttention's rounding: the probabilities in the cache's 16-bit type
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _merge_split(big_m, big_l, big_acc, m, denom, acc):
        """The softmax state over splits 0..s-1 and split s's own -> the state over splits 0..s. Every path
        (one program per split and _combine_splits_kernel, or one program over all) merges a row's splits
        with this code, in split order, from (-inf, 0, 0): the same operations, explicit FMAs included."""
        new_m = tl.maximum(big_m, m)
        old_scale = tl.exp2(big_m - new_m)
        scale = tl.exp2(m - new_m)
        new_l = tl.fma(denom, scale, big_l * old_scale)
        new_acc = tl.fma(acc, scale[:, None], big_acc * old_scale[:, None])
        return new_m, new_l, new_acc

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
        part_acc_ptr,  # [T, H, max_splits, D] fp32: a split's numerator (PARALLEL)
        part_ml_ptr,  # [T, H, max_splits, 2] fp32: its running max and denominator (PARALLEL)
        num_splits_ptr,  # [T] int32: each row's splits (PARALLEL)
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
        num_heads,
        max_splits,
        HAS_TREES: tl.constexpr,
        PARALLEL: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,  # query heads per KV head
        BLOCK_M: tl.constexpr,  # (query row, head) pairs per program: GROUP heads of BLOCK_M // GROUP rows
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One program per (tile of a sequence's query rows, KV head, sequence), or with PARALLEL per (tile and
        split, ...):
        the tile's rows times the KV head's GROUP query heads, as BLOCK_M rows of two tensor-core products per
        BLOCK_N keys, online softmax.

        A row's keys are cut at fixed positions into splits of SPLIT_KEYS, each split's softmax taken from
        scratch (_attend_keys) and the splits merged in order (_merge_split). Without PARALLEL the program
        does every split of its tile in turn; with it a program does one split and stores it, and
        _combine_splits_kernel merges a row's splits (a row of one split is finished by its program). Keys
        are read in order, BLOCK_N at a time, each of a tile's rows masking the keys it does not see; a row's
        scores and sums are computed by the same instructions wherever it sits in a tile and whatever the
        other rows are. So its result depends only on its own keys: a row alone, beside other sequences, or
        among its sequence's k + 1 verify rows gets the same bits, with or without PARALLEL. A draft tree's
        row reads its logical keys (the prefix, then its path) and has a tile to itself, its GROUP heads."""
        seq = tl.program_id(2)
        kv_head = tl.program_id(1)
        if PARALLEL:
            tile = tl.program_id(0) // max_splits
            split = tl.program_id(0) % max_splits
        else:
            tile = tl.program_id(0)
            split = 0
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
        row_splits = (num_keys + SPLIT_KEYS - 1) // SPLIT_KEYS  # [BLOCK_M]
        if (row0 < q_len) & (split * SPLIT_KEYS < tile_keys):
            offs_d = tl.arange(0, BLOCK_D)
            is_d = offs_d < HEAD_DIM
            q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None] & is_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            if UPCAST:
                q = q.to(tl.float32)
            table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            path_row = paths_ptr + (q_start + row0).to(tl.int64) * stride_path  # a tree tile's one row
            big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            big_l = tl.zeros([BLOCK_M], dtype=tl.float32)
            big_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            first = split if PARALLEL else 0
            last = split + 1 if PARALLEL else (tile_keys + SPLIT_KEYS - 1) // SPLIT_KEYS
            for s in range(first, last):
                lo = s * SPLIT_KEYS
                m, denom, acc = _attend_keys(
                    q,
                    lo,
                    tl.minimum(lo + SPLIT_KEYS, tile_keys),
                    num_keys,
                    table_row,
                    path_row,
                    tree_flag,
                    prefix_len,
                    key_cache_ptr,
                    value_cache_ptr,
                    kv_head,
                    stride_kb,
                    stride_ks,
                    stride_kh,
                    stride_vb,
                    stride_vs,
                    stride_vh,
                    block_size,
                    qk_scale,
                    HAS_TREES,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_D,
                    BLOCK_N,
                    IEEE,
                    UPCAST,
                )
                if PARALLEL:
                    big_m, big_l, big_acc = m, denom, acc
                else:  # a row merges only the splits that hold its keys
                    new_m, new_l, new_acc = _merge_split(big_m, big_l, big_acc, m, denom, acc)
                    has = s < row_splits
                    big_m = tl.where(has, new_m, big_m)
                    big_l = tl.where(has, new_l, big_l)
                    big_acc = tl.where(has[:, None], new_acc, big_acc)
            store = row_ok[:, None] & is_d[None, :]
            out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            if PARALLEL:
                if split == 0:
                    tl.store(num_splits_ptr + token, row_splits, mask=row_ok & (offs_m % GROUP == 0))
                    # a row of one split is finished here, as _combine_splits_kernel would
                    m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
                    l0 = tl.zeros([BLOCK_M], dtype=tl.float32)
                    acc0 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                    _, one_l, one_acc = _merge_split(m0, l0, acc0, big_m, big_l, big_acc)
                    one = (one_acc / one_l[:, None]).to(out_ptr.dtype.element_ty)
                    tl.store(out_ptrs, one, mask=store & (row_splits == 1)[:, None])
                base = (token * num_heads + head) * max_splits + split  # [BLOCK_M]
                kept = row_ok & (row_splits > 1) & (split < row_splits)
                tl.store(
                    part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
                    big_acc,
                    mask=kept[:, None] & is_d[None, :],
                )
                tl.store(part_ml_ptr + base * 2, big_m, mask=kept)
                tl.store(part_ml_ptr + base * 2 + 1, big_l, mask=kept)
            else:
                out = big_acc / big_l[:, None]  # [BLOCK_M, BLOCK_D]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store)

    @triton.jit
    def _combine_splits_kernel(
        part_acc_ptr,  # [T, H, max_splits, D] fp32
        part_ml_ptr,  # [T, H, max_splits, 2] fp32
        num_splits_ptr,  # [T] int32
        out_ptr,  # [T, H, D]
        stride_ot,
        stride_oh,
        num_heads,
        max_splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Token t, every head: its splits merged in order (_merge_split), when it has more than one."""
        token = tl.program_id(0).to(tl.int64)
        splits = tl.load(num_splits_ptr + token)
        if splits > 1:
            heads = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            ok = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
            big_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            big_l = tl.zeros([BLOCK_H], dtype=tl.float32)
            big_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            for s in range(0, splits):
                base = (token * num_heads + heads) * max_splits + s  # [BLOCK_H]
                acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
                m = tl.load(part_ml_ptr + base * 2, mask=heads < num_heads, other=0.0)
                denom = tl.load(part_ml_ptr + base * 2 + 1, mask=heads < num_heads, other=1.0)
                big_m, big_l, big_acc = _merge_split(big_m, big_l, big_acc, m, denom, acc)
            out = big_acc / big_l[:, None]
            out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


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
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:  # [T, H, D]
    """Launch the Triton paged-attention kernel (see module docstring). max_query_len: the most query rows of
    a sequence (a bound: the kernel is launched for that many; None: the number of rows in all). split_keys:
    where a row's keys are cut (the worker's is SPLIT_KEYS; bench/bench_paged_attention.py times others)."""
    assert HAS_TRITON, "triton is not importable"
    assert split_keys % 64 == 0, "split_keys must be a multiple of the kernel's key blocks (64)"
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
    max_splits = -(-block_tables.shape[1] * block_size // split_keys)  # a bound of any row's splits
    # A program per split where the splits' partial sums fit PARALLEL_BYTES (decodes and verifies of long
    # contexts: their few rows would leave the GPU idle); else a program per tile does its splits in turn.
    parallel = max_splits > 1 and num_tokens * num_heads * max_splits * (head_dim + 2) * 4 <= PARALLEL_BYTES
    if parallel:
        part_acc = torch.empty((num_tokens, num_heads, max_splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, max_splits, 2), dtype=torch.float32, device=query.device)
        num_splits = torch.empty(num_tokens, dtype=torch.int32, device=query.device)
    else:
        part_acc = part_ml = num_splits = out  # not read
    upcast = INTERPRETED and query.dtype != torch.float32
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tiles on the first axis: the others take at most 65,535 programs
    _paged_attention_kernel[(tiles * max_splits if parallel else tiles, num_kv_heads, num_seqs)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        *tree_args,
        out,
        part_acc,
        part_ml,
        num_splits,
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
        num_heads,
        max_splits,
        HAS_TREES=trees is not None,
        PARALLEL=parallel,
        HEAD_DIM=head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        # keys per step: a function of the model alone (K and V tiles of 16 KB at head_dim 128)
        BLOCK_N=32 if query.dtype == torch.float32 or head_dim > 128 else 64,
        SPLIT_KEYS=split_keys,
        IEEE=query.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        # fp32's products run on FMA units: with 4 warps a split program spilled registers (ptxas, sm_90).
        # A function of the dtype alone: the warps lay out the row sums, which must not change between calls.
        num_warps=8 if query.dtype == torch.float32 else 4,
    )
    if parallel:
        _combine_splits_kernel[(num_tokens,)](
            part_acc,
            part_ml,
            num_splits,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            max_splits,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=block_d,
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
    keys_transposed: bool = False,
) -> torch.Tensor:  # [T, H, D]
    """Paged attention: Triton on an accelerator, the batch-invariant C kernel on the CPU, else SDPA.
    max_query_len: the most query rows of one sequence, where the caller knows it (Triton launches by it).
    keys_transposed: key_cache is [num_blocks, KVH, D, block_size], which only the C kernel reads
    (worker_service/runtime/kv_cache.py)."""
    if keys_transposed:
        return cpu_kernel.paged_attention_cpu(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, trees, keys_transposed=True
        )
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
