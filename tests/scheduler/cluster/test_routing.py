"""Cache-aware routing over two simulated workers: a shared prefix goes where it is cached while load allows."""

from scheduler_service.cluster.engine import WorkerState
from tests.scheduler.cluster.test_cluster import Streams, make_cluster, serving, wait_idle, wait_until
from tests.sim_worker import SimWorkerServer

SYSTEM = [(5 * j + 2) % 50 for j in range(40)]  # 40 tokens: 10 full blocks of 4


def shared_prefix_prompts(n: int, start: int = 0) -> dict[str, list[int]]:
    return {f"q{i}": SYSTEM + [i % 50, (i * 3) % 50] for i in range(start, start + n)}


def two_worker_cluster(**options):
    workers = [SimWorkerServer(step_time_s=0.01) for _ in range(2)]
    cluster = make_cluster([w.address for w in workers], **options)
    wait_until(lambda: len(serving(cluster)) == 2, what="both workers to serve")
    return cluster, workers


def warm(cluster) -> str:
    """Runs one request with the shared prefix to its end; returns the worker that now caches it."""
    streams = Streams(cluster, {"warm": SYSTEM + [1]}, max_tokens=4)
    streams.join()
    assert streams.finish == {"warm": "length"}
    return streams.handles["warm"].engine.address


def placed(streams: Streams) -> list[str]:
    return [handle.engine.address for handle in streams.handles.values()]


def stop(cluster, workers) -> None:
    cluster.stop()
    for worker in workers:
        worker.stop()


def test_a_shared_prefix_goes_to_the_worker_holding_it_while_load_allows():
    cluster, workers = two_worker_cluster()
    try:
        holder = warm(cluster)
        streams = Streams(cluster, shared_prefix_prompts(4), max_tokens=30)  # loads 0..3 vs 0: within 4
        assert placed(streams) == [holder] * 4
        streams.join()
        streams.assert_complete_and_exact()
        snap = wait_idle(cluster)
        assert snap.stats.num_prefix_cache_hits == 4 * 40  # every block of the prefix, every request
    finally:
        stop(cluster, workers)


def test_least_loaded_routing_spreads_the_same_requests():
    cluster, workers = two_worker_cluster(routing="least-loaded")
    try:
        warm(cluster)
        streams = Streams(cluster, shared_prefix_prompts(4), max_tokens=30)
        assert sorted(placed(streams).count(w.address) for w in workers) == [2, 2]
        streams.join()
        streams.assert_complete_and_exact()
    finally:
        stop(cluster, workers)


def test_requests_spread_when_the_holder_is_much_busier_and_a_gone_worker_s_cache_is_forgotten():
    cluster, workers = two_worker_cluster(routing_max_imbalance=2)
    try:
        holder = warm(cluster)
        streams = Streams(cluster, shared_prefix_prompts(8), max_tokens=60)
        where = placed(streams)
        # The holder takes requests until it runs 3 more than the other; then the other gets one, and so on.
        assert where[:3] == [holder] * 3 and where[3] != holder
        assert 3 <= where.count(holder) <= 6
        streams.join()
        streams.assert_complete_and_exact()
        snap = wait_idle(cluster)
        assert all(w.num_cached_blocks >= 10 for w in snap.workers)  # both hold the prefix now
        other = next(w for w in workers if w.address != holder)
        other.stop()
        wait_until(lambda: serving(cluster) == [holder], what="the other worker to leave")
        gone = next(w for w in cluster.snapshot().workers if w.address == other.address)
        assert gone.state is not WorkerState.SERVING and gone.num_cached_blocks == 0
    finally:
        stop(cluster, workers)
