"""The sampler's vocabulary-wide passes on the CPU, where torch's kernels are slow.

`argmax_last(x)` is `x.argmax(dim=-1)`: per row, the index of the first maximum, a NaN counting as the
maximum. torch 2.x's CPU argmax walks a row element by element: on the Intel kind (`lscpu` family 6 model
167, 2 threads) it took 157 µs for one 49,152-token row of logits, 0.93 ms for the 6 rows of a verify step
and 4.6 ms for 48 (8 sequences of k = 5), where numpy's vectorised argmax took 31.5 µs for 6 rows. On the CPU
the rows go through a C pass instead (bf16 and fp16 widened to fp32 first, exactly), which gives torch's
indices (ties, NaN, infinities and signed zeros alike; tests/kernels/test_sampling_cpu.py); elsewhere,
torch's. Not numpy's: reading a tensor into numpy is what a GPU's host read looks like to
tests/worker/runtime/test_host_reads.py. Each row's index depends on that row alone: batch invariant.

`keyed_noise_rows` computes worker_service/speculation/keyed_random.py's keyed uniforms in one pass where
torch took ~15 elementwise ones: bitwise the same values. With `exponential=True` it gives the sampling noise
-log u, the log our own polynomial (no division; within 3e-7 of the exact value, the same bits on every build).

`softmax_last` is torch's softmax with our own exp (kernels/csrc/exp_poly.h) and a fixed order of summation:
within a few ulp of torch's, the same bits on every build.

`keyed_race_rows` samples a token per row in one pass with no [rows, vocabulary] temporaries: the softmax's
weights at the row's temperature (or a given distribution), the keyed noise and the race. A sampled verify
step of 8 sequences at k = 5 took ~9 ms in torch's softmax, its division by the temperature, torch's log and
these passes one by one, and ~4 ms so (bench/bench_verify.py).

`top_k_top_p_rows` is worker_service/speculation/sampling.py's top-k / top-p distribution without sorting
each row: torch's sort took 2.6 ms a row of 49,152 (21 ms for a verify step's 6 rows, 175 ms for 48).

`race_rows(dist, noise)` is kernels/rejection_sampler.py's race, `argmax(where(dist > 0, dist / noise, -1))`:
a sampled token. On the CPU (fp32) it runs as one C pass (kernels/csrc/sampling_cpu.c): the reference's four
vocabulary-wide temporaries and torch's argmax made it the largest part of a sampled verify step.
"""

import ctypes
import functools

import torch

from kernels.cpu_build import optional_library


