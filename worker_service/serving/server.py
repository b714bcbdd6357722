"""The Worker gRPC service, with health checking and reflection.

Health is NOT_SERVING until the model is loaded and the KV cache is allocated
(InitCache), and again from SIGTERM on. A step the worker cannot run ends its
ExecuteModel stream with INVALID_ARGUMENT and a message; the worker's state is
unchanged and it keeps serving. One scheduler session at a time (session.py).

All torch work (model loading, cache allocation, steps) runs on one compute
thread. OpenMP gives every thread that enters a parallel region its own team,
and with two teams on a 2-core machine (the model loaded on the main thread,
steps run on a gRPC thread) a SmolLM2 decode step took 55-76 ms instead of
40-45 ms; on a single thread it takes the same as on the main thread.
"""

from concurrent import futures
import logging
import queue
import threading
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.convert import step_request_from_proto, step_result_to_proto
from specdec.v1 import worker_pb2, worker_pb2_grpc
from worker_service.serving.metrics import WorkerMetrics
from worker_service.serving.session import SessionError, SessionGate, StepAbort, grpc_step_stream, session_stream
from worker_service.speculation.request_state import InvalidStepError
from worker_service.speculation.worker import Worker

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Serves one Worker; steps run one at a time, in arrival order, on the compute thread."""

    def __init__(self, health_servicer: health.HealthServicer):
        self.worker: Worker | None = None
        self.model_id = ""
        self.health = health_servicer
        self.metrics = WorkerMetrics()  # served by run_worker with --metrics-port
        self.compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.sessions = SessionGate()
        self.is_stopping = False  # SIGTERM: finish the step in flight, then end the step stream
        self.step_port = 0  # the port of a step socket serving run_session (step_socket.serve_steps; 0: none)

    def run_compute(self, fn, *args):
        """Runs fn(*args) on the compute thread and returns its result (or raises its exception)."""
        return self.compute.submit(fn, *args).result()

    def close(self) -> None:
        """Lets the compute thread go once the server has stopped."""
        self.compute.shutdown(wait=False)

    def set_worker(self, worker: Worker, model_id: str) -> None:
        """Called once the models are loaded."""
        self.worker, self.model_id = worker, model_id

    def begin_shutdown(self) -> None:
        """NOT_SERVING, no new session, and the open step stream ends after its step in flight."""
        self.is_stopping = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set_health(self, status) -> None:
        for name in (SERVICE_NAME, ""):
            self.health.set(name, status)

    def _require_worker(self, context) -> Worker:
        if self.worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.worker

    def Describe(self, request, context):
        """Model and capacity facts for a block size."""
        worker = self._require_worker(context)
        if request.block_size <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_size must be > 0")
        config = worker.config
        bytes_per_block = worker.kv_bytes_per_block(request.block_size)
        eos_ids = worker.eos_token_ids
        return worker_pb2.DescribeResponse(
            model_id=self.model_id,
            vocab_size=worker.target.vocab_size,
            max_model_len=worker.max_model_len,
            kv_bytes_per_block=bytes_per_block,
            num_blocks_capacity=config.kv_cache_memory_bytes // bytes_per_block,
            eos_token_ids=eos_ids,
            dtype=config.dtype,
            proposer=config.proposer,
            max_num_speculative_tokens=worker.max_num_speculative_tokens,
            draft_model_id=config.draft_model or "",
            scorer=config.scorer,
            device=config.device,
            max_draft_tree_width=worker.max_draft_tree_width,
            step_port=self.step_port,
        )

    def InitCache(self, request, context):
        """Starts a scheduler session: allocates the KV cache, drops every request; the worker then reports
        SERVING."""
        worker = self._require_worker(context)
        if self.is_stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if request.num_blocks <= 0 or request.block_size <= 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_blocks and block_size must be > 0, got {request.num_blocks}, {request.block_size}",
            )
        capacity = worker.config.kv_cache_memory_bytes // max(worker.kv_bytes_per_block(request.block_size), 1)
        if request.num_blocks > capacity:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{request.num_blocks} blocks exceed the KV memory budget ({capacity} blocks)",
            )

        def start_session() -> tuple[str, int]:  # on the compute thread: no step runs in between
            session_id = self.sessions.begin(request.previous_session_id, request.take_over)
            worker.drop_requests()
            return session_id, worker.init_cache(request.num_blocks, request.block_size)

        try:
            session_id, num_bytes = self.run_compute(start_session)
        except SessionError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        logger.info(
            "session started: %d KV blocks of %d tokens%s",
            request.num_blocks,
            request.block_size,
            " (taken over)" if request.take_over else "",
        )
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return worker_pb2.InitCacheResponse(kv_cache_bytes=num_bytes, session_id=session_id)

    def ExecuteModel(self, request_iterator, context):
        """Executes the session's steps in order; one response per request."""
        yield from grpc_step_stream(self.run_session, request_iterator, context)

    def run_session(self, session_id: str | None, requests, is_active) -> Iterator[worker_pb2.ExecuteModelResponse]:
        """A step stream, whichever transport carries it (gRPC's ExecuteModel, or step_socket.py): the results
        of `requests` (ExecuteModelRequest messages, read on a thread of the stream's own) in order, while
        is_active() (False: the scheduler abandoned the stream, and the steps not started are dropped). Raises
        StepAbort for a stream that must end with an error status."""
        if self.worker is None:
            raise StepAbort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        worker = self.worker
        return session_stream(
            self.sessions, session_id, lambda sid: self._execute_steps(worker, sid, requests, is_active)
        )

    def _execute_steps(self, worker: Worker, session_id: str, request_iterator, is_active):
        """The stream's steps, run in order on the compute thread, their results yielded in order. A thread of
        the stream's own reads the requests and queues each step as it arrives: under async scheduling the next
        step is here while one runs, and it starts as soon as that one ends, not after that one's result has
        been converted and sent (~0.9 ms of a ~8 ms one-row step on two cores, which the worker sat idle)."""
        stop = threading.Event()  # set once a step failed or the stream ends: the steps queued after it skip

        def execute(step_request):  # on the compute thread, after every step queued before it
            if stop.is_set() or not is_active() or self.is_stopping:
                raise _NotRun()  # the stream is over, the scheduler left it, or SIGTERM came: see below
            try:
                self.sessions.check_current(session_id)
                return worker.execute(step_request)
            except BaseException:
                stop.set()  # the compute thread reads it before the next queued step
                raise

        # In arrival order: (step id, its future); (step id, ValueError) for a request the step dataclasses reject
        # (e.g. sampling parameters); (None, what ended the reading otherwise); then None.
        arrived: queue.Queue = queue.Queue()

        def read() -> None:
            try:
                for request in request_iterator:
                    if stop.is_set():
                        return
                    try:
                        step_request = step_request_from_proto(request)
                    except ValueError as exc:
                        arrived.put((request.step_id, exc))
                        return
                    arrived.put((request.step_id, self.compute.submit(execute, step_request)))
            except BaseException as exc:  # noqa: BLE001 - the stream's thread decides what it means
                arrived.put((None, exc))
            finally:
                arrived.put(None)

        threading.Thread(target=read, name="step-reader", daemon=True).start()
        try:
            while (item := arrived.get()) is not None:
                step_id, pending = item
                if isinstance(pending, ValueError) and step_id is not None:
                    logger.warning("rejected step %d: %s", step_id, pending)
                    raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, str(pending))
                if isinstance(pending, BaseException):
                    if is_active():
                        raise pending  # not the call ending: an error the stream reports, as before
                    return  # the call ended: cancelled, or the scheduler's side closed it
                try:
                    result = pending.result()
                except _NotRun:
                    if self.is_stopping and is_active():
                        logger.info("shutting down: step stream ended after the steps in flight")
                    return  # the scheduler moves this session's requests to other workers
                except InvalidStepError as exc:
                    logger.warning("rejected step %d: %s", step_id, exc)
                    raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
                except SessionError as exc:
                    raise StepAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
                self.metrics.observe_step(result)
                yield step_result_to_proto(result)
        finally:
            stop.set()


class _NotRun(Exception):
    """A queued step that did not run: the stream ended, failed or was left before it, or the worker stops."""


# Server-side keepalive: a scheduler that vanished without closing its connection (a lost node) is found
# within ~15 s, and its session no longer blocks the next scheduler.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def create_server(
    host: str,
    port: int,
    max_workers: int = 16,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, WorkerServicer, int]:
    """A started server with the Worker, health and reflection services; returns the bound port.

    Only one step stream at a time holds a thread for long (one session, one stream); any other gets
    FAILED_PRECONDITION at once, so the pool stays free for health checks. credentials: a TLS port
    (specdec.security.server_credentials; with a CA, clients need a certificate), else plaintext.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            *KEEPALIVE_OPTIONS,
        ],
    )
    health_servicer = health.HealthServicer()
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = WorkerServicer(health_servicer)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use?)")
    server.start()
    return server, servicer, bound
