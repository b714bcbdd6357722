"""Batch-invariant CPU linear layers: weights pre-packed for oneDNN.

Why: profiling SmolLM2 decode steps on the CPU showed ~70% of a step in
`aten::mm`. `F.linear` (MKL) in fp32 streams the weights at about half the
memory bandwidth for one row, and gets 1.5-2x slower again from 2 to 8 rows,
so a (k+1)-token verification step cost 1.3-1.5x a decode step. oneDNN with
the weight reordered once for a small batch (`_reorder_linear_weight`) is
nearly flat from 1 to 8 rows: a SmolLM2 forward at 500 tokens of context took
53 ms for 1 query token and 68 ms for 5 with `F.linear`, and 52 / 49 ms
packed (2-core AMD EPYC, median of 25; `bench/bench_spec.py` prints the step
times it sees).

Batch invariance: a row's result does not depend on how many rows share the
call (checked bitwise for 2..64 rows in fp32 and 1..64 in bf16; in fp32 a
lone row takes another kernel, so it is padded (see MIN_ROWS); `tests/worker/
test_fast_linear.py`). With the batch-invariant attention kernel
(kernels/paged_attention_cpu.py) a verification query's logits are bitwise
those of step-by-step decoding, in fp32 and bf16.

Projections that read the same input are fused: q/k/v of attention and
gate/up of the MLP become one packed matmul each (SHARED_INPUT_GROUPS), 4
calls per layer instead of 7. A decode step makes ~200 small oneDNN calls,
each with its own dispatch and thread fork/join: fusing took a SmolLM2 fp32
decode step from 37 to 34 ms and bf16 from 31 to 28 ms (median of 25, same
logits bitwise; 2-core AMD EPYC).

Other devices keep `torch.nn.Linear` (cuBLAS on a GPU).
"""

import logging

import torch

logger = logging.getLogger(__name__)

# Fewer rows are padded to this many: in fp32 one row takes another kernel (not batch invariant),
# and on the 2-core AMD EPYC we measured, 2 rows ran a SmolLM2 step ~15% slower than 3-4 rows (60 vs 52 ms).
MIN_ROWS = 4
BATCH_HINT = 8  # oneDNN picks the weight layout for this many rows; 1..64 all run fast with it
# Sibling projections a `transformers` decoder layer calls one after another on the same tensor
# (Llama, Mistral, Qwen2/3 names): each group is fused into one matmul (see SharedInputLinears).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedLinear(torch.nn.Module):
    """`torch.nn.Linear` with its weight reordered for oneDNN; rows are computed independently."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # An opaque oneDNN tensor: kept as a plain attribute (it has no storage to save or move).
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        num_rows = rows.shape[0]
        if num_rows < MIN_ROWS:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, MIN_ROWS - num_rows))  # zero rows below: one op
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed_weight, self.bias,
                                                 "none", [], "")  # [max(N, MIN_ROWS), out]
        return out[:num_rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class SharedInputLinears(torch.nn.Module):
    """Linear layers that read one input, as one PackedLinear over their stacked weights.

    The layer's code still calls each projection (a SharedInputSlice); the
    first call computes them all and the others take their slice, as long as
    they are handed the very same tensor object (`is`) and each takes its
    slice once: anything else is computed afresh, so a caller that does not
    follow the pattern is slower, never wrong. Once every slice is taken the
    group lets go of the input and the outputs (after a long prefill they are
    large, and the next step may be far off).
    """

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(out), in]
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                                device="meta")  # no initialisation: the parameters are set below
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        if fused.bias is not None:
            fused.bias = torch.nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]),
                                            requires_grad=False)
        self.fused = PackedLinear(fused)
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = []

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or self._outputs[index] is None:
            self._input, self._outputs = x, list(self.fused(x).split(self.sizes, dim=-1))
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input, self._outputs = None, []
        return out


class SharedInputSlice(torch.nn.Module):
    """One projection of a SharedInputLinears group, where the model calls it."""

    def __init__(self, group: SharedInputLinears, index: int):
        super().__init__()
        self.in_features, self.out_features = group.fused.in_features, group.sizes[index]
        self.index = index
        self._group = (group,)  # a tuple, not a submodule: the group is registered once, on the parent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group[0].output(x, self.index)


def fuse_shared_inputs(model: torch.nn.Module) -> int:
    """Fuses every SHARED_INPUT_GROUPS group of plain, same-shaped linears in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for names in SHARED_INPUT_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear for m in linears):
                continue
            if len({(m.in_features, m.weight.dtype, m.bias is None) for m in linears}) != 1:
                continue
            group = SharedInputLinears(linears)
            setattr(parent, "_".join(names), group)
            for index, name in enumerate(names):
                setattr(parent, name, SharedInputSlice(group, index))
            count += 1
    return count


def can_pack(model: torch.nn.Module) -> bool:
    """True for a CPU model in fp32, or bf16 where oneDNN has native bf16 kernels."""
    if model.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if model.dtype == torch.float32:
        return True
    return model.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every `torch.nn.Linear` of a CPU model by a PackedLinear in place, fusing the groups of
    SHARED_INPUT_GROUPS first; returns how many linears it replaced."""
    if not can_pack(model):
        return 0
    num_fused = fuse_shared_inputs(model)
    targets = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
    num_grouped = sum(len(m.sizes) for m in model.modules() if isinstance(m, SharedInputLinears))
    logger.info("packed %d linear layers for oneDNN (%s), %d of them in %d fused groups", len(targets) + num_grouped,
                model.dtype, num_grouped, num_fused)
    return len(targets) + num_grouped
