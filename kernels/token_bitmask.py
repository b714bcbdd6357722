"""Structured outputs' token masks applied to logits in place: a C kernel for the CPU's fp32 logits
(kernels/csrc/token_bitmask_cpu.c), and the PyTorch reference it equals bit for bit, which runs everywhere
else (GPU logits, other dtypes, no C compiler).

A mask is llguidance's bitmask (int32 words; bit t % 32 of word t // 32 set: token t allowed), built for the
model's output size and padded to whole words. The reference unpacks every row to a [V] bool and goes through
masked_fill: 0.42 ms for the six rows of a k = 5 verify step with a 49,152-token vocabulary on two cores;
the kernel reads each row's words once, 0.022 ms (bench/bench_constraint.py prints both).
"""

import ctypes
import functools

import torch

from kernels.cpu_build import optional_library


@functools.lru_cache(maxsize=1)
def c_library():
    """The C library, or None when it cannot be built here (logged once: the reference is used)."""
    return optional_library("token_bitmask_cpu", bind, "the PyTorch reference")


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the argument types of a build of kernels/csrc/token_bitmask_cpu.c (this machine's, or a test's
    narrower one)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    library.specdec_apply_token_bitmask.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64]
    library.specdec_apply_token_bitmask.restype = ctypes.c_int
    return library


def apply_token_bitmask_(
    logits: torch.Tensor,  # [N, V], changed in place
    rows: torch.Tensor,  # [R] int64: the row mask i covers
    bitmask: torch.Tensor,  # [R, W] int32, W * 32 >= V
    eos_token_ids: list[int],
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:  # another build (bind())
    """Sets logits[rows[i], t] to -inf for every token t that mask i forbids; a mask that allows no token
    allows the EOS ids instead. Returns `logits`."""
    if rows.numel() == 0:
        return logits
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == rows.numel()
    assert bitmask.shape[1] * 32 >= logits.shape[1], "the masks hold fewer bits than the vocabulary"
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        library = None
    elif library is None:
        library = c_library()
    if library is None or logits.stride(1) != 1:
        return apply_token_bitmask_reference(logits, rows, bitmask, eos_token_ids)
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.contiguous()
    eos = torch.tensor(eos_token_ids, dtype=torch.int64)
    status = library.specdec_apply_token_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[1],
        rows.data_ptr(),
        rows.numel(),
        bitmask.data_ptr(),
        bitmask.shape[1],
        eos.data_ptr(),
        eos.numel(),
    )
    assert status == 0, status
    return logits


def apply_token_bitmask_reference(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, eos_token_ids: list[int]
) -> torch.Tensor:
    """apply_token_bitmask_ in PyTorch ops."""
    num_vocab = logits.shape[-1]
    rows, packed = rows.to(logits.device), bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :num_vocab]  # [R, V]
    nothing = ~allowed.any(dim=1)
    if bool(nothing.any()):
        allowed[nothing.nonzero().squeeze(1).unsqueeze(1), torch.tensor(eos_token_ids, device=logits.device)] = True
    with torch.inference_mode():  # the scorer's logits are inference tensors
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
