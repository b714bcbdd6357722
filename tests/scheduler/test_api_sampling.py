"""Client sampling parameters into RequestSampling: defaults and messages a user can act on."""

import pytest

from scheduler_service.api import InvalidRequestError, sampling_params
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
