"""Training variants of `train-draft` side by side on the same conversations: labels (hard, hard + soft) and
precision (fp32, bf16 autocast).

    .venv/bin/python bench/bench_train_variants.py --work-dir DIR              # hard vs soft (~25 min on 2 cores)
    .venv/bin/python bench/bench_train_variants.py --work-dir DIR --variants fp32,bf16 --epochs 2

DIR is a `specdec train-draft` work directory (its shards hold the target's responses and features). The
first --shards shards are split (--eval-fraction held out, the seed's split), and a head is trained on them
for each of --variants (VARIANTS: the TrainConfig fields each sets) from the same seed and initial weights,
--epochs epochs, one torch thread each, in one process per variant at once (so their seconds per step are
comparable with each other, not with a run alone); each prints held-out accuracy by position every
--checkpoint-every steps and at the end. Results: bench/results/train-variants-*.json.
"""

import argparse
import logging
import multiprocessing
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from draft_training import dataset  # noqa: E402
from draft_training.recipe import TrainConfig  # noqa: E402
from draft_training.train import new_head  # noqa: E402
from draft_training.trainer import Trainer  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402

VARIANTS = {
    "hard": {"soft_labels": False, "precision": "float32"},
    "soft": {"soft_labels": True, "precision": "float32"},
    "fp32": {"precision": "float32"},
    "bf16": {"precision": "bfloat16"},
}


def train(variant: str, args) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s " + variant + " %(message)s")
    torch.set_num_threads(1)
    conversations = dataset.load_shards(sorted(args.work_dir.glob("shard-*.pt"))[: args.shards])
    target = load_model(args.model, dtype=args.dtype)
    draft_to_target, _ = dataset.draft_vocabulary(conversations, 0.98, 8192)
    config = TrainConfig(
        model="",
        output="",
        work_dir="",
        epochs=args.epochs,
        eval_fraction=args.eval_fraction,
        checkpoint_every=args.checkpoint_every,
        **VARIANTS[variant],
    )
    train_set, held_out = dataset.split(conversations, config.eval_fraction, config.seed)
    head, teacher = new_head(target, draft_to_target, config)
    logging.info(
        "%d conversations for training (%d tokens), %d held out",
        len(train_set),
        sum(len(c.token_ids) for c in train_set),
        len(held_out),
    )
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(head, config, pathlib.Path(scratch) / "checkpoint.pt", teacher=teacher)
        start = time.perf_counter()
        accuracy = trainer.fit(train_set, held_out)
        seconds = time.perf_counter() - start
    steps = config.epochs * len(dataset.batches(train_set, config.batch_tokens))
    return {
        "held_out_accuracy": accuracy,
        "num_steps": steps,
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / steps, 3),
    }


def main(args) -> None:
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    with multiprocessing.get_context("spawn").Pool(len(args.variants)) as pool:
        results = dict(zip(args.variants, pool.starmap(train, [(v, args) for v in args.variants])))
    for variant, result in results.items():
        print(
            f"{variant}: held-out accuracy by position {' '.join(f'{a:.3f}' for a in result['held_out_accuracy'])}"
            f"; {result['num_steps']} steps, {result['seconds_per_step']:.2f} s a step (with evaluation)"
        )
    save("train-variants", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=pathlib.Path, required=True)
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=["hard", "soft"],
        help=f"comma-separated, from {', '.join(VARIANTS)}",
    )
    parser.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="q4_1", help="the target's, as the work directory's run had it")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    arguments = parser.parse_args()
    arguments.model = arguments.model or str(fetch_default_model())
    main(arguments)
