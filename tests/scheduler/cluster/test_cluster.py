"""The cluster: routing over many workers, moving requests when one leaves, waiting for workers, discovery.

Workers are real gRPC servers on 127.0.0.1 serving the simulated worker of
tests/sim_worker.py (its "model" is deterministic, so every request's output
is known: reference_output). Stopping a server fails its step streams the way
a killed process does.
"""

import threading
import time

import grpc
import pytest

from scheduler_service.cluster import cluster as cluster_module
from scheduler_service.cluster import watchdog
from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.engine import WorkerState
from scheduler_service.cluster.handle import EngineError
from scheduler_service.cluster.membership import Membership, parse_worker_spec
from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.core.request import Request
from tests.sim_worker import PieceTokenizer, SimWorkerServer, reference_output

BLOCK_SIZE = 4


def partial_acceptance(step_id: int, request_id: str) -> int:
    return (step_id + len(request_id)) % 4


def make_cluster(
    specs: list[str], resolver=None, on_serving_changed=lambda is_serving: None, request_observer=None, **options
) -> Cluster:
    opts = SchedulerOptions(
        model_dir="", worker_addresses=tuple(specs), block_size=BLOCK_SIZE, worker_refresh_interval_s=0.1, **options
    )
    membership = Membership([parse_worker_spec(s) for s in specs], *([resolver] if resolver else []))
    cluster = Cluster(opts, membership, PieceTokenizer(), on_serving_changed, request_observer)
    cluster.start()
    return cluster


