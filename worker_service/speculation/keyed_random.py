"""Counter-based randomness: every random number is a hash of its key, never drawn from a stateful generator.

A sampled token's noise depends only on (request seed, absolute token
position, stream, column), so a seeded request samples the same tokens alone
or batched, after preemption by recompute, on another worker, and with or
without n-gram speculation (worker_service/speculation/verify.py).

Key layout. The 64-bit seed is split into two 32-bit halves and everything is
uint32 arithmetic::

    row_key = fmix32(fmix32(fmix32(STREAM_SALT[stream] ^ seed_lo) ^ seed_hi) ^ position)
    bits[c] = fmix32(row_key ^ column_hash[c]),   column_hash[c] = fmix32(c ^ COLUMN_SALT)
    u       = ((bits >> 9) + 0.5) / 2**23          in (0, 1), exact in float32
    e       = -log(u)                              Exp(1), finite and > 0

``fmix32`` is murmur3's finaliser, a bijection on uint32 with full avalanche.
Each absorbing step ``fmix32(h ^ word)`` is a bijection of the new word, so for
one (seed, stream) distinct positions get distinct row keys, and in one row
distinct columns get distinct 32-bit values. Columns are mixed through their
own hash (not ``row_key + c * constant``) so two rows are never shifted copies
of each other. Streams separate the uses of one (seed, position):

    STREAM_TOKEN   the target's race noise over the vocabulary (sampled and recovered tokens)
    STREAM_ACCEPT  the uniform of the accept test of a model draft (one column)
    STREAM_DRAFT   the draft model's own race noise when it proposes

Row keys (a few dozen per step) are computed on the host in numpy uint32
arithmetic, where products wrap and shifts are logical by definition (as
tensor operations, a few dozen tiny ones per call would cost more than the
vocabulary-wide work). The vocabulary-wide part runs on the given device in
int32 tensors holding uint32 bit patterns: int32 products wrap modulo 2**32
(two's complement, on every backend torch runs on), which is exactly uint32
multiplication, and right shifts are made logical by masking off the sign
extension. That is about 3x cheaper on a CPU than int64 tensors masked with
``& 0xFFFFFFFF`` after every multiply, and gives the same bits (tested against
a plain Python-integer implementation).
"""

from __future__ import annotations

from collections.abc import Sequence
import functools

import numpy as np
import torch

from kernels import sampling_cpu
from specdec.step import MAX_SEED

STREAM_TOKEN = 0
STREAM_ACCEPT = 1
STREAM_DRAFT = 2
MAX_POSITION = 2**32 - 1
# Fractional digits of pi: arbitrary, distinct constants that make the streams' keys differ.
_STREAM_SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E)
_COLUMN_SALT = 0x9E3779B9  # the golden ratio in 32 bits
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_UNIFORM_BITS = 23  # k + 0.5 for k < 2**23 is exact in float32
_CPU_CHUNK_ELEMENTS = 1 << 18  # values (1 MB of int32) per pass on a CPU: see _keyed_floats


def signed32(value: int) -> int:
    """The int32 bit pattern of a uint32 value."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _fmix32_np(h: np.ndarray) -> np.ndarray:  # uint32, same shape
    """murmur3's 32-bit finaliser on a numpy uint32 array (unsigned: products wrap, shifts are logical)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_FMIX_C1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_FMIX_C2)
    return h ^ (h >> np.uint32(16))


def fmix32_(h: torch.Tensor) -> torch.Tensor:  # the same int32 tensor, mixed in place
    """murmur3's 32-bit finaliser on uint32 values held as int32 bit patterns, in place.

    ``h ^= h >>> s`` is an arithmetic shift into one scratch tensor whose sign
    extension is masked off: allocating a temporary per operation made this
    about 3x slower on a CPU.
    """
    scratch = torch.empty_like(h)
    for shift, multiplier in ((16, _FMIX_C1), (13, _FMIX_C2), (16, None)):
        torch.bitwise_right_shift(h, shift, out=scratch)
        scratch &= (1 << (32 - shift)) - 1  # now a logical shift
        h ^= scratch
        if multiplier is not None:
            h *= signed32(multiplier)  # wraps modulo 2**32: uint32 multiplication
    return h


def row_keys(seeds: Sequence[int], positions: Sequence[int], stream: int) -> np.ndarray:  # [N] uint32
    """The key of each row: the seed's halves, then the position, absorbed into the stream's salt."""
    for seed, position in zip(seeds, positions, strict=True):
        if not (0 <= seed <= MAX_SEED and 0 <= position <= MAX_POSITION):
            raise ValueError(
                f"need seeds in [0, 2**64) and positions in [0, 2**32), got seed {seed}, position {position}"
            )
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1)  # [N]
    positions = np.asarray(positions, dtype=np.uint64).reshape(-1).astype(np.uint32)  # [N]
    seed_lo = (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32)  # [N]
    seed_hi = (seeds >> np.uint64(32)).astype(np.uint32)  # [N]
    h = _fmix32_np(np.uint32(_STREAM_SALTS[stream]) ^ seed_lo)  # [N]
    h = _fmix32_np(h ^ seed_hi)  # [N]
    return _fmix32_np(h ^ positions)  # [N]


