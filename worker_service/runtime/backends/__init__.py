"""Forward backends: how a ModelRunner computes a packed batch's hidden states.

One interface, chosen once per model by `choose` (the only place that decides):

- "cpu_llama": a Llama decoder layer as ten direct calls into our C kernels (cpu_llama.py), on the CPU;
- "gpu_llama": a Llama decoder layer as nine Triton launches (gpu_llama.py), on a GPU with the batch-invariant
  layers (the default; `--no-batch-invariant` keeps cuBLAS and the `transformers` forward);
- "transformers": `transformers`' decoder layers over our paged attention (transformers_layers.py): any
  decoder model, and the reference the others are tested against.

Every backend is batch invariant (the `transformers` one where its linears are: on a GPU, with the
batch-invariant layers): a row's hidden state does not depend on the other rows of the batch, so speculation
stays lossless.
"""

import logging
from typing import Protocol

import torch
from transformers import PreTrainedModel

from worker_service.runtime.attention import PagedMetadata
from worker_service.runtime.backends.cpu_llama import CpuLlamaForward
from worker_service.runtime.backends.gpu_llama import GpuLlamaForward
from worker_service.runtime.backends.transformers_layers import TransformersForward

logger = logging.getLogger(__name__)


class ForwardBackend(Protocol):
    """model.model's forward over a packed batch on the paged KV cache."""

    name: str
    transposed_keys: bool  # its attention reads K transposed where kv_cache.transposes_keys says a cache may be
    bf16_cache_under_fp32: bool  # it writes and reads a bf16 KV cache under an fp32 model (--kv-cache-dtype)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedMetadata,
        rows: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T]; writes every row's K/V and returns the normed hidden states of `rows`
        ([N] int64), [N, hidden], and the residual stream entering each of `aux_layers` for every row,
        [T, len(aux_layers) x hidden] (None without aux_layers)."""
        ...


# first: preferred
BACKENDS = {backend.name: backend for backend in (CpuLlamaForward, GpuLlamaForward, TransformersForward)}


def build(name: str, model: PreTrainedModel) -> ForwardBackend:
    """Backend `name` for `model`; ValueError when it does not cover the model (the message says why)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown forward backend {name!r}: choose one of {', '.join(BACKENDS)}")
    reason = BACKENDS[name].supports(model)
    if reason is not None:
        raise ValueError(f"the {name} forward does not cover this model: {reason}")
    return BACKENDS[name](model)


def choose(model: PreTrainedModel) -> ForwardBackend:
    """The first backend of BACKENDS that covers `model` (`transformers` covers every model); logged with why
    the ones before it do not."""
    for name, backend in BACKENDS.items():
        reason = backend.supports(model)
        if reason is None:
            logger.info("the %s forward runs this model", name)
            return backend(model)
        logger.info("not the %s forward: it does not cover %s", name, reason)
    raise AssertionError("the transformers forward covers every model")
