"""Scheduler capacity by simulation: how many workers one scheduler process keeps busy.

Simulated workers (tests/sim_worker.py: real Worker gRPC servers in a separate
process; no model: each step answers after --step-time-ms with 1..4 tokens per
sequence, k = 3 drafts, 0..3 accepted) are driven by the scheduler's cluster
in this process, with a real tokenizer (SmolLM2's) detokenising every token.
Each worker is kept at --seqs-per-worker live sequences (a finished request
is replaced at once) for --seconds. Reported per worker count: the scheduler
process's CPU time per step and per sequence-step (the thread that reads the
outputs, standing in for the gRPC client streams, is not counted), the
workers' idle share (1 - busy / active wall time), and steps per second.

    .venv/bin/python bench/bench_scheduler_capacity.py --workers 1,4,8,16 --seqs-per-worker 32 --step-time-ms 30
    .venv/bin/python bench/bench_scheduler_capacity.py --workers 16 --profile  # where the scheduler's time goes

Results are saved in bench/results/scheduler-capacity-*.json.
"""

import argparse
from collections import Counter
import itertools
import logging
import pathlib
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import save  # noqa: E402
from scheduler_service.cluster.cluster import Cluster  # noqa: E402
from scheduler_service.cluster.engine import WorkerState  # noqa: E402
from scheduler_service.cluster.membership import Membership, parse_worker_spec  # noqa: E402
from scheduler_service.cluster.options import SchedulerOptions  # noqa: E402
from scheduler_service.core.request import Request  # noqa: E402
from scheduler_service.frontends.tokenizer import ChatTokenizer  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402

logger = logging.getLogger("bench")
VOCAB = 50  # the simulated model's vocabulary


class ClosedLoop:
    """Keeps `num_live` requests in the cluster; one thread reads every output (its CPU time is measured)."""

    def __init__(self, cluster: Cluster, num_live: int, prompt_len: int, max_tokens: int):
        self.cluster, self.num_live = cluster, num_live
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.ids = itertools.count()
        self.rng = random.Random(0)
        self.handles = {}
        self.num_tokens = 0
        self.cpu_s = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _submit(self) -> None:
        request_id = f"q{next(self.ids)}"
        prompt = [self.rng.randrange(VOCAB) for _ in range(self.prompt_len)]
        self.handles[request_id] = self.cluster.submit(Request(request_id, prompt, max_tokens=self.max_tokens))

    def _run(self) -> None:
        while len(self.handles) < self.num_live:
            self._submit()
        while not self.stop.is_set():
            start = time.thread_time()
            for request_id, handle in list(self.handles.items()):
                while not handle.outputs.empty():
                    output = handle.get()
                    self.num_tokens += len(output.new_token_ids)
                    if output.finish_reason is not None:
                        del self.handles[request_id]
                        self._submit()
                        break
            self.cpu_s += time.thread_time() - start
            time.sleep(0.005)


class StackSampler:
    """A sampling profiler for every thread of this process (cProfile sees only the thread that starts it).

    Every `interval_s` it records the function on top of each busy thread's stack (self time) and every
    function on it (inclusive time). Threads blocked in a wait, a sleep or a gRPC read are not counted.
    """

    IDLE = ("wait", "sleep", "_next", "get", "select", "_wait_once", "_run")

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.self_counts: Counter = Counter()
        self.total_counts: Counter = Counter()
        self.num_samples = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval_s):
            self.num_samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me or frame.f_code.co_name in self.IDLE:
                    continue
                self.self_counts[self._name(frame)] += 1
                names = set()
                while frame is not None:
                    names.add(self._name(frame))
                    frame = frame.f_back
                self.total_counts.update(names)

    @staticmethod
    def _name(frame) -> str:
        path = pathlib.Path(frame.f_code.co_filename)
        return f"{path.parent.name}/{path.name}:{frame.f_code.co_name}"

    def report(self, top: int = 20) -> None:
        for title, counts in (("self", self.self_counts), ("inclusive", self.total_counts)):
            print(f"--- {title}: share of samples with a busy thread in the function ({self.num_samples} samples)")
            for name, count in counts.most_common(top):
                print(f"{100 * count / self.num_samples:6.1f}%  {name}")


