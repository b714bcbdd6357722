"""Draft trees in the worker: how proposers grow them (proposers/trees.py, the suffix proposer's), and a step
that verifies them: plain decoding's tokens, greedy and seeded, fp32 and bf16, mixed with chains and plain
decodes, with accepted paths off the first branch (their K/V moved, the EAGLE-3 features reordered)."""

import argparse

import pytest

from specdec import step
from tests.worker.driver import Driver
from tests.worker.speculation.test_seeded_sampling import PROMPT, SAMPLING_IDS, SAMPLINGS, alone, sharp_pair  # noqa: F401
from tests.worker.speculation.test_speculative import BLOCK_SIZE, MAX_TOKENS, NUM_BLOCKS, PROMPTS, make_worker
from worker_service.serving.flags import add_flags, config_from_args, forwarded_argv
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.proposers import Proposal, Proposer, num_matching
from worker_service.speculation.proposers.ngram import propose_ngram, propose_ngram_tree
from worker_service.speculation.proposers.suffix import SuffixProposer, TokenIndex, walk, walk_tree
from worker_service.speculation.proposers.trees import (
    best_nodes,
    chain_length,
    first_ranks,
    grow_tree,
    tree_depth,
    tree_matching,
)
from worker_service.speculation.request_state import InvalidStepError, RequestState

K = 8


# ------------------------------------------------------------------ growing trees

# Each node (a tuple of tokens from the root) -> its children's (token, probability).
CHILDREN = {
    (): [(1, 0.6), (2, 0.3), (3, 0.1)],
    (1,): [(4, 0.9), (5, 0.1)],
    (2,): [(6, 0.5), (7, 0.5)],
    (1, 4): [(8, 0.5), (9, 0.4)],
    (1, 4, 8): [(10, 1.0)],
}


def expand(path, depth):
    assert len(path) == depth
    return [(token, p, path + (token,)) for token, p in CHILDREN.get(path, [])]


def test_grow_tree_takes_the_most_confident_nodes_depth_first():
    tree = grow_tree(expand, (), max_nodes=6, max_depth=8, max_width=3, min_confidence=0.01)
    # confidences: 1 .6, 14 .54, 2 .3, 148 .27, 1489/149 .216, 1481... -> the 6 best: 1, 14, 2, 148, 14810, 149
    assert tree.states == [(1,), (1, 4), (1, 4, 8), (1, 4, 8, 10), (1, 4, 9), (2,)]
    assert tree.token_ids == [1, 4, 8, 10, 9, 2]
    assert tree.parents == [0, 1, 2, 3, 2, 0]
    assert chain_length(tree.parents) == 4 and tree_depth(tree.parents) == 4
    assert tree.score == pytest.approx(0.6 + 0.54 + 0.27 + 0.27 + 0.216 + 0.3)


def test_a_tree_ranks_its_nodes_in_the_order_it_chose_them():
    """Rank j: the j-th node best-first growth chose (ties: the earlier chosen), so the first j ranks are the
    tree a budget of j grows; the ranks of a depth-first prefix (a preview cut to k) are renumbered."""
    tree = grow_tree(expand, (), max_nodes=6, max_depth=8, max_width=3, min_confidence=0.01)
    assert tree.states == [(1,), (1, 4), (1, 4, 8), (1, 4, 8, 10), (1, 4, 9), (2,)]
    assert tree.ranks == [1, 2, 4, 5, 6, 3]
    for budget in range(1, 7):
        smaller = grow_tree(expand, (), max_nodes=budget, max_depth=8, max_width=3, min_confidence=0.01)
        assert sorted(smaller.states) == sorted(s for s, r in zip(tree.states, tree.ranks) if r <= budget)
    assert first_ranks(tree.ranks, 5) == [1, 2, 3, 4, 5] and first_ranks([1, 3, 4, 2], 3) == [1, 2, 3]
    picked = best_nodes([-1, -1, 0, 1], [7, 8, 9, 10], [0.5, 0.4, 0.45, 0.1], 3)
    assert picked.token_ids == [7, 9, 8] and picked.ranks == [1, 2, 3]


