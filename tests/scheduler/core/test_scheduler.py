"""Scheduler against a fake worker that applies the worker semantics of specdec.step (tests/sim_worker.py).

The fake worker keeps a fake paged KV cache: every position it computes is
written as (request id, token) into the slot its block table names, and
before each step it checks that a request's computed positions still hold its
own tokens. Freeing or sharing a block too early therefore fails a test.
"""

from collections import defaultdict, deque
import logging
import subprocess
import sys

import pytest

from scheduler_service.cluster.pipeline import StepPipeline
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.core.scheduler import Scheduler
from specdec.step import RequestSampling, SequenceOutput, StepRequest, StepResult
from tests.sim_worker import PIECES, VOCAB_SIZE, FakeWorker, PieceTokenizer, reference_output


def run(scheduler: Scheduler, worker: FakeWorker, on_step=None, max_iterations: int = 10_000):
    """Drives the engine's step pipeline against the fake worker (two steps in flight in async mode).

    Returns the outputs by request id.
    """
    pipeline = StepPipeline(scheduler)
    results: deque[StepResult] = deque()
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)

    def send(step: StepRequest) -> None:
        if on_step is not None:
            on_step(step)
        results.append(worker.execute(step))

    for _ in range(max_iterations):
        pipeline.send_ready(send)
        if not results:
            assert not scheduler.has_unfinished(), "nothing in flight, yet requests wait"
            return outputs
        for output in pipeline.apply(results.popleft()):
            outputs[output.request_id].append(output)
    raise AssertionError("the scheduler did not finish")


def make(num_kv_blocks=64, block_size=4, **kwargs) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=block_size, **kwargs)
    return Scheduler(config, PieceTokenizer()), FakeWorker(block_size)


def streamed(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def prompts(num_requests: int, length: int = 5) -> dict[str, list[int]]:
    return {f"r{i}": [(i * 11 + j * 3) % VOCAB_SIZE for j in range(length + i % 3)] for i in range(num_requests)}


def add_all(scheduler: Scheduler, prompt_by_id: dict[str, list[int]], max_tokens: int = 12, **kwargs) -> None:
    for request_id, prompt in prompt_by_id.items():
        scheduler.add_request(Request(request_id, list(prompt), max_tokens=max_tokens, **kwargs))


def partial_acceptance(step_id: int, request_id: str) -> int:
    return (step_id + int(request_id[1:])) % 4


def test_single_request_matches_reference_and_reports_usage():
    scheduler, worker = make(num_speculative_tokens=3)
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=10))
    outputs = run(scheduler, worker)["a"]
    assert streamed(outputs) == reference_output([1, 2, 3], 10)
    last = outputs[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_completion_tokens) == ("length", 3, 10)
    assert last.num_accepted_tokens == last.num_draft_tokens > 0
    assert "".join(o.text for o in outputs) == "".join(PIECES[t] for t in streamed(outputs))
    assert scheduler.num_free_blocks == 64


def test_fcfs_and_max_num_seqs():
    scheduler, worker = make(max_num_seqs=2)
    add_all(scheduler, prompts(3), max_tokens=4)
    new_ids_per_step = []
    run(scheduler, worker, on_step=lambda step: new_ids_per_step.append([n.request_id for n in step.new_requests]))
    assert new_ids_per_step[0] == ["r0", "r1"]
    assert ["r2"] in new_ids_per_step
    assert scheduler.num_free_blocks == 64


