"""Paged KV block bookkeeping: integer block ids, a free queue, ref counts, block tables, the prefix cache.

Pure bookkeeping, no tensors: the worker owns the KV memory; a block id is an
index into its `[num_blocks, block_size, ...]` caches. The draft model's KV
uses the same block tables, so one allocation covers both models.

Prefix caching (automatic, as vLLM's): a *full* block whose KV every model of
the worker has written for committed tokens (never lookahead slots, never
unverified drafts) is registered under its hash (block_hash.py) by
`cache_blocks`. A new or resumed request takes the cached blocks of its
longest cached prefix (`cached_prefix`, then `allocate`), so several tables
may hold one block (its ref count says how many); only the rest is computed.
A block whose ref count falls to zero goes to the back of the free queue
*keeping* its KV and hash: it counts as free, a hit takes it back, and
allocation evicts from the front (least recently released first).

Invariants: a block is either referenced (ref count > 0) or in the free queue,
never both; a cached block's KV is never written again (hits cover only full
blocks below the request's last token, which is always computed).
"""

from collections import OrderedDict
import logging

logger = logging.getLogger(__name__)


class BlockManager:
    """Allocates fixed-size KV blocks to requests, with paired check/act methods.

    A request's block table covers token positions [0, len(table) * block_size).
    Lookahead slots are real KV slots the worker fills with draft tokens, so a
    decode step reserves them like any other position.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Unreferenced blocks, least recently released first (a dict as an ordered set: O(1) removal on a hit).
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding that KV
        self._hash_of: dict[int, bytes] = {}  # the reverse, for eviction
        self._num_hashed: dict[str, int] = {}  # per table: its leading blocks already offered to the cache
        self._num_evictions = 0  # cached blocks whose KV was dropped, since last taken

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks (ref count zero), cached ones included: any of them can be allocated."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def has_blocks(self, request_id: str) -> bool:
        """Whether the request holds a block table."""
        return request_id in self._block_tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table."""
        return list(self._block_tables[request_id])

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold the block."""
        return self._ref_counts[block_id]

    def take_num_evictions(self) -> int:
        """Cached blocks evicted (their KV dropped for new use) since the last call."""
        num, self._num_evictions = self._num_evictions, 0
        return num

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's KV is registered in the prefix cache."""
        return block_id in self._hash_of

    def cached_prefix(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix of a sequence of `num_tokens` tokens.

        Only full blocks below the last token count: the last token is always computed (its logits
        sample the next), so a hit never has the request write into a block others may read.
        """
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, num_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Whether a new table for `num_tokens` positions, starting with `cached_block_ids`, fits."""
        num_new = self.num_blocks_for(num_tokens) - len(cached_block_ids)
        num_revived = sum(1 for block_id in cached_block_ids if self._ref_counts[block_id] == 0)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, cached_block_ids: list[int] = ()) -> list[int]:
        """Creates the request's table for `num_tokens` positions: the cached blocks (from `cached_prefix`),
        then new ones; returns it."""
        assert request_id not in self._block_tables, f"{request_id} already holds blocks"
        assert self.can_allocate(num_tokens, cached_block_ids)
        for block_id in cached_block_ids:
            assert self._hash_of.get(block_id) is not None, f"block {block_id} is not cached"
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1
        table = [*cached_block_ids]
        table += [self._take_block() for _ in range(self.num_blocks_for(num_tokens) - len(table))]
        self._block_tables[request_id] = table
        self._num_hashed[request_id] = len(cached_block_ids)
        return list(table)

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens_written: int) -> None:
        """Registers the request's full blocks among its first `num_tokens_written` positions.

        `num_tokens_written`: committed tokens whose KV every model on the worker has written, and
        `block_hashes` the hashes of the request's full blocks of committed tokens. A block whose hash is
        cached already (the same prefix computed twice at once) stays private and is freed as usual.
        """
        if not self.enable_prefix_caching:
            return
        table = self._block_tables[request_id]
        num_full = min(num_tokens_written // self.block_size, len(block_hashes), len(table))
        for i in range(self._num_hashed[request_id], num_full):
            if block_hashes[i] not in self._cached:
                self._cached[block_hashes[i]] = table[i]
                self._hash_of[table[i]] = block_hashes[i]
        self._num_hashed[request_id] = max(num_full, self._num_hashed[request_id])

    def num_blocks_to_append(self, request_id: str, num_tokens_total: int, num_lookahead_slots: int) -> int:
        """Worst-case new blocks so that slots cover [0, num_tokens_total + num_lookahead_slots).

        `num_tokens_total` counts the positions computed so far plus this step's
        new tokens; every lookahead slot may be written, so all are counted.
        """
        num_needed = self.num_blocks_for(num_tokens_total + num_lookahead_slots)
        return max(0, num_needed - len(self._block_tables[request_id]))

    def can_append_slots(self, request_id: str, num_tokens_total: int, num_lookahead_slots: int) -> bool:
        """Whether `append_slots` with the same arguments can succeed."""
        num_blocks = self.num_blocks_to_append(request_id, num_tokens_total, num_lookahead_slots)
        return num_blocks <= self.num_free_blocks

    def append_slots(self, request_id: str, num_tokens_total: int, num_lookahead_slots: int) -> list[int]:
        """Grows the table to cover the next tokens plus lookahead slots; returns the new block ids."""
        num_blocks = self.num_blocks_to_append(request_id, num_tokens_total, num_lookahead_slots)
        assert num_blocks <= self.num_free_blocks, "call can_append_slots first"
        new_block_ids = [self._take_block() for _ in range(num_blocks)]
        self._block_tables[request_id].extend(new_block_ids)
        return new_block_ids

    def trim(self, request_id: str, num_tokens_needed: int) -> int:
        """Frees trailing blocks beyond `num_tokens_needed` positions; returns how many were freed.

        Used once the accepted count is known: lookahead slots reserved for
        rejected drafts are no longer needed.
        """
        table = self._block_tables[request_id]
        num_kept = self.num_blocks_for(num_tokens_needed)
        num_freed = max(0, len(table) - num_kept)
        for _ in range(num_freed):
            self._release_block(table.pop())
        return num_freed

    def free(self, request_id: str) -> None:
        """Releases all of the request's blocks and forgets its table; cached ones keep their KV."""
        table = self._block_tables.pop(request_id)
        del self._num_hashed[request_id]
        # Last block first: a sequence's tail, the part least likely to be shared, is evicted first.
        for block_id in reversed(table):
            self._release_block(block_id)
        logger.debug("freed %d blocks of %s; %d free", len(table), request_id, self.num_free_blocks)

    def _take_block(self) -> int:
        """The least recently released free block, evicted from the cache if it was cached."""
        block_id, _ = self._free_queue.popitem(last=False)
        assert self._ref_counts[block_id] == 0, f"block {block_id} in the free queue is in use"
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._cached[block_hash]
            self._num_evictions += 1
        self._ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        assert self._ref_counts[block_id] > 0, f"block {block_id} released twice"
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:  # only unreferenced blocks go back to the free queue
            self._free_queue[block_id] = None
