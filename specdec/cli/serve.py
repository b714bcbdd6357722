"""`specdec serve`: N worker processes and the scheduler (this process) on loopback.

The CPU cores are split between the workers (torch threads per worker). A
worker that dies after it has loaded its model is started again on the same
port, and the scheduler takes it back (its requests meanwhile moved to the
others); a worker that fails before loading its model stops the server.
"""

import argparse
from dataclasses import replace
import logging
import os
import subprocess
import sys
import threading

from scheduler_service.process import flags as scheduler_flags
from specdec import cpus, security
from specdec.cli.parsing import flag_free_environ
from worker_service.runtime import default_model as models
from worker_service.serving import flags as worker_flags

logger = logging.getLogger(__name__)


class WorkerProcess:
    """One worker process; `supervise` restarts it on its port when it dies after loading its model."""

    def __init__(self, index: int, argv: list[str], parent_fd: int):
        self.index = index
        self.argv = argv  # `specdec ...` arguments without --port and --parent-fd
        self.parent_fd = parent_fd  # the read end of the pipe whose end of file tells the worker to exit
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.is_loaded = False
        self.is_stopping = False
        self._lock = threading.Lock()  # start (restart) and stop never interleave

    def start(self, port: int = 0) -> str:
        """Starts the process and returns its address, read from its output."""
        with self._lock:
            if self.is_stopping:
                raise RuntimeError(f"worker {self.index}: the server is stopping")
            self.is_loaded = False
            # Its own session: a Ctrl-C in the terminal reaches only `specdec serve`, which stops the
            # workers itself (otherwise they would exit first and be restarted as if they had crashed). So
            # that a SIGKILL of `serve` does not leave it running, it watches the pipe only `serve` writes to.
            # Every setting is on its command line: no SPECDEC_<FLAG> variable meant for `serve` (its client
            # port's TLS, say) may reach the worker.
            self.proc = proc = subprocess.Popen(
                [sys.executable, "-m", "specdec", *self.argv, "--port", str(port), "--parent-fd", str(self.parent_fd)],
                stdout=subprocess.PIPE,
                stderr=None,
                text=True,
                start_new_session=True,
                env=flag_free_environ(),
                pass_fds=(self.parent_fd,),
            )
        for line in proc.stdout:
            self._echo(line)
            if line.startswith("worker listening on "):
                self.address = line.split()[-1]
                threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
                return self.address
        raise RuntimeError(f"worker {self.index} exited with code {proc.wait()} before listening")

    def supervise(self, on_fatal) -> None:
        """Waits for the process; restarts it when it dies after loading, else calls on_fatal(message)."""
        while True:
            code = self.proc.wait()
            if self.is_stopping:
                return
            if not self.is_loaded:
                on_fatal(f"worker {self.index} exited with code {code} before loading its model")
                return
            port = int(self.address.rsplit(":", 1)[1])
            logger.warning(
                "worker %d (%s) exited with code %d: starting it again on port %d", self.index, self.address, code, port
            )
            try:
                self.start(port)
            except RuntimeError as exc:
                if not self.is_stopping:
                    on_fatal(str(exc))
                return

    def stop(self) -> None:
        with self._lock:
            self.is_stopping = True
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._echo(line)

    def _echo(self, line: str) -> None:
        if line.startswith("worker model loaded"):
            self.is_loaded = True
        print(f"[worker {self.index}] {line}", end="", file=sys.stderr)


def worker_num_threads(args: argparse.Namespace) -> int:
    """Each worker's torch threads: --num-threads, else the CPUs this process may use (specdec.cpus: its
    affinity, capped by its cgroup's CPU quota) shared evenly among --num-workers."""
    return args.num_threads or max(1, cpus.usable_cpus() // args.num_workers)


def worker_step_port(args: argparse.Namespace) -> int | None:
    """Each worker's --step-port: its steps on a socket of its own (any free port, on loopback like its gRPC
    port), unless the scheduler would not use it (--step-transport grpc)."""
    return None if args.step_transport == "grpc" else 0


def _worker_argv(args: argparse.Namespace, model_dir: str) -> list[str]:
    step_port = worker_step_port(args)
    return [
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        "worker",
        "--host",
        "127.0.0.1",
        "--model",
        model_dir,
        "--num-threads",
        str(worker_num_threads(args)),
        *worker_flags.forwarded_argv(args),
        *([] if step_port is None else ["--step-port", str(step_port)]),
    ]


def serve(args: argparse.Namespace) -> int:
    from scheduler_service.process.main import run_scheduler

    if args.num_workers < 1:
        print(f"specdec serve: error: --num-workers must be >= 1, got {args.num_workers}", file=sys.stderr)
        return 2
    if args.worker_metrics_port and not 0 < args.worker_metrics_port <= 65536 - args.num_workers:
        print(
            f"specdec serve: error: --worker-metrics-port {args.worker_metrics_port} + {args.num_workers} workers "
            "is not a port range in 1..65535 (0: off)",
            file=sys.stderr,
        )
        return 2
    workers: list[WorkerProcess] = []
    # Every worker inherits the read end; the write end stays here only (os.pipe's are not inherited), so
    # the workers read end of file when this process exits, however it ends.
    parent_read_fd, parent_write_fd = os.pipe()
    stop = threading.Event()
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        stop.set()

    try:
        model_dir = str(models.resolve_model(args.model))
        # Every scheduler flag is checked, and the key and TLS files read, before any worker starts (the
        # workers' addresses are known once they listen).
        options = scheduler_flags.options_from_args(args, model_dir, ["127.0.0.1:0"], models.model_name(args.model))
        security.server_credentials(options.client_tls)
        argv = _worker_argv(args, model_dir)
        for index in range(args.num_workers):
            metrics_port = args.worker_metrics_port + index if args.worker_metrics_port else 0
            workers.append(WorkerProcess(index, [*argv, "--metrics-port", str(metrics_port)], parent_read_fd))
            workers[-1].start()
        for worker in workers:
            threading.Thread(target=worker.supervise, args=(on_fatal,), daemon=True).start()
        code = run_scheduler(replace(options, worker_addresses=tuple(w.address for w in workers)), stop)
    except Exception as exc:  # noqa: BLE001 - the CLI edge: one clear line, non-zero exit
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        for worker in workers:
            worker.stop()
        os.close(parent_read_fd)
        os.close(parent_write_fd)
    if fatal:
        print(f"specdec serve: error: {fatal[0]}", file=sys.stderr)
        code = 1
    return code
