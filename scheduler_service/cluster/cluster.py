"""Many workers behind one client API: membership, routing, and moving requests when a worker leaves.

Each worker has its own engine (engine.py: a scheduler with its own KV pool,
speculation state and step loop). The cluster

- keeps one engine per worker address the membership names (static
  addresses, and every address a `dns:///` name resolves to, re-resolved
  every refresh interval); a worker whose address disappears leaves;
- places each new request on a serving worker (`_rank`): by default
  (--routing cache-aware) the one whose prefix cache holds the longest prefix
  of its tokens, among the workers with at most --routing-max-imbalance more
  requests than the least busy; without a cached prefix (or with
  --routing least-loaded), the one with the most headroom (queued + running
  requests, then free KV blocks). A request stays there unless its worker
  leaves; a worker's cache goes with its scheduler when it leaves;
- moves the unfinished requests of a worker that left to the others: they
  resume by recompute from prompt + the tokens already streamed, so the
  client's stream just continues (keyed sampling makes the output the same);
- holds requests while no worker serves, for at most the wait timeout (and
  never past the client's deadline), then fails them with UNAVAILABLE;
- watches every serving worker (watchdog.py), so a worker that hangs (no
  step result, no failure) leaves too.

One lock (`lock`) guards the cluster and every engine's scheduler.
"""

from collections import deque
from dataclasses import dataclass, fields
import logging
import threading
import time
from typing import Callable

import grpc

from scheduler_service.cluster.engine import EngineHooks, WorkerEngine, WorkerSnapshot, WorkerState
from scheduler_service.cluster.handle import EngineError, ModelFacts, RequestHandle, RequestObserver
from scheduler_service.cluster.membership import Membership
from scheduler_service.cluster.options import SchedulerOptions, scheduler_config
from scheduler_service.cluster.pipeline import BusyStats
from scheduler_service.cluster.watchdog import Watchdog
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.detokenizer import Tokenizer
from scheduler_service.core.request import Request, RequestOutput, RequestStatus
from scheduler_service.core.stats import SchedulerStats

logger = logging.getLogger(__name__)

MAINTENANCE_INTERVAL_S = 0.2
# A request whose workers keep failing while they run it (one that crashes them?) stops moving.
MAX_MOVES_PER_REQUEST = 4


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every worker's state and the totals, copied under the lock."""

    workers: tuple[WorkerSnapshot, ...]
    stats: SchedulerStats  # summed over every worker, those gone included
    busy: BusyStats
    num_worker_failures: int
    num_engine_errors: int
    num_requests: int  # accepted by the API (a moved request counts once)
    num_moved_requests: int
    num_waiting_for_worker: int


def _sum(items: list, cls):
    return cls(**{f.name: sum(getattr(i, f.name) for i in items) for f in fields(cls)})


