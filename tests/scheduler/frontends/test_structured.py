"""The scheduler's constraint compiler: the cache, the size and time bounds, and a tokenizer llguidance
cannot use (the server's problem, not the client's)."""

import json
import time

import grpc
import pytest

from scheduler_service.cluster.handle import EngineError
from scheduler_service.frontends.structured import ConstraintCompiler, ConstraintInputError
from specdec.v1 import generation_pb2 as pb
from tests.tiny_models import save_tiny_byte_tokenizer

SCHEMA = pb.StructuredOutputs(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_tiny_byte_tokenizer(directory)
    return (directory / "tokenizer.json").read_text()


def compiler(tokenizer_json, vocab_size=274, max_chars=1000, timeout_s=5.0):
    events = []
    return ConstraintCompiler(tokenizer_json, vocab_size, [2], max_chars, timeout_s, events.append), events


def test_no_constraint_is_no_grammar_and_a_repeated_one_is_a_cache_hit(tokenizer_json):
    constraints, events = compiler(tokenizer_json)
    assert constraints.compile(pb.StructuredOutputs()) == ""
    first = constraints.compile(SCHEMA)
    assert first and constraints.compile(SCHEMA) == first
    assert events[0] is not None and events[1] is None  # compiled (seconds), then found in the cache


def test_true_is_any_value_and_false_is_refused(tokenizer_json):
    constraints, _ = compiler(tokenizer_json)
    assert constraints.compile(pb.StructuredOutputs(json="true"))
    with pytest.raises(ConstraintInputError, match="allows no value"):
        constraints.compile(pb.StructuredOutputs(json="false"))


def test_a_constraint_over_the_size_limit_is_refused_naming_the_flag(tokenizer_json):
    constraints, events = compiler(tokenizer_json, max_chars=10)
    with pytest.raises(ConstraintInputError, match="--structured-output-max-chars"):
        constraints.compile(pb.StructuredOutputs(regex="a" * 11))
    with pytest.raises(ConstraintInputError, match="--structured-output-max-chars"):
        constraints.compile(pb.StructuredOutputs(choice=pb.Choice(choices=["abcdef", "ghijkl"])))
    assert events == []


def test_a_slow_compile_is_refused_in_time_and_its_late_result_serves_the_next_request(tokenizer_json, monkeypatch):
    constraints, events = compiler(tokenizer_json, timeout_s=0.2)
    real = constraints._compile

    def slow(kind, value):
        time.sleep(0.6)
        return real(kind, value)

    monkeypatch.setattr(constraints, "_compile", slow)
    start = time.monotonic()
    with pytest.raises(EngineError) as caught:
        constraints.compile(SCHEMA)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--structured-output-timeout" in str(
        caught.value
    )
    assert time.monotonic() - start < 0.5
    time.sleep(0.8)  # the compile finishes in the background
    assert constraints.compile(SCHEMA) and events == [None]


def test_a_tokenizer_llguidance_cannot_use_is_the_server_s_error(tokenizer_json):
    constraints, _ = compiler(tokenizer_json, vocab_size=100)  # a model vocabulary smaller than the tokenizer's
    with pytest.raises(EngineError) as caught:
        constraints.compile(SCHEMA)
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED and "not available for this model" in str(caught.value)


def test_each_kind_is_checked(tokenizer_json):
    constraints, _ = compiler(tokenizer_json)
    for bad, message in [
        (pb.StructuredOutputs(regex="(x"), "regex"),
        (pb.StructuredOutputs(json="{"), "not valid JSON"),
        (pb.StructuredOutputs(choice=pb.Choice()), "at least one choice"),
        (pb.StructuredOutputs(grammar="start: x"), "x"),
        (pb.StructuredOutputs(json_object=False), "must be true"),
    ]:
        with pytest.raises(ConstraintInputError, match=message):
            constraints.compile(bad)
