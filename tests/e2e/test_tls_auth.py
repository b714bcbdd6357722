"""TLS on the client port, mutual TLS to the workers, API keys: real servers on 127.0.0.1 port 0.

Certificates are made per test session with `cryptography` (tests/certs.py). The in-process scheduler drives
simulated workers (tests/sim_worker.py); the last test runs real `specdec serve` / `specdec generate` processes
with the tiny model.
"""

import contextlib
import logging
import os
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.membership import Membership, parse_worker_spec
from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.cluster.worker_client import WorkerClient
from scheduler_service.frontends.auth import security_hooks
from scheduler_service.frontends.server import create_server
from specdec import security
from specdec.security import TlsFiles
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from tests.certs import TestCA
from tests.e2e.client import greedy_request
from tests.processes import running
from tests.sim_worker import PieceTokenizer, SimWorkerServer, reference_output

KEY = "sk-test-7f3a9c1e5b2d4a60"  # the valid key; must never show up in logs or messages
OTHER_KEY = "sk-also-valid-0b8e2f"  # a second valid key (from the environment)
WRONG_KEY = "sk-wrong-c0ffee-1234"
PROMPT = [3, 1, 4, 1, 5]
MAX_TOKENS = 8
RPC_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server certificate for 127.0.0.1/localhost, one for a worker DNS name only, client
    certificates, and a second (rogue) CA with a client certificate of its own."""
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(directory / "ca"), TestCA(directory / "rogue", name="rogue CA")
    return dict(
        ca=ca.ca_file,
        server=ca.issue("server", ["localhost"], ["127.0.0.1"]),
        named_worker=ca.issue("worker", ["specdec-worker.test"]),
        client=ca.issue("client", is_server=False),
        rogue_client=rogue.issue("rogue", is_server=False),
    )


def _server_tls(pki, cert="server", ca=False, prefix="--ssl-") -> TlsFiles:
    return TlsFiles(pki[cert].certfile, pki[cert].keyfile, pki["ca"] if ca else None, flag_prefix=prefix)


def _client_credentials(pki, ca: bool = True, cert: str | None = None) -> grpc.ChannelCredentials:
    """TLS trusting the test CA (else the system roots), presenting `cert` (a pki entry) if given."""
    read = lambda path: path and open(path, "rb").read()  # noqa: E731
    files = pki[cert] if cert else None
    return grpc.ssl_channel_credentials(
        root_certificates=read(pki["ca"]) if ca else None,
        private_key=read(files and files.keyfile),
        certificate_chain=read(files and files.certfile),
    )


@contextlib.contextmanager
def scheduler(worker_addresses: list[str], **options):
    """The client API in this process, as run_scheduler sets it up (PieceTokenizer: token-id prompts only)."""
    opts = SchedulerOptions(
        model_dir="",
        worker_addresses=tuple(worker_addresses),
        port=0,
        block_size=4,
        worker_refresh_interval_s=0.1,
        **options,
    )
    server, servicer, port = create_server(opts.host, opts.port, **security_hooks(opts))
    cluster = Cluster(
        opts, Membership([parse_worker_spec(a) for a in worker_addresses]), PieceTokenizer(), servicer.set_serving
    )
    cluster.start()
    try:
        cluster.wait_for_facts(20)
        servicer.attach(cluster, PieceTokenizer())
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
        cluster.stop()


@pytest.fixture
def sim_worker():
    worker = SimWorkerServer()
    yield worker
    worker.stop()


def _stub(channel) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(channel)


def _generate(channel, metadata=None) -> list[int]:
    responses = _stub(channel).Generate(greedy_request(PROMPT, MAX_TOKENS), metadata=metadata, timeout=RPC_TIMEOUT_S)
    return [t for r in responses for t in r.token_ids]


# --- TLS and mutual TLS on the client port ---------------------------------------------------------------


def test_a_tls_client_port_needs_the_ca(pki, sim_worker):
    with scheduler([sim_worker.address], client_tls=_server_tls(pki)) as address:
        with grpc.insecure_channel(address) as channel:  # plaintext against TLS
            with pytest.raises(grpc.RpcError) as exc:
                _generate(channel)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, _client_credentials(pki, ca=False)) as channel:  # system roots only
            with pytest.raises(grpc.RpcError) as exc:
                _generate(channel)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, _client_credentials(pki)) as channel:
            assert _generate(channel) == reference_output(PROMPT, MAX_TOKENS)


def test_mutual_tls_on_the_client_port_refuses_a_client_without_a_certificate(pki, sim_worker):
    with scheduler([sim_worker.address], client_tls=_server_tls(pki, ca=True)) as address:
        for cert in (None, "rogue_client"):  # no certificate; one the CA did not sign
            with grpc.secure_channel(address, _client_credentials(pki, cert=cert)) as channel:
                with pytest.raises(grpc.RpcError) as exc:
                    _generate(channel)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, cert
        with grpc.secure_channel(address, _client_credentials(pki, cert="client")) as channel:
            assert _generate(channel) == reference_output(PROMPT, MAX_TOKENS)


# --- Mutual TLS between the scheduler and its workers ----------------------------------------------------


@pytest.fixture
def tls_worker(pki):
    """A simulated worker that accepts only clients with a certificate the CA signed."""
    worker = SimWorkerServer(credentials=security.server_credentials(_server_tls(pki, ca=True)))
    yield worker
    worker.stop()


def _worker_tls(pki, cert: str | None = "client") -> TlsFiles:
    files = pki[cert] if cert else None
    return TlsFiles(files and files.certfile, files and files.keyfile, pki["ca"], "--worker-ssl-", is_server=False)


def test_the_scheduler_serves_requests_through_a_mutual_tls_worker(pki, tls_worker):
    with scheduler([tls_worker.address], worker_tls=_worker_tls(pki)) as address:
        with grpc.insecure_channel(address) as channel:
            assert _generate(channel) == reference_output(PROMPT, MAX_TOKENS)
    assert tls_worker.servicer.num_steps > 0


@pytest.mark.parametrize("name", ["plaintext", "tls without a certificate", "certificate of another CA"])
def test_a_client_without_a_valid_certificate_cannot_reach_the_worker(pki, tls_worker, name):
    credentials = {
        "plaintext": None,
        "tls without a certificate": _client_credentials(pki),
        "certificate of another CA": _client_credentials(pki, cert="rogue_client"),
    }[name]
    client = WorkerClient(tls_worker.address, credentials)
    try:
        for call in (
            lambda: client.describe(4, timeout=RPC_TIMEOUT_S),
            lambda: client.init_cache(8, 4, timeout=RPC_TIMEOUT_S),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
    assert tls_worker.servicer.worker is None  # InitCache never ran


def test_worker_server_name_checks_a_certificate_that_names_a_host_not_the_ip(pki):
    """Workers found by dns:/// are dialled by IP; their certificate carries a DNS name instead."""
    worker = SimWorkerServer(credentials=security.server_credentials(_server_tls(pki, "named_worker", ca=True)))
    try:
        client = WorkerClient(worker.address, security.channel_credentials(_worker_tls(pki)))
        with pytest.raises(grpc.RpcError) as exc:  # 127.0.0.1 is not in the certificate
            client.describe(4, timeout=RPC_TIMEOUT_S)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()
        client = WorkerClient(
            worker.address, security.channel_credentials(_worker_tls(pki)), server_name="specdec-worker.test"
        )
        assert client.describe(4, timeout=RPC_TIMEOUT_S).model_id == "sim"
        client.close()
        with (
            scheduler(
                [worker.address], worker_tls=_worker_tls(pki), worker_server_name="specdec-worker.test"
            ) as address,
            grpc.insecure_channel(address) as channel,
        ):
            assert _generate(channel) == reference_output(PROMPT, MAX_TOKENS)
    finally:
        worker.stop()


