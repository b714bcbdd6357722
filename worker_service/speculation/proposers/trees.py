"""Draft trees as proposers build them: several continuations per sequence, verified in one pass.

A tree's drafts are rows 1..n of the sequence's verify query (row 0 is its
last token); `parents[j - 1]` is draft j's parent row (0: the root). A chain
is the tree whose parents are 0, 1, 2, ...

`grow_tree` builds one best-first, as EAGLE-2 builds its dynamic tree: a
node's confidence is the product of its proposer's probabilities along its
path (the probability that the target accepts it, if the proposer is
calibrated), and the tree takes the most confident nodes, at most
`max_width` children per node, until it holds `max_nodes` or no candidate
reaches `min_confidence`. Because a child is never more confident than its
parent, the chosen nodes always include their ancestors. The expected
accepted length of the tree is the sum of its nodes' confidences. Rows are
then numbered depth first, each node's likeliest child first, so the drafts
begin with the chain a chain proposer would have drafted (`chain_length`).
Each row also keeps its *rank*, the order in which the tree chose it (1: the
most confident node; ties: the earlier chosen): the tree of the first j ranks
is the tree a budget of j nodes grows, so the scheduler learns from the ranks
of accepted nodes how much the j-th node of a budget returns.

The width is the scheduler's to choose per sequence and step
(`RequestState.draft_tree_width`, `draft_width`); a proposer's own width
(its `tree_width`, the worker's --draft-tree-width) applies where it sent 0.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
import heapq
import itertools
from typing import Any

# expand(state, depth) -> the children of a node `depth` tokens below the root: (token, probability, state),
# most probable first.
Expand = Callable[[Any, int], list[tuple[int, float, Any]]]


@dataclass
class DraftTree:
    token_ids: list[int] = field(default_factory=list)  # rows 1..n, depth first, likeliest child first
    parents: list[int] = field(default_factory=list)  # each row's parent row (0: the root)
    confidences: list[float] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)  # each node's state (what expand made of it)
    ranks: list[int] = field(default_factory=list)  # the order each row was chosen in (1: first)

    @property
    def score(self) -> float:
        """The expected accepted length: the sum of the nodes' confidences."""
        return sum(self.confidences)


def grow_tree(
    expand: Expand, root: Any, max_nodes: int, max_depth: int, max_width: int, min_confidence: float
) -> DraftTree:
    """The most confident nodes under `root` (see the module docstring)."""
    order = itertools.count()  # ties: the earlier pushed (a likelier sibling, or a shallower node) first
    heap: list = []
    chosen: list[tuple[int, int, float, Any]] = []  # (parent index in `chosen` or -1, token, confidence, state)

    def push_children(parent: int, state: Any, depth: int, confidence: float) -> None:
        if depth >= max_depth:
            return
        for token, probability, child in expand(state, depth)[:max_width]:
            heapq.heappush(heap, (-confidence * probability, next(order), parent, token, child, depth + 1))

    push_children(-1, root, 0, 1.0)
    while heap and len(chosen) < max_nodes:
        negative, _, parent, token, state, depth = heapq.heappop(heap)
        if -negative < min_confidence:
            break
        chosen.append((parent, token, -negative, state))
        push_children(len(chosen) - 1, state, depth, -negative)
    return _depth_first(chosen)


def best_nodes(parents: list[int], token_ids: list[int], confidences: list[float], max_nodes: int) -> DraftTree:
    """The `max_nodes` most confident of these candidate nodes (each parent an earlier candidate, or -1 for the
    root, and no more confident than it), as a tree numbered depth first."""
    ranked = sorted(range(len(parents)), key=lambda n: (-confidences[n], n))[:max_nodes]
    index_of = {n: j for j, n in enumerate(sorted(ranked))}  # the chosen in candidate order: parents first
    chosen = [
        (index_of[parents[n]] if parents[n] >= 0 else -1, token_ids[n], confidences[n], n) for n in sorted(ranked)
    ]
    assert all(parents[n] < 0 or parents[n] in index_of for n in ranked), "a chosen node's parent was not chosen"
    return _depth_first(chosen)


def _depth_first(chosen: list[tuple[int, int, float, Any]]) -> DraftTree:
    """Renumbers the chosen nodes depth first, each node's children by confidence (ties: chosen first)."""
    children: dict[int, list[int]] = {}
    rank_of = {index: rank for rank, index in enumerate(_by_confidence(list(range(len(chosen))), chosen), start=1)}
    for index, (parent, _, _, _) in enumerate(chosen):
        children.setdefault(parent, []).append(index)
    tree, row_of = DraftTree(), {}
    stack = [(index, 0) for index in reversed(_by_confidence(children.get(-1, []), chosen))]  # (node, parent row)
    while stack:
        index, parent_row = stack.pop()
        _, token, confidence, state = chosen[index]
        tree.token_ids.append(token)
        tree.parents.append(parent_row)
        tree.confidences.append(confidence)
        tree.states.append(state)
        tree.ranks.append(rank_of[index])
        row_of[index] = len(tree.token_ids)
        stack.extend((child, row_of[index]) for child in reversed(_by_confidence(children.get(index, []), chosen)))
    return tree


def _by_confidence(indices: list[int], chosen) -> list[int]:
    return sorted(indices, key=lambda i: -chosen[i][2])  # stable: ties keep the order they were chosen in


def draft_width(state, default: int) -> int:
    """The most children per draft `state` may get this step: the scheduler's choice, else `default`."""
    return state.draft_tree_width or default


def first_ranks(ranks: list[int], n: int) -> list[int]:
    """The ranks of a tree's first `n` rows (depth first; a tree too) among themselves."""
    kept = sorted(range(n), key=lambda row: ranks[row])
    result = [0] * n
    for rank, row in enumerate(kept, start=1):
        result[row] = rank
    return result


def row_depths(parents: list[int]) -> list[int]:
    """The depth of each row: the root's 0, then each draft's (its parent's + 1)."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent] + 1)
    return depths


def tree_depth(parents: list[int]) -> int:
    """The most drafts one step of this tree can accept (its deepest node's depth)."""
    return max(row_depths(parents))


def chain_length(parents: list[int]) -> int:
    """How many leading drafts form a chain from the root (draft j's parent is row j - 1)."""
    return next((j for j, parent in enumerate(parents) if parent != j), len(parents))


def tree_matching(token_ids: list[int], parents: list[int], emitted: list[int]) -> int:
    """How deep the emitted tokens follow the tree from the root (for a chain: the drafts' common prefix with
    them): the drafts the target accepted, or would have had the tree been scored."""
    node, depth = 0, 0
    while depth < len(emitted):
        child = next(
            (j + 1 for j, parent in enumerate(parents) if parent == node and token_ids[j] == emitted[depth]), None
        )
        if child is None:
            break
        node, depth = child, depth + 1
    return depth
