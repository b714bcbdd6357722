"""Keyed (counter-based) randomness: the bits match a plain-integer reference, and the
uniforms are uniform, independent across positions, columns, seeds and streams."""

import math

import pytest
import torch

from kernels import cpu_build, sampling_cpu
from worker_service.speculation.keyed_random import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TOKEN,
    keyed_bits,
    keyed_exponential,
    keyed_uniform,
    row_keys,
    uniform_from_bits,
)

MASK = 0xFFFFFFFF
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK
    return h ^ (h >> 16)


def reference_bits(seed: int, position: int, stream: int, column: int) -> int:
    """The key layout of the module docstring, in Python integers."""
    salt = (0x243F6A88, 0x85A308D3, 0x13198A2E)[stream]
    key = fmix32(fmix32(fmix32(salt ^ (seed & MASK)) ^ (seed >> 32)) ^ position)
    return fmix32(key ^ fmix32(column ^ 0x9E3779B9))


@pytest.mark.parametrize("device", DEVICES)
def test_bits_match_the_integer_reference(device):
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    positions = [0, 1, 7, 2**31, 2**32 - 1, 100, 4096, 12345]
    for stream in (STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT):
        bits = keyed_bits(seeds, positions, stream, 300, device).cpu()  # [8, 300]
        for row, (seed, position) in enumerate(zip(seeds, positions)):
            for col in (0, 1, 2, 150, 299):
                assert int(bits[row, col]) & MASK == reference_bits(seed, position, stream, col)


