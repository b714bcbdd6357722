"""Acceptance along a draft tree: which path of drafts to keep, and the token after it.

A sequence's verify rows form a tree (kernels/draft_tree.py): row 0 is the
last emitted token, every other row a draft token whose parent is an earlier
row. Row i's logits give the target's distribution q_i for the token after
row i's path, at position n + depth(i) (n: the position row 0 samples), and
y_i is the target's keyed sample there: race(q_i, E(seed, n + depth(i))), or
argmax q_i for a greedy request (kernels/rejection_sampler.py). The rule:

    node = row 0
    repeat: y = y_node
            if a child c of node has token y: accept c, node = c
            else: emit y and stop (after a leaf, y is the bonus token)

Why this is exact (lossless): plain decoding emits, at each position, the
target's keyed sample given the tokens before it. By induction along the
accepted path, every accepted row's context is plain decoding's context: its
attention reads the cached prefix and its own path only, and its keyed noise
is that of its position n + depth(i), which is plain decoding's position for
the same token. So y_node is the token plain decoding emits after the path,
and the rule keeps a child exactly when it is that token, then emits the
first token that no child guessed: the emitted tokens are plain decoding's,
token for token, for greedy and seeded requests alike (an unseeded request
draws a random seed, so its tokens are an exact sample of the target). Unlike
multi-draft rejection sampling (SpecInfer, EAGLE-2), no residual
distribution is needed: a draft's own randomness never enters the choice;
only the target's keyed sample does. Siblings should carry distinct tokens
(proposers merge equal ones); if two do, the first in row order is taken.
"""


def accept_tree(target_tokens: list[int], node_tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """The accepted rows (deepest last, row 0 left out) and the emitted tokens (theirs, then the stop's y).

    ``target_tokens[i]``: y_i, the target's keyed sample (or argmax) at row i; ``node_tokens[i]``: row i's
    draft token (row 0's is not read); ``parents[i]``: row i's parent row (row 0's is not read), topological.
    """
    children: dict[int, list[int]] = {}
    for row in range(1, len(parents)):
        children.setdefault(parents[row], []).append(row)
    node, path = 0, []
    while True:
        y = target_tokens[node]
        child = next((c for c in children.get(node, ()) if node_tokens[c] == y), None)
        if child is None:
            return path, [node_tokens[row] for row in path] + [y]
        path.append(child)
        node = child
