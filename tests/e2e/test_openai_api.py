"""The OpenAI-compatible HTTP API of `specdec serve` (in this process, tests/serving.py; tiny pair, n-gram
speculation), through the official `openai` client: the same greedy output as the gRPC API, logprobs, the usage
extension, errors and API keys."""

import http.client
import json
import socket

import grpc
import openai
import pytest

from specdec.v1 import generation_pb2 as pb
from tests.processes import free_port
from tests.serving import serve_in_process

KEY = "sk-http-test-5d1e9a"
MESSAGES = [{"role": "user", "content": "w9 w10 w9 w10"}]
PROMPT_IDS = [5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram proposer drafts
MAX_TOKENS = 12
SERVED_MODEL_NAME = "tiny-llama"  # --served-model-name: what clients see instead of the checkpoint path


class Server:
    """The server's HTTP address, an `openai` client with the key, and a gRPC stub with the key."""

    def __init__(self, serving):
        self.http_address, self.stub = serving.http_address, serving.stub
        self.client = openai.OpenAI(base_url=f"http://{self.http_address}/v1", api_key=KEY, max_retries=0)
        self.metadata = [("authorization", f"Bearer {KEY}")]

    def complete(self, **fields) -> pb.CompleteResponse:
        sampling = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
        return self.stub.Complete(pb.CompleteRequest(sampling=sampling, **fields), metadata=self.metadata)

    def raw(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
        host, port = self.http_address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = conn.getresponse()
        result = response.status, json.loads(response.read())
        conn.close()
        return result


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"{KEY}\n")
    args = [
        "--http-port",
        str(free_port()),
        "--api-key-file",
        str(key_file),
        "--model",
        str(tiny_pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--max-model-len",
        "64",
        "--num-kv-blocks",
        "64",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--speculation-policy",
        "fixed",
        "--served-model-name",
        SERVED_MODEL_NAME,
    ]
    with serve_in_process(args) as serving:  # on exit: drained, run_scheduler returned 0
        yield Server(serving)
    for address in (serving.http_address, serving.address):  # both APIs stopped
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5)


def _text_of(token_ids, token_texts: list[str]) -> str:
    """The output text from each token's text (special tokens, e.g. EOS, are not in the text)."""
    assert len(token_texts) == len(token_ids)
    return "".join(text for t, text in zip(token_ids, token_texts) if t > 2)


def _speculative(usage) -> dict:
    return usage.model_extra["speculative_decoding"]


def test_chat_greedy_matches_grpc_whole_and_streamed(server):
    expected = server.complete(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    kwargs = dict(
        model=server.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=server.metadata).model,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert kwargs["model"] == SERVED_MODEL_NAME  # gRPC and HTTP name the model alike
    whole = server.client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert whole.model == SERVED_MODEL_NAME
    assert choice.message.content == expected.text and choice.finish_reason == "length"
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(list(expected.logprobs))
    assert _text_of(expected.token_ids, [c.token for c in choice.logprobs.content]) == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids) == MAX_TOKENS
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + MAX_TOKENS
    # The gRPC call above left the prompt's full blocks (below its last token) in the prefix cache.
    assert whole.usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 4 * 4 > 0
    assert _speculative(whole.usage) == {
        "draft_tokens": expected.usage.draft_tokens,
        "accepted_tokens": expected.usage.accepted_tokens,
        "by_proposer": {
            p.proposer: {"draft_tokens": p.draft_tokens, "accepted_tokens": p.accepted_tokens}
            for p in expected.usage.proposers
        },
    }

    chunks = list(server.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    logprobs = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert logprobs == pytest.approx(list(expected.logprobs))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert _speculative(chunks[-1].usage) == _speculative(whole.usage)


def test_completions_greedy_matches_grpc_for_token_ids_and_text(server):
    expected = server.complete(prompt_token_ids=PROMPT_IDS)
    assert expected.usage.draft_tokens > 0  # the usage extension below counts real drafts
    kwargs = dict(
        model=None, prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS, logprobs=0, extra_body={"ignore_eos": True}
    )
    whole = server.client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.text == expected.text
    assert choice.text.split() == [f"w{t}" for t in expected.token_ids if t > 2]
    assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs))
    assert _text_of(expected.token_ids, choice.logprobs.tokens) == expected.text
    assert len(choice.logprobs.text_offset) == MAX_TOKENS and choice.logprobs.text_offset[0] == 0
    assert _speculative(whole.usage)["draft_tokens"] == expected.usage.draft_tokens

    chunks = list(server.client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        list(expected.logprobs)
    )
    assert chunks[-1].choices[0].finish_reason == "length"

    by_text = server.client.completions.create(**{**kwargs, "prompt": "w5 w6 w7 w8 w5 w6 w7"})
    assert by_text.choices[0].text == expected.text


def test_models_and_health(server):
    info = server.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=server.metadata)
    assert [m.id for m in server.client.models.list()] == [info.model] == [SERVED_MODEL_NAME]
    assert server.raw("GET", "/health") == (200, {"status": "serving"})  # no key needed


