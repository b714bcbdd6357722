"""Speculation that pays its way: no speculation vs n-gram vs suffix (goodput policy) over gRPC, side by side.

    .venv/bin/python bench/bench_goodput.py                      # ~25 min on 2 cores
    .venv/bin/python bench/bench_goodput.py --max-tokens 64 --prompts-per-category 2 --concurrency 1,4

Starts one `specdec serve --port 0` per configuration (default: none; ngram K=5; suffix K=16; each with the
default goodput policy), all at once, and runs every workload on each configuration in turn (rotating the
order), so a noisy neighbour slows them alike. Greedy, ignore_eos: every configuration emits the same tokens
(the script counts outputs that differ from the first configuration's: expect 0). Workloads, each on its own
prompts (none is served twice unless the workload says so, so the suffix cache only helps where text really
repeats):

1. batch 1 per category: summarization, rag, qa, translation, math_reasoning (--prompts-per-category each,
   first turns, --long-tokens new tokens), one request at a time: tok/s per category and geomean ratios;
2. concurrency sweep (--concurrency): mixed categories, 2 x concurrency requests per level (fresh prompts per
   level), --max-tokens each: throughput, the policy's chosen k, acceptance per draft position, predicted vs
   measured step time;
3. MT-Bench two turns: one question per MT-Bench category; turn 1, then turn 2 (which asks to revise the first
   answer) with turn 1's answer in the chat history; throughput of each turn, batch 1;
4. repeat: --repeat-prompts fresh prompts served once, then the same prompts again (batch 1): throughput of
   each pass.

Results: bench/results/goodput-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import logging
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.bench_serving import spawned, wait_idle  # noqa: E402
from bench.common import load_questions, save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402

logger = logging.getLogger("bench.goodput")

CATEGORIES = ["summarization", "rag", "qa", "translation", "math_reasoning"]
MT_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
DEFAULT_CONFIGS = [
    "--proposer none",
    "--proposer ngram --num-speculative-tokens 5",
    "--proposer suffix --num-speculative-tokens 16",
]


def generate(stub, messages: list[tuple[str, str]], max_tokens: int, timeout_s: float) -> tuple[list[int], str]:
    """Streams one greedy chat request; its token ids and text."""
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    for role, content in messages:
        request.messages.add(role=role, content=content)
    token_ids, text = [], []
    for response in stub.Generate(request, timeout=timeout_s):
        token_ids += response.token_ids
        text.append(response.text)
    return token_ids, "".join(text)


def mean_k(num_sequence_steps_by_k: list[int]) -> float | None:
    """The mean draft length of sequence-steps counted by k (None: no steps)."""
    total = sum(num_sequence_steps_by_k)
    return sum(k * n for k, n in enumerate(num_sequence_steps_by_k)) / total if total else None


def counters_delta(before: pb.Counters, after: pb.Counters) -> dict:
    """The speculation counters over an interval: k histogram, acceptance by position, step-time model."""

    def diff(a, b):
        n = max(len(a), len(b))
        return [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]

    by_k = diff(after.num_sequence_steps_by_k, before.num_sequence_steps_by_k)
    per_pos = diff(after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)
    drafted = after.num_drafted_tokens - before.num_drafted_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    measured = after.measured_step_seconds - before.measured_step_seconds
    return {
        "num_sequence_steps_by_k": by_k,
        "mean_k": mean_k(by_k),
        "num_accepted_per_pos": per_pos,
        "num_drafted": drafted,
        "num_accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "num_steps": after.num_steps - before.num_steps,
        "predicted_step_s": after.predicted_step_seconds - before.predicted_step_seconds,
        "measured_step_s": measured,
        "step_time_rel_error": (
            (after.step_time_abs_error_seconds - before.step_time_abs_error_seconds) / measured
            if measured > 0
            else None
        ),
        "worker_step_s": after.worker_step_seconds - before.worker_step_seconds,
        "propose_s": after.propose_seconds - before.propose_seconds,
    }


class Target:
    """One configuration's server: a stub and the outputs it produced (for the lossless check)."""

    def __init__(self, label: str, address: str):
        self.label = label
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.outputs: dict[str, list[int]] = {}

    def run(
        self, jobs: list[tuple[str, list[tuple[str, str]]]], concurrency: int, max_tokens: int, timeout_s: float
    ) -> dict:
        """Serves the jobs (key, messages) with at most `concurrency` in flight; throughput and counters."""
        before = wait_idle(self.stub).counters
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda job: generate(self.stub, job[1], max_tokens, timeout_s), jobs))
        wall_s = time.perf_counter() - start
        after = wait_idle(self.stub).counters
        for (key, _), (token_ids, _) in zip(jobs, results):
            self.outputs[key] = token_ids
        num_tokens = sum(len(t) for t, _ in results)
        return {
            "num_requests": len(jobs),
            "num_tokens": num_tokens,
            "wall_s": wall_s,
            "tok_s": num_tokens / wall_s,
            "texts": [text for _, text in results],
            **counters_delta(before, after),
        }


