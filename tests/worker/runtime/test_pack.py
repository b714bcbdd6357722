"""pack(): a step's chunks become the forward's inputs and cache metadata, each list reaching the device in
one of two copies (device.to_device). Checked against the inputs written out from the chunks by hand."""

import random

import torch

from worker_service.runtime.device import to_device
from worker_service.runtime.kv_cache import KVCache, KVCacheSpec, position_slots, slot
from worker_service.runtime.runner import SequenceChunk, pack

BLOCK_SIZE = 4
# A fresh prefill of 5 tokens, a decode after 6 cached tokens, a verify of 3 rows after 9 (its table one block
# longer than it needs: a lookahead block), and a tree of 4 rows (root, two children, a grandchild) after 2.
CHUNKS = [
    SequenceChunk([11, 12, 13, 14, 15], 0, [7, 3], num_logits=1),
    SequenceChunk([21], 6, [5, 9]),
    SequenceChunk([31, 32, 33], 9, [2, 8, 6, 1], num_logits=3),
    SequenceChunk([41, 42, 43, 44], 2, [4, 0], num_logits=4, parents=[-1, 0, 0, 1]),
]


def test_pack_writes_every_input_where_the_forward_reads_it(device):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    batch = pack(CHUNKS, KVCache(spec, 10, BLOCK_SIZE, device), torch.device(device))
    meta = batch.metadata
    assert batch.input_ids.device.type == torch.device(device).type

    def ints(tensor):
        return tensor.cpu().tolist()

    assert ints(batch.input_ids) == [11, 12, 13, 14, 15, 21, 31, 32, 33, 41, 42, 43, 44]
    # a tree row is computed at its depth: root 2, children 3, grandchild 4
    assert ints(batch.positions) == [0, 1, 2, 3, 4, 6, 9, 10, 11, 2, 3, 3, 4]
    assert ints(batch.logits_indices) == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert ints(meta.query_start_loc) == [0, 5, 6, 9, 13]
    assert ints(meta.seq_lens) == [5, 7, 12, 6]
    assert ints(meta.block_tables) == [[7, 3, 0, 0], [5, 9, 0, 0], [2, 8, 6, 1], [4, 0, 0, 0]]
    assert meta.block_tables.dtype == meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert batch.input_ids.dtype == batch.positions.dtype == batch.logits_indices.dtype == torch.int64
    # K/V slots: row r of a sequence goes to its table's block (start + r) // 4, offset (start + r) % 4 (a tree's
    # rows in row order, whatever their depth)
    slots = [7 * 4, 7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 3 * 4, 9 * 4 + 2, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    slots += [4 * 4 + 2, 4 * 4 + 3, 0 * 4, 0 * 4 + 1]
    assert ints(meta.slot_mapping) == slots
    assert meta.trees is not None and ints(meta.trees.is_tree) == [0, 0, 0, 1]


def test_to_device_is_one_tensor_per_list_in_order(device):
    a, empty, b = to_device([[1, 2, 3], [], [4]], torch.int32, torch.device(device))
    assert (a.cpu().tolist(), empty.numel(), b.cpu().tolist()) == ([1, 2, 3], 0, [4])
    assert a.dtype == torch.int32 and a.is_contiguous() and b.is_contiguous()


def test_position_slots_are_each_positions_slot():
    """A block's run at a time (the packed steps' K/V slots): what slot() gives each position, for ranges that
    start and end anywhere in a block, span several blocks, or are empty."""
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        table = rng.sample(range(100), 12)
        for _ in range(50):
            start = rng.randrange(0, 12 * block_size)
            end = rng.randrange(start, 12 * block_size + 1)
            want = [slot(table, p, block_size) for p in range(start, end)]
            assert position_slots(table, start, end, block_size) == want, (block_size, start, end)
