"""What serving costs beside the model at batch 1: a served decode against the same decode in-process.

    .venv/bin/python bench/bench_overhead.py                       # ~3 min on 2 cores
    .venv/bin/python bench/bench_overhead.py --flags "--proposer none --scheduling sync" --max-tokens 400
    .venv/bin/python bench/bench_overhead.py --versus "--step-transport grpc" --rounds 10   # two servers in turns

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

`--versus FLAGS2` starts a second server, `specdec serve --port 0 FLAGS FLAGS2`, and times it in the same
rounds, the two going first in turns, each server quiet before the other is timed: per round, its TPOT over
the first's (above 1: slower), and the median of those paired ratios, which a drifting machine moves far less
than either server's times.
"""

import argparse
import contextlib
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
SUMMARY_KEYS = (  # of a served round, medians in the summary
    "tpot_ms",
    "scheduler_cpu_ms_per_token",
    "scheduler_switches_per_token",
    "worker_switches_per_token",
    "model_threads_preempted_per_token",
)
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
    rounds, versus_rounds = [], []
    with contextlib.ExitStack() as servers:
        address, server_pid = servers.enter_context(spawned_server(args.flags))
        stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(address))
        stream_timed(stub, chat_request(PROMPT, 16), timeout_s=600)  # warm-up
        pids = [server_pid]
        if args.versus is not None:
            versus_address, versus_pid = servers.enter_context(spawned_server(f"{args.flags} {args.versus}"))
            versus_stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(versus_address))
            stream_timed(versus_stub, chat_request(PROMPT, 16), timeout_s=600)
            pids.append(versus_pid)
        runner = ModelRunner(load_model(path, args.dtype))
        runner.init_cache(-(-(len(prompt) + args.max_tokens) // BLOCK_SIZE), BLOCK_SIZE)
        in_process_round(runner, prompt, 16)  # warm-up
        for i in range(args.rounds):
            # With --versus, the two servers take turns going first: the one timed second ran 2-5% faster here.
            other = None
            if args.versus is not None and i % 2 == 1:
                wait_quiet(pids)
                other = served_round(versus_stub, versus_pid, args.max_tokens)
            wait_quiet(pids)
            served = served_round(stub, server_pid, args.max_tokens)
            if args.versus is not None and other is None:
                wait_quiet(pids)
                other = served_round(versus_stub, versus_pid, args.max_tokens)
            wait_quiet(pids)
            alone = in_process_round(runner, prompt, args.max_tokens)
            ratio = served["tpot_ms"] / alone["ms_per_token"]
            rounds.append({**served, "in_process_ms_per_token": alone["ms_per_token"], "ratio": ratio})
            print(
                f"round {i + 1}: served {served_line(served)}; in-process {alone['ms_per_token']:.2f} ms/token "
                f"({ratio:.2f}x)",
                flush=True,
            )
            if other is not None:
                versus_rounds.append({**other, "versus_ratio": other["tpot_ms"] / served["tpot_ms"]})
                print(
                    f"  versus: {served_line(other)}; {versus_rounds[-1]['versus_ratio']:.3f}x the first's TPOT",
                    flush=True,
                )
    summary = {
        key: statistics.median(r[key] for r in rounds) for key in ("in_process_ms_per_token", "ratio", *SUMMARY_KEYS)
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
    if versus_rounds:
        ratios = [r["versus_ratio"] for r in versus_rounds]
        summary["versus"] = {
            "tpot_ratio": statistics.median(ratios),
            **{
                key: statistics.median(r[key] for r in versus_rounds) for key in SUMMARY_KEYS if key in versus_rounds[0]
            },
        }
        v = summary["versus"]
        print(
            f"  `specdec serve {args.flags} {args.versus}`: its TPOT {v['tpot_ratio']:.3f}x the first's (median of "
            f"{len(ratios)} paired rounds, {min(ratios):.3f}-{max(ratios):.3f}); {v['tpot_ms']:.2f} ms/token, the "
            f"scheduler {v['scheduler_cpu_ms_per_token']:.2f} CPU-ms per token; context switches per token: "
            f"scheduler {v['scheduler_switches_per_token']:.1f}, worker {v['worker_switches_per_token']:.1f}, the "
            f"model's two threads preempted {v['model_threads_preempted_per_token']:.1f}"
        )
    save(
        "overhead",
        {"args": vars(args), "cpu": cpu_name(), "rounds": rounds, "versus_rounds": versus_rounds, "summary": summary},
    )


def served_line(served: dict) -> str:
    return (
        f"{served['tpot_ms']:.2f} ms/token; CPU per token: scheduler {served['scheduler_cpu_ms_per_token']:.2f} ms, "
        f"worker threads {', '.join(f'{v:.2f}' for v in served['worker_threads_cpu_ms_per_token'])} ms; context "
        f"switches per token: scheduler {served['scheduler_switches_per_token']:.1f}, worker "
        f"{served['worker_switches_per_token']:.1f} (the model's two threads preempted "
        f"{served['model_threads_preempted_per_token']:.1f})"
    )


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
    parser.add_argument(
        "--versus",
        default=None,
        metavar="FLAGS2",
        help='also time `specdec serve FLAGS FLAGS2` in the same rounds, in turns (e.g. "--step-transport grpc")',
    )
    main(parser.parse_args())
