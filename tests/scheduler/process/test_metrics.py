"""The scheduler's Prometheus metrics, scraped over HTTP from a cluster of simulated gRPC workers.

The simulated workers (tests/sim_worker.py) speculate with k = 3 and accept a
varying number of drafts, so every counter the run moves is known from what
the clients received.
"""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
import pytest

from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.core.request import Request
from scheduler_service.core.stats import SchedulerStats
from scheduler_service.process import flags as scheduler_flags
from scheduler_service.process.metrics import METRICS, RequestMetrics, cluster_registry
from specdec.cli import build_parser
from specdec.cli.serve import serve
from specdec.metrics_server import start_metrics_server
from tests.scheduler.cluster.test_cluster import (
    Streams,
    make_cluster,
    partial_acceptance,
    prompts,
    serving,
    wait_idle,
    wait_until,
)
from tests.sim_worker import SimWorkerServer, reference_output


class Scrape:
    """One scrape of /metrics, parsed: sample values by (sample name, labels)."""

    def __init__(self, port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            self.text = response.read().decode()
        self.families = list(text_string_to_metric_families(self.text))
        self.samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in self.families for s in f.samples}

    def value(self, name: str, **labels) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(key)[label]: v for (n, key), v in self.samples.items() if n == name and label in dict(key)}

    def exposed_names(self) -> set[str]:
        """Family names as the README lists them (counters with their `_total`)."""
        return {f.name + "_total" if f.type == "counter" else f.name for f in self.families}


@pytest.fixture
def metrics_cluster():
    """Two simulated workers (k = 3, partial acceptance), a cluster over them, and its metrics port."""
    workers = [SimWorkerServer(step_time_s=0.005, num_accepted=partial_acceptance) for _ in range(2)]
    request_metrics = RequestMetrics()
    cluster = make_cluster([w.address for w in workers], request_observer=request_metrics, worker_wait_timeout_s=0.5)
    server = start_metrics_server(cluster_registry(cluster.snapshot, request_metrics), "127.0.0.1", 0, "scheduler")
    try:
        wait_until(lambda: len(serving(cluster)) == 2, what="both workers to serve")
        yield cluster, workers, server.server_port
    finally:
        server.shutdown()
        cluster.stop()
        for worker in workers:
            worker.stop()


def read_all(handle, on_first=lambda: None) -> tuple[list[int], str]:
    tokens, first = [], True
    while True:
        output = handle.get(timeout=30)
        tokens += output.new_token_ids
        if first:
            on_first()
            first = False
        if output.finish_reason is not None:
            return tokens, output.finish_reason