# --- API keys ---------------------------------------------------------------------------------------------


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_api_keys_guard_every_generation_rpc_and_leave_health_open(sim_worker, caplog):
    caplog.set_level(logging.DEBUG)
    keys = security.load_api_keys(None, {security.API_KEY_ENV: OTHER_KEY}) | {KEY}
    with scheduler([sim_worker.address], api_keys=keys) as address, grpc.insecure_channel(address) as channel:
        stub = _stub(channel)
        messages = []
        for metadata in (None, _bearer(WRONG_KEY), [("authorization", KEY)], [("x-api-key", KEY)]):
            for call in (
                lambda: _generate(channel, metadata),
                lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata),
            ):
                with pytest.raises(grpc.RpcError) as exc:
                    call()
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
                messages.append(exc.value.details())
        assert _generate(channel, _bearer(KEY)) == reference_output(PROMPT, MAX_TOKENS)
        assert _generate(channel, [("authorization", f"bearer {OTHER_KEY}")]) == reference_output(PROMPT, MAX_TOKENS)
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=_bearer(KEY)).model == "sim"
        # Probes need no key.
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specdec.v1.GenerationService"), timeout=RPC_TIMEOUT_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "missing API key" in messages[0] and "invalid API key" in messages[2]
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert "rejected /specdec.v1.GenerationService/Generate" in logged  # the DEBUG lines were captured
    for secret in (KEY, OTHER_KEY, WRONG_KEY):
        assert not any(secret in m for m in messages)
        assert secret not in logged


