"""Two real worker processes behind one scheduler (tiny model; the scheduler in this process, tests/serving.py):
a worker killed mid-stream loses nothing, and the requests it held resume from the prefix the survivor has
cached.

The reference is the undisturbed output of one in-process worker (greedy and
seeded sampling at temperature 0.8): with randomness keyed by (seed,
position), a request's tokens do not depend on the batch, on preemption or on
moving to another worker.
"""

import signal
import threading
import time

import grpc
import pytest

from specdec import step
from specdec.v1 import generation_pb2 as pb
from tests.e2e.test_prefix_caching import SYSTEM  # a shared system prompt: 9 full blocks of 4
from tests.processes import Process
from tests.serving import scheduler_in_process
from tests.worker.driver import Driver
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.worker import Worker

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [40] * 12,
    [10, 11, 12, 10, 11],
    list(range(3, 23)),
    [100, 101, 102],
    [9, 8, 7, 9, 8, 7, 9],
    [200, 201],
    [33, 34, 35, 36, 33, 34],
]
SEEDS = [None, None, None, None, 11, 12, 13, 14]  # the first four greedy, the rest sampled at 0.8
MAX_TOKENS = 160
WORKER_ARGS = ["--num-threads", "1", "--proposer", "ngram", "--num-speculative-tokens", "3"]


def sampling(seed: int | None) -> pb.SamplingParams:
    if seed is None:
        return pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Each request alone on one in-process worker, no speculation."""
    config = WorkerConfig(model=str(tiny_pair.target_path))
    worker = Worker(config, ModelRunner(load_model(tiny_pair.target_path)))
    worker.init_cache(512, 4)
    outputs = []
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS)):
        params = step.RequestSampling(temperature=0.0 if seed is None else 0.8, seed=seed)
        outputs += Driver(worker.execute, 4, 512).generate([prompt], MAX_TOKENS, params, prefix=f"ref{i}-")
    return outputs


def start_worker(pair, port: int = 0, args: list[str] = WORKER_ARGS) -> Process:
    return start_workers(pair, 1, args, port)[0]


def start_workers(pair, count: int, args: list[str] = WORKER_ARGS, port: int = 0) -> list[Process]:
    """`count` worker processes, started together (their imports overlap on the cores) and then waited for."""
    processes = [
        Process(["worker", "--host", "127.0.0.1", "--port", str(port), "--model", str(pair.target_path), *args])
        for _ in range(count)
    ]
    try:
        for process in processes:
            process.wait_for("model loaded")
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return processes


def worker_status(stub, address: str) -> pb.WorkerStatus | None:
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    return next((w for w in info.workers if w.address == address), None)


def wait_until(predicate, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def connect(scheduler, addresses: list[str]):
    """The scheduler's stub, once both workers serve."""
    wait_until(
        lambda: all(worker_status(scheduler.stub, a).state == "serving" for a in addresses),
        what="both workers to serve",
    )
    return scheduler.stub


class Streams:
    """Streams every prompt (greedy or seeded, as SEEDS says) at once, each on a thread of its own."""

    def __init__(self, stub, prompts: list[list[int]], id_prefix: str):
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.finish: list = [None] * len(prompts)
        self.threads = [
            threading.Thread(target=self._consume, args=(stub, i, f"{id_prefix}{i}", prompt))
            for i, prompt in enumerate(prompts)
        ]
        for thread in self.threads:
            thread.start()

    def _consume(self, stub, i: int, request_id: str, prompt: list[int]) -> None:
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling(SEEDS[i]))
        try:
            for response in stub.Generate(request):
                self.tokens[i] += response.token_ids
                self.finish[i] = response.finish_reason
        except grpc.RpcError as exc:
            self.finish[i] = exc

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)


STEP_TIMEOUT_S = 3.0


