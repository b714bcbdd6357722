"""Paged KV block bookkeeping: integer block ids, a free list, ref counts, block tables.

Pure bookkeeping, no tensors: the worker owns the KV memory; a block id is an
index into its `[num_blocks, block_size, ...]` caches. The draft model's KV
uses the same block tables, so one allocation covers both models.
"""

from collections import deque
import logging

logger = logging.getLogger(__name__)


class BlockManager:
    """Allocates fixed-size KV blocks to requests, with paired check/act methods.

    A request's block table covers token positions [0, len(table) * block_size).
    Lookahead slots are real KV slots the worker fills with draft tokens, so a
    decode step reserves them like any other position.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (ref count zero)."""
        return len(self._free_block_ids)

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
        """How many block tables hold the block (0 or 1: blocks are not shared yet)."""
        return self._ref_counts[block_id]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new table for `num_tokens` positions fits in the free blocks."""
        return self.num_blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Creates the request's table with blocks for `num_tokens` positions; returns it."""
        assert request_id not in self._block_tables, f"{request_id} already holds blocks"
        assert self.can_allocate(num_tokens)
        table = [self._take_block() for _ in range(self.num_blocks_for(num_tokens))]
        self._block_tables[request_id] = table
        return list(table)

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
        """Frees all of the request's blocks and forgets its table."""
        table = self._block_tables.pop(request_id)
        for block_id in reversed(table):
            self._release_block(block_id)
        logger.debug("freed %d blocks of %s; %d free", len(table), request_id, self.num_free_blocks)

    def _take_block(self) -> int:
        block_id = self._free_block_ids.popleft()
        assert self._ref_counts[block_id] == 0, f"block {block_id} on the free list is in use"
        self._ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        assert self._ref_counts[block_id] > 0, f"block {block_id} released twice"
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:  # only unreferenced blocks go back to the free list
            self._free_block_ids.append(block_id)
