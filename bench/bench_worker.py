"""Plain decoding speed of the worker vs `transformers` generate, and the multi-token query cost.

    .venv/bin/python bench/bench_worker.py [--dtype float32] [--repeats 3] [--new-tokens 128]

Prints and saves (bench/results/) for SmolLM2, in one run:
- transformers generate, batch 1, greedy, 128 new tokens (median of repeats);
- the worker's plain decoding tokens/s at batch 1 and batch 8 (aggregate);
- one forward of a 5-token query over a 300-token cached prefix vs a 1-token decode step.
"""

import argparse
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import chat_ids, load_questions, median_time, save  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model, load_tokenizer  # noqa: E402
from worker_service.runtime.runner import SequenceChunk  # noqa: E402
from worker_service.speculation.build import build_worker  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 1024


def bench_transformers(model_path, prompt_ids, new_tokens, repeats):
    model = load_model(model_path, ARGS.dtype)
    ids = torch.tensor([prompt_ids])

    def run():
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    run()  # warm-up
    return new_tokens / median_time(run, repeats)


def bench_worker(worker, prompts, new_tokens, repeats):
    def run():
        Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(prompts, new_tokens)

    run()
    return len(prompts) * new_tokens / median_time(run, repeats)


def bench_query_cost(worker, repeats=30):
    """Time of one forward: a 5-token query vs a 1-token decode, both over a 300-token cached prefix."""
    runner = worker.target
    prefix = list(range(1000, 1300))
    table = list(range(0, -(-310 // BLOCK_SIZE)))
    runner.forward([SequenceChunk(prefix, 0, table, num_logits=1)])
    decode = [SequenceChunk([42], 300, table, num_logits=1)]
    query = [SequenceChunk([42, 43, 44, 45, 46], 300, table, num_logits=5)]
    for chunks in (decode, query):
        runner.forward(chunks)
    t_decode = median_time(lambda: runner.forward(decode), repeats)
    t_query = median_time(lambda: runner.forward(query), repeats)
    return t_decode * 1e3, t_query * 1e3


def main():
    model_path = str(fetch_default_model())
    tokenizer = load_tokenizer(model_path)
    questions = load_questions(categories=["writing", "qa", "summarization", "translation"], per_category=2)
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in questions[:8]]
    results = {"dtype": ARGS.dtype, "new_tokens": ARGS.new_tokens, "repeats": ARGS.repeats}
    results["transformers_b1_tok_s"] = bench_transformers(model_path, prompts[0], ARGS.new_tokens, ARGS.repeats)
    logging.info("transformers generate batch 1: %.1f tok/s", results["transformers_b1_tok_s"])
    worker = build_worker(WorkerConfig(model=model_path, dtype=ARGS.dtype))
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    results["worker_b1_tok_s"] = bench_worker(worker, prompts[:1], ARGS.new_tokens, ARGS.repeats)
    logging.info("worker batch 1: %.1f tok/s", results["worker_b1_tok_s"])
    results["worker_b8_tok_s"] = bench_worker(worker, prompts, ARGS.new_tokens, ARGS.repeats)
    logging.info("worker batch 8: %.1f tok/s", results["worker_b8_tok_s"])
    t_decode, t_query = bench_query_cost(worker)
    results.update(decode_step_ms=t_decode, query5_step_ms=t_query, query5_over_decode=t_query / t_decode)
    print(
        f"\nSmolLM2-135M, {ARGS.dtype}, {torch.get_num_threads()} threads, {ARGS.new_tokens} new tokens, "
        f"median of {ARGS.repeats}"
    )
    print(f"  transformers generate  batch 1: {results['transformers_b1_tok_s']:7.1f} tok/s")
    print(
        f"  worker plain decoding  batch 1: {results['worker_b1_tok_s']:7.1f} tok/s "
        f"({results['worker_b1_tok_s'] / results['transformers_b1_tok_s']:.2f}x transformers)"
    )
    print(
        f"  worker plain decoding  batch 8: {results['worker_b8_tok_s']:7.1f} tok/s aggregate "
        f"({results['worker_b8_tok_s'] / results['transformers_b1_tok_s']:.2f}x transformers batch 1)"
    )
    print(
        f"  forward at a 300-token context: 1-token decode {t_decode:.1f} ms, 5-token query {t_query:.1f} ms "
        f"-> {t_query / t_decode:.2f}x"
    )
    save("worker", results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    ARGS = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
