"""--dtype: names and aliases, "auto" resolution, and float16 models that load and decode on the CPU."""

import pytest
import torch

from tests.tiny_models import tiny_llama
from tests.worker.driver import Driver
from worker_service.runtime.dtypes import resolve_dtype
from worker_service.runtime.loader import checkpoint_dtype
from worker_service.speculation.build import build_worker
from worker_service.speculation.config import WorkerConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.mark.parametrize(
    "requested, checkpoint, device, expected",
    [
        ("auto", "bfloat16", "cpu", "float32"),  # the CPU: float32 whatever the checkpoint says
        ("auto", "bfloat16", "cuda", "bfloat16"),  # an accelerator: the checkpoint's dtype
        ("auto", "float16", "cuda", "float16"),
        ("auto", None, "cuda", "float32"),  # a checkpoint that names none
        ("auto", "float64", "cuda", "float32"),  # or one we do not run
        ("half", "float32", "cpu", "float16"),
        ("bfloat16", "float32", "cpu", "bfloat16"),
    ],
)
def test_resolve_dtype(requested, checkpoint, device, expected):
    assert resolve_dtype(requested, checkpoint, device) == expected


def test_worker_config_normalises_aliases_and_rejects_unknown_names():
    assert WorkerConfig(model="m", dtype="half").dtype == "float16"
    assert WorkerConfig(model="m").dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        WorkerConfig(model="m", dtype="float64")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16") / "model"
    tiny_llama(seed=0, num_layers=2, hidden=32, heads=2, kv_heads=1).to(torch.bfloat16).save_pretrained(path)
    return path


def test_checkpoint_dtype(tiny_pair, bf16_checkpoint):
    assert checkpoint_dtype(tiny_pair.target_path) == "float32"
    assert checkpoint_dtype(bf16_checkpoint) == "bfloat16"


def test_auto_loads_float32_on_the_cpu_and_the_config_says_so(bf16_checkpoint):
    worker = build_worker(WorkerConfig(model=str(bf16_checkpoint), device="cpu", num_threads=1))
    assert worker.config.dtype == "float32"  # what Describe reports
    assert worker.target.model.dtype == torch.float32


def test_float16_loads_and_decodes_on_the_cpu(tiny_pair):
    """float16 works on the CPU (slower than float32 there, but exact enough): weights, KV cache and a
    speculative decode with drafts from a float16 draft model."""
    config = WorkerConfig(
        model=str(tiny_pair.target_path),
        dtype="half",
        device="cpu",
        proposer="draft",
        draft_model=str(tiny_pair.draft_path),
        num_speculative_tokens=3,
        num_threads=1,
    )
    worker = build_worker(config)
    assert worker.config.dtype == "float16"
    assert worker.target.model.dtype == worker.draft.model.dtype == torch.float16
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert worker.target.kv_cache.key_caches[0].dtype == torch.float16
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    outputs = driver.generate([[5, 6, 7, 8, 5, 6, 7], [40] * 6], max_tokens=8, num_speculative_tokens=3)
    assert [len(o) for o in outputs] == [8, 8] and all(0 <= t < 256 for o in outputs for t in o)
    assert sum(o.num_draft_tokens for r in driver.results for o in r.outputs) > 0  # drafts ran in float16 too
