"""`specdec serve`: a worker process and the scheduler (this process) on loopback."""

import argparse
import subprocess
import sys
import threading

from specdec import models

_WORKER_FLAGS = ("model", "draft_model", "proposer", "num_speculative_tokens", "ngram_min", "ngram_max", "scorer",
                 "dtype", "max_model_len", "kv_cache_memory_gib", "num_threads", "speculative_row_budget")


def _worker_argv(args: argparse.Namespace, model_dir: str) -> list[str]:
    argv = ["worker", "--host", "127.0.0.1", "--port", "0"]
    for name in _WORKER_FLAGS:
        value = model_dir if name == "model" else getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def _start_worker(args: argparse.Namespace, model_dir: str) -> tuple[subprocess.Popen, str]:
    """Starts the worker and returns it with its address, read from its first output line."""
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "--log-level", args.log_level,
                             *_worker_argv(args, model_dir)],
                            stdout=subprocess.PIPE, stderr=None, text=True)
    for line in proc.stdout:
        if line.startswith("worker listening on "):
            address = line.split()[-1]
            threading.Thread(target=lambda: [print(f"[worker] {l}", end="", file=sys.stderr) for l in proc.stdout],
                             daemon=True).start()
            return proc, address
        print(f"[worker] {line}", end="", file=sys.stderr)
    raise RuntimeError(f"the worker exited with code {proc.wait()} before listening")


def serve(args: argparse.Namespace) -> int:
    from scheduler_service.main import run_scheduler
    from specdec.cli import _scheduler_options

    try:
        model_dir = str(models.resolve_model(args.model))
        proc, address = _start_worker(args, model_dir)
    except Exception as exc:  # noqa: BLE001 - the CLI edge
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    worker_exit: list[int] = []

    def watch_worker() -> None:
        worker_exit.append(proc.wait())
        stop.set()

    threading.Thread(target=watch_worker, daemon=True).start()
    try:
        code = run_scheduler(_scheduler_options(args, address, model_dir), stop)
    except Exception as exc:  # noqa: BLE001
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    if worker_exit and worker_exit[0] != 0 and code == 0:
        print(f"specdec serve: error: the worker exited with code {worker_exit[0]}", file=sys.stderr)
        code = 1
    return code
