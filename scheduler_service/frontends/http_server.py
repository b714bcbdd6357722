"""uvicorn serving the HTTP API on its own thread (its own event loop) inside the scheduler process.

The listening socket is bound here, before uvicorn starts, so that a port in
use fails at once with OSError (as the gRPC port does) and the bound port is
known. With TLS on the client port, the HTTP port uses the same files (and,
with --ssl-ca-certs, requires client certificates the same way).
"""

import logging
import socket
import ssl
import threading
import time

import uvicorn

from specdec.security import TlsFiles

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = 2  # connections still open at stop (the drain is over) get this long


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror or exc}") from exc


class HttpServer:
    """An ASGI app served by uvicorn on HOST:PORT from a daemon thread; start() once, stop() once."""

    def __init__(self, app, host: str, port: int, tls: TlsFiles = TlsFiles()):
        self.host = host
        self._socket = _listen(host, port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="auto",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ssl_certfile=tls.certfile,
            ssl_keyfile=tls.keyfile,
            ssl_ca_certs=tls.ca_certs,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.requires_client_cert else ssl.CERT_NONE,
        )
        try:
            config.load()  # builds the TLS context now: a bad file fails here, not on the thread
        except (OSError, ssl.SSLError):
            self._socket.close()
            raise
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="http", daemon=True
        )

    def start(self) -> None:
        """Starts serving; returns once uvicorn accepts connections (RuntimeError if it does not)."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stops accepting, gives open connections GRACEFUL_SHUTDOWN_S, and waits for the thread."""
        self._server.should_exit = True
        self._thread.join(GRACEFUL_SHUTDOWN_S + 5)
        self._socket.close()
