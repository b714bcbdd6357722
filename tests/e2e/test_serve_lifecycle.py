"""A real `specdec serve` as a supervisor and its clients see it: health says SERVING only when a request
would be admitted (polled the way a readiness probe does, then called at once), and a serve killed with its
process group leaves no worker process behind.

The window between a worker serving and the client API taking requests is narrow in a real process (how
narrow depends on the machine); the in-process test holds it open and checks both health endpoints in it.
"""

import os
import pathlib
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.membership import Membership, parse_worker_spec
from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.frontends.http_server import HttpServer
from scheduler_service.frontends.openai_api import create_app
from scheduler_service.frontends.server import create_server
from scheduler_service.frontends.tokenizer import ChatTokenizer
from specdec.v1 import generation_pb2_grpc
from tests.e2e.client import greedy_request, http_json
from tests.processes import Process, free_port, running
from tests.sim_worker import SimWorkerServer

NUM_STARTS = 4  # 2 per health path: each start takes ~10 s of the suite
POLL_S = 0.005  # as fast as a client that retries at once
WORKER_EXIT_S = 10.0


def _wait_until(is_ready, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_ready():
        assert time.monotonic() < deadline, "health never said SERVING"
        time.sleep(POLL_S)


def _grpc_health_serving(health) -> bool:
    response = health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.GenerationService"))
    return response.status == health_pb2.HealthCheckResponse.SERVING


def _http_health_serving(http_port: int) -> bool:
    try:
        return http_json(http_port, "GET", "/health")[0] == 200
    except ConnectionError:  # the HTTP port is not bound yet
        return False


def test_health_waits_for_the_client_api_after_a_worker_serves(tiny_pair):
    """The scheduler's pieces as run_scheduler starts them, stopped between the cluster's first serving worker
    and the client API's attach: both health endpoints still say not serving there, and SERVING after it."""
    worker = SimWorkerServer()
    opts = SchedulerOptions(
        model_dir=str(tiny_pair.target_path), worker_addresses=(worker.address,), port=0, block_size=4
    )
    tokenizer = ChatTokenizer(opts.model_dir)
    server, servicer, port = create_server(opts.host, opts.port)
    http_server = HttpServer(create_app(servicer.frontend), "127.0.0.1", 0)
    http_server.start()
    worker_serves = threading.Event()

    def on_serving_changed(is_serving: bool) -> None:
        servicer.set_serving(is_serving)
        if is_serving:
            worker_serves.set()

    cluster = Cluster(opts, Membership([parse_worker_spec(worker.address)]), tokenizer, on_serving_changed)
    cluster.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            cluster.wait_for_facts(20)
            assert worker_serves.wait(20)
            assert not _grpc_health_serving(health)
            assert http_json(http_server.port, "GET", "/health")[0] == 503
            with pytest.raises(grpc.RpcError) as refused:  # what health promises: not admitted yet
                list(stub.Generate(greedy_request([5, 6], 2)))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            servicer.attach(cluster, tokenizer)
            assert _grpc_health_serving(health)
            assert _http_health_serving(http_server.port)
            assert sum(len(r.token_ids) for r in stub.Generate(greedy_request([5, 6], 2))) == 2
    finally:
        http_server.stop()
        server.stop(grace=None)
        cluster.stop()
        worker.stop()


def test_health_serving_means_a_request_is_admitted_at_once(tiny_pair):
    """NUM_STARTS fresh servers; each is polled until SERVING (gRPC health on even starts, HTTP /health on odd
    ones), then called at once through both APIs: no call may be refused as 'starting'."""
    for start in range(NUM_STARTS):
        http_port = free_port()
        args = [
            "serve",
            "--port",
            "0",
            "--http-port",
            str(http_port),
            "--model",
            str(tiny_pair.target_path),
            "--num-threads",
            "1",
            "--block-size",
            "4",
        ]
        with running(args) as process:
            address = process.address(who="scheduler ")
            with grpc.insecure_channel(address) as channel:
                if start % 2 == 0:
                    health = health_pb2_grpc.HealthStub(channel)
                    _wait_until(lambda: _grpc_health_serving(health))
                else:
                    _wait_until(lambda: _http_health_serving(http_port))
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                responses = list(stub.Generate(greedy_request([5, 6, 7, 8], 2), timeout=60))
                status, body = http_json(
                    http_port,
                    "POST",
                    "/v1/chat/completions",
                    {
                        "model": str(tiny_pair.target_path),
                        "max_tokens": 2,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": "w5 w6"}],
                    },
                )
            assert sum(len(r.token_ids) for r in responses) == 2, f"start {start}"
            assert status == 200, f"start {start}: {body}"
            assert body["usage"]["completion_tokens"] == 2, f"start {start}: {body}"


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid`."""
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it has exited meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (one whose new parent has not reaped it yet has exited all the same)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_exit_when_serve_is_killed_with_its_process_group(tiny_pair):
    """SIGKILL to serve's process group, as a supervisor sends after its grace period: the workers, which run
    in sessions of their own, must notice and exit within WORKER_EXIT_S."""
    args = ["serve", "--port", "0", "--num-workers", "2", "--model", str(tiny_pair.target_path), "--num-threads", "1"]
    process = Process(args, start_new_session=True)
    try:
        process.wait_for("scheduler ready")
        workers = _children(process.proc.pid)
        assert len(workers) == 2 and all(_is_running(pid) for pid in workers), workers
        assert all(os.getpgid(pid) != process.proc.pid for pid in workers)  # beyond the group's SIGKILL
        os.killpg(process.proc.pid, signal.SIGKILL)
        process.proc.wait(10)
        deadline = time.monotonic() + WORKER_EXIT_S
        while any(_is_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _is_running(pid)], "workers outlived the killed serve"
    finally:
        for pid in workers if "workers" in locals() else []:
            if _is_running(pid):
                os.kill(pid, signal.SIGKILL)
        process.stop()