@functools.lru_cache(maxsize=8)
def _column_hashes(num_cols: int, device: torch.device) -> torch.Tensor:  # [C] int32 bit patterns
    return fmix32_(torch.arange(num_cols, dtype=torch.int32, device=device) ^ signed32(_COLUMN_SALT))


def _device_keys(seeds, positions, stream: int, device: torch.device) -> torch.Tensor:  # [N] int32 bit patterns
    return torch.from_numpy(row_keys(seeds, positions, stream).view(np.int32)).to(device)


def _bits(keys: torch.Tensor, num_cols: int) -> torch.Tensor:  # [N, num_cols] int32 bit patterns
    return fmix32_(keys.unsqueeze(1) ^ _column_hashes(num_cols, keys.device))  # [N, C]


def keyed_bits(
    seeds: Sequence[int],  # N request seeds in [0, 2**64)
    positions: Sequence[int],  # N absolute token positions
    stream: int,
    num_cols: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [N, num_cols] int32 bit patterns
    """32 random bits per (row, column), a pure function of (seed, position, stream, column)."""
    return _bits(_device_keys(seeds, positions, stream, torch.device(device)), num_cols)  # [N, C]


def uniform_from_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # float32 in (0, 1)
    """The top 23 bits k as ``(k + 0.5) / 2**23`` (``bits`` is consumed): exact in float32, so never 0 or 1.

    (With 24 bits, ``k + 0.5`` needs 25 significant bits and the largest k would
    round up to exactly 1.) The arithmetic shift gives k - 2**22; adding
    2**22 + 0.5 in float32 is exact.
    """
    shifted = bits.bitwise_right_shift_(32 - _UNIFORM_BITS)  # [...] in [-2**22, 2**22)
    out = torch.empty(bits.shape, dtype=torch.float32, device=bits.device) if out is None else out
    torch.add(shifted, 2.0 ** (_UNIFORM_BITS - 1) + 0.5, out=out)  # converts and adds in one pass
    return out.mul_(2.0**-_UNIFORM_BITS)


def noise_keys(seeds, positions, stream: int, num_cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The row keys ([N]) and column hashes ([num_cols]) of those rows' noise, int32 bit patterns on `device`:
    what the CPU's C passes hash (kernels/sampling_cpu.py)."""
    device = torch.device(device)
    return _device_keys(seeds, positions, stream, device), _column_hashes(num_cols, device)


def _keyed_floats(seeds, positions, stream, num_cols, device, exponential: bool) -> torch.Tensor:  # [N, num_cols]
    """bits -> uniform (-> ``-log``, in place), in chunks of rows that stay in a CPU's cache.

    On a CPU the ~17 elementwise passes are memory-bound: over 48 rows of a
    49152-token vocabulary (9 MB per pass) they took 2-3x longer per value
    than in chunks of 5 rows (1 MB). Where the C kernel builds, the whole is one
    pass of it: the same uniforms, and for the exponentials a log of our own
    (kernels/csrc/sampling_cpu.c: within 3e-7 of the exact value, the same bits on
    every build), which every CPU sampling path shares.
    """
    device = torch.device(device)
    keys = _device_keys(seeds, positions, stream, device)  # [N]
    out = torch.empty((len(keys), num_cols), dtype=torch.float32, device=device)  # [N, C]
    library = sampling_cpu.c_library() if device.type == "cpu" else None
    if library is not None:  # one C pass
        return sampling_cpu.keyed_noise_rows(keys, _column_hashes(num_cols, device), out, library, exponential)
    rows_per_chunk = len(keys) if device.type != "cpu" else max(1, _CPU_CHUNK_ELEMENTS // max(num_cols, 1))
    for start in range(0, len(keys), rows_per_chunk):
        uniform = uniform_from_bits(
            _bits(keys[start : start + rows_per_chunk], num_cols), out[start : start + rows_per_chunk]
        )
        if exponential:
            uniform.log_().neg_()
    return out


def keyed_uniform(
    seeds: Sequence[int],
    positions: Sequence[int],
    stream: int,
    num_cols: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [N, num_cols] float32 in (0, 1)
    """U(0, 1) samples keyed by (seed, position, stream, column); never exactly 0 or 1."""
    return _keyed_floats(seeds, positions, stream, num_cols, device, exponential=False)  # [N, C]


def keyed_exponential(
    seeds: Sequence[int],
    positions: Sequence[int],
    stream: int,
    num_cols: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [N, num_cols] float32, finite and > 0
    """Exp(1) samples keyed like :func:`keyed_uniform`: ``-log u``."""
    return _keyed_floats(seeds, positions, stream, num_cols, device, exponential=True)  # [N, C]
