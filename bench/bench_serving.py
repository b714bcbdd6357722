"""Serving benchmark: streamed chat requests at several concurrency levels against a specdec server over gRPC.

Against a running server:

    .venv/bin/python bench/bench_serving.py --address 127.0.0.1:50051 [--concurrency 1,4,16] [--max-tokens 64]

Or start `specdec serve --port 0 FLAGS` for each --spawn and compare the configurations in one run, all
servers up at once and their levels interleaved (--rounds R: each level R times, the order of the servers
reversed every other round):

    .venv/bin/python bench/bench_serving.py --concurrency 1,4,8,16 --max-tokens 64 \\
        --spawn "--proposer none --scheduling sync" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --scheduling sync" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --scheduling async" \\
        --spawn "--proposer ngram --num-speculative-tokens 4 --speculative-disable-queue-size 4 --scheduling async"

FLAGS pass through as they are (e.g. "--num-kv-blocks 256 --max-num-seqs 8"). Each level sends --num-requests
(default 2 x concurrency, at least 4) Spec-Bench first turns, cycling over categories (each level and round on
prompts no earlier one sent, the same to every server), greedy with ignore_eos so that every request emits
--max-tokens tokens, with at most `concurrency` in flight. Per level it reports throughput, TTFT and TPOT
percentiles, and from the server's counters (deltas over the level) the acceptance rate, tokens per
sequence-step, steps with speculation disabled, the worker's idle share and the CPU seconds the other servers
used meanwhile (idle servers: about 0). Then, per level, each configuration's throughput (over all rounds)
relative to the first. Results are saved in bench/results/serving-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import logging
import math
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import load_questions, process_tree_cpu_s, save, wait_quiet  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from tests.processes import running  # noqa: E402

logger = logging.getLogger("bench.serving")
SPAWNED: set[int] = set()  # the pids of the servers spawned_server has up, which wait_idle waits on


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
    """Waits until no request runs and every KV block is free, and until every server spawned here uses no CPU
    (bench.common.wait_quiet: a server works on for a moment after its last answer); returns the last info
    either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        is_idle = info.num_running == 0 and info.num_waiting == 0 and info.num_free_kv_blocks == info.num_kv_blocks
        if is_idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    wait_quiet(list(SPAWNED), timeout_s=max(deadline - time.monotonic(), 0.0))
    return info


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


def describe(stub, label: str) -> dict:
    """The server's configuration (logged), after one warm-up request."""
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
    return {
        "proposer": info.proposer,
        "num_speculative_tokens": info.num_speculative_tokens,
        "scheduling": info.scheduling,
        "speculative_disable_queue_size": info.speculative_disable_queue_size,
        "num_kv_blocks": info.num_kv_blocks,
        "max_num_seqs": info.max_num_seqs,
        "model": info.model,
    }


