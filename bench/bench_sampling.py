"""Sampling parameters and tool calling with speculation: what the logits processing costs speculation, and
what speculation gives tool calls. Servers side by side, over gRPC, greedy:

    .venv/bin/python bench/bench_sampling.py --per-category 3    # ~15 min on 2 cores
    .venv/bin/python bench/bench_sampling.py --per-category 1 --max-tokens 64 --tool-proposers ""

Servers (`specdec serve --port 0`, all up at once; idle, a server uses no CPU), each with the ChatML tools
template and the hermes parser, and --extra-flags: plain decoding (`--proposer none`), the default
configuration (suffix speculation, the goodput policy) and, for tool calls, each of --tool-proposers. Fresh
servers serve each variant and each tool-call pass, so that no pass finds another's prompts in the prefix
cache or its outputs in the suffix proposer's.

1. Processing: --per-category Spec-Bench first turns per category (../shared/data), batch 1, --max-tokens
   tokens each (ignore_eos), as they are, with `repetition_penalty: 1.1`, and with `logprobs` +
   `top_logprobs: 5`. Per variant: tokens/s over whole requests (prefill included), speculation's speedup,
   and that speedup over the unprocessed requests' (target: >= 0.95, "the processing costs speculation at
   most 5% of its speedup"); the decode phase's speedup (after the first token); outputs that differ from
   plain decoding (expect 0: lossless); the share of emitted tokens that were accepted drafts (a penalty
   changes the text, and with it what a copying proposer finds to copy).
2. Tool calls: each question with "Record this as a task." and one tool (`create_task`, its schema below),
   `tool_choice: required`, one call: batch 1, then --concurrency requests at a time (every question twice,
   on fresh servers; --concurrent-rounds passes, the servers' order rotated, the speedup the geometric mean of
   the passes' ratios). Tokens/s and speedups (target >= 1.5x), whole and decode phase, calls valid against the
   schema, outputs that differ, and the forced drafts (tokens the schema fixes, drafted for free).

The servers' order rotates from request to request. Results: bench/results/sampling-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import json
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import jsonschema  # noqa: E402

from bench.bench_serving import spawned, wait_idle  # noqa: E402
from bench.common import ROOT, load_questions, save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402

logger = logging.getLogger("bench.sampling")
TEMPLATE = ROOT / "deploy" / "chat_templates" / "chatml_tools.jinja"
CATEGORIES = [
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
]  # fmt: skip
TASK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "category": {"enum": CATEGORIES},
        "priority": {"enum": ["low", "medium", "high"]},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 50}, "maxItems": 3},
    },
    "required": ["title", "category", "priority", "steps"],
    "additionalProperties": False,
}
VARIANTS = {
    "as is": {},
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "top_logprobs 5": {"logprobs": True, "top_logprobs": 5},
}


def complete(stub, request: pb.GenerateRequest) -> dict:
    """Streams one request: its whole time, its time to the first token, its tokens, usage and tool calls."""
    start = time.perf_counter()
    first_s, token_ids, num_first = None, [], 0
    for response in stub.Generate(request, timeout=600):
        if first_s is None and response.token_ids:
            first_s, num_first = time.perf_counter() - start, len(response.token_ids)
        token_ids += response.token_ids
        last = response
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "decode_seconds": seconds - (first_s or seconds),
        "token_ids": token_ids,
        "num_decode_tokens": len(token_ids) - num_first,
        "usage": last.usage,
        "tool_calls": list(last.tool_calls),
    }


def chat(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=text)], sampling=pb.SamplingParams(temperature=0, **sampling)
    )


def tool_request(text: str) -> pb.GenerateRequest:
    request = chat(f"{text}\n\nRecord this as a task.", max_tokens=200)
    request.tools.add(name="create_task", description="Record a task", parameters=json.dumps(TASK))
    request.tool_choice.mode = "required"
    request.parallel_tool_calls = False
    return request


def side_by_side(stubs: dict, requests: list[pb.GenerateRequest]) -> dict[str, list[dict]]:
    """Batch 1, each request on every server in turn (the order rotating): each server's results."""
    runs = {name: [] for name in stubs}
    names = list(stubs)
    for i, request in enumerate(requests):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            wait_idle(stubs[name])
            runs[name].append(complete(stubs[name], request))
    return runs


def concurrent(stub, requests: list[pb.GenerateRequest], concurrency: int) -> float:
    """Tokens per second with `concurrency` requests in flight."""
    wait_idle(stub)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: complete(stub, r), requests))
    return sum(len(r["token_ids"]) for r in results) / (time.perf_counter() - start)


def summary(runs: dict[str, list[dict]]) -> dict:
    """Per server: tokens/s over whole requests and over their decode phase (after the first token), the
    speedups over plain decoding, outputs that differ from plain decoding's, the share of tokens that were
    accepted drafts and the forced drafts."""
    out = {}
    for name, results in runs.items():
        tokens = sum(len(r["token_ids"]) for r in results)
        accepted = sum(r["usage"].accepted_tokens for r in results)
        out[name] = {
            "tok_s": tokens / sum(r["seconds"] for r in results),
            "decode_tok_s": sum(r["num_decode_tokens"] for r in results) / sum(r["decode_seconds"] for r in results),
            "num_differ": sum(r["token_ids"] != p["token_ids"] for r, p in zip(results, runs["plain"])),
            "accepted_per_token": accepted / max(tokens, 1),
            "forced_drafts": sum(
                p.draft_tokens for r in results for p in r["usage"].proposers if p.proposer == "forced"
            ),
        }
    for name in out:
        out[name]["speedup"] = out[name]["tok_s"] / out["plain"]["tok_s"]
        out[name]["decode_speedup"] = out[name]["decode_tok_s"] / out["plain"]["decode_tok_s"]
    return out


