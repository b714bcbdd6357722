"""Structured outputs through `specdec serve` (in this process, tests/serving.py; a tiny random model over a
byte-level vocabulary, n-gram speculation, async and sync scheduling; suffix, EAGLE-3 (a random head), both at
once and forced drafts off under one scheduling each): every kind of constraint over gRPC and the official
`openai` client, the same tokens with and without speculation, `length` inside the constraint, bad constraints
refused with the server still serving, the cache hit on a repeated schema, a hostile constraint refused within
the bound while another request streams, and constrained streams that survive preemption and a killed worker
(worker processes)."""

import json
import re
import threading
import time
import urllib.request

import grpc
import jsonschema
import openai
import pytest

from specdec.v1 import generation_pb2 as pb
from tests.processes import free_ports
from tests.serving import scheduler_in_process, serve_in_process
from tests.tiny_models import make_tiny_byte_pair

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MAX_TOKENS = 80
MODEL = "tiny-bytes"


@pytest.fixture(scope="module", params=["async", "sync"])
def server(request, tmp_path_factory):
    yield from serving(tmp_path_factory, request.param, ["--proposer", "ngram", "--num-speculative-tokens", "4"])


# The other proposers (and forced drafts off), each under one of the two schedulings
SPECULATING = {
    "suffix-sync": ("sync", ["--proposer", "suffix", "--num-speculative-tokens", "6"]),
    "eagle3-async": ("async", ["--proposer", "eagle3", "--num-speculative-tokens", "4"]),
    "eagle3,suffix-sync": ("sync", ["--proposer", "eagle3,suffix", "--num-speculative-tokens", "4"]),
    "ngram-unforced-async": ("async", ["--proposer", "ngram", "--num-speculative-tokens", "4", "--no-forced-drafts"]),
}


@pytest.fixture(scope="module", params=list(SPECULATING))
def speculating_server(request, tmp_path_factory):
    scheduling, args = SPECULATING[request.param]
    yield from serving(tmp_path_factory, scheduling, args)


def serving(tmp_path_factory, scheduling: str, proposer_args: list[str]):
    """`specdec serve` of the tiny byte-level model (with a random EAGLE-3 head for it), in this process
    (tests/serving.py), and its clients."""
    pair = make_tiny_byte_pair(tmp_path_factory.mktemp("bytes"))
    http_port, metrics_port = free_ports(2)
    args = [
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
        "--model",
        str(pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "256",
        *proposer_args,
        "--speculation-policy",
        "fixed",
        "--structured-output-timeout",
        "1",
        "--served-model-name",
        MODEL,
        "--scheduling",
        scheduling,
    ]
    if any("eagle3" in arg for arg in proposer_args):
        args += ["--draft-model", str(pair.eagle3_head_path)]
    with serve_in_process(args) as server:
        yield {
            "stub": server.stub,
            "openai": openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key="none", max_retries=0),
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "args": args,
        }


def complete(
    server,
    constraint: pb.StructuredOutputs,
    speculate: bool = True,
    seed: int | None = None,
    prompt: str = "Describe a city.",
    max_tokens: int = MAX_TOKENS,
) -> pb.CompleteResponse:
    sampling = pb.SamplingParams(
        temperature=0 if seed is None else 1.0,
        max_tokens=max_tokens,
        structured_outputs=constraint,
        **({} if seed is None else {"seed": seed}),
    )
    return server["stub"].Complete(
        pb.CompleteRequest(prompt=prompt, sampling=sampling, speculation=pb.SpeculationParams(enabled=speculate))
    )


@pytest.mark.parametrize("seed", [None, 7])
def test_json_schema_output_validates_and_equals_the_output_without_speculation(server, seed):
    constraint = pb.StructuredOutputs(json=json.dumps(SCHEMA))
    fast, plain = complete(server, constraint, seed=seed), complete(server, constraint, speculate=False, seed=seed)
    assert fast.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(fast.text), SCHEMA)
    assert list(fast.token_ids) == list(plain.token_ids)
    forced = {p.proposer: p for p in fast.usage.proposers}["forced"]
    assert forced.draft_tokens > 0 and forced.accepted_tokens > 0
    assert plain.usage.draft_tokens == 0


