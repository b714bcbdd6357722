"""The CPU kernels of the working tree against a git revision's, in whole forwards of the default model.

    .venv/bin/python bench/bench_kernel_revisions.py --rev cd3eabb [--dtype q4_1] [--context 300] [--rounds 3]

Builds kernels/csrc (the linear, attention and layer-op kernels) as the revision had it
and as the working tree has it, and times the default model's forward with one
build or the other swapped in (the kernels' callers look them up at every
call), on the same packed weights and KV cache: rows 1, 2, 3, 5 and 8 (--rows) of one
sequence (of each of --seqs) at --context cached tokens (a decode, and verifies of k = 1, 2, 4, 7).
Every round runs every row count on both builds in turn; the median over the
rounds is printed with the ratio (working tree / revision). Each build's
logits are checked equal: these kernels promise the same bits whatever
instructions compute them, so a revision that changed only their speed must
give the same logits.

Prints the CPU's model name; saves JSON under bench/results/.
"""

import argparse
import logging
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_linear import cpu_name  # noqa: E402
from bench.common import ROOT, save  # noqa: E402
from kernels import layer_ops_cpu, linear_cpu, paged_attention_cpu  # noqa: E402
from kernels.cpu_build import SOURCE_DIR, KernelBuildError, load_library  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402

ROWS = (1, 2, 3, 5, 8)
BLOCK_SIZE = 16


def builds_of(source_dir: pathlib.Path) -> tuple:
    """(linear library, attention function, layer-ops library) built from one copy of kernels/csrc. An attention
    kernel from before its cache dtype argument (--kv-cache-dtype) has another signature than the one the working
    tree's layer loop calls (and before e304d3b it could not read the transposed keys the caches keep), and a
    layer loop from before it takes other arguments: then the working tree's is used for both, and said so."""
    linear = linear_cpu.bind(load_library("linear_cpu", source_dir=source_dir))
    try:
        attention = paged_attention_cpu.bind(load_library("paged_attention_cpu", source_dir=source_dir))
    except KernelBuildError as exc:
        print(f"the revision's attention kernel is not compared ({exc}): the working tree's runs in both")
        attention = paged_attention_cpu.kernel()
    layers = layer_ops_cpu.bind(load_library("layer_ops_cpu", source_dir=source_dir))
    if not hasattr(layers, "specdec_llama_layers") or layer_loop_differs(source_dir):
        print("the revision's layer ops are not compared (another layer loop): the working tree's run in both")
        layers = layer_ops_cpu.c_library()
    return linear, attention, layers


def layer_loop_differs(source_dir: pathlib.Path) -> bool:
    """Whether a copy of kernels/csrc declares the layer loop's arguments otherwise than the working tree."""

    def declarations(path: pathlib.Path) -> str:
        text = path.read_text()
        return text[text.index("struct LinearArgs") : text.index("static int project")]

    return declarations(source_dir / "layer_ops_cpu.c") != declarations(SOURCE_DIR / "layer_ops_cpu.c")


def use(build: tuple) -> None:
    linear_cpu.c_library = lambda: build[0]
    paged_attention_cpu.kernel = lambda: build[1]
    layer_ops_cpu.c_library = lambda: build[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--dtype", default="q4_1")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=25, help="timed forwards per row count, build and round")
    parser.add_argument("--rows", type=lambda text: [int(n) for n in text.split(",")], default=list(ROWS))
    parser.add_argument("--seqs", type=int, default=1, help="sequences in each forward, each with those rows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "kernels/csrc"], capture_output=True)
        if archive.returncode != 0:
            sys.exit(f"git archive {args.rev} kernels/csrc failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        builds = {
            args.rev: builds_of(pathlib.Path(tmp) / "kernels" / "csrc"),
            "working tree": (linear_cpu.c_library(), paged_attention_cpu.kernel(), layer_ops_cpu.c_library()),
        }
    runner = ModelRunner(load_model(fetch_default_model(), args.dtype))
    blocks = -(-(args.context + max(args.rows)) // BLOCK_SIZE)  # a sequence's
    runner.init_cache(blocks * args.seqs, BLOCK_SIZE)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(args.seqs)]
    generator = torch.Generator().manual_seed(0)
    length = args.context + max(args.rows)
    tokens = [torch.randint(3, runner.vocab_size, (length,), generator=generator).tolist() for _ in tables]
    for seq_tokens, table in zip(tokens, tables):
        runner.forward([SequenceChunk(seq_tokens[: args.context], 0, table, num_logits=0)])
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, SmolLM2-135M in {args.dtype}, {args.seqs} sequences of "
        f"context {args.context}; ms per forward, median of {args.rounds} rounds x {args.repeats}"
    )
    samples: dict[tuple[int, str], list[float]] = {}
    logits: dict[tuple[int, str], torch.Tensor] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            chunks = [
                SequenceChunk(seq_tokens[args.context : args.context + rows], args.context, table, num_logits=rows)
                for seq_tokens, table in zip(tokens, tables)
            ]
            for name, build in builds.items():
                use(build)
                logits[rows, name] = runner.forward(chunks)  # warm-up; rewrites the same K/V
                start = time.perf_counter()
                for _ in range(args.repeats):
                    runner.forward(chunks)
                samples.setdefault((rows, name), []).append((time.perf_counter() - start) / args.repeats * 1e3)
    results = []
    print(f"{'rows':>4} {args.rev + ' ms':>14} {'working tree ms':>16} {'ratio':>6}  same logits")
    for rows in args.rows:
        old, new = (statistics.median(samples[rows, name]) for name in builds)
        same = torch.equal(logits[rows, args.rev], logits[rows, "working tree"])
        print(f"{rows:>4} {old:>14.2f} {new:>16.2f} {new / old:>6.2f}  {same}")
        results.append({"rows": rows, "revision_ms": old, "working_tree_ms": new, "same_logits": same})
    save(
        "kernel-revisions",
        {
            "cpu": cpu_name(),
            "rev": args.rev,
            "seqs": args.seqs,
            "dtype": args.dtype,
            "context": args.context,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
