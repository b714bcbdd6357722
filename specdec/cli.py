"""The `specdec` command: serve, worker, scheduler, generate."""

import argparse
import logging
import sys

from specdec import models


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--draft-model", default=None, help="draft model for --proposer draft")
    p.add_argument("--proposer", choices=("none", "ngram", "draft"), default="none")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--scorer", choices=("multi_query", "batch_expansion"), default="multi_query")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")


def _worker_config(args: argparse.Namespace):
    from worker_service.config import WorkerConfig

    model = args.model or str(models.fetch_default_model())
    return WorkerConfig(model=model, dtype=args.dtype, draft_model=args.draft_model, proposer=args.proposer,
                        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                        ngram_max=args.ngram_max, scorer=args.scorer,
                        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
                        max_model_len=args.max_model_len, num_threads=args.num_threads)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker_service.main import run_worker
    from worker_service.model_loader import ModelLoadError

    try:
        return run_worker(_worker_config(args), args.host, args.port)
    except (ModelLoadError, ValueError, OSError, RuntimeError) as exc:
        print(f"specdec worker: error: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="run a worker service (models + KV cache)")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=50052)
    _add_worker_flags(worker)
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