@contextlib.contextmanager
def fresh_servers(flags: str, configurations: dict[str, str]):
    """One server per configuration (name: its proposer flags), each with `flags`, started for one part and
    warmed up: fresh prefix and suffix caches, so that no part finds an earlier part's prompts or outputs."""
    with contextlib.ExitStack() as stack:
        stubs = {}
        for name, proposer_flags in configurations.items():
            address = stack.enter_context(spawned(f"{proposer_flags} {flags}"))
            stubs[name] = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(address))
        for stub in stubs.values():  # the first requests pay one-time costs
            complete(stub, chat("Hello!", max_tokens=8))
            complete(stub, tool_request("Buy milk."))
        yield stubs


def main(args) -> None:
    questions = load_questions(categories=CATEGORIES, per_category=args.per_category)
    texts = [q["turns"][0] for q in questions]
    flags = f"--chat-template {TEMPLATE} --tool-call-parser hermes {args.extra_flags}"
    results: dict = {"args": vars(args), "processing": {}, "tools": {}}
    pair = {"plain": "--proposer none", "default": ""}
    for variant, sampling in VARIANTS.items():
        with fresh_servers(flags, pair) as stubs:
            requests = [chat(t, max_tokens=args.max_tokens, ignore_eos=True, **sampling) for t in texts]
            results["processing"][variant] = summary(side_by_side(stubs, requests))
        logger.info("%s: %s", variant, results["processing"][variant])
    configurations = {**pair, **{f: f"--proposer {f}" for f in args.tool_proposers}}
    requests = [tool_request(t) for t in texts]
    with fresh_servers(flags, configurations) as stubs:
        runs = side_by_side(stubs, requests)
    tools = summary(runs)
    for name, result in runs.items():
        tools[name]["num_valid"] = sum(
            len(r["tool_calls"]) == 1 and _is_valid(r["tool_calls"][0].arguments) for r in result
        )
    rounds: dict[str, list[float]] = {name: [] for name in configurations}
    for round_index in range(args.concurrent_rounds):
        with fresh_servers(flags, configurations) as stubs:  # fresh again: an earlier pass left every call cached
            names = list(stubs)[round_index % len(stubs) :] + list(stubs)[: round_index % len(stubs)]
            for name in names:
                rounds[name].append(concurrent(stubs[name], requests * 2, args.concurrency))
        logger.info("concurrency %d, round %d: %s", args.concurrency, round_index + 1, rounds)
    for name in tools:
        ratios = [tok_s / plain for tok_s, plain in zip(rounds[name], rounds["plain"])]
        tools[name]["concurrent_tok_s"] = statistics.mean(rounds[name])
        tools[name]["concurrent_speedup"] = statistics.geometric_mean(ratios)
        tools[name]["concurrent_speedup_by_round"] = ratios
    results["tools"] = tools
    results["tools_meta"] = {
        "num_requests": len(requests),
        "concurrency": args.concurrency,
        "concurrent_rounds": args.concurrent_rounds,
    }
    report(results)
    save("sampling", results)


def _is_valid(arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), TASK)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def report(results: dict) -> None:
    base = results["processing"]["as is"]["default"]["speedup"]
    print(f"\n{'requests (batch 1)':<24} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'vs as is':>8} "
          f"{'decode':>7} {'differ':>6} {'drafted share':>13}")  # fmt: skip
    for variant, r in results["processing"].items():
        plain, spec = r["plain"], r["default"]
        print(
            f"{variant:<24} {plain['tok_s']:>11.1f} {spec['tok_s']:>10.1f} {spec['speedup']:>7.2f}x "
            f"{spec['speedup'] / base:>7.2f}x {spec['decode_speedup']:>6.2f}x {spec['num_differ']:>6} "
            f"{spec['accepted_per_token']:>13.2f}"
        )
    meta = results["tools_meta"]
    print(f"\ntool calls, required ({meta['num_requests']} requests): tok/s and speedup over plain decoding")
    print(f"{'server':<16} {'batch 1':>8} {'speedup':>8} {'decode':>7} {'conc ' + str(meta['concurrency']):>8} "
          f"{'speedup':>8} {'valid':>6} {'differ':>6} {'forced':>7}")  # fmt: skip
    for name, t in results["tools"].items():
        print(
            f"{name:<16} {t['tok_s']:>8.1f} {t['speedup']:>7.2f}x {t['decode_speedup']:>6.2f}x "
            f"{t['concurrent_tok_s']:>8.1f} {t['concurrent_speedup']:>7.2f}x {t['num_valid']:>6} "
            f"{t['num_differ']:>6} {t['forced_drafts']:>7}"
            + (f"  rounds: {' '.join(f'{r:.2f}' for r in t['concurrent_speedup_by_round'])}" if name != "plain" else "")
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request in part 1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--concurrent-rounds",
        type=int,
        default=1,
        help="passes of the tool calls at --concurrency, each on fresh servers in a rotated order (the speedup: "
        "the geometric mean of the passes' ratios)",
    )
    parser.add_argument("--extra-flags", default="", help="more `specdec serve` flags for every server")
    parser.add_argument(
        "--tool-proposers",
        type=lambda text: [p for p in text.split(";") if p],
        default=["eagle3,suffix"],
        help="proposers for more tool-call servers, ';'-separated (beside plain and the default configuration)",
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(parser.parse_args())
