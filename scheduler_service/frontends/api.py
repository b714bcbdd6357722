"""Client requests (generation_pb2) into scheduler Requests: validation with messages a user can act on."""

from collections.abc import Callable
from dataclasses import replace
import json
import secrets
import uuid

from scheduler_service.core.request import Request
from scheduler_service.frontends.tokenizer import ChatTokenizer, TokenizerError
from scheduler_service.frontends.tools import ToolPlan
from specdec.convert import shared_sampling_fields
from specdec.step import RequestSampling
from specdec.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 128
# Limits on what a client controls, checked before any expensive work (tokenising, scheduling).
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHAT_MESSAGES = 1024
MAX_CHARS_PER_TOKEN = 16  # a text prompt longer than max_model_len x this cannot fit: refused untokenised
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256


class InvalidRequestError(ValueError):
    """Bad client input (INVALID_ARGUMENT)."""


def _check_text_size(num_chars: int, max_model_len: int, what: str) -> None:
    max_chars = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > max_chars:
        raise InvalidRequestError(
            f"{what} has {num_chars} characters: more than max_model_len {max_model_len} "
            f"tokens can hold (at most {max_chars} characters)"
        )


PROMPT_INPUTS = ("prompt", "prompt_token_ids", "messages")


def _chat_messages(messages, max_model_len: int) -> list[dict]:
    """Validated chat messages: a known role each (a role is rendered into the template as it is); an
    assistant turn's tool calls and a tool turn's call id, as chat templates read them."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequestError(f"{len(messages)} chat messages: at most {MAX_CHAT_MESSAGES} are accepted")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role[:32]!r}")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}] has tool_calls: only an assistant turn makes calls")
    num_chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
    _check_text_size(num_chars, max_model_len, "the chat")
    return [_chat_message(m) for m in messages]


def _chat_message(m: pb.ChatMessage) -> dict:
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _json_or_text(arguments: str):
    """A call's arguments as templates expect them: the JSON object (as `transformers` passes it), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _prompt_input(request: pb.GenerateRequest | pb.CompleteRequest) -> str:
    """Which of PROMPT_INPUTS the request sets; exactly one must be (an empty list counts as unset)."""
    given = [
        name for name in PROMPT_INPUTS if (request.HasField(name) if name == "prompt" else len(getattr(request, name)))
    ]
    if len(given) != 1:
        got = " and ".join(given) if given else "none"
        raise InvalidRequestError(
            f"{'no prompt: ' if not given else ''}set exactly one of prompt, prompt_token_ids or messages, got {got}"
        )
    return given[0]


def prompt_token_ids(
    request: pb.GenerateRequest | pb.CompleteRequest,
    tokenizer: ChatTokenizer,
    vocab_size: int,
    max_model_len: int,
    tools: ToolPlan | None = None,
) -> list[int]:
    """The prompt as token ids, from text, ids or chat messages (rendered with the tools to offer)."""
    kind = _prompt_input(request)
    try:
        if kind == "prompt":
            _check_text_size(len(request.prompt), max_model_len, "the prompt")
            ids = tokenizer.encode(request.prompt)
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        else:
            template_tools = list(tools.template_tools) if tools is not None and tools.template_tools else None
            ids = tokenizer.apply_chat_template(_chat_messages(request.messages, max_model_len), template_tools)
    except TokenizerError as exc:
        raise InvalidRequestError(str(exc)) from exc
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    return ids


def sampling_params(s: pb.SamplingParams, vocab_size: int) -> RequestSampling:
    """The client's sampling parameters, validated by RequestSampling (unset fields take their defaults)."""
    bad = [t for t in s.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    try:
        return RequestSampling(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            **shared_sampling_fields(s),
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def with_arrival_seed(sampling: RequestSampling) -> RequestSampling:
    """A request without a seed gets a random 63-bit one when it arrives.

    The worker keys every random number by (seed, token position); with the
    seed fixed here, a request preempted (recompute) or moved to another
    worker goes on with exactly the tokens it would have produced otherwise.
    """
    return sampling if sampling.seed is not None else replace(sampling, seed=secrets.randbits(63))


def _check_stops(s: pb.SamplingParams, vocab_size: int) -> None:
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"{len(s.stop_token_ids)} stop token ids: at most {MAX_STOP_TOKEN_IDS}")
    bad_stop = [t for t in s.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{len(s.stop)} stop strings: at most {MAX_STOP_STRINGS}")
    if any(not text for text in s.stop):
        raise InvalidRequestError("stop strings must not be empty")
    too_long = [text for text in s.stop if len(text) > MAX_STOP_STRING_CHARS]
    if too_long:
        raise InvalidRequestError(f"a stop string has {len(too_long[0])} characters: at most {MAX_STOP_STRING_CHARS}")


def build_request(
    request: pb.GenerateRequest | pb.CompleteRequest,
    tokenizer: ChatTokenizer,
    vocab_size: int,
    eos_token_ids: list[int],
    max_model_len: int,
    compile_constraint: Callable[[pb.StructuredOutputs], str] | None = None,
    tools: ToolPlan | None = None,
) -> Request:
    """Validates a GenerateRequest or CompleteRequest (the same fields) and builds the scheduler's Request
    (cheap checks first; the structured-output constraint, compiled by `compile_constraint`, last). `tools`:
    the request's validated tools (tools.plan_tools), rendered into the chat and maybe constraining the output."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id has {len(request.request_id)} characters: at most {MAX_REQUEST_ID_CHARS}"
        )
    sampling = with_arrival_seed(sampling_params(request.sampling, vocab_size))
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be > 0, got {max_tokens}")
    if max_tokens is not None and max_tokens >= max_model_len:
        raise InvalidRequestError(
            f"max_tokens {max_tokens} does not fit: max_model_len is {max_model_len} tokens (prompt + output)"
        )
    _check_stops(s, vocab_size)
    spec = request.speculation
    k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None
    if k is not None and k < 0:
        raise InvalidRequestError(f"num_speculative_tokens must be >= 0, got {k}")
    ids = prompt_token_ids(request, tokenizer, vocab_size, max_model_len, tools)
    if max_tokens is None:  # unset: the default, or what is left of max_model_len
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_model_len - len(ids)))
    if len(ids) + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together more "
            f"than max_model_len {max_model_len}; lower max_tokens"
        )
    constraint = tools.constraint() if tools is not None and tools.is_constrained else s.structured_outputs
    is_constrained = constraint.WhichOneof("constraint") is not None
    for name, value in (("ignore_eos", s.ignore_eos), ("min_tokens", s.min_tokens)):
        if is_constrained and value:
            raise InvalidRequestError(
                f"{name} cannot be combined with structured_outputs: the output ends where its constraint does"
            )
    grammar = _grammar(constraint, compile_constraint) if is_constrained else ""
    try:
        return Request(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=list(s.stop_token_ids),
            eos_token_ids=list(eos_token_ids),
            is_eos_ignored=s.ignore_eos,
            stop_strings=list(s.stop),
            is_speculation_enabled=spec.enabled if spec.HasField("enabled") else True,
            num_speculative_tokens=k,
            grammar=grammar,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def _grammar(outputs: pb.StructuredOutputs, compile_constraint: Callable[[pb.StructuredOutputs], str] | None) -> str:
    """The compiled constraint (one is set); raises InvalidRequestError for a bad one."""
    if compile_constraint is None:
        raise InvalidRequestError(
            "this server cannot compile structured_outputs constraints (its tokenizer has no tokenizer.json)"
        )
    try:
        return compile_constraint(outputs)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
