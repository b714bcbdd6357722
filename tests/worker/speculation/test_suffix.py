"""The suffix proposer: its per-request and global indexes, the confidence rule, the memory bound, and
lossless greedy and seeded decoding with a worker."""

import argparse

import pytest

from specdec import step
from tests.worker.driver import Driver
from tests.worker.speculation.test_seeded_sampling import PROMPT, SAMPLING_IDS, SAMPLINGS, alone, sharp_pair  # noqa: F401
from tests.worker.speculation.test_speculative import BLOCK_SIZE, NUM_BLOCKS, PROMPTS, draft_counts, make_worker
from worker_service.serving.flags import add_flags, config_from_args, forwarded_argv
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.proposers.suffix import SuffixProposer
from worker_service.speculation.request_state import RequestState

K = 8  # the Driver's block tables leave 8 slots beyond max_tokens
MAX_TOKENS = 24


def state(request_id: str, token_ids: list[int], num_prompt_tokens: int | None = None) -> RequestState:
    num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    return RequestState(
        request_id,
        list(token_ids),
        num_prompt_tokens,
        step.RequestSampling(temperature=0.0, seed=1),
        block_table=[],
        num_speculative_tokens=K,
    )


def propose(proposer: SuffixProposer, s: RequestState, k: int = K) -> list[int]:
    return proposer.propose([s], [k]).draft_token_ids[0]


def output(first: int) -> list[int]:
    """30 distinct tokens starting at `first` (no repeats: only an exact earlier copy predicts them)."""
    return list(range(first, first + 30))


def test_proposes_a_continuation_seen_only_in_an_earlier_request():
    proposer = SuffixProposer(cache_tokens=1000)
    earlier = state("a", [7, 8, 9] + output(100), num_prompt_tokens=3)
    proposer.release([earlier])
    current = state("b", [5, 6, 100, 101, 102, 103])  # the start of a's output, but not what followed it
    assert propose(proposer, current) == [104, 105, 106, 107]  # match of 4 tokens: at most 4 drafts
    assert propose(proposer, current, k=2) == [104, 105]
    assert propose(proposer, state("c", [5, 6, 7, 8, 9])) == []  # a's prompt is not indexed, only its output


