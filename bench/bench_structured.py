"""Structured outputs with speculation: a JSON-extraction workload over gRPC, configurations side by side.

    .venv/bin/python bench/bench_structured.py                       # ~20 min on 2 cores
    .venv/bin/python bench/bench_structured.py --num-texts 2 --concurrency 4 --proposers ngram

Starts one `specdec serve --port 0` per configuration, one after another, and keeps them all: no speculation
unconstrained (the constraint's overhead), no speculation constrained, and each of --proposers with forced
drafts on and off (`--no-forced-drafts`), with their default k and the default goodput policy. Every job runs
on every configuration in turn, greedy.

Workload: the first --num-texts articles of Spec-Bench's summarization category and passages of its rag
category (../shared/data/spec_bench_dev.jsonl, cut to --text-chars characters), each with an instruction to
extract a record as JSON and the JSON schema of that record (written here): batch 1 (one request at a time,
the servers' order rotating from job to job), then --concurrency requests at a time, in --num-rounds rounds of
2 x concurrency jobs each (other texts every round).

The servers run one after another, and the machine drifts while they do: in a single pass the three servers
that ran last took 18-24% longer than the first (the unconstrained one among them); with rounds, every
proposer's server once measured 0.84-1.07x plain decoding over whole requests in a forward round and
1.04-1.21x in the reversed round after it. So the rounds alternate the order: forward, then reversed
(rotated by one every two rounds). Over an even number of rounds every proposer's server then has the same
mean place, and constrained plain decoding half a place before it (the unconstrained server, which takes its
lengths from it, runs right after it, half a place after). The concurrency speedups are over all rounds,
with each round's printed beside them.

Per configuration: tokens/s, the speedup over constrained decoding without speculation, both over whole
requests and over their decode phase (the tokens after each request's first, timed from its first token:
speculation cannot shorten the prefill, which at batch 1 here is a third to a half of a plain request), the
mean time to the first token, tokens per streamed message (at batch 1 one message per step: tokens per step),
outputs that validate against their schema (jsonschema; the others are named, with their finish reason and
length) and outputs that differ from constrained decoding without speculation (expect 0); drafts by proposer
(`forced`: the constraint's). Constraint overhead: unconstrained over constrained tokens/s, no speculation,
batch 1 (the unconstrained requests generate as many tokens as the constrained ones did). Each server is
warmed up on two texts that no measured job uses (the prefix cache would skip their prefill).

Results: bench/results/structured-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import json
import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import jsonschema  # noqa: E402

from bench.bench_goodput import geomean, rotate  # noqa: E402
from bench.bench_serving import spawned, wait_idle  # noqa: E402
from bench.common import load_questions, save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402

logger = logging.getLogger("bench.structured")

ARTICLE_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "topic": {"enum": ["politics", "business", "sports", "science", "health", "entertainment", "world", "other"]},
        "summary": {"type": "string", "maxLength": 240},
    },
    "required": ["title", "people", "places", "topic", "summary"],
    "additionalProperties": False,
}
PASSAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "subject": {"type": "string", "maxLength": 60},
        "key_facts": {"type": "array", "items": {"type": "string", "maxLength": 120}, "maxItems": 3},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
    },
    "required": ["subject", "key_facts", "sentiment"],
    "additionalProperties": False,
}
WORKLOADS = {
    "summarization": (
        "Extract the article's title, the people and places it names, its topic and a one-sentence summary, as JSON.",
        ARTICLE_SCHEMA,
    ),
    "rag": ("Extract the passage's subject, up to three key facts and its sentiment, as JSON.", PASSAGE_SCHEMA),
}


class Server:
    def __init__(self, label: str, address: str, constrained: bool):
        self.label, self.constrained = label, constrained
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)


def jobs_of(num_texts: int, text_chars: int, offset: int = 0) -> list[dict]:
    jobs = []
    for category, (instruction, schema) in WORKLOADS.items():
        rows = load_questions(categories=[category])[offset : offset + num_texts]
        for row in rows:
            text = row["turns"][0].removeprefix("Summarize: ")[:text_chars]
            jobs.append(
                {
                    "key": f"{category}-{row['question_id']}",
                    "prompt": f"{instruction}\n\nText:\n{text}",
                    "schema": schema,
                }
            )
    return jobs


def run_job(server: Server, job: dict, max_tokens: int, timeout_s: float, num_tokens: int | None = None) -> dict:
    """One streamed chat request; constrained by the job's schema, or unconstrained for exactly `num_tokens`
    tokens. Times the first token (prefill: speculation cannot change it) and the rest (decode) apart."""
    if server.constrained:
        sampling = pb.SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            structured_outputs=pb.StructuredOutputs(json=json.dumps(job["schema"])),
        )
    else:
        sampling = pb.SamplingParams(temperature=0, max_tokens=num_tokens or max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=job["prompt"])], sampling=sampling)
    start = time.perf_counter()
    token_ids, text, first, last, num_messages = [], [], None, None, 0
    for reply in server.stub.Generate(request, timeout=timeout_s):
        if reply.token_ids:
            now = time.perf_counter()
            first, last = first or now, now
            num_messages += 1
        token_ids += reply.token_ids
        text.append(reply.text)
    first, last = first or time.perf_counter(), last or time.perf_counter()
    return {
        "token_ids": token_ids,
        "text": "".join(text),
        "finish": pb.FinishReason.Name(reply.finish_reason),
        "proposers": {p.proposer: [p.draft_tokens, p.accepted_tokens] for p in reply.usage.proposers},
        "ttft_s": first - start,
        "decode_s": last - first,
        "num_messages": num_messages,
    }


def run_level(server: Server, jobs: list[dict], concurrency: int, args, lengths: dict | None = None) -> dict:
    wait_idle(server.stub)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(
            pool.map(
                lambda job: run_job(
                    server, job, args.max_tokens, args.request_timeout, (lengths or {}).get(job["key"])
                ),
                jobs,
            )
        )
    wall_s = time.perf_counter() - start
    return {"wall_s": wall_s, "replies": dict(zip((j["key"] for j in jobs), replies))}


def _decode_s(replies: dict) -> float:
    return sum(r["decode_s"] for r in replies.values())


def summarize(level: dict, jobs: list[dict], reference: dict | None) -> dict:
    replies = level["replies"]
    tokens = sum(len(r["token_ids"]) for r in replies.values())
    valid, invalid = 0, []
    for job in jobs:
        reply = replies[job["key"]]
        try:
            jsonschema.validate(json.loads(reply["text"]), job["schema"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            invalid.append(f"{job['key']} ({reply['finish']}, {len(reply['token_ids'])} tokens)")
    drafted: dict[str, list[int]] = {}
    for r in replies.values():
        for name, (d, a) in r["proposers"].items():
            drafted.setdefault(name, [0, 0])
            drafted[name][0] += d
            drafted[name][1] += a
    differing = (
        None
        if reference is None
        else sum(replies[k]["token_ids"] != reference["replies"][k]["token_ids"] for k in replies)
    )
    decode_s = _decode_s(replies)
    decode_tokens = sum(max(len(r["token_ids"]) - 1, 0) for r in replies.values())  # after each first token
    return {
        "tokens": tokens,
        "wall_s": level["wall_s"],
        "tok_s": tokens / level["wall_s"],
        "valid": valid,
        "invalid": invalid,
        "ttft_s": sum(r["ttft_s"] for r in replies.values()) / len(replies),
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "tokens_per_message": tokens / max(sum(r["num_messages"] for r in replies.values()), 1),
        "num_jobs": len(jobs),
        "stopped": sum(r["finish"] == "FINISH_REASON_STOP" for r in replies.values()),
        "differing": differing,
        "drafts_by_proposer": drafted,
    }


def round_order(servers: list[Server], turn: int) -> list[Server]:
    """The concurrency level's server order in round `turn`: constrained plain decoding, the unconstrained server
    (it takes its lengths from the former) and the rest, forward in even rounds and reversed in odd ones, the
    rest rotated by one every two rounds (module docstring)."""
    unconstrained, plain, rest = servers[0], servers[1], servers[2:]
    order = [plain, unconstrained] + rotate(rest, turn // 2)
    return order if turn % 2 == 0 else order[2:][::-1] + order[:2]


def measure(servers: list[Server], groups: list[list[dict]], concurrency: int, args) -> dict:
    """Every group of jobs on every server in turn: {label: {"wall_s", "replies", "rounds"}} (rounds: each
    group's own result, at concurrency > 1). Batch 1 rotates the order job by job, the unconstrained server
    last; rounds go as round_order says. The unconstrained server takes its lengths from constrained plain
    decoding's replies of the same group."""
    ordered = servers[1:] + servers[:1]
    level: dict[str, dict] = {}
    for turn, group in enumerate(groups):
        order = rotate(ordered[:-1], turn) + ordered[-1:] if concurrency == 1 else round_order(servers, turn)
        for server in order:
            lengths = None
            if not server.constrained:
                ref = level[servers[1].label]["replies"]
                lengths = {job["key"]: max(len(ref[job["key"]]["token_ids"]), 1) for job in group}
            result = run_level(server, group, concurrency, args, lengths)
            into = level.setdefault(server.label, {"wall_s": 0.0, "replies": {}, "rounds": []})
            into["wall_s"] += result["wall_s"]
            into["replies"].update(result["replies"])
            if concurrency > 1:
                into["rounds"].append(result)
        logger.info("concurrency %d: %d/%d", concurrency, turn + 1, len(groups))
    return level


def rows_of(level: dict, servers: list[Server], jobs: list[dict]) -> dict:
    """Each server's summary, with its speedups over constrained plain decoding (servers[1]), and each round's."""
    reference = level[servers[1].label]
    base = summarize(reference, jobs, None)
    rows = {}
    for server in servers:
        row = summarize(level[server.label], jobs, reference if server.constrained else None)
        row["speedup"] = row["tok_s"] / base["tok_s"]
        row["decode_speedup"] = base["decode_s"] / row["decode_s"] if row["decode_s"] > 0 else None
        if reference["rounds"]:  # each round's own ratios: how far the machine's drift moved them
            pairs = list(zip(level[server.label]["rounds"], reference["rounds"]))
            row["speedup_by_round"] = [b["wall_s"] / r["wall_s"] for r, b in pairs]
            row["decode_speedup_by_round"] = [_decode_s(b["replies"]) / _decode_s(r["replies"]) for r, b in pairs]
        rows[server.label] = row
    return rows


def print_report(report: dict, servers: list[Server]) -> None:
    is_constrained = {server.label: server.constrained for server in servers}
    for name in ("batch1", "concurrency"):
        print(f"\n{name}:")
        for label, row in report[name].items():
            drafted = ", ".join(f"{p} {d}/{a}" for p, (d, a) in sorted(row["drafts_by_proposer"].items()))
            print(
                f"  {label:22s} {row['tok_s']:7.1f} tok/s  {row['speedup']:5.2f}x  decode {row['decode_tok_s']:6.1f} "
                f"tok/s {row['decode_speedup']:5.2f}x  TTFT {row['ttft_s'] * 1e3:4.0f} ms  "
                f"{row['tokens_per_message']:4.2f} tok/msg  valid {row['valid']}/{row['num_jobs']}  stop "
                f"{row['stopped']}  differ {row['differing']}  drafts/accepted: {drafted}"
            )
            if row["invalid"] and is_constrained[label]:
                print(f"  {'':22s} not valid: {', '.join(row['invalid'])}")
            if "speedup_by_round" in row:
                print(
                    f"  {'':22s} by round: {' / '.join(f'{v:.2f}' for v in row['speedup_by_round'])}x, decode "
                    f"{' / '.join(f'{v:.2f}' for v in row['decode_speedup_by_round'])}x"
                )
    print(
        f"\nconstraint overhead (unconstrained / constrained tok/s, no speculation, batch 1): "
        f"{report['constraint_overhead_batch1']:.3f}"
    )


def main(args) -> None:
    configs = [("none, unconstrained", "--proposer none", False), ("none", "--proposer none", True)]
    for proposer in args.proposers:
        configs += [
            (f"{proposer}", f"--proposer {proposer}", True),
            (f"{proposer}, no forced", f"--proposer {proposer} --no-forced-drafts", True),
        ]
    batch1_jobs = jobs_of(args.num_texts, args.text_chars)
    round_jobs = [
        jobs_of(args.concurrency, args.text_chars, offset=args.num_texts + r * args.concurrency)
        for r in range(args.num_rounds)
    ]
    warm_up_offset = args.num_texts + args.num_rounds * args.concurrency
    warm_up_jobs = jobs_of(1, args.text_chars, offset=warm_up_offset)  # one of each schema
    if len(warm_up_jobs) < len(WORKLOADS):
        raise SystemExit(
            f"--num-texts + --num-rounds x --concurrency = {warm_up_offset} texts per category, and "
            f"one more to warm up: more than the data has"
        )
    report: dict = {"args": vars(args)}
    with contextlib.ExitStack() as stack:
        servers = []
        for label, flags, constrained in configs:  # one at a time: eight starting at once starve each other
            logger.info("starting specdec serve %s %s", flags, args.common_flags)
            servers.append(Server(label, stack.enter_context(spawned(f"{flags} {args.common_flags}")), constrained))
            for job in warm_up_jobs:  # the kernels, both schemas' grammars
                run_job(servers[-1], job, 8, args.request_timeout, 8)
        batch1 = measure(servers, [[job] for job in batch1_jobs], 1, args)
        concurrent = measure(servers, round_jobs, args.concurrency, args)
    report["batch1"] = rows_of(batch1, servers, batch1_jobs)
    report["concurrency"] = rows_of(concurrent, servers, [job for jobs in round_jobs for job in jobs])
    report["constraint_overhead_batch1"] = (
        report["batch1"]["none, unconstrained"]["tok_s"] / report["batch1"]["none"]["tok_s"]
    )
    print(
        f"\nJSON extraction, {len(batch1_jobs)} jobs at batch 1, {sum(map(len, round_jobs))} at concurrency "
        f"{args.concurrency}; speedup over constrained decoding without speculation, whole requests and decode "
        f"(after each request's first token)"
    )
    print_report(report, servers)
    for key, metric in (("geomean_speedup_batch1", "speedup"), ("geomean_decode_speedup_batch1", "decode_speedup")):
        values = [report["batch1"][label][metric] for label, _, _ in configs[2:]]
        report[key] = geomean(values) if values else None
    save("structured", report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--proposers",
        type=lambda s: s.split(";"),
        default=["ngram", "suffix", "eagle3"],
        help="semicolon-separated --proposer values",
    )
    parser.add_argument("--num-texts", type=int, default=4, help="texts per category at batch 1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--num-rounds",
        type=int,
        default=2,
        help="rounds at --concurrency, 2 x concurrency other texts each, the order alternating",
    )
    parser.add_argument("--text-chars", type=int, default=1500)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="enough for every record to close (rag-509 of the concurrency level needs 399)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument(
        "--common-flags",
        default="--max-num-seqs 16 --kv-cache-memory-gib 0.5",
        help="flags every server gets (eight servers: a small KV cache each)",
    )
    ARGS = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(ARGS)