def test_counters_and_histograms_follow_a_speculative_run(metrics_cluster):
    cluster, workers, port = metrics_cluster
    streams = Streams(cluster, prompts(6), max_tokens=20)  # finish by length
    stop_prompt = [7, 8, 9, 10]
    stop_token = reference_output(stop_prompt, 30)[12]
    stopped = cluster.submit(Request("stop", stop_prompt, max_tokens=30, stop_token_ids=[stop_token]))
    aborted = cluster.submit(Request("abort", [1, 2, 3, 4, 5], max_tokens=900))
    during: list[Scrape] = []
    abort_tokens, abort_reason = read_all(aborted, lambda: (during.append(Scrape(port)), cluster.abort("abort")))
    stop_tokens, stop_reason = read_all(stopped)
    streams.join()
    streams.assert_complete_and_exact()
    assert (stop_reason, abort_reason) == ("stop", "abort") and stop_tokens[-1] == stop_token
    snap = wait_idle(cluster)
    after = Scrape(port)

    # While the run went on, requests ran and held KV blocks; after it, nothing runs or holds a block.
    assert during[0].value("specdec_num_requests_running") >= 1
    assert during[0].value("specdec_kv_cache_usage_perc") > 0
    assert after.value("specdec_num_requests_running") == after.value("specdec_num_requests_waiting") == 0
    assert after.value("specdec_kv_cache_usage_perc") == 0.0
    addresses = {w.address for w in workers}
    assert set(after.by_label("specdec_worker_kv_cache_usage_perc", "worker")) == addresses
    assert after.by_label("specdec_worker_serving", "worker") == {a: 1.0 for a in addresses}

    # Tokens: what the clients received, and every prompt (each request emitted its first token).
    num_received = sum(map(len, streams.tokens.values())) + len(stop_tokens) + len(abort_tokens)
    assert after.value("specdec_generation_tokens_total") == num_received
    num_prompt_tokens = sum(map(len, streams.prompts.values())) + len(stop_prompt) + 5
    assert after.value("specdec_prompt_tokens_total") == num_prompt_tokens
    assert after.by_label("specdec_request_success_total", "finished_reason") == {"length": 6, "stop": 1, "abort": 1}

    # Speculation: both workers' counts summed; per-position counts add up to the accepted total.
    drafted = after.value("specdec_spec_decode_num_draft_tokens_total")
    accepted = after.value("specdec_spec_decode_num_accepted_tokens_total")
    num_drafts = after.value("specdec_spec_decode_num_drafts_total")
    assert drafted >= accepted > 0 and 0 < num_drafts <= drafted <= 3 * num_drafts
    assert (drafted, accepted) == (snap.stats.num_draft_tokens, snap.stats.num_accepted_tokens)
    per_pos = after.by_label("specdec_spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert set(per_pos) == {"0", "1", "2"} and sum(per_pos.values()) == accepted
    assert per_pos["0"] >= per_pos["1"] >= per_pos["2"] > 0  # accepted drafts are a prefix
    # The policy's chosen k: one count per decoding sequence-step, the same as GetServerInfo's histogram.
    by_k = after.by_label("specdec_spec_decode_num_sequence_steps_by_k_total", "k")
    assert by_k == {str(k): n for k, n in enumerate(snap.stats.num_sequence_steps_by_k)} and by_k.get("3", 0) > 0

    # Request latencies: one TTFT and one e2e per request; one ITL per token after each first token.
    num_requests = 8
    assert after.value("specdec_time_to_first_token_seconds_count") == num_requests
    assert after.value("specdec_e2e_request_latency_seconds_count") == num_requests
    assert after.value("specdec_inter_token_latency_seconds_count") == num_received - num_requests
    assert after.value("specdec_inter_token_latency_seconds_sum") > 0
    assert after.value("specdec_e2e_request_latency_seconds_bucket", le="+Inf") == num_requests

    # Every documented metric is scraped, and nothing undocumented.
    assert after.exposed_names() == {m.name for m in METRICS}


def test_worker_failure_moves_requests_and_counters_keep_counting(metrics_cluster):
    cluster, workers, port = metrics_cluster
    streams = Streams(cluster, prompts(6), max_tokens=120)
    wait_until(lambda: cluster.snapshot().stats.num_emitted_tokens > 60, what="tokens to flow")
    before = Scrape(port)
    workers[0].stop()
    streams.join()
    streams.assert_complete_and_exact()
    wait_idle(cluster)
    after = Scrape(port)
    assert after.value("specdec_worker_failures_total") == 1
    assert after.value("specdec_moved_requests_total") == cluster.snapshot().num_moved_requests > 0
    assert after.by_label("specdec_worker_serving", "worker")[workers[0].address] == 0.0
    # Every token once, moves included; the counters only went up.
    assert after.value("specdec_generation_tokens_total") == 6 * 120
    for name in ("specdec_generation_tokens_total", "specdec_spec_decode_num_accepted_tokens_total"):
        assert after.value(name) >= before.value(name)


def test_requests_waiting_for_a_worker_count_as_waiting_then_abort(metrics_cluster):
    cluster, workers, port = metrics_cluster
    for worker in workers:
        worker.stop()
    wait_until(lambda: not serving(cluster), what="no worker to serve")
    handle = cluster.submit(Request("waits", [1, 2, 3], max_tokens=5))
    waiting = Scrape(port)
    assert waiting.value("specdec_num_requests_waiting") == 1
    assert sum(waiting.by_label("specdec_worker_num_requests_waiting", "worker").values()) == 0
    with pytest.raises(Exception, match="no worker is available"):
        handle.get(timeout=10)  # fails after --worker-wait-timeout (0.5 s here)
    after = Scrape(port)
    assert after.value("specdec_num_requests_waiting") == 0
    assert after.value("specdec_request_success_total", finished_reason="abort") == 1
    assert after.value("specdec_e2e_request_latency_seconds_count") == 1
    assert after.value("specdec_time_to_first_token_seconds_count") == 0


def test_engine_errors_are_exported(metrics_cluster):
    cluster, workers, port = metrics_cluster
    assert Scrape(port).value("specdec_engine_errors_total") == 0
    with cluster.lock:
        engine = cluster._engines[workers[1].address]
        engine.num_engine_errors += 2  # as the engine's error handling counts them
    assert Scrape(port).value("specdec_engine_errors_total") == 2


def test_stats_total_sums_per_position_counts_of_different_k():
    a, b = SchedulerStats(), SchedulerStats()
    a.count_speculation(num_draft_tokens=3, num_accepted_tokens=2)
    a.count_speculation(num_draft_tokens=3, num_accepted_tokens=0)
    b.count_speculation(num_draft_tokens=5, num_accepted_tokens=4)
    b.count_speculation(num_draft_tokens=0, num_accepted_tokens=0)
    total = SchedulerStats.total([a, b])
    assert total.num_accepted_tokens_per_pos == (2, 2, 1, 1)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 11, 6)
    assert SchedulerStats.total([]).num_accepted_tokens_per_pos == ()


