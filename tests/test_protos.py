"""The gRPC contract: specdec/v1 matches protos/ (else rerun scripts/gen_protos.py); buf lint and buf breaking."""

import filecmp
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"stale generated code, run scripts/gen_protos.py: {stale}"


def test_services_have_the_contract_rpcs():
    from specdec.v1 import generation_pb2, worker_pb2

    generation = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert {m.name for m in generation.methods} >= {"Generate", "Complete", "Abort", "GetServerInfo"}
    assert generation.methods_by_name["Generate"].server_streaming
    worker = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
    execute = worker.methods_by_name["ExecuteModel"]
    assert execute.client_streaming and execute.server_streaming


BUF = pathlib.Path(sys.executable).parent / "buf"  # PyPI buf-bin, in the test extra


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True)


def test_buf_lint_standard_rules():
    result = subprocess.run([str(BUF), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"buf lint (buf.yaml: STANDARD rules):\n{result.stdout}{result.stderr}"


def test_buf_breaking_against_the_previous_commit(tmp_path):
    """No breaking change to the contract against HEAD~1's protos (buf's FILE rules).

    Only a commit whose message says `BREAKING CHANGE` (the conventional-commits footer) may break it: that
    commit's run reports this test as an expected failure; the commit after it compares with it again.
    """
    if _git("rev-parse", "--verify", "--quiet", "HEAD~1").returncode != 0:
        pytest.skip("no previous commit to compare with (a shallow clone?)")
    archive = _git("archive", "--format=tar", "HEAD~1", "protos")
    if archive.returncode != 0:
        pytest.skip("the previous commit has no protos/")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    # Its own buf.yaml, so that buf never takes a buf.yaml above the temporary folder for the module root.
    (tmp_path / "buf.yaml").write_text("version: v2\nmodules:\n  - path: protos\n")
    result = subprocess.run(
        [str(BUF), "breaking", "--against", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode != 0 and "BREAKING CHANGE" in _git("log", "-1", "--format=%B").stdout.decode():
        pytest.xfail(f"HEAD says BREAKING CHANGE:\n{result.stdout}")
    assert result.returncode == 0, f"buf breaking against HEAD~1:\n{result.stdout}{result.stderr}"
