"""Batch-invariant layers for a model on a GPU (--batch-invariant, the default).

The CPU's kernels are batch invariant by construction (kernels/linear_cpu.py, kernels/paged_attention_cpu.py);
on CUDA, cuBLAS's matmuls and torch's row reductions are not (kernels/invariant_ops.py says how they vary).
`make_batch_invariant` replaces a CUDA model's linear layers and RMSNorms in place by modules that call our
Triton kernels, whose every row is computed the same way whatever the batch; the rest of a decoder layer is
elementwise or our paged attention (per row already). So greedy speculation emits plain decoding's tokens at
any batch on the GPU too.
"""

import logging

import torch

from kernels.invariant_ops import linear_triton, rms_norm_triton

logger = logging.getLogger(__name__)

# `transformers`' RMSNorms that compute LlamaRMSNorm's function (weight * normed rounded to the input's dtype);
# others (Gemma's 1 + weight, ...) keep their own.
LLAMA_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class InvariantLinear(torch.nn.Module):
    """An nn.Linear computed by kernels.invariant_ops.linear_triton; it shares the linear's parameters."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_triton(x, self.weight, self.bias)


class InvariantRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm computed by kernels.invariant_ops.rms_norm_triton; it shares the norm's weight."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_triton(x, self.weight, self.variance_epsilon)


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Replaces every nn.Linear and LLAMA_RMS_NORMS module of `model` in place (any device where Triton runs;
    the worker calls it for CUDA models); returns how many it replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear or type(module).__name__ in LLAMA_RMS_NORMS
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = InvariantLinear(module) if type(module) is torch.nn.Linear else InvariantRMSNorm(module)
        setattr(parent, child, replacement)
    logger.info("%d linear layers and RMSNorms run batch-invariant Triton kernels", len(targets))
    return len(targets)
