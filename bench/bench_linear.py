"""What batch invariance costs: SmolLM2 forwards with our linear kernel vs the library's, side by side.

    .venv/bin/python bench/bench_linear.py [--repeats 7] [--context 256]
    .venv/bin/python bench/bench_linear.py --build no-prefetch=-DPREFETCH_BYTES=0 --rounds 5   # two builds

One ModelRunner per (dtype, linear): "invariant" is the worker's own
(kernels/linear_cpu.py: every output a fixed chain of FMAs), "library" keeps
`torch.nn.Linear` (MKL / oneDNN, whatever torch picks on this CPU: AMX for bf16
on the Intel kind), which is not batch invariant. Both use the same attention
kernel. Per workload, the median forward time in ms over --repeats runs:

- decode B: B sequences, one new token each, over --context cached tokens;
- verify BxR: B sequences, R query rows each (a k = R - 1 speculation step);
- prefill N: one prompt of N tokens from an empty cache.

`--build NAME=CFLAGS` adds our kernel built with extra compiler flags (e.g. a
-D that kernels/csrc/linear_cpu.c reads) as another column, so two builds are
compared in one run; `--rounds` repeats every workload on every runner in turn
(a noisy neighbour slows them alike) and keeps each one's median.

Saves JSON under bench/results/ and prints the CPU's model name.
"""

import argparse
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from kernels import linear_cpu  # noqa: E402
from kernels.cpu_build import load_library  # noqa: E402
from worker_service.runtime import runner as model_runner_module  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402

BLOCK_SIZE = 16
WORKLOADS = [
    ("decode", 1, 1),
    ("decode", 4, 1),
    ("decode", 16, 1),
    ("verify", 1, 2),
    ("verify", 1, 4),
    ("verify", 1, 6),
    ("verify", 8, 6),
    ("verify", 16, 6),
    ("prefill", 1, 512),
    ("prefill", 1, 2048),
]
logger = logging.getLogger("bench.linear")


def cpu_name() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def make_runner(path, dtype: str, invariant: bool) -> ModelRunner:
    if invariant:
        return ModelRunner(load_model(path, dtype))
    original = model_runner_module.pack_linears
    model_runner_module.pack_linears = lambda model, *args: 0  # keeps torch.nn.Linear
    try:
        return ModelRunner(load_model(path, dtype))
    finally:
        model_runner_module.pack_linears = original


def workload_chunks(runner: ModelRunner, kind: str, num_seqs: int, rows: int, context: int) -> list[SequenceChunk]:
    """The chunks of one workload, with their cached prefixes already computed."""
    generator = torch.Generator().manual_seed(0)
    cached = 0 if kind == "prefill" else context
    total = cached + rows
    num_blocks = -(-total // BLOCK_SIZE)
    runner.init_cache(num_blocks * num_seqs, BLOCK_SIZE)
    chunks = []
    for seq in range(num_seqs):
        tokens = torch.randint(3, runner.vocab_size, (total,), generator=generator).tolist()
        table = list(range(seq * num_blocks, (seq + 1) * num_blocks))
        if cached:
            runner.forward([SequenceChunk(tokens[:cached], 0, table, num_logits=0)])
        chunks.append(SequenceChunk(tokens[cached:], cached, table, num_logits=1 if kind == "prefill" else rows))
    return chunks


def forward_ms(runner: ModelRunner, chunks: list[SequenceChunk], repeats: int, library=None) -> list[float]:
    """`repeats` timed forwards after a warm-up; `library`: another build of our kernel (load_library's)."""
    original = linear_cpu.c_library
    if library is not None:
        linear_cpu.c_library = lambda: library  # the kernel's callers look it up at every call
    try:
        runner.forward(chunks)  # warm-up (rewrites the same K/V: the cache state does not change)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(chunks)
            times.append((time.perf_counter() - start) * 1e3)
        return times
    finally:
        linear_cpu.c_library = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence for decode/verify")
    parser.add_argument("--rounds", type=int, default=1, help="times every workload runs on every runner in turn")
    parser.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="NAME=CFLAGS",
        help="also our kernel built with these extra flags (space-separated), as column NAME",
    )
    args = parser.parse_args()
    builds = {}
    for spec in args.build:
        name, _, flags = spec.partition("=")
        builds[name] = linear_cpu.bind(load_library("linear_cpu", tuple(flags.split())))
    logging.basicConfig(level=logging.WARNING)
    path = fetch_default_model()
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, SmolLM2-135M, context {args.context}, median of {args.repeats}")
    results = []
    for dtype in ("float32", "bfloat16"):
        runners = {name: make_runner(path, dtype, name == "invariant") for name in ("invariant", "library")}
        runners.update({name: runners["invariant"] for name in builds})  # the same packed weights
        print(
            f"\n{dtype:10} {'workload':14} {'rows':>5} {'invariant ms':>13} {'library ms':>11} {'ratio':>6}"
            + "".join(f" {name + ' ms':>14} {'ratio':>6}" for name in builds)
        )
        for kind, num_seqs, rows in WORKLOADS:
            label = (
                f"{kind} {num_seqs}"
                if kind == "decode"
                else f"{kind} {num_seqs}x{rows}"
                if kind == "verify"
                else f"{kind} {rows}"
            )
            chunks = {
                name: workload_chunks(runner, kind, num_seqs, rows, args.context)
                for name, runner in runners.items()
                if name not in builds
            }
            samples = {name: [] for name in runners}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    samples[name] += forward_ms(
                        runner, chunks.get(name, chunks["invariant"]), args.repeats, builds.get(name)
                    )
            times = {name: statistics.median(values) for name, values in samples.items()}
            ratio = times["invariant"] / times["library"]
            print(
                f"{'':10} {label:14} {num_seqs * rows:>5} {times['invariant']:>13.2f} {times['library']:>11.2f} "
                f"{ratio:>6.2f}"
                + "".join(f" {times[name]:>14.2f} {times[name] / times['invariant']:>6.2f}" for name in builds)
            )
            results.append({"dtype": dtype, "workload": label, "rows": num_seqs * rows, **times, "ratio": ratio})
    save(
        "linear",
        {
            "cpu": cpu,
            "threads": torch.get_num_threads(),
            "context": args.context,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "builds": args.build,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
