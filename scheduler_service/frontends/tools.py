"""Tool calling: a request's tools validated, what its tool_choice does to the generation, and its calls read
back out of the output text, whole or as it streams.

- "none": the tools are not rendered; the output is plain text.
- "auto": the chat template renders the tools; the output is free, and the server's tool-call parser
  (--tool-call-parser) reads calls out of it: `hermes` (Hermes / Qwen: `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks, text around them is content; a call's arguments stream once its name is read)
  or `json` (the whole output is one such object, or a list of them; a call's arguments stream once its name
  is read).
- "required": the output is constrained (structured outputs) to a JSON list of one or more calls
  `[{"name": ..., "arguments": {...}}]` valid against the tools' schemas (one call without
  parallel_tool_calls).
- a named function: the output is constrained to that function's arguments, a JSON object valid against its
  schema; it is the one call's arguments, streamed as they come.

A constrained call's tokens are often forced by its schema (names, keys, punctuation): the worker drafts them
for free, so tool calls speculate well whatever the proposer.
"""

from dataclasses import dataclass, field
import json
import re
import secrets

from scheduler_service.cluster.options import TOOL_CALL_PARSERS
from specdec.v1 import generation_pb2 as pb

TOOL_CHOICE_MODES = ("none", "auto", "required")
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}}