def test_chunked_prefill_shares_the_budget_with_decodes():
    scheduler, worker = make(max_num_batched_tokens=8, num_speculative_tokens=2)
    scheduler.add_request(Request("short", [1, 2], max_tokens=20))
    steps = []
    scheduler.add_request(Request("long", list(range(20)), max_tokens=3))
    outputs = run(scheduler, worker, on_step=steps.append)
    for step in steps:
        num_tokens = sum(r.num_new_tokens for r in step.new_requests + step.cached_requests)
        assert num_tokens <= 8
    chunks = [
        r.num_new_tokens
        for step in steps
        for r in step.new_requests + step.cached_requests
        if r.request_id == "long" and r.num_new_tokens > 1
    ]
    assert sum(chunks) == 20 and len(chunks) > 2  # the prompt was split
    assert streamed(outputs["long"]) == reference_output(list(range(20)), 3)
    assert streamed(outputs["short"]) == reference_output([1, 2], 20)


def test_preemption_with_a_tiny_pool_gives_the_same_outputs():
    prompt_by_id = prompts(6)
    big, big_worker = make(num_kv_blocks=256, num_speculative_tokens=3)
    add_all(big, prompt_by_id, max_tokens=16)
    expected = run(big, big_worker)
    tiny, tiny_worker = make(num_kv_blocks=10, num_speculative_tokens=3)
    add_all(tiny, prompt_by_id, max_tokens=16)
    outputs = run(tiny, tiny_worker)
    assert tiny.stats.num_preemptions > 0
    for request_id, prompt in prompt_by_id.items():
        # Every token exactly once, in order: nothing repeated or lost across preemptions.
        assert streamed(outputs[request_id]) == streamed(expected[request_id]) == reference_output(prompt, 16)
    assert tiny.num_free_blocks == 10


def test_eos_stop_ids_and_truncation_after_a_stop():
    scheduler, worker = make(num_speculative_tokens=4)
    expected = reference_output([5], 12)
    eos, stop = expected[3], expected[6]
    num_to_eos, num_to_stop = expected.index(eos) + 1, expected.index(stop) + 1
    assert num_to_eos < num_to_stop
    scheduler.add_request(Request("eos", [5], max_tokens=12, eos_token_ids=[eos]))
    scheduler.add_request(
        Request("ignore", [5], max_tokens=12, eos_token_ids=[eos], is_eos_ignored=True, stop_token_ids=[stop])
    )
    outputs = run(scheduler, worker)
    # The step that emitted the EOS emitted more tokens after it (k=4, all accepted): dropped.
    assert worker.num_emitted_by_id["eos"] > num_to_eos
    assert streamed(outputs["eos"]) == expected[:num_to_eos] and outputs["eos"][-1].finish_reason == "stop"
    assert streamed(outputs["ignore"]) == expected[:num_to_stop]
    assert outputs["ignore"][-1].finish_reason == "stop"
    assert scheduler.num_free_blocks == 64


def test_stop_string_across_tokens():
    scheduler, worker = make(num_speculative_tokens=3)
    expected = reference_output([7, 8], 20)
    text = "".join(PIECES[t] for t in expected)
    stop_string = text[5:7]  # the 6th and 7th tokens' text
    scheduler.add_request(Request("a", [7, 8], max_tokens=20, stop_strings=[stop_string]))
    outputs = run(scheduler, worker)["a"]
    streamed_text = "".join(o.text for o in outputs)
    assert streamed_text == text[: text.index(stop_string)]
    assert outputs[-1].finish_reason == "stop"
    assert streamed(outputs) == expected[: text.index(stop_string) + len(stop_string)]


def test_a_stop_string_before_min_tokens_does_not_stop_and_the_eos_is_held_back_by_the_worker():
    """Text within the first min_tokens tokens is not searched for stop strings (the worker holds the stop
    tokens back: the request asks it to, EOS included unless ignored)."""
    scheduler, worker = make(num_speculative_tokens=3)
    expected = reference_output([7, 8], 20)
    text = "".join(PIECES[t] for t in expected)
    stop_string = text[5:7]  # the 6th and 7th tokens' text
    first_end = text.index(stop_string) + len(stop_string)
    later = text.find(stop_string, first_end)
    sampling = RequestSampling(min_tokens=first_end + 1)
    request = Request("a", [7, 8], max_tokens=20, stop_strings=[stop_string], sampling=sampling, eos_token_ids=[3])
    assert request.sampling.stop_token_ids == (3,)
    scheduler.add_request(request)
    outputs = run(scheduler, worker)["a"]
    streamed_text = "".join(o.text for o in outputs)
    assert streamed_text == (text[:later] if later >= 0 else text)
    assert len(streamed(outputs)) > first_end


