"""fp32, bf16, q8_0 and q4_1 (int8 and fp32 activations), plain vs n-gram speculation, side by side, and
plain decoding against the memory bound.

    .venv/bin/python bench/bench_dtype.py [--prompts-per-category 5] [--new-tokens 128] [--k 5] [--repeats 1]

SmolLM2-135M-Instruct at batch 1, greedy, on the first N prompts of five
Spec-Bench categories (bench_spec.py's prompts and runner; every configuration
runs on a prompt before the next prompt starts). Two configurations per
dtype: plain, and n-gram k=K (q4_1 is the shipped GGUF's blocks, its output
layer q8_0). Prints tokens/s, tokens per target forward and speedups; the
number of outputs that differ from plain decoding in the same dtype (greedy
speculation is lossless: expect 0 in every dtype); and the memory-bandwidth
bound of plain decoding:

    bound step time = bytes of weights one forward reads / measured read bandwidth

where the bandwidth is the best of several full passes of `torch.sum` over a
buffer far larger than the caches (all threads), and the bytes are every
weight the forward multiplies with, as packed for the kernel (the embedding
table not: a lookup reads one row). The share reached = bound step time / the worker's measured decode step
time (`StepStats.total_ms`, prefill excluded); it is measured with the fast
CPU forward (worker_service/runtime/backends/cpu_llama.py) and, side by side, with
`transformers`' decoder layers on the same kernels. Saves JSON under
bench/results/.
"""

import argparse
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import bench_spec  # noqa: E402
from bench.common import chat_ids, load_questions, save  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.backends.transformers_layers import TransformersForward  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.fast_linear import PackedLinear  # noqa: E402
from worker_service.runtime.loader import load_model, load_tokenizer  # noqa: E402
from worker_service.runtime.runner import ModelRunner  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402
from worker_service.speculation.worker import Worker  # noqa: E402

# label: (--dtype, --quantized-activations); q8_0 and q4_1 take int8 activations by default, q4_1/fp32 exact ones
DTYPES = {
    "fp32": ("float32", "int8"),
    "bf16": ("bfloat16", "int8"),
    "q8_0": ("q8_0", "int8"),
    "q4_1": ("q4_1", "int8"),
    "q4_1/fp32": ("q4_1", "fp32"),
}
logger = logging.getLogger("bench.dtype")


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second `torch.sum` streams from memory (best of `repeats`)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(repeats))
    return num_bytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model) -> int:
    """Bytes of the weights one forward of a packed model (ModelRunner's) reads: the packed linears' (blocks
    for a quantized dtype) and every other parameter but the embedding table (a lookup reads one row)."""
    packed = sum(
        m.packed_weight.numel() * m.packed_weight.element_size() for m in model.modules() if isinstance(m, PackedLinear)
    )
    embedding = model.get_input_embeddings().weight
    return packed + sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


def build(path: str, k: int) -> tuple[dict, dict, dict]:
    """({config name: fn(prompt, new_tokens) -> Run}, {dtype label: weight bytes}, {config name: Worker})."""
    configs, weights, workers = {}, {}, {}
    for label, (dtype, activations) in DTYPES.items():
        runner = ModelRunner(load_model(path, dtype), quantized_activations=activations)
        weights[label] = weight_bytes(runner.model)
        for name, proposer, num_spec in ((f"{label} plain", "none", 0), (f"{label} k={k}", "ngram", k)):
            config = WorkerConfig(
                model=path,
                dtype=dtype,
                proposer=proposer,
                num_speculative_tokens=num_spec,
                quantized_activations=activations,
            )
            worker = Worker(config, runner)
            worker.init_cache(bench_spec.NUM_BLOCKS, bench_spec.BLOCK_SIZE)
            workers[name] = worker
    for kind, num_spec in (("plain", 0), (f"k={k}", k)):  # every dtype's plain, then every dtype's k
        for label in DTYPES:
            name = f"{label} {kind}"
            configs[name] = lambda p, n, w=workers[name], s=num_spec: bench_spec.run_ours(w, s, p, n)
    return configs, weights, workers


