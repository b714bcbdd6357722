"""The engine loop: schedule -> execute on the worker -> process, in a background thread.

sync: one step in flight. async (zero-bubble): the next step is scheduled and
sent while the worker runs the current one, so the worker always finds its
next step queued; the scheduler assumes every draft is accepted and corrects
itself when the result arrives (see scheduler.py).

Clients submit requests from gRPC threads and read their outputs from a
per-request queue; everything that touches the scheduler holds one lock.
"""

from dataclasses import dataclass
import logging
import queue
import threading
import time

import grpc

from scheduler_service.request import Request, RequestOutput
from scheduler_service.scheduler import Scheduler
from specdec.worker_client import WorkerClient

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The worker failed; the request cannot complete."""


@dataclass
class EngineStats:
    """Worker time accounting: idle share = 1 - busy / active wall time."""

    worker_busy_s: float = 0.0    # sum of the worker's own step times
    active_wall_s: float = 0.0    # wall time with at least one step in flight
    num_worker_failures: int = 0


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
        self._scheduler_factory = scheduler_factory
        self.scheduler: Scheduler = scheduler_factory()
        self.client = client
        self.stats = EngineStats()
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Condition()
        self._stopped = False
        self._max_in_flight = 2 if self.scheduler.config.is_async else 1
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

    def snapshot(self):
        """(scheduler, stats) read under the lock, for GetServerInfo."""
        with self._lock:
            return self.scheduler, EngineStats(**vars(self.stats))

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
        num_in_flight = 0
        last_result_at = busy_since = 0.0  # busy period: from a send after idling to the last result
        while True:
            with self._lock:
                while num_in_flight < self._max_in_flight and not self._stopped:
                    step = self.scheduler.schedule()
                    if step is None:
                        break
                    if num_in_flight == 0 and busy_since == 0.0:
                        busy_since = time.perf_counter()
                    stream.send(step)
                    num_in_flight += 1
                if self._stopped:
                    return
                if not num_in_flight:
                    busy_since = 0.0
                    self._lock.wait(timeout=1.0)
                    continue
            result = stream.recv()  # blocks outside the lock: clients may submit meanwhile
            now = time.perf_counter()
            num_in_flight -= 1
            with self._lock:
                # Wall time counts from the previous result (or the start of this busy period), so
                # the gaps between steps — the scheduler's bubbles — count as worker idle time.
                self.stats.active_wall_s += now - max(last_result_at, busy_since)
                self.stats.worker_busy_s += result.stats.total_ms / 1e3
                last_result_at = now
                self._dispatch(self.scheduler.update(result))

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
            self.stats.num_worker_failures += 1
            stale_ids = self.scheduler.request_ids()
            for handle in self._handles.values():
                handle.outputs.put(EngineError(message))
            self._handles.clear()
            self.scheduler = self._scheduler_factory()
            self.scheduler.drop_on_worker(stale_ids)  # the worker may still hold their state
        time.sleep(1.0)
