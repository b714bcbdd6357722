"""What an extra query row costs: SmolLM2 forwards of 1..8 rows of one sequence, per dtype and activations.

    .venv/bin/python bench/bench_rows.py [--context 300] [--repeats 9] [--rounds 3]

Speculation's gain on the CPU is bounded by what a verify row costs beside a
decode row: a step of k drafts is a forward of k + 1 rows of one sequence. Per
configuration (q4_1 is the shipped GGUF's blocks, its output layer q8_0; `int8`
and `fp32` are --quantized-activations; `bf16-kv` is --kv-cache-dtype bfloat16), the median forward time of R rows over
--context cached tokens, R = 1..8, and each R's time over R = 1's; the same for
the fastest forward (on a shared machine a neighbour's bursts inflate medians,
rarely minimums). The configurations take turns --rounds times.
Saves JSON under bench/results/ and prints the CPU's model name.
"""

import argparse
import logging
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_linear import cpu_name, forward_ms, workload_chunks  # noqa: E402
from bench.common import save  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner  # noqa: E402

CONFIGS = {  # name: (dtype, quantized activations, KV cache dtype)
    "q4_1 int8": ("q4_1", "int8", "auto"),
    "q4_1 int8 bf16-kv": ("q4_1", "int8", "bfloat16"),
    "q4_1 fp32": ("q4_1", "fp32", "auto"),
    "q8_0 int8": ("q8_0", "int8", "auto"),
    "bfloat16": ("bfloat16", "int8", "auto"),
    "float32": ("float32", "int8", "auto"),
}
ROWS = (1, 2, 3, 4, 5, 6, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the query rows")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per workload and round")
    parser.add_argument("--rounds", type=int, default=3, help="times every workload runs on every config in turn")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = fetch_default_model()
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, SmolLM2-135M, context {args.context}", flush=True)
    runners = {}
    for name in args.configs:
        dtype, activations, kv_cache_dtype = CONFIGS[name]
        runners[name] = ModelRunner(
            load_model(path, dtype), quantized_activations=activations, kv_cache_dtype=kv_cache_dtype
        )
    times = {name: {} for name in runners}
    fastest = {name: {} for name in runners}
    for rows in ROWS:
        kind = "decode" if rows == 1 else "verify"
        chunks = {name: workload_chunks(runner, kind, 1, rows, args.context) for name, runner in runners.items()}
        samples = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                samples[name] += forward_ms(runner, chunks[name], args.repeats)
        for name in runners:
            times[name][rows] = statistics.median(samples[name])
            fastest[name][rows] = min(samples[name])
        print(f"  {rows} rows: " + ", ".join(f"{n} {times[n][rows]:.2f} ms" for n in runners), flush=True)
    for title, table in (("median", times), ("fastest", fastest)):
        print(f"\n{title:12}" + "".join(f" {f'{r} rows':>9}" for r in ROWS) + "   (ms; x: over 1 row)")
        for name in runners:
            one = table[name][1]
            print(f"{name:12}" + "".join(f" {table[name][r]:>9.2f}" for r in ROWS))
            print(f"{'':12}" + "".join(f" {table[name][r] / one:>8.2f}x" for r in ROWS))
    save(
        "rows",
        {
            "cpu": cpu,
            "threads": torch.get_num_threads(),
            "context": args.context,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "median_ms": {name: {str(r): t for r, t in by_rows.items()} for name, by_rows in times.items()},
            "fastest_ms": {name: {str(r): t for r, t in by_rows.items()} for name, by_rows in fastest.items()},
        },
    )


if __name__ == "__main__":
    main()
