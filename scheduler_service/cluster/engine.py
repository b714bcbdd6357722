"""One worker's engine loop: join it, drive its steps, and hand its requests back when it leaves.

A `WorkerEngine` owns one worker's scheduler (its KV pool, queues and
speculation state) and a thread that runs

    join:  Describe -> InitCache (retried while the worker is not up); each
           join is a new session on the worker, which drops every request
           it held, so nothing of an earlier session can leak into this one
    serve: schedule -> send -> receive -> update, one (sync) or two (async)
           steps in flight (see pipeline.py)
    leave: when the step stream fails, the health check fails, a step takes
           longer than the step timeout or the worker is no longer listed;
           its unfinished requests go back to the cluster, which moves them
           to other workers by recompute. An unexpected error in this loop
           (a bug) fails the requests it ran with INTERNAL instead: moving
           them could repeat it.

and then joins again (a worker restarted at the same address comes back),
unless it was stopped. Everything that touches the scheduler holds the
cluster's lock; the step stream is written and read outside it.
"""

from dataclasses import dataclass, replace
import enum
import logging
import threading
import time
from typing import Callable

import grpc

from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.cluster.pipeline import BusyStats, StepPipeline
from scheduler_service.cluster.worker_client import SocketStepStream, WorkerClient
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.detokenizer import Tokenizer
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.stats import SchedulerStats
from specdec.security import channel_credentials
from specdec.v1.worker_pb2 import DescribeResponse

logger = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 10.0
INIT_CACHE_TIMEOUT_S = 120.0
JOIN_RETRY_S = 1.0  # between attempts to reach a worker that is not up
REJOIN_DELAY_S = 0.5  # after a worker left, before trying to join it again
WAIT_POLL_S = 1.0


class WorkerState(enum.Enum):
    JOINING = "joining"  # not (yet) reachable, or not initialised
    SERVING = "serving"  # initialised; takes requests
    GONE = "gone"  # left (failed, or no longer listed); its requests moved


@dataclass(frozen=True)
class WorkerSnapshot:
    """An immutable copy of one worker's state and counters (read without the lock)."""

    address: str
    state: WorkerState
    config: SchedulerConfig | None  # None until it first joined
    stats: SchedulerStats
    busy: BusyStats
    num_failures: int
    num_engine_errors: int  # unexpected exceptions the engine caught
    last_error: str | None  # why it last failed to join or left, for operators
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int  # in its prefix cache


@dataclass(frozen=True)
class EngineHooks:
    """What an engine needs of the cluster above it, as values and callbacks (the engine never imports it).

    Every callback is called with `lock` held.
    """

    lock: threading.RLock  # guards the cluster and every engine's scheduler
    options: SchedulerOptions
    tokenizer: Tokenizer | None  # for the schedulers' detokenizers
    # A worker's Describe reply -> its scheduler config; ValueError when the worker cannot join.
    config_for: Callable[[DescribeResponse], SchedulerConfig]
    on_serving: Callable[["WorkerEngine"], None]
    # (engine, its unfinished requests, the internal error that made it leave or None)
    on_left: Callable[["WorkerEngine", list[Request], str | None], None]
    dispatch: Callable[[list[RequestOutput]], None]  # a step's outputs to their streams


