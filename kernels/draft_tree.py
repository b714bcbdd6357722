"""Draft trees in a packed batch: which earlier query rows of its own sequence each query row sees.

A sequence's query rows are normally a chain: row i (of q_len) sits at position
seq_len - q_len + i and sees the cached prefix and rows 0..i. A speculative step
may instead send a *tree* of drafts: rows in topological order, each naming its
parent row (-1: it follows the cached prefix directly). Row i then sits at
position ctx_start + depth(i) (ctx_start = seq_len - q_len) and sees the cached
prefix and its own path from the root: its ancestors and itself. Its K/V were
written to slot ctx_start + i (tree order), so the path's keys are not
contiguous; the attention paths read them through ``paths``:

    logical key j of row t (j < ctx_start + depth(t) + 1) is
        position j                          for j < ctx_start (the prefix)
        position ctx_start + paths[t, j - ctx_start]   otherwise

which, for an accepted path, are the keys a plain decode at that position reads,
in the same order: the batch-invariant kernel gives it bitwise the same output.
A chain is the tree with parent = previous row; sequences that are chains keep
the plain causal rule in every kernel (``is_tree`` 0), so their results do not
change by a bit.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTrees:
    """The tree structure of a packed batch's query rows, as the attention kernels read it."""

    is_tree: torch.Tensor  # [B] int32: 1 where the sequence's rows are not a plain chain
    depths: torch.Tensor  # [T] int32: a row's depth (its position is seq_len - q_len + depth)
    paths: torch.Tensor  # [T, P] int32: row indices (within its sequence) root .. itself; -1 after; P >= 1

    @staticmethod
    def from_parents(query_start_loc: list[int], parents: list[int]) -> "DraftTrees":
        """From each packed row's parent row within its own sequence (-1: the cached prefix).

        Raises ValueError unless every parent is -1 or an earlier row of the same sequence.
        """
        num_tokens = query_start_loc[-1]
        if len(parents) != num_tokens:
            raise ValueError(f"{len(parents)} parents for {num_tokens} query rows")
        depths, paths, is_tree = [0] * num_tokens, [()] * num_tokens, []
        for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
            chain = True
            for i in range(end - start):
                parent = parents[start + i]
                if not -1 <= parent < i:
                    raise ValueError(f"row {i} of a sequence names parent {parent}: a parent is -1 (the cached "
                                     f"prefix) or an earlier row of the same sequence")
                chain = chain and parent == i - 1
                above = paths[start + parent] if parent >= 0 else ()
                paths[start + i] = (*above, i)
                depths[start + i] = len(above)
            is_tree.append(0 if chain else 1)
        width = max((len(paths[t]) for s, e, tree in zip(query_start_loc, query_start_loc[1:], is_tree) if tree
                     for t in range(s, e)), default=1)
        table = torch.full((num_tokens, width), -1, dtype=torch.int32)  # [T, P]
        for start, end, tree in zip(query_start_loc, query_start_loc[1:], is_tree):
            for t in range(start, end) if tree else ():
                table[t, :len(paths[t])] = torch.tensor(paths[t], dtype=torch.int32)
        return DraftTrees(torch.tensor(is_tree, dtype=torch.int32), torch.tensor(depths, dtype=torch.int32), table)

    def to(self, device: torch.device | str) -> "DraftTrees":
        return DraftTrees(self.is_tree.to(device), self.depths.to(device), self.paths.to(device))

    def visible(self, query_start_loc: list[int], seq_lens: list[int], b: int) -> torch.Tensor:  # [Q, L] bool
        """Which of its seq_lens[b] keys each query row of sequence b sees (the reference attention's mask)."""
        start, end = query_start_loc[b], query_start_loc[b + 1]
        q_len, seq_len = end - start, seq_lens[b]
        ctx_start = seq_len - q_len
        keys = torch.arange(seq_len)  # [L]
        if not self.is_tree[b]:
            return keys[None, :] <= (ctx_start + torch.arange(q_len))[:, None]  # [Q, L] causal
        seen = torch.zeros(q_len, seq_len, dtype=torch.bool)  # [Q, L]
        seen[:, :ctx_start] = True
        for i in range(q_len):
            path = self.paths[start + i]
            seen[i, ctx_start + path[path >= 0].long()] = True
        return seen
