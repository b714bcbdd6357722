"""What an extra query row costs: SmolLM2 forwards of 1..8 rows of one sequence, per dtype and activations.

    .venv/bin/python bench/bench_rows.py [--context 300] [--repeats 5] [--rounds 9]

Speculation's gain on the CPU is bounded by what a verify row costs beside a
decode row: a step of k drafts is a forward of k + 1 rows of one sequence. Per
configuration (q4_1 is the shipped GGUF's blocks, its output layer q8_0; `int8`
and `fp32` are --quantized-activations; `bf16-kv` is --kv-cache-dtype bfloat16), the median forward time of R rows over
--context cached tokens, R = 1..8, and each R's time over R = 1's; the same for
the fastest forward (on a shared machine a neighbour's bursts inflate medians,
rarely minimums). Every round runs every row count on every configuration in
turn (the same cached prefix, the query rows rewritten in place), so a slow
spell of the machine falls on all of them alike; "per round" is the median
over the rounds of R's median over 1's in the same round.
Saves JSON under bench/results/ and prints the CPU's model name.
"""

import argparse
import logging
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_linear import cpu_name, forward_ms  # noqa: E402
from bench.common import save  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402

CONFIGS = {  # name: (dtype, quantized activations, KV cache dtype)
    "q4_1 int8": ("q4_1", "int8", "auto"),
    "q4_1 int8 bf16-kv": ("q4_1", "int8", "bfloat16"),
    "q4_1 fp32": ("q4_1", "fp32", "auto"),
    "q8_0 int8": ("q8_0", "int8", "auto"),
    "bfloat16": ("bfloat16", "int8", "auto"),
    "float32": ("float32", "int8", "auto"),
}
ROWS = (1, 2, 3, 4, 5, 6, 8)
BLOCK_SIZE = 16


def row_chunks(runner: ModelRunner, context: int) -> dict[int, list[SequenceChunk]]:
    """Per row count R, the chunk of R query rows after `context` cached tokens of one sequence (computed once
    here): every R's forward rewrites the same positions' K/V, so the cache state does not change."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, runner.vocab_size, (context + max(ROWS),), generator=generator).tolist()
    blocks = -(-len(tokens) // BLOCK_SIZE)
    runner.init_cache(blocks, BLOCK_SIZE)
    table = list(range(blocks))
    runner.forward([SequenceChunk(tokens[:context], 0, table, num_logits=0)])
    return {r: [SequenceChunk(tokens[context : context + r], context, table, num_logits=r)] for r in ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the query rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per workload and round")
    parser.add_argument("--rounds", type=int, default=9, help="times every workload runs on every config in turn")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = fetch_default_model()
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, SmolLM2-135M, context {args.context}", flush=True)
    runners, chunks = {}, {}
    for name in args.configs:
        dtype, activations, kv_cache_dtype = CONFIGS[name]
        runners[name] = ModelRunner(
            load_model(path, dtype), quantized_activations=activations, kv_cache_dtype=kv_cache_dtype
        )
        chunks[name] = row_chunks(runners[name], args.context)
    samples = {name: {rows: [] for rows in ROWS} for name in runners}
    round_ratios = {name: {rows: [] for rows in ROWS} for name in runners}
    for number in range(args.rounds):
        this_round = {name: {} for name in runners}
        for rows in ROWS:
            for name, runner in runners.items():
                this_round[name][rows] = forward_ms(runner, chunks[name][rows], args.repeats)
                samples[name][rows] += this_round[name][rows]
        for name in runners:
            one = statistics.median(this_round[name][1])
            for rows in ROWS:
                round_ratios[name][rows].append(statistics.median(this_round[name][rows]) / one)
        print(f"  round {number + 1} of {args.rounds}", flush=True)
    times = {name: {rows: statistics.median(samples[name][rows]) for rows in ROWS} for name in runners}
    fastest = {name: {rows: min(samples[name][rows]) for rows in ROWS} for name in runners}
    ratios = {name: {rows: statistics.median(round_ratios[name][rows]) for rows in ROWS} for name in runners}
    for title, table in (("median", times), ("fastest", fastest)):
        print(f"\n{title:12}" + "".join(f" {f'{r} rows':>9}" for r in ROWS) + "   (ms; x: over 1 row)")
        for name in runners:
            one = table[name][1]
            print(f"{name:12}" + "".join(f" {table[name][r]:>9.2f}" for r in ROWS))
            print(f"{'':12}" + "".join(f" {table[name][r] / one:>8.2f}x" for r in ROWS))
    print(f"\n{'per round':12}" + "".join(f" {f'{r} rows':>9}" for r in ROWS) + "   (median of each round's ratio)")
    for name in runners:
        print(f"{name:12}" + "".join(f" {ratios[name][r]:>8.2f}x" for r in ROWS))
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
            "per_round_ratio": {name: {str(r): x for r, x in by_rows.items()} for name, by_rows in ratios.items()},
        },
    )


if __name__ == "__main__":
    main()
