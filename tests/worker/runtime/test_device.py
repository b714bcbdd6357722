"""--device and --gpu-memory-utilization: parsing, resolution, the KV budget, and every tensor of a worker step
on the model's device."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specdec import step
from specdec.cli import build_parser
from tests.worker.driver import Driver
from tests.worker.speculation.test_eagle3 import make_worker as make_eagle3_worker
from tests.worker.speculation.test_speculative import BLOCK_SIZE, NUM_BLOCKS, PROMPTS, make_worker
from worker_service.runtime import device as devices
from worker_service.runtime.dtypes import check_device, resolve_device
from worker_service.serving.flags import config_from_args, forwarded_argv
from worker_service.speculation.build import build_worker
from worker_service.speculation.config import WorkerConfig

GIB = 2**30
aten = torch.ops.aten
# Ops whose host-side output is legitimate: a tensor made from Python or numpy data on its way to the device
# (block tables, keyed-noise row keys, draft-tree paths; `detach_` is how torch.tensor(..., pin_memory=True)
# finishes its host staging tensor), results copied back to the host, and `tolist` reading host metadata
# (`resolve_conj` / `resolve_neg`).
HOST_SIDE_OPS = frozenset(
    {
        aten.lift_fresh.default,
        aten.detach_.default,
        aten._to_copy.default,
        aten.copy_.default,
        aten.resolve_conj.default,
        aten.resolve_neg.default,
    }
)


class DeviceRecorder(TorchDispatchMode):
    """Records the op and device of every tensor an op returns while it is active."""

    def __init__(self):
        super().__init__()
        self.placements: list[tuple[str, torch.device]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            if not (value.device.type == "cpu" and (func in HOST_SIDE_OPS or value.is_pinned())):
                self.placements.append((str(func), value.device))
        return out

    def off_device(self, device: torch.device) -> list[tuple[str, torch.device]]:
        """The recorded (op, device) pairs of tensors that are not on `device`."""
        return [(op, d) for op, d in self.placements if d != device]


def test_the_recorder_catches_a_tensor_off_the_device():
    """The checker's own check: a tensor made on the wrong device is reported; host data on its way is not."""
    with DeviceRecorder() as recorder:
        torch.zeros(2, device="meta").add_(1)
        torch.tensor([1, 2]).to("meta")
        torch.ones(3)
    assert recorder.off_device(torch.device("meta")) == [("aten.ones.default", torch.device("cpu"))]
    assert recorder.off_device(torch.device("cpu")) == [
        ("aten.zeros.default", torch.device("meta")),
        ("aten.add_.Tensor", torch.device("meta")),
        ("aten._to_copy.default", torch.device("meta")),
    ]


@pytest.mark.parametrize("proposer", ["ngram", "draft", "eagle3", "eagle3-trees"])
def test_every_step_tensor_is_on_the_models_device(tiny_pair, tiny_eagle3_head, device, proposer):
    """Greedy, seeded-sampling and logprob requests speculating together: no op returns a tensor elsewhere."""
    if proposer.startswith("eagle3"):
        worker = make_eagle3_worker(
            tiny_pair, tiny_eagle3_head, k=3, device=device, tree_width=3 if proposer == "eagle3-trees" else 1
        )
        worker.proposer.min_confidence = 0.0  # a random head's drafts: every step drafts
    else:
        worker = make_worker(tiny_pair, proposer, 3, device=device)
    samplings = [
        step.RequestSampling(temperature=0.0),
        step.RequestSampling(temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=True),
        step.RequestSampling(temperature=1.0, seed=8),
    ]
    recorder = DeviceRecorder()

    def execute(request: step.StepRequest) -> step.StepResult:
        with recorder:
            return worker.execute(request)

    driver = Driver(execute, BLOCK_SIZE, NUM_BLOCKS)
    driver.generate(PROMPTS[:3], 12, sampling=samplings, num_speculative_tokens=3)
    assert sum(o.num_draft_tokens for r in driver.results for o in r.outputs) > 0  # the verify path ran
    assert len(recorder.placements) > 500  # the mode saw the steps' ops (the CPU's C passes are out of its sight)
    assert recorder.off_device(worker.target.device) == []


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_spellings(name):
    assert check_device(name) == name
    assert WorkerConfig(model="m", device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "mps", ""])