def strip_texts(node) -> None:
    """Drops the generated texts (kept only to build MT-Bench's second turns) before saving."""
    if isinstance(node, dict):
        node.pop("texts", None)
        for value in node.values():
            strip_texts(value)


def rotate(targets: list[Target], index: int) -> list[Target]:
    return targets[index % len(targets) :] + targets[: index % len(targets)]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(args) -> None:
    questions = load_questions()
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    taken = {c: 0 for c in by_category}

    def take(category: str, n: int) -> list[dict]:
        rows = by_category[category][taken[category] : taken[category] + n]
        taken[category] += n
        return rows

    with contextlib.ExitStack() as stack:
        targets = []
        for flags in args.config or DEFAULT_CONFIGS:
            logger.info("starting specdec serve %s", flags)
            targets.append(Target(flags, stack.enter_context(spawned(f"{flags} {args.common_flags}"))))
        for t in targets:  # warm-up
            generate(t.stub, [("user", "Hello")], 8, args.request_timeout)
        report: dict = {"configs": [t.label for t in targets], "args": vars(args)}
        turn = 0

        # 1. batch 1 per category
        per_category = {}
        for category in CATEGORIES:
            rows = take(category, args.prompts_per_category)
            jobs = [(f"cat-{q['question_id']}", [("user", q["turns"][0])]) for q in rows]
            per_category[category] = {}
            for t in rotate(targets, turn):
                per_category[category][t.label] = t.run(jobs, 1, args.long_tokens, args.request_timeout)
                logger.info("%s / %s: %.1f tok/s", category, t.label, per_category[category][t.label]["tok_s"])
            turn += 1
        report["batch1_categories"] = per_category

        # 2. concurrency sweep (mixed categories, fresh prompts per level)
        sweep = {}
        for concurrency in args.concurrency:
            n = 2 * concurrency
            rows = [q for i in range(n) for q in take(CATEGORIES[i % len(CATEGORIES)], 1)]
            jobs = [(f"sweep-{q['question_id']}", [("user", q["turns"][0])]) for q in rows]
            sweep[concurrency] = {}
            for t in rotate(targets, turn):
                sweep[concurrency][t.label] = t.run(jobs, concurrency, args.max_tokens, args.request_timeout)
                logger.info(
                    "concurrency %d / %s: %.1f tok/s", concurrency, t.label, sweep[concurrency][t.label]["tok_s"]
                )
            turn += 1
        report["sweep"] = sweep

        # 3. MT-Bench: turn 1, then turn 2 with turn 1's answer in the history
        mt = {"turn1": {}, "turn2": {}}
        rows = [q for c in MT_CATEGORIES for q in take(c, 1)]
        first = [(f"mt1-{q['question_id']}", [("user", q["turns"][0])]) for q in rows]
        for t in rotate(targets, turn):
            mt["turn1"][t.label] = t.run(first, 1, args.long_tokens, args.request_timeout)
        answers = mt["turn1"][targets[0].label]["texts"]  # greedy: every configuration's are the same
        second = [
            (f"mt2-{q['question_id']}", [("user", q["turns"][0]), ("assistant", answer), ("user", q["turns"][1])])
            for q, answer in zip(rows, answers)
        ]
        for t in rotate(targets, turn):
            mt["turn2"][t.label] = t.run(second, 1, args.long_tokens, args.request_timeout)
            logger.info("MT-Bench turn 2 / %s: %.1f tok/s", t.label, mt["turn2"][t.label]["tok_s"])
        turn += 1
        report["mt_bench"] = mt

        # 4. the same prompts twice
        repeat = {"pass1": {}, "pass2": {}}
        rows = [q for i in range(args.repeat_prompts) for q in take(CATEGORIES[i % len(CATEGORIES)], 1)]
        for name in ("pass1", "pass2"):
            jobs = [(f"{name}-{q['question_id']}", [("user", q["turns"][0])]) for q in rows]
            for t in rotate(targets, turn):
                repeat[name][t.label] = t.run(jobs, 1, args.max_tokens, args.request_timeout)
                logger.info("repeat %s / %s: %.1f tok/s", name, t.label, repeat[name][t.label]["tok_s"])
        report["repeat"] = repeat

        base = targets[0]
        report["num_outputs_differing"] = {
            t.label: sum(t.outputs[k] != base.outputs[k] for k in base.outputs) for t in targets[1:]
        }
    strip_texts(report)
    print_report(report, [t.label for t in targets])
    save("goodput", report)


