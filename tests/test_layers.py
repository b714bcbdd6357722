"""The import layers contract ([tool.importlinter] in pyproject.toml) holds, and it has teeth."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler_service", "worker_service", "draft_training", "specdec", "kernels")


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", "--no-logo"],
        cwd=root,
        env={"PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "importer, back_import, contract",
    [
        # The circle this layout broke: the cluster reading the process's metrics.
        (
            "scheduler_service/cluster/cluster.py",
            "from scheduler_service.process.metrics import RequestMetrics",
            "scheduler: process -> front ends -> cluster -> core BROKEN",
        ),
        # An engine calling its cluster directly instead of through its hooks.
        (
            "scheduler_service/cluster/engine.py",
            "from scheduler_service.cluster.cluster import Cluster",
            "cluster: placement -> watchdog, handles -> engine -> its parts BROKEN",
        ),
        ("scheduler_service/core/scheduler.py", "import grpc", "imports no torch"),
        (
            "scheduler_service/core/request.py",
            "from worker_service.speculation.config import WorkerConfig",
            "the scheduler and the worker never import each other BROKEN",
        ),
        # The model runtime reaching up into speculation (the device deciding by a WorkerConfig).
        (
            "worker_service/runtime/device.py",
            "from worker_service.speculation.config import WorkerConfig",
            "worker: serving -> speculation -> runtime BROKEN",
        ),
        # Speculation reaching up into the gRPC server.
        (
            "worker_service/speculation/worker.py",
            "from worker_service.serving.metrics import WorkerMetrics",
            "worker: serving -> speculation -> runtime BROKEN",
        ),
        (
            "worker_service/serving/main.py",
            "from draft_training.recipe import TrainConfig",
            "serving never imports the training package BROKEN",
        ),
        (
            "specdec/step.py",
            "from worker_service.runtime.dtypes import DTYPE_NAMES",
            "the CLI alone imports both BROKEN",
        ),
    ],
)
def test_a_back_import_breaks_a_contract(tmp_path, importer, back_import, contract):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    source = tmp_path / importer
    source.write_text(source.read_text() + f"\n{back_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert contract in " ".join(result.stdout.split()), result.stdout