@pytest.mark.parametrize("build", ["native", "scalar"])
def test_the_c_pass_gives_the_torch_passes_values(build, monkeypatch):
    """On the CPU the bits and the uniform are one C pass (kernels/sampling_cpu.py): bitwise the values of the
    torch passes, and of the integer reference, extreme keys included, on a plain x86-64 build too. The
    exponentials' log is the C pass's own: within 3e-7 of the exact value, bitwise the same on every build."""
    seeds = [0, 1, 2**32 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    positions = [0, 7, 2**31, 2**32 - 1, 100, 12345]
    native_exponential = keyed_exponential(seeds, positions, STREAM_TOKEN, 49152)
    if build == "scalar":
        scalar = sampling_cpu.bind(cpu_build.load_library("sampling_cpu", ("-march=x86-64",)))
        monkeypatch.setattr(sampling_cpu, "c_library", lambda: scalar)
    assert sampling_cpu.c_library() is not None
    with_c = {stream: keyed_uniform(seeds, positions, stream, 49152) for stream in (STREAM_TOKEN, STREAM_DRAFT)}
    exponential_c = keyed_exponential(seeds, positions, STREAM_TOKEN, 49152)
    assert torch.equal(exponential_c, native_exponential)
    monkeypatch.setattr(sampling_cpu, "c_library", lambda: None)
    for stream, values in with_c.items():
        assert torch.equal(values, keyed_uniform(seeds, positions, stream, 49152))
        bits = [reference_bits(seeds[1], positions[1], stream, col) for col in (0, 4099, 49151)]
        want = [((b - (1 << 32) if b >= 1 << 31 else b) >> 9) + 2**22 + 0.5 for b in bits]
        assert values[1, [0, 4099, 49151]].tolist() == [w * 2**-23 for w in want]
    exact = -torch.log(with_c[STREAM_TOKEN].double())
    assert float(((exponential_c.double() - exact).abs() / exact).max()) < 3e-7


@pytest.mark.parametrize("build", ["native", "scalar"])
def test_the_c_log_at_the_uniforms_extremes_and_every_binade(build):
    """-log u by the C passes' polynomial for every u the keyed uniforms can take near 0 and 1, and around each
    power of two between: finite, > 0, within 3e-7 of the exact value, the same bits on both builds."""
    flags = ("-march=x86-64",) if build == "scalar" else ()
    library = sampling_cpu.bind(cpu_build.load_library("sampling_cpu", flags))
    k = [*range(4096), *range(2**23 - 4096, 2**23), *(2**shift + d for shift in range(23) for d in range(-3, 4))]
    k = torch.cat(
        [
            torch.tensor(k).clamp(0, 2**23 - 1),
            torch.randint(0, 2**23, (100_000,), generator=torch.Generator().manual_seed(0)),
        ]
    )
    u = (k.double() + 0.5) * 2**-23  # the uniforms' values, exact in float32
    e = sampling_cpu.neg_log_unit(u.float(), library)
    exact = -torch.log(u)
    assert bool((torch.isfinite(e) & (e > 0)).all())
    assert float(((e.double() - exact).abs() / exact).max()) < 3e-7
    assert torch.equal(e, sampling_cpu.neg_log_unit(u.float(), sampling_cpu.c_library()))


def test_uniform_is_strictly_inside_0_1_at_the_extremes():
    extremes = torch.tensor([-1, 0, 2**31 - 1, -(2**31), 511, -512], dtype=torch.int32)  # all-ones, zeros, ...
    u = uniform_from_bits(extremes.clone())
    assert bool(((u > 0) & (u < 1)).all())
    assert float(u.max()) == 1 - 2**-24 and float(u.min()) == 2**-24
    e = -torch.log(u)
    assert bool((torch.isfinite(e) & (e > 0)).all())


def test_same_key_same_value_whatever_the_batch():
    seeds, positions = [5, 9, 2**64 - 1, 5], [10, 10, 3, 11]
    batch = keyed_exponential(seeds, positions, STREAM_TOKEN, 49152)  # [4, V], chunked on a CPU
    for row in range(4):
        alone = keyed_exponential([seeds[row]], [positions[row]], STREAM_TOKEN, 49152)  # [1, V]
        assert torch.equal(alone[0], batch[row])
    many = keyed_exponential(seeds * 10, positions * 10, STREAM_TOKEN, 49152)  # other chunk boundaries
    assert torch.equal(many[-4:], batch)
    assert torch.equal(keyed_uniform([5], [10], STREAM_ACCEPT, 3), keyed_uniform([5], [10], STREAM_ACCEPT, 3))


def test_row_keys_of_one_seed_are_distinct():
    for stream in (STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT):
        keys = row_keys([42] * 100_000, range(100_000), stream)
        assert len(set(keys.tolist())) == 100_000  # a bijection of the position


def test_bad_keys_raise_value_error():
    with pytest.raises(ValueError, match=r"seeds in \[0, 2\*\*64\)"):
        keyed_uniform([-1], [0], STREAM_TOKEN, 4)
    with pytest.raises(ValueError, match=r"positions in \[0, 2\*\*32\)"):
        keyed_uniform([1], [2**32], STREAM_TOKEN, 4)


def test_uniform_moments_and_histogram():
    u = keyed_uniform(list(range(64)), [1000] * 64, STREAM_TOKEN, 49152).flatten().double()  # 3.1M values
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # the sample variance: Var((u - 1/2)^2) = 1/180
    counts = torch.histc(u, bins=100, min=0, max=1)  # [100]
    chi2 = float(((counts - n / 100) ** 2 / (n / 100)).sum())
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)  # df = 99, 5 sigma
    e = keyed_exponential(list(range(64)), [7] * 64, STREAM_TOKEN, 49152).flatten().double()
    assert abs(float(e.mean()) - 1) < 5 / math.sqrt(n) and abs(float(e.var()) - 1) < 5 * math.sqrt(8 / n)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize(
    "name, seeds_a, positions_a, seeds_b, positions_b",
    [
        ("neighbouring positions", [3] * 64, range(64), [3] * 64, range(1, 65)),
        ("neighbouring seeds", range(64), [500] * 64, range(1, 65), [500] * 64),
        ("seeds 2**32 apart (high half)", range(64), [500] * 64, range(2**32, 2**32 + 64), [500] * 64),
        ("positions 2**16 apart", [3] * 64, range(64), [3] * 64, range(2**16, 2**16 + 64)),
    ],
)
def test_no_correlation_between_neighbouring_keys(name, seeds_a, positions_a, seeds_b, positions_b):
    a = keyed_uniform(list(seeds_a), list(positions_a), STREAM_TOKEN, 8192)  # [64, C]
    b = keyed_uniform(list(seeds_b), list(positions_b), STREAM_TOKEN, 8192)
    bound = 5 / math.sqrt(a.numel())
    assert abs(correlation(a, b)) < bound, name
    assert abs(correlation(a[:, :-1], a[:, 1:])) < bound  # neighbouring columns
    assert abs(correlation(a[:-1], a[1:])) < bound  # neighbouring rows of one call
    assert not torch.equal(a, b)


def test_streams_are_independent():
    seeds, positions = list(range(32)), list(range(100, 132))
    by_stream = [keyed_uniform(seeds, positions, s, 8192) for s in (STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT)]
    bound = 5 / math.sqrt(by_stream[0].numel())
    for i in range(3):
        for j in range(i + 1, 3):
            assert float((by_stream[i] == by_stream[j]).float().mean()) < 1e-3  # different values
            assert abs(correlation(by_stream[i], by_stream[j])) < bound
