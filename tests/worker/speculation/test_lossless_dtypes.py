"""Greedy speculation emits exactly plain decoding's tokens in every dtype: bf16, and llama.cpp's q8_0 and
q4_1 weight blocks, included.

On the tiny seeded pair, and (slow tier) on the embedded SmolLM2 with itself
as the draft model: in bf16 as in fp32 its drafts are then all accepted,
because the draft's one-token steps and the target's verify queries compute
the same logits.

Plain decoding here is the same worker with k = 0 (not `transformers`, whose
bf16 arithmetic differs): what must not change is the output when speculation
is turned on. That holds only because every layer, the linear layers
(kernels/linear_cpu.py) and attention (kernels/paged_attention_cpu.py)
included, computes a row the same way whatever the number of rows in the
step.

The gpu tier runs the tiny pair on CUDA too (the Triton kernels, cuBLAS).
"""

from dataclasses import dataclass
import pathlib

import pytest

from kernels import invariant_ops, linear_cpu
from tests.e2e.client import chat_prompts
from tests.kernels.perturbed import batch_dependent_linear
from tests.worker.driver import Driver
from worker_service.runtime.backends import cpu_llama
from worker_service.runtime.dtypes import QUANTIZED_DTYPES
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.worker import Worker

# q8_0 / q4_1: llama.cpp's weight blocks, int8 activations; "q4_1, bf16 KV": --kv-cache-dtype bfloat16
DTYPES = ["float32", "bfloat16", "q8_0", "q4_1", "q4_1, bf16 KV"]
QUESTIONS = [
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "List three prime numbers.",
    "What is the capital of France?",
    "Write the numbers from 1 to 12, separated by commas.",
    "Explain why the sky is blue in one sentence.",
    "Spell the word banana letter by letter.",
    "Name the days of the week.",
    "Translate 'good morning' into French and Spanish.",
]


@dataclass
class Workload:
    target_path: pathlib.Path
    draft_path: pathlib.Path
    prompts: list[list[int]]
    max_tokens: int
    block_size: int
    num_blocks: int
    device: str = "cpu"


MARKS = {"tiny": (), "tiny-cuda": (pytest.mark.gpu,), "smollm2": (pytest.mark.slow,)}
WORKLOADS = [pytest.param(name, marks=marks, id=name) for name, marks in MARKS.items()]
# Every k on the tiny models; SmolLM2 (the slow tier) at k = 5 only, whose mixed_ks holds every draft length
# from 0 to 5 in each step (running k = 1 and 3 too tripled its share of the suite for no other step shape).
KS = {"tiny": (1, 3, 5), "tiny-cuda": (1, 3, 5), "smollm2": (5,)}


@pytest.fixture(scope="module")
def workload(request) -> Workload:
    if request.param.startswith("tiny"):
        pair = request.getfixturevalue("tiny_pair")
        # Repetitive prompts give n-gram matches; the last two have no repeated token at first.
        prompts = [
            [5, 6, 7, 8, 9, 5, 6, 7],
            [40] * 20,
            [10, 11, 12, 10, 11, 12, 10],
            list(range(3, 33)),
            [100, 101, 102],
            [7, 8, 7, 8, 7, 8],
            [200, 201, 202, 200, 201],
            [50, 60, 70, 80],
        ]
        device = "cuda" if request.param == "tiny-cuda" else "cpu"
        return Workload(pair.target_path, pair.draft_path, prompts, 40, 4, 600, device)
    path = request.getfixturevalue("smollm2_path")
    return Workload(path, path, chat_prompts(path, QUESTIONS), 32, 16, 100)


@pytest.fixture(scope="module")
def runners():
    """The module's loaded models by (role, path, dtype, device): each is loaded once (SmolLM2 takes ~3 s a
    dtype) and freed with the module. A target and a draft from one file stay two runners, two KV caches."""
    loaded: dict[tuple, ModelRunner] = {}
    yield loaded
    loaded.clear()


def dtypes(name: str) -> tuple[str, str]:
    """A name of DTYPES as (--dtype, --kv-cache-dtype)."""
    dtype, _, kv = name.partition(", ")
    return dtype, "bfloat16" if kv == "bf16 KV" else "auto"


def runner(runners: dict, role: str, path: pathlib.Path, name: str, device: str) -> ModelRunner:
    """A runner for a new Worker (the Worker allocates its KV cache afresh; the worker before it is done)."""
    key = (role, str(path), name, device)
    if key not in runners:
        dtype, kv_cache_dtype = dtypes(name)
        runners[key] = ModelRunner(load_model(path, dtype, device), kv_cache_dtype=kv_cache_dtype)
    return runners[key]


