"""The Worker gRPC service, with health checking and reflection.

Health is NOT_SERVING until the model is loaded and the KV cache is allocated
(InitCache). A step the worker cannot run ends its ExecuteModel stream with
INVALID_ARGUMENT and a message; the worker's state is unchanged and it keeps
serving other and later streams.

All torch work (model loading, cache allocation, steps) runs on one compute
thread. OpenMP gives every thread that enters a parallel region its own team,
and with two teams on a 2-core machine (the model loaded on the main thread,
steps run on a gRPC thread) a SmolLM2 decode step took 55-76 ms instead of
40-45 ms; on a single thread it takes the same as on the main thread.
"""

from concurrent import futures
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.convert import step_request_from_proto, step_result_to_proto
from specdec.v1 import worker_pb2, worker_pb2_grpc
from worker_service.metrics import WorkerMetrics
from worker_service.request_state import InvalidStepError
from worker_service.worker import Worker

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one Worker; steps run one at a time, in arrival order, on the compute thread."""

    def __init__(self, health_servicer: health.HealthServicer):
        self.worker: Worker | None = None
        self.model_id = ""
        self.health = health_servicer
        self.metrics = WorkerMetrics()   # served by run_worker with --metrics-port
        self.compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    def run_compute(self, fn, *args):
        """Runs fn(*args) on the compute thread and returns its result (or raises its exception)."""
        return self.compute.submit(fn, *args).result()

    def close(self) -> None:
        """Lets the compute thread go once the server has stopped."""
        self.compute.shutdown(wait=False)

    def set_worker(self, worker: Worker, model_id: str) -> None:
        """Called once the models are loaded."""
        self.worker, self.model_id = worker, model_id

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
        eos = worker.target.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return worker_pb2.WorkerInfo(
            model_id=self.model_id, vocab_size=worker.target.vocab_size, max_model_len=worker.max_model_len,
            kv_bytes_per_block=bytes_per_block,
            num_blocks_capacity=config.kv_cache_memory_bytes // bytes_per_block,
            eos_token_ids=eos_ids, dtype=config.dtype, proposer=config.proposer,
            max_num_speculative_tokens=config.num_speculative_tokens, draft_model_id=config.draft_model or "",
            scorer=config.scorer)

    def InitCache(self, request, context):
        """Allocates the KV cache; the worker then reports SERVING."""
        worker = self._require_worker(context)
        capacity = worker.config.kv_cache_memory_bytes // max(worker.kv_bytes_per_block(request.block_size or 1), 1)
        if request.num_blocks > capacity:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{request.num_blocks} blocks exceed the KV memory budget ({capacity} blocks)")
        try:
            num_bytes = self.run_compute(worker.init_cache, request.num_blocks, request.block_size)
        except InvalidStepError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return worker_pb2.InitCacheResponse(kv_cache_bytes=num_bytes)

    def ExecuteModel(self, request_iterator, context):
        """Executes steps in order; one response per request."""
        worker = self._require_worker(context)
        for request in request_iterator:
            try:
                step_request = step_request_from_proto(request)
            except ValueError as exc:  # the step dataclasses reject a field (e.g. sampling parameters)
                logger.warning("rejected step %d: %s", request.step_id, exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if not context.is_active():
                return  # the scheduler gave up on this stream (it left us): its queued steps must not run
            try:
                result = self.run_compute(worker.execute, step_request)
            except InvalidStepError as exc:
                logger.warning("rejected step %d: %s", request.step_id, exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.metrics.observe_step(result)
            yield step_result_to_proto(result)


def create_server(host: str, port: int, max_workers: int = 8) -> tuple[grpc.Server, WorkerServicer, int]:
    """A started server with the Worker, health and reflection services; returns the bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    health_servicer = health.HealthServicer()
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = WorkerServicer(health_servicer)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use?)")
    server.start()
    return server, servicer, bound
