"""The scheduler process: join the workers, serve the client API until SIGTERM."""

import logging
import signal
import threading

from scheduler_service.cluster import Cluster
from scheduler_service.membership import Membership, parse_worker_spec
from scheduler_service.metrics import cluster_registry
from scheduler_service.options import SchedulerOptions
from scheduler_service.server import create_server, set_serving
from scheduler_service.tokenizer import ChatTokenizer
from specdec.metrics_server import start_metrics_server

logger = logging.getLogger(__name__)


def run_scheduler(opts: SchedulerOptions, stop: threading.Event | None = None) -> int:
    """Serves until SIGTERM/SIGINT (or `stop`). Prints `scheduler listening on HOST:PORT` once bound.

    Health is SERVING while at least one worker serves.
    """
    stop = stop or threading.Event()
    membership = Membership([parse_worker_spec(a) for a in opts.worker_addresses])
    tokenizer = ChatTokenizer(opts.model_dir)
    server, servicer, health_servicer, port = create_server(opts.host, opts.port)
    print(f"scheduler listening on {opts.host}:{port}", flush=True)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(opts, membership, tokenizer, lambda is_serving: set_serving(health_servicer, is_serving))
    try:
        metrics_server = (start_metrics_server(cluster_registry(cluster), opts.host, opts.metrics_port, "scheduler")
                          if opts.metrics_port else None)
    except OSError:
        server.stop(grace=None)
        raise
    cluster.start()
    try:
        facts = cluster.wait_for_facts(opts.first_worker_timeout_s)
    except TimeoutError:
        server.stop(grace=None)
        cluster.stop()
        _stop_metrics(metrics_server)
        raise
    servicer.attach(cluster, tokenizer)
    logger.info("serving %s from %s; %s scheduling", facts.model_id, ", ".join(opts.worker_addresses),
                facts.config.scheduling)
    print("scheduler ready", flush=True)
    while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    server.stop(grace=5).wait()
    cluster.stop()
    _stop_metrics(metrics_server)
    return 0


def _stop_metrics(metrics_server) -> None:
    if metrics_server is not None:
        metrics_server.shutdown()