@pytest.mark.parametrize("seed", [None, 7])
def test_every_proposer_keeps_the_schema_and_changes_no_token(speculating_server, seed):
    """suffix, eagle3, eagle3,suffix and forced drafts off: valid JSON, the tokens of constrained decoding
    without speculation; forced drafts counted in usage and on /metrics where they are on, absent where off."""
    server = speculating_server
    constraint = pb.StructuredOutputs(json=json.dumps(SCHEMA))
    # plain first: the suffix index holds its output when the same request speculates
    plain = complete(server, constraint, speculate=False, seed=seed)
    fast = complete(server, constraint, seed=seed)
    assert fast.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(fast.text), SCHEMA)
    assert list(fast.token_ids) == list(plain.token_ids)
    by_proposer = {p.proposer: p for p in fast.usage.proposers}
    named = server["args"][server["args"].index("--proposer") + 1].split(",")
    assert any(by_proposer[name].draft_tokens > 0 for name in named if name in by_proposer), by_proposer
    forced = by_proposer.get("forced")
    forced_on_metrics = _metric(server, "specdec_spec_decode_num_draft_tokens_by_proposer_total", 'proposer="forced"')
    if "--no-forced-drafts" in server["args"]:
        assert forced is None and forced_on_metrics == 0
    else:
        assert forced.draft_tokens > 0 and forced.accepted_tokens > 0 and forced_on_metrics >= forced.draft_tokens


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (
            pb.StructuredOutputs(regex=r"[A-Z][a-z]{2,6} [0-9]{3}-[0-9]{4}"),
            lambda text: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{3}-[0-9]{4}", text),
        ),
        (
            pb.StructuredOutputs(choice=pb.Choice(choices=["positive", "negative", "neutral"])),
            lambda text: text in ("positive", "negative", "neutral"),
        ),
        (
            pb.StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/'),
            lambda text: re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3})*\)", text),
        ),
        (pb.StructuredOutputs(grammar='root ::= "yes" | "no"'), lambda text: text in ("yes", "no")),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_every_kind_of_constraint_is_followed(server, constraint, check):
    reply = complete(server, constraint)
    assert reply.finish_reason == pb.FINISH_REASON_STOP, reply.text
    assert check(reply.text), reply.text


def test_any_json_object(server):
    """The random model's strings run on: the output is an object's start, cut by max_tokens (`length`), or
    a whole object (`stop`)."""
    reply = complete(server, pb.StructuredOutputs(json_object=True))
    assert reply.text.startswith("{")
    if reply.finish_reason == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(reply.text), dict)
    else:
        assert reply.finish_reason == pb.FINISH_REASON_LENGTH and reply.usage.completion_tokens == MAX_TOKENS


def test_the_openai_client_gets_json_of_its_schema(server):
    client = server["openai"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    legacy = client.completions.create(
        model=MODEL, prompt="Mood:", max_tokens=8, temperature=0, extra_body={"guided_choice": ["happy", "sad"]}
    )
    assert legacy.choices[0].text in ("happy", "sad")


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda text: text.startswith("{")),
        ({"extra_body": {"guided_json": SCHEMA}}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        ({"extra_body": {"guided_regex": "[a-c]{2}-[0-9]{3}"}}, lambda text: re.fullmatch("[a-c]{2}-[0-9]{3}", text)),
        ({"extra_body": {"guided_grammar": 'root ::= "on" | "off"'}}, lambda text: text in ("on", "off")),
        ({"extra_body": {"structured_outputs": {"choice": ["left", "right"]}}}, lambda text: text in ("left", "right")),
    ],
    ids=["json_object", "guided_json", "guided_regex", "guided_grammar", "structured_outputs"],
)
def test_the_openai_client_s_other_constraint_fields_are_followed(server, body, check):
    reply = server["openai"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer."}], temperature=0, max_tokens=MAX_TOKENS, **body
    )
    text = reply.choices[0].message.content
    assert check(text), text
    # json_object: the random model's strings may run on to max_tokens; the others end their grammar
    assert reply.choices[0].finish_reason == "stop" or "json_object" in str(body)


