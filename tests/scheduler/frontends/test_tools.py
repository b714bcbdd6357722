"""Tool calling's pieces: a request's tools validated, the constraints of "required" and a named function, the
readers of calls (whole and streamed a character at a time) and the shipped ChatML tools template."""

import json
import pathlib

import jsonschema
import pytest

from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.frontends.tools import (
    CallDelta,
    HermesCallReader,
    JsonCallReader,
    NamedCallReader,
    RequiredCallReader,
    ToolsError,
    plan_tools,
)
from specdec.v1 import generation_pb2 as pb

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}
TEMPLATE = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "chat_templates" / "chatml_tools.jinja"


def request(tools=(("get_weather", WEATHER), ("get_time", None)), mode=None, function=None, **fields):
    r = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[pb.Tool(name=n, parameters=json.dumps(p) if p is not None else "") for n, p in tools],
        **fields,
    )
    if mode is not None:
        r.tool_choice.mode = mode
    if function is not None:
        r.tool_choice.function = function
    return r


def test_without_tools_there_is_no_plan_and_auto_is_the_default_with_them():
    assert plan_tools(request(tools=()), "hermes") is None
    plan = plan_tools(request(), "hermes")
    assert plan.mode == "auto" and plan.parser == "hermes" and not plan.is_constrained
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather", "get_time"]
    assert plan.schemas["get_time"] == {"type": "object", "properties": {}}  # no parameters: no arguments
    assert plan_tools(request(mode="none"), None).template_tools == ()  # "none": the model is not told


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tools=(("get weather", WEATHER),)), r"tools\[0\].name must be 1-64 letters"),
        (dict(tools=(("f", WEATHER), ("f", WEATHER))), r"tools\[1\].name 'f' is given twice"),
        (dict(tools=(("f", {"type": "string"}),)), r"tools\[0\].parameters must be a JSON schema of an object"),
        (dict(function="get_news"), "names the function 'get_news', which is not a tool"),
        (dict(mode="sometimes"), "tool_choice must be one of none, auto, required or a function"),
        (dict(tools=(), mode="required"), "tool_choice 'required' needs tools"),
        (dict(parser=None), "tool_choice 'auto' needs the server's tool-call parser"),
        (
            dict(mode="required", sampling=pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a"))),
            "constrains the output: drop structured_outputs",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(kwargs, message):
    parser = kwargs.pop("parser", "hermes")
    with pytest.raises(ToolsError, match=message):
        plan_tools(request(**kwargs), parser)
    bad_json = request()
    bad_json.tools[0].parameters = "{not json"
    with pytest.raises(ToolsError, match=r"tools\[0\].parameters is not valid JSON"):
        plan_tools(bad_json, "hermes")
    text_prompt = pb.GenerateRequest(prompt="hi", tools=[pb.Tool(name="f")])
    with pytest.raises(ToolsError, match="tools need a chat"):
        plan_tools(text_prompt, "hermes")


def test_required_constrains_to_a_list_of_valid_calls():
    schema = json.loads(plan_tools(request(mode="required"), None).constraint().json)
    jsonschema.validate(
        [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}], schema
    )
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "get_news", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(plan_tools(request(mode="required", parallel_tool_calls=False), None).constraint().json)
    assert single["maxItems"] == 1
    named = plan_tools(request(function="get_weather"), None)
    assert json.loads(named.constraint().json) == WEATHER
    assert plan_tools(request(), "hermes").constraint() is None


def streamed(reader, text: str) -> tuple[str, list]:
    """Feeds `text` a character at a time; the content streamed and every call piece."""
    content, deltas = [], []
    for char in text:
        c, d = reader.feed(char)
        content.append(c)
        deltas += d
    c, d = reader.finish()
    return "".join(content) + c, deltas + d


def read(reader, text: str, step: str) -> tuple[str, list]:
    """`text` fed "whole" (one feed) or "streamed" (a character at a time), then finished: the content and
    every call piece."""
    if step == "streamed":
        return streamed(reader, text)
    content, deltas = reader.feed(text)
    more, last = reader.finish()
    return content + more, deltas + last


def reassembled(deltas) -> list[tuple[str, str, str]]:
    """The calls OpenAI clients rebuild from the pieces: id and name from the first, arguments concatenated."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = [d.id, d.name, ""]
        calls[d.index][2] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def assert_reads(reader, output: str, step: str, content: str, calls: list[tuple[str, str]]) -> None:
    """`output` read (see read()) gives `content` and `calls` (name, arguments), and the pieces streamed
    reassemble to the calls read."""
    got_content, deltas = read(reader, output, step)
    assert got_content == content
    assert [(c.name, c.arguments) for c in reader.calls] == calls
    assert reassembled(deltas) == [(c.id, c.name, c.arguments) for c in reader.calls]


HERMES_OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_ca'
)


@pytest.mark.parametrize("step", ["whole", "streamed"])
def test_hermes_reads_calls_and_keeps_the_text_around_them(step):
    reader = HermesCallReader()
    content, deltas = read(reader, HERMES_OUTPUT, step)
    assert content == "Let me check.\n\n<tool_ca"  # a cut-off block start is content at the end
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert reassembled(deltas) == [(c.id, c.name, c.arguments) for c in reader.calls]
    assert len({c.id for c in reader.calls}) == 2 and all(c.id.startswith("call_") for c in reader.calls)


def test_hermes_holds_back_only_what_may_start_a_block():
    reader = HermesCallReader()
    assert reader.feed("Hi <tool") == ("Hi ", [])
    assert reader.feed("box>") == ("<toolbox>", [])  # not a block after all
    assert reader.feed("<tool_call>not json</tool_call>!") == ("<tool_call>not json</tool_call>!", [])
    assert reader.calls == []
    one = HermesCallReader(is_parallel=False)
    streamed(one, HERMES_OUTPUT)
    assert [c.name for c in one.calls] == ["get_weather"]  # parallel_tool_calls false: the first call only


def test_hermes_streams_a_calls_arguments_before_its_block_closes():
    """Under "auto" a call's arguments go out as they are generated once its name is known, as under
    "required"; what a client reassembles is the call as generated."""
    reader = HermesCallReader()
    assert reader.feed('Sure. <tool_call>\n{"name": "get_weather", "argu') == ("Sure. ", [])
    content, deltas = reader.feed('ments": {"city": "Os')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Os')]
    assert deltas[0].id.startswith("call_") and reader.calls == []
    assert reader.feed('lo"}}\n</tool_') == ("", [CallDelta(0, 'lo"}')])
    assert reader.feed("call> Done.") == (" Done.", [])
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == [(deltas[0].id, "get_weather", '{"city": "Oslo"}')]
    _, streamed_deltas = streamed(HermesCallReader(), HERMES_OUTPUT)  # one piece per character of the arguments
    assert len([d for d in streamed_deltas if d.index == 0]) == len('{"city": "Paris"}')


@pytest.mark.parametrize(
    "output, content, calls",
    [
        ('<tool_call>{"city": "Oslo"}</tool_call>', '<tool_call>{"city": "Oslo"}</tool_call>', []),  # no name
        ('<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',) * 2 + ([],),  # a list: not a Hermes call
        ('<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", "{}")]),  # closed without arguments
        (
            '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>',
            "",
            [("get_weather", '{"city": "Oslo"}')],
        ),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Os', "", [("get_weather", '{"city": "Os')]),
        ('<tool_call>{"name": "get_time", "argu', "", [("get_time", "")]),  # cut before its arguments
        ('<tool_call>{"nam', '<tool_call>{"nam', []),  # cut before a name: content
        ('<tool_call>{"name": "get\\qtime", "arguments": {}}</tool_call>',) * 2 + ([],),  # a bad escape: no name
        ('<tool_call>{"x": 1}</tool_c', '<tool_call>{"x": 1}</tool_c', []),
    ],
)
@pytest.mark.parametrize("step", ["whole", "streamed"])
def test_hermes_blocks_without_a_call_are_content_and_cut_calls_keep_what_was_streamed(output, content, calls, step):
    assert_reads(HermesCallReader(), output, step, content, calls)


@pytest.mark.parametrize(
    "text, names, content",
    [
        ('{"name": "get_time", "parameters": {}}', ["get_time"], ""),
        (' [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', ["a", "b"], ""),
        ("Sunny today.", [], "Sunny today."),
        ('{"weather": "sunny"}', [], '{"weather": "sunny"}'),  # JSON but not a call: content
    ],
)
def test_json_reads_a_call_or_a_list_else_content(text, names, content):
    reader = JsonCallReader()
    got_content, deltas = streamed(reader, text)
    assert [c.name for c in reader.calls] == names and got_content == content
    assert reassembled(deltas) == [(c.id, c.name, c.arguments) for c in reader.calls]


def test_json_streams_a_calls_arguments_once_its_name_is_read():
    reader = JsonCallReader()
    assert reader.feed(' {"name": "get_weather", "argu') == ("", [])
    content, deltas = reader.feed('ments": {"city": "Os')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Os')]
    assert deltas[0].id.startswith("call_") and reader.calls == []
    assert reader.feed('lo"}} Done') == (" Done", [CallDelta(0, 'lo"}')])  # after the value: content
    assert reader.feed(".") == (".", [])
    assert reader.finish() == ("", [])
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == [(deltas[0].id, "get_weather", '{"city": "Oslo"}')]
    _, streamed_deltas = streamed(JsonCallReader(), '[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]')
    assert len([d for d in streamed_deltas if d.index == 0]) == len('{"x": 1}')  # a piece per character


@pytest.mark.parametrize(
    "output, content, calls",
    [
        ('{"weather": "sunny"} ok', '{"weather": "sunny"} ok', []),  # a value without a call: content
        ('[{"name": "get_weather", "arguments": {"city": "Os', "", [("get_weather", '{"city": "Os')]),  # cut short
        ('{"name": "get_time", "argu', "", [("get_time", "")]),  # cut before its arguments
        ('[{"nam', '[{"nam', []),  # cut before a name: content
        ('{"name": "get\\qtime", "arguments": {}}',) * 2 + ([],),  # a bad escape: no name
        ("  ", "  ", []),
    ],
)
@pytest.mark.parametrize("step", ["whole", "streamed"])
def test_json_values_without_a_call_are_content_and_cut_calls_keep_what_was_streamed(output, content, calls, step):
    assert_reads(JsonCallReader(), output, step, content, calls)


def test_json_holds_a_value_without_a_name_until_it_ends():
    reader = JsonCallReader()
    assert reader.feed('{"weather": ') == ("", [])
    assert reader.feed('"sunny"}\n') == ('{"weather": "sunny"}\n', [])
    assert reader.feed("More.") == ("More.", [])


def test_content_that_does_not_start_like_json_streams_at_once():
    reader = JsonCallReader()
    assert reader.feed("  ") == ("", [])
    assert reader.feed("Hello") == ("  Hello", [])
    assert reader.feed(" there") == (" there", [])


REQUIRED_OUTPUT = (
    '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "C"}}, '
    '{ "name" : "get_time" , "arguments" : { } } ]'
)


@pytest.mark.parametrize("step", ["whole", "streamed"])
def test_required_calls_arguments_stream_as_they_are_generated(step):
    """The arguments of each call go out as the characters come, from the moment the call's name is known:
    what a client reassembles is the call's arguments exactly as generated (brackets and quotes inside strings
    included)."""
    reader = RequiredCallReader()
    content, deltas = read(reader, REQUIRED_OUTPUT, step)
    assert content == ""
    assert [(c.name, c.arguments) for c in reader.calls] == [
        ("get_weather", '{"city": "Pa\\"ris}", "unit": "C"}'),
        ("get_time", "{ }"),
    ]
    assert reassembled(deltas) == [(c.id, c.name, c.arguments) for c in reader.calls]
    if step == "streamed":  # one piece per character of the arguments, the first with the id and name
        assert len([d for d in deltas if d.index == 0]) == len(reader.calls[0].arguments)


def test_required_sends_the_first_arguments_before_the_call_ends():
    reader = RequiredCallReader()
    assert reader.feed('[{"name": "get_weather"') == ("", [])  # no arguments yet
    content, deltas = reader.feed(', "arguments": {"ci')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"ci')]
    assert deltas[0].id.startswith("call_") and reader.calls == []
    assert reader.feed('ty": "Oslo"}') == ("", [CallDelta(0, 'ty": "Oslo"}')])
    assert reader.feed("}]") == ("", [])
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == [(deltas[0].id, "get_weather", '{"city": "Oslo"}')]


def test_required_arguments_before_the_name_go_out_once_the_name_is_known():
    reader = RequiredCallReader()
    assert reader.feed('[{"arguments": {"x": 1}, ') == ("", [])
    content, deltas = reader.feed('"name": "f"}]')
    assert [(d.name, d.arguments) for d in deltas] == [("f", '{"x": 1}')]
    assert [(c.name, c.arguments) for c in reader.calls] == [("f", '{"x": 1}')]


def test_required_cut_short_keeps_what_was_streamed_and_one_call_without_parallel_calls():
    cut = RequiredCallReader()
    _, deltas = streamed(cut, '[{"name": "get_weather", "arguments": {"city": "Os')
    assert [(c.name, c.arguments) for c in cut.calls] == [("get_weather", '{"city": "Os')]
    assert reassembled(deltas) == [(c.id, c.name, c.arguments) for c in cut.calls]
    one = RequiredCallReader(is_parallel=False)
    _, deltas = streamed(one, REQUIRED_OUTPUT)
    assert [c.name for c in one.calls] == ["get_weather"] and {d.index for d in deltas} == {0}


def test_a_named_functions_arguments_stream_as_they_come():
    reader = NamedCallReader("get_weather")
    first = reader.feed('{"city": ')
    assert first[0] == "" and first[1][0].name == "get_weather" and first[1][0].arguments == '{"city": '
    assert reader.feed('"Oslo"}') == ("", [CallDelta(0, '"Oslo"}')])
    reader.finish()
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city": "Oslo"}')]
    assert reader.calls[0].id == first[1][0].id


def test_the_chatml_tools_template_renders_tools_calls_and_results(smollm2_path):
    ours = ChatTokenizer(smollm2_path, TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": WEATHER}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = ours.decode(ours.apply_chat_template(messages, tools), skip_special_tokens=False)
    assert f"<tools>\n{json.dumps(tools[0])}\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(plain) == ChatTokenizer(smollm2_path).apply_chat_template(plain)  # SmolLM2's own