def test_k_cap_is_lowered_near_max_tokens():
    scheduler, worker = make(num_speculative_tokens=4)
    scheduler.add_request(Request("a", [1], max_tokens=7))
    caps = []
    run(
        scheduler,
        worker,
        on_step=lambda step: caps.extend(r.num_speculative_tokens for r in step.new_requests + step.cached_requests),
    )
    assert caps == [0, 4, 0]  # the prefill step: none; then 1 + 4 tokens, and 1 left: no drafts past max_tokens
    assert worker.num_emitted_by_id["a"] == 7


def test_abort_frees_blocks_at_once():
    scheduler, worker = make(num_speculative_tokens=2)
    add_all(scheduler, prompts(3), max_tokens=30)
    for _ in range(3):
        scheduler.update(worker.execute(scheduler.schedule()))
    assert scheduler.num_free_blocks < 64
    assert scheduler.abort("r1") and scheduler.abort("r0")
    assert not scheduler.abort("r1") and not scheduler.abort("unknown")
    assert scheduler.num_free_blocks == 64 - len(scheduler.block_manager.block_table("r2"))  # at once
    step = scheduler.schedule()
    assert sorted(step.finished_request_ids) == ["r0", "r1"]  # the worker forgets them
    assert [r.request_id for r in step.cached_requests] == ["r2"]
    scheduler.update(worker.execute(step))
    assert scheduler.abort("r2")
    assert scheduler.num_free_blocks == 64 and not scheduler.has_unfinished()
    assert scheduler.schedule() is None


def test_async_matches_sync_and_drops_output_after_finish():
    prompt_by_id = prompts(5)
    eos = reference_output(prompt_by_id["r2"], 8)[7]
    results = {}
    for scheduling in ("sync", "async"):
        scheduler, worker = make(num_kv_blocks=40, num_speculative_tokens=3, scheduling=scheduling)
        worker.num_accepted = partial_acceptance
        add_all(scheduler, prompt_by_id, max_tokens=20, eos_token_ids=[eos])
        results[scheduling] = run(scheduler, worker)
        assert scheduler.num_free_blocks == 40
        assert scheduler.num_steps_in_flight == 0
    for request_id in prompt_by_id:
        assert streamed(results["async"][request_id]) == streamed(results["sync"][request_id])
        assert results["async"][request_id][-1].finish_reason is not None
    # r2 hit EOS while its next step was already in flight; that step's tokens were dropped.
    assert worker.num_emitted_by_id["r2"] > len(streamed(results["async"]["r2"]))


def test_async_preemption_with_a_tiny_pool():
    prompt_by_id = prompts(6)
    scheduler, worker = make(num_kv_blocks=12, num_speculative_tokens=3, scheduling="async")
    worker.num_accepted = partial_acceptance
    add_all(scheduler, prompt_by_id, max_tokens=16)
    outputs = run(scheduler, worker)
    assert scheduler.stats.num_preemptions > 0
    for request_id, prompt in prompt_by_id.items():
        assert streamed(outputs[request_id]) == reference_output(prompt, 16)
    assert scheduler.num_free_blocks == 12


def test_async_abort_of_a_request_in_flight_frees_after_its_result():
    scheduler, worker = make(num_speculative_tokens=2, scheduling="async")
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=50))
    first = worker.execute(scheduler.schedule())
    second = worker.execute(scheduler.schedule())
    assert scheduler.abort("a")
    assert scheduler.num_free_blocks < 64  # both steps still write a's blocks
    assert scheduler.update(first) == []
    assert scheduler.num_free_blocks < 64
    assert scheduler.update(second) == []
    assert scheduler.num_free_blocks == 64
    assert not scheduler.has_unfinished()


