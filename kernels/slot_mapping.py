"""Slot mapping: where each packed token's K/V goes in the paged KV cache.

For token t of sequence b (query_start_loc[b] <= t < query_start_loc[b+1]) at
position p in its sequence::

    slot[t] = block_tables[b, p // block_size] * block_size + p % block_size

A slot indexes the cache viewed as ``[num_blocks * block_size, KVH, D]``.
"""

import torch

from kernels._triton import HAS_TRITON, num_search_steps, use_triton

if HAS_TRITON:
    from kernels._triton import find_sequence, tl, triton

    @triton.jit
    def _slot_mapping_kernel(
        block_tables_ptr,  # [B, max_blocks] int32
        query_start_loc_ptr,  # [B+1] int32
        positions_ptr,  # [T] int64
        slot_mapping_ptr,  # [T] int64 (output)
        num_tokens,
        num_seqs,
        block_tables_stride,
        block_size,
        NUM_SEARCH_STEPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """One program per BLOCK_T packed tokens."""
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        is_valid = tokens < num_tokens
        seq_ids = find_sequence(query_start_loc_ptr, tokens, num_seqs, NUM_SEARCH_STEPS)
        positions = tl.load(positions_ptr + tokens, mask=is_valid, other=0)  # [BLOCK_T]
        block_ids = tl.load(
            block_tables_ptr + seq_ids.to(tl.int64) * block_tables_stride + positions // block_size,
            mask=is_valid,
            other=0,
        )  # [BLOCK_T]
        slots = block_ids.to(tl.int64) * block_size + positions % block_size
        tl.store(slot_mapping_ptr + tokens, slots, mask=is_valid)


def slot_mapping_triton(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:  # [T] int64
    """Launch the Triton slot-mapping kernel (see module docstring)."""
    assert HAS_TRITON, "triton is not importable"
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    assert query_start_loc.shape == (block_tables.shape[0] + 1,)
    assert query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous()
    assert positions.dim() == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
    assert block_size > 0
    assert block_tables.device == query_start_loc.device == positions.device
    num_tokens = positions.shape[0]
    num_seqs = block_tables.shape[0]
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=positions.device)  # [T]
    if num_tokens == 0:
        return slot_mapping
    block_t = 128
    grid = (triton.cdiv(num_tokens, block_t),)
    _slot_mapping_kernel[grid](
        block_tables,
        query_start_loc,
        positions,
        slot_mapping,
        num_tokens,
        num_seqs,
        block_tables.stride(0),
        block_size,
        NUM_SEARCH_STEPS=num_search_steps(num_seqs),
        BLOCK_T=block_t,
    )
    return slot_mapping


def token_seq_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [T] int64
    """Sequence index of every packed token: how many sequences end at or before it."""
    token_ids = torch.arange(num_tokens, device=query_start_loc.device)  # [T]
    return torch.searchsorted(query_start_loc[1:], token_ids, right=True)  # [T]


def slot_mapping_ref(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:  # [T] int64
    """PyTorch reference of ``slot_mapping_triton``: vectorised, no host syncs."""
    device = positions.device
    seq_ids = token_seq_ids(query_start_loc.to(device), positions.shape[0])  # [T]
    block_idx = positions // block_size  # [T]
    flat_idx = seq_ids * block_tables.shape[1] + block_idx  # [T] row-major index into block_tables
    block_ids = torch.take(block_tables.to(device), flat_idx).long()  # [T]
    return block_ids * block_size + (positions - block_idx * block_size)  # [T]


def compute_slot_mapping(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:  # [T] int64
    """Slot of every packed token: Triton on an accelerator, else the reference."""
    if use_triton(positions):
        device = positions.device
        return slot_mapping_triton(block_tables.to(device), query_start_loc.to(device), positions, block_size)
    return slot_mapping_ref(block_tables, query_start_loc, positions, block_size)
