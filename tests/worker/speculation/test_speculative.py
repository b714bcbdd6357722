"""Speculative decoding in the worker: lossless greedy output, draft KV upkeep, scorer equivalence."""

import pytest
import torch

from specdec import step
from specdec.step import DraftPreview
from tests.worker.driver import Driver
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.proposers.ngram import propose_ngram
from worker_service.speculation.request_state import InvalidStepError
from worker_service.speculation.scorers import expand
from worker_service.speculation.worker import Worker

BLOCK_SIZE = 4
NUM_BLOCKS = 400
# Repetitive prompts give n-gram matches; the last two have no repeated token, so they propose nothing.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40] * 20, [10, 11, 12, 10, 11, 12, 10], list(range(3, 33)), [100, 101, 102]]
MAX_TOKENS = 24


def make_worker(
    pair,
    proposer="none",
    k=0,
    scorer="multi_query",
    draft_path=None,
    device="cpu",
    dtype="float32",
    draft_previews=True,
    draft_tree_width=1,
) -> Worker:
    draft_path = draft_path or pair.draft_path
    config = WorkerConfig(
        model=str(pair.target_path),
        proposer=proposer,
        num_speculative_tokens=k,
        scorer=scorer,
        draft_model=str(draft_path) if proposer == "draft" else None,
        device=device,
        dtype=dtype,
        draft_previews=draft_previews,
        draft_tree_width=draft_tree_width,
    )
    draft = ModelRunner(load_model(draft_path, dtype, device)) if proposer == "draft" else None
    worker = Worker(config, ModelRunner(load_model(pair.target_path, dtype, device)), draft)
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return worker


@pytest.fixture(scope="module")
def baseline(tiny_pair):
    """Greedy output without speculation, checked against full-sequence `transformers` forwards."""
    got = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, MAX_TOKENS)
    reference = load_model(tiny_pair.target_path)
    for prompt, output in zip(PROMPTS, got):
        seq = list(prompt)
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
        assert output == seq[len(prompt) :]
    return got


def speculative_run(worker, k):
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    return driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=k), driver.results


def has_mixed_step(results) -> bool:
    """Some step ran speculating and non-speculating decodes together (one pass, no split)."""
    return any(len({o.num_draft_tokens > 0 for o in r.outputs if o.token_ids}) == 2 for r in results[1:])


def draft_counts(results):
    per_request: dict[str, tuple[int, int]] = {}
    for result in results:
        for out in result.outputs:
            drafted, accepted = per_request.get(out.request_id, (0, 0))
            per_request[out.request_id] = (drafted + out.num_draft_tokens, accepted + out.num_accepted_tokens)
    return per_request


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("scorer", ["multi_query", "batch_expansion"])
def test_ngram_greedy_is_lossless(tiny_pair, baseline, k, scorer):
    got, results = speculative_run(make_worker(tiny_pair, "ngram", k, scorer), k)
    assert got == baseline
    counts = draft_counts(results)
    assert counts["r0"][1] > 0 and counts["r1"][1] > 0  # speculation really happened and was accepted
    assert results[1].outputs[4].num_draft_tokens == 0  # no repeated n-gram yet: proposes nothing
    assert has_mixed_step(results)
    assert all(o.num_draft_tokens <= k for r in results for o in r.outputs)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_is_lossless(tiny_pair, baseline, k):
    got, results = speculative_run(make_worker(tiny_pair, "draft", k), k)
    assert got == baseline
    assert sum(o.num_draft_tokens for r in results for o in r.outputs) > 0


def test_self_draft_accepts_everything_and_stays_lossless(tiny_pair, baseline):
    """Target as its own draft: every draft is accepted, so every step goes through the bonus-token path."""
    worker = make_worker(tiny_pair, "draft", 3, draft_path=tiny_pair.target_path)
    got, results = speculative_run(worker, 3)
    assert got == baseline
    drafted, accepted = map(sum, zip(*draft_counts(results).values()))
    assert drafted > 0 and accepted == drafted


def test_per_request_k_zero_mixes_with_speculating_requests(tiny_pair, baseline):
    worker = make_worker(tiny_pair, "draft", 3)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    first = driver.generate(PROMPTS[:2], MAX_TOKENS, num_speculative_tokens=0, prefix="off")
    assert first == baseline[:2]
    assert all(o.num_draft_tokens == 0 for r in driver.results for o in r.outputs)


