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
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
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
            _hang_up(conn)

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
        try:
            step_wire.configure(conn)
            self._stream(conn)
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
            _hang_up(conn)

    def _stream(self, conn: socket.socket) -> None:
        reader = step_wire.FrameReader(conn)
        conn.settimeout(HELLO_TIMEOUT_S)
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

        def requests() -> Iterator[worker_pb2.ExecuteModelRequest]:  # on the servicer's step-reader thread
            try:
                while (frame := reader.read()) is not None:
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
            except OSError:
                pass  # reset, or a keepalive timeout: as good as closed
            abandoned.set()

        for response in self._run_session(session_id, requests(), lambda: not abandoned.is_set()):
            step_wire.write_frame(conn, step_wire.RESULT, response.SerializeToString())


def _send_error(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    with contextlib.suppress(OSError):
        step_wire.write_frame(conn, step_wire.ERROR, step_wire.error_payload(code, message))


def _hang_up(conn: socket.socket) -> None:
    """Closes a connection that another thread may be reading (shutdown wakes it: close alone would not)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()
