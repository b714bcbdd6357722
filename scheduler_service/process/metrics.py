"""The scheduler's Prometheus metrics: one table of every name, the scrape-time collector, request latencies.

Names mirror vLLM's (`vllm:` -> `specdec_`: no colon, which Prometheus keeps for recording rules) and
say their unit. Two kinds of source:

- counters and gauges the cluster already keeps (SchedulerStats, ClusterSnapshot,
  WorkerSnapshot) are read at scrape time by `ClusterCollector`, from one
  `cluster.snapshot()`, so nothing is counted twice;
- request latencies and finish reasons are observed by `RequestMetrics` where the
  cluster hands outputs to request streams (`Cluster.dispatch`, `abort`, `_fail`).

Load gauges come twice, under different names, so that a `sum()` never counts
a request twice: `specdec_num_requests_running` (and `_waiting`,
`kv_cache_usage_perc`) are the scheduler's totals, without labels, as the
Gateway API Inference Extension's model-server protocol reads them;
`specdec_worker_num_requests_running{worker="HOST:PORT"}` (and so on) are the
same per worker. Counters are totals over every worker the scheduler has had,
gone ones included, so they never go backwards when a worker leaves.
"""

from dataclasses import dataclass
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_service.cluster.cluster import ClusterSnapshot
from scheduler_service.cluster.engine import WorkerState
from scheduler_service.cluster.handle import RequestHandle, RequestObserver
from scheduler_service.core.request import RequestOutput

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class MetricInfo:
    """One exported metric, as the README's table lists it."""

    name: str  # as scraped; counters end in `_total`
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    help: str


def _info(name: str, kind: str, help_text: str, *labels: str) -> MetricInfo:
    return MetricInfo(f"specdec_{name}", kind, labels, help_text)


METRICS = (
    _info("num_requests_running", "gauge", "Requests running on any worker."),
    _info("num_requests_waiting", "gauge", "Requests queued on a worker or waiting for a worker to serve."),
    _info("kv_cache_usage_perc", "gauge", "Fraction (0..1) of the serving workers' KV blocks in use."),
    _info("worker_num_requests_running", "gauge", "Requests running on the worker.", "worker"),
    _info("worker_num_requests_waiting", "gauge", "Requests queued on the worker.", "worker"),
    _info("worker_kv_cache_usage_perc", "gauge", "Fraction (0..1) of the worker's KV blocks in use.", "worker"),
    _info("worker_serving", "gauge", "1 while the worker serves, 0 while it joins or after it left.", "worker"),
    _info("prompt_tokens_total", "counter", "Prompt tokens of requests that emitted their first token."),
    _info("generation_tokens_total", "counter", "Output tokens delivered to clients."),
    _info(
        "request_success_total",
        "counter",
        "Finished requests by finish reason: stop, length, abort (cancelled, or failed: no worker, moved too often).",
        "finished_reason",
    ),
    _info("time_to_first_token_seconds", "histogram", "From arrival to the first output token."),
    _info(
        "inter_token_latency_seconds",
        "histogram",
        "Between output tokens: each later output's gap divided over the tokens it carries, once per token.",
    ),
    _info("e2e_request_latency_seconds", "histogram", "From arrival to the last output (any finish reason)."),
    _info("spec_decode_num_drafts_total", "counter", "Sequence-steps with at least one draft token."),
    _info("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed."),
    _info("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    _info(
        "spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Sequence-steps that accepted the draft at this position (0..K-1); a step that accepted n drafts counts "
        "at 0..n-1, so the positions sum to the accepted total.",
        "position",
    ),
    _info(
        "spec_decode_num_draft_tokens_by_proposer_total",
        "counter",
        "Draft tokens proposed, by the proposer that drafted them (each step scores one proposer's drafts per "
        "sequence).",
        "proposer",
    ),
    _info(
        "spec_decode_num_accepted_tokens_per_pos_by_proposer_total",
        "counter",
        "spec_decode_num_accepted_tokens_per_pos_total split by the proposer that drafted.",
        "proposer",
        "position",
    ),
    _info(
        "spec_decode_num_sequence_steps_by_k_total",
        "counter",
        "Decoding sequence-steps by the draft length k (0..K) the speculation policy chose.",
        "k",
    ),
    _info(
        "spec_decode_num_tree_steps_by_depth_total",
        "counter",
        "Sequence-steps whose drafts formed a tree (--draft-tree-width), by its depth.",
        "depth",
    ),
    _info(
        "spec_decode_num_tree_steps_by_nodes_total",
        "counter",
        "Sequence-steps whose drafts formed a tree, by its number of nodes.",
        "nodes",
    ),
    _info(
        "spec_decode_predicted_step_seconds_total",
        "counter",
        "The policy's step-cost model: predicted worker step time, summed over the steps it predicted.",
    ),
    _info(
        "spec_decode_measured_step_seconds_total",
        "counter",
        "Measured worker step time of the steps the cost model predicted (compare with the predicted total).",
    ),
    _info("num_steps_speculation_disabled_total", "counter", "Steps run without drafts because of the queue size."),
    _info("num_preemptions_total", "counter", "Requests preempted (recomputed later) for lack of KV blocks."),
    _info(
        "prefix_cache_queries_total",
        "counter",
        "Tokens of requests leaving a waiting queue (new, preempted or moved), looked up in the prefix cache.",
    ),
    _info("prefix_cache_hits_total", "counter", "Of those, tokens whose KV was found cached (not computed)."),
    _info("prefix_cache_evictions_total", "counter", "Cached KV blocks whose KV was dropped to hold other tokens."),
    _info("prefix_cache_blocks", "gauge", "KV blocks in the serving workers' prefix caches (in use or free)."),
    _info("worker_failures_total", "counter", "Times a worker left by failing (crash, hang, broken stream)."),
    _info("moved_requests_total", "counter", "Requests moved to another worker after theirs left."),
    _info(
        "engine_errors_total",
        "counter",
        "Unexpected exceptions the worker engines and the cluster's maintenance caught.",
    ),
    _info(
        "structured_output_requests_total",
        "counter",
        "Requests admitted with a structured-output constraint (JSON schema, JSON object, regex, choice, grammar).",
    ),
    _info(
        "structured_output_cache_hits_total",
        "counter",
        "Of those, constraints found compiled in the scheduler's cache (a repeated schema).",
    ),
    _info(
        "structured_output_compile_seconds",
        "histogram",
        "Compiling a constraint that was not cached (beside the step loop; bounded by --structured-output-timeout).",
    ),
)
_BY_NAME = {m.name: m for m in METRICS}

