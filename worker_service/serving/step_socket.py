"""The step stream on a bare TCP socket beside the gRPC port (the worker's --step-port; specdec/step_wire.py).

One thread accepts; each connection gets a thread that reads its HELLO,
then hands the steps to run_session (the servicer's: the session gate, the
step-reader thread, the compute thread, as for gRPC's ExecuteModel) and
writes each result as it comes. A connection that closes without END
abandons its steps, as a cancelled gRPC call does; a StepAbort becomes an
ERROR frame with gRPC's status code.
"""

import contextlib
import logging
import socket
import threading
import time
from typing import Callable, Iterator

from google.protobuf.message import DecodeError
import grpc

from specdec import step_wire
from specdec.v1 import worker_pb2
from worker_service.serving.session import StepAbort

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection that does not say hello by then is dropped
STOP_GRACE_S = 1.0  # on stop, how long results in flight may take to go out

# (session id, ExecuteModelRequest messages, is the stream still active) -> ExecuteModelResponse messages
RunSession = Callable[[str, Iterator[worker_pb2.ExecuteModelRequest], Callable[[], bool]], Iterator]


class StepSocketServer:
    """Listens on host:port (0: any free port; `port` is the bound one) and serves step streams until stop()."""

    def __init__(self, host: str, port: int, run_session: RunSession):
        host = host.strip("[]")  # gRPC's "[::]" is socket's "::"
        if ":" in host:  # on "::" both IPv6 and IPv4, as gRPC's port listens
            dualstack = host == "::" and socket.has_dualstack_ipv6()
            self._listener = socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=dualstack)
        else:
            self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self._run_session = run_session
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._is_stopped = False
        self.num_streams = 0  # step streams admitted so far (a HELLO read)
        self._accepting = threading.Thread(target=self._accept, name="step-socket", daemon=True)
        self._accepting.start()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stops listening; the open streams' results in flight go out (within grace_s), then they close."""
        with self._lock:
            self._is_stopped = True
            connections = dict(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        self._accepting.join(STOP_GRACE_S)
        deadline = time.monotonic() + grace_s
        for conn, thread in connections.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # its thread ends the stream and closes it

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # stop() closed the listener
            with self._lock:
                if self._is_stopped:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn, peer), name="step-stream", daemon=True)
                self._connections[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        reading = threading.Lock()  # held while a thread reads conn: it is closed only when none does
        try:
            step_wire.configure(conn)
            self._stream(conn, reading)
        except StepAbort as exc:
            _send_error(conn, exc.code, exc.message)
        except step_wire.WireError as exc:
            logger.warning("step stream from %s broke the framing: %s", peer, exc)
            _send_error(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError:
            pass  # the scheduler's side is gone: nothing to tell it
        except Exception as exc:  # noqa: BLE001 - a bug: the stream ends with INTERNAL, the worker serves on
            logger.exception("step stream from %s failed", peer)
            _send_error(conn, grpc.StatusCode.INTERNAL, f"the worker's step stream failed: {exc!r}")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            _hang_up(conn, reading)

    def _stream(self, conn: socket.socket, reading: threading.Lock) -> None:
        reader = step_wire.FrameReader(conn)
        conn.settimeout(HELLO_TIMEOUT_S)
        with reading:
            frame = reader.read()
        conn.settimeout(None)
        if frame is None:
            return
        kind, payload = frame
        if kind != step_wire.HELLO:
            raise step_wire.WireError(f"the first frame must be a hello, got kind {kind}")
        session_id = step_wire.session_id_from_hello(payload)
        with self._lock:
            self.num_streams += 1
        abandoned = threading.Event()  # the scheduler closed the connection without END

        def read() -> tuple[int, bytes] | None:
            with reading:
                return reader.read()

        def requests() -> Iterator[worker_pb2.ExecuteModelRequest]:  # on the servicer's step-reader thread
            try:
                while (frame := read()) is not None:
                    kind, payload = frame
                    if kind == step_wire.END:
                        return
                    if kind != step_wire.STEP:
                        raise step_wire.WireError(f"expected a step or the end, got frame kind {kind}")
                    try:
                        request = worker_pb2.ExecuteModelRequest.FromString(payload)
                    except DecodeError as exc:
                        raise step_wire.WireError(f"a step that does not parse: {exc}") from None
                    yield request
            except (OSError, step_wire.ClosedMidFrame):
                pass  # reset, a keepalive timeout, or closed mid-frame: the scheduler is gone
            abandoned.set()

        for response in self._run_session(session_id, requests(), lambda: not abandoned.is_set()):
            step_wire.write_frame(conn, step_wire.RESULT, response.SerializeToString())


def serve_steps(servicer, host: str, port: int) -> StepSocketServer:
    """A StepSocketServer on host:port (0: any free port) for `servicer.run_session`, its bound port set as
    `servicer.step_port`, which Describe advertises."""
    server = StepSocketServer(host, port, servicer.run_session)
    servicer.step_port = server.port
    return server


def _send_error(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    with contextlib.suppress(OSError):
        step_wire.write_frame(conn, step_wire.ERROR, step_wire.error_payload(code, message))


def _hang_up(conn: socket.socket, reading: threading.Lock) -> None:
    """Closes a connection that another thread may be reading: shutdown wakes that thread (close alone would
    not), and the descriptor is closed once it has let go (closed under a reader, its number could be reused by
    the next connection meanwhile). A reader that comes after finds the socket closed (OSError): the end."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    if reading.acquire(timeout=STOP_GRACE_S):
        try:
            conn.close()
        finally:
            reading.release()
