"""Client sampling parameters into RequestSampling: defaults and messages a user can act on."""

import pytest

from scheduler_service.frontends.api import InvalidRequestError, build_request, sampling_params
from specdec.step import RequestSampling
from specdec.v1 import generation_pb2 as pb


def test_unset_fields_take_the_defaults():
    assert sampling_params(pb.SamplingParams(), 256) == RequestSampling(temperature=1.0, top_p=1.0, top_k=0, seed=None)
    got = sampling_params(pb.SamplingParams(temperature=0.0, top_p=0.5, top_k=7, seed=2**64 - 1, logprobs=True), 256)
    assert got == RequestSampling(0.0, 0.5, 7, 2**64 - 1, True)
    assert not got.is_processed and got.repetition_penalty == 1.0 and got.min_p == 0.0


def test_processing_fields_reach_the_request_sampling():
    got = sampling_params(
        pb.SamplingParams(
            min_p=0.25,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.5,
            logit_bias={9: -100.0, 3: 2.5},
            min_tokens=4,
            logprobs=True,
            top_logprobs=5,
        ),
        256,
    )
    assert got == RequestSampling(
        min_p=0.25,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.5,
        logit_bias=((3, 2.5), (9, -100.0)),
        min_tokens=4,
        logprobs=True,
        top_logprobs=5,
    )


def test_min_tokens_holds_back_eos_and_the_stop_tokens_the_request_ends_on():
    def held(**sampling) -> tuple[int, ...]:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=pb.SamplingParams(**sampling))
        built = build_request(request, tokenizer=None, vocab_size=256, eos_token_ids=[2], max_model_len=64)
        return built.sampling.stop_token_ids

    assert held(min_tokens=3, stop_token_ids=[9, 7]) == (2, 7, 9)
    assert held(min_tokens=3, stop_token_ids=[9], ignore_eos=True) == (9,)
    assert held(stop_token_ids=[9]) == ()  # nothing to hold back without min_tokens


@pytest.mark.parametrize(
    "params, message",
    [
        (pb.SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        (pb.SamplingParams(temperature=float("inf")), "temperature must be >= 0"),
        (pb.SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (pb.SamplingParams(top_k=-1), "top_k must be an integer >= 0"),
        (pb.SamplingParams(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (pb.SamplingParams(presence_penalty=-2.5), r"presence_penalty must be in \[-2.0, 2.0\]"),
        (pb.SamplingParams(frequency_penalty=3), r"frequency_penalty must be in \[-2.0, 2.0\]"),
        (pb.SamplingParams(repetition_penalty=0), "repetition_penalty must be > 0"),
        (pb.SamplingParams(logit_bias={3: 150.0}), r"logit_bias values must be in \[-100.0, 100.0\]"),
        (pb.SamplingParams(logit_bias={300: 1.0}), r"logit_bias names token id 300, outside the vocabulary \[0, 256\)"),
        (pb.SamplingParams(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (pb.SamplingParams(top_logprobs=3), "top_logprobs needs logprobs"),
        (pb.SamplingParams(top_logprobs=21, logprobs=True), r"top_logprobs must be in \[0, 20\]"),
    ],
)
def test_bad_parameters_are_invalid_requests(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        sampling_params(params, 256)


@pytest.mark.parametrize(
    "sampling, message",
    [
        (pb.SamplingParams(min_tokens=9, max_tokens=8), "min_tokens 9 is more than max_tokens 8"),
        (
            pb.SamplingParams(min_tokens=2, structured_outputs=pb.StructuredOutputs(regex="a+")),
            "min_tokens cannot be combined with structured_outputs",
        ),
    ],
)
def test_min_tokens_that_cannot_hold_is_refused(sampling, message):
    request = pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=sampling)
    with pytest.raises(InvalidRequestError, match=message):
        build_request(request, None, 256, [2], 64, compile_constraint=lambda c: "grammar")


def test_requests_without_a_seed_get_one_at_arrival():
    def arrive(**sampling) -> int:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=pb.SamplingParams(**sampling))
        return build_request(request, tokenizer=None, vocab_size=256, eos_token_ids=[2], max_model_len=64).sampling.seed

    seeds = {arrive() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)  # random, 63 bits
    assert arrive(seed=7) == 7 and arrive(seed=2**64 - 1) == 2**64 - 1  # a client's seed is kept