def print_report(report: dict, labels: list[str]) -> None:
    base = labels[0]
    names = [f"[{i}]" for i in range(1, len(labels) + 1)]
    for name, label in zip(names, labels):
        print(f"{name} {label}")
    print("\nbatch 1 per category (tok/s, then ratio vs [1])")
    print(f"{'category':<16}" + "".join(f"{n:>8}" for n in names) + "".join(f"{n:>8}" for n in names[1:]))
    ratios = {label: [] for label in labels}
    for category, runs in report["batch1_categories"].items():
        row = [runs[label]["tok_s"] for label in labels]
        for label in labels:
            ratios[label].append(runs[label]["tok_s"] / runs[base]["tok_s"])
        print(f"{category:<16}" + "".join(f"{v:>8.1f}" for v in row) + "".join(f"{v / row[0]:>7.2f}x" for v in row[1:]))
    print(
        f"{'geomean':<16}" + " " * 8 * len(labels) + "".join(f"{geomean(ratios[label]):>7.2f}x" for label in labels[1:])
    )
    if len(labels) >= 3:
        print(
            f"{names[2]} vs {names[1]} geomean: "
            f"{geomean([a / b for a, b in zip(ratios[labels[2]], ratios[labels[1]])]):.2f}x"
        )
    print("\nconcurrency sweep (tok/s, ratio vs [1]; mean k, acceptance, predicted/measured step time)")
    for concurrency, runs in report["sweep"].items():
        for name, label in zip(names, labels):
            r = runs[label]
            rel = r["step_time_rel_error"]
            print(
                f"  c={concurrency:<3} {name} {r['tok_s']:>7.1f} {r['tok_s'] / runs[base]['tok_s']:>5.2f}x "
                f"k={'-' if r['mean_k'] is None else format(r['mean_k'], '.2f'):>5} "
                f"k-hist={r['num_sequence_steps_by_k']} "
                f"accept={'-' if r['acceptance_rate'] is None else format(r['acceptance_rate'], '.2f')} "
                f"per-pos={r['num_accepted_per_pos'][:8]} "
                f"pred/meas={r['predicted_step_s']:.1f}/{r['measured_step_s']:.1f}s "
                f"err={'-' if rel is None else format(rel, '.0%')}"
            )
    for section, title in (("mt_bench", "MT-Bench"), ("repeat", "same prompts twice")):
        print(f"\n{title} (tok/s, ratio vs [1])")
        for part, runs in report[section].items():
            print(
                f"  {part:<6}"
                + "".join(
                    f" {n} {runs[label]['tok_s']:>6.1f} {runs[label]['tok_s'] / runs[base]['tok_s']:>5.2f}x"
                    for n, label in zip(names, labels)
                )
            )
    print(f"\noutputs differing from [1] (greedy: expect 0): {report['num_outputs_differing']}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        action="append",
        metavar="FLAGS",
        help=f"`specdec serve` flags of one configuration (default: {DEFAULT_CONFIGS})",
    )
    parser.add_argument("--common-flags", default="", help="flags added to every configuration")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--prompts-per-category", type=int, default=3, help="batch-1 workload")
    parser.add_argument("--long-tokens", type=int, default=128, help="new tokens: batch-1 and MT-Bench workloads")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens: sweep and repeat workloads")
    parser.add_argument("--repeat-prompts", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(parse_args())
