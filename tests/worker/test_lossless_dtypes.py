"""Greedy speculation emits exactly plain decoding's tokens in every dtype, bf16 included.

Plain decoding here is the same worker with k = 0 (not `transformers`, whose
bf16 arithmetic differs): what must not change is the output when speculation
is turned on. That holds only because every layer, attention included
(kernels/paged_attention_cpu.py), computes a row the same way whatever the
number of rows in the step.
"""

import pytest
import torch

import kernels.paged_attention_cpu as cpu_kernel
from tests.worker.driver import Driver
from worker_service.config import WorkerConfig
from worker_service.model_loader import load_model
from worker_service.model_runner import ModelRunner
from worker_service.worker import Worker

BLOCK_SIZE = 4
NUM_BLOCKS = 600
# Repetitive prompts give n-gram matches; the last two have no repeated token at first.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40] * 20, [10, 11, 12, 10, 11, 12, 10], list(range(3, 33)), [100, 101, 102]]
MAX_TOKENS = 40
DTYPES = ["float32", "bfloat16"]


def make_worker(pair, dtype: str, proposer: str = "none", k: int = 0) -> Worker:
    config = WorkerConfig(model=str(pair.target_path), dtype=dtype, proposer=proposer, num_speculative_tokens=k,
                          draft_model=str(pair.draft_path) if proposer == "draft" else None)
    draft = ModelRunner(load_model(pair.draft_path, dtype)) if proposer == "draft" else None
    worker = Worker(config, ModelRunner(load_model(pair.target_path, dtype)), draft)
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return worker


def generate(worker: Worker, ks: list[int]) -> tuple[list[list[int]], list]:
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    return driver.generate(PROMPTS, MAX_TOKENS, num_speculative_tokens=ks), driver.results


def mixed_ks(k: int) -> list[int]:
    """Five requests, some drafting k, some fewer, one none: one step holds queries of several lengths."""
    return [k, 1, 0, k, max(k - 1, 1)]


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return {dtype: generate(make_worker(tiny_pair, dtype), [0] * len(PROMPTS))[0] for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculation_is_token_identical_to_plain_decoding(tiny_pair, plain, proposer, k, dtype):
    got, results = generate(make_worker(tiny_pair, dtype, proposer, k), mixed_ks(k))
    assert got == plain[dtype]
    outputs = [o for r in results for o in r.outputs]
    assert sum(o.num_draft_tokens for o in outputs) > 0  # speculation really happened
    if proposer == "ngram":  # the tiny draft model rarely agrees with the target; n-gram drafts often do
        assert sum(o.num_accepted_tokens for o in outputs) > 0


def test_bf16_speculation_differs_without_the_batch_invariant_kernel(tiny_pair, plain, monkeypatch):
    """The check above has teeth: with SDPA attention (the fallback without a C compiler) bf16
    speculation changes some outputs of this very workload."""
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    differ = 0
    for proposer, k in [("ngram", 3), ("ngram", 5), ("draft", 3), ("draft", 5)]:
        got, _ = generate(make_worker(tiny_pair, "bfloat16", proposer, k), mixed_ks(k))
        differ += sum(a != b for a, b in zip(got, plain["bfloat16"]))
    assert differ > 0


def test_plain_bf16_decoding_stays_close_to_fp32(plain):
    """bf16 is another model, not a broken one: most greedy tokens agree with fp32."""
    pairs = [(a, b) for x, y in zip(plain["float32"], plain["bfloat16"]) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) > 0.5