# eagle3,suffix with trees allowed (--draft-tree-width 2): the policy picks a chain or a tree per sequence and step.
@pytest.mark.parametrize(
    "how, proposer",
    [("SIGKILL", "ngram"), ("SIGSTOP", "ngram"), ("SIGTERM", "ngram"), ("SIGKILL", "eagle3,suffix tree")],
)
def test_a_worker_fails_mid_stream_then_comes_back(tiny_pair, tiny_eagle3_head, reference, how, proposer):
    """Killed (its stream fails), stopped (no step result: the step timeout finds it) or terminated (it finishes
    its step in flight and leaves): its requests move and every stream completes exactly; then a worker
    restarted at the same address takes work again. With an EAGLE-3 head and suffix at once too, drafting
    chains or trees."""
    args = [*WORKER_ARGS[:2], "--proposer", proposer.split()[0], "--num-speculative-tokens", "3"]
    if proposer.endswith("tree"):
        args += ["--draft-tree-width", "2"]
    if "eagle3" in proposer:
        args += ["--draft-model", str(tiny_eagle3_head)]
    workers = start_workers(tiny_pair, 2, args)
    addresses = [w.address() for w in workers]
    try:
        # Least-loaded routing: the restarted worker must take work, which cache-aware routing would send to
        # the survivor, holding every prompt's prefix by then (tests/scheduler/cluster/test_routing.py).
        with scheduler_in_process(
            [
                "--model",
                str(tiny_pair.target_path),
                "--block-size",
                "4",
                "--worker-step-timeout",
                str(STEP_TIMEOUT_S),
                "--routing",
                "least-loaded",
                "--worker",
                addresses[0],
                "--worker",
                addresses[1],
            ]
        ) as scheduler:
            stub = connect(scheduler, addresses)
            streams = Streams(stub, PROMPTS, "r")
            wait_until(lambda: all(len(t) >= 4 for t in streams.tokens), what="every stream to begin")
            before = {a: worker_status(stub, a) for a in addresses}
            assert all(s.num_running > 0 for s in before.values()), before  # spread over both workers
            failed_at = time.monotonic()
            workers[0].proc.send_signal(getattr(signal, how))  # mid-stream
            wait_until(lambda: worker_status(stub, addresses[0]).state != "serving", what="the worker to leave")
            if how == "SIGSTOP":  # declared failed by the step timeout (health checks would take longer)
                assert time.monotonic() - failed_at < STEP_TIMEOUT_S + 2.0
                assert "no step result" in worker_status(stub, addresses[0]).last_error
            streams.join()

            assert streams.finish == [pb.FINISH_REASON_LENGTH] * len(PROMPTS), streams.finish
            for i, expected in enumerate(reference):
                assert streams.tokens[i] == expected, f"request {i} (seed {SEEDS[i]}) differs from the undisturbed run"
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.counters.num_moved_requests >= 1 and info.counters.num_worker_failures >= 1
            wait_until(
                lambda: (s := worker_status(stub, addresses[1])).num_free_kv_blocks == s.num_kv_blocks > 0,
                what="the survivor's KV blocks to be free",
            )
            assert worker_status(stub, addresses[0]).state != "serving"

            port = int(addresses[0].rsplit(":", 1)[1])
            workers[0].proc.kill()  # a stopped process too (SIGKILL works on it)
            assert workers[0].proc.wait(60) == (0 if how == "SIGTERM" else -9)  # SIGTERM: a clean exit
            workers[0] = start_worker(tiny_pair, port, args)  # a restarted pod: same address
            wait_until(lambda: worker_status(stub, addresses[0]).state == "serving", what="the worker to rejoin")
            placed_before = worker_status(stub, addresses[0]).counters.num_requests
            for i in range(4):
                request = pb.CompleteRequest(
                    prompt_token_ids=PROMPTS[i],
                    sampling=pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                )
                assert list(stub.Complete(request).token_ids) == reference[i][:8]
            assert worker_status(stub, addresses[0]).counters.num_requests > placed_before  # it takes work
    finally:
        for worker in workers:
            worker.stop()


SHARED_PROMPTS = [SYSTEM + p for p in PROMPTS]


@pytest.fixture(scope="module")
def shared_reference(tiny_pair):
    """The shared-prefix requests, each alone on an in-process worker (no cache, no speculation)."""
    worker = Worker(WorkerConfig(model=str(tiny_pair.target_path)), ModelRunner(load_model(tiny_pair.target_path)))
    worker.init_cache(512, 4)
    return [
        Driver(worker.execute, 4, 512).generate(
            [prompt],
            MAX_TOKENS,
            step.RequestSampling(temperature=0.0 if seed is None else 0.8, seed=seed),
            prefix=f"ref{i}-",
        )[0]
        for i, (prompt, seed) in enumerate(zip(SHARED_PROMPTS, SEEDS))
    ]


def test_requests_moved_after_a_kill_resume_from_the_survivor_s_cached_prefix(tiny_pair, shared_reference):
    """Both workers hold the shared prefix (the requests arrive together, before either has cached it, so they
    spread by headroom); one is killed mid-stream: its requests move, find the prefix in the survivor's cache,
    and finish exactly."""
    workers = start_workers(tiny_pair, 2)
    addresses = [w.address() for w in workers]
    try:
        with scheduler_in_process(
            [
                "--model",
                str(tiny_pair.target_path),
                "--block-size",
                "4",
                "--worker",
                addresses[0],
                "--worker",
                addresses[1],
            ]
        ) as scheduler:
            stub = connect(scheduler, addresses)
            streams = Streams(stub, SHARED_PROMPTS, "s")
            wait_until(lambda: all(len(t) >= 4 for t in streams.tokens), what="every stream to begin")
            before = {a: worker_status(stub, a) for a in addresses}
            assert all(s.num_running > 0 and s.num_cached_kv_blocks >= 9 for s in before.values()), before
            victim = max(addresses, key=lambda a: before[a].num_running)
            survivor = next(a for a in addresses if a != victim)
            workers[addresses.index(victim)].proc.send_signal(signal.SIGKILL)
            streams.join()
            assert streams.finish == [pb.FINISH_REASON_LENGTH] * len(SHARED_PROMPTS), streams.finish
            for i, expected in enumerate(shared_reference):
                assert streams.tokens[i] == expected, f"request {i} (seed {SEEDS[i]}) differs from the undisturbed run"
            after = worker_status(stub, survivor)
            num_moved = stub.GetServerInfo(pb.GetServerInfoRequest()).counters.num_moved_requests
            assert num_moved >= 1
            # Each moved request found at least the system prompt's 9 blocks on the survivor.
            hits = after.counters.prefix_cache_hits - before[survivor].counters.prefix_cache_hits
            assert hits >= 36 * num_moved
    finally:
        for worker in workers:
            worker.stop()
