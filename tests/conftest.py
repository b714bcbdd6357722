"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import make_tiny_pair  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A seeded tiny Llama target and a smaller draft sharing its vocabulary, saved as checkpoints."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the embedded SmolLM2 checkpoint (fetched and converted once)."""
    from worker_service.models import fetch_default_model

    return fetch_default_model()
