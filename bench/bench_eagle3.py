"""A learned drafter against copying: none, ngram, suffix, eagle3 and eagle3,suffix over gRPC, side by side.

    .venv/bin/python bench/bench_eagle3.py                     # ~35 min on 2 cores
    .venv/bin/python bench/bench_eagle3.py --prompts-per-category 1 --dtypes bfloat16 --concurrency 1,4

Starts one `specdec serve --port 0` per (dtype, proposer) — each with its default k and the default goodput
policy; eagle3 reads the head that ships for the default model — all at once, and runs each workload on every
configuration in turn (rotating the order), so a noisy neighbour slows them alike. Greedy, ignore_eos: every
configuration of a dtype emits the same tokens (the script counts outputs that differ from the dtype's
no-speculation output: expect 0).

1. batch 1: every Spec-Bench category of ../shared/data/spec_bench_dev.jsonl (--prompts-per-category first
   turns each, --new-tokens tokens): tokens/s, tokens per target forward, acceptance by draft position and
   the proposers' share of the worker's step time, per category; speedups over no speculation as geometric
   means over the eight MT-Bench categories and over all thirteen (--prompts-per-category 0: skipped);
2. concurrency (--concurrency, the first dtype of --dtypes, --sweep-configs): mixed categories, 2 x
   concurrency requests per level, --sweep-tokens each, --sweep-rounds times (each round on the next prompts
   and in another order; every level starts from the same prompts, which a lower level served): throughput
   against no speculation over all rounds, and each round's ratio (their spread is the noise).

Results: bench/results/eagle3-*.json.
"""

import argparse
import contextlib
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.bench_goodput import MT_CATEGORIES, Target, generate, geomean, mean_k, rotate, strip_texts  # noqa: E402
from bench.bench_serving import spawned  # noqa: E402
from bench.common import load_questions, save  # noqa: E402

logger = logging.getLogger("bench.eagle3")

PROPOSERS = ["none", "ngram", "suffix", "eagle3", "eagle3,suffix"]


def main(args) -> None:
    questions = load_questions()
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    categories = sorted(by_category)
    report: dict = {"args": vars(args), "categories": categories}
    with contextlib.ExitStack() as stack:
        targets: dict[str, dict[str, Target]] = {}
        for dtype in args.dtypes:
            targets[dtype] = {}
            for proposer in args.proposers:
                flags = f"--proposer {proposer} --dtype {dtype} {args.common_flags}"
                logger.info("starting specdec serve %s", flags)
                targets[dtype][proposer] = Target(proposer, stack.enter_context(spawned(flags)))
        every = [t for by_proposer in targets.values() for t in by_proposer.values()]
        for t in every:  # warm-up
            generate(t.stub, [("user", "Hello")], 8, args.request_timeout)

        batch1 = {dtype: {} for dtype in args.dtypes}
        for turn, category in enumerate(categories if args.prompts_per_category > 0 else []):  # 0: the sweep only
            rows = by_category[category][: args.prompts_per_category]
            jobs = [(f"b1-{q['question_id']}", [("user", q["turns"][0])]) for q in rows]
            order = [(dtype, t) for dtype, by_proposer in targets.items() for t in by_proposer.values()]
            for dtype, t in rotate(order, turn):
                batch1[dtype].setdefault(category, {})[t.label] = t.run(jobs, 1, args.new_tokens, args.request_timeout)
                logger.info(
                    "%s %s / %s: %.1f tok/s", dtype, category, t.label, batch1[dtype][category][t.label]["tok_s"]
                )
        report["batch1"] = batch1
        save("eagle3-batch1", report)  # a sweep that fails keeps these

        sweep_dtype = args.dtypes[0]
        sweep = {}
        # Prompts batch 1 did not use, categories interleaved (repeated if the file has too few).
        unused = [rows[args.prompts_per_category :] for rows in by_category.values()]
        pool = [rows[i] for i in range(max(map(len, unused))) for rows in unused if i < len(rows)]
        for turn, concurrency in enumerate(args.concurrency):
            chosen = [targets[sweep_dtype][p] for p in args.sweep_configs]
            rounds: dict[str, list[dict]] = {t.label: [] for t in chosen}
            # Each round its own prompts (a repeated request is one the suffix proposer and the prefix cache
            # have seen), and its own order of the configurations (drift hits all alike).
            for round_index in range(args.sweep_rounds):
                first = round_index * 2 * concurrency
                jobs = [
                    (f"sw{concurrency}-{round_index}-{i}", [("user", pool[i % len(pool)]["turns"][0])])
                    for i in range(first, first + 2 * concurrency)
                ]
                for t in rotate(chosen, turn + round_index):
                    rounds[t.label].append(t.run(jobs, concurrency, args.sweep_tokens, args.request_timeout))
                    logger.info(
                        "concurrency %d, round %d / %s: %.1f tok/s",
                        concurrency,
                        round_index + 1,
                        t.label,
                        rounds[t.label][-1]["tok_s"],
                    )
            sweep[concurrency] = {label: merge_rounds(runs) for label, runs in rounds.items()}
        report["sweep"] = {"dtype": sweep_dtype, "levels": sweep}

        report["num_outputs_differing"] = {
            dtype: {
                label: sum(
                    t.outputs[k] != by_proposer["none"].outputs[k]
                    for k in by_proposer["none"].outputs
                    if k in t.outputs
                )
                for label, t in by_proposer.items()
                if label != "none"
            }
            for dtype, by_proposer in targets.items()
            if "none" in by_proposer
        }
    strip_texts(report)
    summarize(report)
    print_report(report)
    save("eagle3", report)


