"""The worker process: listen first (health NOT_SERVING), load the models, serve until SIGTERM."""

import logging
import os
import threading
import time

import grpc

from specdec.announce import announce
from specdec.metrics_server import start_metrics_server
from specdec.stop_signals import StopSignals
from worker_service.serving.server import create_server
from worker_service.serving.step_socket import serve_steps
from worker_service.speculation.build import build_worker
from worker_service.speculation.config import WorkerConfig

logger = logging.getLogger(__name__)

SHUTDOWN_STEP_WAIT_S = 60.0  # the longest a step (a long prefill on a CPU) may take to finish on SIGTERM
PARENT_GONE_EXIT_S = 5.0  # once the parent is gone, the longest the orderly shutdown may take


def run_worker(
    config: WorkerConfig,
    host: str,
    port: int,
    ready_line: bool = True,
    credentials: grpc.ServerCredentials | None = None,
    metrics_port: int = 0,
    parent_fd: int | None = None,
    step_port: int | None = None,
) -> int:
    """Serves until SIGTERM/SIGINT. Prints `worker listening on HOST:PORT` once bound.

    credentials: TLS on the port (specdec.security.server_credentials; with a CA only clients with a
    certificate it signed get in); None: plaintext. metrics_port: Prometheus metrics at
    http://HOST:PORT/metrics (0: off). parent_fd: the read end of a pipe that the parent process holds
    open (`specdec serve`); end of file on it means the parent is gone, and the worker exits. step_port: also
    serve the step stream on a bare socket at HOST:step_port (0: any free port; step_socket.py), plaintext
    only; None: not.
    """
    if parent_fd is not None:
        os.fstat(parent_fd)  # OSError (EBADF) at once for a descriptor this process did not inherit
    if step_port is not None and credentials is not None:
        raise ValueError("--step-port serves the step stream in plaintext: it cannot go with TLS (--ssl-*)")
    server, servicer, bound_port = create_server(host, port, credentials=credentials)
    logger.info("%s on %s:%d", "plaintext" if credentials is None else "TLS", host, bound_port)
    step_server = metrics_server = None
    try:
        if step_port is not None:
            step_server = serve_steps(servicer, host, step_port)
            logger.info("step stream also on a bare socket at %s:%d", host, step_server.port)
        if metrics_port:
            metrics_server = start_metrics_server(servicer.metrics.registry, host, metrics_port, "worker")
    except OSError:
        if step_server is not None:
            step_server.stop()
        server.stop(grace=None)
        raise
    announce(f"worker listening on {host}:{bound_port}")
    stop = threading.Event()  # set by the parent watch (a thread)
    signals = StopSignals()
    if parent_fd is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_fd, stop), name="parent-watch", daemon=True).start()
    try:
        worker = servicer.run_compute(build_worker, config)  # torch stays on the compute thread
    except Exception:
        if step_server is not None:
            step_server.stop()
        server.stop(grace=None)
        raise
    servicer.set_worker(worker, config.model)
    if ready_line:
        announce("worker model loaded")
    signals.wait(stop)
    # Finish the step in flight and end the step stream: the scheduler moves the requests elsewhere.
    logger.info("shutting down: finishing the step in flight")
    servicer.begin_shutdown()  # no step starts from now on
    try:
        servicer.compute.submit(lambda: None).result(timeout=SHUTDOWN_STEP_WAIT_S)  # the step in flight is done
    except TimeoutError:
        logger.warning("the step in flight did not finish within %.0f s", SHUTDOWN_STEP_WAIT_S)
    if step_server is not None:
        step_server.stop()  # its result goes out; the scheduler then moves the session's requests
    server.stop(grace=1).wait()  # the same for a gRPC stream
    servicer.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    return 0


def _exit_with_parent(parent_fd: int, stop: threading.Event) -> None:
    """Blocks until the parent's end of the pipe closes (it exited, however it died), then shuts down: in
    order if that is quick, else at once (a model still loading, a step that does not end)."""
    while os.read(parent_fd, 1):  # nothing is ever written; b"" is end of file
        pass
    logger.warning("the process that started this worker is gone: shutting down")
    stop.set()
    time.sleep(PARENT_GONE_EXIT_S)
    logger.error("the shutdown took over %.0f s: exiting now", PARENT_GONE_EXIT_S)
    os._exit(1)
