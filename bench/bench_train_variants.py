"""Hard labels against hard + soft labels (`train-draft --soft-labels`), side by side on the same conversations.

    .venv/bin/python bench/bench_soft_labels.py --work-dir DIR     # ~25 min on 2 cores (both modes at once)

DIR is a `specdec train-draft` work directory (its shards hold the target's responses and features). The
first --shards shards are split (--eval-fraction held out, the seed's split), and a head is trained on them
with each kind of label from the same seed and initial weights, --epochs epochs, one torch thread each, in two
processes at once; each prints held-out accuracy by position every --checkpoint-every steps and at the end.
Results: bench/results/soft-labels-*.json.
"""

import argparse
import logging
import multiprocessing
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from worker_service.draft_training import dataset  # noqa: E402
from worker_service.draft_training.train import TrainConfig, new_head  # noqa: E402
from worker_service.draft_training.trainer import Trainer  # noqa: E402
from worker_service.model_loader import load_model  # noqa: E402
from worker_service.models import fetch_default_model  # noqa: E402

MODES = ("hard", "soft")


def train(mode: str, args) -> list[float]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s " + mode + " %(message)s")
    torch.set_num_threads(1)
    conversations = dataset.load_shards(sorted(args.work_dir.glob("shard-*.pt"))[:args.shards])
    target = load_model(args.model, dtype=args.dtype)
    draft_to_target, _ = dataset.draft_vocabulary(conversations, 0.98, 8192)
    config = TrainConfig(model="", output="", work_dir="", epochs=args.epochs, eval_fraction=args.eval_fraction,
                         checkpoint_every=args.checkpoint_every, soft_labels=mode == "soft")
    train_set, held_out = dataset.split(conversations, config.eval_fraction, config.seed)
    head, teacher = new_head(target, draft_to_target, config)
    logging.info("%d conversations for training (%d tokens), %d held out", len(train_set),
                 sum(len(c.token_ids) for c in train_set), len(held_out))
    with tempfile.TemporaryDirectory() as scratch:
        return Trainer(head, config, pathlib.Path(scratch) / "checkpoint.pt", teacher=teacher).fit(train_set, held_out)


def main(args) -> None:
    with multiprocessing.get_context("spawn").Pool(len(MODES)) as pool:
        results = dict(zip(MODES, pool.starmap(train, [(mode, args) for mode in MODES])))
    for mode, accuracy in results.items():
        print(f"{mode}: held-out accuracy by position {' '.join(f'{a:.3f}' for a in accuracy)}")
    save("soft-labels", {"args": {k: str(v) for k, v in vars(args).items()}, "held_out_accuracy": results})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=pathlib.Path, required=True)
    parser.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="q4_1", help="the target's, as the work directory's run had it")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    arguments = parser.parse_args()
    arguments.model = arguments.model or str(fetch_default_model())
    main(arguments)