def run_all(servers: list[tuple[str, str, int | None]], prompts: list[str], args) -> list[dict]:
    """Every configuration (label, address, pid or None), all up at once, interleaved: per round and level each
    server in turn (the order reversed every other round), so a busier minute of the machine falls on all of
    them. Each level records the CPU seconds the other spawned servers used meanwhile (idle: about 0).

    Each (round, level) sends prompts no earlier one sent, the same to every server: a suffix cache outlives
    requests, and would draft an earlier level's answers."""
    channels = [grpc.insecure_channel(address) for _, address, _ in servers]
    try:
        stubs = [generation_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
        configs = [
            {"label": label, "server": describe(stub, label), "rounds": []}
            for (label, _, _), stub in zip(servers, stubs)
        ]
        for stub in stubs:
            stream_timed(stub, chat_request(prompts[0], 8), args.request_timeout)  # warm-up
        first = 1
        for r in range(args.rounds):
            order = list(range(len(servers)))[:: 1 if r % 2 == 0 else -1]
            levels: list[list[dict]] = [[] for _ in servers]
            for concurrency, num_requests in zip(args.concurrency, level_sizes(args)):
                rotated = prompts[first:] + prompts[:first]
                for i in order:
                    logger.info("round %d/%d, %s", r + 1, args.rounds, configs[i]["label"])
                    others = [pid for j, (_, _, pid) in enumerate(servers) if j != i and pid is not None]
                    before = sum(map(process_tree_cpu_s, others))
                    level = run_level(stubs[i], rotated, concurrency, num_requests, args)
                    level["idle_servers_cpu_s"] = sum(map(process_tree_cpu_s, others)) - before
                    levels[i].append(level)
                first = (first + num_requests) % len(prompts)
            for config, config_levels in zip(configs, levels):
                config["rounds"].append(config_levels)
        for config in configs:
            config["levels"] = [merge_rounds(per_round) for per_round in zip(*config["rounds"])]
        return configs
    finally:
        for channel in channels:
            channel.close()


def merge_rounds(levels: tuple[dict, ...]) -> dict:
    """One level over every round: the first round's figures, with throughput taken over all rounds (total
    tokens / total wall time) and each round's throughput kept."""
    merged = dict(levels[0])
    wall_s = sum(lv["wall_s"] for lv in levels)
    tokens = sum(lv["num_completion_tokens"] for lv in levels)
    merged.update(
        wall_s=wall_s,
        num_completion_tokens=tokens,
        throughput_tok_s=tokens / wall_s,
        round_throughputs_tok_s=[lv["throughput_tok_s"] for lv in levels],
        num_errors=sum(lv["num_errors"] for lv in levels),
        idle_servers_cpu_s=sum(lv["idle_servers_cpu_s"] for lv in levels),
    )
    return merged


@contextlib.contextmanager
def spawned(flags: str):
    """`specdec serve --port 0 FLAGS`, once it is ready: yields its address."""
    with spawned_server(flags) as (address, _):
        yield address


@contextlib.contextmanager
def spawned_server(flags: str):
    """`specdec serve --port 0 FLAGS`, once it is ready: yields (its address, its pid)."""
    with running(["serve", "--port", "0", *shlex.split(flags)]) as process:
        address = process.address(who="scheduler ")
        process.wait_for("scheduler ready")
        SPAWNED.add(process.proc.pid)
        try:
            yield address, process.proc.pid
        finally:
            SPAWNED.discard(process.proc.pid)
            if process.proc.poll() is not None:
                logger.error(
                    "server exited with %s; last output:\n%s", process.proc.poll(), "\n".join(process.lines[-20:])
                )


def fmt(value, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(config: dict) -> None:
    print(f"\n{config['label'] or '(defaults)'}")
    print(
        f"{'conc':>4} {'reqs':>4} {'err':>3} {'tok/s':>7} {'TTFT p50':>9} {'p90':>9} {'TPOT p50':>9} {'p90':>9} "
        f"{'accept':>6} {'tok/seq-step':>12} {'no-spec/steps':>13} {'idle':>5} {'others CPU':>10}  per round tok/s"
    )
    for lv in config["levels"]:
        print(
            f"{lv['concurrency']:>4} {lv['num_requests']:>4} {lv['num_errors']:>3} {lv['throughput_tok_s']:>7.1f} "
            f"{fmt(lv['ttft_p50_s'], 1e3):>7}ms {fmt(lv['ttft_p90_s'], 1e3):>7}ms "
            f"{fmt(lv['tpot_p50_s'], 1e3):>7}ms {fmt(lv['tpot_p90_s'], 1e3):>7}ms "
            f"{fmt(lv['acceptance_rate'], 1, '.2f'):>6} {fmt(lv['tokens_per_sequence_step'], 1, '.2f'):>12} "
            f"{lv['num_steps_speculation_disabled']:>6}/{lv['num_steps']:<6} "
            f"{fmt(lv['worker_idle_share'], 1, '.0%'):>5} {lv['idle_servers_cpu_s']:>9.1f}s  "
            + " ".join(f"{t:.1f}" for t in lv["round_throughputs_tok_s"])
        )
    print("(TTFT, TPOT and the counters: the first round; tok/s: all rounds)")


def comparison(configs: list[dict]) -> dict[str, list[list[float]]]:
    """Per level (concurrency), each configuration's throughput over the first configuration's in each round
    (the two ran next to each other, so a slower minute of the machine falls on both)."""
    base = configs[0]["levels"]
    return {
        str(lv["concurrency"]): [
            [t / b for t, b in zip(c["levels"][i]["round_throughputs_tok_s"], lv["round_throughputs_tok_s"])]
            for c in configs
        ]
        for i, lv in enumerate(base)
    }


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def print_comparison(configs: list[dict], ratios: dict[str, list[list[float]]]) -> None:
    print(f"\nthroughput vs [1] {configs[0]['label']}: geometric mean over rounds (lowest..highest round)")
    for i, c in enumerate(configs, 1):
        print(f"  [{i}] {c['label'] or '(defaults)'}")
    print("conc " + " ".join(f"{f'[{i}]':>17}" for i in range(1, len(configs) + 1)))
    for concurrency, row in ratios.items():
        cells = [f"{geomean(r):.2f}x ({min(r):.2f}..{max(r):.2f})" for r in row]
        print(f"{concurrency:>4} " + " ".join(f"{cell:>17}" for cell in cells))


def main(args) -> None:
    prompts = interleaved_prompts()
    servers = [(args.address, args.address, None)] if args.address else []
    with contextlib.ExitStack() as stack:
        for flags in args.spawn or []:
            logger.info("starting specdec serve %s", flags)
            try:
                address, pid = stack.enter_context(spawned_server(flags))
            except AssertionError as exc:  # a server that fails to start: go on without it
                logger.error("configuration %r failed to start: %s", flags, exc)
                continue
            servers.append((flags, address, pid))
        configs = run_all(servers, prompts, args) if servers else []
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
            "rounds": args.rounds,
            "configs": configs,
            "throughput_vs_first": {level: [geomean(r) for r in row] for level, row in ratios.items()},
            "throughput_vs_first_by_round": ratios,
        },
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="HOST:PORT of a running server")
    parser.add_argument("--spawn", action="append", metavar="FLAGS", help="start `specdec serve --port 0 FLAGS`")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default: 2 x concurrency, >= 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="times each level runs per configuration, interleaved")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse_args(argv)
    if not args.address and not args.spawn:
        parser.error("give --address or at least one --spawn")
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(parse_args())