# Seconds. A CPU decode step takes ~20-100 ms and a long prefill or a queue seconds; the top buckets catch
# requests that waited for a worker (--worker-wait-timeout, 60 s by default) or generated for minutes.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
COMPILE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def _event_counter(name: str) -> Counter:
    info = _BY_NAME[name]
    return Counter(info.name, info.help, info.labels, registry=None)


def _histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
    info = _BY_NAME[name]
    return Histogram(info.name, info.help, info.labels, buckets=buckets, registry=None)


class RequestMetrics(RequestObserver):
    """Request latencies and finish reasons, observed as the cluster hands outputs over (its lock held).

    Per-request timing lives on the RequestHandle (arrival_s, last_token_s), so a
    request that moves to another worker keeps its clock.
    """

    def __init__(self) -> None:
        self.ttft = _histogram("specdec_time_to_first_token_seconds", TTFT_BUCKETS_S)
        self.itl = _histogram("specdec_inter_token_latency_seconds", ITL_BUCKETS_S)
        self.e2e = _histogram("specdec_e2e_request_latency_seconds", E2E_BUCKETS_S)
        self.finished = _event_counter("specdec_request_success_total")
        for reason in FINISH_REASONS:
            self.finished.labels(reason)  # every reason is scraped from the start, at 0
        self.constrained = _event_counter("specdec_structured_output_requests_total")
        self.constraint_cache_hits = _event_counter("specdec_structured_output_cache_hits_total")
        self.compile = _histogram("specdec_structured_output_compile_seconds", COMPILE_BUCKETS_S)

    def collectors(self) -> tuple[Collector, ...]:
        return self.ttft, self.itl, self.e2e, self.finished, self.constrained, self.constraint_cache_hits, self.compile

    def on_constraint_compiled(self, seconds: float | None) -> None:
        """A constrained request was admitted: its compile took `seconds`, or None (found in the cache)."""
        self.constrained.inc()
        if seconds is None:
            self.constraint_cache_hits.inc()
        else:
            self.compile.observe(seconds)

    def on_output(self, handle: RequestHandle, output: RequestOutput, now: float | None = None) -> None:
        """Observes one output handed to the request's stream.

        Inter-token latency: an output that carries n tokens (a step that accepted
        n - 1 drafts) is observed n times with its gap / n, so the histogram's
        sum / count is the mean time per output token. vLLM observes the gap once
        per output, which under speculation reads as a slower stream than the client sees.
        """
        now = time.monotonic() if now is None else now
        num_tokens = len(output.new_token_ids)
        if num_tokens:
            if handle.last_token_s is None:
                self.ttft.observe(now - handle.arrival_s)
            else:
                per_token_s = (now - handle.last_token_s) / num_tokens
                for _ in range(num_tokens):
                    self.itl.observe(per_token_s)
            handle.last_token_s = now
        if output.finish_reason is not None:
            self._finish(handle, output.finish_reason, now)

    def on_failed(self, handle: RequestHandle, now: float | None = None) -> None:
        """A request ended with an error (no worker, moved too often, shutdown): counted as an abort."""
        self._finish(handle, "abort", time.monotonic() if now is None else now)

    def _finish(self, handle: RequestHandle, reason: str, now: float) -> None:
        self.e2e.observe(now - handle.arrival_s)
        self.finished.labels(reason).inc()