def test_api_key_file_and_environment_are_both_accepted(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# production\n\n  {KEY}  \n# {WRONG_KEY} (revoked)\nsecond-key\n")
    assert security.load_api_keys(str(key_file), {}) == {KEY, "second-key"}
    assert security.load_api_keys(str(key_file), {security.API_KEY_ENV: OTHER_KEY}) == {KEY, "second-key", OTHER_KEY}
    assert security.load_api_keys(None, {security.API_KEY_ENV: OTHER_KEY}) == {OTHER_KEY}
    assert security.load_api_keys(None, {}) == frozenset()
    assert security.load_client_api_key(str(key_file), {security.API_KEY_ENV: OTHER_KEY}) == KEY
    assert KEY not in repr(SchedulerOptions(model_dir="", worker_addresses=("a:1",), api_keys=frozenset({KEY})))
    comments_only = tmp_path / "empty"
    comments_only.write_text("# none yet\n")
    with pytest.raises(ValueError, match="no key in the file"):
        security.load_api_keys(str(comments_only), {})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (lambda: dict(client_tls=TlsFiles(certfile="c.pem")), "--ssl-certfile and --ssl-keyfile go together"),
        (lambda: dict(client_tls=TlsFiles(ca_certs="ca.pem")), "--ssl-ca-certs .* needs --ssl-certfile"),
        (
            lambda: dict(worker_tls=TlsFiles(keyfile="k.pem", flag_prefix="--worker-ssl-", is_server=False)),
            "--worker-ssl-certfile and --worker-ssl-keyfile go together",
        ),
        (lambda: dict(worker_server_name="w.test"), "--worker-ssl-server-name needs TLS"),
    ],
    ids=["cert-without-key", "ca-without-cert", "worker-key-without-cert", "server-name-without-tls"],
)
def test_bad_flag_combinations_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        SchedulerOptions(model_dir="", worker_addresses=("a:1",), **options())
    # A client may trust a CA without a certificate of its own (TLS, not mutual).
    assert TlsFiles(ca_certs="ca.pem", is_server=False).is_enabled


def test_an_unreadable_credential_file_is_one_line_naming_the_flag(tmp_path, pki):
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(security.CredentialError, match=f"--ssl-keyfile {missing}: cannot read"):
        security.server_credentials(TlsFiles(pki["server"].certfile, missing))
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "scheduler", "--worker", "127.0.0.1:1", "--api-key-file", missing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"specdec scheduler: error: --api-key-file {missing}: cannot read: No such file or directory"
    ]