def test_grow_tree_respects_width_depth_and_confidence():
    assert grow_tree(expand, (), 10, 8, 1, 0.01).token_ids == [1, 4, 8, 10]  # width 1: the likeliest chain
    assert grow_tree(expand, (), 10, 2, 3, 0.01).states == [(1,), (1, 4), (1, 5), (2,), (2, 6), (2, 7), (3,)]
    assert grow_tree(expand, (), 10, 8, 3, 0.29).states == [(1,), (1, 4), (2,)]  # .27 < .29: not taken
    assert grow_tree(expand, (), 0, 8, 3, 0.0).token_ids == []


def test_tree_matching_follows_the_emitted_tokens():
    tokens, parents = [1, 4, 8, 9, 2, 6], [0, 1, 2, 2, 0, 5]
    assert tree_matching(tokens, parents, [1, 4, 9, 33]) == 3
    assert tree_matching(tokens, parents, [2, 6]) == 2
    assert tree_matching(tokens, parents, [7]) == 0
    assert num_matching(tokens, [1, 4, 9], parents) == 3 and num_matching(tokens, [1, 4, 9]) == 2  # a chain


def test_suffix_tree_of_width_one_is_the_walk():
    """With one child per node the tree is the chain the walk drafts, with its score."""
    index = TokenIndex()
    history = [t for f in (3, 4, 3, 5, 3, 3, 6) for t in (50, 1, 2, f, 9, 9)] + [50, 1, 2]
    index.extend(0, history)
    candidates = index.candidates(history)
    chain, tree = walk(candidates, K), walk_tree(candidates, K, 1)
    assert tree.token_ids == chain.token_ids and tree.score == pytest.approx(chain.score)
    assert tree.parents == list(range(len(chain.token_ids)))


def test_suffix_tree_keeps_the_continuations_the_walk_drops():
    """After 34 x [60] + [1, 2] (all matches equally long) came 3 (four times, then four different tokens), 4
    (twice, then 20 both times) and 5 (once). The walk drafts 3 and its most recent follower at confidence
    4/7 x 1/4; the tree drafts 3, then the 4 branch (2/7 all along) before 3's uncertain followers."""
    history = (
        [
            t
            for f, g in ((3, 10), (4, 20), (3, 11), (5, 30), (3, 12), (4, 20), (3, 13))
            for t in [60] * 34 + [1, 2, f, g]
        ]
        + [60] * 34
        + [1, 2]
    )
    state = RequestState("a", history, len(history), step.RequestSampling(temperature=0.0), [], K)
    chain = SuffixProposer(cache_tokens=0).propose([state], [K]).draft_token_ids[0]
    assert chain == [3, 13, 60, 60, 60, 60, 60, 60]
    proposal = SuffixProposer(cache_tokens=0, tree_width=3).propose([state], [K])
    assert proposal.draft_token_ids[0] == [3, 4, 20, 60, 60, 60, 60, 60]
    assert proposal.parents[0] == [0, 0, 2, 3, 4, 5, 6, 7]
    assert proposal.scores[0] == pytest.approx(4 / 7 + 7 * 2 / 7)


def test_ngram_tree_holds_the_continuations_of_the_latest_matches():
    """[1, 2] occurred three times, followed by 3, 4 and 3: a chain copies the latest (3, 7); the tree has 3 (two
    of three occurrences) and 4 beside it, and each continues as its occurrences did."""
    tokens = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 3, 7, 9, 1, 2]
    assert propose_ngram(tokens, 1, 2, 3) == ([3, 7, 9], 2)
    tree, n = propose_ngram_tree(tokens, 1, 2, max_nodes=4, max_width=2)
    assert n == 2 and tree.token_ids == [3, 7, 9, 4] and tree.parents == [0, 1, 2, 0]
    assert tree.confidences == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert propose_ngram_tree([5, 6, 7], 1, 2, 4, 2)[0].token_ids == []  # no match