class ClusterCollector(Collector):
    """Reads the cluster's gauges and counters at scrape time from one snapshot."""

    def __init__(self, snapshot: Callable[[], ClusterSnapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _load_gauges(snap)
        yield from _counters(snap)


def _gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    info = _BY_NAME[name]
    return GaugeMetricFamily(info.name, info.help, value=value, labels=info.labels or None)


def _counter(name: str, value: float | None = None) -> CounterMetricFamily:
    info = _BY_NAME[name]
    return CounterMetricFamily(info.name, info.help, value=value, labels=info.labels or None)


def _load_gauges(snap: ClusterSnapshot) -> Iterator[Metric]:
    running, waiting, usage, serving = (
        _gauge(f"specdec_worker_{name}")
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "serving")
    )
    for w in snap.workers:
        running.add_metric([w.address], w.num_running)
        waiting.add_metric([w.address], w.num_waiting)
        usage.add_metric([w.address], _usage(w.num_total_blocks - w.num_free_blocks, w.num_total_blocks))
        serving.add_metric([w.address], float(w.state is WorkerState.SERVING))
    num_used_blocks = sum(w.num_total_blocks - w.num_free_blocks for w in snap.workers)
    num_total_blocks = sum(w.num_total_blocks for w in snap.workers)
    yield _gauge("specdec_num_requests_running", sum(w.num_running for w in snap.workers))
    yield _gauge("specdec_num_requests_waiting", sum(w.num_waiting for w in snap.workers) + snap.num_waiting_for_worker)
    yield _gauge("specdec_kv_cache_usage_perc", _usage(num_used_blocks, num_total_blocks))
    yield _gauge("specdec_prefix_cache_blocks", sum(w.num_cached_blocks for w in snap.workers))
    yield from (running, waiting, usage, serving)


def _usage(num_used_blocks: int, num_total_blocks: int) -> float:
    return num_used_blocks / num_total_blocks if num_total_blocks else 0.0


def _counters(snap: ClusterSnapshot) -> Iterator[Metric]:
    st = snap.stats
    for name, value in (
        ("prompt_tokens_total", st.num_prompt_tokens),
        ("generation_tokens_total", st.num_emitted_tokens),
        ("spec_decode_num_drafts_total", st.num_drafts),
        ("spec_decode_num_draft_tokens_total", st.num_draft_tokens),
        ("spec_decode_num_accepted_tokens_total", st.num_accepted_tokens),
        ("spec_decode_predicted_step_seconds_total", st.predicted_step_s),
        ("spec_decode_measured_step_seconds_total", st.measured_step_s),
        ("num_steps_speculation_disabled_total", st.num_steps_speculation_disabled),
        ("num_preemptions_total", st.num_preemptions),
        ("prefix_cache_queries_total", st.num_prefix_cache_queries),
        ("prefix_cache_hits_total", st.num_prefix_cache_hits),
        ("prefix_cache_evictions_total", st.num_prefix_cache_evictions),
        ("worker_failures_total", snap.num_worker_failures),
        ("moved_requests_total", snap.num_moved_requests),
        ("engine_errors_total", snap.num_engine_errors),
    ):
        yield _counter(f"specdec_{name}", value)
    per_pos = _counter("specdec_spec_decode_num_accepted_tokens_per_pos_total")
    k = max((w.config.num_speculative_tokens for w in snap.workers if w.config is not None), default=0)
    counts = st.num_accepted_tokens_per_pos
    for position in range(max(k, len(counts))):  # positions never accepted yet are scraped at 0
        per_pos.add_metric([str(position)], counts[position] if position < len(counts) else 0)
    yield per_pos
    drafted = _counter("specdec_spec_decode_num_draft_tokens_by_proposer_total")
    for proposer, count in sorted(st.num_draft_tokens_by_proposer.items()):
        drafted.add_metric([proposer], count)
    yield drafted
    per_pos = _counter("specdec_spec_decode_num_accepted_tokens_per_pos_by_proposer_total")
    for proposer, counts in sorted(st.num_accepted_tokens_per_pos_by_proposer.items()):
        for position in range(max(k, len(counts))):
            per_pos.add_metric([proposer, str(position)], counts[position] if position < len(counts) else 0)
    yield per_pos
    for name, label, counts in (
        ("num_sequence_steps_by_k", "k", st.num_sequence_steps_by_k),
        ("num_tree_steps_by_depth", "depth", st.num_tree_steps_by_depth),
        ("num_tree_steps_by_nodes", "nodes", st.num_tree_steps_by_nodes),
    ):
        histogram = _counter(f"specdec_spec_decode_{name}_total")
        for value, count in enumerate(counts):
            histogram.add_metric([str(value)], count)
        yield histogram


def cluster_registry(snapshot: Callable[[], ClusterSnapshot], request_metrics: RequestMetrics) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) with every scheduler metric: the cluster's
    snapshots (`Cluster.snapshot`) and the request metrics the cluster was given as its observer."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(snapshot))
    for collector in request_metrics.collectors():
        registry.register(collector)
    return registry