def test_bonus_token_draft_kv_is_written(tiny_pair):
    """After an all-accepted step, the draft's next proposal equals a fresh draft run on the full prefix."""
    worker = make_worker(tiny_pair, "draft", 3, draft_path=tiny_pair.target_path)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    prompt = [7, 8, 9, 10, 11]
    table = driver.blocks(64)
    greedy = step.RequestSampling(temperature=0.0)
    worker.execute(step.StepRequest(0, new_requests=[step.NewRequest("b", prompt, 5, greedy, table, 5, 3)]))
    result = worker.execute(step.StepRequest(1, cached_requests=[step.CachedRequest("b", [], len(table), 1, 3)]))
    assert result.outputs[0].num_accepted_tokens == 3 and len(result.outputs[0].token_ids) == 4
    state = worker.requests["b"]
    proposal = worker.proposer.propose([state], [3]).draft_token_ids[0]
    fresh = load_model(tiny_pair.target_path)
    seq = list(state.token_ids)
    with torch.inference_mode():
        for _ in range(3):
            seq.append(int(fresh(torch.tensor([seq])).logits[0, -1].argmax()))
    assert proposal == seq[len(state.token_ids) :]


def test_batch_expansion_and_multi_query_scores_agree(tiny_pair):
    runner = ModelRunner(load_model(tiny_pair.target_path))
    runner.init_cache(64, BLOCK_SIZE)
    prefixes = [list(range(3, 20)), [9, 9, 9], list(range(50, 60))]
    tables = [[i * 8 + j for j in range(8)] for i in range(3)]
    runner.forward([SequenceChunk(p, 0, t, 0) for p, t in zip(prefixes, tables)])
    chunks = [
        SequenceChunk([1, 2, 3, 4], len(prefixes[0]), tables[0], 4),  # pending + 3 drafts
        SequenceChunk([5], len(prefixes[1]), tables[1], 1),  # no drafts
        SequenceChunk([6, 7, 8, 9, 10, 11], len(prefixes[2]), tables[2], 6),
    ]
    multi = runner.forward(chunks)
    expanded = runner.forward(expand(chunks))
    assert len(expand(chunks)) == 4 + 1 + 6
    assert multi.shape == expanded.shape == (11, 256)
    assert (multi - expanded).abs().max().item() <= 1e-4


def test_lookahead_beyond_block_table_is_rejected(tiny_pair):
    worker = make_worker(tiny_pair, "ngram", 3)
    greedy = step.RequestSampling(temperature=0.0)
    worker.execute(step.StepRequest(0, new_requests=[step.NewRequest("x", [5, 6, 5], 3, greedy, [0], 3, 3)]))
    with pytest.raises(InvalidStepError, match="shorter than"):
        worker.execute(step.StepRequest(1, cached_requests=[step.CachedRequest("x", [], 1, 1, 3)]))
    with pytest.raises(InvalidStepError, match="unknown request id 'y'"):
        worker.execute(step.StepRequest(2, cached_requests=[step.CachedRequest("y", [], 0, 1)]))
    # Rejected steps change nothing: with room for the lookahead the same request runs on.
    ok = worker.execute(step.StepRequest(3, cached_requests=[step.CachedRequest("x", [1, 2], 1, 1, 3)]))
    assert len(ok.outputs[0].token_ids) >= 1


