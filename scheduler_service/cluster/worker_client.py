"""A client of the Worker service: describe, init the cache, and a step stream (no torch)."""

import contextlib
import logging
import queue
import socket
import threading

from google.protobuf.message import DecodeError
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import step, step_wire
from specdec.convert import step_request_to_proto, step_result_from_proto
from specdec.security import channel_options
from specdec.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_CLOSE = object()
STEP_SOCKET_CONNECT_TIMEOUT_S = 5.0
CLOSE_WAIT_S = 5.0  # how long close() waits for a recv to let go of the socket before it leaves it open
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
SESSION_METADATA_KEY = "specdec-session-id"  # the step stream's session (worker.proto, ExecuteModel)


class StepStream:
    """One ExecuteModel stream. `send` may run ahead of `recv` (two steps in flight)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, session_id: str):
        self._outbox: queue.Queue = queue.Queue()
        self._responses = stub.ExecuteModel(
            iter(self._outbox.get, _CLOSE), metadata=[(SESSION_METADATA_KEY, session_id)]
        )

    def send(self, request: step.StepRequest) -> None:
        self._outbox.put(step_request_to_proto(request))

    def recv(self) -> step.StepResult:
        """The next step's result; raises grpc.RpcError when the worker rejected a step."""
        return step_result_from_proto(next(self._responses))

    def close(self) -> None:
        """Gives up on the stream at once (steps in flight are dropped)."""
        self._outbox.put(_CLOSE)
        self._responses.cancel()

    def finish(self) -> None:
        """Ends the stream gracefully: returns once the worker has ended it (its results are discarded)."""
        self._outbox.put(_CLOSE)
        for _ in self._responses:
            pass


class SocketStepStream:
    """StepStream's calls over a worker's step socket (specdec/step_wire.py): the same messages without gRPC's
    threads. Errors are raised as the gRPC stream raises them (grpc.RpcError with code() and details(), and
    StopIteration when the worker ends the stream), so the engine loop handles both alike.

    A failed send is not raised: the worker may have closed the stream with an ERROR frame (a refused session,
    a rejected step), which the next recv reads and raises; a connection that just failed raises there too.
    close() may come from another thread while recv waits: it shuts the socket down, which ends the wait, and
    closes it once no recv is reading it (a descriptor closed under a reader could be reused meanwhile).
    """

    def __init__(self, sock: socket.socket, session_id: str):
        self._sock = sock
        self._reader = step_wire.FrameReader(sock)
        self._reading = threading.Lock()  # held by recv while it reads
        self._send_error: OSError | None = None
        self._write(step_wire.HELLO, (step_wire.HELLO_PREFIX + (session_id or "")).encode())

    def send(self, request: step.StepRequest) -> None:
        self._write(step_wire.STEP, step_request_to_proto(request).SerializeToString())

    def recv(self) -> step.StepResult:
        """The next step's result; raises grpc.RpcError when the worker rejected a step or the connection
        failed, StopIteration when the worker ended the stream, ValueError for a result that does not parse."""
        with self._reading:
            frame = self._read()
        if frame is None:
            if self._send_error is not None:
                raise self._unavailable(self._send_error)
            raise StopIteration
        kind, payload = frame
        if kind == step_wire.ERROR:
            raise step_wire.error_from_payload(payload)
        if kind != step_wire.RESULT:
            raise ValueError(f"expected a step result on the step socket, got frame kind {kind}")
        try:
            response = worker_pb2.ExecuteModelResponse.FromString(payload)
        except DecodeError as exc:
            raise ValueError(f"a step result that does not parse: {exc}") from None
        return step_result_from_proto(response)

    def close(self) -> None:
        """Gives up on the stream at once (steps in flight are dropped); a recv in progress ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._reading.acquire(timeout=CLOSE_WAIT_S):  # a recv in progress returns now: the socket is shut
            try:
                self._sock.close()
            finally:
                self._reading.release()

    def finish(self) -> None:
        """Ends the stream gracefully: returns once the worker has ended it (its results are discarded)."""
        try:
            self._write(step_wire.END)
            with self._reading:
                while self._read() is not None:
                    pass
        except (grpc.RpcError, ValueError):
            pass  # the worker ended it already
        finally:
            self.close()

    def _read(self) -> tuple[int, bytes] | None:
        try:
            return self._reader.read()
        except (OSError, step_wire.ClosedMidFrame) as exc:
            raise self._unavailable(exc) from None
        except step_wire.WireError as exc:
            raise ValueError(f"the step socket's framing broke: {exc}") from None

    def _write(self, kind: int, payload: bytes = b"") -> None:
        if self._send_error is not None:
            return
        try:
            step_wire.write_frame(self._sock, kind, payload)
        except OSError as exc:
            self._send_error = exc  # recv raises what the worker said, or this

    @staticmethod
    def _unavailable(exc: Exception) -> step_wire.StepStreamError:
        return step_wire.StepStreamError(grpc.StatusCode.UNAVAILABLE, f"the step socket failed: {exc}")


class WorkerClient:
    """Talks to one worker at `address` (host:port).

    credentials: TLS (specdec.security.channel_credentials), else plaintext; server_name: the name the
    worker's certificate must carry when it differs from the address (grpc.ssl_target_name_override).
    """

    def __init__(
        self, address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None
    ):
        self.address = address
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            *channel_options(server_name),
        ]
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def describe(self, block_size: int, timeout: float | None = None) -> worker_pb2.DescribeResponse:
        return self.stub.Describe(worker_pb2.DescribeRequest(block_size=block_size), timeout=timeout)

    def init_cache(
        self,
        num_blocks: int,
        block_size: int,
        previous_session_id: str | None = None,
        take_over: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Starts a session (the worker drops every request it held); returns its id."""
        reply = self.stub.InitCache(
            worker_pb2.InitCacheRequest(
                num_blocks=num_blocks,
                block_size=block_size,
                previous_session_id=previous_session_id or "",
                take_over=take_over,
            ),
            timeout=timeout,
        )
        return reply.session_id

    def open_stream(self, session_id: str, step_port: int = 0) -> StepStream | SocketStepStream:
        """The session's step stream: on the worker's step socket at step_port (DescribeResponse.step_port;
        0: none) when it can connect, else (and with a warning when it could not) over gRPC."""
        if step_port:
            host = self.address.rsplit(":", 1)[0].strip("[]")
            sock = None
            try:
                sock = socket.create_connection((host, step_port), timeout=STEP_SOCKET_CONNECT_TIMEOUT_S)
                sock.settimeout(None)
                step_wire.configure(sock)
            except OSError as exc:
                if sock is not None:
                    sock.close()
                logger.warning(
                    "worker %s: cannot reach its step socket (port %d): %s; its steps go over gRPC",
                    self.address,
                    step_port,
                    exc,
                )
            else:
                return SocketStepStream(sock, session_id)  # a failed hello shows at the first recv
        return StepStream(self.stub, session_id)

    def execute(self, request: step.StepRequest, session_id: str) -> step.StepResult:
        """One step on a fresh stream (simple, for tests and tools)."""
        stream = self.open_stream(session_id)
        try:
            stream.send(request)
            result = stream.recv()
        except BaseException:
            stream.close()
            raise
        stream.finish()  # the worker has closed the stream: the session may open the next one
        return result

    def check_health(self, timeout: float) -> grpc.Future:
        """A gRPC health check of the Worker service, as a future (its result is the serving status)."""
        return self.health.Check.future(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)

    def close(self) -> None:
        self.channel.close()
