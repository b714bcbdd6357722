"""EAGLE-3 draft trees (--draft-tree-width): the head expands its likeliest tokens level by level on its own
paged KV, attending along the tree, and its state after steps that accepted any branch is a fresh run's (the
output equal to plain decoding's: tests/worker/speculation/test_eagle3.py, greedy and seeded)."""

import torch

from tests.worker.driver import Driver
from tests.worker.speculation.test_eagle3 import (  # noqa: F401 - the fixtures head_dir, repeating_head_dir
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPTS,
    head_dir,
    make_worker,
    repeating_head_dir,
)
from worker_service.speculation.proposers import trees as trees_module

WIDTH = 3


def tree_worker(pair, head_dir, k=5, dtype="float32"):
    return make_worker(pair, head_dir, k=k, dtype=dtype, tree_width=WIDTH)


def test_a_level_row_is_bitwise_the_heads_chain_step_over_its_path(tiny_pair, head_dir):
    """Each level's rows attend to the committed positions and their own path only: the row that extends the
    head's argmax path gives bitwise the output the head's chain step at that depth gives (a row that also saw
    its siblings' or cousins' K/V would not)."""
    prompts = [[9] * 5, PROMPTS[0], PROMPTS[3]]
    chains, trees = make_worker(tiny_pair, head_dir, k=6), tree_worker(tiny_pair, head_dir, k=6)
    for worker in (chains, trees):
        worker.proposer.min_confidence = 0.0
        with torch.no_grad():
            worker.head.norm.weight.mul_(8.0)  # a sharper head: deeper trees
        Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(prompts, 1, keep=True)
        worker.proposer.propose([worker.requests[f"r{i}"] for i in range(len(prompts))], [6] * len(prompts))
    chain_rows, level_rows = [], []  # (path tokens, normed row); the heads caught up above
    draft_tokens, run_level = chains.head.draft_tokens, trees.proposer._run_level

    def record_chain(normed):
        tokens, probabilities = draft_tokens(normed)
        chain_rows.append(normed[0].clone())
        return tokens, probabilities

    def record_level(states, candidates, expanded, level, depth):
        normed, prenorm = run_level(states, candidates, expanded, level, depth)
        for row, n in enumerate(n for nodes in level.values() for n in nodes):
            path, node = [], n
            while node >= 0:
                path.insert(0, candidates[0][node][1])
                node = candidates[0][node][0]
            level_rows.append((path, normed[row].clone()))
        return normed, prenorm

    chains.head.draft_tokens, trees.proposer._run_level = record_chain, record_level
    num_compared = 0
    for i in range(len(prompts)):
        chain_rows.clear(), level_rows.clear()
        chain = chains.proposer.propose([chains.requests[f"r{i}"]], [6]).draft_token_ids[0]
        trees.proposer.propose([trees.requests[f"r{i}"]], [6])
        depths = [len(path) for path, _ in level_rows]
        assert depths.count(1) >= 2 and max(depths) >= 2  # siblings expanded, and a level below them
        for depth, want in enumerate(chain_rows, start=1):  # the chain's step d reads drafts 1..d
            got = [row for path, row in level_rows if path == chain[:depth]]
            if got:
                assert torch.equal(got[0], want), (i, depth)
                num_compared += depth >= 2
    assert num_compared >= 2  # rows below the first level, beside expanded siblings


def test_after_tree_steps_the_next_proposal_equals_a_fresh_runs(tiny_pair, repeating_head_dir, monkeypatch):
    """After steps whose accepted paths were moved into place (the target's K/V and the head's features), the
    head's state and next tree equal a fresh prefill's over the same tokens. Siblings are numbered least likely
    first here, so that the paths the target accepts (the head's likeliest tokens) leave the first branch."""
    monkeypatch.setattr(
        trees_module, "_by_confidence", lambda indices, chosen: sorted(indices, key=lambda i: chosen[i][2])
    )
    prompts = [[9] * 5, PROMPTS[0], PROMPTS[3]]
    worker = tree_worker(tiny_pair, repeating_head_dir, k=4)
    worker.proposer.min_confidence = 0.0
    moved, keep_path = [], worker.target.keep_path
    worker.target.keep_path = lambda table, start, path: (moved.append(path), keep_path(table, start, path))
    Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(prompts, 14, num_speculative_tokens=4, keep=True)
    assert any(path != list(range(1, len(path) + 1)) for path in moved)  # some paths left the first branch
    fresh = tree_worker(tiny_pair, repeating_head_dir, k=4)
    fresh.proposer.min_confidence = 0.0
    Driver(fresh.execute, BLOCK_SIZE, NUM_BLOCKS).generate(
        [worker.requests[f"r{i}"].token_ids[:-1] for i in range(len(prompts))], 1, keep=True, prefix="f"
    )
    for i in range(len(prompts)):
        stepped, fresh_state = worker.requests[f"r{i}"], fresh.requests[f"f{i}"]
        assert fresh_state.token_ids == stepped.token_ids
        a = worker.proposer.propose([stepped], [4])
        b = fresh.proposer.propose([fresh_state], [4])
        assert (a.draft_token_ids, a.parents) == (b.draft_token_ids, b.parents)
        assert torch.equal(worker.proposer._next[f"r{i}"].feature, fresh.proposer._next[f"f{i}"].feature)


def test_a_batch_mixing_chains_and_trees_equals_plain_decoding(tiny_pair, head_dir):
    """The scheduler's width per sequence: in one batch of head calls, width 1 drafts the head's chain (no
    parents), widths 2 and 3 trees of at most that many children per node, and 0 the worker's own; greedy
    output is plain decoding's."""
    plain = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 20)
    worker = tree_worker(tiny_pair, head_dir, k=5)
    worker.proposer.min_confidence = 0.0  # full trees
    widths = [1, 2, 3, 0, 1]
    seen = []  # (width, parents)
    propose = worker.proposer.propose

    def spy(states, ks):
        proposal = propose(states, ks)
        seen.extend((s.draft_tree_width, proposal.parents_of(i)) for i, (s, k) in enumerate(zip(states, ks)) if k)
        return proposal

    worker.proposer.propose = spy
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, 20, num_speculative_tokens=5, tree_widths=widths) == plain
    assert seen and all(parents is None for width, parents in seen if width == 1)
    for width in (2, 3, 0):
        trees = [parents for w, parents in seen if w == width]
        assert trees and all(parents is not None for parents in trees)
        most = max(max(parents.count(row) for row in set(parents)) for parents in trees)
        assert most <= (width or WIDTH) and (width == 2 or most > 2)


def test_a_trees_catch_up_runs_the_heads_output_layer_once(tiny_pair, head_dir):
    """The head's top W at the last committed position give both a tree's first level and a chain's first
    draft: one pass of its output layer per catch-up (not an argmax pass and a top-W pass); greedy output is
    plain decoding's."""
    plain = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 12)
    worker = tree_worker(tiny_pair, head_dir, k=4)
    passes, per_catch_up = [], []
    hook = worker.head.lm_head.register_forward_hook(lambda module, args, out: passes.append(len(out)))
    catch_up = worker.proposer._catch_up

    def counted(states):
        before = len(passes)
        catch_up(states)
        if states:
            per_catch_up.append(len(passes) - before)

    worker.proposer._catch_up = counted
    try:
        driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
        assert driver.generate(PROMPTS, 12, num_speculative_tokens=4) == plain
    finally:
        hook.remove()
    assert per_catch_up and max(per_catch_up) == 1
