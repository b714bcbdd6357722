"""OpenAI's request bodies (/v1/chat/completions, /v1/completions) and their mapping onto a GenerateRequest.

Only the shape is checked here (types, fields this server does not
implement); every value goes on to api.build_request, the one validation path
of both client APIs. No field that would change what is generated is dropped:
a field this server does not declare gets 400, unless it is one of
IGNORED_FIELDS (they change nothing generated) or is sent at its neutral value
(NEUTRAL_VALUES: e.g. `echo: false`, `tools: []`).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.v1 import generation_pb2 as pb

INT32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs (chat's top_logprobs: 20)

# Accepted and ignored: they change nothing this server generates (docs/serving.md lists them).
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
)
# Not implemented: accepted only at a neutral value (one that changes nothing; OpenAI's and vLLM's defaults).
NEUTRAL_VALUES: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "prompt_logprobs": (None, 0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
}
# The chat roles OpenAI clients send, mapped onto the roles the chat template knows (api.CHAT_ROLES).
ROLE_ALIASES = {"developer": "system"}


class InvalidParamError(ValueError):
    """A request this server does not support: 400, naming the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (unconstrained), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(BaseModel):
    """vLLM's `structured_outputs` body field (one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(BaseModel):
    """The sampling fields both endpoints share; `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
    `stop_token_ids` and `ignore_eos` are extensions (as in vLLM)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: INT32 | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    max_tokens: INT32 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[INT32] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: INT32 | None = None
    # OpenAI's booleans are nullable (clients send null for "unset"): None is False.
    ignore_eos: bool | None = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format, and vLLM's fields (structured_outputs, and the older
    # guided_json / guided_regex / guided_choice / guided_grammar); at most one may be set.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Raises InvalidParamError for a field this server does not implement set to a value that would change
        the output."""
        for name, value in (self.model_extra or {}).items():
            if name not in IGNORED_FIELDS and value not in NEUTRAL_VALUES.get(name, ()):
                raise InvalidParamError(name, f"'{name}' is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidParamError("stream_options", "stream_options is only allowed with stream: true")

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int = 0) -> pb.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        fields: dict[str, Any] = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=max_tokens,
            repetition_penalty=self.repetition_penalty,
        )
        return pb.SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            top_k=self.top_k or 0,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens or 0,
            structured_outputs=self._structured_outputs(),
            n=self.n,
        )

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's logit_bias: token ids as JSON object keys (strings)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidParamError("logit_bias", f"logit_bias keys must be token ids, got {key[:32]!r}") from None
        return bias

    def _structured_outputs(self) -> pb.StructuredOutputs | None:
        """The one constraint the body sets (its value is checked by api.build_request), or None."""
        given: list[tuple[str, pb.StructuredOutputs]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                given.append(("response_format", pb.StructuredOutputs(json_object=True)))
            else:
                spec = self.response_format.json_schema
                if spec is None or spec.schema_ is None:
                    raise InvalidParamError(
                        "response_format", "response_format of type json_schema needs json_schema.schema"
                    )
                given.append(("response_format", pb.StructuredOutputs(json=json.dumps(spec.schema_))))
        so = self.structured_outputs
        if so is not None:
            fields = {
                name: value
                for name, value in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                    ("json_object", so.json_object),
                )
                if value is not None
            }
            if len(fields) > 1:
                raise InvalidParamError(
                    "structured_outputs", f"structured_outputs sets {' and '.join(fields)}: set one"
                )
            for name, value in fields.items():
                given.append(("structured_outputs", _constraint(name, value)))
        for name, value in (
            ("guided_json", self.guided_json),
            ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice),
            ("guided_grammar", self.guided_grammar),
        ):
            if value is not None:
                given.append((name, _constraint(name.removeprefix("guided_"), value)))
        if len(given) > 1:
            raise InvalidParamError(given[1][0], f"{' and '.join(n for n, _ in given)} each set a constraint: set one")
        return given[0][1] if given else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _constraint(kind: str, value) -> pb.StructuredOutputs:
    if kind == "json":
        return pb.StructuredOutputs(json=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.Choice(choices=value))
    return pb.StructuredOutputs(**{kind: value})


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call in an assistant message (sent back with the tool's result)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_proto(self) -> pb.ChatMessage:
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        return pb.ChatMessage(
            role=ROLE_ALIASES.get(self.role, self.role),
            content=content or "",
            tool_calls=[
                pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in self.tool_calls or []
            ],
            tool_call_id=self.tool_call_id or "",
            name=self.name or "",
        )


class FunctionIn(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # arguments always follow the schema with "required" and a named function


class ToolIn(BaseModel):
    type: Literal["function"]
    function: FunctionIn

    def to_proto(self) -> pb.Tool:
        f = self.function
        parameters = json.dumps(f.parameters) if f.parameters is not None else ""
        return pb.Tool(name=f.name, description=f.description or "", parameters=parameters)


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    max_completion_tokens: INT32 | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def to_proto(self) -> pb.GenerateRequest:
        """The GenerateRequest of this body; raises InvalidParamError for what this server does not support."""
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParamError("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        sampling = self.sampling(max_tokens, bool(self.logprobs), self.top_logprobs or 0)
        request = pb.GenerateRequest(
            messages=[m.to_proto() for m in self.messages],
            sampling=sampling,
            tools=[t.to_proto() for t in self.tools or []],
        )
        if isinstance(self.tool_choice, str):
            request.tool_choice.mode = self.tool_choice
        elif self.tool_choice is not None:
            request.tool_choice.function = self.tool_choice.function.name
        if self.parallel_tool_calls is not None:
            request.parallel_tool_calls = self.parallel_tool_calls
        return request


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[str] | list[INT32] | list[list[INT32]]
    logprobs: int | None = None

    def to_proto(self) -> pb.GenerateRequest:
        """The GenerateRequest of this body; raises InvalidParamError for what this server does not support."""
        self.check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise InvalidParamError(
                "logprobs",
                f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}] (alternatives per token), got {self.logprobs}",
            )
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidParamError("prompt", f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        sampling = self.sampling(self.max_tokens, self.logprobs is not None, self.logprobs or 0)
        if isinstance(prompt, str):
            return pb.GenerateRequest(prompt=prompt, sampling=sampling)
        return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