def test_protocol_misuse_is_reported():
    scheduler, worker = make(scheduling="sync")
    scheduler.add_request(Request("a", [1], max_tokens=3))
    step = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()  # sync: the result must be applied first
    result = worker.execute(step)
    with pytest.raises(ValueError):
        scheduler.update(StepResult(step.step_id + 1, result.outputs))
    with pytest.raises(ValueError):
        scheduler.update(StepResult(step.step_id, [SequenceOutput("a", [1, 2, 3])]))
    assert len(scheduler.update(result)) == 1


def test_requests_that_can_never_run_are_rejected():
    scheduler, _ = make(num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="no room for output"):
        scheduler.add_request(Request("long", list(range(64)), max_tokens=1))
    with pytest.raises(ValueError, match="lower max_tokens"):
        scheduler.add_request(Request("big", [1], max_tokens=40))
    scheduler.add_request(Request("ok", [1], max_tokens=10))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("ok", [1], max_tokens=10))
    with pytest.raises(ValueError):
        Request("empty", [], max_tokens=1)


def test_async_skips_a_request_its_step_in_flight_surely_finishes():
    scheduler, worker = make(scheduling="async")  # no speculation: each step emits exactly 1 token
    scheduler.add_request(Request("a", [1, 2], max_tokens=5))
    outputs = run(scheduler, worker)
    assert streamed(outputs["a"]) == reference_output([1, 2], 5)
    assert worker.num_emitted_by_id["a"] == 5  # no step was wasted past max_tokens


def test_scheduler_never_imports_torch():
    code = "import scheduler_service.core.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeline_accounts_busy_and_idle_time():
    scheduler, worker = make(scheduling="sync")
    now = [0.0]
    pipeline = StepPipeline(scheduler, clock=lambda: now[0])
    scheduler.add_request(Request("a", [1, 2], max_tokens=2))
    sent = []
    assert pipeline.send_ready(sent.append) == 1 and pipeline.send_ready(sent.append) == 0  # sync: one in flight
    now[0] = 0.5
    result = worker.execute(sent.pop())
    result.stats.total_ms = 300.0
    pipeline.apply(result)
    assert pipeline.send_ready(sent.append) == 1
    now[0] = 0.75
    result = worker.execute(sent.pop())
    result.stats.total_ms = 200.0
    pipeline.apply(result)
    assert pipeline.send_ready(sent.append) == 0 and pipeline.num_in_flight == 0
    now[0] = 10.0  # idle: not counted
    scheduler.add_request(Request("b", [3], max_tokens=1))
    pipeline.send_ready(sent.append)
    now[0] = 10.25
    pipeline.apply(worker.execute(sent.pop()))
    assert pipeline.stats.active_wall_s == 1.0
    assert pipeline.stats.worker_busy_s == 0.5


def test_stats_count_drafts_by_proposer_and_sum_over_workers():
    from scheduler_service.core.stats import SchedulerStats

    a, b = SchedulerStats(), SchedulerStats()
    a.count_speculation(4, 2, "eagle3")
    a.count_speculation(5, 5, "suffix")
    b.count_speculation(3, 1, "eagle3")
    b.count_speculation(2, 0, "")  # a single proposer's worker reports no name: only the totals count
    snapshot = a.num_accepted_tokens_per_pos_by_proposer
    a.count_speculation(1, 1, "eagle3")  # counters are replaced, never changed in place: snapshots stay
    assert snapshot == {"eagle3": (1, 1), "suffix": (1, 1, 1, 1, 1)}
    total = SchedulerStats.total([a, b])
    assert total.num_draft_tokens_by_proposer == {"eagle3": 8, "suffix": 5}
    assert total.num_accepted_tokens_per_pos_by_proposer == {"eagle3": (3, 1), "suffix": (1, 1, 1, 1, 1)}
    assert total.num_draft_tokens == 15 and sum(total.num_accepted_tokens_per_pos) == total.num_accepted_tokens


