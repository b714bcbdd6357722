"""Prefix caching benchmark: caching on vs off, side by side, on the default model (`specdec serve`).

    .venv/bin/python bench/bench_prefix_cache.py [--proposers none,ngram,suffix] [--parts multiturn,shared,routing]

For each proposer, two servers (`--enable-prefix-caching` and `--no-enable-prefix-caching`) run the same
workloads, one server at a time:

- multiturn: the MT-Bench questions of Spec-Bench (`--questions-per-category` of each of its 8 categories),
  one conversation at a time: turn 1, then turn 2 with turn 1's answer in the history. Reports turn 2's
  time to first token (p50, p99): with caching, turn 1's prompt and answer are not computed again.
- shared: `--num-requests` chat requests that share one `--system-tokens`-token system prompt (a synthetic
  document) and differ in their question (Spec-Bench first turns), at `--concurrency`. Reports output
  throughput and TTFT (p50, p99).

Every request is greedy, so the outputs with and without caching must be the same token for token: the
script checks it and reports mismatches. Then (`routing`) `serve --num-workers 2` with caching, cache-aware
routing vs `--routing least-loaded`, on a shared workload whose requests take one of `--num-tenants`
system prompts: prefix cache hit rate and TTFT. Results go to bench/results/prefix-cache-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import logging
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.bench_serving import percentile, spawned, wait_idle  # noqa: E402
from bench.common import load_questions, save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402

logger = logging.getLogger("bench.prefix_cache")

MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
PROPOSER_FLAGS = {
    "none": "--proposer none",
    "ngram": "--proposer ngram --num-speculative-tokens 4",
    "suffix": "--proposer suffix --num-speculative-tokens 8",
}


def system_prompt(num_tokens: int, tenant: int = 0) -> str:
    """A synthetic policy document of about `num_tokens` tokens (~1.3 tokens a word); tenants differ at once."""
    rules = [
        "Answer in plain language and keep to the facts the user gives.",
        "When a question is ambiguous, say which reading you answer.",
        "Cite the section of this handbook a rule comes from.",
        "Never invent prices, dates or names that the user did not mention.",
        "Prefer short paragraphs; use a list only for steps that happen in order.",
    ]
    lines = [f"You are assistant number {tenant} of the help desk. Handbook, edition {tenant}:"]
    while len(" ".join(lines).split()) * 1.3 < num_tokens:
        i = len(lines)
        lines.append(f"Section {tenant}.{i}: {rules[i % len(rules)]} (rule {i} applies to every reply)")
    return "\n".join(lines)


def chat(messages: list[tuple[str, str]], max_tokens: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for role, content in messages:
        request.messages.add(role=role, content=content)
    return request


def stream(stub, request: pb.GenerateRequest) -> dict:
    """One request: its tokens, text, TTFT, end time and usage."""
    start = time.perf_counter()
    first, tokens, text, usage = None, [], [], None
    for response in stub.Generate(request, timeout=600):
        if response.token_ids and first is None:
            first = time.perf_counter()
        tokens += response.token_ids
        text.append(response.text)
        if response.HasField("usage"):
            usage = response.usage
    return {
        "tokens": tokens,
        "text": "".join(text),
        "ttft_s": first - start,
        "end_s": time.perf_counter(),
        "start_s": start,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_prompt_tokens,
    }


def multiturn(stub, args) -> dict:
    rows = load_questions(categories=MT_BENCH_CATEGORIES, per_category=args.questions_per_category)
    turn2 = []
    for row in rows:
        first = stream(stub, chat([("user", row["turns"][0])], args.turn1_max_tokens))
        messages = [("user", row["turns"][0]), ("assistant", first["text"]), ("user", row["turns"][1])]
        turn2.append(stream(stub, chat(messages, args.max_tokens)))
    ttfts = [r["ttft_s"] for r in turn2]
    return {
        "num_conversations": len(rows),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in turn2) / len(turn2),
        "mean_cached_tokens": sum(r["cached_tokens"] for r in turn2) / len(turn2),
        "outputs": [r["tokens"] for r in turn2],
    }


def shared_requests(args, num_tenants: int = 1) -> list[pb.GenerateRequest]:
    questions = [r["turns"][0] for r in load_questions(categories=["qa", "writing", "reasoning", "stem"])]
    systems = [system_prompt(args.system_tokens, tenant) for tenant in range(num_tenants)]
    return [
        chat([("system", systems[i % num_tenants]), ("user", questions[i % len(questions)])], args.max_tokens)
        for i in range(args.num_requests)
    ]


def shared(stub, requests: list[pb.GenerateRequest], concurrency: int) -> dict:
    before = wait_idle(stub).counters
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: stream(stub, r), requests))
    wall_s = time.perf_counter() - start
    after = wait_idle(stub).counters
    ttfts = [r["ttft_s"] for r in results]
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return {
        "num_requests": len(results),
        "wall_s": wall_s,
        "throughput_tok_s": sum(len(r["tokens"]) for r in results) / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in results) / len(results),
        "hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
        "outputs": [r["tokens"] for r in results],
    }


def run_server(flags: str, parts: list[str], args) -> dict:
    logger.info("serve %s", flags)
    with spawned(flags) as address, grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stream(stub, chat([("user", "Hello")], 4))  # warm-up
        result = {}
        if "multiturn" in parts:
            result["multiturn"] = multiturn(stub, args)
        if "shared" in parts:
            result["shared"] = shared(stub, shared_requests(args), args.concurrency)
        if "routing" in parts:
            result["routing"] = shared(stub, shared_requests(args, args.num_tenants), args.concurrency)
    return result


def ratio(off: float, on: float) -> float:
    return off / on if on else float("inf")


def report(proposer: str, on: dict, off: dict) -> dict:
    rows = {}
    if "multiturn" in on:
        a, b = on["multiturn"], off["multiturn"]
        rows["multiturn_ttft_p50_speedup"] = ratio(b["ttft_p50_s"], a["ttft_p50_s"])
        rows["multiturn_ttft_p99_speedup"] = ratio(b["ttft_p99_s"], a["ttft_p99_s"])
        rows["multiturn_outputs_equal"] = a["outputs"] == b["outputs"]
        print(
            f"{proposer:>7} multi-turn, turn 2 ({a['num_conversations']} conversations, "
            f"{a['mean_prompt_tokens']:.0f} prompt tokens, {a['mean_cached_tokens']:.0f} cached): TTFT p50 "
            f"{1e3 * b['ttft_p50_s']:.0f} -> {1e3 * a['ttft_p50_s']:.0f} ms "
            f"({rows['multiturn_ttft_p50_speedup']:.2f}x), p99 {1e3 * b['ttft_p99_s']:.0f} -> "
            f"{1e3 * a['ttft_p99_s']:.0f} ms ({rows['multiturn_ttft_p99_speedup']:.2f}x); outputs equal: "
            f"{rows['multiturn_outputs_equal']}"
        )
    if "shared" in on:
        a, b = on["shared"], off["shared"]
        rows["shared_throughput_speedup"] = a["throughput_tok_s"] / b["throughput_tok_s"]
        rows["shared_ttft_p50_speedup"] = ratio(b["ttft_p50_s"], a["ttft_p50_s"])
        rows["shared_outputs_equal"] = a["outputs"] == b["outputs"]
        print(
            f"{proposer:>7} shared system prompt ({a['num_requests']} requests, {a['mean_prompt_tokens']:.0f} "
            f"prompt tokens): {b['throughput_tok_s']:.1f} -> {a['throughput_tok_s']:.1f} tok/s "
            f"({rows['shared_throughput_speedup']:.2f}x), TTFT p50 {1e3 * b['ttft_p50_s']:.0f} -> "
            f"{1e3 * a['ttft_p50_s']:.0f} ms ({rows['shared_ttft_p50_speedup']:.2f}x), p99 "
            f"{1e3 * b['ttft_p99_s']:.0f} -> {1e3 * a['ttft_p99_s']:.0f} ms; hit rate {a['hit_rate']:.0%}; "
            f"outputs equal: {rows['shared_outputs_equal']}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proposers", default="none,ngram,suffix")
    parser.add_argument("--parts", default="multiturn,shared,routing")
    parser.add_argument("--questions-per-category", type=int, default=2)
    parser.add_argument("--turn1-max-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32, help="turn 2's and the shared requests' output")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-tenants", type=int, default=4, help="system prompts of the routing workload")
    parser.add_argument("--serve-flags", default="", help="more flags for every server")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parts = args.parts.split(",")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {cpu_name}")
    results = {"cpu": cpu_name, "args": vars(args), "proposers": {}}
    for proposer in args.proposers.split(","):
        flags = f"{PROPOSER_FLAGS[proposer]} {args.serve_flags}"
        same_parts = [p for p in parts if p != "routing"]
        on = run_server(flags, same_parts, args)
        off = run_server(f"{flags} --no-enable-prefix-caching", same_parts, args)
        results["proposers"][proposer] = {"on": on, "off": off, "summary": report(proposer, on, off)}
    if "routing" in parts:
        routing = {}
        for policy in ("cache-aware", "least-loaded"):
            routing[policy] = run_server(f"--num-workers 2 --routing {policy} {args.serve_flags}", ["routing"], args)[
                "routing"
            ]
            r = routing[policy]
            print(
                f"two workers, {policy:>12}: {args.num_tenants} system prompts, {r['num_requests']} requests: "
                f"hit rate {r['hit_rate']:.0%}, TTFT p50 {1e3 * r['ttft_p50_s']:.0f} ms, p99 "
                f"{1e3 * r['ttft_p99_s']:.0f} ms, {r['throughput_tok_s']:.1f} tok/s"
            )
        results["routing"] = routing
    save("prefix-cache", results)


if __name__ == "__main__":
    main()
