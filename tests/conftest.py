"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import make_tiny_pair, save_tiny_eagle3_head  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped (never passed) on a host without CUDA."""
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(needs_cuda)


# Where a test runs the worker's torch code: always the CPU, and CUDA in the gpu tier.
@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param


# Where a kernel test runs Triton: the CPU in Triton's interpreter (only without CUDA: the interpreter is set
# up above), or CUDA in the gpu tier.
@pytest.fixture(
    params=[
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only on a host without CUDA"
            ),
        ),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]
)
def triton_device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A seeded tiny Llama target and a smaller draft sharing its vocabulary, saved as checkpoints."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_eagle3_head(tmp_path_factory):
    """A random EAGLE-3 head (SpecForge layout) for the tiny target: it drafts, and nothing it drafts is
    accepted unless the target agrees."""
    return save_tiny_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head")


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the embedded SmolLM2 checkpoint (fetched and converted once)."""
    from worker_service.runtime.default_model import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_path):
    """generate(prompt_ids, max_new_tokens): the embedded SmolLM2's greedy `transformers` generate (stopping at
    EOS), the reference of several modules. Each prompt is generated once a session: at ~0.2 s a token on two
    cores it cost the end-to-end tests a minute a module."""
    from worker_service.runtime.loader import load_model

    model = load_model(smollm2_path)
    outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in outputs:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
            outputs[key] = out[0, len(prompt_ids) :].tolist()
        return list(outputs[key])

    return generate
