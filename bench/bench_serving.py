"""Serving benchmark: streamed chat requests at several concurrency levels against a specdec server over gRPC.

Against a running server:

    .venv/bin/python bench/bench_serving.py --address 127.0.0.1:50051 [--concurrency 1,4,16] [--max-tokens 64]

Or start `specdec serve --port 0 FLAGS` for each --spawn and compare the configurations in one run:

    .venv/bin/python bench/bench_serving.py --concurrency 1,4,8,16 --max-tokens 64 \\
        --spawn "--proposer none --scheduling sync" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --scheduling sync" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --scheduling async" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --speculative-disable-queue-size 4 --scheduling async"

FLAGS pass through as they are (e.g. "--num-kv-blocks 256 --max-num-seqs 8"). Each level sends --num-requests
(default 2 x concurrency, at least 4) Spec-Bench first turns, cycling over categories (each level on
prompts no earlier level sent), greedy with ignore_eos so that every request emits --max-tokens tokens,
with at most `concurrency` in flight. Per level it reports
throughput, TTFT and TPOT percentiles, and from the server's counters (deltas over the level) the acceptance
rate, tokens per sequence-step, steps with speculation disabled and the worker's idle share. Then, per level,
each configuration's throughput relative to the first. Results are saved in bench/results/serving-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import logging
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import load_questions, save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from tests.processes import running  # noqa: E402

logger = logging.getLogger("bench.serving")


def interleaved_prompts() -> list[str]:
    """First turns of the Spec-Bench questions, round-robin over categories so any prefix is a mix."""
    by_category: dict[str, list[str]] = {}
    for row in load_questions():
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    columns = list(by_category.values())
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]


def chat_request(text: str, max_tokens: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    request.messages.add(role="user", content=text)
    return request


def stream_timed(stub, request: pb.GenerateRequest, timeout_s: float) -> dict:
    """Streams one request; its token count, TTFT and TPOT (None where undefined), or its error."""
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    try:
        for response in stub.Generate(request, timeout=timeout_s):
            if response.token_ids:
                last = time.perf_counter()
                first = first or last
                num_tokens += len(response.token_ids)
    except grpc.RpcError as exc:
        logger.error("request failed: %s: %s", exc.code().name, exc.details())
        return {"num_tokens": num_tokens, "error": f"{exc.code().name}: {exc.details()}"}
    return {
        "num_tokens": num_tokens,
        "ttft_s": None if first is None else first - start,
        "tpot_s": (last - first) / (num_tokens - 1) if num_tokens > 1 else None,
    }


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def counter_deltas(before: pb.Counters, after: pb.Counters) -> dict:
    """Speculation and utilisation figures over the interval between two counter snapshots."""

    def sequence_steps(c: pb.Counters) -> float:  # the server reports emitted / sequence-steps
        return c.num_emitted_tokens / c.mean_accepted_length if c.mean_accepted_length else 0.0

    drafted = after.num_drafted_tokens - before.num_drafted_tokens
    emitted = after.num_emitted_tokens - before.num_emitted_tokens
    num_sequence_steps = sequence_steps(after) - sequence_steps(before)
    active_s = after.active_wall_seconds - before.active_wall_seconds
    busy_s = after.worker_busy_seconds - before.worker_busy_seconds
    return {
        "num_drafted": drafted,
        "num_accepted": after.num_accepted_tokens - before.num_accepted_tokens,
        "acceptance_rate": (after.num_accepted_tokens - before.num_accepted_tokens) / drafted if drafted else None,
        "tokens_per_sequence_step": emitted / num_sequence_steps if num_sequence_steps > 0 else None,
        "num_steps": after.num_steps - before.num_steps,
        "num_steps_speculation_disabled": after.num_steps_speculation_disabled - before.num_steps_speculation_disabled,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "worker_busy_s": busy_s,
        "active_wall_s": active_s,
        "worker_idle_share": 1 - busy_s / active_s if active_s > 0 else None,
    }


def wait_idle(stub, timeout_s: float = 60.0) -> pb.GetServerInfoResponse:
    """Waits until no request runs and every KV block is free; returns the last info either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        is_idle = info.num_running == 0 and info.num_waiting == 0 and info.num_free_kv_blocks == info.num_kv_blocks
        if is_idle or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def level_sizes(args) -> list[int]:
    """Requests per concurrency level."""
    return [args.num_requests or max(2 * c, 4) for c in args.concurrency]


def run_level(stub, prompts: list[str], concurrency: int, num_requests: int, args) -> dict:
    """One concurrency level: its requests, timings and counter deltas."""
    requests = [chat_request(prompts[i % len(prompts)], args.max_tokens) for i in range(num_requests)]
    before = wait_idle(stub).counters
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: stream_timed(stub, r, args.request_timeout), requests))
    wall_s = time.perf_counter() - start
    info = wait_idle(stub)
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    num_tokens = sum(r["num_tokens"] for r in results)
    level = {
        "concurrency": concurrency,
        "num_requests": num_requests,
        "num_errors": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r}),
        "wall_s": wall_s,
        "num_completion_tokens": num_tokens,
        "throughput_tok_s": num_tokens / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p90_s": percentile(tpots, 90),
        **counter_deltas(before, info.counters),
        "after": {
            "num_running": info.num_running,
            "num_waiting": info.num_waiting,
            "num_free_kv_blocks": info.num_free_kv_blocks,
            "num_kv_blocks": info.num_kv_blocks,
        },
    }
    if info.num_running or info.num_waiting or info.num_free_kv_blocks != info.num_kv_blocks:
        logger.error("server not idle 60 s after the load: %s", level["after"])
    logger.info("concurrency %d: %.1f tok/s, %d errors", concurrency, level["throughput_tok_s"], level["num_errors"])
    return level