def test_per_request_index_follows_the_growing_sequence():
    proposer = SuffixProposer(cache_tokens=0)
    s = state("a", [1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert propose(proposer, s) == [4, 5, 9]  # match [1, 2, 3]; not the trivial match at the end
    s.token_ids += [4, 5, 9]  # accepted: the index catches up with the new tokens only
    assert propose(proposer, s) == [9, 1, 2, 3, 4, 5]  # now [1 2 3 4 5 9] matches 6 tokens back
    assert propose(proposer, state("b", [40] * 20)) == [40] * K  # a run: shorter matches carry on past the end


def test_released_request_id_starts_afresh():
    proposer = SuffixProposer(cache_tokens=0)
    s = state("x", [1, 2, 3, 4, 1, 2])
    assert propose(proposer, s) == [3, 4]
    proposer.release([s])
    assert propose(proposer, state("x", [9, 8, 1, 2])) == []  # same id, new request: the old tokens are gone


def test_confidence_rule_shortens_the_draft_where_continuations_disagree():
    def segments(followers):
        return [t for f in followers for t in (50, 1, 2, 3, f, 60)] + [50, 1, 2]

    proposer = SuffixProposer(cache_tokens=0)
    agree = propose(proposer, state("agree", segments([100] * 12)))
    assert agree[:5] == [3, 100, 60, 50, 1] and len(agree) == K
    # 11 occurrences with the longest match all continue with 3 (confidence 1), then with 11 different
    # tokens: 1/11 < MIN_TOKEN_PROB, so the draft stops after 3.
    assert propose(proposer, state("disagree", segments(range(100, 112)))) == [3]
    # 4 of the 8 occurrences with the longest match (all but the first) agree on the second token:
    # confidence 1/2, still drafted; then they agree, up to the match length (4).
    assert propose(proposer, state("half", segments([99, 100, 100, 100, 100, 101, 102, 103, 104]))) == [3, 100, 60, 50]


def test_global_index_respects_its_memory_bound_and_evicts_least_recently_used():
    proposer = SuffixProposer(cache_tokens=100)
    proposer.release([state(f"r{i}", [1] + output(100 * (i + 1)), num_prompt_tokens=1) for i in range(3)])
    assert proposer.outputs.index.num_tokens == 90
    assert propose(proposer, state("q", [5, 100, 101])) == [102, 103]  # r0's output is used: most recent now
    proposer.release([state("r3", [1] + output(400), num_prompt_tokens=1)])
    assert proposer.outputs.index.num_tokens <= 100
    assert proposer.outputs.request_ids == ["r2", "r0", "r3"]  # r1 was the least recently used
    assert propose(proposer, state("q1", [5, 200, 201])) == []
    assert propose(proposer, state("q0", [5, 100, 101])) == [102, 103]
    proposer.release([state("r4", [1] + output(500), num_prompt_tokens=1)])
    assert proposer.outputs.request_ids == ["r3", "r0", "r4"]  # r2 was not used since it came in
    assert proposer.outputs.index.num_tokens == 90
    proposer.release([state("long", [1] + list(range(1000, 1250)), num_prompt_tokens=1)])
    assert proposer.outputs.request_ids == ["long"] and proposer.outputs.index.num_tokens == 100  # its last 100
    assert propose(proposer, state("q", [1100, 1150, 1151])) == [1152, 1153]
    assert propose(proposer, state("q", [1100, 1148, 1149])) == []


def test_releasing_a_request_again_replaces_its_output():
    """A preempted request is released, comes back with its output so far, and is released again."""
    proposer = SuffixProposer(cache_tokens=1000)
    proposer.release([state("x", [1] + output(100)[:10], num_prompt_tokens=1)])
    proposer.release([state("x", [1] + output(100), num_prompt_tokens=1)])
    assert proposer.outputs.request_ids == ["x"] and proposer.outputs.index.num_tokens == 30


def test_zero_cache_tokens_disables_the_global_index():
    proposer = SuffixProposer(cache_tokens=0)
    proposer.release([state("a", [7] + output(100), num_prompt_tokens=1)])
    assert proposer.outputs is None
    assert propose(proposer, state("b", [5, 100, 101])) == []


def test_flag_reaches_the_config_and_is_forwarded_to_workers():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--proposer", "suffix", "--num-speculative-tokens", "16", "--suffix-cache-tokens", "0"])
    config = config_from_args(args, "model", None)
    assert config.proposer == "suffix" and config.suffix_cache_tokens == 0
    argv = forwarded_argv(args)
    assert argv[argv.index("--suffix-cache-tokens") + 1] == "0"
    assert parser.parse_args([]).suffix_cache_tokens == 65536
    with pytest.raises(ValueError, match="suffix_cache_tokens must be >= 0"):
        WorkerConfig(model="model", proposer="suffix", num_speculative_tokens=16, suffix_cache_tokens=-1)


def total_accepted(results) -> int:
    return sum(accepted for _, accepted in draft_counts(results).values())


@pytest.fixture(scope="module")
def baseline(tiny_pair):
    return Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, MAX_TOKENS)


def test_greedy_is_lossless_and_earlier_outputs_get_drafts_accepted(tiny_pair, baseline):
    worker = make_worker(tiny_pair, "suffix", K)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K, prefix="first") == baseline
    first_pass = driver.results[:]
    # The same prompts again as new requests: their outputs are in the global index now.
    assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K, prefix="second") == baseline
    second_pass = driver.results[len(first_pass) :]
    assert all(o.num_draft_tokens <= K for r in driver.results for o in r.outputs)
    ngram = Driver(make_worker(tiny_pair, "ngram", K).execute, BLOCK_SIZE, NUM_BLOCKS)
    assert ngram.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=K) == baseline
    assert total_accepted(second_pass) > max(total_accepted(first_pass), total_accepted(ngram.results))
    assert all(accepted > 0 for _, accepted in draft_counts(second_pass).values())


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_seeded_sampling_equals_plain_sampling(sharp_pair, sampling):  # noqa: F811
    want, _ = alone(sharp_pair, sampling)
    driver = Driver(make_worker(sharp_pair, "suffix", K).execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate([PROMPT], MAX_TOKENS, sampling=sampling, num_speculative_tokens=K, prefix="a") == [
        want[:MAX_TOKENS]
    ]
    num_first = len(driver.results)
    # Seeded again under a new id: the earlier output drafts, and the same tokens get accepted.
    assert driver.generate([PROMPT], MAX_TOKENS, sampling=sampling, num_speculative_tokens=K, prefix="b") == [
        want[:MAX_TOKENS]
    ]
    assert total_accepted(driver.results[num_first:]) > total_accepted(driver.results[:num_first])
