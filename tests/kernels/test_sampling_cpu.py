"""The sampler's CPU passes (kernels/sampling_cpu.py) against torch: argmax_last's indices, the race's tokens
and (in tests/worker/speculation/test_keyed_random.py) the keyed uniforms' values, on every build."""

import pytest
import torch

from kernels import cpu_build, sampling_cpu
from kernels.sampling_cpu import argmax_last, race_rows

NAN, INF = float("nan"), float("inf")
NARROWER_BUILDS = {"avx2": ("-march=x86-64-v3",), "scalar": ("-march=x86-64",)}
# Ties (the first maximum wins), NaN (it counts as the maximum: its first one), infinities, an all -inf row (0)
# and signed zeros (equal: the first), and torch's argmax of each row.
EDGE_ROWS = torch.tensor(
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
EDGE_ARGMAX = [1, 0, 1, 3, 1, 0, 0]


def build_library(build: str | None):
    """This machine's build of kernels/csrc/sampling_cpu.c (None), or a narrower one."""
    if build is None:
        return None
    return sampling_cpu.bind(cpu_build.load_library("sampling_cpu", NARROWER_BUILDS[build]))


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (6, 4099), (2, 3, 257), (5, 16), (3, 7), (0, 11)], ids=str)
def test_the_indices_of_torch_argmax(build, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    got = argmax_last(x, library=build_library(build))
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
def test_ties_nan_infinities_and_signed_zeros_as_torch(build):
    """The edge rows alone (the scalar loop), repeated to 42 values (two vectors, then the tail), and after 38
    values of -inf (the NaN or the maximum in the tail)."""
    library = build_library(build)
    wide = torch.cat([EDGE_ROWS.repeat(1, 10), torch.full((7, 2), -INF)], dim=1)
    wide[0, 5] = wide[0, 21] = 7.0  # ties in two vectors' lanes 5: the first vector's wins
    tail = torch.cat([torch.full((7, 38), -INF), EDGE_ROWS], dim=1)
    assert argmax_last(EDGE_ROWS, library=library).tolist() == EDGE_ROWS.argmax(dim=-1).tolist() == EDGE_ARGMAX
    for rows in (wide, tail):
        assert argmax_last(rows, library=library).tolist() == rows.argmax(dim=-1).tolist()
    assert argmax_last(EDGE_ROWS.to(torch.bfloat16), library=library).tolist() == EDGE_ARGMAX


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


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize("shape", [(49152,), (6, 49152), (2, 3, 1000), (4, 7), (5, 16), (3, 33), (0, 9)], ids=str)
def test_race_rows_picks_the_references_token(build, shape):
    """The C race gives the reference's index on every build (the AVX-512 lanes' first maxima, the scalar loop),
    ties, zero mass, NaN and underflow included."""
    library = build_library(build)
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


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize(
    "top_k, top_p",
    [(0, 0.5), (0, 0.9), (0, 0.99), (0, 0.999999), (1, 1.0), (5, 1.0), (50, 0.9), (1000, 0.95), (49152, 0.8), (0, 1.0)],
)
def test_top_k_top_p_rows_keep_the_references_tokens(build, top_k, top_p):
    """The tokens of sampling.py's sort-based reference and, to rounding, its probabilities: on rows whose mass
    sits in a few tokens (the first candidates suffice), on flat ones (they grow to the whole row) and on rows
    with -inf (min_p's cut). Where top_p's boundary falls in a tail of tokens each far below a float's rounding
    of the mass above them, the two roundings may cut it at different tokens: then both sets are the row's most
    likely tokens, one holds the other, and the extra tokens weigh less than 1e-5 together."""
    from worker_service.speculation.sampling import _top_k_top_p_probs

    generator = torch.Generator().manual_seed(top_k + int(top_p * 1000))
    scaled = torch.randn(6, 49152, generator=generator) * torch.tensor([[8.0], [3.0], [1.0], [0.3], [0.01], [2.0]])
    scaled[5, ::3] = -INF
    top_ks, top_ps = torch.full((6,), top_k), torch.full((6,), top_p)
    got = sampling_cpu.top_k_top_p_rows(scaled, top_ks, top_ps, library=build_library(build))
    want = _top_k_top_p_probs(scaled, top_ks, top_ps)
    full = torch.softmax(scaled.double(), dim=-1)
    for row in range(6):
        kept, kept_there = got[row] > 0, want[row] > 0
        if not torch.equal(kept, kept_there):  # one set holds the other, and the extra tokens weigh nothing
            smaller, larger = (kept, kept_there) if kept.sum() < kept_there.sum() else (kept_there, kept)
            assert bool((larger | ~smaller).all()) and top_p < 1
            assert float(scaled[row][larger & ~smaller].max()) <= float(scaled[row][smaller].min())
            assert float(full[row][larger & ~smaller].sum()) < 1e-5
            continue
        assert torch.equal(kept, kept_there)
        torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(6))
    assert torch.equal(got, sampling_cpu.top_k_top_p_rows(scaled, top_ks, top_ps))  # every build: the same bits


