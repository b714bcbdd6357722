"""The worker's step socket (--step-port; specdec/step_wire.py) where it differs from the gRPC stream: its
framing, a scheduler that leaves without END, the worker shutting down, a port the scheduler cannot reach,
and TLS. What both transports share (steps, rejected steps, the one-session rule) is tested on both in
test_worker_server.py and tests/scheduler/cluster/test_cluster.py."""

import logging
import socket
import struct
import time

import grpc
import pytest

from scheduler_service.cluster.worker_client import SocketStepStream, StepStream, WorkerClient
from specdec import step, step_wire
from specdec.cli import build_parser
from tests.certs import TestCA
from tests.e2e.client import expect_status
from tests.serving import worker_in_process
from worker_service.serving.step_socket import StepSocketServer

BLOCK_SIZE = 16
NUM_BLOCKS = 64
GREEDY = step.RequestSampling(temperature=0.0)


@pytest.fixture(scope="module")
def worker(tiny_pair):
    with worker_in_process(
        ["--model", str(tiny_pair.target_path), "--num-threads", "1", "--proposer", "none", "--step-port", "0"]
    ) as served:
        yield served


@pytest.fixture
def client(worker):
    client = WorkerClient(worker.address)
    yield client
    client.close()


def new_request(request_id: str) -> step.StepRequest:
    return step.StepRequest(1, new_requests=[step.NewRequest(request_id, [5, 6, 7], 3, GREEDY, [0], 3)])


def raw_stream(worker) -> tuple[socket.socket, step_wire.FrameReader]:
    sock = socket.create_connection(("127.0.0.1", worker.step_server.port), timeout=30)
    return sock, step_wire.FrameReader(sock)


def expect_error_frame(reader: step_wire.FrameReader, code: grpc.StatusCode, fragment: str) -> None:
    """The worker answers with an ERROR frame, then closes the connection."""
    kind, payload = reader.read()
    assert kind == step_wire.ERROR
    error = step_wire.error_from_payload(payload)
    assert error.code() == code and fragment in error.details(), error.details()
    assert reader.read() is None


def decodes(client: WorkerClient, session_id: str, request_id: str) -> list[int]:
    """Opens a step-socket stream of the session, decodes one new request, ends the stream with END."""
    stream = client.open_stream(session_id, client.describe(BLOCK_SIZE).step_port)
    assert isinstance(stream, SocketStepStream)
    stream.send(new_request(request_id))
    tokens = stream.recv().outputs[0].token_ids
    stream.finish()
    return tokens


