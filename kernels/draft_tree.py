"""Draft trees in a packed batch: which keys of its own sequence each query row sees.

A sequence's query rows are normally a chain: row i (of q_len) sits at position
seq_len - q_len + i and sees keys 0..its position. A speculative step may
instead send a *tree* of drafts: rows in topological order, each naming its
parent row (-1: it follows the cached prefix directly). Row i is computed at
position ctx_start + depth(i) (ctx_start = seq_len - q_len) and sees the cached
prefix and its own path from the root: its ancestors and itself. Its K/V were
written to slot ctx_start + i (tree order), so the path's keys are not
contiguous; the attention paths read them through ``paths``, which hold the
positions (slots in the sequence) of each row's path, root first:

    logical key j of row t (j < prefix_lens[b] + depth(t) + 1) is
        position j                                  for j < prefix_lens[b] (the prefix)
        position paths[t, j - prefix_lens[b]]       otherwise

which, for an accepted path, are the keys a plain decode at that position reads,
in the same order: the batch-invariant kernel gives it bitwise the same output.
The prefix usually ends where the query rows start (``from_parents``); a drafter
that grows a tree a level per call (an EAGLE-3 head) queries only the newest
level, whose ancestors were written by earlier calls after the prefix
(``from_paths``). A chain is the tree with parent = previous row; sequences
that are chains keep the plain causal rule in every kernel (``is_tree`` 0), so
their results do not change by a bit.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTrees:
    """The tree structure of a packed batch's query rows, as the attention kernels read it."""

    is_tree: torch.Tensor  # [B] int32: 1 where the sequence's rows are not a plain chain
    prefix_lens: torch.Tensor  # [B] int32: the keys every row of a tree sequence sees (0 for a chain)
    depths: torch.Tensor  # [T] int32: a tree row's path length - 1
    paths: torch.Tensor  # [T, P] int32: positions of a tree row's path, root .. itself; -1 after; P >= 1

    @staticmethod
    def from_parents(query_start_loc: list[int], seq_lens: list[int], parents: list[int]) -> "DraftTrees":
        """From each packed row's parent row within its own sequence (-1: the cached prefix); a sequence's rows
        were written at its last positions (it holds seq_lens[b] keys).

        Raises ValueError unless every parent is -1 or an earlier row of the same sequence.
        """
        num_tokens = query_start_loc[-1]
        if len(parents) != num_tokens:
            raise ValueError(f"{len(parents)} parents for {num_tokens} query rows")
        rows: list[tuple[int, ...]] = [()] * num_tokens  # each row's path, as row indices
        paths: list[list[int] | None] = []
        prefix_lens = []
        for b, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
            chain = True
            for i in range(end - start):
                parent = parents[start + i]
                if not -1 <= parent < i:
                    raise ValueError(
                        f"row {i} of a sequence names parent {parent}: a parent is -1 (the cached "
                        f"prefix) or an earlier row of the same sequence"
                    )
                chain = chain and parent == i - 1
                rows[start + i] = (*(rows[start + parent] if parent >= 0 else ()), i)
            ctx_start = seq_lens[b] - (end - start)
            prefix_lens.append(0 if chain else ctx_start)
            paths += [None] * (end - start) if chain else [[ctx_start + r for r in rows[t]] for t in range(start, end)]
        return DraftTrees.from_paths(query_start_loc[:-1], prefix_lens, paths)

    @staticmethod
    def from_paths(query_starts: list[int], prefix_lens: list[int], paths: list[list[int] | None]) -> "DraftTrees":
        """From each packed row's path (the positions it sees after its sequence's prefix, root first, itself
        last), or None for every row of a chain sequence; `query_starts`: each sequence's first packed row."""
        num_tokens = len(paths)
        is_tree = [0] * len(query_starts)
        for b, start in enumerate(query_starts):
            if start < num_tokens and paths[start] is not None:
                is_tree[b] = 1
        width = max((len(p) for p in paths if p is not None), default=1)
        # Python lists, one tensor each: host metadata on its way to the device, no host tensor arithmetic.
        table = [[-1] * width if path is None else path + [-1] * (width - len(path)) for path in paths]
        depths = [0 if path is None else len(path) - 1 for path in paths]
        prefix = [p if tree else 0 for p, tree in zip(prefix_lens, is_tree)]
        return DraftTrees(
            torch.tensor(is_tree, dtype=torch.int32),
            torch.tensor(prefix, dtype=torch.int32),
            torch.tensor(depths, dtype=torch.int32),
            torch.tensor(table, dtype=torch.int32) if table else torch.full((0, width), -1, dtype=torch.int32),
        )  # [T, P]

    def to(self, device: torch.device | str) -> "DraftTrees":
        return DraftTrees(*(t.to(device) for t in (self.is_tree, self.prefix_lens, self.depths, self.paths)))

    def visible(self, query_start_loc: list[int], seq_lens: list[int], b: int) -> torch.Tensor:  # [Q, L] bool
        """Which of its seq_lens[b] keys each query row of sequence b sees (the reference attention's mask)."""
        start, end = query_start_loc[b], query_start_loc[b + 1]
        q_len, seq_len = end - start, seq_lens[b]
        keys = torch.arange(seq_len)  # [L]
        if not self.is_tree[b]:
            return keys[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]  # [Q, L] causal
        seen = torch.zeros(q_len, seq_len, dtype=torch.bool)  # [Q, L]
        seen[:, : int(self.prefix_lens[b])] = True
        for i in range(q_len):
            path = self.paths[start + i]
            seen[i, path[path >= 0].long()] = True
        return seen
