"""Decoding with draft trees on the tiny target (forward with trees, verify along the tree, keep_path) emits
plain decoding's tokens and log-probabilities, greedy and seeded, fp32 and bf16, while accepting paths that
are not the first branch."""

import random

import pytest

from specdec import step
from tests.kernels.test_tree_attention import random_tree
from tests.worker.runtime.test_model_runner import random_tokens
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk
from worker_service.speculation.request_state import new_state
from worker_service.speculation.verify import verify

BLOCK_SIZE = 4
NUM_TOKENS = 40
SAMPLINGS = {
    "greedy": step.RequestSampling(temperature=0.0, logprobs=True),
    "seeded": step.RequestSampling(temperature=1.0, top_k=8, seed=7, logprobs=True),
}


def start(runner: ModelRunner, prompt: list[int], sampling, table: list[int]):
    """A request's state after its prefill (the first token emitted)."""
    state = new_state(
        step.NewRequest("r", prompt, len(prompt), sampling, table, len(prompt)),
        runner.vocab_size,
        runner.kv_cache.num_blocks,
    )
    result = verify([state], runner.forward([SequenceChunk(prompt, 0, table)]), [[]], None)
    state.token_ids += result.token_ids[0]
    return state, list(result.logprobs[0])


def plain(runner, prompt, sampling, table) -> tuple[list[int], list[float]]:
    state, logprobs = start(runner, prompt, sampling, table)
    while state.num_tokens - len(prompt) < NUM_TOKENS:
        logits = runner.forward([SequenceChunk(state.token_ids[-1:], state.num_tokens - 1, table)])
        result = verify([state], logits, [[]], None)
        state.token_ids += result.token_ids[0]
        logprobs += result.logprobs[0]
    return state.token_ids[len(prompt) :][:NUM_TOKENS], logprobs[:NUM_TOKENS]


def with_trees(runner, prompt, sampling, table, oracle: list[int], rng: random.Random):
    """Each step drafts a random tree whose nodes guess right (the oracle's token at their depth) half the
    time, siblings distinct; returns the tokens, log-probabilities and how often a path left the first branch."""
    state, logprobs = start(runner, prompt, sampling, table)
    num_off_first_branch = 0
    while state.num_tokens - len(prompt) < NUM_TOKENS:
        parents = random_tree(rng, rng.randint(2, 12), rng.randint(1, 5), rng.randint(1, 3))
        done = state.num_tokens - len(prompt)
        tokens = [state.token_ids[-1]]
        for row in range(1, len(parents)):
            depth, above = 1, parents[row]
            while above > 0:
                depth, above = depth + 1, parents[above]
            taken = {tokens[c] for c in range(1, row) if parents[c] == parents[row]}
            right = oracle[done + depth - 1] if done + depth - 1 < len(oracle) else 0
            guess = right if rng.random() < 0.5 else rng.randrange(runner.vocab_size)
            while guess in taken:
                guess = rng.randrange(runner.vocab_size)
            tokens.append(guess)
        begin = state.num_tokens - 1
        logits = runner.forward([SequenceChunk(tokens, begin, table, num_logits=len(tokens), parents=parents)])
        result = verify([state], logits, [tokens[1:]], None, [[p for p in parents[1:]]])
        path = result.paths[0]
        num_off_first_branch += any(
            row != min(c for c in range(1, len(parents)) if parents[c] == parents[row]) for row in path
        )
        runner.keep_path(table, begin, path)
        assert result.token_ids[0][:-1] == [tokens[row] for row in path]
        state.token_ids += result.token_ids[0]
        logprobs += result.logprobs[0]
    return state.token_ids[len(prompt) :][:NUM_TOKENS], logprobs[:NUM_TOKENS], num_off_first_branch


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_decoding_emits_plain_decodings_tokens(tiny_pair, dtype, sampling):
    runner = ModelRunner(load_model(tiny_pair.target_path, dtype, "cpu"))
    runner.init_cache(64, BLOCK_SIZE)
    prompt = random_tokens(9, 5, runner.vocab_size)
    want_tokens, want_logprobs = plain(runner, prompt, SAMPLINGS[sampling], list(range(0, 20)))
    for seed in range(3):
        tokens, logprobs, num_off = with_trees(
            runner, prompt, SAMPLINGS[sampling], list(range(20, 40))[::-1], want_tokens, random.Random(seed)
        )
        assert tokens == want_tokens, seed
        assert logprobs == want_logprobs, seed
        assert num_off > 0, seed  # some accepted paths left the first branch: their K/V moved