def test_metrics_port_in_use_is_an_error(metrics_cluster):
    cluster, _, port = metrics_cluster
    with pytest.raises(OSError):
        start_metrics_server(cluster_registry(cluster.snapshot, RequestMetrics()), "127.0.0.1", port, "scheduler")
    assert Scrape(port).value("specdec_num_requests_running") == 0


@pytest.mark.parametrize("port", [-1, 65536])
def test_metrics_port_out_of_range_is_rejected(port):
    with pytest.raises(ValueError, match="--metrics-port"):
        SchedulerOptions(model_dir="", worker_addresses=("127.0.0.1:1",), metrics_port=port)


def test_serve_forwards_a_metrics_port_per_worker_and_rejects_a_range_past_65535(capsys):
    args = build_parser().parse_args(
        ["serve", "--metrics-port", "9090", "--worker-metrics-port", "65535", "--num-workers", "2"]
    )
    assert scheduler_flags.options_from_args(args, "", ["127.0.0.1:1"]).metrics_port == 9090
    assert serve(args) == 2 and "--worker-metrics-port" in capsys.readouterr().err


def test_prefix_cache_metrics_count_tokens_hits_and_cached_blocks(metrics_cluster):
    cluster, _, port = metrics_cluster
    system = [(3 * j + 1) % 50 for j in range(24)]  # 6 full blocks of 4
    first = Streams(cluster, {"first": system + [1]}, max_tokens=5)
    first.join()
    then = Streams(cluster, {"then": system + [2, 3]}, max_tokens=5)
    then.join()
    then.assert_complete_and_exact()
    snap = wait_idle(cluster)
    scrape = Scrape(port)
    assert scrape.value("specdec_prefix_cache_queries_total") == 25 + 26 == snap.stats.num_prefix_cache_queries
    assert scrape.value("specdec_prefix_cache_hits_total") == 24 == snap.stats.num_prefix_cache_hits
    assert scrape.value("specdec_prefix_cache_blocks") == sum(w.num_cached_blocks for w in snap.workers) >= 6
    assert scrape.value("specdec_prefix_cache_evictions_total") == 0
