"""The scheduler with prefix caching, against the fake worker, whose "KV" of a position is keyed by the
whole prefix up to it: a hit on blocks computed from other tokens, or a cached block overwritten, fails
the worker's check before the step (tests/sim_worker.py)."""

import pytest

from scheduler_service.core.request import Request
from specdec.step import StepRequest
from tests.scheduler.core.test_scheduler import make, partial_acceptance, reference_output, run, streamed

SYSTEM = [(7 * j + 1) % 50 for j in range(13)]  # 13 tokens: 3 full blocks of 4 (the 13th is in the 4th)


def new_requests_sent(steps: list[StepRequest]) -> dict[str, list[int]]:
    """Per request, the num_computed_tokens of each NewRequest it was sent as (a hit's cached tokens)."""
    sent: dict[str, list[int]] = {}
    for step in steps:
        for new in step.new_requests:
            sent.setdefault(new.request_id, []).append(new.num_computed_tokens)
    return sent


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(scheduling, k):
    scheduler, worker = make(num_speculative_tokens=k, scheduling=scheduling)
    worker.num_accepted = partial_acceptance
    steps = []
    prompts = {"r1": SYSTEM + [3, 4], "r2": SYSTEM + [5], "r3": SYSTEM[:8] + [9, 9, 9]}
    for request_id, prompt in prompts.items():  # one after another: each finds what the others left
        scheduler.add_request(Request(request_id, list(prompt), max_tokens=9))
        outputs = run(scheduler, worker, on_step=steps.append)[request_id]
        assert streamed(outputs) == reference_output(prompt, 9)
    assert new_requests_sent(steps) == {"r1": [0], "r2": [12], "r3": [8]}
    assert scheduler.stats.num_prefix_cache_queries == sum(map(len, prompts.values()))
    assert scheduler.stats.num_prefix_cache_hits == 12 + 8
    assert outputs[-1].num_cached_tokens == 8  # r3's usage
    assert scheduler.num_free_blocks == 64  # cached blocks count as free
    assert all(scheduler.block_manager.ref_count(b) == 0 for b in range(64))


def test_a_finished_request_leaves_its_answer_for_the_next_turn():
    scheduler, worker = make()
    scheduler.add_request(Request("turn1", SYSTEM, max_tokens=8))
    answer = streamed(run(scheduler, worker)["turn1"])
    turn2 = SYSTEM + answer + [1, 2]  # 23 tokens: 5 full blocks
    steps = []
    scheduler.add_request(Request("turn2", turn2, max_tokens=4))
    assert streamed(run(scheduler, worker, on_step=steps.append)["turn2"]) == reference_output(turn2, 4)
    # Turn 1 wrote KV for 13 + 7 positions (not its last token's): 5 full blocks.
    assert new_requests_sent(steps) == {"turn2": [20]}


def test_a_block_is_cached_once_its_last_tokens_kv_is_written():
    scheduler, worker = make()
    scheduler.add_request(Request("turn1", SYSTEM, max_tokens=7))  # 20 tokens, KV written for 19
    answer = streamed(run(scheduler, worker)["turn1"])
    steps = []
    scheduler.add_request(Request("turn2", SYSTEM + answer + [1, 2], max_tokens=4))
    run(scheduler, worker, on_step=steps.append)
    assert new_requests_sent(steps) == {"turn2": [16]}


def test_a_block_holding_unverified_drafts_is_never_cached():
    scheduler, worker = make(num_speculative_tokens=3, speculation_policy="fixed")
    worker.num_accepted = lambda step_id, request_id: 0
    scheduler.add_request(Request("a", SYSTEM[:8], max_tokens=6))
    for _ in range(2):  # the prefill, then a decode with 3 drafts
        scheduler.update(worker.execute(scheduler.schedule()))
    table = scheduler.block_manager.block_table("a")
    # Block 2 is written full (position 8, then drafts at 9..11, all rejected) but holds one committed token.
    assert [scheduler.block_manager.is_cached(b) for b in table] == [True, True, False]
    scheduler.abort("a")
    assert scheduler.num_free_blocks == 64 and scheduler.block_manager.num_cached_blocks == 2


def test_a_preempted_request_resumes_from_its_cached_blocks():
    scheduler, worker = make(num_kv_blocks=12, num_speculative_tokens=3, max_num_seqs=2)
    worker.num_accepted = partial_acceptance
    prompts = {"r0": SYSTEM[:9], "r1": SYSTEM[4:13]}
    steps = []
    for request_id, prompt in prompts.items():
        scheduler.add_request(Request(request_id, list(prompt), max_tokens=24))
    outputs = run(scheduler, worker, on_step=steps.append)
    for request_id, prompt in prompts.items():
        assert streamed(outputs[request_id]) == reference_output(prompt, 24)
    assert scheduler.stats.num_preemptions > 0
    resumed = [hits for hits in new_requests_sent(steps).values() if len(hits) > 1]
    assert any(hit > 0 for hits in resumed for hit in hits[1:]), new_requests_sent(steps)
    assert scheduler.num_free_blocks == 12


def test_with_caching_off_nothing_is_reused():
    scheduler, worker = make(enable_prefix_caching=False)
    steps = []
    for request_id in ("a", "b"):
        scheduler.add_request(Request(request_id, SYSTEM + [1], max_tokens=3))
        run(scheduler, worker, on_step=steps.append)
    assert new_requests_sent(steps) == {"a": [0], "b": [0]}
    assert scheduler.stats.num_prefix_cache_hits == 0 and scheduler.block_manager.num_cached_blocks == 0


def test_a_worker_reporting_kv_it_cannot_have_written_is_refused():
    scheduler, worker = make()
    scheduler.add_request(Request("a", SYSTEM, max_tokens=3))
    result = worker.execute(scheduler.schedule())
    result.outputs[0].num_kv_written_tokens = 14  # the step reached 13 positions
    with pytest.raises(ValueError, match="KV written for 14 positions"):
        scheduler.update(result)
