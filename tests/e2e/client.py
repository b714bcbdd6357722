"""gRPC (and plain HTTP) client helpers for end-to-end tests."""

from concurrent.futures import ThreadPoolExecutor
import contextlib
import http.client
import json
import time

import grpc
from grpc_health.v1 import health_pb2_grpc
import pytest

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from tests.processes import running


class Server:
    """A `specdec serve` process and a stub to its client API (tests/serving.py: the same, in this process)."""

    def __init__(self, process):
        self.process = process
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")
        self.connect(address)

    def connect(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def info(self) -> pb.GetServerInfoResponse:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest())

    def wait_idle(self, timeout: float = 30.0) -> pb.GetServerInfoResponse:
        """Waits until no request runs and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (
                info.num_running == 0 and info.num_waiting == 0 and info.num_free_kv_blocks == info.num_kv_blocks
            ) or time.monotonic() > deadline:
                return info
            time.sleep(0.05)


class InProcessApi:
    """A stub to a scheduler running in the test process, the cluster behind it, and waits on its state."""

    def __init__(self, address: str, cluster, servicer):
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.cluster, self.servicer = cluster, servicer

    def wait_all_free(self, timeout: float = 10.0) -> pb.GetServerInfoResponse:
        """Waits until no request runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
            if info.num_running == info.num_waiting == 0 and info.num_free_kv_blocks == info.num_kv_blocks:
                return info
            assert time.monotonic() < deadline, f"blocks still held: {info}"
            time.sleep(0.02)

    def wait_live(self, num_requests: int, timeout: float = 60.0, calls=()) -> None:
        """Waits until the cluster holds `num_requests` accepted, unfinished requests; on a timeout the message
        says how the given `calls` (gRPC futures) ended, if they did."""
        self._wait_for(lambda: self.cluster.num_live_requests, num_requests, "live", timeout, calls)

    def wait_running(self, num_requests: int, timeout: float = 60.0, calls=()) -> None:
        """Waits until `num_requests` requests run (are past the waiting queue); reports like `wait_live`."""
        self._wait_for(
            lambda: self.stub.GetServerInfo(pb.GetServerInfoRequest()).num_running,
            num_requests,
            "running",
            timeout,
            calls,
        )

    @staticmethod
    def _wait_for(count, num_requests: int, what: str, timeout: float, calls) -> None:
        deadline = time.monotonic() + timeout
        while (now := count()) < num_requests:
            if time.monotonic() >= deadline:
                ended = [f"{c.code()}: {c.details()}" for c in calls if c.done()]
                raise AssertionError(
                    f"{now} of {num_requests} requests {what}; {len(ended)} of {len(calls)} calls ended: {ended}"
                )
            time.sleep(0.02)


@contextlib.contextmanager
def serve(args: list[str]):
    with running(["serve", "--port", "0", *args]) as process:
        server = Server(process)
        try:
            yield server
        finally:
            server.channel.close()


def expect_status(call, code: grpc.StatusCode, fragment: str) -> grpc.RpcError:
    """Runs call(), which must fail with `code` and a message containing `fragment`; returns the error."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()
    return info.value


def as_complete(request: pb.GenerateRequest) -> pb.CompleteRequest:
    """The same request for Complete (CompleteRequest has GenerateRequest's fields, with the same numbers)."""
    return pb.CompleteRequest.FromString(request.SerializeToString())


def greedy_request(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt_ids,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
        **kwargs,
    )


def stream(stub, request: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse]:
    """Token ids of a streamed completion, and its last message."""
    token_ids, last = [], None
    for response in stub.Generate(request):
        token_ids.extend(response.token_ids)
        last = response
    return token_ids, last


def stream_all(stub, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], pb.GenerateResponse]]:
    """All requests streamed concurrently."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stream(stub, r), requests))


def chat_prompts(model_path, questions: list[str]) -> list[list[int]]:
    """Each question as a user message, rendered with the model's chat template, as token ids."""
    from worker_service.runtime.loader import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in questions
    ]


def http_json(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    """One HTTP call to 127.0.0.1:port with a JSON body (or none): the status and the decoded JSON reply."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            body=json.dumps(body) if body is not None else None,
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
