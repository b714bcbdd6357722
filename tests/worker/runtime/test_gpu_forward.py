"""The GPU Llama forward (worker_service/runtime/backends/gpu_llama.py): its logits against the `transformers`
forward over the same batch-invariant layers, a row alone against the row in a mixed step, and where the
runner chooses it. On the CPU in Triton's interpreter (the tiny model), on CUDA in the gpu tier."""

import pytest
import torch

from kernels import invariant_ops, layer_ops
from kernels._triton import HAS_TRITON
from tests.worker.runtime.test_fast_forward import _run
from tests.worker.runtime.test_forward_invariance import LAYOUT, SHORT_LAYOUT, rows_that_differ
from worker_service.runtime import backends
from worker_service.runtime.backends import gpu_llama
from worker_service.runtime.backends.gpu_llama import GpuLlamaForward
from worker_service.runtime.invariant_layers import make_batch_invariant
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


def runner_with(backend: str, model_path, dtype: str, device: str) -> ModelRunner:
    """A runner on the batch-invariant layers (the runner makes them for GPU models; on the CPU, here)."""
    model = load_model(model_path, dtype, torch.device(device))
    if device == "cpu":
        make_batch_invariant(model)
    runner = ModelRunner(model, backend=backend, graphs=False)
    assert runner.backend.name == backend
    return runner


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_gpu_forward_logits_equal_the_transformers_forward(tiny_pair, triton_device, dtype):
    """Prefill chunks, decodes and verify queries, mixed: the same logits as `transformers`' layers over the
    same kernels, up to the order of a few sums (the joined q/k/v and gate/up projections split K their own
    way) carried through the layers in the dtype's rounding."""
    ours = _run(runner_with("gpu_llama", tiny_pair.target_path, dtype, triton_device), 0)
    theirs = _run(runner_with("transformers", tiny_pair.target_path, dtype, triton_device), 0)
    for got, want in zip(ours, theirs):
        got = got.cpu()
        want = want.cpu()
        scale = want.abs().max().item()
        tolerance = {"float32": 1e-5, "bfloat16": 6e-2}[dtype] * scale
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
        if dtype == "float32":
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_the_gpu_forward_keeps_a_row_alone_equal_to_the_row_in_a_mixed_batch(tiny_pair, triton_device, dtype):
    layout = LAYOUT if triton_device == "cuda" else SHORT_LAYOUT
    runner = runner_with("gpu_llama", tiny_pair.target_path, dtype, triton_device)
    differ = rows_that_differ(runner, layout)
    assert differ == [], f"rows {differ} of the mixed step differ from the same rows decoded alone"


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_split_sums_added_by_the_residual_add_give_the_linears_own_bits(tiny_pair, triton_device, dtype, monkeypatch):
    """Where a decode step's linear splits K, down's split sums go to the residual add's kernel instead of the
    linear's second launch: the logits are bit for bit those of the linear's own sum."""
    monkeypatch.setattr(invariant_ops, "MIN_SPLIT_WEIGHTS", 0)  # the tiny model's down splits as an 8B's does
    monkeypatch.setattr(invariant_ops, "MIN_SPLIT_BLOCKS", 1)
    config = load_model(tiny_pair.target_path, dtype).config
    assert invariant_ops.k_splits(config.hidden_size, config.intermediate_size)[0] > 1

    def steps() -> list[torch.Tensor]:  # a prefill of two sequences, then a decode of one beside a verify
        runner = runner_with("gpu_llama", tiny_pair.target_path, dtype, triton_device)
        runner.init_cache(num_blocks=8, block_size=4)
        tokens = [[5 + 3 * i + j for i in range(12)] for j in range(2)]
        prefill = [SequenceChunk(tokens[j][:8], 0, [4 * j + b for b in range(4)], 1) for j in range(2)]
        step = [SequenceChunk(tokens[0][8:9], 8, [0, 1, 2, 3], 1), SequenceChunk(tokens[1][8:12], 8, [4, 5, 6, 7], 4)]
        return [runner.forward(prefill), runner.forward(step)]

    fused = steps()
    monkeypatch.setattr(gpu_llama, "linear_split_sums", invariant_ops.linear_triton)
    for got, want in zip(fused, steps()):
        assert torch.equal(got.cpu(), want.cpu())


def test_the_joined_projections_leave_the_model_its_own_linears(tiny_pair, triton_device):
    """The q/k/v and gate/up weights are joined once; the model's linears become views of them, so the
    `transformers` forward of the same model still computes what it did, from one copy of the weights."""
    runner = runner_with("gpu_llama", tiny_pair.target_path, "float32", triton_device)
    model = runner.model
    attn = model.model.layers[0].self_attn
    joined = runner.backend.layers[0].qkv
    assert attn.q_proj.weight.data_ptr() == joined.data_ptr()
    assert attn.k_proj.weight.data_ptr() == joined[attn.q_proj.weight.shape[0] :].data_ptr()
    fresh = load_model(tiny_pair.target_path, "float32")
    assert torch.equal(attn.v_proj.weight.cpu(), fresh.model.layers[0].self_attn.v_proj.weight)


def test_the_runner_chooses_the_gpu_forward_only_over_the_invariant_layers(tiny_pair, triton_device):
    model = load_model(tiny_pair.target_path, "float32", triton_device)
    reason = GpuLlamaForward.supports(model)
    assert "not the batch-invariant ones" in reason  # the CPU model's own linears (or a GPU's cuBLAS ones)
    make_batch_invariant(model)
    assert GpuLlamaForward.supports(model) is None  # in Triton's interpreter, or on CUDA
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rope_type dynamic" in GpuLlamaForward.supports(model)
    model.config.model_type = "mistral"
    assert "mistral" in GpuLlamaForward.supports(model)
    assert backends.choose(model).name == "transformers"


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [True, False])
def test_a_cuda_llama_runs_the_gpu_forward_by_default(tiny_pair, invariant):
    model = load_model(tiny_pair.target_path, "bfloat16", torch.device("cuda"))
    runner = ModelRunner(model, batch_invariant=invariant)
    assert runner.backend.name == ("gpu_llama" if invariant else "transformers")


def test_kernels_that_fail_their_check_leave_the_model_the_transformers_forward(tiny_pair, monkeypatch):
    """A Triton or a GPU that cannot run the layer kernels must not stop the worker: the runner keeps the
    `transformers` forward, and says why."""
    model = load_model(tiny_pair.target_path, "float32")
    make_batch_invariant(model)

    def broken(gate_up):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(layer_ops, "silu_mul_triton", broken)
    gpu_llama.kernels_fail.cache_clear()
    try:
        assert "no kernel image" in GpuLlamaForward.supports(model)
        assert backends.choose(model).name == "transformers"
    finally:
        monkeypatch.undo()
        gpu_llama.kernels_fail.cache_clear()
    assert GpuLlamaForward.supports(model) is None
