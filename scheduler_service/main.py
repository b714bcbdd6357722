"""The scheduler process: connect to the worker, allocate its KV cache, serve the client API."""

from dataclasses import dataclass
import logging
import signal
import threading
import time

import grpc

from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import Engine
from scheduler_service.scheduler import Scheduler
from scheduler_service.server import ModelFacts, create_server, set_serving
from scheduler_service.tokenizer import ChatTokenizer
from scheduler_service.worker_client import WorkerClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerOptions:
    """Scheduler flags before the worker's facts are known (None = derive from the worker)."""

    model_dir: str
    worker_address: str
    host: str = "127.0.0.1"
    port: int = 50051
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_speculative_tokens: int | None = None
    speculative_disable_queue_size: int | None = None
    scheduling: str = "async"
    worker_timeout_s: float = 600.0


def wait_for_worker(client: WorkerClient, block_size: int, timeout_s: float):
    """Describe, retried while the worker is starting or loading its model."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.describe(block_size, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def scheduler_config(opts: SchedulerOptions, info) -> SchedulerConfig:
    max_model_len = min(opts.max_model_len or info.max_model_len, info.max_model_len)
    num_kv_blocks = opts.num_kv_blocks or min(info.num_blocks_capacity, 4096)
    k = info.max_num_speculative_tokens if opts.num_speculative_tokens is None else opts.num_speculative_tokens
    if k > info.max_num_speculative_tokens:
        raise ValueError(f"--num-speculative-tokens {k} exceeds the worker's k ({info.max_num_speculative_tokens})")
    return SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=opts.block_size, max_num_seqs=opts.max_num_seqs,
                           max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=max_model_len,
                           num_speculative_tokens=k if info.proposer != "none" else 0,
                           speculative_disable_queue_size=opts.speculative_disable_queue_size,
                           scheduling=opts.scheduling)


def run_scheduler(opts: SchedulerOptions, stop: threading.Event | None = None) -> int:
    """Serves until SIGTERM/SIGINT (or `stop`). Prints `scheduler listening on HOST:PORT` once bound."""
    stop = stop or threading.Event()
    server, servicer, health_servicer, port = create_server(opts.host, opts.port)
    print(f"scheduler listening on {opts.host}:{port}", flush=True)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    client = WorkerClient(opts.worker_address)
    try:
        info = wait_for_worker(client, opts.block_size, opts.worker_timeout_s)
        config = scheduler_config(opts, info)
        client.init_cache(config.num_kv_blocks, config.block_size)
        tokenizer = ChatTokenizer(opts.model_dir)
    except Exception:
        server.stop(grace=None)
        raise
    engine = Engine(lambda stats: Scheduler(config, tokenizer, stats), client)
    engine.start()
    servicer.attach(engine, tokenizer, ModelFacts(info.model_id, info.vocab_size, list(info.eos_token_ids),
                                                  info.proposer))
    set_serving(health_servicer)
    logger.info("serving %s: %d KV blocks of %d tokens, k=%d, %s scheduling", info.model_id,
                config.num_kv_blocks, config.block_size, config.num_speculative_tokens, config.scheduling)
    print("scheduler ready", flush=True)
    while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    server.stop(grace=5).wait()
    engine.stop()
    client.close()
    return 0
