"""What the worker's verify stage costs a step, with the sampler's CPU kernels and with torch's ops alone.

After the forward, a step picks its tokens: the target's argmax per row (greedy), or per sampled row an
exponential race of its probabilities against keyed Exp(1) noise (worker_service/speculation/verify.py,
kernels/rejection_sampler.py). On the CPU those vocabulary-wide passes go through kernels/sampling_cpu.py (an
argmax, the softmax, top-k / top-p, the noise, the race, and a sampled row as one pass); the "torch" runs
take the same steps with torch's ops instead (the C library switched off in this process), the sampler's
code before those kernels. Both give the same tokens (checked here), except that top-p's cut may fall a tail token
apart (a rounding of the mass above it), which changes a sampled token now and then.

Drives the in-process worker (SmolLM2, --dtype, an n-gram proposer at k = --k) over Spec-Bench prompts from
../shared/data at batch 1 and --batch, greedy, sampled (temperature 0.8, one seed per request) and sampled
with top_p 0.9, each configuration in turn in every round; prints the medians of the steps' verify and total
times (the worker's StepStats) and the kernels' time over torch's. Prints the CPU's model name; saves JSON
under bench/results/.

    .venv/bin/python bench/bench_verify.py [--rounds 3] [--new-tokens 64] [--batch 8] [--k 5]
"""

import argparse
import contextlib
import logging
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_linear import cpu_name  # noqa: E402
from bench.common import chat_ids, load_questions, save  # noqa: E402
from kernels import sampling_cpu  # noqa: E402
import kernels.rejection_sampler  # noqa: E402
from specdec import step  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_tokenizer  # noqa: E402
from worker_service.speculation import sampling, verify  # noqa: E402
from worker_service.speculation.build import build_worker  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 4096, 16


@contextlib.contextmanager
def torch_ops_only():
    """The sampler as it was before kernels/sampling_cpu.py: torch's argmax, race and keyed uniforms."""

    def argmax(x):
        return x.argmax(dim=-1)

    def race(dist, noise):
        return torch.where(dist > 0, dist / noise, torch.full_like(dist, -1.0)).argmax(dim=-1)

    patches = [
        (sampling_cpu, "c_library", lambda: None),
        (verify, "argmax_last", argmax),
        (sampling, "argmax_last", argmax),
        (sampling, "top_k_top_p_rows", lambda *args: None),
        (kernels.rejection_sampler, "argmax_last", argmax),
        (kernels.rejection_sampler, "race_rows", race),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


MODES = {  # how every request of a workload samples
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
}


def run(worker, prompts: list[list[int]], new_tokens: int, k: int, mode: str):
    """One generation; returns (tokens, verify ms per step, step ms per step)."""
    seeded = MODES[mode]["temperature"] > 0
    samplings = [
        step.RequestSampling(**MODES[mode], **({"seed": 1000 + i} if seeded else {})) for i in range(len(prompts))
    ]
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    tokens = driver.generate(prompts, new_tokens, sampling=samplings, num_speculative_tokens=k)
    steps = [r for r in driver.results[1:-1] if r.outputs]  # the decode steps: not the prefill, not the release
    return tokens, [r.stats.verify_ms for r in steps], [r.stats.total_ms for r in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="q4_1")
    parser.add_argument("--k", type=int, default=5, help="drafts per step (n-gram)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    assert sampling_cpu.c_library() is not None, "the sampler's C kernel did not build here"
    path = str(fetch_default_model())
    tokenizer = load_tokenizer(path)
    questions = load_questions(categories=["summarization", "qa", "writing", "rag"], per_category=4)
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in questions[: args.batch]]
    worker = build_worker(WorkerConfig(model=path, dtype=args.dtype, proposer="ngram", num_speculative_tokens=args.k))
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, SmolLM2 {args.dtype}, n-gram k = {args.k}", flush=True)
    workloads = [(batch, mode) for batch in (1, args.batch) for mode in MODES]
    samples = {(w, impl): ([], []) for w in workloads for impl in ("kernels", "torch")}
    for number in range(args.rounds):
        for batch, mode in workloads:
            outputs = {}
            for impl in ("kernels", "torch") if number % 2 == 0 else ("torch", "kernels"):
                with torch_ops_only() if impl == "torch" else contextlib.nullcontext():
                    outputs[impl], verify_ms, step_ms = run(worker, prompts[:batch], args.new_tokens, args.k, mode)
                samples[(batch, mode), impl][0].extend(verify_ms)
                samples[(batch, mode), impl][1].extend(step_ms)
            if mode != "top_p 0.9":  # top-p's cut may fall a tail token apart (tests/kernels/test_sampling_cpu.py)
                assert outputs["kernels"] == outputs["torch"], f"the tokens differ at batch {batch}, {mode}"
        print(f"  round {number + 1} of {args.rounds}", flush=True)
    print(f"\n{'workload':24} {'verify ms: kernels':>19} {'torch':>7} {'x':>6}   {'step ms: kernels':>17} {'torch':>7}")
    results = {}
    for batch, mode in workloads:
        (kv, ks), (tv, ts) = samples[(batch, mode), "kernels"], samples[(batch, mode), "torch"]
        row = {
            "verify_ms": {"kernels": statistics.median(kv), "torch": statistics.median(tv)},
            "step_ms": {"kernels": statistics.median(ks), "torch": statistics.median(ts)},
        }
        name = f"batch {batch}, {mode}"
        results[name] = row
        v, s = row["verify_ms"], row["step_ms"]
        print(
            f"{name:24} {v['kernels']:>19.2f} {v['torch']:>7.2f} {v['kernels'] / v['torch']:>5.2f}x"
            f"   {s['kernels']:>17.2f} {s['torch']:>7.2f}"
        )
    save("verify", {"cpu": cpu, "threads": torch.get_num_threads(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
