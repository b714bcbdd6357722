"""A seeded request samples the same tokens alone, batched, preempted (recompute), moved to another
worker, and with or without n-gram speculation: its randomness is keyed by (seed, token position)."""

import itertools
import shutil

import pytest
import torch

from specdec import step
from tests.tiny_models import TinyPair
from tests.worker.driver import Driver
from tests.worker.speculation.test_speculative import BLOCK_SIZE, NUM_BLOCKS, draft_counts, make_worker
from worker_service.runtime.loader import load_model
from worker_service.speculation.request_state import new_state

PROMPT = [7, 8] * 10  # repetitive: n-gram drafts find matches
MAX_TOKENS = 32
SAMPLINGS = [
    step.RequestSampling(temperature=0.8, seed=1234),
    step.RequestSampling(temperature=0.8, top_k=3, seed=99),
    step.RequestSampling(temperature=0.8, top_k=20, top_p=0.9, seed=2**64 - 5),
]
SAMPLING_IDS = ["temperature", "top_k", "top_k_top_p"]


@pytest.fixture(scope="module")
def sharp_pair(tiny_pair, tmp_path_factory) -> TinyPair:
    """The tiny target with its output layer scaled by 3.

    The tiny target's next-token distributions at temperature 0.8 are nearly
    flat, so a sampled continuation never matches an n-gram draft; scaled
    logits are peaked like a trained model's and some drafts get accepted.
    """
    model = load_model(tiny_pair.target_path)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("sharp") / "target"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_pair.target_path / name, path / name)
    return TinyPair(path, tiny_pair.draft_path)


def alone(pair, sampling, proposer="none", k=0) -> tuple[list[int], list[step.StepResult]]:
    """The request decoded on its own by a fresh worker."""
    driver = Driver(make_worker(pair, proposer, k).execute, BLOCK_SIZE, NUM_BLOCKS)
    return driver.generate([PROMPT], MAX_TOKENS, sampling=sampling, num_speculative_tokens=k)[0], driver.results


def decode_with_restarts(workers, sampling, restart_at: list[int], k: int = 0) -> list[int]:
    """Decodes PROMPT; once the output reaches each count in `restart_at`, the worker drops the request
    (finished_request_ids) and the next of `workers` (the same one: a preemption; another: a move) gets
    it back as a NewRequest carrying prompt + the tokens so far, the way the scheduler resumes by recompute."""
    workers, step_ids, restarts = iter(workers), itertools.count(), list(restart_at)
    worker, output, is_new = next(workers), [], True
    blocks = list(range(-(-(len(PROMPT) + MAX_TOKENS + k + 8) // BLOCK_SIZE)))
    while len(output) < MAX_TOKENS:
        if is_new:
            tokens = PROMPT + output
            new = step.NewRequest("x", tokens, len(PROMPT), sampling, blocks, len(tokens), k)
            request = step.StepRequest(next(step_ids), new_requests=[new])
        else:
            cached = step.CachedRequest("x", [], len(blocks), 1, k)
            request = step.StepRequest(next(step_ids), cached_requests=[cached])
        output += worker.execute(request).outputs[0].token_ids
        is_new = bool(restarts) and len(output) >= restarts[0]
        if is_new:
            restarts.pop(0)
            worker.execute(step.StepRequest(next(step_ids), finished_request_ids=["x"]))
            worker = next(workers)
    assert not restarts, "the request finished before every restart happened"
    return output[:MAX_TOKENS]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_batched_with_others(sharp_pair, sampling):
    want, _ = alone(sharp_pair, sampling)
    others = [[5, 6, 7], list(range(10, 40)), [9] * 12, [100, 3], [40] * 20, [11, 12, 11, 12], [200]]
    prompts = others[:3] + [PROMPT] + others[3:]
    samplings = [step.RequestSampling(temperature=0.8, seed=i) for i in range(7)]
    samplings[5] = step.RequestSampling(temperature=0.0)  # a greedy neighbour too
    samplings = samplings[:3] + [sampling] + samplings[3:]
    driver = Driver(make_worker(sharp_pair).execute, BLOCK_SIZE, NUM_BLOCKS)
    got = driver.generate(prompts, MAX_TOKENS, sampling=samplings)
    assert got[3] == want
    assert len({tuple(g) for g in got}) == 8  # the neighbours really sample their own tokens


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_preempted_and_moved(sharp_pair, sampling, k):
    want, _ = alone(sharp_pair, sampling)
    proposer = "ngram" if k else "none"
    worker = make_worker(sharp_pair, proposer, k)
    assert decode_with_restarts([worker] * 3, sampling, restart_at=[5, 19], k=k) == want  # preempted twice
    fresh = [make_worker(sharp_pair, proposer, k) for _ in range(2)]
    assert decode_with_restarts(fresh, sampling, restart_at=[12], k=k) == want  # moved to a new worker


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_ngram_speculation_does_not_change_the_tokens(sharp_pair, sampling):
    want, _ = alone(sharp_pair, sampling)
    got, results = alone(sharp_pair, sampling, "ngram", 3)
    assert got == want
    drafted, accepted = draft_counts(results)["r0"]
    assert drafted > 0 and accepted > 0  # speculation ran and some drafts were accepted: not vacuous


def test_draft_model_proposals_are_reproducible(sharp_pair, tiny_pair):
    """Draft-model sampling is keyed too: the same tokens alone, batched and on a rerun.

    The unscaled tiny target drafts for the sharp one: related distributions, so
    some drafts are accepted and some rejected (both paths of the accept rule run).
    """
    pair = TinyPair(sharp_pair.target_path, tiny_pair.target_path)
    sampling = SAMPLINGS[1]
    first, results = alone(pair, sampling, "draft", 3)
    assert alone(pair, sampling, "draft", 3)[0] == first
    driver = Driver(make_worker(pair, "draft", 3).execute, BLOCK_SIZE, NUM_BLOCKS)
    batch = driver.generate(
        [[5, 6, 7], PROMPT, [40] * 20],
        MAX_TOKENS,
        num_speculative_tokens=3,
        sampling=[step.RequestSampling(temperature=0.8, seed=1), sampling, step.RequestSampling(temperature=0.0)],
    )
    assert batch[1] == first
    drafted, accepted = draft_counts(results)["r0"]
    assert 0 < accepted < drafted


def test_a_request_without_a_seed_gets_one_from_the_worker():
    new = step.NewRequest("u", [5, 6], 2, step.RequestSampling(temperature=1.0), [0], 2)
    seeds = {new_state(new, vocab_size=256, num_blocks=4).sampling.seed for _ in range(8)}
    assert len(seeds) == 8 and all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    seeded = step.NewRequest("s", [5, 6], 2, step.RequestSampling(temperature=1.0, seed=3), [0], 2)
    assert new_state(seeded, vocab_size=256, num_blocks=4).sampling.seed == 3
