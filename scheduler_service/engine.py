"""The engine loop: schedule -> execute on the worker -> process, in a background thread.

sync: one step in flight. async (zero-bubble): the next step is scheduled and
sent while the worker runs the current one, so the worker always finds its
next step queued; the scheduler assumes every draft is accepted and corrects
itself when the result arrives (see scheduler.py).

Clients submit requests from gRPC threads and read their outputs from a
per-request queue; everything that touches the scheduler holds one lock.
"""

from dataclasses import dataclass, replace
import logging
import queue
import threading
import time

import grpc

from scheduler_service.config import SchedulerConfig
from scheduler_service.pipeline import BusyStats, StepPipeline
from scheduler_service.request import Request, RequestOutput
from scheduler_service.scheduler import Scheduler, SchedulerStats
from scheduler_service.worker_client import WorkerClient

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The worker failed; the request cannot complete."""


@dataclass(frozen=True)
class EngineSnapshot:
    """An immutable copy of the engine's state, for GetServerInfo (read without holding the lock)."""

    config: SchedulerConfig
    stats: SchedulerStats
    busy: BusyStats
    num_worker_failures: int
    num_running: int
    num_waiting: int
    num_free_blocks: int


class RequestHandle:
    """The outputs of one request, in order; the last has a finish_reason (or is an EngineError)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.outputs: queue.Queue = queue.Queue()
        self.is_done = False

    def get(self, timeout: float | None = None) -> RequestOutput:
        item = self.outputs.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item


class Engine:
    """Owns the scheduler and the step stream to one worker."""

    def __init__(self, scheduler_factory, client: WorkerClient):
        self._scheduler_factory = scheduler_factory  # scheduler_factory(stats) -> Scheduler
        self.scheduler: Scheduler = scheduler_factory(SchedulerStats())
        self.client = client
        self.busy = BusyStats()
        self.num_worker_failures = 0
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> RequestHandle:
        """Queues a request; raises ValueError (bad or duplicate request) before anything is queued."""
        with self._lock:
            if request.request_id in self._handles:
                raise KeyError(f"request id {request.request_id!r} is already running")
            self.scheduler.add_request(request)
            handle = self._handles[request.request_id] = RequestHandle(request.request_id)
            self._lock.notify_all()
        return handle

    def abort(self, request_id: str) -> bool:
        """Aborts a live request (its blocks are freed); False when no such request runs."""
        with self._lock:
            handle = self._handles.pop(request_id, None)
            request = self.scheduler.get_request(request_id)
            if handle is None or request is None or not self.scheduler.abort(request_id):
                return False
            handle.outputs.put(request.make_output([], ""))  # finish_reason "abort", usage so far
            self._lock.notify_all()
            return True

    def snapshot(self) -> EngineSnapshot:
        """The engine's state and counters, copied under the lock."""
        with self._lock:
            s = self.scheduler
            return EngineSnapshot(config=s.config, stats=replace(s.stats), busy=replace(self.busy),
                                  num_worker_failures=self.num_worker_failures, num_running=len(s.running),
                                  num_waiting=len(s.waiting), num_free_blocks=s.num_free_blocks)

    def _run(self) -> None:
        while not self._stopped:
            stream = self.client.open_stream()
            try:
                self._drive(stream)
            except grpc.RpcError as exc:
                self._fail_all(f"the worker failed: {exc.code().name}: {exc.details()}")
            finally:
                stream.close()

    def _drive(self, stream) -> None:
        pipeline = StepPipeline(self.scheduler, self.busy)
        while True:
            with self._lock:
                if not self._stopped:
                    pipeline.send_ready(stream.send)
                if self._stopped:
                    return
                if not pipeline.num_in_flight:
                    self._lock.wait(timeout=1.0)
                    continue
            result = stream.recv()  # blocks outside the lock: clients may submit meanwhile
            with self._lock:
                self._dispatch(pipeline.apply(result))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            handle.outputs.put(output)
            if output.finish_reason is not None:
                handle.is_done = True
                del self._handles[output.request_id]

    def _fail_all(self, message: str) -> None:
        """Ends every live request with an error and starts over with an empty scheduler."""
        logger.error("%s; failing %d requests", message, len(self._handles))
        with self._lock:
            self.num_worker_failures += 1
            stale_ids = self.scheduler.request_ids()
            for handle in self._handles.values():
                handle.outputs.put(EngineError(message))
            self._handles.clear()
            self.scheduler = self._scheduler_factory(self.scheduler.stats)
            self.scheduler.drop_on_worker(stale_ids)  # the worker may still hold their state
        time.sleep(1.0)
