"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix.

With `tree_width` > 1 the draft is a tree (proposers/trees.py) over the
continuations of the MAX_TREE_MATCHES latest occurrences: a node's
confidence is the share of those occurrences that follow its path.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker_service.speculation.proposers import Proposal, Proposer
from worker_service.speculation.proposers.trees import DraftTree, draft_width, grow_tree

MAX_TREE_MATCHES = 16  # the latest occurrences a tree's continuations come from


def propose_ngram(
    token_ids: list[int] | np.ndarray, ngram_min: int, ngram_max: int, num_drafts: int
) -> tuple[list[int], int]:
    """Up to `num_drafts` tokens that followed the most recent earlier match of the sequence's suffix, and the
    match's length n (0: no drafts).

    Tries suffix lengths n from ngram_max down to ngram_min and takes the
    longest that matches; among its matches, the most recent one that still
    has a following token. No match: no drafts.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    if num_drafts <= 0:
        return [], 0
    starts, n = _follower_starts(tokens, ngram_min, ngram_max)
    return (tokens[starts[0] : starts[0] + num_drafts].tolist(), n) if len(starts) else ([], 0)


def propose_ngram_tree(
    token_ids: list[int], ngram_min: int, ngram_max: int, max_nodes: int, max_width: int
) -> tuple[DraftTree, int]:
    """A tree of the continuations of the latest matches of the longest matching suffix (module docstring),
    and the match's length n (0: no drafts)."""
    tokens = token_ids

    def follow(starts: list[int], depth: int) -> list[tuple[int, float, list[int]]]:
        by_token: dict[int, list[int]] = {}  # the latest first: ties go to the latest occurrence
        for start in starts:
            if start + depth < len(tokens):
                by_token.setdefault(tokens[start + depth], []).append(start)
        total = sum(map(len, by_token.values()))
        return sorted(((t, len(s) / total, s) for t, s in by_token.items()), key=lambda child: -child[1])

    starts, n = _follower_starts(np.asarray(token_ids, dtype=np.int64), ngram_min, ngram_max)
    if not len(starts) or max_nodes <= 0:
        return DraftTree(), 0
    return grow_tree(follow, starts[:MAX_TREE_MATCHES].tolist(), max_nodes, max_nodes, max_width, 0.0), n


def _follower_starts(tokens: np.ndarray, ngram_min: int, ngram_max: int) -> tuple[np.ndarray, int]:
    """Where the tokens after each earlier match of the longest matching suffix start, the latest first, and
    its length n; (empty, 0) without a match."""
    num_tokens = len(tokens)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens-n, n]: starts 0.. with a follower
        matches = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if len(matches):
            return matches[::-1] + n, n
    return np.zeros(0, dtype=np.int64), 0


class NgramProposer(Proposer):
    """Prompt lookup over prompt + generated tokens; no model."""

    reports_match = True

    def __init__(self, ngram_min: int, ngram_max: int, tree_width: int = 1):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tree_width = tree_width  # 1: chains

    def propose(self, states, num_drafts: list[int]) -> Proposal:
        found = [self._propose_one(s, k) for s, k in zip(states, num_drafts)]
        return Proposal(
            [tree.token_ids for tree, _ in found],
            scores=[tree.score for tree, _ in found],
            match_lengths=[n for _, n in found],
            parents=[tree.parents if tree.parents and tree.token_ids else None for tree, _ in found],
            ranks=[tree.ranks for tree, _ in found],
        )

    def _propose_one(self, state, k: int) -> tuple[DraftTree, int]:
        """A tree where the sequence's width this step is > 1, else a chain (a DraftTree without parents)."""
        width = draft_width(state, self.tree_width)
        if width > 1:
            return propose_ngram_tree(state.token_ids, self.ngram_min, self.ngram_max, k, width)
        drafts, n = propose_ngram(state.token_ids, self.ngram_min, self.ngram_max, k)
        return DraftTree(token_ids=drafts), n
