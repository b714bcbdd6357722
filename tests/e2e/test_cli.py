"""The `specdec` command in real processes: SPECDEC_<FLAG> variables, global flags after the subcommand, JSON
logs, the periodic stats line, and `specdec generate --ca-file`."""

import json
import subprocess
import sys

import grpc
import pytest

from scheduler_service.cluster.worker_client import WorkerClient
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from tests.certs import TestCA
from tests.processes import running

STATS_LINE = (
    r"INFO scheduler_service.process.stats_logger: Avg prompt throughput: \d+\.\d tokens/s, Avg generation "
    r"throughput: \d+\.\d tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, "
    r"Prefix cache hit rate: (\d+\.\d%|-), acceptance rate: \d+\.\d% \(tokens per speculating step \d\.\d\d\)"
)


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki") / "ca")
    return ca.ca_file, ca.issue("server", ["localhost"], ["127.0.0.1"])


def test_serve_configured_by_environment_variables(tiny_pair, server_cert):
    """TLS, speculation, block size and the stats interval come from the environment; the client port's TLS
    must not reach the loopback workers (they would refuse the scheduler's plaintext); --log-level after the
    subcommand turns on DEBUG."""
    ca_file, cert = server_cert
    env = {
        "SPECDEC_SSL_CERTFILE": cert.certfile,
        "SPECDEC_SSL_KEYFILE": cert.keyfile,
        "SPECDEC_PROPOSER": "ngram",
        "SPECDEC_NUM_SPECULATIVE_TOKENS": "3",
        "SPECDEC_BLOCK_SIZE": "4",
        "SPECDEC_LOG_STATS_INTERVAL": "0.3",
    }
    args = ["serve", "--port", "0", "--model", str(tiny_pair.target_path), "--num-threads", "1", "--log-level", "DEBUG"]
    with running(args, env=env) as process:
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")
        credentials = grpc.ssl_channel_credentials(root_certificates=open(ca_file, "rb").read())
        with grpc.secure_channel(address, credentials) as channel:
            info = generation_pb2_grpc.GenerationServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest())
        assert (info.proposer, info.num_speculative_tokens, info.block_size) == ("ngram", 3, 4)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec",
                "generate",
                "--raw",
                "w5 w6 w7 w5 w6 w7 w5 w6",
                "--max-tokens",
                "24",
                "--address",
                address,
                "--ca-file",
                ca_file,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "completion 24" in out.stderr
        process.wait_for(STATS_LINE, timeout=5)  # well before the default interval (10 s) would log it
        process.wait_for(r"DEBUG scheduler_service\.core\.scheduler: released ", timeout=30)


def test_worker_configured_by_environment_variables_logs_json(tiny_pair):
    """SPECDEC_DTYPE=half reaches the worker's Describe; --log-format json after the subcommand."""
    env = {"SPECDEC_DTYPE": "half", "SPECDEC_NUM_THREADS": "1", "SPECDEC_LOG_LEVEL": "DEBUG"}
    args = ["worker", "--port", "0", "--model", str(tiny_pair.target_path), "--log-format", "json"]
    with running(args, env=env) as process:
        address = process.address(who="worker ")
        process.wait_for("worker model loaded")
        client = WorkerClient(address)
        try:
            assert client.describe(4).dtype == "float16"
        finally:
            client.close()
        entries = [json.loads(line) for line in process.lines if line.startswith("{")]
    loading = [e for e in entries if e["logger"] == "worker_service.runtime.loader" and "loading model" in e["message"]]
    assert loading and loading[0]["level"] == "INFO" and "(float16 on " in loading[0]["message"]
    assert {"time", "level", "logger", "message"} <= set(loading[0])


def test_worker_on_a_cuda_device_the_host_lacks_exits_with_the_reason(tiny_pair):
    args = ["worker", "--port", "0", "--model", str(tiny_pair.target_path), "--num-threads", "1", "--device", "cuda:64"]
    out = subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "specdec worker: error: --device cuda:64: " in out.stderr  # no CUDA here, or fewer than 65 devices
