"""Slot mapping: Triton kernel vs PyTorch reference vs hand-computed slots."""

import subprocess
import sys

import pytest
import torch

from kernels._triton import HAS_TRITON
from kernels.slot_mapping import compute_slot_mapping, slot_mapping_ref, slot_mapping_triton

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences, block_size 4, non-contiguous tables, -1 padding, crossing a block edge."""
    block_tables = torch.tensor([[7, 2, 9], [3, 0, -1]], dtype=torch.int32)  # [B=2, 3]
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)  # [B+1]
    positions = torch.tensor([2, 3, 4, 5, 6], dtype=torch.int64)  # [T=5]
    # seq 0: positions 2, 3 in block 7, position 4 at the start of block 2;
    # seq 1: positions 5, 6 in its second block, id 0.
    expected = torch.tensor([7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 0 * 4 + 1, 0 * 4 + 2])  # [T]
    return block_tables, query_start_loc, positions, expected


def random_case(seed: int, block_size: int, num_seqs: int):
    """Random q_lens (some 0) over random cached prefixes, with shuffled block ids."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(0, 9, (num_seqs,), generator=gen)  # [B]
    prefix_lens = torch.randint(0, 40, (num_seqs,), generator=gen)  # [B]
    max_blocks = -(-int((q_lens + prefix_lens).max()) // block_size)
    block_ids = torch.randperm(num_seqs * max_blocks, generator=gen, dtype=torch.int32)
    block_tables = block_ids.view(num_seqs, max_blocks)  # [B, max_blocks]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)  # [B+1]
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens.tolist(), q_lens.tolist())])
    return block_tables, query_start_loc, positions, q_lens


def brute_force(block_tables, q_lens, positions, block_size) -> torch.Tensor:  # [T]
    """One token at a time, straight from the definition."""
    seq_of_token = [b for b, q in enumerate(q_lens.tolist()) for _ in range(q)]
    slots = [
        int(block_tables[b, p // block_size]) * block_size + p % block_size
        for b, p in zip(seq_of_token, positions.tolist())
    ]
    return torch.tensor(slots, dtype=torch.int64)


def test_ref_matches_hand_computed():
    block_tables, query_start_loc, positions, expected = hand_case()
    assert torch.equal(slot_mapping_ref(block_tables, query_start_loc, positions, 4), expected)
    assert torch.equal(compute_slot_mapping(block_tables, query_start_loc, positions, 4), expected)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ref_matches_brute_force(seed, block_size):
    block_tables, query_start_loc, positions, q_lens = random_case(seed, block_size, num_seqs=7)
    expected = brute_force(block_tables, q_lens, positions, block_size)
    assert torch.equal(slot_mapping_ref(block_tables, query_start_loc, positions, block_size), expected)


@requires_triton
def test_triton_matches_hand_computed(triton_device):
    block_tables, query_start_loc, positions, expected = hand_case()
    slots = slot_mapping_triton(*(t.to(triton_device) for t in (block_tables, query_start_loc, positions)), 4)
    assert torch.equal(slots.cpu(), expected)


@requires_triton
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_seqs", [1, 5, 40])
def test_triton_matches_ref(num_seqs, block_size, triton_device):
    block_tables, query_start_loc, positions, _ = random_case(num_seqs, block_size, num_seqs)
    expected = slot_mapping_ref(block_tables, query_start_loc, positions, block_size)
    slots = slot_mapping_triton(*(t.to(triton_device) for t in (block_tables, query_start_loc, positions)), block_size)
    assert torch.equal(slots.cpu(), expected)


def test_package_import_is_cheap_and_versionless():
    """`transformers` may import our `kernels` as if it were HF's: it must be cheap and have no version."""
    code = (
        "import sys, kernels; "
        "assert not hasattr(kernels, '__version__'); "
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