def merge_rounds(runs: list[dict]) -> dict:
    """One configuration's rounds at a concurrency level as one run (tokens over wall time, counters summed),
    with each round's tok/s beside it."""
    tokens, wall_s = sum(r["num_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    by_k = [
        sum(r["num_sequence_steps_by_k"][k] for r in runs if k < len(r["num_sequence_steps_by_k"]))
        for k in range(max(len(r["num_sequence_steps_by_k"]) for r in runs))
    ]
    drafted, accepted = sum(r["num_drafted"] for r in runs), sum(r["num_accepted"] for r in runs)
    return {
        "num_requests": sum(r["num_requests"] for r in runs),
        "num_tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s,
        "round_tok_s": [r["tok_s"] for r in runs],
        "num_steps": sum(r["num_steps"] for r in runs),
        "num_sequence_steps_by_k": by_k,
        "mean_k": mean_k(by_k),
        "num_drafted": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        **{
            key: sum(r[key] for r in runs)
            for key in ("worker_step_s", "propose_s", "predicted_step_s", "measured_step_s")
        },
    }


def summarize(report: dict) -> None:
    """Per dtype and proposer: speedups over none (geomeans), tokens per forward, acceptance, propose share."""
    summary = {}
    for dtype, by_category in report["batch1"].items():
        if not by_category:  # --prompts-per-category 0
            continue
        summary[dtype] = {}
        labels = next(iter(by_category.values())).keys()
        for label in labels:
            runs = [by_category[c][label] for c in by_category]
            speedups = {c: by_category[c][label]["tok_s"] / by_category[c]["none"]["tok_s"] for c in by_category}
            tokens = sum(r["num_tokens"] for r in runs)
            steps = sum(r["num_steps"] for r in runs)
            per_pos = [
                sum(r["num_accepted_per_pos"][i] if i < len(r["num_accepted_per_pos"]) else 0 for r in runs)
                for i in range(max(len(r["num_accepted_per_pos"]) for r in runs))
            ]
            worker_s = sum(r["worker_step_s"] for r in runs)
            summary[dtype][label] = {
                "speedup_geomean_mt_bench": geomean([speedups[c] for c in MT_CATEGORIES if c in speedups]),
                "speedup_geomean_all": geomean(list(speedups.values())),
                "speedup_by_category": speedups,
                "tok_s": tokens / sum(r["wall_s"] for r in runs),
                "tokens_per_forward": tokens / steps if steps else None,
                "num_accepted_per_pos": per_pos,
                "acceptance_rate": (
                    sum(r["num_accepted"] for r in runs) / sum(r["num_drafted"] for r in runs)
                    if sum(r["num_drafted"] for r in runs)
                    else None
                ),
                "propose_share": sum(r["propose_s"] for r in runs) / worker_s if worker_s else None,
            }
    report["summary"] = summary
    levels = report["sweep"]["levels"]
    report["sweep"]["ratio_to_none"] = {
        c: {label: run["tok_s"] / by_label["none"]["tok_s"] for label, run in by_label.items()}
        for c, by_label in levels.items()
        if "none" in by_label
    }
    report["sweep"]["round_ratios_to_none"] = {
        c: {
            label: [tok_s / none for tok_s, none in zip(run["round_tok_s"], by_label["none"]["round_tok_s"])]
            for label, run in by_label.items()
        }
        for c, by_label in levels.items()
        if "none" in by_label
    }


def print_report(report: dict) -> None:
    for dtype, by_label in report["summary"].items():
        print(
            f"\n== batch 1, {dtype}: {len(report['categories'])} categories x "
            f"{report['args']['prompts_per_category']} prompts x {report['args']['new_tokens']} tokens"
        )
        print(
            f"{'proposer':16} {'MT-Bench x':>10} {'all x':>7} {'tok/s':>7} {'tok/fwd':>8} {'accept':>7} "
            f"{'propose':>8}  accepted by position"
        )
        for label, s in by_label.items():
            accept = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
            share = f"{s['propose_share']:.1%}" if s["propose_share"] is not None else "-"
            print(
                f"{label:16} {s['speedup_geomean_mt_bench']:10.2f} {s['speedup_geomean_all']:7.2f} {s['tok_s']:7.1f} "
                f"{s['tokens_per_forward'] or 0:8.2f} {accept:>7} {share:>8}  {s['num_accepted_per_pos']}"
            )
        print("per category (x none):")
        for label, s in by_label.items():
            print(f"  {label:16} " + " ".join(f"{c[:6]}={v:.2f}" for c, v in s["speedup_by_category"].items()))
    print(f"\n== concurrency ({report['sweep']['dtype']}), throughput x none")
    for c, ratios in report["sweep"]["ratio_to_none"].items():
        rounds = report["sweep"]["round_ratios_to_none"][c]

        def spread(label: str) -> str:  # each round's ratio, where there were several
            return f" ({' '.join(f'{x:.2f}' for x in rounds[label])})" if len(rounds[label]) > 1 else ""

        print(f"  {c:3}: " + "  ".join(f"{label}={r:.2f}{spread(label)}" for label, r in ratios.items()))
        for label, run in report["sweep"]["levels"][c].items():
            if run["num_drafted"]:
                print(
                    f"       {label}: mean k {run['mean_k']:.2f}, acceptance {run['acceptance_rate']:.2f}, "
                    f"{run['num_tokens'] / run['num_steps']:.2f} tokens a step, proposing "
                    f"{run['propose_s'] / run['worker_step_s']:.1%} of worker time, step time predicted / "
                    f"measured {run['predicted_step_s'] / run['measured_step_s']:.2f}"
                )
    print(f"\noutputs differing from no speculation: {report['num_outputs_differing']}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--proposers",
        type=lambda s: s.split(";"),
        default=PROPOSERS,
        help="configurations, ';'-separated (default: none;ngram;suffix;eagle3;eagle3,suffix)",
    )
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"])
    parser.add_argument(
        "--common-flags", default="--kv-cache-memory-gib 0.5", help="flags added to every configuration"
    )
    parser.add_argument("--prompts-per-category", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[1, 4, 8, 16],
        help="levels of the concurrency sweep ('': no sweep)",
    )
    parser.add_argument(
        "--sweep-configs",
        type=lambda s: s.split(";"),
        default=None,
        help="the configurations of the concurrency sweep, from --proposers (default: those of "
        "none;eagle3;eagle3,suffix that --proposers runs)",
    )
    parser.add_argument("--sweep-tokens", type=int, default=64)
    parser.add_argument(
        "--sweep-rounds",
        type=int,
        default=1,
        help="each concurrency level this many times, every configuration once a round (default: 1)",
    )
    parser.add_argument("--request-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.sweep_configs is None:
        args.sweep_configs = [p for p in ("none", "eagle3", "eagle3,suffix") if p in args.proposers]
    missing = [p for p in args.sweep_configs if p not in args.proposers]
    if missing:
        parser.error(f"--sweep-configs {';'.join(missing)}: not among --proposers {';'.join(args.proposers)}")
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(parse_args())
