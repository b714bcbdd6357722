"""Acceptance along a draft tree: the path that follows the target's keyed samples, and output equal to plain
decoding's whatever the trees (a toy keyed target, so that every tree shape is cheap to try)."""

import hashlib
import random

import pytest

from kernels.tree_acceptance import accept_tree
from tests.kernels.test_tree_attention import random_tree

VOCAB = 6  # small, so that guesses often hit and trees branch on real alternatives


def keyed_target(context: tuple[int, ...], seed: int) -> int:
    """A toy target's keyed sample after `context`: a fixed function of the tokens before and the seed (and
    so of the position), as the worker's keyed race is."""
    digest = hashlib.sha256(repr((seed, context)).encode()).digest()
    return digest[0] % VOCAB


def plain_decode(prompt: tuple[int, ...], seed: int, num_tokens: int) -> list[int]:
    context = prompt
    for _ in range(num_tokens):
        context += (keyed_target(context, seed),)
    return list(context[len(prompt) :])


def tree_decode(accept, prompt: tuple[int, ...], seed: int, num_tokens: int, rng: random.Random) -> list[int]:
    """Speculative decoding with a random draft tree per step: every node guesses the target's token right
    half the time (else a random token; siblings distinct), the target scores each row's context."""
    context = prompt
    while len(context) - len(prompt) < num_tokens:
        parents = random_tree(rng, rng.randint(1, 16), rng.randint(1, 6), rng.randint(1, 4))
        tokens, contexts = [None], [context]
        for row in range(1, len(parents)):
            parent_context = contexts[parents[row]]
            taken = {tokens[c] for c in range(1, row) if parents[c] == parents[row]}
            right = keyed_target(parent_context, seed)
            guess = right if rng.random() < 0.5 and right not in taken else rng.randrange(VOCAB)
            while guess in taken and len(taken) < VOCAB:
                guess = rng.randrange(VOCAB)
            tokens.append(guess)
            contexts.append(parent_context + (guess,))
        targets = [keyed_target(c, seed) for c in contexts]  # y of every row, as one target pass gives them
        path, emitted = accept(targets, tokens, parents)
        assert emitted[:-1] == [tokens[row] for row in path]
        assert all(parents[b] == a for a, b in zip([0, *path], path))  # a path from the root
        context += tuple(emitted)
    return list(context[len(prompt) :])[:num_tokens]


def accept_first_child(target_tokens, node_tokens, parents):
    """A broken rule: when some child matches, it takes the node's first child (a sibling of the match)."""
    node, path = 0, []
    while True:
        children = [c for c in range(1, len(parents)) if parents[c] == node]
        if not any(node_tokens[c] == target_tokens[node] for c in children):
            return path, [node_tokens[row] for row in path] + [target_tokens[node]]
        path.append(children[0])
        node = children[0]


def test_the_child_equal_to_the_targets_sample_is_accepted_not_its_sibling():
    #            row: 0   1  2  3  4  5  6
    parents = [-1, 0, 0, 0, 2, 2, 5]
    tokens = [None, 5, 7, 9, 3, 4, 8]
    # y per row: after the root the target says 7 (row 2), after row 2 it says 4 (row 5), after row 5 it says 1
    targets = [7, 0, 4, 0, 0, 1, 0]
    assert accept_tree(targets, tokens, parents) == ([2, 5], [7, 4, 1])
    # a leaf accepted: the bonus token is y at the leaf
    targets[5] = 8
    targets[6] = 2
    assert accept_tree(targets, tokens, parents) == ([2, 5, 6], [7, 4, 8, 2])
    # no child matches at the root: y is emitted alone
    assert accept_tree([1, 0, 0, 0, 0, 0, 0], tokens, parents) == ([], [1])


def test_a_chain_follows_the_chain_rule():
    """On a chain: accept while the draft equals y, then emit y (worker_service/speculation/verify.py's rule)."""
    parents, tokens = [-1, 0, 1, 2], [None, 4, 5, 6]
    assert accept_tree([4, 5, 9, 0], tokens, parents) == ([1, 2], [4, 5, 9])
    assert accept_tree([4, 5, 6, 3], tokens, parents) == ([1, 2, 3], [4, 5, 6, 3])


@pytest.mark.parametrize("seed", range(8))
def test_tree_decoding_emits_plain_decodings_tokens(seed):
    prompt = (1, 2, 3)
    want = plain_decode(prompt, seed, 60)
    assert tree_decode(accept_tree, prompt, seed, 60, random.Random(seed)) == want


def test_accepting_a_sibling_instead_of_the_matching_child_is_caught():
    prompt = (1, 2, 3)
    differ = [
        seed
        for seed in range(8)
        if tree_decode(accept_first_child, prompt, seed, 60, random.Random(seed)) != plain_decode(prompt, seed, 60)
    ]
    assert len(differ) == 8
