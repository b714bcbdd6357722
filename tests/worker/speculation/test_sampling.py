"""logits_to_probs / sample_from_probs / sample_rows / RequestSampling on hand-made inputs."""

import math

import pytest
import torch

from kernels import sampling_cpu
from kernels.rejection_sampler import race
from specdec.step import RequestSampling
from worker_service.speculation.keyed_random import STREAM_DRAFT, STREAM_TOKEN, keyed_exponential
from worker_service.speculation.sampling import (
    logits_to_probs,
    sample_from_probs,
    sample_rows,
    sampling_tensors,
)

# Probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled vocabulary order) as logits.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])  # [V=4]
LOGITS = PROBS.log()  # [V]


def probs_for(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:  # [V]
    """logits_to_probs on a single row."""
    return logits_to_probs(
        logits.unsqueeze(0), torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    )[0]


def test_greedy_rows_are_one_hot_on_the_argmax():
    probs = probs_for(LOGITS, temperature=0.0, top_k=2, top_p=0.3)  # [V]
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_temperature_scales_the_logits():
    torch.testing.assert_close(probs_for(LOGITS, temperature=0.5), torch.softmax(LOGITS * 2, dim=-1))
    torch.testing.assert_close(probs_for(LOGITS), PROBS)


def test_top_k_keeps_the_k_most_likely_tokens():
    torch.testing.assert_close(probs_for(LOGITS, top_k=2), torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    torch.testing.assert_close(probs_for(LOGITS, top_k=1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs_for(LOGITS, top_k=10), PROBS)  # k > V: everything


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.1, [0.0, 1.0, 0.0, 0.0]),  # the top token is always kept
        (0.75, [0.0, 0.5, 0.0, 0.3]),  # 0.5 < 0.75 <= 0.5 + 0.3
        (0.85, [0.15, 0.5, 0.0, 0.3]),
        (1.0, [0.15, 0.5, 0.05, 0.3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    expected = torch.tensor(expected)
    torch.testing.assert_close(probs_for(LOGITS, top_p=top_p), expected / expected.sum())


def test_top_k_applies_before_top_p():
    # top-k 3 renormalises the top token to 0.5/0.95 > 0.52, so top-p 0.52 keeps it
    # alone; on the raw probabilities (0.5 < 0.52) top-p would keep two tokens.
    torch.testing.assert_close(probs_for(LOGITS, top_k=3, top_p=0.52), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs_for(LOGITS, top_p=0.52), torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)


def test_top_p_one_keeps_tiny_tokens():
    logits = torch.tensor([0.0, -30.0, 5.0, -60.0])  # [V], tokens 1 and 3 far below float eps
    probs = probs_for(logits, top_p=1.0, top_k=4)
    assert bool((probs > 0).all())


def test_per_row_parameters_in_one_batch():
    params = [
        RequestSampling(temperature=0.0),
        RequestSampling(top_k=2),
        RequestSampling(top_p=0.75),
        RequestSampling(temperature=0.5, top_k=3, top_p=0.9),
        RequestSampling(),
    ]
    logits = torch.randn(len(params), 50, generator=torch.Generator().manual_seed(0))  # [N, V]
    probs = logits_to_probs(logits, *sampling_tensors(params))  # [N, V]
    for i, p in enumerate(params):
        alone = probs_for(logits[i], p.temperature, p.top_k, p.top_p)  # [V]
        torch.testing.assert_close(probs[i], alone)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(params)))
    assert int((probs[1] > 0).sum()) == 2


def test_sampling_tensors():
    params = [RequestSampling(0.7, 0.9, 0), RequestSampling(0.0, 1.0, 5)]
    temperature, top_k, top_p, min_p = sampling_tensors(params)
    torch.testing.assert_close(temperature, torch.tensor([0.7, 0.0]))
    assert top_k.tolist() == [0, 5] and top_k.dtype == torch.int64
    torch.testing.assert_close(top_p, torch.tensor([0.9, 1.0]))
    torch.testing.assert_close(min_p, torch.tensor([0.0, 0.0]))


def test_sample_from_probs_follows_the_distribution():
    num_rows = 50_000
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3]).expand(num_rows, 4)  # [N, V]
    seeds = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(num_rows)]  # many requests, one position
    tokens = sample_from_probs(probs, seeds, [77] * num_rows, STREAM_TOKEN)  # [N]
    empirical = torch.bincount(tokens, minlength=4).float() / num_rows  # [V]
    assert float(empirical[1]) == 0.0
    assert 0.5 * float((empirical - probs[0]).abs().sum()) < 0.01
    along_positions = sample_from_probs(probs, [5] * num_rows, range(num_rows), STREAM_TOKEN)  # one request
    empirical = torch.bincount(along_positions, minlength=4).float() / num_rows  # [V]
    assert 0.5 * float((empirical - probs[0]).abs().sum()) < 0.01


