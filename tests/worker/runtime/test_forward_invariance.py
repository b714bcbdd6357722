"""A whole forward is batch invariant: a row's logits alone equal its logits in a mixed step of 64 rows.

Embedding, norms, RoPE, attention (kernels/paged_attention_cpu.py), the MLP
and the output layer (kernels/linear_cpu.py) all compute a row the same way
whatever else shares the step, so one-token decoding from scratch and a step
that mixes a prefill, decodes and verify queries give bitwise the same logits
(and write the same K/V). That is what makes greedy speculation lossless and
a request's output independent of the batch it ran in.
"""

import random

import pytest
import torch

from kernels import invariant_ops
from tests.kernels.perturbed import batch_dependent_linear
from worker_service.runtime.backends import cpu_llama
from worker_service.runtime.backends.transformers_layers import TransformersForward
from worker_service.runtime.invariant_layers import (
    InvariantLinear,
    InvariantRMSNorm,
    kernels_fail,
    make_batch_invariant,
)
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

BLOCK_SIZE = 4
# (cached prefix, rows in the mixed step) per sequence: a fresh prefill, decodes, verify queries of 2..7 rows,
# a prefill chunk over a cached prefix; 64 rows in all.
LAYOUT = [(0, 21), (9, 1), (14, 6), (3, 1), (0, 1), (25, 7), (6, 2), (11, 10), (30, 1), (2, 4), (17, 5), (8, 5)]
# Every dtype on the tiny model, with the fast forward (worker_service/runtime/backends/cpu_llama.py) and with
# transformers' (the one other models run); SmolLM2 in the dtypes it is served in (fp16 on the CPU is slow).
CASES = [
    ("tiny", dtype, forward)
    for dtype in ("float32", "bfloat16", "float16", "q8_0", "q4_1")
    for forward in ("fast", "transformers")
]
CASES += [pytest.param("smollm2", dtype, "fast", marks=pytest.mark.slow) for dtype in ("float32", "bfloat16", "q4_1")]


def one_row_at_a_time(runner: ModelRunner, tokens: list[int], blocks: list[int]) -> torch.Tensor:  # [L, V]
    """Every position's logits, decoding the sequence one token per forward from an empty cache."""
    return torch.cat([runner.forward([SequenceChunk([t], pos, blocks)]) for pos, t in enumerate(tokens)])


def rows_that_differ(runner: ModelRunner, layout: list[tuple[int, int]] = LAYOUT) -> list[int]:
    """The rows of one mixed step of `layout` whose logits differ from the same rows decoded alone."""
    total = sum(rows for _, rows in layout)
    runner.init_cache(num_blocks=256, block_size=BLOCK_SIZE)
    rng = random.Random(0)
    free = list(range(256))
    rng.shuffle(free)
    sequences = [[rng.randrange(3, runner.vocab_size) for _ in range(cached + rows)] for cached, rows in layout]
    tables = [[free.pop() for _ in range(-(-len(s) // BLOCK_SIZE))] for s in sequences]

    # The cached prefixes, prefilled in one step; then the mixed step, with every row's logits.
    runner.forward(
        [
            SequenceChunk(s[:cached], 0, t, num_logits=0)
            for s, t, (cached, _) in zip(sequences, tables, layout)
            if cached
        ]
    )
    mixed = runner.forward(
        [
            SequenceChunk(s[cached:], cached, t, num_logits=rows)
            for s, t, (cached, rows) in zip(sequences, tables, layout)
        ]
    )  # [total, V]

    alone_tables = [[free.pop() for _ in range(-(-len(s) // BLOCK_SIZE))] for s in sequences]
    alone = torch.cat(
        [one_row_at_a_time(runner, s, t)[cached:] for s, t, (cached, _) in zip(sequences, alone_tables, layout)]
    )  # [total, V]
    return [i for i in range(total) if not torch.equal(mixed[i], alone[i])]


@pytest.mark.parametrize("model, dtype, forward", CASES)
def test_a_row_alone_equals_the_row_in_a_mixed_batch_of_64(request, model, dtype, forward):
    model_path = (
        request.getfixturevalue("tiny_pair").target_path if model == "tiny" else request.getfixturevalue("smollm2_path")
    )
    runner = ModelRunner(load_model(model_path, dtype))
    assert runner.backend.name == "cpu_llama"
    if forward == "transformers":
        runner.backend = TransformersForward(runner.model)
    differ = rows_that_differ(runner)
    assert differ == [], f"rows {differ} of the mixed step differ from the same rows decoded alone"


def test_the_check_catches_a_batch_dependent_linear_in_the_fast_forward(tiny_pair, monkeypatch):
    """Teeth that do not depend on this machine: the fast forward's projections made to round multi-row
    calls another way (as a library GEMM's blocking may) must make rows differ."""
    perturbed = batch_dependent_linear()
    monkeypatch.setattr(cpu_llama, "linear_function", lambda: perturbed)
    runner = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    assert rows_that_differ(runner) != []


def invariant_runner(model_path, dtype: str, device: str) -> ModelRunner:
    """The GPU's forward: transformers' layers, their linears and RMSNorms our Triton kernels
    (invariant_layers.py); on the CPU in Triton's interpreter (the runner makes them for GPU models only)."""
    model = load_model(model_path, dtype, torch.device(device))
    if device == "cpu":
        make_batch_invariant(model)
    runner = ModelRunner(model, backend="transformers")
    assert runner.backend.name == "transformers"
    assert sum(isinstance(m, (InvariantLinear, InvariantRMSNorm)) for m in model.modules()) == 4 * 9 + 2
    return runner


# Triton's interpreter runs a launch in ~10 ms: on the CPU, a mixed step of 8 rows (a prefill, a decode, a verify).
SHORT_LAYOUT = [(0, 4), (3, 1), (2, 3)]


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)]
)  # the interpreter multiplies bf16 in fp32
def test_the_gpu_forward_keeps_a_row_alone_equal_to_the_row_in_a_mixed_batch(tiny_pair, triton_device, dtype):
    layout = LAYOUT if triton_device == "cuda" else SHORT_LAYOUT
    differ = rows_that_differ(invariant_runner(tiny_pair.target_path, dtype, triton_device), layout)
    assert differ == [], f"rows {differ} of the mixed step differ from the same rows decoded alone"


@pytest.mark.gpu
def test_the_check_catches_a_batch_dependent_linear_in_the_gpu_forward(tiny_pair, monkeypatch):
    exact = invariant_ops.linear_triton

    def batch_dependent(x, weight, bias=None):
        return exact(x * (1 + 2**-7) if x.reshape(-1, x.shape[-1]).shape[0] > 1 else x, weight, bias)

    monkeypatch.setattr(invariant_ops, "linear_triton", batch_dependent)
    assert rows_that_differ(invariant_runner(tiny_pair.target_path, "float32", "cuda")) != []


def test_kernels_that_fail_their_check_leave_the_model_its_own_layers(tiny_pair, monkeypatch, caplog):
    """A Triton or a driver that cannot run the kernels must not stop the worker: the model keeps its layers
    (not batch invariant), and the log says so."""
    model = load_model(tiny_pair.target_path, "float32")
    assert kernels_fail(model.device, model.dtype) is None

    def broken(x, weight, bias=None):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(invariant_ops, "linear_triton", broken)
    assert "no kernel image" in kernels_fail(model.device, model.dtype)
    assert make_batch_invariant(model) == 0
    assert not any(isinstance(m, (InvariantLinear, InvariantRMSNorm)) for m in model.modules())
    assert "do not run" in caplog.text
