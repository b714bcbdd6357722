"""A client of the Worker service: describe, init the cache, and a step stream (no torch)."""

import queue

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import step
from specdec.convert import step_request_to_proto, step_result_from_proto
from specdec.security import channel_options
from specdec.v1 import worker_pb2, worker_pb2_grpc

_CLOSE = object()
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class StepStream:
    """One ExecuteModel stream. `send` may run ahead of `recv` (two steps in flight)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self._outbox: queue.Queue = queue.Queue()
        self._responses = stub.ExecuteModel(iter(self._outbox.get, _CLOSE))

    def send(self, request: step.StepRequest) -> None:
        self._outbox.put(step_request_to_proto(request))

    def recv(self) -> step.StepResult:
        """The next step's result; raises grpc.RpcError when the worker rejected a step."""
        return step_result_from_proto(next(self._responses))

    def close(self) -> None:
        self._outbox.put(_CLOSE)
        self._responses.cancel()


class WorkerClient:
    """Talks to one worker at `address` (host:port).

    credentials: TLS (specdec.security.channel_credentials), else plaintext; server_name: the name the
    worker's certificate must carry when it differs from the address (grpc.ssl_target_name_override).
    """

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None):
        self.address = address
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   *channel_options(server_name)]
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def describe(self, block_size: int, timeout: float | None = None) -> worker_pb2.WorkerInfo:
        return self.stub.Describe(worker_pb2.DescribeRequest(block_size=block_size), timeout=timeout)

    def init_cache(self, num_blocks: int, block_size: int, timeout: float | None = None) -> int:
        reply = self.stub.InitCache(worker_pb2.InitCacheRequest(num_blocks=num_blocks, block_size=block_size),
                                    timeout=timeout)
        return reply.kv_cache_bytes

    def open_stream(self) -> StepStream:
        return StepStream(self.stub)

    def execute(self, request: step.StepRequest) -> step.StepResult:
        """One step on a fresh stream (simple, for tests and tools)."""
        stream = self.open_stream()
        try:
            stream.send(request)
            return stream.recv()
        finally:
            stream.close()

    def check_health(self, timeout: float) -> grpc.Future:
        """A gRPC health check of the Worker service, as a future (its result is the serving status)."""
        return self.health.Check.future(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)

    def close(self) -> None:
        self.channel.close()