def test_top_k_top_p_rows_break_ties_by_the_lower_index():
    """Equal logits rank by index: top-k 3 of a flat row keeps tokens 0, 1 and 2, and top-p 0.5 of 10 equal
    tokens the first 5 (the mass above the 6th, 5 x 0.1, reaches 0.5)."""
    flat = torch.zeros(2, 10)
    got = sampling_cpu.top_k_top_p_rows(flat, torch.tensor([3, 0]), torch.tensor([1.0, 0.5]))
    assert (got[0] > 0).tolist() == [True] * 3 + [False] * 7
    assert (got[1] > 0).sum().item() in (5, 6)  # the 6th's mass above is 0.5 give or take a rounding
    assert (got[1] > 0).tolist()[:5] == [True] * 5 and not bool((got[1, 6:] > 0).any())


def keyed_inputs(num_rows: int, vocab: int, seed: int):
    """Logits with a few strong tokens and a long tail, -inf entries and a fully masked row; the noise keys of
    distinct (seed, position) rows."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator) * 3  # [R, V]
    logits[:, :: max(vocab // 7, 1)] = -INF  # masked tokens (a grammar's, a bias's)
    logits[0, :] = -INF
    logits[0, vocab // 2] = 1.0  # one token left: always it
    row_keys = torch.randint(-(2**31), 2**31 - 1, (num_rows,), dtype=torch.int32, generator=generator)
    column_hashes = torch.randint(-(2**31), 2**31 - 1, (vocab,), dtype=torch.int32, generator=generator)
    return logits, row_keys, column_hashes


def keyed_exponentials(row_keys, column_hashes, library=None):
    """The keyed Exp(1) noise of (row key, column hash), as keyed_random.py's C pass computes it."""
    out = torch.empty(row_keys.numel(), column_hashes.numel())
    return sampling_cpu.keyed_noise_rows(
        row_keys, column_hashes, out, library or sampling_cpu.c_library(), exponential=True
    )


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize("shape", [(1, 49152), (48, 4099), (5, 16), (3, 7)], ids=str)
def test_keyed_race_rows_on_a_distribution_is_the_race_against_the_keyed_noise(build, shape):
    """temperature 0: the values are a distribution, and the token is bitwise race_rows' against the noise of
    keyed_noise_rows(exponential=True), on every build; the noise is the same on every build."""
    library = build_library(build) or sampling_cpu.c_library()
    logits, row_keys, column_hashes = keyed_inputs(*shape, seed=shape[0] + shape[1])
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [R, V]: the masked row's NaN as no mass
    noise = keyed_exponentials(row_keys, column_hashes, library)
    assert torch.equal(noise, keyed_exponentials(row_keys, column_hashes))  # the same noise on every build
    got = sampling_cpu.keyed_race_rows(probs, torch.zeros(shape[0]), row_keys, column_hashes, library)
    assert torch.equal(got, race_reference(probs, noise))


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
@pytest.mark.parametrize("temperature", [1.0, 0.8, 0.05, 2.5])
def test_keyed_race_rows_on_logits_samples_torchs_softmax_at_the_temperature(build, temperature):
    """temperature > 0: the values are logits, the distribution their softmax at that temperature (our exp,
    unnormalised): the token torch's softmax and the same noise give on every row of this data (they could
    differ only where two scores are within rounding), the same tokens on every build, and the masked row's
    one token."""
    library = build_library(build) or sampling_cpu.c_library()
    logits, row_keys, column_hashes = keyed_inputs(64, 4099, seed=int(temperature * 100))
    temperatures = torch.full((64,), temperature)
    got = sampling_cpu.keyed_race_rows(logits, temperatures, row_keys, column_hashes, library)
    reference = race_reference(torch.softmax(logits / temperature, dim=-1), keyed_exponentials(row_keys, column_hashes))
    assert torch.equal(got, reference)
    assert torch.equal(got, sampling_cpu.keyed_race_rows(logits, temperatures, row_keys, column_hashes))
    assert int(got[0]) == 4099 // 2
    assert len(set(got.tolist())) > 32  # really sampled: different rows, different tokens


