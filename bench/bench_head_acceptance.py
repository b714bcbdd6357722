"""How often an EAGLE-3 head's first draft is accepted, by kind of prompt: text like its training data or not.

    .venv/bin/python bench/bench_head_acceptance.py                     # ~5 min on 2 cores
    .venv/bin/python bench/bench_head_acceptance.py --head DIR --dtypes q4_1,bfloat16,float32

The worker in-process, greedy, one draft every step (k = 1), --new-tokens tokens per prompt, on three sets:

- `self, empty turn`: --num-self-prompts prompts the target writes from an empty user turn (sampled with
  --seed: fresh ones, not a training run's), the kind the shipped head was trained on;
- `self, openers`: as many written after an opener (draft_training.prompts.SELF_PROMPT_OPENERS);
- `mt-bench`: the first turns of the eight MT-Bench categories of ../shared/data/spec_bench_dev.jsonl
  (--per-category each).

Prints, per set and --dtypes (the target's; the head is the same), the share of first drafts accepted: the
head's accuracy at position 1 on that text as the served head sees it. Not a speed benchmark. Results:
bench/results/head-acceptance-*.json.
"""

import argparse
import logging
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer  # noqa: E402

from bench.bench_goodput import MT_CATEGORIES  # noqa: E402
from bench.common import chat_ids, load_questions, save  # noqa: E402
from draft_training.prompts import SELF_PROMPT_OPENERS  # noqa: E402
from draft_training.train import BLOCK_SIZE, stop_token_ids, write_self_prompts  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import DEFAULT_EAGLE3_HEAD, fetch_default_model  # noqa: E402
from worker_service.speculation.build import build_worker  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402

NUM_BLOCKS = 4096


def main(args) -> None:
    model = str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    writer = build_worker(WorkerConfig(model=model, proposer="none"))  # as train-draft writes them (dtype auto)
    writer.init_cache(args.num_self_prompts * 16, BLOCK_SIZE)
    stops = stop_token_ids(writer, tokenizer)
    rng = random.Random(args.seed)
    openers = {
        "self, empty turn": [""] * args.num_self_prompts,
        "self, openers": [rng.choice(SELF_PROMPT_OPENERS) for _ in range(args.num_self_prompts)],
    }
    texts = {
        label: [p.text for p in write_self_prompts(writer, tokenizer, stops, starts, args.seed, args.num_self_prompts)]
        for label, starts in openers.items()
    }
    del writer
    texts["mt-bench"] = [
        q["turns"][0] for q in load_questions(categories=MT_CATEGORIES, per_category=args.per_category)
    ]
    report = {
        "args": {**vars(args), "head": str(args.head)},
        "num_prompts": {k: len(v) for k, v in texts.items()},
        "acceptance": {},
    }
    for dtype in args.dtypes:
        worker = build_worker(
            WorkerConfig(
                model=model, dtype=dtype, proposer="eagle3", draft_model=str(args.head), num_speculative_tokens=1
            )
        )
        worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
        report["acceptance"][dtype] = {}
        for label, prompts in texts.items():
            driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
            driver.generate([chat_ids(tokenizer, t) for t in prompts], args.new_tokens, num_speculative_tokens=1)
            outputs = [o for r in driver.results for o in r.outputs]
            drafted, accepted = sum(o.num_draft_tokens for o in outputs), sum(o.num_accepted_tokens for o in outputs)
            report["acceptance"][dtype][label] = {
                "drafted": drafted,
                "accepted": accepted,
                "rate": accepted / drafted if drafted else None,
            }
            logging.info("%s %s: %d / %d accepted", dtype, label, accepted, drafted)
    print(f"\nfirst drafts accepted, k = 1, greedy, {args.new_tokens} tokens a prompt ({args.head.name})")
    print(f"{'prompts':18} {'n':>4} " + " ".join(f"{d:>10}" for d in args.dtypes))
    for label in texts:
        rates = [report["acceptance"][d][label]["rate"] for d in args.dtypes]
        print(
            f"{label:18} {len(texts[label]):4} "
            + " ".join(f"{r:10.3f}" if r is not None else f"{'-':>10}" for r in rates)
        )
    save("head-acceptance", report)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=pathlib.Path, default=DEFAULT_EAGLE3_HEAD)
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16"])
    parser.add_argument("--num-self-prompts", type=int, default=40)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=777)
    main(parser.parse_args())
