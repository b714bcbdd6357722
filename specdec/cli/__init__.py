"""The `specdec` command: serve, worker, scheduler, generate, train-draft.

The top layer: it imports both services (each defines its own flags and builds
its config from them) and the shared protocol; nothing imports it.
"""

import argparse
import logging
import os
import sys

from scheduler_service.process import flags as scheduler_flags
from specdec import security
from specdec.cli import logs, parsing
from specdec.metrics_server import check_metrics_port
from worker_service.runtime import default_model as models
from worker_service.serving import flags as worker_flags


def _add_model_flag(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--model", default=None, help=f"{help_text} (default: the embedded SmolLM2-135M-Instruct)")


def _worker_address(value: str) -> str:
    from scheduler_service.cluster.membership import parse_worker_spec

    try:
        parse_worker_spec(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def cmd_worker(args: argparse.Namespace) -> int:
    from worker_service.serving.compat import check_versions

    try:
        check_versions()  # before the model code imports what an old library lacks
        from worker_service.serving.main import run_worker

        credentials = security.server_credentials(security.server_tls_from_args(args))  # before the model
        config = worker_flags.config_from_args(args, str(models.resolve_model(args.model)), args.num_threads)
        check_metrics_port(args.metrics_port)
        if args.step_port is not None and not 0 <= args.step_port <= 65535:
            raise ValueError(f"--step-port must be a port in 0..65535 (0: any free port), got {args.step_port}")
        return run_worker(
            config,
            args.host,
            args.port,
            credentials=credentials,
            metrics_port=args.metrics_port,
            parent_fd=args.parent_fd,
            step_port=args.step_port,
        )
    except (ValueError, OSError, RuntimeError) as exc:  # a ModelLoadError is a RuntimeError
        print(f"specdec worker: error: {exc}", file=sys.stderr)
        return 1


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler_service.process.main import run_scheduler

    try:
        model_dir = str(models.resolve_model(args.model))
        return run_scheduler(
            scheduler_flags.options_from_args(args, model_dir, args.worker, models.model_name(args.model))
        )
    except Exception as exc:  # noqa: BLE001 - the CLI edge: one clear line, non-zero exit
        print(f"specdec scheduler: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.cli.serve import serve

    return serve(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.cli.generate import generate

    return generate(args)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specdec.cli.train_draft import train_draft

    return train_draft(args)


def build_parser() -> argparse.ArgumentParser:
    parser = parsing.SpecdecArgumentParser(
        prog="specdec",
        description=__doc__.splitlines()[0],
        formatter_class=parsing.DefaultsHelpFormatter,
        epilog=parsing.ENV_EPILOG,
    )
    parser.add_argument(
        "--version", action="version", version=f"specdec {parsing.version()}", help="print `specdec VERSION` and exit"
    )
    parsing.add_global_flags(parser, is_subcommand=False)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(parsing.add_subcommand(sub, "worker", "run a worker service (models + KV cache)"))
    _add_scheduler(parsing.add_subcommand(sub, "scheduler", "run the scheduler (client API) for running workers"))
    _add_serve(
        parsing.add_subcommand(
            sub,
            "serve",
            "start workers and the scheduler on loopback",
            description="Starts worker processes and the scheduler. The workers listen on 127.0.0.1 in plaintext; "
            "--ssl-* and --api-key-file protect the client port.",
        )
    )
    _add_generate(parsing.add_subcommand(sub, "generate", "stream a completion from a running server"))
    _add_train_draft(
        parsing.add_subcommand(
            sub,
            "train-draft",
            "train an EAGLE-3 draft head for a model",
            description="Generates the target's own responses to prompts from redistributable package text and "
            "prompts it writes itself, then trains an EAGLE-3 head on its hidden states. Resumable.",
        )
    )
    return parser


def _add_worker(worker: argparse.ArgumentParser) -> None:
    worker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    worker.add_argument("--port", type=int, default=50052, help="port to listen on; 0: any free port")
    _add_model_flag(worker, "checkpoint directory or .gguf file")
    worker_flags.add_flags(worker)
    worker.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads (default: $OMP_NUM_THREADS, else the CPUs the process may use: its affinity, capped "
        "by its cgroup's CPU quota)",
    )
    security.add_server_tls_flags(worker, "the worker port")
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics; 0: off",
    )
    worker.add_argument(
        "--step-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the step stream (the scheduler's steps and their results) on a bare TCP socket at "
        "--host:PORT, which the scheduler finds through Describe and prefers (less CPU per step than gRPC's "
        "stream); 0: any free port; plaintext only (default: off, steps go over the gRPC port)",
    )
    worker.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        metavar="FD",
        help="exit when this inherited file descriptor reads end of file: `specdec serve` passes "
        "a pipe only it writes to, so that its workers end with it, even when it is killed "
        "(default: none, the worker runs until SIGTERM)",
    )
    worker.set_defaults(func=cmd_worker)


def _add_scheduler(scheduler: argparse.ArgumentParser) -> None:
    scheduler.add_argument("--host", default="127.0.0.1", help="client API address to listen on")
    scheduler.add_argument("--port", type=int, default=50051, help="client API port; 0: any free port")
    scheduler.add_argument(
        "--worker",
        required=True,
        action="append",
        type=_worker_address,
        metavar="HOST:PORT|dns:///NAME:PORT",
        help="a worker, or every address a DNS name resolves to (repeatable)",
    )
    _add_model_flag(scheduler, "the workers' model, for its tokenizer")
    scheduler_flags.add_flags(scheduler)
    scheduler_flags.add_security_flags(scheduler)
    scheduler.set_defaults(func=cmd_scheduler)


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="client API address to listen on")
    serve.add_argument("--port", type=int, default=50051, help="client API port; 0: any free port")
    _add_model_flag(serve, "checkpoint directory or .gguf file")
    worker_flags.add_flags(serve)
    serve.add_argument(
        "--num-workers", type=int, default=1, metavar="N", help="worker processes; the CPU cores are split between them"
    )
    serve.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per worker (default: the CPUs the process may use, its affinity capped by its "
        "cgroup's CPU quota, / --num-workers)",
    )
    serve.add_argument(
        "--worker-metrics-port",
        type=int,
        default=0,
        metavar="BASE",
        help="worker i serves Prometheus metrics on port BASE + i; 0: off",
    )
    scheduler_flags.add_flags(serve, with_model_flags=False)
    scheduler_flags.add_security_flags(serve, with_worker_flags=False)  # its loopback workers stay plaintext
    serve.set_defaults(func=cmd_serve)


def _add_generate(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051", help="the server's client API, HOST:PORT")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as a chat message")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this probability"
    )
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="reproducible sampling (default: a random seed)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--no-speculation", action="store_true", help="decode this request without drafts")
    gen.add_argument(
        "--ca-file",
        default=None,
        metavar="PEM",
        help="CA of the server's certificate: connect with TLS (default: plaintext)",
    )
    gen.add_argument(
        "--cert-file", default=None, metavar="PEM", help="client certificate, for mutual TLS (default: none)"
    )
    gen.add_argument("--key-file", default=None, metavar="PEM", help="private key of --cert-file (default: none)")
    gen.add_argument(
        "--server-name",
        default=None,
        metavar="NAME",
        help="the name the server's certificate must carry (default: the host of --address)",
    )
    keys = gen.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the API key to send; other local users can see it in the process list, so prefer "
        f"--api-key-file or ${security.API_KEY_ENV} (default: ${security.API_KEY_ENV}, if set)",
    )
    keys.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"file with the API key (its first key) (default: ${security.API_KEY_ENV}, if set)",
    )
    gen.set_defaults(func=cmd_generate)


def _add_train_draft(train: argparse.ArgumentParser) -> None:
    from specdec.cli import train_draft

    _add_model_flag(train, "the target: checkpoint directory or .gguf file")
    train_draft.add_flags(train)
    train.set_defaults(func=cmd_train_draft)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure_logging(args.log_level, args.log_format)
    code = args.func(args)
    if args.command in ("worker", "scheduler", "serve"):
        # The servers have stopped. Exit now: a gRPC handler thread still blocked on a peer's
        # stream would otherwise hold up the interpreter's exit (it joins executor threads).
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code
