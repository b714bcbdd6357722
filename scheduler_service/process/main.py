"""The scheduler process: join the workers, serve the client APIs (gRPC, and HTTP with --http-port) until
SIGTERM, then drain.

Drain (both APIs): health turns NOT_SERVING (HTTP /health: 503) at once (load balancers stop sending), new
calls get UNAVAILABLE, running requests may finish for the shutdown grace
period; what is left then ends with UNAVAILABLE, and the process exits 0.
"""

import logging
import threading
import time

from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.membership import Membership, parse_worker_spec
from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.frontends.auth import security_hooks
from scheduler_service.frontends.frontend import Frontend
from scheduler_service.frontends.http_server import HttpServer
from scheduler_service.frontends.openai_api import create_app
from scheduler_service.frontends.server import create_server
from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.process.metrics import RequestMetrics, cluster_registry
from scheduler_service.process.stats_logger import StatsLogger
from specdec.announce import announce
from specdec.metrics_server import start_metrics_server
from specdec.stop_signals import StopSignals

logger = logging.getLogger(__name__)


def run_scheduler(opts: SchedulerOptions, stop: threading.Event | None = None) -> int:
    """Serves until SIGTERM/SIGINT (or `stop`). Prints `scheduler listening on HOST:PORT` once bound, and
    `http listening on HOST:PORT` for the HTTP API (--http-port).

    Health is SERVING once a worker has described the model (a request would be admitted) and while at
    least one worker serves.
    """
    stop = stop or threading.Event()
    membership = Membership([parse_worker_spec(a) for a in opts.worker_addresses])
    tokenizer = ChatTokenizer(opts.model_dir, opts.chat_template)
    server, servicer, port = create_server(opts.host, opts.port, opts.max_open_streams, **security_hooks(opts))
    announce(f"scheduler listening on {opts.host}:{port}")
    signals = StopSignals()  # only on the main thread (tests run the scheduler on others, with `stop`)
    stoppers = [lambda: server.stop(grace=None)]  # what has started, stopped last first if starting fails
    try:
        http = _start_http(servicer.frontend, opts)
        if http is not None:
            stoppers.append(http.stop)
        request_metrics = RequestMetrics()
        servicer.frontend.on_constraint_compiled.append(request_metrics.on_constraint_compiled)
        cluster = Cluster(opts, membership, tokenizer, servicer.set_serving, request_metrics)
        metrics_server = (
            start_metrics_server(
                cluster_registry(cluster.snapshot, request_metrics), opts.host, opts.metrics_port, "scheduler"
            )
            if opts.metrics_port
            else None
        )
        stoppers.append(lambda: _stop_metrics(metrics_server))
        cluster.start()
        stoppers.append(cluster.stop)
        facts = cluster.wait_for_facts(opts.first_worker_timeout_s)
    except BaseException:
        for stopper in reversed(stoppers):
            stopper()
        raise
    servicer.attach(cluster, tokenizer)
    logger.info(
        "serving %s (%s) from %s; %s scheduling",
        facts.served_model_name,
        facts.model_id,
        ", ".join(opts.worker_addresses),
        facts.config.scheduling,
    )
    announce("scheduler ready")
    stats_logger = StatsLogger(cluster.snapshot, opts.log_stats_interval_s)
    stats_logger.start()
    signals.wait(stop)
    drain(servicer, cluster, opts.shutdown_grace_period_s)
    stats_logger.stop()
    stopped = server.stop(grace=2)  # the last messages (aborts included) go out
    if http is not None:
        http.stop()
    stopped.wait()
    _stop_metrics(metrics_server)
    return 0


def _start_http(frontend: Frontend, opts: SchedulerOptions) -> HttpServer | None:
    """The OpenAI-compatible HTTP API on --http-port (None when 0), sharing the gRPC API's Frontend."""
    if not opts.http_port:
        return None
    http = HttpServer(create_app(frontend, opts.api_keys), opts.host, opts.http_port, opts.client_tls)
    http.start()
    logger.info(
        "HTTP API: %s; API keys: %s",
        "TLS" if opts.client_tls.is_enabled else "plaintext",
        "required" if opts.api_keys else "not required",
    )
    announce(f"http listening on {opts.host}:{http.port}")
    return http


def _stop_metrics(metrics_server) -> None:
    if metrics_server is not None:
        metrics_server.shutdown()


def drain(servicer, cluster: Cluster, grace_period_s: float) -> None:
    """Stops taking requests, lets the running ones finish for up to the grace period, then aborts the rest."""
    servicer.begin_drain()
    num_live = cluster.num_live_requests
    logger.info("shutting down: %d requests running; they may finish for %.0f s", num_live, grace_period_s)
    deadline = time.monotonic() + grace_period_s
    while cluster.num_live_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    num_left = cluster.num_live_requests
    if num_left:
        logger.warning("shutdown grace period over: %d requests aborted", num_left)
    cluster.stop(
        f"the scheduler shut down: the request did not finish within the shutdown grace period ({grace_period_s:.0f} s)"
    )