@pytest.mark.parametrize("tree_depth", [0, 2], ids=["chain", "tree"])
def test_a_tree_teaches_the_policy_by_the_ranks_of_its_accepted_nodes_and_is_counted_by_its_shape(tree_depth):
    """A step whose 4 drafts formed a tree 2 deep, its accepted path the nodes ranked 1 and 3: the policy learns
    the value of each node rank (1 and 3 accepted, 2 and 4 not) and nothing about chains (a chain of 4 with 2
    accepted rejected position 3); the stats count the tree. A chain's step teaches the chain estimate."""
    scheduler, worker = make(num_speculative_tokens=4)
    worker.num_accepted = lambda step_id, request_id: 2
    execute = worker.execute

    def execute_as_trees(step: StepRequest) -> StepResult:
        result = execute(step)
        for output in result.outputs:
            if output.num_draft_tokens == 4:  # fewer near max_tokens
                assert output.num_accepted_tokens == 2
                output.draft_tree_depth = tree_depth
                output.accepted_draft_ranks = [1, 3] if tree_depth else []
        return result

    worker.execute = execute_as_trees
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=13))
    assert streamed(run(scheduler, worker)["a"]) == reference_output([1, 2, 3], 13)
    acceptance, trees = scheduler.policy.worker_acceptance, scheduler.policy.worker_tree_acceptance
    stats = scheduler.stats
    if tree_depth:
        assert trees.num_delivered[3] > 0 and trees.num_accepted[0] == trees.num_delivered[0]
        assert trees.num_accepted[2] == trees.num_delivered[2] and trees.num_accepted[1] == trees.num_accepted[3] == 0
        assert len(acceptance.num_requested) < 4  # the chains were only the last steps (fewer drafts left)
        assert (
            stats.num_tree_steps_by_depth[2]
            == stats.num_tree_steps_by_nodes[4]
            == sum(stats.num_tree_steps_by_depth)
            > 0
        )
    else:
        assert acceptance.num_tried[1] > 0 and acceptance.num_accepted[1] == acceptance.num_tried[1]
        assert acceptance.num_tried[2] > 0 and acceptance.num_accepted[2] == 0
        assert trees.num_requested == [] and stats.num_tree_steps_by_depth == stats.num_tree_steps_by_nodes == ()


def test_debug_log_traces_each_steps_shape_and_time(caplog):
    """--log-level DEBUG: one line a step with what the cost model is fitted on (the shape and measured time)."""
    scheduler, worker = make(scheduling="sync", num_speculative_tokens=2, speculation_policy="fixed")
    prompt_by_id = prompts(2)
    add_all(scheduler, prompt_by_id, max_tokens=6)
    steps, drafts = [], []

    class Timed(FakeWorker):
        def execute(self, step: StepRequest) -> StepResult:
            result = super().execute(step)
            result.stats.total_ms = 12.5
            drafts.append(sum(o.num_draft_tokens for o in result.outputs))
            return result

    timed = Timed(worker.block_size)
    with caplog.at_level(logging.DEBUG, logger="scheduler_service.core.scheduler"):
        run(scheduler, timed, on_step=steps.append)
    lines = [r.getMessage() for r in caplog.records if "decode rows" in r.getMessage()]
    assert len(lines) == len(steps) and any(drafts)
    assert lines[0].startswith(
        f"step 0: 0 decode rows (0 drafts), {sum(map(len, prompt_by_id.values()))} "
        "prefill rows, 2 seqs, 0 attended: 12.50 ms"
    )
    assert [f"({n} drafts)" in line for line, n in zip(lines, drafts)] == [True] * len(lines)
