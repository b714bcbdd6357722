"""The worker process: listen first (health NOT_SERVING), load the models, serve until SIGTERM."""

import logging
import signal
import threading

import torch

from specdec.metrics_server import start_metrics_server
from worker_service.config import WorkerConfig
from worker_service.model_loader import load_model
from worker_service.model_runner import ModelRunner
from worker_service.server import create_server
from worker_service.worker import Worker

logger = logging.getLogger(__name__)


def build_worker(config: WorkerConfig) -> Worker:
    """Loads the target (and draft) model and wraps them in a Worker."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    target = ModelRunner(load_model(config.model, config.dtype))
    draft = None
    if config.proposer == "draft":
        draft = ModelRunner(load_model(config.draft_model, config.dtype))
    return Worker(config, target, draft)


def run_worker(config: WorkerConfig, host: str, port: int, ready_line: bool = True, metrics_port: int = 0) -> int:
    """Serves until SIGTERM/SIGINT. Prints `worker listening on HOST:PORT` once bound.

    metrics_port: Prometheus metrics at http://HOST:PORT/metrics (0: off).
    """
    server, servicer, bound_port = create_server(host, port)
    try:
        metrics_server = (start_metrics_server(servicer.metrics.registry, host, metrics_port, "worker")
                          if metrics_port else None)
    except OSError:
        server.stop(grace=None)
        raise
    print(f"worker listening on {host}:{bound_port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        worker = servicer.run_compute(build_worker, config)  # torch stays on the compute thread
    except Exception:
        server.stop(grace=None)
        raise
    servicer.set_worker(worker, config.model)
    if ready_line:
        print("worker model loaded", flush=True)
    while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    logger.info("shutting down")
    server.stop(grace=5).wait()
    servicer.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    return 0
