"""The periodic stats line of the scheduler process, like vLLM's, while requests run.

Every interval, from the change in the cluster's counters since the last line:

    Avg prompt throughput: 85.3 tokens/s, Avg generation throughput: 41.0 tokens/s, Running: 3 reqs,
    Waiting: 0 reqs, KV cache usage: 4.7%, Prefix cache hit rate: 81.2%, acceptance rate: 62.5%
    (tokens per speculating step 2.88)

Prompt tokens count when their request emits its first token. The prefix cache
hit rate is hits / queries in tokens over the interval ("-" when no request
left a waiting queue). The acceptance
rate is accepted / drafted tokens; the tokens per speculating step are what a
step with drafts delivered per sequence (its accepted drafts + the one token
the target always adds; GetServerInfo's mean_accepted_length counts every
step). An interval in which nothing ran and nothing waits logs nothing.
"""

import logging
import threading
import time
from typing import Callable

from scheduler_service.cluster.cluster import ClusterSnapshot
from scheduler_service.cluster.engine import WorkerState

logger = logging.getLogger(__name__)


def format_stats_line(previous: ClusterSnapshot, current: ClusterSnapshot, elapsed_s: float) -> str | None:
    """The line for the interval between two snapshots `elapsed_s` apart; None when it was idle."""
    before, now = previous.stats, current.stats
    num_prompt_tokens = now.num_prompt_tokens - before.num_prompt_tokens
    num_generated_tokens = now.num_emitted_tokens - before.num_emitted_tokens
    num_running = sum(w.num_running for w in current.workers)
    num_waiting = sum(w.num_waiting for w in current.workers) + current.num_waiting_for_worker
    if not (
        now.num_steps - before.num_steps or num_prompt_tokens or num_generated_tokens or num_running or num_waiting
    ):
        return None
    serving = [w for w in current.workers if w.state is WorkerState.SERVING]
    num_total_blocks = sum(w.num_total_blocks for w in serving)
    num_used_blocks = num_total_blocks - sum(w.num_free_blocks for w in serving)
    kv_usage = num_used_blocks / num_total_blocks if num_total_blocks else 0.0
    seconds = max(elapsed_s, 1e-9)
    line = (
        f"Avg prompt throughput: {num_prompt_tokens / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {num_generated_tokens / seconds:.1f} tokens/s, "
        f"Running: {num_running} reqs, Waiting: {num_waiting} reqs, KV cache usage: {100 * kv_usage:.1f}%, "
        f"Prefix cache hit rate: {_hit_rate(before, now)}, "
    )
    num_draft_tokens = now.num_draft_tokens - before.num_draft_tokens
    num_drafts = now.num_drafts - before.num_drafts
    if not num_draft_tokens or not num_drafts:
        return line + "acceptance rate: - (no drafts)"
    num_accepted_tokens = now.num_accepted_tokens - before.num_accepted_tokens
    return line + (
        f"acceptance rate: {100 * num_accepted_tokens / num_draft_tokens:.1f}% "
        f"(tokens per speculating step {1 + num_accepted_tokens / num_drafts:.2f})"
    )


def _hit_rate(before, now) -> str:
    num_queries = now.num_prefix_cache_queries - before.num_prefix_cache_queries
    num_hits = now.num_prefix_cache_hits - before.num_prefix_cache_hits
    return f"{100 * num_hits / num_queries:.1f}%" if num_queries else "-"


class StatsLogger:
    """Logs format_stats_line at INFO every `interval_s` seconds on a thread of its own (0: never)."""

    def __init__(
        self, snapshot: Callable[[], ClusterSnapshot], interval_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-logger", daemon=True)

    def start(self) -> None:
        if self._interval_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        previous, previous_time = self._snapshot(), self._clock()
        while not self._stop.wait(self._interval_s):
            try:
                current, now = self._snapshot(), self._clock()
                line = format_stats_line(previous, current, now - previous_time)
            except Exception:  # noqa: BLE001 - a stats line is never worth the scheduler; say why, go on
                logger.warning("cannot compute the stats line", exc_info=True)
                continue
            if line is not None:
                logger.info(line)
            previous, previous_time = current, now