def measure(addresses: list[str], args, tokenizer) -> dict:
    opts = SchedulerOptions(
        model_dir="",
        worker_addresses=tuple(addresses),
        block_size=16,
        max_num_seqs=args.seqs_per_worker,
        scheduling="async",
    )
    cluster = Cluster(opts, Membership([parse_worker_spec(a) for a in addresses]), tokenizer)
    cluster.start()
    cluster.wait_for_facts(30)
    deadline = time.monotonic() + 30
    while sum(w.state is WorkerState.SERVING for w in cluster.snapshot().workers) < len(addresses):
        assert time.monotonic() < deadline, "the simulated workers did not all join"
        time.sleep(0.05)
    loop = ClosedLoop(cluster, args.seqs_per_worker * len(addresses), args.prompt_len, args.max_tokens)
    loop.thread.start()
    time.sleep(args.warmup_seconds)
    profiler = StackSampler() if args.profile else None
    before, cpu0, loop_cpu0, wall0 = cluster.snapshot(), time.process_time(), loop.cpu_s, time.perf_counter()
    if profiler:
        profiler.thread.start()
    time.sleep(args.seconds)
    if profiler:
        profiler.stop.set()
    after, cpu1, loop_cpu1, wall1 = cluster.snapshot(), time.process_time(), loop.cpu_s, time.perf_counter()
    loop.stop.set()
    loop.thread.join()
    cluster.stop()
    scheduler_cpu_s = (cpu1 - cpu0) - (loop_cpu1 - loop_cpu0)
    num_steps = after.stats.num_steps - before.stats.num_steps
    num_seq_steps = after.stats.num_sequence_steps - before.stats.num_sequence_steps
    busy = after.busy.worker_busy_s - before.busy.worker_busy_s
    active = after.busy.active_wall_s - before.busy.active_wall_s
    row = {
        "workers": len(addresses),
        "seconds": wall1 - wall0,
        "steps": num_steps,
        "steps_per_s": num_steps / (wall1 - wall0),
        "ideal_steps_per_s": len(addresses) / (args.step_time_ms / 1e3),
        "tokens_per_s": (after.stats.num_emitted_tokens - before.stats.num_emitted_tokens) / (wall1 - wall0),
        "scheduler_cpu_share": scheduler_cpu_s / (wall1 - wall0),
        "cpu_ms_per_step": 1e3 * scheduler_cpu_s / max(num_steps, 1),
        "cpu_us_per_seq_step": 1e6 * scheduler_cpu_s / max(num_seq_steps, 1),
        "worker_idle_share": 1 - busy / active if active else 1.0,
    }
    if profiler:
        profiler.report()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,4,8,16", help="simulated worker counts")
    parser.add_argument("--seqs-per-worker", type=int, default=32)
    parser.add_argument("--step-time-ms", type=float, default=30.0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per worker count")
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample every thread's stack in the measured interval; print the busiest functions",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    tokenizer = ChatTokenizer(fetch_default_model())
    rows = []
    for num_workers in [int(n) for n in args.workers.split(",")]:
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.sim_worker",
                "--num-workers",
                str(num_workers),
                "--step-time-ms",
                str(args.step_time_ms),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=pathlib.Path(__file__).resolve().parent.parent,
        )
        addresses = sim.stdout.readline().split()[2:]
        try:
            row = measure(addresses, args, tokenizer)
        finally:
            sim.stdin.close()
            sim.wait(30)
        rows.append(row)
        logger.info(
            "%2d workers: %6.1f steps/s (ideal %5.1f), %6.0f tok/s, scheduler CPU %4.0f%% = %.2f ms/step "
            "= %.0f us/sequence-step, workers idle %4.1f%%",
            num_workers,
            row["steps_per_s"],
            row["ideal_steps_per_s"],
            row["tokens_per_s"],
            100 * row["scheduler_cpu_share"],
            row["cpu_ms_per_step"],
            row["cpu_us_per_seq_step"],
            100 * row["worker_idle_share"],
        )
    save("scheduler-capacity", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
