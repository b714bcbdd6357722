"""Assembles a Worker from its config: the device, the models in their resolved dtype, the KV budget."""

from dataclasses import replace
import logging
import os

import torch

from specdec import cpus
from worker_service.runtime import device as devices
from worker_service.runtime.dtypes import resolve_dtype
from worker_service.runtime.eagle3_head import TargetFacts, load_head
from worker_service.runtime.loader import checkpoint_dtype, load_model
from worker_service.runtime.quantization import gguf_format
from worker_service.runtime.runner import ModelRunner
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.worker import Worker

logger = logging.getLogger(__name__)


def build_worker(config: WorkerConfig) -> Worker:
    """Loads the target (and draft model or EAGLE-3 head) on the worker's device and wraps them in a Worker.

    Its config carries what Describe reports: the device (--device resolved), the dtype the models run in
    ("auto" resolved from the target's checkpoint) and the KV budget (on CUDA, from --gpu-memory-utilization).
    Run it on the thread that runs the steps: a CUDA device is made that thread's current one.
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:  # torch's default counts the affinity mask, not a CPU quota
        torch.set_num_threads(min(torch.get_num_threads(), cpus.usable_cpus()))
    device = devices.use_device(config.device)
    dtype = resolve_dtype(
        config.dtype,
        checkpoint_dtype(config.model),
        device.type,
        gguf_format(config.model) if device.type == "cpu" else None,
    )
    runner_options = dict(
        batch_invariant=config.batch_invariant,
        graphs=not config.enforce_eager,
        quantized_activations=config.quantized_activations,
    )
    target = ModelRunner(
        load_model(config.model, dtype, device), **runner_options, kv_cache_dtype=config.kv_cache_dtype
    )
    draft = head = None
    if "draft" in config.proposer_names:
        draft = ModelRunner(load_model(config.draft_model, dtype, device), **runner_options)
    if "eagle3" in config.proposer_names:
        model = target.model
        facts = TargetFacts(model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers)
        head = load_head(
            config.draft_model,
            facts,
            model.model.embed_tokens,
            device,
            config.quantized_activations,
            graphs=not config.enforce_eager,
        )
    budget = devices.kv_cache_budget_bytes(device, config.kv_cache_memory_bytes, config.gpu_memory_utilization)
    logger.info(
        "running on %s in %s (--dtype %s); KV cache budget %.2f GiB",
        devices.describe(device),
        dtype,
        config.dtype,
        budget / devices.GIB,
    )
    config = replace(config, device=str(device), dtype=dtype, kv_cache_memory_bytes=budget)
    return Worker(config, target, draft, head)