class CountingProposer:
    """Wraps a proposer and records the num_drafts of every call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def propose(self, states, num_drafts):
        self.calls.append(list(num_drafts))
        return self.inner.propose(states, num_drafts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def per_sequence_k_run(worker, ks: list[int]) -> list[step.StepResult]:
    """Prefills PROMPTS, then decodes 16 steps with sequence i at k = ks[i] (the scheduler's per-step k)."""
    greedy = step.RequestSampling(temperature=0.0)
    tables = [[i * 30 + j for j in range(30)] for i in range(len(PROMPTS))]
    new = [
        step.NewRequest(f"r{i}", p, len(p), greedy, t, len(p), k)
        for i, (p, t, k) in enumerate(zip(PROMPTS, tables, ks))
    ]
    results = [worker.execute(step.StepRequest(0, new_requests=new))]
    for step_id in range(1, 17):
        cached = [step.CachedRequest(f"r{i}", [], 30, 1, k) for i, k in enumerate(ks)]
        results.append(worker.execute(step.StepRequest(step_id, cached_requests=cached)))
    return results


def test_worker_follows_the_per_sequence_k(tiny_pair):
    """Each sequence drafts at most its own k (k = 0: none), in one mixed step; k > the worker's K is refused."""
    worker = make_worker(tiny_pair, "ngram", 5)
    ks = [5, 0, 2, 1, 0]
    results = per_sequence_k_run(worker, ks)
    drafted = {f"r{i}": 0 for i in range(len(ks))}
    for result in results[1:]:
        for out in result.outputs:
            assert out.num_draft_tokens <= ks[int(out.request_id[1:])]
            drafted[out.request_id] += out.num_draft_tokens
    assert drafted["r0"] > 0 and drafted["r2"] > 0 and drafted["r1"] == drafted["r4"] == 0
    greedy = step.RequestSampling(temperature=0.0)
    with pytest.raises(InvalidStepError, match="exceeds this worker's 5"):
        worker.execute(step.StepRequest(9, new_requests=[step.NewRequest("big", [5, 6], 2, greedy, [399], 2, 6)]))


def test_all_k_zero_runs_a_plain_step_without_the_proposer(tiny_pair):
    """When the scheduler sends k = 0 for every sequence the proposer is never called; output unchanged."""
    worker = make_worker(tiny_pair, "ngram", 3)
    worker.proposer = CountingProposer(worker.proposer)
    per_sequence_k_run(worker, [0] * len(PROMPTS))
    assert worker.proposer.calls == []
    per_sequence_k_run(make_worker(tiny_pair, "ngram", 3), [0] * len(PROMPTS))  # a fresh worker: same ids
    worker.execute(step.StepRequest(20, finished_request_ids=[f"r{i}" for i in range(len(PROMPTS))]))
    per_sequence_k_run(worker, [0, 3, 0, 0, 0])
    assert worker.proposer.calls and all(call == [0, 3, 0, 0, 0] for call in worker.proposer.calls)


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_each_step_previews_the_next_draft_and_the_next_step_drafts_it(tiny_pair, baseline, proposer):
    """After each step the worker reports every sampling sequence's next draft from its copying proposer (how
    many, on how long a match); the next step drafts exactly that (the kept lookup, cut to the step's k), so
    drafts and acceptance step by step equal those of a worker without previews, and the output is lossless."""
    ks = [4, 0, 3, 4, 2]
    runs = {}
    for previews in (True, False):
        driver = Driver(make_worker(tiny_pair, proposer, 4, draft_previews=previews).execute, BLOCK_SIZE, NUM_BLOCKS)
        assert driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=ks) == baseline
        runs[previews] = driver.results
    assert all(o.next_draft is None for r in runs[False] for o in r.outputs)

    def per_step(results):
        return [[(o.request_id, o.num_draft_tokens, o.num_accepted_tokens) for o in r.outputs] for r in results]

    assert per_step(runs[True]) == per_step(runs[False])
    k_of = {f"r{i}": k for i, k in enumerate(ks)}
    tokens = {f"r{i}": list(p) for i, p in enumerate(PROMPTS)}
    previews: dict[str, DraftPreview] = {}
    for result in runs[True][:-1]:  # the last one finishes the requests
        for out in result.outputs:
            if out.request_id in previews:
                assert out.num_draft_tokens == min(previews[out.request_id].num_drafts, k_of[out.request_id])
            tokens[out.request_id] += out.token_ids
            assert (out.next_draft is not None) == bool(out.token_ids)  # every sampling sequence, and only those
            if out.next_draft is not None:
                previews[out.request_id] = out.next_draft
                if proposer == "ngram":
                    drafts, n = propose_ngram(tokens[out.request_id], 1, 4, 4)
                    assert out.next_draft == DraftPreview(len(drafts), n)
                assert (out.next_draft.num_drafts > 0) == (out.next_draft.match_length > 0)
    seen = [p for r in runs[True] for o in r.outputs if (p := o.next_draft) is not None]
    assert any(p.num_drafts == 4 for p in seen) and any(p.num_drafts == 0 for p in seen)
