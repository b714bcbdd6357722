"""What a new user gets: `specdec serve` with no flags but its ports (the README's first command, a real process)
serves the embedded SmolLM2 under the model's own name, and speculates, with the output of plain decoding (a
`--proposer none` server in this process)."""

import grpc
import pytest

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from tests.e2e.client import http_json
from tests.processes import free_port, running
from tests.serving import serve_in_process
from worker_service.runtime.default_model import DEFAULT_MODEL_NAME, default_model_path
from worker_service.speculation.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_PROPOSER

pytestmark = pytest.mark.slow

# A prompt whose answer repeats its input: copying proposers have something to draft.
MESSAGES = [
    {
        "role": "user",
        "content": "Repeat this sentence three times: the quick brown fox jumps over the lazy dog near the river bank.",
    }
]
MAX_TOKENS = 48


def _chat(port: int, **fields) -> tuple[int, dict]:
    return http_json(
        port,
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **fields},
    )


def test_serve_without_flags_speculates_losslessly_under_the_models_name():
    http_port = free_port()
    with running(["serve", "--port", "0", "--http-port", str(http_port)]) as process:
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")
        with grpc.insecure_channel(address) as channel:
            info = generation_pb2_grpc.GenerationServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest())
        assert (info.proposer, info.num_speculative_tokens) == (
            DEFAULT_PROPOSER,
            DEFAULT_NUM_SPECULATIVE_TOKENS[DEFAULT_PROPOSER],
        )
        assert info.model == DEFAULT_MODEL_NAME
        assert [m["id"] for m in http_json(http_port, "GET", "/v1/models")[1]["data"]] == [DEFAULT_MODEL_NAME]

        status, speculative = _chat(http_port, model=DEFAULT_MODEL_NAME)
        assert status == 200, speculative
        assert speculative["model"] == DEFAULT_MODEL_NAME
        assert speculative["usage"]["speculative_decoding"]["draft_tokens"] > 0
        assert _chat(http_port, model=str(default_model_path()))[0] == 200  # the model id (its path) too
        assert _chat(http_port, model="gpt-4o")[0] == 404

    http_port = free_port()
    with serve_in_process(["--http-port", str(http_port), "--proposer", "none"]):
        status, plain = _chat(http_port)
    assert status == 200, plain
    assert plain["usage"]["speculative_decoding"]["draft_tokens"] == 0
    assert speculative["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert speculative["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
