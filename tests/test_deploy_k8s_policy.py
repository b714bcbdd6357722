"""Kubernetes manifests, base and TLS overlay: the "restricted" Pod Security Standard, read-only root
filesystems with writable caches, explicit pull policies, the recommended labels, and the NetworkPolicy
that lets only the scheduler reach the workers.

The Pod Security Standard check is written from its "restricted" profile (which includes "baseline"):
https://kubernetes.io/docs/concepts/security/pod-security-standards/
"""

import copy
import re
import tomllib

import pytest
import yaml

from specdec.cli import build_parser
from tests.test_deploy import K8S_MANIFESTS, ROOT, dockerfile_cache_dirs
from tests.test_deploy_tls import overlay_objects

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
PROFILE_TYPES = {"RuntimeDefault", "Localhost"}  # seccomp (required) and AppArmor (when set)
IMAGE_UID = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _base_objects() -> dict[tuple[str, str], dict]:
    return {
        (d["kind"], d["metadata"]["name"]): d
        for path in K8S_MANIFESTS
        for d in yaml.safe_load_all(path.read_text())
        if d
    }


OBJECT_SETS = {"base": _base_objects, "tls": overlay_objects}
STEP_PORT = 50053  # the workers' --step-port in deploy/k8s/worker.yaml


def _workloads(objects: dict) -> list[dict]:
    return [doc for doc in objects.values() if "template" in doc.get("spec", {})]


def _containers(pod_spec: dict) -> list[dict]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod_spec.get(key, [])]