def test_greedy_one_hot_rows_sample_their_argmax():
    probs = torch.eye(5)[[3, 0, 4]]  # [N=3, V=5]
    for position in range(20):
        assert sample_from_probs(probs, [1, 2, 3], [position] * 3, STREAM_TOKEN).tolist() == [3, 0, 4]
        assert sample_from_probs(
            probs, [1, 2, 3], [position] * 3, STREAM_TOKEN, is_greedy=[True, False, True]
        ).tolist() == [3, 0, 4]


def test_seeded_rows_do_not_depend_on_the_batch():
    probs = torch.softmax(torch.randn(3, 100, generator=torch.Generator().manual_seed(1)), dim=-1)  # [3, V]
    alone = [int(sample_from_probs(probs[2:], [7], [p], STREAM_TOKEN)[0]) for p in range(10)]
    in_batch = [int(sample_from_probs(probs, [3, 1, 7], [p + 5, 0, p], STREAM_TOKEN)[2]) for p in range(10)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not a constant
    other_stream = [int(sample_from_probs(probs[2:], [7], [p], STREAM_DRAFT)[0]) for p in range(10)]
    assert other_stream != alone  # the draft's noise is not the target's


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_invalid_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RequestSampling(**kwargs)


def test_params_defaults_and_greedy():
    assert not RequestSampling().is_greedy
    assert RequestSampling(temperature=0).is_greedy
    assert RequestSampling(top_k=0).top_k == 0  # 0 = off, accepted
    assert RequestSampling(seed=2**64 - 1).seed == 2**64 - 1  # the whole uint64 range
    with pytest.raises(AttributeError):
        RequestSampling().temperature = 0.5  # frozen: validated once, never changed


ROW_PARAMS = [  # plain temperatures, and rows whose distribution logits_to_probs filters
    RequestSampling(temperature=0.8, seed=1),
    RequestSampling(temperature=1.0, top_p=0.9, seed=2),
    RequestSampling(temperature=1.0, seed=3),
    RequestSampling(temperature=0.6, top_k=40, seed=4),
    RequestSampling(temperature=1.2, min_p=0.05, seed=5),
    RequestSampling(temperature=0.3, seed=6),
]


def the_passes(logits, params, seeds, positions):
    """sample_rows' definition, pass by pass: the distribution, the keyed noise, the race."""
    probs = logits_to_probs(logits, *sampling_tensors(params))
    return race(probs, keyed_exponential(seeds, positions, STREAM_TOKEN, logits.shape[-1]))


@pytest.mark.parametrize("with_c", [True, False], ids=["c-pass", "torch-passes"])
def test_sample_rows_is_the_race_of_each_rows_distribution(with_c, monkeypatch):
    """sample_rows (on the CPU one C pass a row, or torch's passes without the C library) gives the tokens of
    logits_to_probs, the keyed noise and the race (here on every row of this data: they could differ only
    where two scores are within rounding), and a row's token does not depend on the others."""
    if not with_c:
        monkeypatch.setattr(sampling_cpu, "c_library", lambda: None)
    logits = torch.randn(len(ROW_PARAMS) * 4, 5000, generator=torch.Generator().manual_seed(3)) * 4  # [N, V]
    params = ROW_PARAMS * 4
    seeds = [p.seed for p in params]
    positions = [100 + i // len(ROW_PARAMS) for i in range(len(params))]
    tokens = sample_rows(logits, params, seeds, positions, STREAM_TOKEN)
    assert tokens.tolist() == the_passes(logits, params, seeds, positions).tolist()
    for row in (0, 1, 5, 22):
        alone = sample_rows(
            logits[row : row + 1], params[row : row + 1], seeds[row : row + 1], positions[row : row + 1], STREAM_TOKEN
        )
        assert int(alone[0]) == int(tokens[row])
    filtered_alone = sample_rows(logits[1::2], params[1::2], seeds[1::2], positions[1::2], STREAM_TOKEN)
    assert filtered_alone.tolist() == tokens[1::2].tolist()  # the filtered rows alone: their distributions only
    assert len(set(tokens.tolist())) > 12  # really sampled


def test_sample_rows_follows_the_temperatures_distribution():
    num_rows = 40_000
    logits = LOGITS.expand(num_rows, 4).contiguous()  # [N, V]
    params = [RequestSampling(temperature=0.5, seed=7)] * num_rows
    tokens = sample_rows(logits, params, [7] * num_rows, range(num_rows), STREAM_TOKEN)  # one request
    empirical = torch.bincount(tokens, minlength=4).double() / num_rows
    want = torch.softmax(LOGITS.double() / 0.5, dim=-1)
    assert float((empirical - want).abs().max()) < 5 * (0.25 / num_rows) ** 0.5
