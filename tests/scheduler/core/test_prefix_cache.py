"""The prefix cache in the block manager: hits, what is never cached, LRU eviction, exact ref and free counts."""

import random

import pytest

from scheduler_service.core.block_hash import BlockHashes, cache_root, hash_block
from scheduler_service.core.block_manager import BlockManager

ROOT = cache_root("model", "float32")


def hashes(token_ids: list[int], block_size: int, root: bytes = ROOT) -> list[bytes]:
    return BlockHashes(root, block_size).extend(token_ids)


def run_request(manager: BlockManager, request_id: str, token_ids: list[int], num_written: int | None = None):
    """Allocates with whatever prefix is cached, then reports KV written for `num_written` tokens (all)."""
    cached = manager.cached_prefix(hashes(token_ids, manager.block_size), len(token_ids))
    table = manager.allocate(request_id, len(token_ids), cached)
    written = len(token_ids) if num_written is None else num_written
    manager.cache_blocks(request_id, hashes(token_ids, manager.block_size), written)
    return cached, table


def test_a_shared_prefix_is_a_hit_with_shared_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 108))  # two full blocks
    _, table_a = run_request(manager, "a", system + [1, 2, 3])
    cached, table_b = run_request(manager, "b", system + [4, 5])
    assert cached == table_a[:2] == table_b[:2]
    assert [manager.ref_count(b) for b in table_b] == [2, 2, 1]
    assert manager.num_free_blocks == 16 - 3 - 1  # a's 3 blocks, b's one new block
    manager.free("a")
    assert [manager.ref_count(b) for b in table_b] == [1, 1, 1]
    manager.free("b")
    assert manager.num_free_blocks == 16 and all(manager.ref_count(b) == 0 for b in range(16))


def test_no_hit_for_a_partial_block_nor_for_the_last_token():
    manager = BlockManager(num_blocks=16, block_size=4)
    run_request(manager, "a", list(range(6)))  # one full block, one partial
    assert manager.num_cached_blocks == 1
    assert len(manager.cached_prefix(hashes(list(range(6)), 4), 6)) == 1
    # Eight tokens: both blocks are full, but the last token is always computed, so only the first is a hit.
    run_request(manager, "b", list(range(8)))
    assert manager.num_cached_blocks == 2
    assert len(manager.cached_prefix(hashes(list(range(8)), 4), 8)) == 1
    assert len(manager.cached_prefix(hashes(list(range(9)), 4), 9)) == 2


def test_only_blocks_of_written_kv_are_cached():
    manager = BlockManager(num_blocks=16, block_size=4)
    token_ids = list(range(12))
    run_request(manager, "a", token_ids, num_written=7)  # the worker wrote every model's KV for 7 positions
    assert manager.num_cached_blocks == 1
    manager.cache_blocks("a", hashes(token_ids, 4), 12)
    assert manager.num_cached_blocks == 3


def test_another_root_or_another_position_is_no_hit():
    manager = BlockManager(num_blocks=16, block_size=4)
    run_request(manager, "a", [7, 7, 7, 7, 7, 7, 7, 7, 1])
    other_dtype = hashes([7] * 8 + [1], 4, cache_root("model", "bfloat16"))
    assert manager.cached_prefix(other_dtype, 9) == []
    # The same four tokens after other ones: a block's hash chains over its parent's.
    assert manager.cached_prefix(hashes([1, 2, 3, 4, 7, 7, 7, 7, 1], 4), 9) == []
    assert hash_block(ROOT, [7] * 4) != hash_block(hash_block(ROOT, [7] * 4), [7] * 4)


def test_freed_blocks_stay_cached_count_as_free_and_are_evicted_least_recently_released_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    run_request(manager, "a", a)  # blocks [0, 1, 2]; [0, 1] full and cached
    manager.free("a")  # released last block first: free queue [3, 2, 1, 0]
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    assert manager.can_allocate(8)
    run_request(manager, "b", b[:3])  # takes 3 and 2 (not cached): a's blocks stay
    assert len(manager.cached_prefix(hashes(a, 2), 5)) == 2
    manager.free("b")  # b's full block (3) cached; queue [1, 0, 2, 3]
    assert manager.take_num_evictions() == 0
    run_request(manager, "c", [11, 12])  # takes 1 (a's tail block): evicted first
    assert manager.take_num_evictions() == 1 and manager.take_num_evictions() == 0
    assert len(manager.cached_prefix(hashes(a, 2), 5)) == 1  # a's head block survives
    assert len(manager.cached_prefix(hashes(b[:3], 2), 3)) == 1


