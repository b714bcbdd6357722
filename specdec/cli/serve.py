"""`specdec serve`: a worker process and the scheduler (this process) on loopback."""

import argparse
import subprocess
import sys
import threading

from scheduler_service import flags as scheduler_flags
from worker_service import flags as worker_flags
from worker_service import models


def _worker_argv(args: argparse.Namespace, model_dir: str) -> list[str]:
    argv = ["worker", "--host", "127.0.0.1", "--port", "0", "--model", model_dir, *worker_flags.forwarded_argv(args)]
    if args.num_threads is not None:
        argv += ["--num-threads", str(args.num_threads)]
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
        code = run_scheduler(scheduler_flags.options_from_args(args, model_dir, address), stop)
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