def wait_until(predicate, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_idle(cluster: Cluster):
    """Waits until no request runs and every serving worker's KV blocks are free (a step in flight may
    still hold a finished request's blocks); returns the snapshot."""

    def is_idle() -> bool:
        snap = cluster.snapshot()
        return (
            all(w.num_running == w.num_waiting == 0 and w.num_free_blocks == w.num_total_blocks for w in snap.workers)
            and snap.num_waiting_for_worker == 0
        )

    wait_until(is_idle, what="the workers to be idle with every block free")
    return cluster.snapshot()


def serving(cluster: Cluster) -> list[str]:
    return [w.address for w in cluster.snapshot().workers if w.state is WorkerState.SERVING]


class Streams:
    """Submits requests and reads every handle on its own thread, as the gRPC servicer does."""

    def __init__(self, cluster: Cluster, prompts: dict[str, list[int]], max_tokens: int):
        self.prompts, self.max_tokens = prompts, max_tokens
        self.tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        self.finish: dict[str, str | Exception] = {}
        self.handles = {rid: cluster.submit(Request(rid, list(p), max_tokens=max_tokens)) for rid, p in prompts.items()}
        self.threads = [threading.Thread(target=self._read, args=(rid,)) for rid in prompts]
        for thread in self.threads:
            thread.start()

    def _read(self, request_id: str) -> None:
        handle = self.handles[request_id]
        while True:
            try:
                output = handle.get(timeout=60)
            except EngineError as exc:
                self.finish[request_id] = exc
                return
            self.tokens[request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finish[request_id] = output.finish_reason
                return

    def join(self) -> None:
        for thread in self.threads:
            thread.join(60)

    def assert_complete_and_exact(self) -> None:
        """Every request finished by length with the reference output: each token exactly once."""
        assert self.finish == {rid: "length" for rid in self.prompts}
        for rid, prompt in self.prompts.items():
            assert self.tokens[rid] == reference_output(prompt, self.max_tokens), rid


def prompts(n: int) -> dict[str, list[int]]:
    return {f"r{i}": [(i * 11 + j * 3) % 50 for j in range(4 + i % 3)] for i in range(n)}


@pytest.fixture
def fast_health(monkeypatch):
    monkeypatch.setattr(watchdog, "HEALTH_INTERVAL_S", 0.1)
    monkeypatch.setattr(watchdog, "HEALTH_TIMEOUT_S", 1.0)


# The workers' step streams over gRPC, or over their step sockets (what `specdec serve`'s workers offer).
TRANSPORTS = pytest.mark.parametrize("step_socket", [False, True], ids=["grpc", "step-socket"])


def assert_transport(workers: list[SimWorkerServer], step_socket: bool) -> None:
    """The steps went where the test meant: each worker's step socket served streams only when it had one."""
    for worker in workers:
        assert (worker.step_server is not None and worker.step_server.num_streams > 0) == step_socket


@TRANSPORTS
def test_requests_spread_over_workers_by_headroom(step_socket):
    workers = [
        SimWorkerServer(step_time_s=0.002, num_accepted=partial_acceptance, step_socket=step_socket) for _ in range(2)
    ]
    cluster = make_cluster([w.address for w in workers])
    try:
        wait_until(lambda: len(serving(cluster)) == 2, what="both workers to serve")
        streams = Streams(cluster, prompts(8), max_tokens=20)
        streams.join()
        streams.assert_complete_and_exact()
        snap = wait_idle(cluster)
        placed = [w.stats.num_requests for w in snap.workers]
        assert sum(placed) == 8 and min(placed) >= 2  # by headroom: both take a share
        assert snap.num_requests == 8 and snap.stats.num_requests == 8 and snap.num_moved_requests == 0
        assert_transport(workers, step_socket)
    finally:
        cluster.stop()
        for w in workers:
            w.stop()


def test_step_transport_grpc_leaves_the_step_socket_alone():
    workers = [SimWorkerServer(step_time_s=0.002, step_socket=True)]
    cluster = make_cluster([workers[0].address], step_transport="grpc")
    try:
        wait_until(lambda: serving(cluster), what="the worker to serve")
        streams = Streams(cluster, prompts(2), max_tokens=10)
        streams.join()
        streams.assert_complete_and_exact()
        assert_transport(workers, False)
    finally:
        cluster.stop()
        workers[0].stop()


@TRANSPORTS
def test_a_failed_worker_s_requests_move_and_it_rejoins_at_the_same_address(step_socket):
    workers = [
        SimWorkerServer(step_time_s=0.01, num_accepted=partial_acceptance, step_socket=step_socket) for _ in range(2)
    ]
    cluster = make_cluster([w.address for w in workers], scheduling="async")
    try:
        wait_until(lambda: len(serving(cluster)) == 2, what="both workers to serve")
        streams = Streams(cluster, prompts(8), max_tokens=60)
        wait_until(lambda: all(len(t) >= 5 for t in streams.tokens.values()), what="every stream to begin")
        workers[0].stop()  # mid-stream: its step stream fails
        streams.join()
        streams.assert_complete_and_exact()
        snap = wait_idle(cluster)  # the survivor's free-block count is back at its total
        assert snap.num_moved_requests >= 4 and snap.num_worker_failures == 1
        survivor = next(w for w in snap.workers if w.address == workers[1].address)
        assert survivor.state is WorkerState.SERVING and survivor.num_total_blocks > 0

        # A restarted pod, same address (a step socket on another port: the scheduler asks Describe again).
        comeback = SimWorkerServer(step_time_s=0.01, port=workers[0].port, step_socket=step_socket)
        wait_until(lambda: len(serving(cluster)) == 2, what="the restarted worker to rejoin")
        again = Streams(cluster, {f"new{i}": [i + 1, i + 2] for i in range(4)}, max_tokens=10)
        again.join()
        again.assert_complete_and_exact()
        assert comeback.servicer.num_steps > 0  # it takes work again
        assert_transport([*workers, comeback], step_socket)
        comeback.stop()
    finally:
        cluster.stop()
        for w in workers:
            w.stop()


def cluster_with_its_worker_down(worker_wait_timeout_s: float, on_serving_changed=lambda is_serving: None):
    """A cluster whose only worker served once and is gone; returns it and the worker's port."""
    worker = SimWorkerServer()
    cluster = make_cluster(
        [worker.address], worker_wait_timeout_s=worker_wait_timeout_s, on_serving_changed=on_serving_changed
    )
    wait_until(lambda: serving(cluster) == [worker.address], what="the worker to serve")
    worker.stop()
    wait_until(lambda: not serving(cluster), what="the worker to leave")
    return cluster, worker.port


def test_with_every_worker_down_a_request_waits_and_runs_once_one_starts():
    health = []  # the scheduler's health: SERVING while at least one worker serves
    cluster, port = cluster_with_its_worker_down(worker_wait_timeout_s=30.0, on_serving_changed=health.append)
    try:
        assert health == [True, False]
        waiting = Streams(cluster, {"w": [4, 5, 6]}, max_tokens=5)
        assert cluster.snapshot().num_waiting_for_worker == 1
        time.sleep(0.3)
        assert waiting.tokens["w"] == []
        back = SimWorkerServer(port=port)
        waiting.join()
        waiting.assert_complete_and_exact()
        wait_idle(cluster)
        assert health == [True, False, True]
        back.stop()
    finally:
        cluster.stop()


def test_with_no_worker_coming_back_a_request_gets_unavailable_after_the_wait_timeout():
    cluster, _ = cluster_with_its_worker_down(worker_wait_timeout_s=0.5)
    try:
        start = time.monotonic()
        late = Streams(cluster, {"late": [1, 2, 3]}, max_tokens=5)
        late.join()
        assert 0.4 < time.monotonic() - start < 5
        assert isinstance(late.finish["late"], EngineError)
        assert late.finish["late"].code is grpc.StatusCode.UNAVAILABLE
        assert "no worker is available" in str(late.finish["late"])
        snap = cluster.snapshot()
        assert snap.num_waiting_for_worker == 0 and snap.workers[0].num_running == 0
    finally:
        cluster.stop()


def test_a_client_deadline_bounds_the_wait():
    worker = SimWorkerServer()
    cluster = make_cluster([worker.address], worker_wait_timeout_s=60.0)
    try:
        wait_until(lambda: serving(cluster), what="the worker to serve")
        worker.stop()
        wait_until(lambda: not serving(cluster), what="the worker to leave")
        start = time.monotonic()
        handle = cluster.submit(Request("d", [1, 2], max_tokens=3), client_deadline=start + 0.3)
        with pytest.raises(EngineError, match="no worker is available") as info:
            handle.get(timeout=10)
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and worker.address in str(info.value)
        assert time.monotonic() - start < 5
    finally:
        cluster.stop()


def test_discovery_adds_and_removes_workers_and_removed_workers_requests_move():
    workers = [SimWorkerServer(step_time_s=0.01, num_accepted=partial_acceptance) for _ in range(2)]
    answers = [[workers[0].address]]
    cluster = make_cluster(["dns:///workers.test:50052"], resolver=lambda name, port: answers[-1])
    try:
        wait_until(lambda: serving(cluster) == [workers[0].address], what="the first worker to serve")
        streams = Streams(cluster, prompts(4), max_tokens=300)
        wait_until(lambda: all(len(t) >= 3 for t in streams.tokens.values()), what="every stream to begin")
        answers.append([workers[0].address, workers[1].address])  # scaled up
        wait_until(lambda: len(serving(cluster)) == 2, what="the new worker to join")
        answers.append([workers[1].address])  # scaled down: the first one is gone
        wait_until(
            lambda: [w.address for w in cluster.snapshot().workers] == [workers[1].address],
            what="the first worker to leave",
        )
        assert not streams.finish  # it left mid-stream
        streams.join()
        streams.assert_complete_and_exact()
        snap = cluster.snapshot()
        assert snap.num_moved_requests == 4 and snap.num_worker_failures == 0  # a planned leave
        assert workers[1].servicer.num_steps > 0
    finally:
        cluster.stop()
        for w in workers:
            w.stop()


@TRANSPORTS
@pytest.mark.parametrize(("is_health_failing", "why"), [(True, "health checks failed"), (False, "no step result")])
def test_a_hung_worker_leaves(monkeypatch, fast_health, is_health_failing, why, step_socket):
    """Like SIGSTOP (no result, no error, health checks fail), or a wedged compute thread (health still
    SERVING, caught by the step timeout)."""
    workers = [SimWorkerServer(step_time_s=0.01, step_socket=step_socket) for _ in range(2)]
    cluster = make_cluster([w.address for w in workers], worker_step_timeout_s=120.0 if is_health_failing else 0.5)
    try:
        wait_until(lambda: len(serving(cluster)) == 2, what="both workers to serve")
        streams = Streams(cluster, prompts(6), max_tokens=40)
        wait_until(lambda: all(len(t) >= 3 for t in streams.tokens.values()), what="every stream to begin")
        workers[0].servicer.freeze(is_health_failing)
        streams.join()
        streams.assert_complete_and_exact()
        status = {w.address: w for w in cluster.snapshot().workers}[workers[0].address]
        assert why in status.last_error and status.num_failures == 1
        assert_transport(workers, step_socket)
    finally:
        cluster.stop()
        for w in workers:
            w.stop()


def test_a_request_whose_workers_keep_failing_stops_moving(monkeypatch):
    monkeypatch.setattr(cluster_module, "MAX_MOVES_PER_REQUEST", 1)
    workers = [SimWorkerServer(step_time_s=0.01)]
    cluster = make_cluster([workers[0].address])
    try:
        wait_until(lambda: serving(cluster), what="the worker to serve")
        streams = Streams(cluster, {"poison": [1, 2, 3]}, max_tokens=500)
        wait_until(lambda: len(streams.tokens["poison"]) >= 3, what="the stream to begin")
        port = workers[0].port
        workers[0].stop()  # first failure: it moves (waits for a worker)
        workers[0] = SimWorkerServer(step_time_s=0.01, port=port)
        wait_until(lambda: len(streams.tokens["poison"]) >= 20, what="the stream to resume")
        workers[0].stop()  # second failure: it has moved once already
        streams.join()
        assert isinstance(streams.finish["poison"], EngineError)
        assert streams.finish["poison"].code is grpc.StatusCode.INTERNAL
        assert "every worker that ran it failed" in str(streams.finish["poison"])
    finally:
        cluster.stop()
        for w in workers:
            w.stop()


@TRANSPORTS
def test_a_worker_that_left_alive_is_told_to_drop_the_old_requests_when_it_rejoins(fast_health, step_socket):
    worker = SimWorkerServer(step_time_s=0.01, step_socket=step_socket)
    cluster = make_cluster([worker.address])
    try:
        wait_until(lambda: serving(cluster) == [worker.address], what="the worker to serve")
        streams = Streams(cluster, prompts(3), max_tokens=200)
        wait_until(lambda: all(len(t) >= 3 for t in streams.tokens.values()), what="every stream to begin")
        worker.servicer.freeze()
        wait_until(lambda: not serving(cluster), what="the worker to leave")
        worker.servicer.thaw()  # it still holds the requests' old state; they come back to it as new requests
        streams.join()
        streams.assert_complete_and_exact()
        assert cluster.snapshot().num_worker_failures == 1  # a NewRequest for an id it held would fail again
        assert_transport([worker], step_socket)
    finally:
        cluster.stop()
        worker.stop()


def test_a_worker_serving_another_model_does_not_join_and_says_why():
    good, other = SimWorkerServer(), SimWorkerServer(model_id="another-model")
    other.servicer.freeze()  # answers only once the first worker has defined the model
    cluster = make_cluster([good.address, other.address])
    try:
        wait_until(lambda: serving(cluster) == [good.address], what="the first worker to serve")
        other.servicer.thaw()

        def other_status():
            return {w.address: w for w in cluster.snapshot().workers}[other.address]

        wait_until(lambda: "cannot join" in (other_status().last_error or ""), what="the join error")
        assert other_status().state is WorkerState.JOINING and "another-model" in other_status().last_error
    finally:
        cluster.stop()
        good.stop()
        other.stop()


def test_abort_while_waiting_for_a_worker_and_shutdown_fail_cleanly():
    worker = SimWorkerServer()
    cluster = make_cluster([worker.address])
    wait_until(lambda: serving(cluster), what="the worker to serve")
    worker.stop()
    wait_until(lambda: not serving(cluster), what="the worker to leave")
    handle = cluster.submit(Request("a", [1, 2], max_tokens=3))
    assert cluster.abort("a") and not cluster.abort("a")
    assert handle.get(timeout=5).finish_reason == "abort"
    other = cluster.submit(Request("b", [1, 2], max_tokens=3))
    cluster.stop()
    with pytest.raises(EngineError, match="shutting down"):
        other.get(timeout=5)
