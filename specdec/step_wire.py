"""The step stream on a bare TCP socket: the frames both sides write, and the errors they mean.

The worker's ExecuteModel stream carries every step at batch 1, and gRPC's
synchronous stream costs ~2.5 CPU-ms and ~28 thread wake-ups a step on the
two sides together, where the model's OpenMP team wants every core
(docs/benchmarks.md, "Where it goes: the step stream itself"). A worker
started with --step-port also serves the same messages on a socket of its
own, advertised in DescribeResponse.step_port; the scheduler uses it for
plaintext workers and falls back to gRPC when it cannot connect. Everything
else (Describe, InitCache, health, TLS) stays gRPC.

A frame is its payload's length (4 bytes, little-endian), its kind (1 byte),
then the payload:

    scheduler -> worker: HELLO  "specdec-step/1 SESSION_ID" (first, once)
                         STEP   an ExecuteModelRequest
                         END    no more steps: the worker finishes the ones it has, then closes
    worker -> scheduler: RESULT an ExecuteModelResponse, one per STEP, in order
                         ERROR  "STATUS_CODE_NAME\\nmessage": what gRPC's status would say; then it closes

The worker closing the connection after its results is the stream's end (as
gRPC's OK); the scheduler closing it without END abandons the steps it sent.
"""

import socket
import struct

import grpc

HEADER = struct.Struct("<IB")  # payload length, frame kind
MAX_PAYLOAD_BYTES = 64 << 20  # as the gRPC channels' message limits
HELLO_PREFIX = "specdec-step/1 "

HELLO, STEP, END, RESULT, ERROR = 1, 2, 3, 4, 5

# A peer gone without closing (a lost node) is found within ~20 s, as the gRPC channels' keepalive finds it:
# by keepalive probes on an idle connection, and by TCP_USER_TIMEOUT while sent data goes unacknowledged (a
# result written to a scheduler that vanished meanwhile), which keepalive does not cover.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 2
USER_TIMEOUT_MS = 20_000


class WireError(Exception):
    """The peer broke the framing (a bad kind, a frame over the limit)."""


class ClosedMidFrame(WireError):
    """The connection ended inside a frame: the peer is gone (it died, or gave up on the stream)."""


class StepStreamError(grpc.RpcError):
    """A step stream's failure as the gRPC stream would raise it: code() and details() (the worker's ERROR frame,
    or the connection failing)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def configure(sock: socket.socket) -> None:
    """No Nagle delay (a step is one small write each way), and keepalive probes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def write_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(len(payload), kind) + payload)


def error_payload(code: grpc.StatusCode, message: str) -> bytes:
    return f"{code.name}\n{message}".encode()


def error_from_payload(payload: bytes) -> StepStreamError:
    name, _, message = payload.decode(errors="replace").partition("\n")
    code = getattr(grpc.StatusCode, name, None)
    if not isinstance(code, grpc.StatusCode):
        return StepStreamError(grpc.StatusCode.UNKNOWN, f"{name}: {message}")
    return StepStreamError(code, message)


def session_id_from_hello(payload: bytes) -> str:
    """The session id of a HELLO frame's payload; WireError when it is not one."""
    text = payload.decode(errors="replace")
    if not text.startswith(HELLO_PREFIX):
        raise WireError(f"not a specdec step stream (expected a {HELLO_PREFIX.strip()!r} hello)")
    return text[len(HELLO_PREFIX) :]


class FrameReader:
    """Reads frames off one socket, with as few recv calls as it can (a header and a small payload: one)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buffer = bytearray()

    def read(self) -> tuple[int, bytes] | None:
        """The next frame as (kind, payload); None when the connection ends between frames. ClosedMidFrame when
        it ends inside one, WireError for a frame over the limit; OSError from the socket."""
        if not self._fill(HEADER.size):
            if self._buffer:
                raise ClosedMidFrame("the connection closed mid-frame")
            return None
        length, kind = HEADER.unpack_from(self._buffer)
        if length > MAX_PAYLOAD_BYTES:
            raise WireError(f"a frame of {length} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")
        if not self._fill(HEADER.size + length):
            raise ClosedMidFrame("the connection closed mid-frame")
        payload = bytes(self._buffer[HEADER.size : HEADER.size + length])
        del self._buffer[: HEADER.size + length]
        return kind, payload

    def _fill(self, size: int) -> bool:
        """Reads until the buffer holds `size` bytes; False at the end of the connection."""
        while len(self._buffer) < size:
            chunk = self._sock.recv(max(size - len(self._buffer), 1 << 16))
            if not chunk:
                return False
            self._buffer += chunk
        return True
