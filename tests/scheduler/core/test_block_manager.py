"""Block manager: allocation, lookahead reservation, trimming, ref counts, no leaks."""

import pytest

from scheduler_service.core.block_manager import BlockManager


def test_lookahead_reservation_crosses_a_block_boundary():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("a", 3)
    assert len(manager.block_table("a")) == 1
    # 3 computed + 1 next token + k=3 lookahead = positions [0, 7): blocks 0 and 1 are touched.
    assert manager.num_blocks_to_append("a", 3 + 1, 3) == 1
    new_block_ids = manager.append_slots("a", 3 + 1, 3)
    assert len(new_block_ids) == 1
    assert manager.block_table("a")[1:] == new_block_ids
    assert manager.num_free_blocks == 6


def test_worst_case_counts_every_lookahead_slot():
    manager = BlockManager(num_blocks=16, block_size=4)
    manager.allocate("a", 4)
    # 4 computed + 1 + k=8: positions [0, 13) need 4 blocks, 3 more than held.
    assert manager.num_blocks_to_append("a", 5, 8) == 3
    # Slots already held are not counted again.
    assert manager.num_blocks_to_append("a", 2, 1) == 0


def test_trim_releases_over_reservation_after_partial_acceptance():
    manager = BlockManager(num_blocks=16, block_size=4)
    manager.allocate("a", 4)
    manager.append_slots("a", 5, 8)  # decode at position 4 with k=8
    assert len(manager.block_table("a")) == 4
    # 2 drafts accepted: the worker computed 4 + 1 + 2 = 7 positions; 2 blocks hold them.
    assert manager.trim("a", 7) == 2
    assert len(manager.block_table("a")) == 2
    assert manager.num_free_blocks == 14
    assert manager.trim("a", 7) == 0


def test_can_allocate_and_can_append_are_false_when_exhausted():
    manager = BlockManager(num_blocks=3, block_size=4)
    assert manager.can_allocate(12)
    assert not manager.can_allocate(13)
    manager.allocate("a", 8)
    assert manager.can_append_slots("a", 9, 3)  # 12 positions: one more block
    assert not manager.can_append_slots("a", 9, 4)  # 13 positions: two more blocks
    manager.append_slots("a", 9, 3)
    assert manager.num_free_blocks == 0
    assert not manager.can_allocate(1)
    assert not manager.can_append_slots("a", 13, 0)


def test_preempt_and_resume_reuses_freed_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", 4)
    manager.allocate("b", 4)
    assert not manager.can_allocate(1)
    manager.free("b")  # preempted by recompute
    assert manager.can_allocate(4)
    manager.allocate("b", 4)  # resumed: prompt + output recomputed into fresh blocks
    assert set(manager.block_table("a")).isdisjoint(manager.block_table("b"))
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == manager.num_total_blocks == 4


def test_ref_counts_are_one_while_used_and_zero_when_free():
    manager = BlockManager(num_blocks=4, block_size=2)
    block_ids = manager.allocate("a", 3)
    assert [manager.ref_count(b) for b in block_ids] == [1, 1]
    manager.free("a")
    assert all(manager.ref_count(b) == 0 for b in range(4))
    with pytest.raises(AssertionError, match="released twice"):
        manager._release_block(block_ids[0])
    with pytest.raises(KeyError):
        manager.free("a")


def test_allocating_twice_for_one_request_is_an_internal_error():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", 1)
    with pytest.raises(AssertionError):
        manager.allocate("a", 1)


def test_free_count_returns_to_start_after_mixed_lifecycles():
    manager = BlockManager(num_blocks=32, block_size=4)
    start = manager.num_free_blocks
    for i in range(5):
        request_id = f"r{i}"
        manager.allocate(request_id, 3 + i)
        for num_tokens in range(4 + i, 20, 3):
            manager.append_slots(request_id, num_tokens, 4)
            manager.trim(request_id, num_tokens + 1)
        manager.free(request_id)  # finished, aborted or cancelled: all end here
    assert manager.num_free_blocks == start


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
