"""What serving costs beside the model at batch 1: a served decode against the same decode in-process.

    .venv/bin/python bench/bench_overhead.py                       # ~3 min on 2 cores
    .venv/bin/python bench/bench_overhead.py --flags "--proposer none --scheduling sync" --max-tokens 400

Starts `specdec serve --port 0 FLAGS` (default: plain decoding, the default dtype) and loads the same model
in this process. Each round, in turns: one greedy request of --max-tokens tokens (ignore_eos) to the server
over gRPC, its decode phase timed per token (TPOT: first to last streamed token); then the same prompt decoded
in-process by the worker's ModelRunner (a forward of one row and an argmax per token). Both on the same
machine minute, so the ratio served / in-process is what the server adds per token: the worker's step
protocol and sampling, the scheduler, gRPC both ways, the detokenizer, and their threads taking the CPU from
the model's OpenMP team. The server is quiet (`wait_quiet`) before each in-process round, and the process
running the in-process decode is idle while the server is timed.

Also the CPU each process took per token during the served decode (Linux /proc): the scheduler process
(`specdec serve`), and the worker's threads, busiest first (the compute thread, then the OpenMP team's
other thread, which spins between the step's kernels, then the gRPC threads), and the context switches per
token: each process's, and how often the model's two threads were preempted. Prints the CPU's model name;
saves JSON under bench/results/. `bench/bench_transport.py` measures the step stream alone, without a model.
"""

import argparse
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.bench_linear import cpu_name  # noqa: E402
from bench.bench_serving import chat_request, spawned_server, stream_timed  # noqa: E402
from bench.common import chat_ids, process_tree, save, thread_counters, wait_quiet  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402

BLOCK_SIZE = 16
PROMPT = "Write a long story about a dragon who learns to read."


def served_round(stub, server_pid: int, max_tokens: int) -> dict:
    """One timed request; its TPOT, and per token the CPU and context switches of the scheduler and of the
    worker's threads."""
    worker_pid = next(p for p in process_tree(server_pid) if p != server_pid)
    before = {pid: thread_counters(pid) for pid in (server_pid, worker_pid)}
    result = stream_timed(stub, chat_request(PROMPT, max_tokens), timeout_s=600)
    used, zero = {}, (0.0, 0, 0)
    for pid, start in before.items():
        now = thread_counters(pid)
        # per thread: (CPU s, voluntary, involuntary switches) during the request, busiest thread first
        used[pid] = sorted((tuple(a - b for a, b in zip(now[t], start.get(t, zero))) for t in now), key=lambda c: -c[0])
    n = result["num_tokens"]
    scheduler, worker = used[server_pid], used[worker_pid]
    return {
        "tpot_ms": result["tpot_s"] * 1e3,
        "num_tokens": n,
        "scheduler_cpu_ms_per_token": sum(c[0] for c in scheduler) / n * 1e3,
        "worker_threads_cpu_ms_per_token": [c[0] / n * 1e3 for c in worker[:2]]
        + [sum(c[0] for c in worker[2:]) / n * 1e3],
        "scheduler_switches_per_token": sum(c[1] + c[2] for c in scheduler) / n,
        "worker_switches_per_token": sum(c[1] + c[2] for c in worker) / n,
        # the model's OpenMP team (the compute thread and its partner) preempted by other threads
        "model_threads_preempted_per_token": sum(c[2] for c in worker[:2]) / n,
    }


def in_process_round(runner: ModelRunner, prompt: list[int], max_tokens: int) -> dict:
    """The same greedy decode by the runner alone: ms per token over the decode steps (the prefill untimed)."""
    table = list(range(-(-(len(prompt) + max_tokens) // BLOCK_SIZE)))
    token = int(runner.forward([SequenceChunk(prompt, 0, table, num_logits=1)]).argmax(-1))
    start = time.perf_counter()
    for position in range(len(prompt), len(prompt) + max_tokens - 1):
        token = int(runner.forward([SequenceChunk([token], position, table)]).argmax(-1))
    return {"ms_per_token": (time.perf_counter() - start) / (max_tokens - 1) * 1e3}


def main(args) -> None:
    path = fetch_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = chat_ids(tokenizer, PROMPT)
    rounds = []
    with spawned_server(args.flags) as (address, server_pid):
        stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(address))
        runner = ModelRunner(load_model(path, args.dtype))
        runner.init_cache(-(-(len(prompt) + args.max_tokens) // BLOCK_SIZE), BLOCK_SIZE)
        in_process_round(runner, prompt, 16)  # warm-up
        stream_timed(stub, chat_request(PROMPT, 16), timeout_s=600)
        for i in range(args.rounds):
            wait_quiet([server_pid])
            served = served_round(stub, server_pid, args.max_tokens)
            wait_quiet([server_pid])
            alone = in_process_round(runner, prompt, args.max_tokens)
            ratio = served["tpot_ms"] / alone["ms_per_token"]
            rounds.append({**served, "in_process_ms_per_token": alone["ms_per_token"], "ratio": ratio})
            print(
                f"round {i + 1}: served {served['tpot_ms']:.2f} ms/token, in-process {alone['ms_per_token']:.2f}"
                f" ({ratio:.2f}x); CPU per token: scheduler {served['scheduler_cpu_ms_per_token']:.2f} ms, worker"
                f" threads {', '.join(f'{v:.2f}' for v in served['worker_threads_cpu_ms_per_token'])} ms; context"
                f" switches per token: scheduler {served['scheduler_switches_per_token']:.1f}, worker"
                f" {served['worker_switches_per_token']:.1f} (the model's two threads preempted"
                f" {served['model_threads_preempted_per_token']:.1f})",
                flush=True,
            )
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in (
            "tpot_ms",
            "in_process_ms_per_token",
            "ratio",
            "scheduler_cpu_ms_per_token",
            "scheduler_switches_per_token",
            "worker_switches_per_token",
            "model_threads_preempted_per_token",
        )
    }
    print(
        f"\n{cpu_name()}, {torch.get_num_threads()} threads in-process; `specdec serve {args.flags}`; "
        f"{args.max_tokens} tokens after a {len(prompt)}-token prompt; medians of {args.rounds} rounds:\n"
        f"  served {summary['tpot_ms']:.2f} ms/token, in-process {summary['in_process_ms_per_token']:.2f} "
        f"ms/token: {summary['ratio']:.2f}x; the scheduler process took "
        f"{summary['scheduler_cpu_ms_per_token']:.2f} CPU-ms per token; context switches per token: scheduler "
        f"{summary['scheduler_switches_per_token']:.1f}, worker {summary['worker_switches_per_token']:.1f}, of which "
        f"the model's two threads preempted {summary['model_threads_preempted_per_token']:.1f}"
    )
    save("overhead", {"args": vars(args), "cpu": cpu_name(), "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="--proposer none", help="`specdec serve` flags (default: plain decoding)")
    parser.add_argument(
        "--dtype",
        default="q4_1",
        help="the in-process model's dtype, the server's (its default: q4_1 for the default model)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    main(parser.parse_args())
