"""What a served run's steps cost: the scheduler's DEBUG step lines, fitted as the speculation policy fits them.

    .venv/bin/python -m specdec serve --log-level DEBUG --port 50081 --proposer eagle3,suffix 2> serve.log &
    .venv/bin/python bench/bench_serving.py --address 127.0.0.1:50081 --concurrency 16,8 --max-tokens 64
    .venv/bin/python bench/step_trace.py serve.log [--proposing-ms 8]

Reads every `step N: R decode rows (D drafts), P prefill rows, S seqs, A attended: T ms (proposing X),
predicted Y` line (scheduler_service/core/scheduler.py writes them) and replays them into the policy's own
step-cost model (scheduler_service/core/goodput.py, StepCostModel: relative errors, here with no forgetting,
so over the whole run). Prints its coefficients (a decoding sequence costs c_row + c_seq, each draft row
c_row), then splits the decode steps by the time their proposers took (a model proposer such as an EAGLE-3
head takes far more than a copy): how many, their mean proposing time, and how far the policy's prediction
made before each step (the trace's `predicted`) was from the measured time. Saves JSON under bench/results/.
"""

import argparse
from pathlib import Path
import re
import statistics
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import save  # noqa: E402
from scheduler_service.core.goodput import StepCostModel  # noqa: E402

# The line scheduler_service/core/scheduler.py logs (Scheduler._observe; test_debug_log_traces_each_steps_shape_and_time
# pins its wording).
STEP_LINE = re.compile(
    r"step (\d+): (\d+) decode rows \((\d+) drafts\), (\d+) prefill rows, (\d+) seqs, "
    r"(\d+) attended: ([\d.]+) ms \(proposing ([\d.]+)\), predicted (?:([\d.]+) ms|-)"
)


def read_steps(path: str) -> list[dict]:
    steps = []
    for line in open(path, encoding="utf-8", errors="replace"):
        m = STEP_LINE.search(line)
        if m:
            rows, drafts, prefill_rows, seqs, attended = map(int, m.groups()[1:6])
            steps.append(
                {
                    "rows": rows,
                    "drafts": drafts,
                    "prefill_rows": prefill_rows,
                    "seqs": seqs,
                    "attended": attended,
                    "ms": float(m[7]),
                    "proposing_ms": float(m[8]),
                    "predicted_ms": float(m[9]) if m[9] else None,
                }
            )
    return steps


def describe(steps: list[dict]) -> dict:
    with_prediction = [s for s in steps if s["predicted_ms"]]
    errors = [s["predicted_ms"] / s["ms"] - 1 for s in with_prediction]
    return {
        "steps": len(steps),
        "mean_proposing_ms": statistics.fmean(s["proposing_ms"] for s in steps) if steps else None,
        "median_prediction_error": statistics.median(errors) if errors else None,
    }


def main(args) -> None:
    try:
        steps = read_steps(args.log)
    except OSError as exc:
        sys.exit(f"cannot read {args.log}: {exc.strerror}")
    if not steps:
        sys.exit(f"{args.log}: no step lines (was the server run with --log-level DEBUG?)")
    model = StepCostModel(decay=1.0)
    for s in steps:
        model.observe(s["rows"], s["prefill_rows"], s["seqs"], s["attended"], s["ms"])
    coefficients = model.coefficients()
    decodes = [s for s in steps if s["prefill_rows"] == 0 and s["seqs"] >= args.min_seqs]
    heavy = [s for s in decodes if s["proposing_ms"] > args.proposing_ms]
    light = [s for s in decodes if s["proposing_ms"] <= args.proposing_ms]
    results = {
        "args": vars(args),
        "coefficients": vars(coefficients) if coefficients else None,
        "decode_steps_proposing_above": describe(heavy),
        "decode_steps_proposing_below": describe(light),
    }
    print(f"{len(steps)} steps")
    if coefficients:
        c = coefficients
        print(
            f"fit: {c.c0:.2f} ms + {c.c_row:.2f} ms a decode row + {c.c_seq:.2f} ms a sequence + "
            f"{c.c_prefill:.3f} ms a prefill row + {c.c_ctx:.2f} ms per 1,024 attended"
        )
        print(f"  a decoding sequence {c.c_row + c.c_seq:.2f} ms, each draft row {c.c_row:.2f} ms")
    for name, group in (("above", heavy), ("at or below", light)):
        d = describe(group)
        if d["steps"]:
            error = d["median_prediction_error"]
            print(
                f"decode steps of >= {args.min_seqs} seqs with proposing {name} {args.proposing_ms} ms: "
                f"{d['steps']}, proposing {d['mean_proposing_ms']:.1f} ms on average, predicted "
                + ("-" if error is None else f"{100 * error:+.0f}% (median)")
            )
    save("step-trace", results)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("log", help="a server's log written with --log-level DEBUG")
    parser.add_argument(
        "--proposing-ms",
        type=float,
        default=8.0,
        help="decode steps whose proposers took longer than this are counted apart",
    )
    parser.add_argument("--min-seqs", type=int, default=1, help="only decode steps of at least this many sequences")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