class Cluster:
    """See the module docstring."""

    def __init__(
        self,
        options: SchedulerOptions,
        membership: Membership,
        tokenizer: Tokenizer | None,
        on_serving_changed: Callable[[bool], None] = lambda is_serving: None,
        request_observer: RequestObserver | None = None,
    ):
        self.options = options
        self.tokenizer = tokenizer
        self.lock = threading.RLock()
        self.facts: ModelFacts | None = None
        self._membership = membership
        self._on_serving_changed = on_serving_changed
        self._engines: dict[str, WorkerEngine] = {}
        self._retired: list[WorkerEngine] = []
        self._handles: dict[str, RequestHandle] = {}
        self._waiting: deque[RequestHandle] = deque()  # for a worker to serve
        self._num_requests = 0
        self._num_moved_requests = 0
        self._num_maintenance_errors = 0
        self._observer = request_observer or RequestObserver()  # request latencies (the process's metrics)
        self._was_serving = False
        self._is_stopping = False
        self._stop_reason = ""
        self._changed = threading.Condition(self.lock)
        self._watchdog = Watchdog(options.worker_step_timeout_s)
        self._session_by_address: dict[str, str] = {}  # a retired engine's last session on its worker
        self._thread = threading.Thread(target=self._maintain, name="cluster", daemon=True)
        self._hooks = EngineHooks(
            self.lock, options, tokenizer, self.config_for, self.on_serving, self.on_left, self.dispatch
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._update_members(self._membership.addresses())
        self._thread.start()

    def stop(self, reason: str = "the scheduler is shutting down") -> None:
        """Fails the requests still running (UNAVAILABLE, with `reason`) and stops every engine."""
        with self.lock:
            self._is_stopping = True
            self._stop_reason = reason
            engines = [*self._engines.values()]
            self._changed.notify_all()
        for engine in engines:
            engine.leave("the scheduler is shutting down", stop=True)
        for engine in engines:
            engine.join_thread(timeout=10)
        with self.lock:
            for handle in [*self._waiting]:
                self._fail(handle, grpc.StatusCode.UNAVAILABLE, reason)

    def wait_for_facts(self, timeout_s: float) -> ModelFacts:
        """Blocks until a worker has described its model; raises TimeoutError."""
        with self.lock:
            if not self._changed.wait_for(lambda: self.facts is not None, timeout_s):
                raise TimeoutError(
                    f"no worker answered within {timeout_s:.0f} s ({', '.join(map(str, self._membership.specs))})"
                )
            return self.facts

    # ------------------------------------------------------------------ client API

    def submit(self, request: Request, client_deadline: float | None = None) -> RequestHandle:
        """Queues a request on a worker, or holds it until one serves.

        Raises KeyError for an id in use and ValueError for a request no worker can serve.
        """
        with self.lock:
            if self._is_stopping:
                raise EngineError(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
            if request.request_id in self._handles:
                raise KeyError(f"request id {request.request_id!r} is already running")
            num_queued = self._num_queued()
            if num_queued >= self.options.max_waiting_requests:
                raise EngineError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is overloaded: {num_queued} requests are queued "
                    f"(--max-waiting-requests {self.options.max_waiting_requests}); retry later",
                )
            config = self.facts.config
            request.check_limits(config.max_model_len, self._largest_pool_tokens())
            handle = RequestHandle(request, client_deadline)
            self._place(handle)  # raises ValueError before anything is kept
            self._handles[request.request_id] = handle
            self._num_requests += 1
            return handle

    def abort(self, request_id: str) -> bool:
        """Aborts a live request (its blocks are freed); False when no such request runs."""
        with self.lock:
            handle = self._handles.get(request_id)
            if handle is None:
                return False
            if handle.engine is not None:
                if not handle.engine.scheduler.abort(request_id):
                    return False
                handle.engine.wake()
            else:
                self._waiting.remove(handle)
                handle.request.status = RequestStatus.FINISHED_ABORTED
            del self._handles[request_id]
            output = handle.request.make_output([], "")  # finish_reason "abort", usage so far
            self._observer.on_output(handle, output)
            handle.outputs.put(output)
            return True

    @property
    def num_live_requests(self) -> int:
        """Requests accepted and not finished (queued, running or waiting for a worker)."""
        with self.lock:
            return len(self._handles)

    def snapshot(self) -> ClusterSnapshot:
        with self.lock:
            engines = [*self._engines.values(), *self._retired]
            return ClusterSnapshot(
                workers=tuple(e.snapshot() for e in self._engines.values()),
                stats=SchedulerStats.total([e.stats for e in engines]),
                busy=_sum([e.busy for e in engines], BusyStats),
                num_worker_failures=sum(e.num_failures for e in engines),
                num_engine_errors=sum(e.num_engine_errors for e in engines) + self._num_maintenance_errors,
                num_requests=self._num_requests,
                num_moved_requests=self._num_moved_requests,
                num_waiting_for_worker=len(self._waiting),
            )

    # ------------------------------------------------------------------ called by engines (lock held)

    def config_for(self, info) -> SchedulerConfig:
        """The scheduler config for a joining worker; ValueError when it serves another model."""
        config = scheduler_config(self.options, info)
        with self.lock:
            if self.facts is None:
                self.facts = ModelFacts(
                    info.model_id,
                    self.options.served_model_name or info.model_id,
                    info.vocab_size,
                    tuple(info.eos_token_ids),
                    info.proposer,
                    config,
                )
                self._changed.notify_all()
            facts = self.facts
        theirs = (info.model_id, info.vocab_size, tuple(info.eos_token_ids))
        ours = (facts.model_id, facts.vocab_size, facts.eos_token_ids)
        if theirs != ours:
            raise ValueError(f"it serves model {theirs} (id, vocab size, EOS ids); the others serve {ours}")
        return config

    def on_serving(self, engine: WorkerEngine) -> None:
        """A worker joined: the requests waiting for one are placed."""
        for handle in [*self._waiting]:
            self._waiting.remove(handle)
            self._place_or_fail(handle)
        self._serving_changed()

    def on_left(self, engine: WorkerEngine, requests: list[Request], internal_error: str | None = None) -> None:
        """A worker left: its unfinished requests move to the others (or wait for one).

        After an internal error in its engine loop they fail with INTERNAL instead (moving could repeat it).
        """
        if self._engines.get(engine.address) is not engine and engine.session_id:  # retired (no longer listed)
            self._session_by_address[engine.address] = engine.session_id  # its successor may take it over
        for request in requests:
            handle = self._handles.get(request.request_id)
            if handle is None:
                continue
            handle.engine = None
            if internal_error is not None:
                self._fail(
                    handle,
                    grpc.StatusCode.INTERNAL,
                    f"internal error in the scheduler while running the request ({internal_error}); "
                    "it is logged with a traceback",
                )
            elif self._is_stopping:
                self._fail(handle, grpc.StatusCode.UNAVAILABLE, self._stop_reason)
            elif request.num_moves > MAX_MOVES_PER_REQUEST:
                self._fail(
                    handle,
                    grpc.StatusCode.INTERNAL,
                    f"the request moved {MAX_MOVES_PER_REQUEST} times: every worker that ran it failed",
                )
            else:
                self._num_moved_requests += 1
                self._place_or_fail(handle)
        self._serving_changed()

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their requests' streams."""
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            self._observer.on_output(handle, output)
            handle.outputs.put(output)
            if output.finish_reason is not None:
                handle.is_done = True
                del self._handles[output.request_id]

    # ------------------------------------------------------------------ placement (lock held)

    def _serving_engines(self) -> list[WorkerEngine]:
        return [e for e in self._engines.values() if e.state is WorkerState.SERVING]

    def _workers_summary(self) -> str:
        """Each worker's state and last error, for messages that say why nothing serves."""
        return (
            "; ".join(
                f"{e.address}: {e.state.value}" + (f" ({e.last_error})" if e.last_error else "")
                for e in self._engines.values()
            )
            or "none listed"
        )

    def _num_queued(self) -> int:
        """Requests not running yet: in the workers' queues, and waiting for a worker."""
        return len(self._waiting) + sum(
            len(e.scheduler.waiting) for e in self._engines.values() if e.scheduler is not None
        )

    def _largest_pool_tokens(self) -> int:
        configs = [e.config for e in self._engines.values() if e.config is not None] or [self.facts.config]
        return max(c.num_kv_blocks * c.block_size for c in configs)

    def _place(self, handle: RequestHandle) -> None:
        """Puts the request on the serving worker with the most headroom that can hold it, else waits.

        Raises ValueError when every serving worker refuses it (its KV pool is too small).
        """
        request, error = handle.request, None
        for engine in self._rank([e for e in self._engines.values() if e.is_available], request):
            try:
                if request.arrival_index is None:  # never scheduled: a new request
                    engine.scheduler.add_request(request)
                else:
                    engine.scheduler.resume_requests([request])
            except ValueError as exc:
                error = exc
                continue
            handle.engine = engine
            engine.wake()
            return
        if error is not None:
            raise error
        wait_s = self.options.worker_wait_timeout_s
        handle.wait_deadline = min(time.monotonic() + wait_s, handle.client_deadline or float("inf"))
        self._waiting.append(handle)
        logger.info("no worker serves: %s waits (at most %.0f s)", request.request_id, wait_s)

    def _rank(self, engines: list[WorkerEngine], request: Request) -> list[WorkerEngine]:
        """The engines in the order to try: see the module docstring (cache-aware routing)."""
        ranked = sorted(engines, key=WorkerEngine.headroom_key)
        if self.options.routing != "cache-aware" or len(ranked) < 2:
            return ranked
        max_load = ranked[0].num_requests + self.options.routing_max_imbalance
        num_cached = {e.address: len(e.scheduler.cached_prefix(request)) for e in ranked if e.num_requests <= max_load}
        best = max(ranked, key=lambda e: num_cached.get(e.address, -1))  # the first of equals: most headroom
        if num_cached[best.address] == 0:
            return ranked
        return [best, *(e for e in ranked if e is not best)]

    def _place_or_fail(self, handle: RequestHandle) -> None:
        try:
            self._place(handle)
        except ValueError as exc:
            self._fail(handle, grpc.StatusCode.RESOURCE_EXHAUSTED, f"no worker can hold the request: {exc}")

    def _fail(self, handle: RequestHandle, code: grpc.StatusCode, message: str) -> None:
        if handle in self._waiting:
            self._waiting.remove(handle)
        self._handles.pop(handle.request_id, None)
        handle.request.status = RequestStatus.FINISHED_ABORTED
        self._observer.on_failed(handle)
        handle.outputs.put(EngineError(code, message))

    def _serving_changed(self) -> None:
        num_serving = len(self._serving_engines())
        is_serving = num_serving > 0
        if is_serving != self._was_serving:
            self._was_serving = is_serving
            logger.info("%d of %d workers serve", num_serving, len(self._engines))
            self._on_serving_changed(is_serving)

    # ------------------------------------------------------------------ maintenance thread

    def _maintain(self) -> None:
        next_refresh = time.monotonic() + self.options.worker_refresh_interval_s
        while True:
            with self.lock:
                if self._changed.wait_for(lambda: self._is_stopping, MAINTENANCE_INTERVAL_S):
                    return
            try:
                next_refresh = self._maintain_once(next_refresh)
            except Exception:  # noqa: BLE001 - a bug must not stop waiting expiry and hang detection for good
                logger.exception("cluster maintenance failed; it goes on")
                self._num_maintenance_errors += 1

    def _maintain_once(self, next_refresh: float) -> float:
        """Expires waiting requests, refreshes DNS when due, runs the watchdog; returns the next refresh time."""
        with self.lock:
            self._expire_waiting()
        now = time.monotonic()
        if self._membership.has_dns and now >= next_refresh:
            next_refresh = now + self.options.worker_refresh_interval_s
            self._update_members(self._membership.addresses())  # DNS outside the lock
        with self.lock:
            engines = self._serving_engines()
        self._watchdog.tick(engines)
        return next_refresh

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for handle in [h for h in self._waiting if h.wait_deadline <= now]:
            self._fail(
                handle,
                grpc.StatusCode.UNAVAILABLE,
                f"no worker is available: the request waited {self.options.worker_wait_timeout_s:.0f} s "
                f"(or until its deadline) for one to serve. Workers: {self._workers_summary()}",
            )

    def _update_members(self, addresses: list[str]) -> None:
        with self.lock:
            if self._is_stopping:
                return
            for address in addresses:
                if address not in self._engines:
                    logger.info("worker %s is listed: joining it", address)
                    previous_session_id = self._session_by_address.pop(address, None)
                    self._engines[address] = engine = WorkerEngine(address, self._hooks, previous_session_id)
                    engine.start()
            gone = [e for a, e in self._engines.items() if a not in addresses]
            for engine in gone:
                del self._engines[engine.address]
                self._retired.append(engine)
        for engine in gone:
            engine.leave("it is no longer listed", stop=True)