def run_config(address: str, label: str, prompts: list[str], args) -> dict:
    """Warm-up, then every concurrency level, against the server at `address`."""
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        logger.info(
            "%s: proposer %s, k=%d, %s, disable queue size %d, %d KV blocks, max %d seqs",
            label,
            info.proposer,
            info.num_speculative_tokens,
            info.scheduling,
            info.speculative_disable_queue_size,
            info.num_kv_blocks,
            info.max_num_seqs,
        )
        stream_timed(stub, chat_request(prompts[0], 8), args.request_timeout)  # warm-up
        # Each level takes prompts no level before it sent: a suffix cache outlives requests, and would draft
        # an earlier level's answers to them.
        levels, first = [], 1
        for concurrency, num_requests in zip(args.concurrency, level_sizes(args)):
            levels.append(run_level(stub, prompts[first:] + prompts[:first], concurrency, num_requests, args))
            first = (first + num_requests) % len(prompts)
    server = {
        "proposer": info.proposer,
        "num_speculative_tokens": info.num_speculative_tokens,
        "scheduling": info.scheduling,
        "speculative_disable_queue_size": info.speculative_disable_queue_size,
        "num_kv_blocks": info.num_kv_blocks,
        "max_num_seqs": info.max_num_seqs,
        "model": info.model,
    }
    return {"label": label, "server": server, "levels": levels}


@contextlib.contextmanager
def spawned(flags: str):
    """`specdec serve --port 0 FLAGS`, once it is ready: yields its address."""
    with running(["serve", "--port", "0", *shlex.split(flags)]) as process:
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")
        try:
            yield address
        finally:
            if process.proc.poll() is not None:
                logger.error(
                    "server exited with %s; last output:\n%s", process.proc.poll(), "\n".join(process.lines[-20:])
                )


def fmt(value, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(config: dict) -> None:
    print(f"\n{config['label']}")
    print(
        f"{'conc':>4} {'reqs':>4} {'err':>3} {'tok/s':>7} {'TTFT p50':>9} {'p90':>9} {'TPOT p50':>9} {'p90':>9} "
        f"{'accept':>6} {'tok/seq-step':>12} {'no-spec/steps':>13} {'idle':>5}"
    )
    for lv in config["levels"]:
        print(
            f"{lv['concurrency']:>4} {lv['num_requests']:>4} {lv['num_errors']:>3} {lv['throughput_tok_s']:>7.1f} "
            f"{fmt(lv['ttft_p50_s'], 1e3):>7}ms {fmt(lv['ttft_p90_s'], 1e3):>7}ms "
            f"{fmt(lv['tpot_p50_s'], 1e3):>7}ms {fmt(lv['tpot_p90_s'], 1e3):>7}ms "
            f"{fmt(lv['acceptance_rate'], 1, '.2f'):>6} {fmt(lv['tokens_per_sequence_step'], 1, '.2f'):>12} "
            f"{lv['num_steps_speculation_disabled']:>6}/{lv['num_steps']:<6} "
            f"{fmt(lv['worker_idle_share'], 1, '.0%'):>5}"
        )


def comparison(configs: list[dict]) -> dict[str, list[float]]:
    """Per level (concurrency), each configuration's throughput over the first configuration's."""
    base = configs[0]["levels"]
    return {
        str(lv["concurrency"]): [c["levels"][i]["throughput_tok_s"] / lv["throughput_tok_s"] for c in configs]
        for i, lv in enumerate(base)
    }


def print_comparison(configs: list[dict], ratios: dict[str, list[float]]) -> None:
    print(f"\nthroughput vs [1] {configs[0]['label']}")
    for i, c in enumerate(configs, 1):
        print(f"  [{i}] {c['label']}")
    print("conc " + " ".join(f"{f'[{i}]':>6}" for i in range(1, len(configs) + 1)))
    for concurrency, row in ratios.items():
        print(f"{concurrency:>4} " + " ".join(f"{r:>5.2f}x" for r in row))


def main(args) -> None:
    prompts = interleaved_prompts()
    configs = []
    if args.address:
        configs.append(run_config(args.address, args.address, prompts, args))
    for flags in args.spawn or []:
        logger.info("starting specdec serve %s", flags)
        try:
            with spawned(flags) as address:
                configs.append(run_config(address, flags, prompts, args))
        except (AssertionError, grpc.RpcError) as exc:  # a server that fails to start or to answer: go on
            logger.error("configuration %r failed: %s", flags, exc)
    if not configs:
        sys.exit("no configuration completed")
    for config in configs:
        print_table(config)
    ratios = comparison(configs)
    if len(configs) > 1:
        print_comparison(configs, ratios)
    save(
        "serving",
        {
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "configs": configs,
            "throughput_vs_first": ratios,
        },
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="HOST:PORT of a running server")
    parser.add_argument("--spawn", action="append", metavar="FLAGS", help="start `specdec serve --port 0 FLAGS`")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default: 2 x concurrency, >= 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse_args(argv)
    if not args.address and not args.spawn:
        parser.error("give --address or at least one --spawn")
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(parse_args())
