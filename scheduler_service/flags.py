"""The scheduler's command-line flags and the SchedulerOptions built from them (one place for both)."""

import argparse

from scheduler_service.config import SCHEDULING_MODES
from scheduler_service.options import SchedulerOptions


def add_flags(p: argparse.ArgumentParser, with_model_flags: bool = True) -> None:
    """Adds the batching, KV, speculation-policy and worker-membership flags.

    with_model_flags=False leaves out --max-model-len and --num-speculative-tokens, for a launcher
    whose worker flags already define them (`specdec serve`).
    """
    if with_model_flags:
        p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the worker's)")
        p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                       help="most drafts per sequence and step (default: the worker's k)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per worker (default: what each worker's KV budget holds, at most 4096)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most running requests per worker (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens per step, prefill chunks included (default: %(default)s)")
    p.add_argument("--speculative-disable-queue-size", type=int, default=None, metavar="N",
                   help="no speculation in a step when more than N requests run on its worker (default: never)")
    p.add_argument("--scheduling", choices=SCHEDULING_MODES, default="async",
                   help="async: step N+1 is scheduled while the worker runs step N (default: %(default)s)")
    p.add_argument("--worker-refresh-interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often dns:/// worker names are resolved again (default: %(default)s)")
    p.add_argument("--worker-wait-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a request waits while no worker serves, then UNAVAILABLE (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the scheduler's Prometheus metrics at http://HOST:PORT/metrics; 0: off (default)")


def options_from_args(args: argparse.Namespace, model_dir: str, worker_addresses: list[str]) -> SchedulerOptions:
    """The SchedulerOptions of parsed flags; raises ValueError for bad values."""
    return SchedulerOptions(model_dir=model_dir, worker_addresses=tuple(worker_addresses), host=args.host,
                            port=args.port, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, num_speculative_tokens=args.num_speculative_tokens,
                            speculative_disable_queue_size=args.speculative_disable_queue_size,
                            scheduling=args.scheduling, worker_refresh_interval_s=args.worker_refresh_interval,
                            worker_wait_timeout_s=args.worker_wait_timeout, metrics_port=args.metrics_port)