def test_keyed_race_rows_mixes_logit_rows_and_distribution_rows():
    """Each row is read as its own temperature says, whatever the other rows are; a row alone samples the token
    it samples in the batch."""
    logits, row_keys, column_hashes = keyed_inputs(6, 1000, seed=5)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    temperature = torch.tensor([0.7, 0.0, 1.0, 0.0, 1.3, 0.7])
    values = torch.where((temperature > 0).unsqueeze(1), logits, probs)  # [R, V]
    got = sampling_cpu.keyed_race_rows(values, temperature, row_keys, column_hashes)
    for row in range(6):
        alone = sampling_cpu.keyed_race_rows(
            values[row : row + 1], temperature[row : row + 1], row_keys[row : row + 1], column_hashes
        )
        assert int(alone[0]) == int(got[row])
    noise = keyed_exponentials(row_keys, column_hashes)
    assert got[[1, 3]].tolist() == race_reference(probs[[1, 3]], noise[[1, 3]]).tolist()


def test_keyed_race_rows_follows_the_softmax():
    """Over many keys, the tokens' frequencies are the softmax's at the temperature (4 tokens, 40,000 rows)."""
    num_rows, temperature = 40_000, 0.7
    logits = torch.tensor([1.0, -INF, 2.0, 1.5]).expand(num_rows, 4).contiguous()
    row_keys = torch.arange(num_rows, dtype=torch.int32) * 7919 + 13  # distinct keys
    column_hashes = torch.tensor([0x1234567, -0x7654321, 0x2468ACE, -0x1357BDF], dtype=torch.int32)
    tokens = sampling_cpu.keyed_race_rows(logits, torch.full((num_rows,), temperature), row_keys, column_hashes)
    empirical = torch.bincount(tokens, minlength=4).double() / num_rows
    want = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert float(empirical[1]) == 0.0
    assert float((empirical - want).abs().max()) < 5 * (0.25 / num_rows) ** 0.5


@pytest.mark.parametrize("build", [None, *NARROWER_BUILDS])
def test_softmax_last_is_torchs_within_rounding_and_the_same_on_every_build(build):
    library = build_library(build) or sampling_cpu.c_library()
    logits, _, _ = keyed_inputs(8, 49152, seed=11)
    logits[0] = torch.randn(49152)  # no masked row here: torch gives NaN for it, and so do we (below)
    got = sampling_cpu.softmax_last(logits, library=library)
    torch.testing.assert_close(got, torch.softmax(logits, dim=-1), rtol=2e-6, atol=1e-9)
    assert torch.equal(got, sampling_cpu.softmax_last(logits))
    assert bool((got[1:, :: 49152 // 7] == 0).all())  # -inf logits: no mass
    masked = torch.full((1, 16), -INF)
    assert bool(sampling_cpu.softmax_last(masked, library=library).isnan().all())