class ToolsError(ValueError):
    """A request's tools or tool_choice that cannot be served; the message names the field."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class CallDelta:
    """A streamed piece of call `index`: its id and name come with its first piece, its arguments in pieces."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do: the mode ("none", "auto", "required" or "function"), the tools for the chat
    template (OpenAI's shape), their schemas, the named function, whether several calls may be made and the
    parser of "auto"."""

    mode: str
    template_tools: tuple[dict, ...]
    schemas: dict[str, dict]
    function: str | None = None
    is_parallel: bool = True
    parser: str | None = None

    @property
    def is_constrained(self) -> bool:
        return self.mode in ("required", "function")

    def constraint(self) -> pb.StructuredOutputs | None:
        """The structured-output constraint of "required" and a named function (None otherwise)."""
        if self.mode == "function":
            return pb.StructuredOutputs(json=json.dumps(self.schemas[self.function]))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.is_parallel:
            schema["maxItems"] = 1
        return pb.StructuredOutputs(json=json.dumps(schema))

    def reader(self) -> "ToolCallReader | None":
        """A reader of one output's calls (None for "none": the output is all content)."""
        if self.mode == "function":
            return NamedCallReader(self.function)
        if self.mode == "required":
            return RequiredCallReader(self.is_parallel)
        if self.mode == "auto":
            assert self.parser in TOOL_CALL_PARSERS
            return HermesCallReader(self.is_parallel) if self.parser == "hermes" else JsonCallReader(self.is_parallel)
        return None

    def finish_reason(self, finish_reason: str | None, calls: list[ToolCall]) -> str | None:
        """OpenAI's: "tool_calls" when "auto" or "required" ended with calls (a named function's call: "stop")."""
        if finish_reason == "stop" and calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def plan_tools(request: pb.GenerateRequest | pb.CompleteRequest, parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools and tool_choice); raises ToolsError naming the field."""
    tools, choice = list(request.tools), request.tool_choice
    kind = choice.WhichOneof("choice")
    if not tools and kind is None:
        return None
    if tools and not len(request.messages):
        raise ToolsError("tools need a chat (messages): a text prompt or token ids cannot render them")
    if len(tools) > MAX_TOOLS:
        raise ToolsError(f"{len(tools)} tools: at most {MAX_TOOLS}")
    schemas = {}
    for i, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise ToolsError(f"tools[{i}].name must be 1-64 letters, digits, '_' or '-', got {tool.name[:80]!r}")
        if tool.name in schemas:
            raise ToolsError(f"tools[{i}].name {tool.name!r} is given twice")
        schemas[tool.name] = _parameters(i, tool.parameters)
    mode = choice.mode if kind == "mode" else "function" if kind == "function" else ("auto" if tools else "none")
    if mode not in (*TOOL_CHOICE_MODES, "function"):
        raise ToolsError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or a function, got {mode!r}")
    if mode == "function" and choice.function not in schemas:
        names = ", ".join(schemas) or "none"
        raise ToolsError(
            f"tool_choice names the function {choice.function[:80]!r}, which is not a tool (tools: {names})"
        )
    if mode in ("auto", "required") and not tools:
        raise ToolsError(f"tool_choice {mode!r} needs tools")
    if mode == "auto" and parser is None:
        raise ToolsError(
            "tool_choice 'auto' needs the server's tool-call parser (--tool-call-parser hermes or json); "
            "'required' and a named function need none"
        )
    is_constrained_elsewhere = request.sampling.structured_outputs.WhichOneof("constraint") is not None
    if mode in ("required", "function") and is_constrained_elsewhere:
        raise ToolsError(f"tool_choice {_describe(mode, choice)} constrains the output: drop structured_outputs")
    template_tools = tuple(
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": schemas[t.name]},
        }
        for t in tools
    )
    is_parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolPlan(
        mode,
        template_tools if mode != "none" else (),
        schemas,
        choice.function if mode == "function" else None,
        is_parallel,
        parser if mode == "auto" else None,
    )


def _describe(mode: str, choice: pb.ToolChoice) -> str:
    return f"function {choice.function!r}" if mode == "function" else repr(mode)


def _parameters(index: int, text: str) -> dict:
    if not text:
        return dict(NO_ARGUMENTS_SCHEMA)
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ToolsError(f"tools[{index}].parameters is not valid JSON: {exc}") from None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ToolsError(f"tools[{index}].parameters must be a JSON schema of an object (the arguments)")
    return schema


# ------------------------------------------------------------------ reading calls out of the output


@dataclass
class ToolCallReader:
    """Reads one output's text as it streams: `feed` each text delta, then `finish`; each returns the content
    to stream on and the call pieces completed. `calls` holds the whole calls read so far."""

    is_parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    @property
    def _is_full(self) -> bool:
        """Past the first call without parallel calls: further calls are dropped."""
        return bool(self.calls) and not self.is_parallel


class NamedCallReader(ToolCallReader):
    """A named function's output: all of it is the call's arguments, streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self._name, self._id, self._arguments = name, new_call_id(), []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        is_first = not self._arguments
        self._arguments.append(text)
        if not text and not is_first:
            return "", []
        return "", [CallDelta(0, text, self._id, self._name) if is_first else CallDelta(0, text)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        deltas = [] if self._arguments else [CallDelta(0, "", self._id, self._name)]
        self.calls = [ToolCall(self._id, self._name, "".join(self._arguments))]
        return "", deltas


ARGUMENT_KEYS = ("arguments", "parameters")  # a call's arguments, by either name (the first that is there)


@dataclass
class _PartialCall:
    """A call being read as it streams: the key whose value comes next (once its colon came), the string
    being read, the name and id, and the text of the arguments (from `start`; up to `end` once they ended) with
    how much of it was sent."""

    key: str | None = None
    colon: bool = False
    string: str = ""
    name: str | None = None
    id: str | None = None
    text: str = ""
    start: int | None = None
    end: int | None = None
    sent: int = 0

    def arguments(self) -> str:
        return "" if self.start is None else self.text[self.start : self.end]


class _StreamedCalls(ToolCallReader):
    """Reads JSON calls `{"name": ..., "arguments": {...}}` a character at a time (`_read`), each call's
    arguments going out as they are generated from the moment its name is known, as OpenAI streams them. A
    call is an object at depth `_call_depth` (2: the items of a list, 1: the object itself); the value of
    "arguments" is the text from its first character to where it ends (its closing bracket back at the
    call's depth, or the `,` or `}` after a scalar)."""

    _call_depth = 2

    def __init__(self, is_parallel: bool = True):
        super().__init__(is_parallel)
        self._reset()

    def _reset(self) -> None:
        """Ready for a new JSON text."""
        self._depth = 0
        self._in_string = self._escaped = False
        self._call: _PartialCall | None = None
        self._named = False  # some call of this text had its name read

    def _read_all(self, text: str) -> list[CallDelta]:
        deltas = []
        for char in text:
            deltas += self._read(char)
        return deltas + self._send()

    def _read(self, char: str) -> list[CallDelta]:
        """One character; the pieces of a call it ends (the rest go out once per text, `_read_all`)."""
        call, depth = self._call, self._call_depth
        if call is not None and call.key in ARGUMENT_KEYS and call.colon and call.end is None:
            if call.start is None and not char.isspace():
                call.start = len(call.text)
            if call.start is not None and not self._in_string and self._depth == depth and char in ",}":
                call.end = len(call.text)  # a scalar's end (an object's or a list's: below)
            else:
                call.text += char
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if call is not None and self._depth == depth:
                    self._string_ended(call)
                return []
            if call is not None and self._depth == depth:
                call.string += char
            return []
        if char == '"':
            self._in_string = True
            if call is not None and self._depth == depth:
                call.string = ""
        elif char in "[{":
            self._depth += 1
            if self._depth == depth and char == "{":
                self._call = _PartialCall()
        elif char in "]}":
            self._depth -= 1
            if call is not None and self._depth == depth and call.key in ARGUMENT_KEYS and call.end is None:
                call.end = len(call.text)  # the arguments' object or list closed
            if call is not None and self._depth == depth - 1:
                return self._end_call(closed=True)
        elif char == ":" and call is not None and self._depth == depth:
            call.colon = True
        elif char == "," and call is not None and self._depth == depth:
            call.key, call.colon = None, False
        return []

    def _string_ended(self, call: _PartialCall) -> None:
        """A string at the call's own depth: a key, or the value of "name"."""
        if not call.colon:
            call.key = call.string
        elif call.key == "name" and call.name is None:
            try:
                call.name = json.loads(f'"{call.string}"')
            except ValueError:  # not a JSON string (free output under "auto"): no name
                return
            self._named = True

    def _send(self) -> list[CallDelta]:
        """The arguments' text not sent yet, once the call's name is known (the first piece: with its id)."""
        call = self._call
        if call is None or call.name is None or call.start is None or self._is_full:
            return []
        piece = call.arguments()[call.sent :]
        if call.id is None:
            call.id = new_call_id()
            call.sent += len(piece)
            return [CallDelta(len(self.calls), piece, call.id, call.name)]
        if not piece:
            return []
        call.sent += len(piece)
        return [CallDelta(len(self.calls), piece)]

    def _end_call(self, closed: bool = False) -> list[CallDelta]:
        """The call being read ends, its object `closed` or the text cut short: its last pieces, and it joins
        `calls`. A closed call without arguments gets `{}`; one cut short before them, empty arguments."""
        if self._call is not None and self._call.name is not None and self._call.start is None:
            self._call.text, self._call.start = "{}" if closed else "", 0
        deltas = self._send()
        call, self._call = self._call, None
        if call is None or call.name is None or self._is_full:
            return []
        self.calls.append(ToolCall(call.id, call.name, call.arguments()))
        return deltas


class RequiredCallReader(_StreamedCalls):
    """ "required": the output is a list of calls `{"name": ..., "arguments": {...}}`, which the constraint
    (ToolPlan.constraint) makes valid JSON of that shape; each call's arguments stream as they are generated.
    A list cut short (max_tokens) leaves its last call's arguments cut short too, as streamed."""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        return "", self._read_all(text)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return "", self._end_call()  # a call cut short: its arguments as they are


class JsonCallReader(_StreamedCalls):
    """The whole output is one call `{"name": ..., "arguments": {...}}` ("parameters" is read too) or a list
    of them ("auto" with the json parser). Output that does not start like JSON is content, streamed as it
    comes. Otherwise each call's arguments stream as they are generated once its name is read, as with
    hermes; a JSON value in which no call's name is read is content, sent when it ends (or the output does),
    and so is the text after the value. A value cut short (max_tokens) keeps its calls as streamed."""

    def __init__(self, is_parallel: bool = True):
        super().__init__(is_parallel)
        self._held = ""  # the output while no call's name is read: content if none is
        self._state = "start"  # "start": only spaces so far; "json": in the value; "content": the rest

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._state == "start":
            start = len(text) - len(text.lstrip())
            self._held += text[:start]
            text = text[start:]
            if not text:
                return "", []
            if text[0] not in "[{":
                self._state = "content"
                content, self._held = self._held + text, ""
                return content, []
            self._state, self._call_depth = "json", 2 if text[0] == "[" else 1
        if self._state == "content":
            return text, []
        deltas = []
        for at, char in enumerate(text):
            if not self._named:
                self._held += char
            deltas += self._read(char)
            if self._depth == 0:  # the value ended: the rest is content
                self._state = "content"
                deltas += self._send()
                held, self._held = ("", "") if self._named else (self._held, "")
                return held + text[at + 1 :], deltas
        return "", deltas + self._send()

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._state == "json" and self._named:
            return "", self._end_call()  # a call cut short: its arguments as they are
        held, self._held = self._held, ""  # only spaces, or a value cut short before any call's name: content
        return held, []


class HermesCallReader(_StreamedCalls):
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen); the text around them is content. Text that may
    be the start of a block is held back until it is not. Inside a block the call's arguments stream as they
    are generated once its name is known; a block in which no call's name is read stays content, sent when it
    closes. A block cut short (max_tokens) keeps its call's arguments as they are, or is content without one."""

    _call_depth = 1

    def __init__(self, is_parallel: bool = True):
        super().__init__(is_parallel)
        self._pending = ""  # held back: maybe the start of a block's opening or closing tag
        self._block: str | None = None  # inside a block: its text so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._pending += text
        content, deltas = [], []
        while True:
            if self._block is None:
                start = self._pending.find(HERMES_OPEN)
                if start < 0:
                    keep = _held_back(self._pending, HERMES_OPEN)
                    content.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(HERMES_OPEN) :]
                self._block = ""
                self._reset()
            end = self._pending.find(HERMES_CLOSE)
            body = self._pending if end < 0 else self._pending[:end]
            if end < 0:
                body = body[: len(body) - _held_back(body, HERMES_CLOSE)]
            self._block += body
            deltas += self._read_all(body)
            if end < 0:
                self._pending = self._pending[len(body) :]
                break
            self._pending = self._pending[end + len(HERMES_CLOSE) :]
            more, last = self._close_block(HERMES_CLOSE)
            content.append(more)
            deltas += last
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._block is None:
            content, self._pending = self._pending, ""
            return content, []
        content, deltas = self._close_block(self._pending)  # cut short inside a block
        self._pending = ""
        return content, deltas

    def _close_block(self, close: str) -> tuple[str, list[CallDelta]]:
        """The block ends (`close`: its closing tag, or what was held back of one where the output ended): the
        content it leaves (all of it when no call's name was read) and its call's last pieces."""
        block, self._block = self._block, None
        deltas = self._end_call()
        return ("" if self._named else HERMES_OPEN + block + close), deltas


def _held_back(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolOutputs:
    """One request's outputs as its tools read them: each output's text becomes the content to stream on and
    the call pieces completed (without tools: the text as it is); the last output also finishes the reader."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan
        self.reader = plan.reader() if plan is not None else None

    def read(self, text: str, is_last: bool) -> tuple[str, list[CallDelta]]:
        if self.reader is None:
            return text, []
        content, deltas = self.reader.feed(text)
        if is_last:
            more, last_deltas = self.reader.finish()
            content, deltas = content + more, deltas + last_deltas
        return content, deltas

    @property
    def calls(self) -> list[ToolCall]:
        return self.reader.calls if self.reader is not None else []

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.plan.finish_reason(finish_reason, self.calls) if self.plan is not None else finish_reason
