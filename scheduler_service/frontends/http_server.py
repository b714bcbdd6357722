"""uvicorn serving the HTTP API on its own thread (its own event loop) inside the scheduler process.

The listening socket is bound here, before uvicorn starts, so that a port in
use fails at once with OSError (as the gRPC port does) and the bound port is
known. With TLS on the client port, the HTTP port uses the same files (and,
with --ssl-ca-certs, requires client certificates the same way).
"""

import asyncio
import contextlib
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


class _Server(uvicorn.Server):
    """uvicorn's server with its housekeeping tick once a second, not ten times.

    uvicorn's main loop wakes every 0.1 s to refresh the Date header (once a second) and to check whether to
    exit. Those wake-ups were half the CPU an idle scheduler took: 9 of its 20 clock ticks in 30 s on the
    Intel kind (docs/benchmarks.md). Here the tick comes each second, refreshing the header every time, and
    stop() wakes the loop at once through wake().
    """

    TICK_S = 1.0

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        should_exit = await self.on_tick(0)
        while not should_exit:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.TICK_S)
            should_exit = await self.on_tick(0)  # counter 0: the Date header is refreshed at every tick

    def wake(self) -> None:
        """Ends the current wait of the main loop (from any thread); nothing before it runs or after it ends."""
        loop = getattr(self, "_loop", None)
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(self._wake.set)


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
        self._server = _Server(config)
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
        self._server.wake()
        self._thread.join(GRACEFUL_SHUTDOWN_S + 5)
        self._socket.close()