def make_worker(work: Workload, runners: dict, dtype: str, proposer: str = "none", k: int = 0) -> Worker:
    config = WorkerConfig(
        model=str(work.target_path),
        dtype=dtypes(dtype)[0],
        kv_cache_dtype=dtypes(dtype)[1],
        proposer=proposer,
        num_speculative_tokens=k,
        draft_model=str(work.draft_path) if proposer == "draft" else None,
        device=work.device,
    )
    draft = runner(runners, "draft", work.draft_path, dtype, work.device) if proposer == "draft" else None
    worker = Worker(config, runner(runners, "target", work.target_path, dtype, work.device), draft)
    worker.init_cache(work.num_blocks, work.block_size)
    return worker


def generate(work: Workload, worker: Worker, ks: list[int]) -> tuple[list[list[int]], list]:
    driver = Driver(worker.execute, work.block_size, work.num_blocks)
    return driver.generate(work.prompts, work.max_tokens, num_speculative_tokens=ks), driver.results


def mixed_ks(k: int) -> list[int]:
    """Eight requests, some drafting k, some fewer, one none: one step holds queries of several lengths (for
    k = 5 every length from 1 to 6 rows)."""
    return [k, 1, 0, min(3, k), max(k - 1, 1), k, min(2, k), k]


def runs_on(name: str, device: str) -> bool:
    return device == "cpu" or dtypes(name)[0] not in QUANTIZED_DTYPES  # block weights: the CPU kernel's


@pytest.fixture(scope="module")
def plain(workload, runners):
    return {
        dtype: generate(workload, make_worker(workload, runners, dtype), [0] * len(workload.prompts))[0]
        for dtype in DTYPES
        if runs_on(dtype, workload.device)
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize(
    "workload, k",
    [pytest.param(name, k, marks=MARKS[name], id=f"{name}-{k}") for name in MARKS for k in KS[name]],
    indirect=["workload"],
    scope="module",
)
def test_greedy_speculation_is_token_identical_to_plain_decoding(workload, runners, plain, proposer, k, dtype):
    if not runs_on(dtype, workload.device):
        pytest.skip(f"{dtype} runs on the CPU only")
    got, results = generate(workload, make_worker(workload, runners, dtype, proposer, k), mixed_ks(k))
    assert got == plain[dtype]
    outputs = [o for r in results for o in r.outputs]
    assert sum(o.num_draft_tokens for o in outputs) > 0  # speculation really happened
    accepted = sum(o.num_accepted_tokens for o in outputs)
    if workload.draft_path == workload.target_path and proposer == "draft":
        assert accepted == sum(o.num_draft_tokens for o in outputs)  # its own draft: the same logits
    elif proposer != "draft":  # the tiny draft model rarely agrees with the target; copied drafts often do
        assert accepted > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "q4_1"])
@pytest.mark.parametrize("workload", WORKLOADS, indirect=True, scope="module")
def test_speculation_differs_with_a_batch_dependent_linear(workload, runners, plain, monkeypatch, dtype):
    """The check above has teeth: when the linear layers' rows change with the number of rows in the call
    (as a library GEMM's blocking may make them), speculation changes some outputs of this very workload.
    The perturbation is built here, so the teeth do not depend on this machine's libraries."""
    if workload.device != "cpu" and dtype in QUANTIZED_DTYPES:
        pytest.skip(f"{dtype} runs on the CPU only")
    exact, exact_triton = linear_cpu.linear_cpu, invariant_ops.linear_triton

    def batch_dependent(x, packed_weight, out_features, bias, **kwargs):
        if x.reshape(-1, x.shape[-1]).shape[0] > 1:
            x = x * (1 + 2**-7)  # another rounding, as another kernel would give
        return exact(x, packed_weight, out_features, bias, **kwargs)

    def batch_dependent_triton(x, weight, bias=None):  # the GPU's invariant layers (invariant_layers.py)
        return exact_triton(x * (1 + 2**-7) if x.reshape(-1, x.shape[-1]).shape[0] > 1 else x, weight, bias)

    monkeypatch.setattr(linear_cpu, "linear_cpu", batch_dependent)
    perturbed = batch_dependent_linear()  # the fast forward's layer loop (kept alive while it runs)
    monkeypatch.setattr(cpu_llama, "linear_function", lambda: perturbed)
    monkeypatch.setattr(invariant_ops, "linear_triton", batch_dependent_triton)
    differ = 0
    for proposer, k in [("ngram", 3), ("ngram", 5), ("draft", 3), ("draft", 5)]:
        got, _ = generate(workload, make_worker(workload, runners, dtype, proposer, k), mixed_ks(k))
        differ += sum(a != b for a, b in zip(got, plain[dtype]))
        if differ:
            break
    assert differ > 0


@pytest.mark.parametrize("workload", WORKLOADS, indirect=True, scope="module")
def test_plain_bf16_decoding_stays_close_to_fp32(plain):
    """bf16 is another model, not a broken one: most greedy tokens agree with fp32."""
    pairs = [(a, b) for x, y in zip(plain["float32"], plain["bfloat16"]) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) > 0.5