@pytest.mark.parametrize("flag", ["--api-key-file", "--ssl-certfile"])
def test_serve_checks_credential_files_before_starting_workers(tmp_path, tiny_pair, pki, flag):
    missing = str(tmp_path / "missing.pem")
    extra = ["--ssl-keyfile", pki["server"].keyfile] if flag == "--ssl-certfile" else []
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec",
            "serve",
            "--port",
            "0",
            "--model",
            str(tiny_pair.target_path),
            flag,
            missing,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"specdec serve: error: {flag} {missing}: cannot read: No such file or directory"
    ]  # no worker started


# --- The CLI, end to end ----------------------------------------------------------------------------------


def test_specdec_generate_with_a_ca_and_a_key_against_serve_with_tls_and_keys(pki, tiny_pair, tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"# clients\n{KEY}\n")
    args = [
        "--log-level",
        "DEBUG",
        "serve",
        "--port",
        "0",
        "--model",
        str(tiny_pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--ssl-certfile",
        pki["server"].certfile,
        "--ssl-keyfile",
        pki["server"].keyfile,
        "--api-key-file",
        str(key_file),
    ]
    with running(args, env={security.API_KEY_ENV: OTHER_KEY}) as process:
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")

        def generate(*extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "specdec",
                    "generate",
                    "--raw",
                    "one two three",
                    "--max-tokens",
                    "4",
                    "--address",
                    address,
                    *extra,
                ],
                capture_output=True,
                text=True,
                timeout=120,
                env=_base_env() | (env or {}),
            )

        ok = generate("--ca-file", pki["ca"], "--api-key-file", str(key_file))
        assert ok.returncode == 0, ok.stderr
        assert "[FINISH_REASON_LENGTH] prompt" in ok.stderr and "completion 4" in ok.stderr
        from_env = generate("--ca-file", pki["ca"], env={security.API_KEY_ENV: OTHER_KEY})
        assert from_env.returncode == 0, from_env.stderr
        on_the_command_line = generate("--ca-file", pki["ca"], "--api-key", KEY, env={security.API_KEY_ENV: WRONG_KEY})
        assert on_the_command_line.returncode == 0, on_the_command_line.stderr  # the flag wins over the variable
        no_key = generate("--ca-file", pki["ca"])
        assert no_key.returncode == 1 and "UNAUTHENTICATED" in no_key.stderr
        wrong = generate("--ca-file", pki["ca"], env={security.API_KEY_ENV: WRONG_KEY})
        assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr and WRONG_KEY not in wrong.stderr
        no_ca = generate("--api-key-file", str(key_file))  # plaintext against the TLS port
        assert no_ca.returncode == 1 and "UNAVAILABLE" in no_ca.stderr
    output = "\n".join(process.lines)
    assert "API keys: 2 accepted" in output  # the DEBUG/INFO output was captured
    for secret in (KEY, OTHER_KEY, WRONG_KEY):
        assert secret not in output


def _base_env() -> dict:
    """The environment without a key of its own (the test's SPECDEC_API_KEY, if any, is dropped)."""
    return {k: v for k, v in os.environ.items() if k != security.API_KEY_ENV}


def test_specdec_worker_with_mutual_tls_admits_only_certified_clients(pki, tiny_pair):
    args = [
        "worker",
        "--port",
        "0",
        "--model",
        str(tiny_pair.target_path),
        "--num-threads",
        "1",
        "--ssl-certfile",
        pki["server"].certfile,
        "--ssl-keyfile",
        pki["server"].keyfile,
        "--ssl-ca-certs",
        pki["ca"],
    ]
    with running(args) as process:
        address = process.address(who="worker ")
        process.wait_for("worker model loaded")
        rogue = WorkerClient(address, _client_credentials(pki))  # TLS, no certificate
        with pytest.raises(grpc.RpcError) as exc:
            rogue.describe(4, timeout=RPC_TIMEOUT_S)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        rogue.close()
        client = WorkerClient(address, security.channel_credentials(_worker_tls(pki)))
        assert client.describe(4, timeout=RPC_TIMEOUT_S).vocab_size > 0
        client.close()
