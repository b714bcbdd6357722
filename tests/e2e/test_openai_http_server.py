"""The HTTP API's serving behaviour: client disconnects, drain, the open-stream bound, TLS, --http-port.

The scheduler runs in this process as run_scheduler sets it up (gRPC and the
HTTP server on 127.0.0.1, port 0) in front of a slow simulated worker
(tests/sim_worker.py), so a long request is still running when the client
goes; the tiny model's tokenizer serves text and chat prompts.
"""

import argparse
import contextlib
import http.client
import json
import socket
import ssl
import threading
import time

import pytest

from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.membership import Membership, parse_worker_spec
from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.frontends.http_server import HttpServer
from scheduler_service.frontends.openai_api import create_app
from scheduler_service.frontends.server import create_server
from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.process.flags import add_flags, add_security_flags, options_from_args
from scheduler_service.process.main import drain
from specdec.security import TlsFiles
from specdec.v1 import generation_pb2 as pb
from tests.certs import TestCA
from tests.e2e.client import InProcessApi
from tests.sim_worker import SimWorkerServer

LONG = {"prompt": [5, 6], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}  # ~15 s at 0.02 s a step


class Api(InProcessApi):
    """The HTTP address besides the gRPC stub (for GetServerInfo) and what runs behind them."""

    def __init__(self, http_port: int, grpc_port: int, cluster: Cluster, servicer):
        super().__init__(f"127.0.0.1:{grpc_port}", cluster, servicer)
        self.http_port = http_port

    def post(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        conn.request("GET", path)
        response = conn.getresponse()
        status, body = response.status, json.loads(response.read())
        conn.close()
        return status, body


@contextlib.contextmanager
def scheduler(tiny_pair, tls: TlsFiles = TlsFiles(), **options):
    worker = SimWorkerServer(step_time_s=0.02, num_blocks=1024)
    opts = SchedulerOptions(
        model_dir=str(tiny_pair.target_path), worker_addresses=(worker.address,), port=0, block_size=4, **options
    )
    tokenizer = ChatTokenizer(opts.model_dir)
    server, servicer, port = create_server(opts.host, opts.port, opts.max_open_streams)
    http_server = HttpServer(create_app(servicer.frontend), "127.0.0.1", 0, tls)  # port 0: any (the flag's 0 is off)
    http_server.start()
    cluster = Cluster(opts, Membership([parse_worker_spec(worker.address)]), tokenizer, servicer.set_serving)
    cluster.start()
    api = None
    try:
        cluster.wait_for_facts(20)
        servicer.attach(cluster, tokenizer)
        api = Api(http_server.port, port, cluster, servicer)
        deadline = time.monotonic() + 20
        while not servicer.frontend.is_serving:  # once the worker serves
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield api
    finally:
        if api is not None:
            api.channel.close()
        http_server.stop()
        server.stop(grace=None)
        cluster.stop()
        worker.stop()


@pytest.fixture(scope="module")
def api(tiny_pair):
    with scheduler(tiny_pair) as api_:
        yield api_


def _close(conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
    """Drops the connection as a client that goes away does."""
    response.close()
    conn.close()


def test_a_client_that_disconnects_mid_stream_frees_the_blocks(api):
    conn, response = api.post("/v1/completions", {**LONG, "stream": True})
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    first = json.loads(response.readline().removeprefix(b"data: "))
    assert first["object"] == "text_completion"
    api.wait_live(1)
    _close(conn, response)
    api.wait_all_free(timeout=5)  # the request would run ~15 s more


def test_a_client_that_disconnects_while_waiting_for_a_whole_reply_frees_the_blocks(api):
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3000, "ignore_eos": True}),
        headers={"Content-Type": "application/json"},
    )
    api.wait_live(1)
    conn.close()
    api.wait_all_free(timeout=5)


def test_the_open_stream_bound_is_shared_with_grpc(tiny_pair):
    with scheduler(tiny_pair, max_open_streams=1) as api:
        call = api.stub.Generate(
            pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=3000, ignore_eos=True))
        )
        next(call)
        conn, response = api.post("/v1/completions", {"prompt": "w5", "max_tokens": 2})
        body = json.loads(response.read())
        assert response.status == 429 and "--max-open-streams" in body["error"]["message"]
        assert body["error"]["code"] == "resource_exhausted"
        call.cancel()
        api.wait_all_free(timeout=5)
        conn, response = api.post("/v1/completions", {"prompt": "w5", "max_tokens": 2})
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2


def test_drain_health_503_new_requests_503_and_unfinished_streams_end_with_an_error_event(tiny_pair):
    with scheduler(tiny_pair) as api:
        assert api.get("/health") == (200, {"status": "serving"})  # no key needed
        conn, response = api.post("/v1/completions", {**LONG, "stream": True})
        response.readline()
        drainer = threading.Thread(target=drain, args=(api.servicer, api.cluster, 0.5))
        drainer.start()
        deadline = time.monotonic() + 5
        while api.get("/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _, refused = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]})
        error = json.loads(refused.read())["error"]
        assert refused.status == 503 and "shutting down" in error["message"] and error["type"] == "server_error"
        events = [line for line in response.read().decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        failure = json.loads(events[-2].removeprefix("data: "))["error"]
        assert failure["code"] == "unavailable" and "shutdown grace period" in failure["message"]
        drainer.join(10)


def test_https_with_the_client_port_files(tiny_pair, tmp_path):
    ca = TestCA(tmp_path)
    cert = ca.issue("server", ["localhost"], ["127.0.0.1"])
    with scheduler(tiny_pair, tls=TlsFiles(cert.certfile, cert.keyfile)) as api:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", api.http_port, timeout=10, context=ssl.create_default_context(cafile=ca.ca_file)
        )
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plaintext against TLS
            api.get("/health")


def test_http_port_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    add_flags(parser)
    add_security_flags(parser)
    assert options_from_args(parser.parse_args([]), "", ["127.0.0.1:1"]).http_port == 0  # off by default
    assert options_from_args(parser.parse_args(["--http-port", "8000"]), "", ["127.0.0.1:1"]).http_port == 8000
    for bad, fragment in ((-1, "0..65535"), (65536, "0..65535"), (50051, "also --port")):
        with pytest.raises(ValueError, match=fragment):
            options_from_args(parser.parse_args(["--http-port", str(bad)]), "", ["127.0.0.1:1"])
    assert options_from_args(parser.parse_args([]), "", ["127.0.0.1:1"]).served_model_name is None
    with pytest.raises(ValueError, match="--served-model-name must not be empty"):
        options_from_args(parser.parse_args(["--served-model-name", " "]), "", ["127.0.0.1:1"])


def test_an_http_port_in_use_is_an_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1"):
            HttpServer(lambda scope, receive, send: None, "127.0.0.1", taken.getsockname()[1])


def test_a_body_over_4_mb_gets_413(api):
    big = json.dumps({"prompt": "w5 " * (2 << 20)}).encode()
    for chunked in (False, True):  # with content-length; chunked, counted as it comes
        conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            body=iter([big]) if chunked else big,
            headers={"Content-Type": "application/json"},
            encode_chunked=chunked,
        )
        response = conn.getresponse()
        assert response.status == 413 and "larger than 4194304 bytes" in json.loads(response.read())["error"]["message"]
        conn.close()
    conn, response = api.post("/v1/completions", {"prompt": "w5", "max_tokens": 2})
    assert response.status == 200
