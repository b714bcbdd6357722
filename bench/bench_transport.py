"""What the scheduler-worker step stream costs per step, without a model: CPU and context switches each side.

    .venv/bin/python bench/bench_transport.py                  # ~1 min
    .venv/bin/python bench/bench_transport.py --step-ms 0 --steps 2000
    .venv/bin/python bench/bench_transport.py --transport socket   # the worker's step socket (--step-port)

Starts the worker's real gRPC server (`worker_service.serving.server.create_server`: the session gate, the
step-reader thread, the compute thread, the step metrics, the proto conversions) in a child process, with a
stand-in for the model whose step sleeps --step-ms and emits one token. This process drives it through the
scheduler's real client (`WorkerClient.open_stream`: `StepStream.send` / `recv`) as the engine loop does under
async scheduling: two decode steps of one sequence in flight. So what is measured is the transport alone:
gRPC both ways, the threads that hand each step on, the conversions.

Reports per step: the CPU each process took (the scheduler's side is this process: its main thread and
gRPC's threads), their context switches (voluntary: a thread blocked; involuntary: a thread was preempted),
and the wall time per step beside --step-ms. On a two-core machine serving a model, the model's OpenMP team
wants both cores; every CPU-millisecond and every wake-up here is taken from it (docs/benchmarks.md, "What
serving adds at batch 1"). Prints the CPU's model name; saves JSON under bench/results/.

`--transport socket` drives the same server's step socket (worker_service/serving/step_socket.py, what a
worker started with --step-port serves and `specdec serve`'s scheduler uses): the same messages, framed on
one TCP socket, through the same session gate and compute thread. What gRPC's machinery costs is the
difference.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.bench_linear import cpu_name  # noqa: E402
from bench.common import save, thread_counters  # noqa: E402
from specdec import step  # noqa: E402

REQUEST_ID = "r0"
BLOCK_SIZE = 16


class SleepingWorker:
    """What the Worker servicer needs of a worker, with a step that sleeps `step_ms` and emits one token."""

    def __init__(self, step_ms: float):
        self.step_s = step_ms / 1e3
        self.config = types.SimpleNamespace(kv_cache_memory_bytes=1 << 30)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 1 << 16

    def drop_requests(self) -> None:
        pass

    def init_cache(self, num_blocks: int, block_size: int) -> int:
        return num_blocks << 16

    def execute(self, request: step.StepRequest) -> step.StepResult:
        time.sleep(self.step_s)
        outputs = [step.SequenceOutput(r.request_id, [42], [-0.5]) for r in request.cached_requests]
        return step.StepResult(request.step_id, outputs, step.StepStats(total_ms=self.step_s * 1e3))


def serve(step_ms: float) -> None:
    """The child: a Worker server and its step socket on free ports (printed), until stdin closes."""
    from worker_service.serving.server import create_server
    from worker_service.serving.step_socket import serve_steps

    server, servicer, port = create_server("127.0.0.1", 0)
    step_server = serve_steps(servicer, "127.0.0.1", 0)
    servicer.set_worker(SleepingWorker(step_ms), "stand-in")
    print(port, step_server.port, flush=True)
    sys.stdin.read()
    step_server.stop()
    server.stop(0)


def totals(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, voluntary, involuntary context switches) so far, summed over the threads of `pid`."""
    counters = thread_counters(pid).values()
    return tuple(sum(c[i] for c in counters) for i in range(3))


def decode_step(step_id: int) -> step.StepRequest:
    return step.StepRequest(step_id, cached_requests=[step.CachedRequest(REQUEST_ID, [], 1, 1)])


def timed_round(stream, first_step_id: int, num_steps: int, server_pid: int) -> dict:
    """num_steps steps, two in flight; the per-step costs of both processes."""
    before = {pid: totals(pid) for pid in (os.getpid(), server_pid)}
    start = time.perf_counter()
    stream.send(decode_step(first_step_id))
    for i in range(1, num_steps):
        stream.send(decode_step(first_step_id + i))
        stream.recv()
    stream.recv()
    wall = time.perf_counter() - start
    out = {"wall_ms_per_step": wall / num_steps * 1e3}
    for side, pid in (("scheduler", os.getpid()), ("worker", server_pid)):
        now = totals(pid)
        out[side] = {
            "cpu_ms_per_step": (now[0] - before[pid][0]) / num_steps * 1e3,
            "voluntary_switches_per_step": (now[1] - before[pid][1]) / num_steps,
            "involuntary_switches_per_step": (now[2] - before[pid][2]) / num_steps,
        }
    return out


def main(args) -> None:
    from scheduler_service.cluster.worker_client import WorkerClient

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--step-ms", str(args.step_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port, step_port = map(int, child.stdout.readline().split())
        client = WorkerClient(f"127.0.0.1:{port}")
        session_id = client.init_cache(64, BLOCK_SIZE, timeout=30)
        stream = client.open_stream(session_id, step_port if args.transport == "socket" else 0)
        timed_round(stream, 0, 50, child.pid)  # warm-up
        rounds = []
        for i in range(args.rounds):
            rounds.append(timed_round(stream, 50 + i * args.steps, args.steps, child.pid))
            r = rounds[-1]
            print(
                f"round {i + 1}: {r['wall_ms_per_step']:.2f} ms/step (steps sleep {args.step_ms} ms); per step: "
                + "; ".join(
                    f"{side} CPU {r[side]['cpu_ms_per_step']:.2f} ms, {r[side]['voluntary_switches_per_step']:.1f}"
                    f" + {r[side]['involuntary_switches_per_step']:.1f} switches"
                    for side in ("scheduler", "worker")
                ),
                flush=True,
            )
        stream.close()
        client.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    summary = {"wall_ms_per_step": statistics.median(r["wall_ms_per_step"] for r in rounds)}
    for side in ("scheduler", "worker"):
        summary[side] = {key: statistics.median(r[side][key] for r in rounds) for key in rounds[0][side]}
    print(
        f"\n{cpu_name()}; {args.transport}; {args.steps} steps a round, two in flight, steps sleeping {args.step_ms} "
        f"ms; medians of "
        f"{args.rounds} rounds, per step:\n"
        + "\n".join(
            f"  {side}: {s['cpu_ms_per_step']:.2f} CPU-ms, {s['voluntary_switches_per_step']:.1f} voluntary + "
            f"{s['involuntary_switches_per_step']:.1f} involuntary context switches"
            for side, s in ((side, summary[side]) for side in ("scheduler", "worker"))
        )
        + f"\n  wall {summary['wall_ms_per_step']:.2f} ms per step"
    )
    save("transport", {"args": vars(args), "cpu": cpu_name(), "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=10.0, help="each step's sleep on the worker (the model)")
    parser.add_argument("--steps", type=int, default=500, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--transport",
        choices=("grpc", "socket"),
        default="grpc",
        help="grpc: the worker's ExecuteModel stream; socket: its step socket (specdec/step_wire.py)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    parsed = parser.parse_args()
    if parsed.serve:
        serve(parsed.step_ms)
    else:
        main(parsed)
