"""Every benchmark script still imports: a reshape that moves a module must move the scripts' imports with it
(three scripts once imported a module from where it had been)."""

import importlib
import pathlib
import py_compile
import subprocess
import sys
import time

import pytest

from bench.common import process_tree_cpu_s, wait_quiet

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


def test_wait_quiet_waits_until_a_busy_process_stops_using_the_cpu():
    """What keeps a benchmark from timing one server while another still computes (bench.common.wait_quiet)."""
    busy_s = 1.0
    code = f"import time\nend = time.monotonic() + {busy_s}\nwhile time.monotonic() < end: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)  # the interpreter has started and spins
        waited = wait_quiet([child.pid])
        used = process_tree_cpu_s(child.pid)
        time.sleep(0.3)
        assert waited > 0.3, "it returned while the process still spun"
        assert process_tree_cpu_s(child.pid) - used < 0.02, "the process still used the CPU after the wait"
        assert wait_quiet([child.pid]) < 0.5, "a quiet process is waited on for one window"
    finally:
        child.kill()
        child.wait()