def test_max_tokens_inside_the_constraint_finishes_with_length(server):
    reply = complete(server, pb.StructuredOutputs(json=json.dumps(SCHEMA)), max_tokens=5)
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH and reply.usage.completion_tokens == 5
    assert reply.text.startswith("{")  # a prefix of a valid record, as far as it got


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
                }
            },
            "strin",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "if": {"properties": {"a": {"const": 1}}}},
                    },
                }
            },
            "if",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "regex"),
        ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_regex and guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}}, "no value"),
        ({"extra_body": {"guided_json": {"type": "object"}, "ignore_eos": True}}, "ignore_eos"),
    ],
)
def test_bad_constraints_get_400_naming_the_problem(server, body, message):
    with pytest.raises(openai.BadRequestError) as caught:
        server["openai"].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8, **body
        )
    assert message in str(caught.value)
    reply = complete(server, pb.StructuredOutputs(regex="ok"))  # and the server goes on serving
    assert reply.finish_reason == pb.FINISH_REASON_STOP and reply.text == "ok"


def test_a_bad_regex_over_grpc_is_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as caught:
        complete(server, pb.StructuredOutputs(regex="(unclosed"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unclosed" in caught.value.details()


def _metric(server, name: str, label: str | None = None) -> float:
    """The sum of a metric's samples (those with `label`, e.g. 'proposer="forced"', where one is given)."""
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    if label is None:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") and label in line)


def test_a_repeated_schema_is_a_cache_hit(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    constraint = pb.StructuredOutputs(json=json.dumps(schema))
    complete(server, constraint)
    hits, requests = (
        _metric(server, "specdec_structured_output_cache_hits_total"),
        _metric(server, "specdec_structured_output_requests_total"),
    )
    complete(server, constraint)
    assert _metric(server, "specdec_structured_output_cache_hits_total") == hits + 1
    assert _metric(server, "specdec_structured_output_requests_total") == requests + 1
    assert _metric(server, "specdec_structured_output_compile_seconds_count") >= 1


def test_a_hostile_constraint_is_refused_within_the_bound_while_others_stream(server):
    """An enormous schema is refused by size at once; a costly one within --structured-output-timeout (1 s)
    or as invalid; a request streaming meanwhile is not held up."""
    stream_gaps, num_tokens, done = [], [0], threading.Event()

    def stream():
        sampling = pb.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        last = time.monotonic()
        for response in server["stub"].Generate(pb.GenerateRequest(prompt="go", sampling=sampling)):
            now = time.monotonic()
            stream_gaps.append(now - last)
            num_tokens[0] += len(response.token_ids)
            last = now
        done.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    enormous = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(grpc.RpcError) as caught:
        complete(server, pb.StructuredOutputs(json=json.dumps(enormous)))
    assert (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "--structured-output-max-chars" in caught.value.details()
    )
    nested: dict = {"type": "string"}
    for _ in range(400):
        nested = {"type": "array", "items": nested}
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        complete(server, pb.StructuredOutputs(json=json.dumps(nested)))
    assert time.monotonic() - start < 5
    assert caught.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    start = time.monotonic()  # a regex whose lexer states blow up: llguidance bounds the work of each token
    reply = complete(server, pb.StructuredOutputs(regex="(.*a){50}"))
    assert time.monotonic() - start < 20 and reply.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert done.wait(60)
    streamer.join()
    assert num_tokens[0] == 200 and max(stream_gaps[1:]) < 1.0


LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {"type": "string", "maxLength": 40},
        "codes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 5},
        "score": {"type": "integer", "minimum": 0, "maximum": 9999},
    },
    "required": ["notes", "codes", "score"],
    "additionalProperties": False,
}
FAILOVER_PROMPTS = ["alpha beta", "gamma", "delta epsilon zeta", "eta", "theta iota", "kappa lambda mu"]
FAILOVER_SEEDS = [None, None, None, 21, 22, 23]
FAILOVER_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    return make_tiny_byte_pair(tmp_path_factory.mktemp("bytes-failover"))


def _failover_reference(pair) -> list[list[int]]:
    """Each request alone on an in-process worker, no speculation: its tokens up to EOS."""
    from scheduler_service.frontends.tokenizer import ChatTokenizer
    from specdec import step, structured
    from tests.worker.driver import Driver
    from worker_service.runtime.loader import load_model
    from worker_service.runtime.runner import ModelRunner
    from worker_service.speculation.config import WorkerConfig
    from worker_service.speculation.worker import Worker

    tokenizer = ChatTokenizer(pair.target_path)
    worker = Worker(WorkerConfig(model=str(pair.target_path)), ModelRunner(load_model(pair.target_path)))
    worker.init_cache(512, 4)
    grammar = structured.to_grammar("json", json.dumps(LONG_SCHEMA))
    outputs = []
    for i, (prompt, seed) in enumerate(zip(FAILOVER_PROMPTS, FAILOVER_SEEDS)):
        params = step.RequestSampling(temperature=0.0 if seed is None else 0.8, seed=seed)
        out = Driver(worker.execute, 4, 512).generate(
            [tokenizer.encode(prompt)], FAILOVER_MAX_TOKENS, params, prefix=f"ref{i}-", grammar=grammar
        )[0]
        outputs.append(out[: out.index(2) + 1])
    return outputs


def test_constrained_streams_survive_preemption_and_a_killed_worker(byte_pair):
    """Two worker processes (the scheduler in this process), a KV pool small enough to preempt, one worker
    killed mid-stream: every constrained stream (greedy and seeded) ends with exactly the tokens it has alone,
    valid JSON."""
    from tests.e2e.test_failover import start_workers, wait_until, worker_status

    reference = _failover_reference(byte_pair)
    args = ["--num-threads", "1", "--proposer", "ngram", "--num-speculative-tokens", "3"]
    workers = start_workers(byte_pair, 2, args)
    addresses = [w.address() for w in workers]
    try:
        with scheduler_in_process(
            [
                "--model",
                str(byte_pair.target_path),
                "--block-size",
                "4",
                "--num-kv-blocks",
                "56",
                "--speculation-policy",
                "fixed",
                "--routing",
                "least-loaded",
                "--worker",
                addresses[0],
                "--worker",
                addresses[1],
            ]
        ) as scheduler:
            stub = scheduler.stub
            wait_until(lambda: all(worker_status(stub, a).state == "serving" for a in addresses))
            tokens, finish = [[] for _ in FAILOVER_PROMPTS], [None] * len(FAILOVER_PROMPTS)
            texts = [""] * len(FAILOVER_PROMPTS)

            def consume(i: int) -> None:
                seed = FAILOVER_SEEDS[i]
                sampling = pb.SamplingParams(
                    temperature=0.0 if seed is None else 0.8,
                    max_tokens=FAILOVER_MAX_TOKENS,
                    structured_outputs=pb.StructuredOutputs(json=json.dumps(LONG_SCHEMA)),
                    **({} if seed is None else {"seed": seed}),
                )
                for response in stub.Generate(pb.GenerateRequest(prompt=FAILOVER_PROMPTS[i], sampling=sampling)):
                    tokens[i] += response.token_ids
                    texts[i] += response.text
                    finish[i] = response.finish_reason

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(FAILOVER_PROMPTS))]
            for thread in threads:
                thread.start()
            wait_until(lambda: all(len(t) >= 6 for t in tokens), what="every stream to begin")
            workers[0].proc.kill()
            for thread in threads:
                thread.join(120)
            assert finish == [pb.FINISH_REASON_STOP] * len(FAILOVER_PROMPTS)
            assert tokens == reference
            for text in texts:
                jsonschema.validate(json.loads(text), LONG_SCHEMA)
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.counters.num_moved_requests >= 1 and info.counters.num_preemptions >= 1
    finally:
        for worker in workers:
            worker.stop()