def plain_decode_step_ms(worker: Worker, prompts: list[list[int]], new_tokens: int) -> float:
    """Median worker step time of plain decodes (prefill steps excluded) over the prompts."""
    worker.init_cache(bench_spec.NUM_BLOCKS, bench_spec.BLOCK_SIZE)
    times = []
    for prompt in prompts:
        driver = Driver(worker.execute, bench_spec.BLOCK_SIZE, bench_spec.NUM_BLOCKS)
        driver.generate([prompt], new_tokens)
        times += [r.stats.total_ms for r in driver.results[1:]]
    return statistics.median(times)


def main(args) -> None:
    path = str(fetch_default_model())
    tokenizer = load_tokenizer(path)
    questions = load_questions(categories=list(bench_spec.CATEGORIES), per_category=args.prompts_per_category)
    questions.sort(key=lambda q: bench_spec.CATEGORIES.index(q["category"]))
    prompts = [(q["category"], chat_ids(tokenizer, q["turns"][0])) for q in questions]
    labels = [f"{q['category']}#{q['question_id']}" for q in questions]
    configs, weights, workers = build(path, args.k)
    runs = bench_spec.run_all(configs, prompts, args.new_tokens, args.repeats)
    table = {name: bench_spec.summarize(r, args.new_tokens) for name, r in runs.items()}
    bandwidth = read_bandwidth()
    # The plain decode step, measured again on its own (step times of the interleaved runs above include
    # prefills); a few prompts suffice.
    some = [p for _, p in prompts[:: max(len(prompts) // 5, 1)]]
    step_ms = {label: plain_decode_step_ms(workers[f"{label} plain"], some, args.new_tokens) for label in DTYPES}
    transformers_step_ms = {}
    for label in DTYPES:
        runner = workers[f"{label} plain"].target
        runner.backend, fast = TransformersForward(runner.model), runner.backend
        transformers_step_ms[label] = plain_decode_step_ms(workers[f"{label} plain"], some, args.new_tokens)
        runner.backend = fast
    bound_ms = {label: weights[label] / bandwidth * 1e3 for label in DTYPES}

    print(
        f"\nSmolLM2-135M, {torch.get_num_threads()} threads, batch 1, greedy, {len(prompts)} prompts "
        f"({args.prompts_per_category} per category), {args.new_tokens} new tokens, fastest of {args.repeats}"
    )
    print(f"  {'config':<12}{'tok/s':>8}{'tok/fwd':>9}{'accept':>8}{'vs fp32 plain':>15}{'vs fp32 k':>11}")
    spec_fp32 = table[f"fp32 k={args.k}"]["tok_s"]
    for name, row in table.items():
        accept = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        print(
            f"  {name:<12}{row['tok_s']:8.1f}{row['tokens_per_forward']:9.2f}{accept:>8}"
            f"{row['tok_s'] / table['fp32 plain']['tok_s']:14.2f}x{row['tok_s'] / spec_fp32:10.2f}x"
        )
    differ = {}
    for label in DTYPES:
        reference, spec = runs[f"{label} plain"], runs[f"{label} k={args.k}"]
        differ[label] = [
            labels[i]
            for i, (a, b) in enumerate(zip(spec, reference))
            if a.token_ids[: args.new_tokens] != b.token_ids[: args.new_tokens]
        ]
        print(
            f"  {label} k={args.k} outputs differing from {label} plain: {len(differ[label])} / {len(prompts)} "
            f"{' '.join(differ[label])}"
        )
    print(f"\nmemory bound: read bandwidth {bandwidth / 1e9:.1f} GB/s (torch.sum over 1 GiB)")
    for label in DTYPES:
        print(
            f"  {label}: {weights[label] / 1e6:.0f} MB of weights per forward -> bound {bound_ms[label]:.1f} ms "
            f"per decode step; measured {step_ms[label]:.1f} ms: {bound_ms[label] / step_ms[label]:.0%} of the bound "
            f"(transformers' layers: {transformers_step_ms[label]:.1f} ms, "
            f"{bound_ms[label] / transformers_step_ms[label]:.0%}; fast forward "
            f"{transformers_step_ms[label] / step_ms[label]:.2f}x)"
        )
    save(
        "dtype",
        {
            "args": vars(args),
            "prompts": labels,
            "table": table,
            "differ": differ,
            "read_bandwidth_bytes_s": bandwidth,
            "weight_bytes": weights,
            "bound_step_ms": bound_ms,
            "plain_decode_step_ms": step_ms,
            "transformers_plain_decode_step_ms": transformers_step_ms,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-category", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="rounds per prompt; each config's fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ARGS = parser.parse_args()
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(ARGS)
