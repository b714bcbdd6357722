"""The Prometheus HTTP endpoint both services start with `--metrics-port` (each with its own registry)."""

import logging
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)


def check_metrics_port(port: int, flag: str = "--metrics-port") -> None:
    """Raises ValueError unless 0 (off) <= port <= 65535."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be a port in 0..65535 (0: off), got {port!r}")


def start_metrics_server(registry: CollectorRegistry, host: str, port: int, who: str) -> WSGIServer:
    """Serves `registry` at http://HOST:PORT/metrics on a daemon thread (port 0: any free port).

    Stop it with `.shutdown()`; `.server_port` is the bound port. Raises OSError when the port is taken.
    """
    # One series per metric, as vLLM: no `_created` gauges beside every counter and histogram.
    prometheus_client.disable_created_metrics()
    server, _ = prometheus_client.start_http_server(port, addr=host, registry=registry)
    logger.info("%s metrics on http://%s:%d/metrics", who, host, server.server_port)
    return server
