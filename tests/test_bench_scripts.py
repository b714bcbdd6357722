"""Every benchmark script still imports: a reshape that moves a module must move the scripts' imports with it
(three scripts once imported a module from where it had been)."""

import importlib
import os
import pathlib
import py_compile
import subprocess
import sys
import threading
import time

import pytest

from bench.common import process_tree_cpu_s, thread_counters, wait_quiet

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


def test_thread_counters_count_a_threads_cpu_and_its_wake_ups():
    """What bench_overhead.py and bench_transport.py read per thread (bench.common.thread_counters)."""
    ids, go, done, leave = [], threading.Event(), threading.Event(), threading.Event()

    def work():
        ids.append(str(threading.get_native_id()))
        go.wait()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of CPU
            pass
        for _ in range(20):  # 20 blocks and wake-ups
            time.sleep(0.001)
        done.set()
        leave.wait()  # alive, so that /proc still lists it

    thread = threading.Thread(target=work)
    thread.start()
    try:
        while not ids:
            time.sleep(0.01)
        before = thread_counters(os.getpid())[ids[0]]
        go.set()
        assert done.wait(30)
        after = thread_counters(os.getpid())[ids[0]]
    finally:
        go.set()
        leave.set()
        thread.join()
    cpu_s, voluntary = after[0] - before[0], after[1] - before[1]
    assert 0.2 <= cpu_s < 5, cpu_s
    assert voluntary >= 20, voluntary
