"""Guarded Triton import and device helpers shared by the kernel modules.

Triton is optional: where it is missing (or cannot be imported on this
platform) ``HAS_TRITON`` is False, no kernel is defined, and the dispatchers
fall back to the PyTorch references.
"""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    HAS_TRITON = False

# Under Triton's interpreter (the CPU tests) the kernels multiply half-precision operands in fp32: the
# interpreter multiplies bf16 wrongly, and bf16 products are exact in fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Devices on which the dispatchers launch Triton kernels.
TRITON_DEVICE_TYPES = ("cuda", "xpu")


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on an accelerator and Triton is importable."""
    return HAS_TRITON and tensor.device.type in TRITON_DEVICE_TYPES


def num_search_steps(num_seqs: int) -> int:
    """Binary-search steps that locate a token among ``num_seqs`` sequences.

    The search interval starts ``num_seqs`` wide and halves (rounding up) each
    step, so ``ceil(log2(num_seqs))`` steps suffice; ``bit_length`` is an upper
    bound that changes only at powers of two (few recompilations).
    """
    return max(1, num_seqs.bit_length())


if HAS_TRITON:

    @triton.jit
    def find_sequence(query_start_loc_ptr, token, num_seqs, NUM_STEPS: tl.constexpr):
        """Index b of the sequence with query_start_loc[b] <= token < query_start_loc[b+1].

        ``token`` may be a scalar or a block of token indices. Invariant of the
        search: query_start_loc[lo] <= token < query_start_loc[hi]; empty
        sequences (repeated offsets) are skipped because the final ``hi`` is
        ``lo + 1``.
        """
        lo = token * 0
        hi = token * 0 + num_seqs
        for _ in tl.static_range(NUM_STEPS):
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid)
            is_left = start <= token
            lo = tl.where(is_left, mid, lo)
            hi = tl.where(is_left, hi, mid)
        return lo

    @triton.jit
    def rounded_to(x, DTYPE: tl.constexpr):
        """fp32 x rounded to DTYPE (to nearest, ties to even) and returned as fp32: where a kernel keeps
        an intermediate in the model's dtype, as torch does. bf16 is rounded on the bits, because a compiler may
        fold the pair of casts x.to(bf16).to(fp32) away (and then fuse the product and sum around it)."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
            return bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float32:
            return x
        else:
            return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def split_sums_added(part_ptr, offsets, mask, num_splits, rows_apart, row_stride):
        """((0 + part[0]) + part[1]) + ... in fp32 at `offsets` of part 0, part s starting rows_apart rows of
        row_stride elements after part s - 1: the order in which invariant_ops adds a linear's split sums, so a
        kernel that takes them (layer_ops) adds them as the linear's own second kernel would."""
        total = tl.zeros_like(offsets).to(tl.float32)
        part_size = (tl.zeros_like(offsets).to(tl.int64) + rows_apart) * row_stride  # in int64 lanes
        for split in range(0, num_splits):
            total += tl.load(part_ptr + split * part_size + offsets, mask=mask, other=0.0)
        return total