def test_bad_device_spellings_are_refused_naming_the_flag(name, capsys):
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
        WorkerConfig(model="m", device=name)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--device", name])
    assert f"argument --device: must be auto, cpu, cuda or cuda:N, got {name!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "requested, num_cuda_devices, expected",
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cpu", 2, "cpu"),
        ("cuda", 1, "cuda:0"),
        ("cuda:1", 2, "cuda:1"),
    ],
)
def test_resolve_device(requested, num_cuda_devices, expected):
    assert resolve_device(requested, num_cuda_devices) == expected


@pytest.mark.parametrize(
    "requested, num_cuda_devices, message",
    [
        ("cuda", 0, "--device cuda: CUDA is not available here"),
        ("cuda:0", 0, "--device cuda:0: CUDA is not available here"),
        ("cuda:2", 2, r"--device cuda:2: this host has 2 CUDA device\(s\), cuda:0..cuda:1"),
    ],
)
def test_resolve_device_refuses_a_missing_cuda_device(requested, num_cuda_devices, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(requested, num_cuda_devices)


def test_device_and_gpu_memory_utilization_flags_are_forwarded():
    args = build_parser().parse_args(["serve", "--device", "cuda:1", "--gpu-memory-utilization", "0.5"])
    argv = forwarded_argv(args)
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    config = config_from_args(build_parser().parse_args(["worker", *argv]), "m", None)
    assert (config.device, config.gpu_memory_utilization) == ("cuda:1", 0.5)
    defaults = config_from_args(build_parser().parse_args(["worker"]), "m", None)
    assert (defaults.device, defaults.gpu_memory_utilization) == ("auto", 0.9)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_must_be_a_fraction(utilization):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        WorkerConfig(model="m", gpu_memory_utilization=utilization)


def test_gpu_kv_budget_is_the_fraction_less_the_weights_and_the_reserve():
    budget = devices.gpu_kv_budget_bytes(
        total_bytes=80 * GIB, free_bytes=79 * GIB, used_bytes=GIB, utilization=0.9, reserve_bytes=2 * GIB
    )
    assert budget == int(80 * GIB * 0.9) - GIB - 2 * GIB
    assert devices.gpu_kv_budget_bytes(80 * GIB, 79 * GIB, GIB, 0.5, 0) == 40 * GIB - GIB


def test_gpu_kv_budget_errors_name_the_flag():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.05: .* leaves no room for a KV cache"):
        devices.gpu_kv_budget_bytes(80 * GIB, 79 * GIB, 3 * GIB, 0.05, 2 * GIB)
    with pytest.raises(ValueError, match="do not fit in the GPU's 20.00 GiB free memory"):  # others hold the rest
        devices.gpu_kv_budget_bytes(80 * GIB, 20 * GIB, GIB, 0.9, 2 * GIB)


def test_cpu_kv_budget_is_kv_cache_memory_gib():
    assert devices.kv_cache_budget_bytes(torch.device("cpu"), GIB // 2, 0.1) == GIB // 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_cuda_without_cuda_is_a_startup_error(tiny_pair):
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available here"):
        build_worker(WorkerConfig(model=str(tiny_pair.target_path), device="cuda"))


def test_build_worker_places_the_models_and_sets_the_budget(tiny_pair, device):
    config = WorkerConfig(
        model=str(tiny_pair.target_path),
        device=device,
        proposer="draft",
        num_speculative_tokens=2,
        draft_model=str(tiny_pair.draft_path),
        kv_cache_memory_bytes=GIB // 4,
        gpu_memory_utilization=0.5,
        num_threads=1,
    )
    worker = build_worker(config)
    expected = torch.device("cuda:0" if device == "cuda" else "cpu")
    assert worker.config.device == str(expected)  # what Describe reports
    assert worker.target.device == worker.draft.device == expected
    if device == "cpu":
        assert worker.config.kv_cache_memory_bytes == GIB // 4
    else:
        assert 0 < worker.config.kv_cache_memory_bytes < torch.cuda.get_device_properties(0).total_memory * 0.5


def test_without_num_threads_the_worker_runs_at_most_the_usable_cpus(tiny_pair, monkeypatch):
    """No --num-threads and no $OMP_NUM_THREADS: torch's default (the affinity mask) capped by the CPUs the
    process may use (specdec.cpus: a cgroup quota below the mask, here 1 CPU), so no thread waits on a CPU
    it does not get."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("specdec.cpus.usable_cpus", lambda: 1)
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_worker(WorkerConfig(model=str(tiny_pair.target_path), device="cpu"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        build_worker(WorkerConfig(model=str(tiny_pair.target_path), device="cpu"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads_before)
