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
other thread, which spins between the step's kernels, then the gRPC threads). Prints the CPU's model name;
saves JSON under bench/results/.
"""

import argparse
import logging
import os
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
from bench.common import chat_ids, process_tree, save, wait_quiet  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402

BLOCK_SIZE = 16
PROMPT = "Write a long story about a dragon who learns to read."


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of `pid`, by thread id."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def served_round(stub, server_pid: int, max_tokens: int) -> dict:
    """One timed request; its TPOT and the CPU per token of the scheduler and of the worker's threads."""
    worker_pid = next(p for p in process_tree(server_pid) if p != server_pid)
    before = {pid: thread_cpu_s(pid) for pid in (server_pid, worker_pid)}
    result = stream_timed(stub, chat_request(PROMPT, max_tokens), timeout_s=600)
    used = {}
    for pid, start in before.items():
        now = thread_cpu_s(pid)
        used[pid] = sorted((now[t] - start.get(t, 0.0) for t in now), reverse=True)
    n = result["num_tokens"]
    worker = used[worker_pid]
    return {
        "tpot_ms": result["tpot_s"] * 1e3,
        "num_tokens": n,
        "scheduler_cpu_ms_per_token": sum(used[server_pid]) / n * 1e3,
        "worker_threads_cpu_ms_per_token": [s / n * 1e3 for s in worker[:2]] + [sum(worker[2:]) / n * 1e3],
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
                f" threads {', '.join(f'{v:.2f}' for v in served['worker_threads_cpu_ms_per_token'])} ms",
                flush=True,
            )
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("tpot_ms", "in_process_ms_per_token", "ratio", "scheduler_cpu_ms_per_token")
    }
    print(
        f"\n{cpu_name()}, {torch.get_num_threads()} threads in-process; `specdec serve {args.flags}`; "
        f"{args.max_tokens} tokens after a {len(prompt)}-token prompt; medians of {args.rounds} rounds:\n"
        f"  served {summary['tpot_ms']:.2f} ms/token, in-process {summary['in_process_ms_per_token']:.2f} "
        f"ms/token: {summary['ratio']:.2f}x; the scheduler process took "
        f"{summary['scheduler_cpu_ms_per_token']:.2f} CPU-ms per token"
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
