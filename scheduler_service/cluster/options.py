"""The scheduler's options (from flags) and the per-worker scheduler config built from a worker's facts."""

from dataclasses import dataclass, field, fields

from scheduler_service.core.config import ROUTING_POLICIES, SCHEDULING_MODES, SPECULATION_POLICIES, SchedulerConfig
from specdec.config_flags import setting
from specdec.metrics_server import check_metrics_port
from specdec.security import TlsFiles

MAX_DEFAULT_KV_BLOCKS = 4096
TOOL_CALL_PARSERS = ("hermes", "json")  # frontends/tools.py's readers of tool_choice "auto"
STEP_TRANSPORTS = ("auto", "grpc")  # engine.py: the worker's step socket where it has one, or gRPC always


_CORE_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}


def _core_setting(name: str, help_text: str, **metadata):
    """A setting the core has too, with the core's default: core tests run with what the process runs."""
    return setting(_CORE_DEFAULTS[name], help_text, **metadata)


@dataclass(frozen=True)
class SchedulerOptions:
    """Scheduler flags before any worker's facts are known (None = derive from the worker).

    A field with a help text is also the scheduler's flag of that name (specdec/config_flags.py generates
    `specdec scheduler`'s and `specdec serve`'s flags from them); --host, --port, --worker, --model and the
    TLS and API-key flags the CLI defines.
    """

    model_dir: str
    worker_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    max_model_len: int | None = setting(None, "prompt + output limit (default: the worker's)")
    num_speculative_tokens: int | None = setting(
        None, "most drafts per sequence and step (default: the worker's k)", metavar="K"
    )
    block_size: int = _core_setting("block_size", "tokens per KV block")
    num_kv_blocks: int | None = setting(
        None, f"KV blocks per worker (default: what each worker's KV budget holds, at most {MAX_DEFAULT_KV_BLOCKS})"
    )
    max_num_seqs: int = _core_setting("max_num_seqs", "most running requests per worker")
    max_num_batched_tokens: int = _core_setting(
        "max_num_batched_tokens", "most tokens per step, prefill chunks included"
    )
    speculative_disable_queue_size: int | None = _core_setting(
        "speculative_disable_queue_size",
        "no speculation in a step when more than N requests run on its worker (default: never)",
        metavar="N",
    )
    speculation_policy: str = _core_setting(
        "speculation_policy",
        "goodput: each sequence's k maximises expected tokens per second of the step (measured step times, "
        "acceptance by draft position); fixed: always the full k",
        choices=SPECULATION_POLICIES,
    )
    scheduling: str = _core_setting(
        "scheduling", "async: step N+1 is scheduled while the worker runs step N", choices=SCHEDULING_MODES
    )
    enable_prefix_caching: bool = _core_setting(
        "enable_prefix_caching",
        "reuse the KV of prompt prefixes a worker has computed before (shared system prompts, earlier chat turns); "
        "--no-enable-prefix-caching recomputes every prompt",
    )
    routing: str = setting(
        "cache-aware",
        "which worker a new request goes to: cache-aware, the one holding its longest cached prefix among those not "
        "much busier than the least busy (--routing-max-imbalance); least-loaded, the one with the fewest requests, "
        "then the most free KV blocks",
        choices=ROUTING_POLICIES,
    )
    routing_max_imbalance: int = setting(
        4,
        "cache-aware routing passes over a worker running or queueing more than N requests more than the least busy "
        "one",
        metavar="N",
    )
    log_stats_interval_s: float = setting(  # process/stats_logger.py
        10.0,
        "while requests run, log throughput, queue, KV usage and acceptance every SECONDS; 0: off",
        flag="--log-stats-interval",
        metavar="SECONDS",
    )
    worker_refresh_interval_s: float = setting(
        10.0, "how often dns:/// worker names are resolved again", flag="--worker-refresh-interval", metavar="SECONDS"
    )
    worker_wait_timeout_s: float = setting(
        60.0,
        "how long a request waits while no worker serves, then UNAVAILABLE",
        flag="--worker-wait-timeout",
        metavar="SECONDS",
    )
    worker_step_timeout_s: float = setting(
        120.0,
        "a worker whose step has no result for this long is treated as failed; its requests move",
        flag="--worker-step-timeout",
        metavar="SECONDS",
    )
    step_transport: str = setting(
        "auto",
        "how the steps go to each worker: auto, over the worker's step socket when it offers one (`specdec worker "
        "--step-port`; `specdec serve` starts its workers with one) and the workers are plaintext, else over gRPC; "
        "grpc, always over the worker's gRPC port",
        choices=STEP_TRANSPORTS,
    )
    take_over_workers: bool = setting(
        False,
        "replace another scheduler's session on the workers (when replacing a scheduler whose connections are still "
        "open); without it a worker another scheduler uses is not joined",
        action="store_true",
    )
    max_waiting_requests: int = setting(
        1024, "queued requests (not yet running) beyond which new ones get RESOURCE_EXHAUSTED", metavar="N"
    )
    max_open_streams: int = setting(
        512, "client calls in progress beyond which new ones get RESOURCE_EXHAUSTED", metavar="N"
    )
    structured_output_max_chars: int = setting(
        65536,
        "a structured-output constraint (schema, regex, grammar, choices) longer than this is refused with "
        "INVALID_ARGUMENT",
        metavar="N",
    )
    structured_output_timeout_s: float = setting(
        2.0,
        "compiling a constraint for longer than this refuses the request with RESOURCE_EXHAUSTED (compiling runs "
        "beside the step loop, never in it)",
        flag="--structured-output-timeout",
        metavar="SECONDS",
    )
    shutdown_grace_period_s: float = setting(
        30.0,
        "on SIGTERM: how long running requests may finish before they are aborted",
        flag="--shutdown-grace-period",
        metavar="SECONDS",
    )
    metrics_port: int = setting(
        0, "serve the scheduler's Prometheus metrics at http://HOST:PORT/metrics; 0: off (default)", metavar="PORT"
    )
    http_port: int = setting(
        0,
        "serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on "
        "HOST:PORT, with the client port's TLS and API keys; 0: off (default)",
        metavar="PORT",
    )
    served_model_name: str | None = setting(  # None: the workers' model id
        None,
        "the model's name in the client APIs: GetServerInfo's model, /v1/models and the OpenAI `model` field "
        "(default: the model's name, its directory's or GGUF file's; a client may also name the workers' model id, "
        "its path)",
        metavar="NAME",
    )
    chat_template: str | None = setting(
        None,
        "render chats with this Jinja template file (default: the model's own; deploy/chat_templates/"
        "chatml_tools.jinja is a ChatML template that renders tools and tool calls)",
        metavar="FILE",
    )
    tool_call_parser: str | None = setting(
        None,
        "read tool calls out of the output for tool_choice 'auto': hermes (<tool_call>{...}</tool_call> blocks) "
        "or json (the whole output is a call or a list of calls) (default: none: 'auto' is refused; 'required' and "
        "a named function need no parser)",
        choices=TOOL_CALL_PARSERS,
    )
    first_worker_timeout_s: float = 600.0  # the process exits when no worker answers in time
    # Security (README "Security"): TLS on the client port; TLS towards the workers (the scheduler's client
    # certificate, the CA of the workers' certificates, the name they carry); accepted API keys (none: open).
    client_tls: TlsFiles = TlsFiles()
    worker_tls: TlsFiles = TlsFiles(flag_prefix="--worker-ssl-", is_server=False)
    worker_server_name: str | None = None
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)  # secrets: never in a repr or a log

    def __post_init__(self) -> None:
        if not self.worker_addresses:
            raise ValueError("at least one worker address is needed (--worker HOST:PORT or dns:///NAME:PORT)")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if self.worker_refresh_interval_s <= 0:
            raise ValueError(f"--worker-refresh-interval must be > 0, got {self.worker_refresh_interval_s}")
        if self.worker_wait_timeout_s < 0:
            raise ValueError(f"--worker-wait-timeout must be >= 0, got {self.worker_wait_timeout_s}")
        if self.worker_step_timeout_s <= 0:
            raise ValueError(f"--worker-step-timeout must be > 0, got {self.worker_step_timeout_s}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_open_streams < 1:
            raise ValueError(f"--max-open-streams must be >= 1, got {self.max_open_streams}")
        if self.shutdown_grace_period_s < 0:
            raise ValueError(f"--shutdown-grace-period must be >= 0, got {self.shutdown_grace_period_s}")
        if self.log_stats_interval_s < 0:
            raise ValueError(f"--log-stats-interval must be >= 0 (0: off), got {self.log_stats_interval_s}")
        if self.structured_output_max_chars < 1:
            raise ValueError(f"--structured-output-max-chars must be >= 1, got {self.structured_output_max_chars}")
        if self.structured_output_timeout_s <= 0:
            raise ValueError(f"--structured-output-timeout must be > 0, got {self.structured_output_timeout_s}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.step_transport not in STEP_TRANSPORTS:
            raise ValueError(
                f"--step-transport must be one of {', '.join(STEP_TRANSPORTS)}, got {self.step_transport!r}"
            )
        if self.routing_max_imbalance < 0:
            raise ValueError(f"--routing-max-imbalance must be >= 0, got {self.routing_max_imbalance}")
        if self.worker_server_name and not self.worker_tls.is_enabled:
            raise ValueError("--worker-ssl-server-name needs TLS to the workers (--worker-ssl-ca-certs, ...)")
        check_metrics_port(self.metrics_port)
        check_metrics_port(self.http_port, "--http-port")
        taken = {"--port": self.port, "--metrics-port": self.metrics_port}
        clash = [flag for flag, port in taken.items() if port and port == self.http_port]
        if clash:
            raise ValueError(f"--http-port {self.http_port} is also {clash[0]}: give the HTTP API a port of its own")


def scheduler_config(opts: SchedulerOptions, info) -> SchedulerConfig:
    """The scheduler config for one worker, from the options and its DescribeResponse; ValueError if they clash."""
    max_model_len = min(opts.max_model_len or info.max_model_len, info.max_model_len)
    num_kv_blocks = opts.num_kv_blocks or min(info.num_blocks_capacity, MAX_DEFAULT_KV_BLOCKS)
    k = info.max_num_speculative_tokens if opts.num_speculative_tokens is None else opts.num_speculative_tokens
    if k > info.max_num_speculative_tokens:
        raise ValueError(f"--num-speculative-tokens {k} exceeds the worker's k ({info.max_num_speculative_tokens})")
    return SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=opts.block_size,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=max_model_len,
        num_speculative_tokens=k if info.proposer != "none" else 0,
        speculative_disable_queue_size=opts.speculative_disable_queue_size,
        speculation_policy=opts.speculation_policy,
        max_draft_tree_width=max(info.max_draft_tree_width, 1),
        scheduling=opts.scheduling,
        enable_prefix_caching=opts.enable_prefix_caching,
        kv_cache_facts=(info.model_id, info.dtype, info.proposer, info.draft_model_id),
    )
