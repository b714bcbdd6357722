"""Every benchmark script still imports: a reshape that moves a module must move the scripts' imports with it
(three scripts once imported a module from where it had been)."""

import importlib
import pathlib
import py_compile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Run with another environment's python (bench_peers.py makes it), so only compiled here.
OTHER_ENVIRONMENTS = {"peer_openvino.py"}
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_script_imports(script):
    if script in OTHER_ENVIRONMENTS:
        py_compile.compile(str(ROOT / "bench" / script), doraise=True)
        return
    module = importlib.import_module(f"bench.{script.removesuffix('.py')}")
    assert module.__doc__, f"bench/{script} says what it measures and how to run it"