def test_broken_framing_gets_invalid_argument_and_the_worker_serves_on(worker, client):
    session_id = client.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    sock, reader = raw_stream(worker)
    step_wire.write_frame(sock, step_wire.HELLO, b"GET / HTTP/1.1")
    expect_error_frame(reader, grpc.StatusCode.INVALID_ARGUMENT, "not a specdec step stream")
    sock.close()

    sock, reader = raw_stream(worker)
    step_wire.write_frame(sock, step_wire.HELLO, (step_wire.HELLO_PREFIX + session_id).encode())
    step_wire.write_frame(sock, 99, b"")
    expect_error_frame(reader, grpc.StatusCode.INVALID_ARGUMENT, "got frame kind 99")
    sock.close()

    sock, reader = raw_stream(worker)
    step_wire.write_frame(sock, step_wire.HELLO, (step_wire.HELLO_PREFIX + session_id).encode())
    sock.sendall(step_wire.HEADER.pack(step_wire.MAX_PAYLOAD_BYTES + 1, step_wire.STEP))
    expect_error_frame(reader, grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit")
    sock.close()

    sock, reader = raw_stream(worker)
    step_wire.write_frame(sock, step_wire.HELLO, (step_wire.HELLO_PREFIX + session_id).encode())
    step_wire.write_frame(sock, step_wire.STEP, b"\xff\xff\xff")
    expect_error_frame(reader, grpc.StatusCode.INVALID_ARGUMENT, "does not parse")
    sock.close()

    # Each of those streams closed its session's stream at the worker: the session opens the next one.
    assert len(decodes(client, session_id, "after")) == 1


def test_a_stream_left_without_end_frees_its_session(worker, client):
    """Closing the connection without END is a cancelled call: the worker drops the stream (the steps it had
    not started never run), and the session's next stream is admitted."""
    session_id = client.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    stream = client.open_stream(session_id, worker.step_server.port)
    stream.send(new_request("a"))
    assert len(stream.recv().outputs[0].token_ids) == 1
    stream.close()
    deadline = time.monotonic() + 30
    while True:  # the worker sees the connection end on its own thread: the next stream may come first
        try:
            assert len(decodes(client, session_id, "b")) == 1
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "already open" in exc.details()
            assert time.monotonic() < deadline, "the abandoned stream still holds the session"
            time.sleep(0.05)


def test_a_connection_that_never_says_hello_is_dropped(worker, monkeypatch):
    from worker_service.serving import step_socket

    monkeypatch.setattr(step_socket, "HELLO_TIMEOUT_S", 0.2)
    sock, reader = raw_stream(worker)
    sock.sendall(struct.pack("<I", 5))  # half a header, then nothing
    assert reader.read() is None  # the worker hung up without a word: there was no stream to report to


def test_the_stream_ends_after_the_steps_in_flight_when_the_worker_stops(tiny_pair):
    """SIGTERM (begin_shutdown): no new step starts and the stream ends, as gRPC's does, so the scheduler moves
    the session's requests."""
    with worker_in_process(
        ["--model", str(tiny_pair.target_path), "--num-threads", "1", "--proposer", "none", "--step-port", "0"]
    ) as served:
        client = WorkerClient(served.address)
        try:
            stream = client.open_stream(client.init_cache(NUM_BLOCKS, BLOCK_SIZE), served.step_server.port)
            stream.send(new_request("a"))
            assert len(stream.recv().outputs[0].token_ids) == 1
            served.servicer.begin_shutdown()
            stream.send(step.StepRequest(2, cached_requests=[step.CachedRequest("a", [], 1, 1)]))
            with pytest.raises(StopIteration):
                stream.recv()
            stream.close()
        finally:
            client.close()


def test_a_step_port_the_scheduler_cannot_reach_falls_back_to_grpc(worker, client, caplog):
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    session_id = client.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    with caplog.at_level(logging.WARNING):
        stream = client.open_stream(session_id, port)
    assert isinstance(stream, StepStream)
    assert f"cannot reach its step socket (port {port})" in caplog.text and "go over gRPC" in caplog.text
    stream.send(new_request("a"))
    assert len(stream.recv().outputs[0].token_ids) == 1
    stream.finish()


def test_an_error_frame_is_a_grpc_error_to_the_scheduler(worker, client):
    session_id = client.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    stream = client.open_stream(session_id, worker.step_server.port)
    stream.send(step.StepRequest(1, cached_requests=[step.CachedRequest("nope", [], 0, 1)]))
    expect_status(stream.recv, grpc.StatusCode.INVALID_ARGUMENT, "unknown request id 'nope'")
    stream.close()


def test_a_step_port_cannot_go_with_tls(tmp_path, capsys):
    ca = TestCA(tmp_path)
    cert = ca.issue("worker", ip_addresses=["127.0.0.1"])
    args = build_parser().parse_args(
        ["worker", "--port", "0", "--step-port", "0", "--ssl-certfile", cert.certfile, "--ssl-keyfile", cert.keyfile]
    )
    assert args.func(args) == 1
    assert "--step-port serves the step stream in plaintext: it cannot go with TLS" in capsys.readouterr().err


def test_the_worker_s_error_wins_over_a_send_that_failed_after_it(worker, client):
    """A stale session's stream is refused and closed by the worker; steps the scheduler sent meanwhile fail to
    send, and the error it sees is still the worker's (FAILED_PRECONDITION), not a broken pipe."""
    client.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    stream = client.open_stream("0" * 32, worker.step_server.port)
    for step_id in range(1, 50):  # the worker hangs up after the hello: a send soon fails
        stream.send(step.StepRequest(step_id))
        time.sleep(0.002)
    expect_status(stream.recv, grpc.StatusCode.FAILED_PRECONDITION, "stale session")
    stream.close()


@pytest.mark.parametrize("host", ["[::1]", "::1"])
def test_an_ipv6_host_as_grpc_writes_it(host):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    served = []

    def run_session(session_id, requests, is_active):
        served.append(session_id)
        return iter(())

    server = StepSocketServer(host, 0, run_session)
    try:
        sock = socket.create_connection(("::1", server.port), timeout=30)
        step_wire.write_frame(sock, step_wire.HELLO, (step_wire.HELLO_PREFIX + "s1").encode())
        assert step_wire.FrameReader(sock).read() is None  # an empty stream: it ends at once
        sock.close()
        assert served == ["s1"]
    finally:
        server.stop()
