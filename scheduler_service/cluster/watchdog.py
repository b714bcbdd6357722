"""Finds workers that hang: health checks, and a limit on how long a step may take.

A worker that crashes is found at once (its step stream fails). One that
stops (SIGSTOP, a frozen VM) neither answers nor fails: its health checks
time out. One whose compute thread is wedged may still answer health checks
SERVING: its step never returns. Either way the worker leaves, and its
requests move.
"""

import logging
import time

import grpc
from grpc_health.v1 import health_pb2

from scheduler_service.cluster.engine import WorkerEngine

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 5.0
NUM_HEALTH_FAILURES_TO_LEAVE = 2


class Watchdog:
    """Checks serving workers; `tick` is called often from one thread and never blocks."""

    def __init__(self, step_timeout_s: float) -> None:
        # Generous by default (--worker-step-timeout): a step that prefills a long prompt on a CPU takes seconds.
        self.step_timeout_s = step_timeout_s
        self._checks: dict[str, tuple[grpc.Future, int]] = {}  # address -> (check in flight, failures in a row)
        self._next_round = 0.0

    def tick(self, engines: list[WorkerEngine]) -> None:
        """Makes a worker whose step takes longer than the step timeout leave; every HEALTH_INTERVAL_S, collects
        the last round of health checks (a worker whose checks failed NUM_HEALTH_FAILURES_TO_LEAVE times in a row
        leaves) and starts the next."""
        now = time.monotonic()
        for engine in engines:
            waiting_since = engine.waiting_since
            if waiting_since is not None and now - waiting_since > self.step_timeout_s:
                engine.leave(f"no step result for {now - waiting_since:.0f} s", stop=False)
        if now < self._next_round:
            return
        self._next_round = now + HEALTH_INTERVAL_S
        for address in self._checks.keys() - {e.address for e in engines}:
            del self._checks[address]  # left or rejoining: start counting afresh
        for engine in engines:
            future, num_failures = self._checks.get(engine.address, (None, 0))
            if future is not None:
                if not future.done():
                    continue  # still waiting (it has its own timeout)
                num_failures = 0 if self._is_healthy(future) else num_failures + 1
                if num_failures >= NUM_HEALTH_FAILURES_TO_LEAVE:
                    engine.leave(f"{num_failures} health checks failed", stop=False)
                    del self._checks[engine.address]
                    continue
            self._checks[engine.address] = (engine.client.check_health(HEALTH_TIMEOUT_S), num_failures)

    @staticmethod
    def _is_healthy(future: grpc.Future) -> bool:
        try:
            return future.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