def test_a_hit_revives_a_free_cached_block_and_can_allocate_counts_it():
    manager = BlockManager(num_blocks=3, block_size=2)
    run_request(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")
    cached = manager.cached_prefix(hashes([1, 2, 3, 4, 9], 2), 5)
    assert len(cached) == 2 and manager.num_free_blocks == 3
    assert manager.can_allocate(6, cached)  # 2 revived + 1 new = 3 free blocks
    assert not manager.can_allocate(8, cached)
    table = manager.allocate("b", 6, cached)
    assert table[:2] == cached and manager.num_free_blocks == 0
    assert [manager.ref_count(b) for b in table] == [1, 1, 1]


def test_the_same_prefix_computed_twice_at_once_keeps_one_copy():
    manager = BlockManager(num_blocks=8, block_size=2)
    token_ids = [1, 2, 3, 4, 5]
    table_a = manager.allocate("a", 5)
    table_b = manager.allocate("b", 5)  # both scheduled before either wrote its KV
    manager.cache_blocks("a", hashes(token_ids, 2), 5)
    manager.cache_blocks("b", hashes(token_ids, 2), 5)
    assert manager.num_cached_blocks == 2
    assert [manager.is_cached(b) for b in table_a] == [True, True, False]
    assert not any(manager.is_cached(b) for b in table_b)
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 2


def test_disabled_caching_never_hits():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_request(manager, "a", [1, 2, 3, 4, 5])
    assert manager.num_cached_blocks == 0
    assert manager.cached_prefix(hashes([1, 2, 3, 4, 5], 2), 5) == []


def test_preemption_finds_its_own_blocks_again():
    manager = BlockManager(num_blocks=8, block_size=2)
    _, table = run_request(manager, "a", [1, 2, 3, 4, 5, 6, 7])
    manager.free("a")  # preempted by recompute
    cached, resumed = run_request(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert cached == table[:3] == resumed[:3]


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_against_a_model(seed):
    """Random allocate (with hits) / append / write / trim / free / preempt, checked after every operation
    against a simple model: ref counts are the tables holding a block, a block is free exactly when
    unreferenced, nothing leaks, cached blocks fit the pool, and a hit only ever returns a block whose KV
    was written from the very same tokens (the model tracks what each block holds)."""
    rng = random.Random(seed)
    size, num_blocks = 4, 24
    manager = BlockManager(num_blocks, size)
    tokens: dict[str, list[int]] = {}  # the model: each live request's committed tokens
    written: dict[str, int] = {}  # ... and how many of them have their KV written
    content: dict[int, tuple] = {}  # block -> the token prefix its KV was written from (full blocks)
    for step in range(400):
        op = rng.choice(["new", "new", "grow", "write", "free", "preempt"])
        live = sorted(tokens)
        if op == "new" or not live:
            request_id = f"r{step}"
            prefix = rng.choice([[], [9] * 8, [9] * 8 + [3] * 4, [5] * 6])  # shared system prompts
            token_ids = prefix + [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            cached = manager.cached_prefix(hashes(token_ids, size), len(token_ids))
            for i, block_id in enumerate(cached):
                assert content[block_id] == tuple(token_ids[: (i + 1) * size]), "a hit on other tokens"
            num_tokens = len(token_ids) + rng.randrange(3)  # + lookahead slots
            if not manager.can_allocate(num_tokens, cached):
                continue
            manager.allocate(request_id, num_tokens, cached)
            tokens[request_id], written[request_id] = token_ids, len(cached) * size
        else:
            request_id = rng.choice(live)
            table = manager.block_table(request_id)
            if op == "grow":
                num_new = rng.randrange(1, 4)
                if manager.can_append_slots(request_id, len(tokens[request_id]) + num_new, 2):
                    manager.append_slots(request_id, len(tokens[request_id]) + num_new, 2)
                    tokens[request_id] += [rng.randrange(4) for _ in range(num_new)]
                    manager.trim(request_id, len(tokens[request_id]))
            elif op == "write":
                token_ids = tokens[request_id]
                num = rng.randrange(written[request_id], len(token_ids) + 1)
                for i in range(written[request_id] // size, num // size):  # the worker writes private blocks
                    if manager.ref_count(table[i]) == 1 and not manager.is_cached(table[i]):
                        content[table[i]] = tuple(token_ids[: (i + 1) * size])
                written[request_id] = num
                manager.cache_blocks(request_id, hashes(token_ids, size), num)
            else:  # free (finished) or preempt (freed, to resume later: the model forgets it the same way)
                manager.free(request_id)
                del tokens[request_id], written[request_id]
        tables = {rid: manager.block_table(rid) for rid in tokens}
        holders = [sum(b in t for t in tables.values()) for b in range(num_blocks)]
        assert [manager.ref_count(b) for b in range(num_blocks)] == holders
        assert manager.num_free_blocks == sum(1 for h in holders if h == 0)
        assert manager.num_cached_blocks <= num_blocks
    for request_id in list(tokens):
        manager.free(request_id)
    assert manager.num_free_blocks == num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(num_blocks))