def _pod_violations(template: dict) -> list[str]:
    """Pod-level rules: host namespaces, volume types, sysctls, the pod securityContext."""
    spec, context = template["spec"], template["spec"].get("securityContext", {})
    problems = [f"{field}: true" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    problems += [
        f"volume {v['name']}: type {sorted(set(v) - {'name'})}"
        for v in spec.get("volumes", [])
        if not set(v) - {"name"} <= RESTRICTED_VOLUME_TYPES
    ]
    problems += [f"sysctl {s['name']}" for s in context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    problems += [
        f"annotation {key}"
        for key, value in template["metadata"].get("annotations", {}).items()
        if key.startswith("container.apparmor.security.beta.kubernetes.io/")
        and not (value == "runtime/default" or value.startswith("localhost/"))
    ]
    if context.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    return problems


def _container_violations(container: dict, pod_context: dict) -> list[str]:
    """Container rules, with the pod securityContext's values where the container sets none."""
    own = container.get("securityContext", {})
    effective = {**pod_context, **own}
    capabilities = own.get("capabilities", {})
    checks = {
        "privileged": not own.get("privileged"),
        "allowPrivilegeEscalation false": own.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": "ALL" in capabilities.get("drop", []),
        "capabilities add only NET_BIND_SERVICE": set(capabilities.get("add", [])) <= {"NET_BIND_SERVICE"},
        "runAsNonRoot true": effective.get("runAsNonRoot") is True,
        "runAsUser not 0": effective.get("runAsUser") != 0,
        "seccompProfile RuntimeDefault/Localhost": effective.get("seccompProfile", {}).get("type") in PROFILE_TYPES,
        "appArmorProfile": effective.get("appArmorProfile", {"type": "RuntimeDefault"})["type"] in PROFILE_TYPES,
        "seLinuxOptions": effective.get("seLinuxOptions", {}).get("type") in SELINUX_TYPES
        and not {"user", "role"} & set(effective.get("seLinuxOptions", {})),
        "procMount Default": own.get("procMount", "Default") == "Default",
        "hostProcess": not effective.get("windowsOptions", {}).get("hostProcess"),
        "no hostPort": not any(port.get("hostPort") for port in container.get("ports", [])),
    }
    return [f"{container['name']}: {rule}" for rule, ok in checks.items() if not ok]


def restricted_violations(template: dict) -> list[str]:
    """What in a pod template breaks the "restricted" Pod Security Standard; empty when it passes."""
    pod_context = template["spec"].get("securityContext", {})
    return _pod_violations(template) + [
        problem
        for container in _containers(template["spec"])
        for problem in _container_violations(container, pod_context)
    ]


@pytest.mark.parametrize("objects", OBJECT_SETS)
def test_pods_pass_the_restricted_pod_security_standard(objects):
    workloads = _workloads(OBJECT_SETS[objects]())
    assert {w["kind"] for w in workloads} == {"StatefulSet", "Deployment"}
    for workload in workloads:
        template = workload["spec"]["template"]
        assert restricted_violations(template) == [], workload["metadata"]["name"]
        context = template["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == IMAGE_UID
        for container in _containers(template["spec"]):  # every one, init containers too
            assert container["imagePullPolicy"] in ("IfNotPresent", "Always", "Never"), container["name"]
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
            }


def _worker_template() -> dict:
    return _base_objects()[("StatefulSet", "specdec-worker")]["spec"]["template"]


def _container_context(template: dict, name: str) -> dict:
    return next(c for c in _containers(template["spec"]) if c["name"] == name).setdefault("securityContext", {})


MUTATIONS = {
    "privileged": lambda t: _container_context(t, "worker").update(privileged=True),
    "escalation": lambda t: _container_context(t, "seed-models").update(allowPrivilegeEscalation=True),
    "capabilities kept": lambda t: _container_context(t, "worker").update(capabilities={}),
    "SYS_ADMIN": lambda t: _container_context(t, "worker").update(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    "root": lambda t: _container_context(t, "worker").update(runAsUser=0),
    "unconfined": lambda t: _container_context(t, "worker").update(seccompProfile={"type": "Unconfined"}),
    "no seccomp": lambda t: t["spec"]["securityContext"].pop("seccompProfile"),
    "may run as root": lambda t: [
        t["spec"]["securityContext"].pop("runAsNonRoot"),
        _container_context(t, "seed-models").pop("runAsNonRoot"),
    ],
    "hostPath": lambda t: t["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
    "hostNetwork": lambda t: t["spec"].update(hostNetwork=True),
    "hostPort": lambda t: _containers(t["spec"])[1]["ports"][0].update(hostPort=50052),
    "sysctl": lambda t: t["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_restricted_check_catches_a_violation(mutation):
    """Guards the check above: each rule it implements must fire on a pod that breaks it."""
    template = copy.deepcopy(_worker_template())
    assert restricted_violations(template) == []
    MUTATIONS[mutation](template)
    assert restricted_violations(template), mutation


@pytest.mark.parametrize("objects", OBJECT_SETS)
def test_no_service_link_variables(objects):
    """Every flag reads SPECDEC_<FLAG>: Kubernetes' service-link variables (a Service named `specdec` sets
    SPECDEC_PORT=tcp://...) must not reach the processes."""
    for workload in _workloads(OBJECT_SETS[objects]()):
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False, workload["metadata"]["name"]


@pytest.mark.parametrize("objects", OBJECT_SETS)
def test_processes_write_only_to_volumes(objects):
    """The root filesystem is read-only: /tmp and every cache the image sets lie on a writable volume."""
    caches = dockerfile_cache_dirs()
    for workload in _workloads(OBJECT_SETS[objects]()):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
            # The scheduler only reads the model baked into the image (SPECDEC_CACHE_DIR, /models).
            wanted = {
                "/tmp",
                *(
                    path
                    for name, path in caches.items()
                    if not (name == "SPECDEC_CACHE_DIR" and workload["kind"] == "Deployment")
                ),
            }
            for path in wanted:
                assert any(path == w or path.startswith(w + "/") for w in writable), (container["name"], path)


def _selector_labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specdec",
        "app.kubernetes.io/instance": "specdec",
        "app.kubernetes.io/component": component,
    }


def _recommended_labels(component: str) -> dict[str, str]:
    return {
        **_selector_labels(component),
        "app.kubernetes.io/part-of": "specdec",
        "app.kubernetes.io/version": VERSION,
        "app.kubernetes.io/managed-by": "kustomize",
    }


@pytest.mark.parametrize("objects", OBJECT_SETS)
def test_objects_carry_the_recommended_labels_and_stable_selectors(objects):
    for (kind, name), doc in OBJECT_SETS[objects]().items():
        component = name.removeprefix("specdec-")
        assert doc["metadata"]["labels"] == _recommended_labels(component), (kind, name)
        spec = doc["spec"]
        selector = spec.get("podSelector") or spec["selector"]
        assert selector.get("matchLabels", selector) == _selector_labels(component), (kind, name)
        if "template" in spec:
            assert spec["template"]["metadata"]["labels"] == _recommended_labels(component)
            for constraint in spec["template"]["spec"].get("topologySpreadConstraints", []):
                assert constraint["labelSelector"]["matchLabels"] == _selector_labels(component)


@pytest.mark.parametrize("objects", OBJECT_SETS)
def test_network_policy_lets_only_the_scheduler_reach_the_workers(objects):
    docs = OBJECT_SETS[objects]()
    (policy,) = [doc for (kind, _), doc in docs.items() if kind == "NetworkPolicy"]
    workers, scheduler = docs[("StatefulSet", "specdec-worker")], docs[("Deployment", "specdec-scheduler")]
    worker_container = workers["spec"]["template"]["spec"]["containers"][0]
    worker_args = build_parser().parse_args(worker_container["args"])
    worker_port = worker_args.port
    spec = policy["spec"]
    # It selects the worker pods; an ingress-only policy: what it does not allow is dropped.
    assert spec["podSelector"]["matchLabels"].items() <= workers["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # the scheduler pods of this namespace, nothing else
    assert peer["podSelector"]["matchLabels"].items() <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    assert not peer["podSelector"]["matchLabels"].items() <= workers["spec"]["template"]["metadata"]["labels"].items()
    # The gRPC port and the step socket's (the base's workers have one; the tls overlay's do not listen there).
    assert rule["ports"] == [{"protocol": "TCP", "port": worker_port}, {"protocol": "TCP", "port": STEP_PORT}]
    assert worker_args.step_port == (STEP_PORT if objects == "base" else None)
    if worker_args.step_port:
        assert {"name": "steps", "containerPort": STEP_PORT} in worker_container["ports"]
    assert docs[("Service", "specdec-worker")]["spec"]["ports"][0]["port"] == worker_port
