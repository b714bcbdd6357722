"""`specdec serve` in the test process: real Workers behind real gRPC servers (and step sockets, as serve's
workers have), and `run_scheduler`, each on 127.0.0.1 port 0 (HTTP and metrics where their flags ask).

For the tests whose subject is what is served, not the process: the flags are parsed by `specdec serve`'s own
parser and turned into the scheduler's options and the workers' config as it does, but no process is started
(each would import torch again, ~10 s). Lifecycle, signals, failover, orphans, the CLI and the image keep real
processes (tests/processes.py).
"""

import contextlib
from dataclasses import replace
import queue
import threading
from unittest import mock

import torch

from scheduler_service.process import flags as scheduler_flags
from scheduler_service.process import main as scheduler_main
from specdec.cli import build_parser
from specdec.cli.serve import worker_num_threads, worker_step_port
from specdec.metrics_server import start_metrics_server
from tests.e2e.client import Server
from worker_service.runtime import default_model as models
from worker_service.serving import flags as worker_flags
from worker_service.serving.server import create_server
from worker_service.serving.step_socket import serve_steps
from worker_service.speculation.build import build_worker

STOP_TIMEOUT_S = 120.0  # the scheduler's drain (its --shutdown-grace-period) and the servers' stop


class InProcessWorker:
    """A Worker served over gRPC as `specdec worker` serves it (model on the compute thread), and on a step
    socket at step_port (None: none) as its --step-port."""

    def __init__(self, config, metrics_port: int = 0, step_port: int | None = None):
        self.server, self.servicer, port = create_server("127.0.0.1", 0)
        self.address = f"127.0.0.1:{port}"
        self.metrics_server = self.step_server = None
        try:
            if step_port is not None:
                self.step_server = serve_steps(self.servicer, "127.0.0.1", step_port)
            self.servicer.set_worker(self.servicer.run_compute(build_worker, config), config.model)
            if metrics_port:
                self.metrics_server = start_metrics_server(
                    self.servicer.metrics.registry, "127.0.0.1", metrics_port, "worker"
                )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """As run_worker on SIGTERM: no new step, the step in flight finishes, the server stops."""
        self.servicer.begin_shutdown()
        self.servicer.compute.submit(lambda: None).result(timeout=STOP_TIMEOUT_S)
        if self.step_server is not None:
            self.step_server.stop()
        self.server.stop(grace=1).wait()
        self.servicer.close()
        self.servicer.worker = None  # the KV cache goes now, not when the gRPC server's threads let go
        if self.metrics_server is not None:
            self.metrics_server.shutdown()


class InProcessServer(Server):
    """A client stub (as Server's) to an in-process scheduler; `workers` are the InProcessWorkers behind it,
    `lines` what run_scheduler announced (`http listening on ...`), `http_address` the HTTP API's, if any."""

    def __init__(self, address: str, lines: list[str], workers: list[InProcessWorker]):
        self.process, self.lines, self.workers = None, lines, workers
        self.http_address = next((line.split()[-1] for line in lines if line.startswith("http listening on ")), None)
        self.connect(address)


class _SchedulerThread:
    """run_scheduler(options, stop) on a thread; what it announces while it starts is read here, not written
    to stdout."""

    def __init__(self, options):
        self.stop_event = threading.Event()
        self.lines: queue.Queue = queue.Queue()
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(options,), name="scheduler", daemon=True)

    def _run(self, options) -> None:
        try:
            self.code = scheduler_main.run_scheduler(options, self.stop_event)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            self.error = exc
        finally:
            self.lines.put(None)

    def start(self, timeout: float = 120.0) -> tuple[str, list[str]]:
        """Starts it; returns the client API's address and every line announced up to `scheduler ready`."""
        with mock.patch.object(scheduler_main, "announce", self.lines.put):
            self.thread.start()
            seen = []
            try:
                while (line := self.lines.get(timeout=timeout)) is not None:
                    seen.append(line)
                    if line == "scheduler ready":
                        address = next(x for x in seen if x.startswith("scheduler listening on ")).split()[-1]
                        return address, seen
            except queue.Empty:
                raise AssertionError(f"no `scheduler ready` within {timeout:.0f} s; announced: {seen}") from None
        raise AssertionError(f"the scheduler stopped before it was ready: {self.error!r}") from self.error

    def stop(self) -> None:
        """Sets its stop (as SIGTERM would): it drains and returns, which it must do with 0."""
        self.stop_event.set()
        self.thread.join(STOP_TIMEOUT_S)
        assert not self.thread.is_alive(), "run_scheduler did not return after its stop was set"
        if self.error is not None:
            raise self.error
        assert self.code == 0, f"run_scheduler returned {self.code}"


@contextlib.contextmanager
def worker_in_process(argv: list[str]):
    """As `specdec worker --host 127.0.0.1 --port 0 ARGV` serves, in this process: yields an InProcessWorker
    (loaded, health NOT_SERVING until a session's InitCache)."""
    args = build_parser().parse_args(["worker", "--host", "127.0.0.1", "--port", "0", *argv])
    config = worker_flags.config_from_args(args, str(models.resolve_model(args.model)), args.num_threads)
    threads_before = torch.get_num_threads()
    try:
        worker = InProcessWorker(config, args.metrics_port, args.step_port)
        try:
            yield worker
        finally:
            worker.stop()
    finally:
        torch.set_num_threads(threads_before)


@contextlib.contextmanager
def serve_in_process(argv: list[str]):
    """As `specdec serve --port 0 ARGV` does, in this process: its workers built from the same flags (one per
    --num-workers, sharing the cores as serve splits them), then the scheduler; yields an InProcessServer.
    On exit the scheduler drains and must return 0, then the workers stop."""
    args = build_parser().parse_args(["serve", "--port", "0", *argv])
    model_dir = str(models.resolve_model(args.model))
    options = scheduler_flags.options_from_args(args, model_dir, ["127.0.0.1:0"], models.model_name(args.model))
    config = worker_flags.config_from_args(args, model_dir, worker_num_threads(args))
    threads_before = torch.get_num_threads()  # build_worker sets torch's (process-wide) thread count
    workers: list[InProcessWorker] = []
    try:
        for index in range(args.num_workers):
            metrics_port = args.worker_metrics_port + index if args.worker_metrics_port else 0
            workers.append(InProcessWorker(config, metrics_port, worker_step_port(args)))
        with _scheduling(replace(options, worker_addresses=tuple(w.address for w in workers)), workers) as server:
            yield server
    finally:
        for worker in workers:
            worker.stop()
        torch.set_num_threads(threads_before)


@contextlib.contextmanager
def scheduler_in_process(argv: list[str]):
    """As `specdec scheduler --port 0 ARGV` serves, in this process, for workers that run elsewhere (processes
    a test kills): yields an InProcessServer; on exit the scheduler drains and must return 0."""
    args = build_parser().parse_args(["scheduler", "--port", "0", *argv])
    model_dir = str(models.resolve_model(args.model))
    options = scheduler_flags.options_from_args(args, model_dir, args.worker, models.model_name(args.model))
    with _scheduling(options, []) as server:
        yield server


@contextlib.contextmanager
def _scheduling(options, workers: list[InProcessWorker]):
    """run_scheduler(options) on a thread and a client to it; stopped (drained) on exit."""
    scheduler = _SchedulerThread(options)
    try:
        address, lines = scheduler.start()
        server = InProcessServer(address, lines, workers)
        try:
            yield server
        finally:
            server.channel.close()
    finally:
        scheduler.stop()