# ------------------------------------------------------------------ verifying trees in the worker


class OracleTrees(Proposer):
    """Drafts, for each sequence, a tree whose right continuation (the known output) is the root's SECOND
    child, a wrong token its first, and below the right one the next right tokens with a wrong sibling each:
    every accepted token sits off the first branch."""

    def __init__(self, outputs: dict[str, list[int]], prompts: dict[str, int]):
        self.outputs, self.prompt_lens = outputs, prompts
        self.paths_accepted = 0

    def propose(self, states, num_drafts):
        drafts, parents = [], []
        for state, k in zip(states, num_drafts):
            done = state.num_tokens - self.prompt_lens[state.request_id]
            right = self.outputs[state.request_id][done : done + k]
            tokens, tree, parent = [], [], 0
            for token in right:
                if len(tokens) + 2 > k:
                    break
                tokens += [(token + 1) % 50 + 3, token]  # a wrong sibling first, then the right token
                tree += [parent, parent]
                parent = len(tokens)
            drafts.append(tokens)
            parents.append(tree if tokens else None)
        return Proposal(drafts, parents=parents)


class RankedOracleTrees(OracleTrees):
    """OracleTrees whose proposer ranked the right tokens first: right_0, wrong_0, right_1, wrong_1, ..."""

    def propose(self, states, num_drafts):
        proposal = super().propose(states, num_drafts)
        proposal.ranks = [
            [r + 1 + (1 if r % 2 == 0 else -1) for r in range(len(d))] if d else None for d in proposal.draft_token_ids
        ]
        return proposal


def test_the_accepted_path_is_reported_by_its_nodes_ranks(tiny_pair):
    want = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, MAX_TOKENS)
    worker = make_worker(tiny_pair, "ngram", K, draft_previews=False)
    worker.proposer = RankedOracleTrees(
        {f"r{i}": out + [0] * K for i, out in enumerate(want)}, {f"r{i}": len(p) for i, p in enumerate(PROMPTS)}
    )
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K) == want
    trees = [o for r in driver.results for o in r.outputs if o.draft_tree_depth]
    assert trees and any(o.num_accepted_tokens > 1 for o in trees)
    for o in trees:  # the right tokens sit at rows 2, 4, 6, ... and were ranked 1, 3, 5, ...
        assert o.accepted_draft_ranks == [2 * j + 1 for j in range(o.num_accepted_tokens)]


