"""The scheduler's options (from flags) and the per-worker scheduler config built from a worker's facts."""

from dataclasses import dataclass, field

from scheduler_service.core.config import ROUTING_POLICIES, SchedulerConfig
from specdec.security import TlsFiles
from specdec.metrics_server import check_metrics_port

MAX_DEFAULT_KV_BLOCKS = 4096


@dataclass(frozen=True)
class SchedulerOptions:
    """Scheduler flags before any worker's facts are known (None = derive from the worker)."""

    model_dir: str
    worker_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_speculative_tokens: int | None = None
    speculative_disable_queue_size: int | None = None
    speculation_policy: str = "goodput"
    scheduling: str = "async"
    enable_prefix_caching: bool = True
    routing: str = "cache-aware"            # where a new request goes (ROUTING_POLICIES)
    routing_max_imbalance: int = 4          # cache-aware: skip workers with this many more requests than the least busy
    worker_refresh_interval_s: float = 10.0
    worker_wait_timeout_s: float = 60.0
    first_worker_timeout_s: float = 600.0   # the process exits when no worker answers in time
    worker_step_timeout_s: float = 120.0    # a step without a result for this long: the worker hangs, it leaves
    take_over_workers: bool = False         # replace another scheduler's session on a worker
    max_waiting_requests: int = 1024        # queued (not running) requests beyond which new ones are refused
    max_open_streams: int = 512             # client calls in progress (streams) beyond which new ones are refused
    shutdown_grace_period_s: float = 30.0   # SIGTERM: how long running requests may finish
    log_stats_interval_s: float = 10.0      # the periodic stats line while requests run (process/stats_logger.py); 0: off
    # Security (README "Security"): TLS on the client port; TLS towards the workers (the scheduler's client
    # certificate, the CA of the workers' certificates, the name they carry); accepted API keys (none: open).
    client_tls: TlsFiles = TlsFiles()
    worker_tls: TlsFiles = TlsFiles(flag_prefix="--worker-ssl-", is_server=False)
    worker_server_name: str | None = None
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)   # secrets: never in a repr or a log
    metrics_port: int = 0                   # Prometheus /metrics on host:metrics_port; 0: off
    http_port: int = 0                      # the OpenAI-compatible HTTP API on host:http_port; 0: off
    served_model_name: str | None = None    # the model's name in the client APIs (None: the workers' model id)
    structured_output_max_chars: int = 65536  # a structured-output constraint's text beyond this is refused
    structured_output_timeout_s: float = 2.0  # compiling a constraint for longer than this: RESOURCE_EXHAUSTED

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
    return SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=opts.block_size, max_num_seqs=opts.max_num_seqs,
                           max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=max_model_len,
                           num_speculative_tokens=k if info.proposer != "none" else 0,
                           speculative_disable_queue_size=opts.speculative_disable_queue_size,
                           speculation_policy=opts.speculation_policy,
                           max_draft_tree_width=max(info.max_draft_tree_width, 1),
                           scheduling=opts.scheduling, enable_prefix_caching=opts.enable_prefix_caching,
                           kv_cache_facts=(info.model_id, info.dtype, info.proposer, info.draft_model_id))
