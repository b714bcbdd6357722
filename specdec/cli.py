"""The `specdec` command: serve, worker, scheduler, generate."""

import argparse
import logging
import os
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
    p.add_argument("--speculative-row-budget", type=int, default=None, metavar="R",
                   help="most query rows a step verifies before drafts follow each sequence's recent acceptance "
                        "(default: 8 on a CPU, unlimited elsewhere; 0: unlimited)")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: what the worker's KV budget holds")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--speculative-disable-queue-size", type=int, default=None, metavar="N",
                   help="no speculation in a step when more than N requests run")
    p.add_argument("--scheduling", choices=("sync", "async"), default="async")


def _scheduler_options(args: argparse.Namespace, worker_address: str, model_dir: str):
    from scheduler_service.main import SchedulerOptions

    return SchedulerOptions(model_dir=model_dir, worker_address=worker_address, host=args.host, port=args.port,
                            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, num_speculative_tokens=args.num_speculative_tokens,
                            speculative_disable_queue_size=args.speculative_disable_queue_size,
                            scheduling=args.scheduling)


def _worker_config(args: argparse.Namespace):
    from worker_service.config import WorkerConfig

    model = str(models.resolve_model(args.model))
    return WorkerConfig(model=model, dtype=args.dtype, draft_model=args.draft_model, proposer=args.proposer,
                        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                        ngram_max=args.ngram_max, scorer=args.scorer,
                        speculative_row_budget=args.speculative_row_budget,
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


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler_service.main import run_scheduler

    try:
        model_dir = str(models.resolve_model(args.model))
        return run_scheduler(_scheduler_options(args, args.worker, model_dir))
    except Exception as exc:  # noqa: BLE001 - the CLI edge: one clear line, non-zero exit
        print(f"specdec scheduler: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.serve import serve

    return serve(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.client import generate

    return generate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="run a worker service (models + KV cache)")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=50052)
    _add_worker_flags(worker)
    worker.set_defaults(func=cmd_worker)

    scheduler = sub.add_parser("scheduler", help="run the scheduler (client API) for a running worker")
    scheduler.add_argument("--host", default="127.0.0.1")
    scheduler.add_argument("--port", type=int, default=50051)
    scheduler.add_argument("--worker", required=True, metavar="HOST:PORT")
    scheduler.add_argument("--model", default=None, help="the worker's model, for its tokenizer")
    scheduler.add_argument("--max-model-len", type=int, default=None)
    scheduler.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                           help="default: the worker's k")
    _add_scheduler_flags(scheduler)
    scheduler.set_defaults(func=cmd_scheduler)

    serve = sub.add_parser("serve", help="start a worker and the scheduler on loopback")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    _add_worker_flags(serve)
    _add_scheduler_flags(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as a chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--no-speculation", action="store_true")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = args.func(args)
    if args.command in ("worker", "scheduler", "serve"):
        # The servers have stopped. Exit now: a gRPC handler thread still blocked on a peer's
        # stream would otherwise hold up the interpreter's exit (it joins executor threads).
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
