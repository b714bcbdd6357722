"""Tool calling through `specdec serve` (in this process, tests/serving.py; the tiny byte-level model, which can
spell any JSON, with the shipped ChatML tools template and the hermes parser, or the json one; n-gram
speculation): a two-turn tool loop with the official `openai` client for "required" and a named function
(valid arguments every time, forced drafts in usage), "auto" read by the parser, streamed deltas that
reassemble to the same calls, the gRPC API's calls, and bad tools refused while the server keeps serving."""

import json
import pathlib

import grpc
import jsonschema
import openai
import pytest

from scheduler_service.frontends.tokenizer import ChatTokenizer
from specdec.v1 import generation_pb2 as pb
from tests.processes import free_port
from tests.serving import serve_in_process
from tests.tiny_models import make_tiny_byte_pair

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "chat_templates" / "chatml_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve_with_parser(tmp_path_factory, parser: str):
    pair = make_tiny_byte_pair(tmp_path_factory.mktemp("tools"), max_positions=2048)
    args = [
        "--http-port",
        str(free_port()),
        "--model",
        str(pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--max-model-len",
        "2048",
        "--num-kv-blocks",
        "2048",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "4",
        "--speculation-policy",
        "fixed",
        "--chat-template",
        str(TEMPLATE),
        "--tool-call-parser",
        parser,
    ]
    with serve_in_process(args) as serving:
        serving.client = openai.OpenAI(base_url=f"http://{serving.http_address}/v1", api_key="none", max_retries=0)
        serving.tokenizer = ChatTokenizer(pair.target_path, TEMPLATE)
        yield serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_with_parser(tmp_path_factory, "hermes")


@pytest.fixture(scope="module")
def json_server(tmp_path_factory):
    yield from serve_with_parser(tmp_path_factory, "json")


def chat(server, messages, **kwargs):
    kwargs = {"max_tokens": 160, "temperature": 1.0, **kwargs}
    return server.client.chat.completions.create(model=None, messages=messages, tools=TOOLS, **kwargs)


def assert_valid(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def forced(usage) -> int:
    return usage.model_extra["speculative_decoding"]["by_proposer"].get("forced", {}).get("draft_tokens", 0)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_two_turn_tool_loop(server, tool_choice):
    """The model calls (valid arguments for every seed), the result goes back as a tool message, the model
    answers; the second prompt is the template's rendering of the call and the result."""
    num_forced = 0
    for seed in range(4):
        first = chat(server, QUESTION, tool_choice=tool_choice, seed=seed, parallel_tool_calls=False)
        choice = first.choices[0]
        calls = choice.message.tool_calls
        assert len(calls) == 1 and choice.message.content is None
        assert_valid(calls)
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        if tool_choice != "required":
            assert [c.function.name for c in calls] == ["get_time"]
        num_forced += forced(first.usage)
        history = [
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            *[{"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls],
        ]
        second = chat(server, history, tool_choice="none", seed=seed, max_tokens=8)
        answer = second.choices[0]
        assert answer.message.tool_calls is None and answer.message.content is not None  # "none": text only
        assert answer.finish_reason in ("stop", "length") and second.usage.completion_tokens >= 1
        rendered = server.tokenizer.apply_chat_template(
            [
                {"role": "user", "content": QUESTION[0]["content"]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                        }
                        for c in calls
                    ],
                },
                *[{"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls],
            ]
        )
        assert second.usage.prompt_tokens == len(rendered)
    assert num_forced > 0  # the schemas' forced tokens were drafted for free


def test_required_may_make_several_calls(server):
    calls = chat(server, QUESTION, tool_choice="required", seed=0).choices[0].message.tool_calls
    assert len(calls) == 2 and len({c.id for c in calls}) == 2  # this seed's list has two
    assert_valid(calls)


def test_auto_reads_calls_with_the_parser_whole_and_streamed(server):
    """With tool_choice "auto" the output is free and the hermes parser reads it: here a constraint makes the
    tiny model write a call after some text; the same request streamed reassembles to the same calls."""
    block = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Oslo", "unit": "C"\\}\\}\\n</tool_call>'
    extra = {"structured_outputs": {"regex": f"Checking\\.\\n{block}"}}
    whole = chat(server, QUESTION, tool_choice="auto", seed=1, extra_body=extra)
    message = whole.choices[0].message
    assert message.content == "Checking.\n" and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    free = chat(server, QUESTION, seed=1, max_tokens=12)  # "auto" by default: no call in random text
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    chunks = list(chat(server, QUESTION, tool_choice="auto", seed=1, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking.\n"
    assert reassemble(chunks) == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_auto_with_the_json_parser_streams_the_arguments(json_server):
    """The json parser: an output that is a list of calls (a constraint makes the tiny model write one) is
    read whole, and streamed its arguments come in pieces as they are generated, reassembling to the same."""
    calls = '\\[\\{"name": "get_time", "arguments": \\{"zone": "CET"\\}\\}\\]'
    extra = {"structured_outputs": {"regex": calls}}
    whole = chat(json_server, QUESTION, tool_choice="auto", seed=1, extra_body=extra)
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "CET"})
    ]
    chunks = list(chat(json_server, QUESTION, tool_choice="auto", seed=1, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert reassemble(chunks) == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    pieces = [p for c in chunks for p in c.choices[0].delta.tool_calls or [] if p.function.arguments]
    assert len(pieces) > 1  # the arguments went out as they were generated, not whole at the end
    free = chat(json_server, QUESTION, seed=1, max_tokens=12)  # random text: content, no call
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


def reassemble(chunks) -> list[tuple[str, str]]:
    """The calls as OpenAI clients rebuild them from streamed pieces (by index; id and name in the first)."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls and piece.type == "function"
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_whole_replys(server, tool_choice):
    whole = chat(server, QUESTION, tool_choice=tool_choice, seed=0)
    chunks = list(chat(server, QUESTION, tool_choice=tool_choice, seed=0, stream=True))
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert reassemble(chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    # the arguments stream as they are generated (a named function's, and each of "required"'s calls)
    assert sum(1 for c in chunks for _ in c.choices[0].delta.tool_calls or []) > 2 * len(expected)


def test_grpc_returns_the_calls_on_the_last_message(server):
    tools = [pb.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Time?")],
        sampling=pb.SamplingParams(temperature=0, max_tokens=160),
        tools=tools,
        tool_choice=pb.ToolChoice(mode="required"),
        parallel_tool_calls=False,
    )
    responses = list(server.stub.Generate(request))
    assert all(not r.tool_calls for r in responses[:-1]) and "".join(r.text for r in responses) == ""
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(last.tool_calls) == 1
    jsonschema.validate(json.loads(last.tool_calls[0].arguments), SCHEMAS[last.tool_calls[0].name])
    complete = server.stub.Complete(pb.CompleteRequest(**{f.name: v for f, v in request.ListFields()}))
    assert [(c.name, c.arguments) for c in complete.tool_calls] == [(c.name, c.arguments) for c in last.tool_calls]


BAD = {
    "a schema that is not an object": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].parameters must be a JSON schema of an object",
    ),
    "an unknown function": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
        "names the function 'get_news', which is not a tool",
    ),
    "a bad name": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].name must be 1-64 letters",
    ),
    "a schema the compiler refuses": (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
            ],
            "tool_choice": "required",
        },
        "",
    ),
    "a tool_choice mode": ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    "tools on completions": ({"tools": TOOLS}, "'tools' is not supported"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_tools_get_400_naming_them(server, name):
    fields, fragment = BAD[name]
    if name == "tools on completions":
        create = lambda: server.client.completions.create(model=None, prompt="hi", extra_body=fields)  # noqa: E731
    else:
        create = lambda: server.client.chat.completions.create(model=None, messages=QUESTION, extra_body=fields)  # noqa: E731
    with pytest.raises(openai.BadRequestError) as info:
        create()
    assert fragment in info.value.body["message"]
    assert chat(server, QUESTION, tool_choice="required", seed=0).choices[0].message.tool_calls  # still serving
    with pytest.raises(grpc.RpcError) as rpc:
        server.stub.Complete(pb.CompleteRequest(prompt="hi", tools=[pb.Tool(name="f")]))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools need a chat" in rpc.value.details()
