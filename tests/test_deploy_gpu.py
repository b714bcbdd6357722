"""Deployment files for GPU workers: compose.gpu.yaml and the deploy/k8s/gpu overlay are valid, give each
worker a GPU and the GPU image, and run it on CUDA with the flags the worker parses; the scheduler is unchanged.
Checked offline, as tests/test_deploy.py does (no Docker engine, no cluster, no GPU)."""

import json

import yaml

from specdec.cli import build_parser
from tests.test_deploy import K8S, _container, _docker_compose, _k8s_docs, _kubernetes_validate
from tests.test_deploy_tls import overlay_objects

FILES = ("compose.yaml", "compose.gpu.yaml")


def test_compose_gpu_override_reserves_a_gpu_and_runs_the_worker_on_cuda():
    assert _docker_compose("config", "-q", files=FILES).returncode == 0
    result = _docker_compose("config", "--format", "json", files=FILES)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    worker = services["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert worker["image"] == "specdec:gpu" and worker["build"]["args"] == {"EXTRAS": "gpu", "TORCH_INDEX_URL": ""}
    args = build_parser().parse_args(worker["command"])
    assert (args.device, args.dtype, args.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9)
    assert args.batch_invariant  # lossless at any batch, the default
    plain = json.loads(_docker_compose("config", "--format", "json").stdout)["services"]
    assert worker["command"][: len(plain["worker"]["command"])] == plain["worker"]["command"]  # only adds flags
    assert services["scheduler"] == plain["scheduler"]
    env = {"SPECDEC_GPU_MEMORY_UTILIZATION": "0.45", "SPECDEC_GPU_COUNT": "2"}
    shared = json.loads(_docker_compose("config", "--format", "json", files=FILES, env=env).stdout)["services"]
    assert build_parser().parse_args(shared["worker"]["command"]).gpu_memory_utilization == 0.45
    assert shared["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2


def test_k8s_gpu_overlay_validates_and_gives_each_worker_a_gpu(tmp_path):
    objects = overlay_objects(K8S / "gpu")
    merged = tmp_path / "gpu.yaml"
    merged.write_text(yaml.safe_dump_all(objects.values()))
    result = _kubernetes_validate(merged)
    assert result.returncode == 0, result.stdout + result.stderr
    worker = objects["StatefulSet", "specdec-worker"]
    container = _container(worker)
    assert container["image"] == "specdec:gpu" and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    tolerations = worker["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    args = build_parser().parse_args(container["args"])
    assert (args.device, args.dtype, args.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9)
    plain_args = _container(_k8s_docs("worker.yaml")["StatefulSet"])["args"]
    assert container["args"][: len(plain_args)] == plain_args  # only adds flags
    assert objects["Deployment", "specdec-scheduler"] == _k8s_docs("scheduler.yaml")["Deployment"]  # unchanged
