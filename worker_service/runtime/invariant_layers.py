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

from kernels import invariant_ops

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
        return invariant_ops.linear_triton(x, self.weight, self.bias)


class InvariantRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm computed by kernels.invariant_ops.rms_norm_triton; it shares the norm's weight."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_ops.rms_norm_triton(x, self.weight, self.variance_epsilon)


def mismatch(*pairs: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """None when each (kernel's result, reference's) pair agrees within 2% (relative norm), else how far the
    first that does not is: a kernel's self-check at load."""
    for got, want in pairs:
        error = float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12))
        if not error < 2e-2:
            return f"a result {error:.2g} away from its reference"
    return None


def kernels_fail(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when both kernels run on `device` in `dtype` and match their references on a small random case;
    else why not (a Triton build or a driver that cannot run them)."""
    try:
        generator = torch.Generator().manual_seed(0)
        x, w = (torch.randn(shape, generator=generator).to(device, dtype) for shape in ((3, 96), (40, 96)))
        wide = torch.randn((8200, 96), generator=generator).to(device, dtype)  # the other column block (block_n)
        # K in splits (kernels.invariant_ops.k_splits): a program per split, a second kernel adding them
        long_x, long_w = (torch.randn(s, generator=generator).to(device, dtype) for s in ((3, 2048), (1024, 2048)))
        return mismatch(
            (invariant_ops.linear_triton(x, w), invariant_ops.linear_ref(x, w)),
            (invariant_ops.linear_triton(x, wide), invariant_ops.linear_ref(x, wide)),
            (invariant_ops.linear_triton(long_x, long_w), invariant_ops.linear_ref(long_x, long_w)),
            (invariant_ops.rms_norm_triton(x, w[0], 1e-6), invariant_ops.rms_norm_ref(x, w[0], 1e-6)),
        )
    except Exception as exc:  # noqa: BLE001 - whatever stops the kernels is reported, and the model keeps its own
        return f"{type(exc).__name__}: {exc}"


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Replaces every nn.Linear and LLAMA_RMS_NORMS module of `model` in place (any device where Triton runs;
    the worker calls it for GPU models); returns how many it replaced. When the kernels fail a check on the
    model's device (kernels_fail), it replaces none and logs why: the model runs, not batch invariant."""
    reason = kernels_fail(model.device, model.dtype)
    if reason is not None:
        logger.error(
            "the batch-invariant kernels do not run on %s (%s): the model keeps its own layers, and speculation "
            "may change outputs at batch > 1",
            model.device,
            reason,
        )
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        # a linear kept in another dtype (fp32 routers, _keep_in_fp32_modules) keeps its own forward
        if (type(module) is torch.nn.Linear and module.weight.dtype == model.dtype)
        or type(module).__name__ in LLAMA_RMS_NORMS
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = InvariantLinear(module) if type(module) is torch.nn.Linear else InvariantRMSNorm(module)
        setattr(parent, child, replacement)
    logger.info("%d linear layers and RMSNorms run batch-invariant Triton kernels", len(targets))
    return len(targets)
