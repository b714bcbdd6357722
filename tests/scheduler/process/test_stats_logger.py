"""The periodic stats line: its numbers from two snapshots, the logging thread, and a real cluster's counters."""

import logging
import re
import threading

from scheduler_service.cluster.cluster import ClusterSnapshot
from scheduler_service.cluster.engine import WorkerSnapshot, WorkerState
from scheduler_service.cluster.pipeline import BusyStats
from scheduler_service.core.stats import SchedulerStats
from scheduler_service.process.stats_logger import StatsLogger, format_stats_line
from tests.scheduler.cluster.test_cluster import Streams, make_cluster, prompts, serving, wait_idle, wait_until
from tests.sim_worker import SimWorkerServer, partial_acceptance


def worker(
    num_running=0, num_waiting=0, num_free_blocks=100, num_total_blocks=100, state=WorkerState.SERVING
) -> WorkerSnapshot:
    return WorkerSnapshot(
        address="127.0.0.1:1",
        state=state,
        config=None,
        stats=SchedulerStats(),
        busy=BusyStats(),
        num_failures=0,
        num_engine_errors=0,
        last_error=None,
        num_running=num_running,
        num_waiting=num_waiting,
        num_free_blocks=num_free_blocks,
        num_total_blocks=num_total_blocks,
        num_cached_blocks=0,
    )


def snapshot(workers=(), num_waiting_for_worker=0, **stats) -> ClusterSnapshot:
    return ClusterSnapshot(
        workers=tuple(workers),
        stats=SchedulerStats(**stats),
        busy=BusyStats(),
        num_worker_failures=0,
        num_engine_errors=0,
        num_requests=0,
        num_moved_requests=0,
        num_waiting_for_worker=num_waiting_for_worker,
    )


def test_the_line_is_made_of_the_interval_deltas():
    before = snapshot(
        num_steps=10,
        num_prompt_tokens=100,
        num_emitted_tokens=50,
        num_draft_tokens=30,
        num_accepted_tokens=20,
        num_drafts=10,
        num_prefix_cache_queries=100,
        num_prefix_cache_hits=10,
    )
    after = snapshot(
        [
            worker(2, 1, num_free_blocks=60),
            worker(1, 0, num_free_blocks=100),
            worker(state=WorkerState.GONE, num_free_blocks=0),
        ],  # a gone worker's blocks do not count
        num_waiting_for_worker=2,
        num_steps=30,
        num_prompt_tokens=300,
        num_emitted_tokens=250,
        num_draft_tokens=130,
        num_accepted_tokens=95,
        num_drafts=40,
        num_prefix_cache_queries=300,
        num_prefix_cache_hits=160,
    )
    line = format_stats_line(before, after, elapsed_s=4.0)
    assert line == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 3 reqs, Waiting: 3 reqs, KV cache usage: 20.0%, Prefix cache hit rate: 75.0%, "
        "acceptance rate: 75.0% (tokens per speculating step 3.50)"
    )


def test_no_drafts_in_the_interval_and_an_idle_interval():
    before = snapshot(num_steps=5, num_emitted_tokens=5, num_draft_tokens=8, num_accepted_tokens=4, num_drafts=2)
    after = snapshot(
        [worker(1)], num_steps=7, num_emitted_tokens=7, num_draft_tokens=8, num_accepted_tokens=4, num_drafts=2
    )
    assert format_stats_line(before, after, 1.0).endswith("acceptance rate: - (no drafts)")
    assert "Prefix cache hit rate: -, " in format_stats_line(before, after, 1.0)  # no request left a queue
    idle = snapshot([worker(0)], num_steps=7, num_emitted_tokens=7)
    assert format_stats_line(idle, idle, 1.0) is None  # nothing ran, nothing running or waiting: quiet
    waiting = snapshot([worker(0)], num_waiting_for_worker=1, num_steps=7, num_emitted_tokens=7)
    assert "Waiting: 1 reqs" in format_stats_line(idle, waiting, 1.0)  # requests that wait are reported


def test_the_thread_logs_only_intervals_in_which_something_ran(caplog):
    busy = snapshot([worker(1)], num_steps=1, num_emitted_tokens=4)
    idle = snapshot([worker(0)], num_steps=1, num_emitted_tokens=4)  # the same counters, nothing running
    snapshots = iter([snapshot(), busy, idle, idle])
    done = threading.Event()

    def next_snapshot():
        value = next(snapshots, None)
        if value is None:
            done.set()
            return idle
        return value

    stats_logger = StatsLogger(next_snapshot, interval_s=0.01)
    with caplog.at_level(logging.INFO, logger="scheduler_service.process.stats_logger"):
        stats_logger.start()
        assert done.wait(10)
        stats_logger.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "scheduler_service.process.stats_logger"]
    assert len(lines) == 1 and lines[0].startswith("Avg prompt throughput: ")  # the busy interval's only
    assert "Running: 1 reqs" in lines[0]


def test_an_interval_of_zero_starts_no_thread():
    stats_logger = StatsLogger(lambda: (_ for _ in ()).throw(AssertionError("no snapshot expected")), 0)
    stats_logger.start()
    stats_logger.stop()


def test_a_real_cluster_line_counts_what_the_clients_received():
    sim = SimWorkerServer(step_time_s=0.002, num_accepted=partial_acceptance)
    cluster = make_cluster([sim.address])
    try:
        wait_until(lambda: serving(cluster), what="the worker to serve")
        before = cluster.snapshot()
        streams = Streams(cluster, prompts(4), max_tokens=12)
        streams.join()
        line = format_stats_line(before, wait_idle(cluster), elapsed_s=1.0)
    finally:
        cluster.stop()
        sim.stop()
    num_prompt_tokens = sum(map(len, prompts(4).values()))
    assert line.startswith(
        f"Avg prompt throughput: {num_prompt_tokens:.1f} tokens/s, "
        f"Avg generation throughput: {4 * 12:.1f} tokens/s, Running: 0 reqs, Waiting: 0 reqs, "
        f"KV cache usage: 0.0%, Prefix cache hit rate: "
    )
    assert re.search(r"acceptance rate: \d+\.\d% \(tokens per speculating step \d\.\d\d\)$", line)
