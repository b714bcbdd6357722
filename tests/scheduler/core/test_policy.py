"""Speculation policy: auto-disable by running-queue size, per-request k."""

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.policy import SpeculationPolicy, StepShape
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from tests.scheduler.core.test_scheduler import FakeWorker, reference_output, run, streamed


def test_every_k_is_zero_above_the_disable_queue_size():
    policy = SpeculationPolicy(num_speculative_tokens=4, speculative_disable_queue_size=2, policy="fixed")
    decodes = [Request(f"r{i}", [1], max_tokens=50) for i in range(3)]
    assert set(policy.plan_step(decodes, StepShape(), 2, 100).ks.values()) == {4}
    assert set(policy.plan_step(decodes, StepShape(), 3, 100).ks.values()) == {0}
    never = SpeculationPolicy(num_speculative_tokens=4, speculative_disable_queue_size=None, policy="fixed")
    assert set(never.plan_step(decodes, StepShape(), 1000, 100).ks.values()) == {4}


def test_per_request_k():
    policy = SpeculationPolicy(num_speculative_tokens=4, speculative_disable_queue_size=None)
    assert policy.num_speculative_tokens_for(Request("a", [1], max_tokens=50), 100) == 4
    assert policy.num_speculative_tokens_for(Request("b", [1], max_tokens=50, num_speculative_tokens=2), 100) == 2
    assert policy.num_speculative_tokens_for(Request("c", [1], max_tokens=50, num_speculative_tokens=9), 100) == 4
    assert policy.num_speculative_tokens_for(Request("d", [1], max_tokens=50, is_speculation_enabled=False), 100) == 0
    # Near the end: no drafts past max_tokens (2 tokens left -> at most 1 draft).
    assert policy.num_speculative_tokens_for(Request("e", [1], max_tokens=2), 100) == 1


def test_auto_disable_under_load_and_resume_when_it_falls():
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, num_speculative_tokens=3, speculative_disable_queue_size=2)
    scheduler, worker = Scheduler(config), FakeWorker(block_size=4)
    max_tokens_by_id = {"a": 4, "b": 6, "c": 20, "d": 24}
    for request_id, max_tokens in max_tokens_by_id.items():
        scheduler.add_request(Request(request_id, [1, 2], max_tokens=max_tokens))
    seen = []

    def on_step(step):
        # All four are admitted in the first step, so the running queue only shrinks.
        ks = {c.num_speculative_tokens for c in step.cached_requests}
        seen.append((len(scheduler.running), max(ks, default=None)))
        if len(scheduler.running) > 2:
            assert ks <= {0}

    outputs = run(scheduler, worker, on_step=on_step)
    assert (4, 0) in seen and (2, 3) in seen
    assert scheduler.stats.num_steps_speculation_disabled > 0
    assert outputs["d"][-1].num_draft_tokens > 0  # speculation resumed once the load fell
    for request_id, max_tokens in max_tokens_by_id.items():
        assert streamed(outputs[request_id]) == reference_output([1, 2], max_tokens)


def test_opted_out_request_never_speculates():
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, num_speculative_tokens=3)
    scheduler, worker = Scheduler(config), FakeWorker(block_size=4)
    scheduler.add_request(Request("off", [1, 2], max_tokens=10, is_speculation_enabled=False))
    scheduler.add_request(Request("on", [1, 2], max_tokens=10))
    outputs = run(scheduler, worker)
    assert outputs["off"][-1].num_draft_tokens == 0
    assert outputs["on"][-1].num_draft_tokens > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_blocks": 0},
        {"block_size": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_model_len": 1},
        {"num_speculative_tokens": -1},
        {"speculative_disable_queue_size": 0},
        {"scheduling": "eager"},
        {"speculation_policy": "always"},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**{"num_kv_blocks": 8, **kwargs})