def argmax_last(x: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` (int64, shape x.shape[:-1]); x a floating tensor with a non-empty last dim. `library`:
    another build (bind())."""
    library = _library_for(library, x, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if library is None or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    rows = _rows(x.float())  # bf16 and fp16 widened exactly
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    library.specdec_argmax_rows(
        rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out.reshape(x.shape[:-1])


def _library_for(library: ctypes.CDLL | None, *tensors: torch.Tensor, dtypes=(torch.float32,)) -> ctypes.CDLL | None:
    """The build to run on `tensors` (`library` if given, else this machine's), or None where torch's ops must:
    a tensor not on the CPU or not of `dtypes`, or no build here."""
    if any(t.device.type != "cpu" or t.dtype not in dtypes for t in tensors):
        return None
    return library if library is not None else c_library()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] as [R, V] rows, each contiguous (the kernels' layout; a copy only where it is not)."""
    rows = x.detach().reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


@functools.lru_cache(maxsize=1)
def c_library() -> ctypes.CDLL | None:
    """The sampler's C library, or None when it cannot be built here (logged once: torch's ops are used)."""
    return optional_library("sampling_cpu", bind, "torch's ops")


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the argument types of a build of kernels/csrc/sampling_cpu.c (this machine's, or a test's narrower
    one)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    library.specdec_race_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
    library.specdec_race_rows.restype = ctypes.c_int
    library.specdec_keyed_noise_rows.argtypes = [ptr, i64, ptr, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
    library.specdec_keyed_noise_rows.restype = ctypes.c_int
    library.specdec_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    library.specdec_argmax_rows.restype = ctypes.c_int
    library.specdec_top_k_top_p_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    library.specdec_top_k_top_p_rows.restype = ctypes.c_int
    library.specdec_neg_log_unit.argtypes = [ptr, i64, ptr]
    library.specdec_neg_log_unit.restype = ctypes.c_int
    library.specdec_softmax_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
    library.specdec_softmax_rows.restype = ctypes.c_int
    library.specdec_keyed_race_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    library.specdec_keyed_race_rows.restype = ctypes.c_int
    return library


def race_rows(dist: torch.Tensor, noise: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``argmax(where(dist > 0, dist / noise, -1), dim=-1)`` (int64, shape dist.shape[:-1]); dist [..., V]
    non-negative, noise [..., V] positive and finite. `library`: another build (bind())."""
    library = _library_for(library, dist, noise)
    if library is None or dist.shape != noise.shape or dist.shape[-1] == 0:
        return argmax_last(torch.where(dist > 0, dist / noise, torch.full_like(dist, -1.0)))
    vocab = dist.shape[-1]
    rows_of_dist, rows_of_noise = _rows(dist), _rows(noise)
    out = torch.empty(rows_of_dist.shape[0], dtype=torch.int64)
    library.specdec_race_rows(
        rows_of_dist.data_ptr(),
        rows_of_dist.stride(0),
        rows_of_noise.data_ptr(),
        rows_of_noise.stride(0),
        rows_of_dist.shape[0],
        vocab,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.reshape(dist.shape[:-1])


def keyed_noise_rows(
    row_keys: torch.Tensor,  # [N] int32: uint32 bit patterns
    column_hashes: torch.Tensor,  # [C] int32: uint32 bit patterns
    out: torch.Tensor,  # [N, C] float32, its rows contiguous
    library: ctypes.CDLL,
    exponential: bool = False,
) -> torch.Tensor:
    """worker_service/speculation/keyed_random.py's uniforms of (row key, column) into `out`, in one C pass:
    bitwise its torch passes' values (exact integer hashing and float operations). `exponential`: -log of
    them instead, the log our own polynomial (within 3e-7 of the exact value; the same bits on every build).
    Returns `out`."""
    assert row_keys.dtype == column_hashes.dtype == torch.int32 and out.dtype == torch.float32
    assert out.shape == (row_keys.numel(), column_hashes.numel()) and out.stride(1) == 1
    row_keys, column_hashes = row_keys.contiguous(), column_hashes.contiguous()
    library.specdec_keyed_noise_rows(
        row_keys.data_ptr(),
        row_keys.numel(),
        column_hashes.data_ptr(),
        column_hashes.numel(),
        int(exponential),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def neg_log_unit(u: torch.Tensor, library: ctypes.CDLL) -> torch.Tensor:
    """-log u (u: float32 in (0, 1)) by the polynomial the keyed exponentials use (its tests look at it)."""
    u = u.contiguous()
    out = torch.empty_like(u)
    library.specdec_neg_log_unit(u.data_ptr(), u.numel(), out.data_ptr())
    return out


def softmax_last(x: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """`torch.softmax(x, dim=-1)`; on the CPU (fp32) one C pass per row with our own exp and a fixed order of
    summation, so every build gives the same bits (within a few ulp of torch's values). `library`: another
    build (bind())."""
    library = _library_for(library, x)
    if library is None or x.shape[-1] == 0:
        return torch.softmax(x, dim=-1)
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.float32)
    library.specdec_softmax_rows(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        rows.shape[1],
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out.reshape(x.shape)


def keyed_race_rows(
    values: torch.Tensor,  # [N, V] float32: logits (temperature > 0) or a distribution (temperature 0)
    temperature: torch.Tensor,  # [N] float32
    row_keys: torch.Tensor,  # [N] int32: the noise's row keys (uint32 bit patterns)
    column_hashes: torch.Tensor,  # [V] int32: its column hashes
    library: ctypes.CDLL | None = None,
) -> torch.Tensor | None:  # [N] int64
    """Each row's sampled token in one C pass, with no [N, V] temporaries: the race of its distribution
    (`softmax_last(values / temperature)` where the temperature is above 0, else the row itself) against the
    keyed Exp(1) noise that `keyed_noise_rows(..., exponential=True)` computes, bitwise `race_rows` of those.
    None where it does not apply (not the CPU's fp32, no C library): the caller's passes then. `library`:
    another build (bind())."""
    library = _library_for(library, values)
    if library is None or values.dim() != 2 or values.shape[-1] == 0:
        return None
    assert row_keys.dtype == column_hashes.dtype == torch.int32 and column_hashes.numel() == values.shape[1]
    rows = _rows(values)
    temperature = temperature.to(device="cpu", dtype=torch.float32).contiguous()
    row_keys, column_hashes = row_keys.contiguous(), column_hashes.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    status = library.specdec_keyed_race_rows(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        rows.shape[1],
        temperature.data_ptr(),
        row_keys.data_ptr(),
        column_hashes.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def top_k_top_p_rows(
    scaled: torch.Tensor,  # [N, V] float32: temperature-scaled logits
    top_k: torch.Tensor,  # [N] int: 0 = off
    top_p: torch.Tensor,  # [N] float: 1 = off
    library: ctypes.CDLL | None = None,
) -> torch.Tensor | None:  # [N, V] float32
    """worker_service/speculation/sampling.py's top-k then top-p distribution per row, without sorting the
    vocabulary (kernels/csrc/sampling_cpu.c); None where it does not apply (not the CPU's fp32, no C library):
    the caller's torch path then. `library`: another build (bind())."""
    library = _library_for(library, scaled)
    if library is None or scaled.dim() != 2:
        return None
    rows = _rows(scaled)
    top_k = top_k.to(device="cpu", dtype=torch.int64).contiguous()
    top_p = top_p.to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32)
    status = library.specdec_top_k_top_p_rows(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        rows.shape[1],
        top_k.data_ptr(),
        top_p.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out if status == 0 else None
