"""Client sampling parameters into RequestSampling: defaults and messages a user can act on."""

import pytest

from scheduler_service.frontends.api import InvalidRequestError, build_request, sampling_params
from specdec.step import RequestSampling
from specdec.v1 import generation_pb2 as pb


def test_unset_fields_take_the_defaults():
    assert sampling_params(pb.SamplingParams()) == RequestSampling(temperature=1.0, top_p=1.0, top_k=0, seed=None)
    got = sampling_params(pb.SamplingParams(temperature=0.0, top_p=0.5, top_k=7, seed=2**64 - 1, logprobs=True))
    assert got == RequestSampling(0.0, 0.5, 7, 2**64 - 1, True)


@pytest.mark.parametrize(
    "params, message",
    [
        (pb.SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        (pb.SamplingParams(temperature=float("inf")), "temperature must be >= 0"),
        (pb.SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (pb.SamplingParams(top_k=-1), "top_k must be an integer >= 0"),
    ],
)
def test_bad_parameters_are_invalid_requests(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        sampling_params(params)


def test_requests_without_a_seed_get_one_at_arrival():
    def arrive(**sampling) -> int:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=pb.SamplingParams(**sampling))
        return build_request(request, tokenizer=None, vocab_size=256, eos_token_ids=[2], max_model_len=64).sampling.seed

    seeds = {arrive() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)  # random, 63 bits
    assert arrive(seed=7) == 7 and arrive(seed=2**64 - 1) == 2**64 - 1  # a client's seed is kept
