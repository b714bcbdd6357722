"""The prefix cache's block hashes: one place that says what identifies a full block's KV.

A full block's hash is SHA-256 over its parent block's hash and its token ids,
chained from a root that names everything else that changes the KV: the model,
its dtype, the block size (`cache_root`). Two blocks have the same hash exactly
when the same model computed them from the very same tokens at the very same
positions (a collision of SHA-256 needs ~2**128 tries: no client can steer a
prompt into another's blocks). The request keeps its hashes (`BlockHashes`),
extended as tokens are committed; the block manager keeps the map from hash to
block.
"""

from array import array
import hashlib


def cache_root(*facts: str) -> bytes:
    """The root of every hash chain: the facts that change the KV besides the tokens (model, dtype, ...)."""
    return hashlib.sha256("\0".join(facts).encode()).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block with these tokens after the block whose hash is `parent` (or the root)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockHashes:
    """The chained hashes of a token sequence's full blocks; the tokens only ever grow (committed ones)."""

    def __init__(self, root: bytes, block_size: int):
        self.root = root
        self.block_size = block_size
        self.hashes: list[bytes] = []

    def extend(self, token_ids: list[int]) -> list[bytes]:
        """Hashes the full blocks of `token_ids` not hashed yet; returns every full block's hash."""
        size = self.block_size
        for i in range(len(self.hashes), len(token_ids) // size):
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(hash_block(parent, token_ids[i * size : (i + 1) * size]))
        return self.hashes