@pytest.mark.parametrize("proposer", ["suffix", "ngram"])
def test_each_sequence_drafts_the_width_the_scheduler_sends(tiny_pair, proposer):
    """On a worker whose --draft-tree-width is 3: width 1 drafts chains, 3 and 0 (the worker's own) trees, each
    with the ranks of its accepted nodes (ancestors first, within the tree); a width above the worker's is
    refused with the step, and the worker serves the next one."""
    want = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, MAX_TOKENS)
    worker = make_worker(tiny_pair, proposer, K, draft_tree_width=3)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    widths = [1, 0, 3, 1, 3]
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K, tree_widths=widths) == want
    outputs = [o for r in driver.results for o in r.outputs]
    drafted = {w: [o for o in outputs if o.num_draft_tokens and widths[int(o.request_id[1:])] == w] for w in (0, 1, 3)}
    assert drafted[1] and all(o.draft_tree_depth == 0 and o.accepted_draft_ranks == [] for o in drafted[1])
    assert any(o.draft_tree_depth for o in drafted[3]) and any(o.draft_tree_depth for o in drafted[0])
    for o in outputs:
        if o.draft_tree_depth:
            ranks = o.accepted_draft_ranks
            assert len(ranks) == o.num_accepted_tokens and ranks == sorted(ranks)
            assert all(1 <= r <= o.num_draft_tokens for r in ranks)
    with pytest.raises(InvalidStepError, match=r"draft_tree_width 4 is outside \[0, 3\]"):
        driver.generate(PROMPTS[:1], 4, num_speculative_tokens=K, tree_widths=[4], prefix="wide")
    assert (
        driver.generate(PROMPTS[:1], MAX_TOKENS, num_speculative_tokens=K, tree_widths=[2], prefix="after") == want[:1]
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trees_off_the_first_branch_change_no_token(tiny_pair, dtype):
    plain = Driver(make_worker(tiny_pair, dtype=dtype).execute, BLOCK_SIZE, NUM_BLOCKS)
    want = plain.generate(PROMPTS, MAX_TOKENS)
    worker = make_worker(tiny_pair, "ngram", K, dtype=dtype, draft_previews=False)
    worker.proposer = OracleTrees(
        {f"r{i}": out + [0] * K for i, out in enumerate(want)}, {f"r{i}": len(p) for i, p in enumerate(PROMPTS)}
    )
    moved = []
    keep_path = worker.target.keep_path
    worker.target.keep_path = lambda table, start, path: (moved.append(path), keep_path(table, start, path))
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    ks = [K, 0, 3, K, 1]  # trees beside plain decodes and a one-token chain
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=ks) == want
    accepted = [o.num_accepted_tokens for r in driver.results for o in r.outputs if o.request_id == "r0"]
    assert max(accepted) == K // 2  # 4 right tokens of 8 nodes, every one the second child
    assert any(path and path[0] == 2 for path in moved)
    assert all(o.num_draft_tokens <= ks[int(o.request_id[1:])] for r in driver.results for o in r.outputs)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_seeded_trees_off_the_first_branch_change_no_token(sharp_pair, sampling):  # noqa: F811
    want, _ = alone(sharp_pair, sampling)
    worker = make_worker(sharp_pair, "ngram", K, draft_previews=False)
    worker.proposer = OracleTrees({"r0": want + [0] * K}, {"r0": len(PROMPT)})
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate([PROMPT], len(want), sampling=sampling, num_speculative_tokens=K) == [want]
    assert sum(o.num_accepted_tokens for r in driver.results for o in r.outputs) >= len(want) // 2


@pytest.mark.parametrize("proposer", ["suffix", "ngram"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4_1"])
def test_copying_trees_are_lossless(tiny_pair, dtype, proposer):
    want = Driver(make_worker(tiny_pair, dtype=dtype).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, MAX_TOKENS)
    worker = make_worker(tiny_pair, proposer, K, dtype=dtype, draft_tree_width=3)
    trees = []
    propose = worker.proposer.propose
    worker.proposer.propose = lambda states, ks: (p := propose(states, ks), trees.extend(p.parents or []))[0]
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K, prefix="first") == want
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K, prefix="second") == want
    assert any(p is not None and chain_length(p) < len(p) for p in trees)  # some drafts branched
    assert all(o.num_draft_tokens <= K for r in driver.results for o in r.outputs)


def test_the_flag_reaches_the_config_and_bad_values_are_refused():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--proposer", "suffix", "--num-speculative-tokens", "8", "--draft-tree-width", "3"])
    assert config_from_args(args, "model", None).draft_tree_width == 3
    argv = forwarded_argv(args)
    assert argv[argv.index("--draft-tree-width") + 1] == "3"
    assert parser.parse_args([]).draft_tree_width == 1
    with pytest.raises(ValueError, match="draft_tree_width must be >= 1"):
        WorkerConfig(model="model", proposer="suffix", num_speculative_tokens=8, draft_tree_width=0)
    with pytest.raises(ValueError, match="need a proposer that drafts them"):
        WorkerConfig(model="model", proposer="draft", draft_model="d", num_speculative_tokens=8, draft_tree_width=2)
    with pytest.raises(ValueError, match="need the multi_query scorer"):
        WorkerConfig(
            model="model", proposer="suffix", num_speculative_tokens=8, draft_tree_width=2, scorer="batch_expansion"
        )