class WorkerEngine:
    """Drives one worker on a thread of its own; see the module docstring."""

    def __init__(self, address: str, hooks: EngineHooks, previous_session_id: str | None = None):
        self.address = address
        opts = hooks.options
        self.client = WorkerClient(address, channel_credentials(opts.worker_tls), opts.worker_server_name)
        self.state = WorkerState.JOINING
        self.scheduler: Scheduler | None = None  # while SERVING
        self.config: SchedulerConfig | None = None
        self.stats = SchedulerStats()  # across every scheduler this worker had
        self.busy = BusyStats()
        self.num_failures = 0
        self.num_engine_errors = 0  # unexpected exceptions in the engine loop (bugs)
        self.last_error: str | None = None
        self.waiting_since: float | None = None  # monotonic time the loop began waiting for a step result
        self._hooks = hooks
        self._lock = hooks.lock
        self._wakeup = threading.Condition(hooks.lock)
        self._stream = None
        self.session_id = previous_session_id  # the last session on the worker (its stream may be open)
        self._leave_reason: str | None = None  # set to make the serve loop leave
        self._is_stopped = False
        self._thread = threading.Thread(target=self._run, name=f"engine {address}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join_thread(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def is_available(self) -> bool:
        """Serving and not about to leave: new requests may go here. Lock held."""
        return self.state is WorkerState.SERVING and self._leave_reason is None

    def wake(self) -> None:
        """Lets the loop schedule again (new requests, aborts). Lock held."""
        self._wakeup.notify_all()

    def leave(self, reason: str, stop: bool) -> None:
        """Makes the worker leave (its requests move); with stop, it never joins again."""
        with self._lock:
            self._is_stopped = self._is_stopped or stop
            self._leave_reason = self._leave_reason or reason
            stream = self._stream
            self._wakeup.notify_all()
        if stream is not None:
            stream.close()  # a receive in progress raises at once

    def snapshot(self) -> WorkerSnapshot:
        """Lock held."""
        s = self.scheduler
        return WorkerSnapshot(
            address=self.address,
            state=self.state,
            config=self.config,
            stats=replace(self.stats),
            busy=replace(self.busy),
            num_failures=self.num_failures,
            num_engine_errors=self.num_engine_errors,
            last_error=self.last_error,
            num_running=len(s.running) if s else 0,
            num_waiting=len(s.waiting) if s else 0,
            num_free_blocks=s.num_free_blocks if s else 0,
            num_total_blocks=self.config.num_kv_blocks if s and self.config else 0,
            num_cached_blocks=s.block_manager.num_cached_blocks if s else 0,
        )

    @property
    def num_requests(self) -> int:
        """Queued + running requests (its load, for routing). Serving; lock held."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def headroom_key(self) -> tuple[int, int]:
        """Smaller is more headroom: queued + running requests, then fewer free KV blocks. Lock held."""
        return self.num_requests, -self.scheduler.num_free_blocks

    def _run(self) -> None:
        while not self._is_stopped:
            if self._join():
                self._leave(*self._serve())
                self._sleep(REJOIN_DELAY_S)
        self.client.close()

    def _join(self) -> bool:
        try:
            return self._try_join()
        except Exception as exc:  # noqa: BLE001 - a bug must not end the loop silently: log it, retry
            logger.exception("worker %s: joining failed", self.address)
            self.last_error = f"joining failed: {exc!r}"
            self._sleep(10 * JOIN_RETRY_S)
            return False

    def _try_join(self) -> bool:
        """Describe + InitCache; True once the worker serves. False (after a pause) when it cannot now."""
        try:
            info = self.client.describe(self._hooks.options.block_size, timeout=DESCRIBE_TIMEOUT_S)
            config = self._hooks.config_for(info)
            self.session_id = self.client.init_cache(
                config.num_kv_blocks,
                config.block_size,
                self.session_id,
                self._hooks.options.take_over_workers,
                timeout=INIT_CACHE_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            log = logger.debug if exc.code() is grpc.StatusCode.UNAVAILABLE else logger.warning
            log("worker %s is not available: %s: %s", self.address, exc.code().name, exc.details())
            self.last_error = f"not available: {exc.code().name}: {exc.details()}"
            self._sleep(JOIN_RETRY_S)
            return False
        except ValueError as exc:
            logger.error("worker %s cannot join: %s", self.address, exc)
            self.last_error = f"cannot join: {exc}"
            self._sleep(10 * JOIN_RETRY_S)
            return False
        opts = self._hooks.options
        uses_step_socket = opts.step_transport == "auto" and not opts.worker_tls.is_enabled
        stream = self.client.open_stream(self.session_id, info.step_port if uses_step_socket else 0)
        with self._lock:
            if self._is_stopped:
                stream.close()
                return False
            self.config = config
            self.scheduler = Scheduler(config, self._hooks.tokenizer, self.stats)
            self._stream, self._leave_reason = stream, None
            self.state = WorkerState.SERVING
            logger.info(
                "worker %s serves on %s: %d KV blocks of %d tokens, k=%d, %s scheduling, steps over %s",
                self.address,
                info.device or "an unnamed device",
                config.num_kv_blocks,
                config.block_size,
                config.num_speculative_tokens,
                config.scheduling,
                "its step socket" if isinstance(stream, SocketStepStream) else "gRPC",
            )
            self._hooks.on_serving(self)
        return True

    def _serve(self) -> tuple[str, bool]:
        """Runs steps until the worker must leave; returns why, and whether it was an internal error."""
        pipeline = StepPipeline(self.scheduler, self.busy)
        stream = self._stream
        try:
            while True:
                outgoing: list = []
                with self._lock:
                    while True:
                        if self._leave_reason is not None:
                            return self._leave_reason, False
                        pipeline.send_ready(outgoing.append)
                        if pipeline.num_in_flight:
                            break
                        self._wakeup.wait(WAIT_POLL_S)
                self.waiting_since = time.monotonic()
                # Sent and received outside the lock: clients submit and other workers run meanwhile, and a send
                # that blocks (a step socket whose worker stopped reading) can be ended by leave().
                for request in outgoing:
                    stream.send(request)
                result = stream.recv()
                with self._lock:
                    self.waiting_since = None
                    self._hooks.dispatch(pipeline.apply(result))
        except grpc.RpcError as exc:
            return self._leave_reason or f"its step stream failed: {exc.code().name}: {exc.details()}", False
        except StopIteration:
            return self._leave_reason or "it ended its step stream", False
        except ValueError as exc:  # the scheduler rejected a result: the worker broke the protocol
            return self._leave_reason or f"it sent an invalid step result: {exc}", False
        except Exception as exc:  # noqa: BLE001 - a bug must not strand the requests: they fail, we rejoin
            logger.exception("worker %s: the engine loop failed", self.address)
            with self._lock:
                self.num_engine_errors += 1
            return f"the engine loop failed: {exc!r}", True
        finally:
            self.waiting_since = None
            stream.close()

    def _leave(self, reason: str, is_internal_error: bool) -> None:
        with self._lock:
            self.state = WorkerState.GONE
            self._stream = None
            requests = self.scheduler.take_live_requests()
            self.scheduler = None
            if not self._is_stopped:
                self.num_failures += 1
                self.last_error = reason
            log = logger.info if self._is_stopped else logger.warning
            log("worker %s left: %s; %d unfinished requests handed back", self.address, reason, len(requests))
            self._hooks.on_left(self, requests, reason if is_internal_error else None)

    def _sleep(self, seconds: float) -> None:
        with self._lock:
            self._wakeup.wait_for(lambda: self._is_stopped, seconds)
