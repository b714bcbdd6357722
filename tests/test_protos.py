"""The committed generated code in specdec/v1 matches protos/ (rerun scripts/gen_protos.py if not)."""

import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"stale generated code, run scripts/gen_protos.py: {stale}"


def test_services_have_the_contract_rpcs():
    from specdec.v1 import generation_pb2, worker_pb2

    generation = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in generation.methods} >= {"Generate", "Complete", "Abort", "GetServerInfo"}
    assert generation.methods_by_name["Generate"].server_streaming
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    execute = worker.methods_by_name["ExecuteModel"]
    assert execute.client_streaming and execute.server_streaming