BAD = {  # name: (endpoint, body fields, HTTP status, fragment of the message)
    "temperature -1": ("chat", {"temperature": -1}, 400, "temperature must be >= 0"),
    "top_p 2": ("chat", {"top_p": 2}, 400, "top_p must be in (0, 1]"),
    "n 0": ("chat", {"n": 0}, 400, "n must be in [1, 16]"),
    "n 17": ("text", {"n": 17}, 400, "n must be in [1, 16]"),
    "top_logprobs 21": ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be in [0, 20]"),
    "top_logprobs without logprobs": ("chat", {"top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
    "presence_penalty 3": ("chat", {"presence_penalty": 3}, 400, "presence_penalty must be in [-2.0, 2.0]"),
    "repetition_penalty 0": ("text", {"repetition_penalty": 0}, 400, "repetition_penalty must be > 0"),
    "min_p 2": ("chat", {"min_p": 2}, 400, "min_p must be in [0, 1]"),
    "logit_bias key": ("chat", {"logit_bias": {"w5": 3}}, 400, "logit_bias keys must be token ids"),
    "logit_bias token": ("chat", {"logit_bias": {"9999": 3}}, 400, "token id 9999, outside the vocabulary"),
    "logit_bias 200": ("text", {"logit_bias": {"5": 200}}, 400, "logit_bias values must be in [-100.0, 100.0]"),
    "min_tokens over max_tokens": ("text", {"min_tokens": 9, "max_tokens": 4}, 400, "min_tokens 9 is more than"),
    "an unknown field": ("chat", {"frobnicate": 1}, 400, "'frobnicate' is not supported"),
    "a vLLM field we lack": ("text", {"include_stop_str_in_output": True}, 400, "'include_stop_str_in_output' is"),
    "tools without a parser": ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "needs the"),
    "tools on completions": ("text", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "'tools' is"),
    "max_tokens not a number": ("chat", {"max_tokens": "many"}, 400, "max_tokens"),
    "max_tokens 0": ("text", {"max_tokens": 0}, 400, "max_tokens must be > 0"),
    "logprobs 6": ("text", {"logprobs": 6}, 400, "logprobs must be in [0, 5]"),
    "echo": ("text", {"echo": True}, 400, "'echo' is not supported"),
    "two prompts": ("text", {"prompt": ["w5", "w6"]}, 400, "one prompt per request"),
    "prompt too long": ("text", {"prompt": list(range(3, 70))}, 400, "max_model_len 64"),
    "another model": ("text", {"model": "gpt-4"}, 404, "does not exist"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_parameters_get_an_openai_error(server, name):
    endpoint, fields, status, fragment = BAD[name]
    base = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "w5 w6"}
    create = server.client.chat.completions.create if endpoint == "chat" else server.client.completions.create
    with pytest.raises(openai.APIStatusError) as info:
        create(**{"model": None, **base, "extra_body": fields})
    assert info.value.status_code == status and fragment in info.value.body["message"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    code, body = server.raw("POST", path, {**base, **fields}, key=KEY)
    assert code == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == ("invalid_argument" if status == 400 else "model_not_found")  # one code a status


@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_null_booleans_are_false(server, endpoint):
    """OpenAI's booleans are nullable: clients that pass their defaults through send null."""
    base = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "w5 w6"}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    fields = {"stream": None, "ignore_eos": None, "max_tokens": 2, **({"logprobs": None} if endpoint == "chat" else {})}
    code, body = server.raw("POST", path, {**base, **fields}, key=KEY)
    assert code == 200, body
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] <= 2


def test_without_a_valid_key_401(server):
    for key in (None, "sk-wrong"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/models/")):
            status, body = server.raw(method, path, {"prompt": "w5"} if method == "POST" else None, key=key)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert ("missing API key" if key is None else "invalid API key") in body["error"]["message"]
            assert KEY not in json.dumps(body)
    wrong = openai.OpenAI(base_url=server.client.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=None, messages=MESSAGES)


PROCESSING = dict(
    presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={9: 2.0, 126: -100}, min_tokens=5
)


def test_processing_and_top_logprobs_are_the_same_with_and_without_speculation(server):
    """Penalties, logit_bias, min_tokens and min_p: the server's n-gram speculation emits the tokens (and top
    logprobs) of the same request without speculation; and they change the output."""

    def complete(speculate: bool, **processing) -> pb.CompleteResponse:
        sampling = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, **processing)
        request = pb.CompleteRequest(
            prompt_token_ids=PROMPT_IDS, sampling=sampling, speculation=pb.SpeculationParams(enabled=speculate)
        )
        return server.stub.Complete(request, metadata=server.metadata)

    num_drafts = 0
    for processing in (PROCESSING, {"repetition_penalty": 0.8}, {"frequency_penalty": -0.5, "min_p": 0.5}):
        spec, plain = complete(True, **processing), complete(False, **processing)
        assert plain.usage.draft_tokens == 0
        num_drafts += spec.usage.draft_tokens
        assert list(spec.token_ids) == list(plain.token_ids)
        assert [list(t.token_ids) for t in spec.top_logprobs] == [list(t.token_ids) for t in plain.top_logprobs]
        assert len(spec.top_logprobs) == len(spec.token_ids) and all(len(t.token_ids) == 3 for t in spec.top_logprobs)
        assert [t.token_ids[0] for t in spec.top_logprobs] == list(spec.token_ids)  # greedy: the top one
        assert [t.logprobs[0] for t in spec.top_logprobs] == pytest.approx(list(spec.logprobs))
    assert num_drafts > 0  # the encouraged repeats are drafted
    assert list(complete(False).token_ids) != list(complete(False, **PROCESSING).token_ids)


def test_top_logprobs_over_openai_whole_and_streamed(server):
    """Chat: top_logprobs alternatives per token (the chosen one first, greedy), streamed alike; completions:
    logprobs = 2 gives a {text: logprob} dict of two per token. The values are the gRPC API's."""
    sampling = pb.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2, presence_penalty=0.5, ignore_eos=True
    )
    expected = server.stub.Complete(
        pb.CompleteRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES], sampling=sampling),
        metadata=server.metadata,
    )
    kwargs = dict(
        model=None,
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        extra_body={"ignore_eos": True},
    )
    content = server.client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        e
        for c in server.client.chat.completions.create(**kwargs, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    for entries in (content, streamed):
        assert len(entries) == len(expected.token_ids)
        for entry, top in zip(entries, expected.top_logprobs):
            assert [a.logprob for a in entry.top_logprobs] == pytest.approx(list(top.logprobs))
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    text = server.client.completions.create(
        model=None, prompt=PROMPT_IDS, temperature=0, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    ).choices[0]
    assert [len(alts) for alts in text.logprobs.top_logprobs] == [2] * 4
    assert [max(alts.values()) for alts in text.logprobs.top_logprobs] == pytest.approx(text.logprobs.token_logprobs)


def test_n_choices_share_the_prompt_and_each_equals_its_seed_alone(server):
    """n = 3 with seed s: choice i is the output of seed s + i alone; choices 1 and 2 find the prompt's full
    blocks in the prefix cache (choice 0 computed them); usage counts the prompt once and every choice's tokens.
    Streamed, the chunks of the three choices reassemble to the same texts."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # no other test sends it: 2 full blocks to share
    kwargs = dict(model=None, temperature=0.9, max_tokens=8, seed=100, extra_body={"ignore_eos": True})

    def hits() -> float:
        return server.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=server.metadata).counters.prefix_cache_hits

    before = hits()
    whole = server.client.completions.create(prompt=prompt, n=3, **kwargs)
    assert hits() - before == 2 * 8  # choices 1 and 2: both full blocks from the cache; choice 0: none
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [server.client.completions.create(prompt=prompt, **{**kwargs, "seed": 100 + i}) for i in range(3)]
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in whole.choices}) > 1  # distinct seeds: distinct samples
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 3 * 8
    assert _speculative(whole.usage)["draft_tokens"] == sum(_speculative(a.usage)["draft_tokens"] for a in alone)

    chunks = list(
        server.client.chat.completions.create(
            messages=MESSAGES, n=3, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    chat = server.client.chat.completions.create(messages=MESSAGES, n=3, **kwargs)
    assert streamed == [c.message.content for c in chat.choices]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 8


def test_n_choices_over_grpc(server):
    """Complete with n = 3: every choice in `choices` (choice 0's also at the top), each the seed s + i request
    alone, usage over all; Generate streams every choice's messages with its index; n out of range is refused."""
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29]

    def request(**sampling) -> pb.CompleteRequest:
        params = pb.SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, **sampling)
        return pb.CompleteRequest(prompt_token_ids=prompt, sampling=params)

    whole = server.stub.Complete(request(n=3, seed=40), metadata=server.metadata)
    alone = [server.stub.Complete(request(seed=40 + i), metadata=server.metadata) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [list(c.token_ids) for c in whole.choices] == [list(a.token_ids) for a in alone]
    assert list(whole.token_ids) == list(whole.choices[0].token_ids) and whole.text == whole.choices[0].text
    assert whole.usage.completion_tokens == 3 * 6 and whole.usage.prompt_tokens == len(prompt)
    streamed: dict[int, list[int]] = {}
    finished = []
    generate = pb.GenerateRequest(prompt_token_ids=prompt, sampling=request(n=3, seed=40).sampling)
    for response in server.stub.Generate(generate, metadata=server.metadata):
        streamed.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            finished.append(response.index)
            assert response.usage.completion_tokens == 6  # each choice's last message: its own usage
    assert sorted(finished) == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == [list(c.token_ids) for c in whole.choices]
    assert not server.stub.Complete(request(seed=40), metadata=server.metadata).choices  # n = 1: no list
    for n in (0, 17):
        with pytest.raises(grpc.RpcError) as info:
            server.stub.Complete(request(n=n), metadata=server.metadata)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16]" in info.value.details()
