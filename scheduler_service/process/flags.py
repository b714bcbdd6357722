"""The scheduler's command-line flags and the SchedulerOptions built from them (one place for both)."""

import argparse

from scheduler_service.cluster.options import SchedulerOptions
from scheduler_service.core.config import ROUTING_POLICIES, SCHEDULING_MODES, SPECULATION_POLICIES
from specdec import security


def add_flags(p: argparse.ArgumentParser, with_model_flags: bool = True) -> None:
    """Adds the batching, KV, speculation-policy and worker-membership flags.

    with_model_flags=False leaves out --max-model-len and --num-speculative-tokens, for a launcher
    whose worker flags already define them (`specdec serve`).
    """
    if with_model_flags:
        p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the worker's)")
        p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                       help="most drafts per sequence and step (default: the worker's k)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per worker (default: what each worker's KV budget holds, at most 4096)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most running requests per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens per step, prefill chunks included")
    p.add_argument("--speculative-disable-queue-size", type=int, default=None, metavar="N",
                   help="no speculation in a step when more than N requests run on its worker (default: never)")
    p.add_argument("--speculation-policy", choices=SPECULATION_POLICIES, default="goodput",
                   help="goodput: each sequence's k maximises expected tokens per second of the step (measured step "
                        "times, acceptance by draft position); fixed: always the full k")
    p.add_argument("--scheduling", choices=SCHEDULING_MODES, default="async",
                   help="async: step N+1 is scheduled while the worker runs step N")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes a worker has computed before (shared system prompts, "
                        "earlier chat turns); --no-enable-prefix-caching recomputes every prompt")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="cache-aware",
                   help="which worker a new request goes to: cache-aware, the one holding its longest cached "
                        "prefix among those not much busier than the least busy (--routing-max-imbalance); "
                        "least-loaded, the one with the fewest requests, then the most free KV blocks")
    p.add_argument("--routing-max-imbalance", type=int, default=4, metavar="N",
                   help="cache-aware routing passes over a worker running or queueing more than N requests more "
                        "than the least busy one")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="while requests run, log throughput, queue, KV usage and acceptance every SECONDS; 0: off")
    p.add_argument("--worker-refresh-interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often dns:/// worker names are resolved again")
    p.add_argument("--worker-wait-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a request waits while no worker serves, then UNAVAILABLE")
    p.add_argument("--worker-step-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="a worker whose step has no result for this long is treated as failed; its requests move")
    p.add_argument("--take-over-workers", action="store_true",
                   help="replace another scheduler's session on the workers (when replacing a scheduler whose "
                        "connections are still open); without it a worker another scheduler uses is not joined")
    p.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="queued requests (not yet running) beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-open-streams", type=int, default=512, metavar="N",
                   help="client calls in progress beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--structured-output-max-chars", type=int, default=65536, metavar="N",
                   help="a structured-output constraint (schema, regex, grammar, choices) longer than this is "
                        "refused with INVALID_ARGUMENT")
    p.add_argument("--structured-output-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="compiling a constraint for longer than this refuses the request with RESOURCE_EXHAUSTED "
                        "(compiling runs beside the step loop, never in it)")
    p.add_argument("--shutdown-grace-period", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM: how long running requests may finish before they are aborted")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the scheduler's Prometheus metrics at http://HOST:PORT/metrics; 0: off (default)")
    p.add_argument("--http-port", type=int, default=0, metavar="PORT",
                   help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                        "/health) on HOST:PORT, with the client port's TLS and API keys; 0: off (default)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the client APIs: GetServerInfo's model, /v1/models and the OpenAI "
                        "`model` field (default: the model's name, its directory's or GGUF file's; a "
                        "client may also name the workers' model id, its path)")


def add_security_flags(p: argparse.ArgumentParser, with_worker_flags: bool = True) -> None:
    """Adds TLS for the client port, the API-key file and (with_worker_flags) TLS towards the workers."""
    security.add_server_tls_flags(p, "the client API port")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"accepted API keys, one per line (# comments); ${security.API_KEY_ENV} adds one. "
                        "Clients send 'authorization: Bearer <key>' (default: no key needed)")
    if not with_worker_flags:
        return
    p.add_argument("--worker-ssl-certfile", default=None, metavar="PEM",
                   help="the scheduler's client certificate towards the workers, with --worker-ssl-keyfile "
                        "(default: none)")
    p.add_argument("--worker-ssl-keyfile", default=None, metavar="PEM",
                   help="private key of --worker-ssl-certfile (default: none)")
    p.add_argument("--worker-ssl-ca-certs", default=None, metavar="PEM",
                   help="CA that signed the workers' certificates (default: plaintext to the workers)")
    p.add_argument("--worker-ssl-server-name", default=None, metavar="NAME",
                   help="the name the workers' certificates must carry, when the scheduler reaches them by IP "
                        "(dns:/// names resolve to pod IPs) (default: the host of each worker address)")


def _security_options(args: argparse.Namespace) -> dict:
    """The security fields of SchedulerOptions; reads the API-key file and $SPECDEC_API_KEY."""
    options = dict(client_tls=security.server_tls_from_args(args),
                   api_keys=security.load_api_keys(args.api_key_file))
    if hasattr(args, "worker_ssl_ca_certs"):  # `specdec serve` keeps its loopback workers plaintext
        options.update(worker_tls=security.TlsFiles(args.worker_ssl_certfile, args.worker_ssl_keyfile,
                                                    args.worker_ssl_ca_certs, "--worker-ssl-", is_server=False),
                       worker_server_name=args.worker_ssl_server_name)
    return options


def options_from_args(args: argparse.Namespace, model_dir: str, worker_addresses: list[str],
                      model_name: str | None = None) -> SchedulerOptions:
    """The SchedulerOptions of parsed flags; raises ValueError for bad values or an unreadable key file.

    model_name: the model's own name (its directory's or GGUF file's), served when --served-model-name is not
    given; None: the workers' model id.
    """
    return SchedulerOptions(model_dir=model_dir, worker_addresses=tuple(worker_addresses), host=args.host,
                            port=args.port, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, num_speculative_tokens=args.num_speculative_tokens,
                            speculative_disable_queue_size=args.speculative_disable_queue_size,
                            speculation_policy=args.speculation_policy,
                            scheduling=args.scheduling, enable_prefix_caching=args.enable_prefix_caching,
                            routing=args.routing, routing_max_imbalance=args.routing_max_imbalance,
                            worker_refresh_interval_s=args.worker_refresh_interval,
                            log_stats_interval_s=args.log_stats_interval,
                            worker_wait_timeout_s=args.worker_wait_timeout,
                            worker_step_timeout_s=args.worker_step_timeout, take_over_workers=args.take_over_workers,
                            max_waiting_requests=args.max_waiting_requests, max_open_streams=args.max_open_streams,
                            shutdown_grace_period_s=args.shutdown_grace_period, metrics_port=args.metrics_port,
                            http_port=args.http_port, served_model_name=args.served_model_name or model_name,
                            structured_output_max_chars=args.structured_output_max_chars,
                            structured_output_timeout_s=args.structured_output_timeout,
                            **_security_options(args))
