"""Client requests (generation_pb2) into scheduler Requests: validation with messages a user can act on."""

from dataclasses import replace
import secrets
import uuid

from scheduler_service.request import Request
from scheduler_service.tokenizer import ChatTokenizer, TokenizerError
from specdec.step import RequestSampling
from specdec.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 128


class InvalidRequestError(ValueError):
    """Bad client input (INVALID_ARGUMENT)."""


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: ChatTokenizer, vocab_size: int) -> list[int]:
    """The prompt as token ids, from text, ids or chat messages."""
    kind = request.WhichOneof("prompt_input")
    try:
        if kind == "prompt":
            ids = tokenizer.encode(request.prompt)
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        elif kind == "messages":
            if not request.messages.messages:
                raise InvalidRequestError("messages is empty")
            ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content}
                                                 for m in request.messages.messages])
        else:
            raise InvalidRequestError("no prompt: set one of prompt, prompt_token_ids or messages")
    except TokenizerError as exc:
        raise InvalidRequestError(str(exc)) from exc
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    return ids


def sampling_params(s: pb.SamplingParams) -> RequestSampling:
    """The client's sampling parameters, validated by RequestSampling (unset fields take their defaults)."""
    try:
        return RequestSampling(temperature=s.temperature if s.HasField("temperature") else 1.0,
                               top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
                               seed=s.seed if s.HasField("seed") else None, logprobs=s.logprobs)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def with_arrival_seed(sampling: RequestSampling) -> RequestSampling:
    """A request without a seed gets a random 63-bit one when it arrives.

    The worker keys every random number by (seed, token position); with the
    seed fixed here, a request preempted (recompute) or moved to another
    worker goes on with exactly the tokens it would have produced otherwise.
    """
    return sampling if sampling.seed is not None else replace(sampling, seed=secrets.randbits(63))


def build_request(request: pb.GenerateRequest, tokenizer: ChatTokenizer, vocab_size: int,
                  eos_token_ids: list[int]) -> Request:
    """Validates a GenerateRequest and builds the scheduler's Request."""
    sampling = with_arrival_seed(sampling_params(request.sampling))
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be > 0, got {max_tokens}")
    bad_stop = [t for t in s.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    if any(not text for text in s.stop):
        raise InvalidRequestError("stop strings must not be empty")
    spec = request.speculation
    k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None
    if k is not None and k < 0:
        raise InvalidRequestError(f"num_speculative_tokens must be >= 0, got {k}")
    ids = prompt_token_ids(request, tokenizer, vocab_size)
    try:
        return Request(request_id=request.request_id or uuid.uuid4().hex, prompt_token_ids=ids,
                       max_tokens=max_tokens, sampling=sampling, stop_token_ids=list(s.stop_token_ids),
                       eos_token_ids=list(eos_token_ids), is_eos_ignored=s.ignore_eos, stop_strings=list(s.stop),
                       is_speculation_enabled=spec.enabled if spec.HasField("enabled") else True,
                       num_speculative_tokens=k)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
