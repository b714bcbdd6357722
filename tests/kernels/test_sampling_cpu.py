"""argmax_last against torch's argmax: the same indices, the CPU path through numpy included."""

import pytest
import torch

from kernels import cpu_build, sampling_cpu
from kernels.sampling_cpu import argmax_last, race_rows

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (6, 4099), (2, 3, 257), (0, 11)], ids=str)
def test_the_indices_of_torch_argmax(dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    got = argmax_last(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_ties_nan_infinities_and_signed_zeros_as_torch():
    """Ties go to the first maximum, a NaN counts as the maximum (its first one), -inf rows give 0."""
    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],
            [5.0, 5.0, 5.0, 5.0],
            [1.0, NAN, 3.0, NAN],
            [INF, 2.0, INF, NAN],
            [1.0, INF, INF, -INF],
            [-INF, -INF, -INF, -INF],
            [-0.0, 0.0, -0.0, 0.0],
        ]
    )
    assert argmax_last(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 1, 3, 1, 0, 0]
    assert argmax_last(x.to(torch.bfloat16)).tolist() == [1, 0, 1, 3, 1, 0, 0]


def test_strided_rows_and_a_row_alone():
    x = torch.randn(8, 200)
    assert torch.equal(argmax_last(x[:, ::3]), x[:, ::3].argmax(dim=-1))
    assert torch.equal(argmax_last(x.t()), x.t().argmax(dim=-1))
    for i in range(8):  # a row's index does not depend on the rows beside it
        assert argmax_last(x[i : i + 1]).item() == argmax_last(x)[i].item()
    assert argmax_last(x[3]).dim() == 0 and argmax_last(x[3]).item() == x[3].argmax().item()


def race_reference(dist: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return torch.where(dist > 0, dist / noise, torch.full_like(dist, -1.0)).argmax(dim=-1)


def race_inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities with zeros (a top-k cut), underflowing tiny masses, a NaN row entry and exact ties."""
    generator = torch.Generator().manual_seed(seed)
    dist = torch.softmax(torch.randn(shape, generator=generator) * 3, dim=-1)
    dist[torch.rand(shape, generator=generator) < 0.3] = 0.0
    dist[..., :3] = torch.tensor([1e-45, 0.0, float("nan")])[: min(3, shape[-1])]
    noise = -torch.rand(shape, generator=generator).clamp_min(1e-7).log()
    if shape[-1] > 40:  # two tokens with the same score: the first one wins
        dist[..., 37], noise[..., 37] = 0.9, 0.5
        dist[..., 39], noise[..., 39] = 0.9, 0.5
    return dist, noise


NARROWER_BUILDS = {"avx2": ("-march=x86-64-v3",), "scalar": ("-march=x86-64",)}


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize("shape", [(49152,), (6, 49152), (2, 3, 1000), (4, 7), (5, 16), (3, 33), (0, 9)], ids=str)
def test_race_rows_picks_the_references_token(build, shape):
    """The C race gives the reference's index on every build (the AVX-512 lanes' first maxima, the scalar loop),
    ties, zero mass, NaN and underflow included."""
    library = None
    if build is not None:
        library = sampling_cpu.bind(cpu_build.load_library("sampling_cpu", NARROWER_BUILDS[build]))
    dist, noise = race_inputs(shape, seed=len(shape) + shape[-1])
    got = race_rows(dist, noise, library=library)
    assert got.dtype == torch.int64 and torch.equal(got, race_reference(dist, noise))


def test_race_rows_of_strided_and_other_dtypes():
    dist, noise = race_inputs((8, 300), seed=3)
    assert torch.equal(race_rows(dist[::2], noise[::2]), race_reference(dist[::2], noise[::2]))
    assert torch.equal(race_rows(dist[:, ::2], noise[:, ::2]), race_reference(dist[:, ::2], noise[:, ::2]))
    as_double = race_rows(dist.double(), noise.double())  # torch's ops: not the C path, the same rule
    assert torch.equal(as_double, race_reference(dist.double(), noise.double()))


def test_ties_go_to_the_first_token_where_the_scores_are_equal():
    dist = torch.zeros(2, 64)
    dist[:, [5, 21, 50]] = 0.5  # lanes 5 of three vectors: the first one must win
    noise = torch.ones(2, 64)
    assert race_rows(dist, noise).tolist() == [5, 5]
    dist[1, 50] = 0.6
    assert race_rows(dist, noise).tolist() == [5, 50]
