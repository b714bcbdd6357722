"""One worker's step pipeline: send what is ready, apply a result, account the worker's busy time.

The engine loop and the scheduler tests both drive a scheduler through this
class, so the schedule -> send -> update cycle exists once. It does no I/O and
takes no lock: the caller passes a `send` function and applies results in the
order the steps were sent (the worker answers them in order).
"""

from dataclasses import dataclass
import time
from typing import Callable

from scheduler_service.core.request import RequestOutput
from scheduler_service.core.scheduler import Scheduler
from specdec.step import StepRequest, StepResult


@dataclass
class BusyStats:
    """Worker time accounting: idle share = 1 - worker_busy_s / active_wall_s."""

    worker_busy_s: float = 0.0  # sum of the worker's own step times
    active_wall_s: float = 0.0  # wall time with at least one step in flight, bubbles included


class StepPipeline:
    """Keeps up to one step (sync) or two steps (async) in flight for one scheduler."""

    def __init__(
        self, scheduler: Scheduler, stats: BusyStats | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats if stats is not None else BusyStats()
        self.max_in_flight = 2 if scheduler.config.is_async else 1
        self._clock = clock
        self._busy_since: float | None = None  # start of the current busy period
        self._last_result_at: float | None = None

    @property
    def num_in_flight(self) -> int:
        """Steps sent whose results have not been applied."""
        return self.scheduler.num_steps_in_flight

    def send_ready(self, send: Callable[[StepRequest], None]) -> int:
        """Schedules and sends steps while fewer than max_in_flight are in flight; returns how many were sent.

        When nothing is in flight afterwards, the worker is idle and the busy period ends.
        """
        num_sent = 0
        while self.num_in_flight < self.max_in_flight:
            step = self.scheduler.schedule()
            if step is None:
                break
            if self._busy_since is None:
                self._busy_since = self._clock()
                self._last_result_at = None
            send(step)
            num_sent += 1
        if self.num_in_flight == 0:
            self._busy_since = None
        return num_sent

    def apply(self, result: StepResult) -> list[RequestOutput]:
        """Applies the oldest step's result; returns what each live request produced."""
        now = self._clock()
        # Wall time counts from the previous result (or the start of this busy period), so the
        # gaps between steps — the scheduler's bubbles — count as worker idle time.
        start = self._last_result_at if self._last_result_at is not None else self._busy_since
        if start is not None:
            self.stats.active_wall_s += now - start
        self.stats.worker_busy_s += result.stats.total_ms / 1e3
        self._last_result_at = now
        return self.scheduler.update(result)
