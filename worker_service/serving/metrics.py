"""The worker's Prometheus metrics: how long each step and its phases take, from the StepStats of every step."""

from prometheus_client import CollectorRegistry, Counter, Histogram

from specdec.step import StepResult

# (name, kind, help), as the README's table lists them; every worker metric is defined here.
METRICS = (
    ("specdec_worker_step_seconds", "histogram", "Whole step on the worker (state update, propose, score, verify)."),
    (
        "specdec_worker_step_propose_seconds",
        "histogram",
        "Drafting (n-gram or suffix lookup, or the draft model) per step; about 0 for a plain step.",
    ),
    ("specdec_worker_step_score_seconds", "histogram", "The target model's forward per step."),
    ("specdec_worker_step_verify_seconds", "histogram", "Sampling and rejection sampling per step."),
    ("specdec_worker_steps_total", "counter", "Steps run."),
    ("specdec_worker_step_num_seqs", "histogram", "Sequences a step ran (prefill chunks included)."),
    ("specdec_worker_speculating_seqs_total", "counter", "Sequence-steps that verified at least one draft."),
)
_HELP = {name: help_text for name, _, help_text in METRICS}

# Seconds, from 0.1 ms (an n-gram lookup) to 30 s (a long prefill chunk on a slow CPU): a SmolLM2-135M
# decode step on two cores takes ~50 ms, a larger model's or a 2048-token prefill's seconds.
STEP_BUCKETS_S = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.035,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
NUM_SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class WorkerMetrics:
    """The worker's metrics in a registry of its own (not the process-wide default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._step, self._propose, self._score, self._verify = (
            Histogram(name, _HELP[name], buckets=STEP_BUCKETS_S, registry=self.registry)
            for name in (
                "specdec_worker_step_seconds",
                "specdec_worker_step_propose_seconds",
                "specdec_worker_step_score_seconds",
                "specdec_worker_step_verify_seconds",
            )
        )
        self._num_steps = Counter(
            "specdec_worker_steps_total", _HELP["specdec_worker_steps_total"], registry=self.registry
        )
        self._num_seqs = Histogram(
            "specdec_worker_step_num_seqs",
            _HELP["specdec_worker_step_num_seqs"],
            buckets=NUM_SEQS_BUCKETS,
            registry=self.registry,
        )
        self._num_speculating = Counter(
            "specdec_worker_speculating_seqs_total",
            _HELP["specdec_worker_speculating_seqs_total"],
            registry=self.registry,
        )

    def observe_step(self, result: StepResult) -> None:
        """Observes one step's timings (StepStats, in ms) and sizes."""
        stats = result.stats
        self._step.observe(stats.total_ms / 1e3)
        self._propose.observe(stats.propose_ms / 1e3)
        self._score.observe(stats.score_ms / 1e3)
        self._verify.observe(stats.verify_ms / 1e3)
        self._num_steps.inc()
        self._num_seqs.observe(len(result.outputs))
        self._num_speculating.inc(stats.num_speculating_seqs)
