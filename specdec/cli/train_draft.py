"""`specdec train-draft`: train an EAGLE-3 head for a target (draft_training)."""

import argparse
import shlex
import sys

from draft_training import prompts
from worker_service.runtime import default_model as models
from worker_service.runtime.dtypes import DEVICE_SPELLINGS, DTYPE_CHOICES


def add_flags(p: argparse.ArgumentParser) -> None:
    from draft_training.recipe import PRECISIONS, TrainConfig

    d = TrainConfig(model="", output="", work_dir="")
    p.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="where the head is written (config.json, model.safetensors, training.json)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        metavar="DIR",
        help="prompts, responses and checkpoints; run again with the same one to resume (default: OUTPUT/work)",
    )
    p.add_argument(
        "--sources",
        default=",".join(d.sources),
        metavar="LIST",
        help=f"prompt sources, comma-separated, from {', '.join(prompts.SOURCES)} (packages: the "
        "descriptions of installed permissively licensed distributions; python: standard library "
        "functions; self: prompts the target writes); none: only --prompts files",
    )
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE",
        help='more prompts: one per line, or JSON lines with a "prompt" field (repeatable)',
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts from packages, python and files")
    p.add_argument("--num-self-prompts", type=int, default=d.num_self_prompts, help="prompts the target writes")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="longest response")
    p.add_argument(
        "--generation-batch-size",
        type=int,
        default=d.generation_batch_size,
        help="requests the worker generates at once",
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype, help="the target's dtype, as the worker's")
    p.add_argument("--device", default=d.device, help=DEVICE_SPELLINGS)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--draft-vocab-coverage",
        type=float,
        default=d.draft_vocab_coverage,
        help="the draft vocabulary: the most frequent response tokens covering this fraction of them",
    )
    p.add_argument("--max-draft-vocab-size", type=int, default=d.max_draft_vocab_size)
    p.add_argument("--num-steps", type=int, default=d.num_steps, help="draft steps unrolled in training")
    p.add_argument(
        "--soft-labels",
        action="store_true",
        default=d.soft_labels,
        help="a second label beside the target's greedy token: its whole next-token distribution "
        "(recomputed from the stored features by its last layers)",
    )
    p.add_argument(
        "--train-precision",
        choices=PRECISIONS,
        default=d.precision,
        help="the head's forward and backward in training: bfloat16 autocast (fp32 weights), float32, "
        "or auto: bfloat16 where the device has native bf16 matmuls",
    )
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per training batch")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="conversations held out")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="STEPS")
    p.add_argument("--seed", type=int, default=d.seed)


def train_draft(args: argparse.Namespace) -> int:
    """Runs the recipe; any failure is one line on stderr and exit status 1."""
    from draft_training.prompts import PromptSourceError
    from draft_training.recipe import TrainConfig
    from draft_training.train import TrainingError, run

    try:
        sources = tuple(s for s in args.sources.split(",") if s and s != "none")
        config = TrainConfig(
            model=str(models.resolve_model(args.model)),
            output=args.output,
            work_dir=args.work_dir or f"{args.output}/work",
            sources=sources,
            prompt_files=tuple(args.prompts),
            num_prompts=args.num_prompts,
            num_self_prompts=args.num_self_prompts,
            max_new_tokens=args.max_new_tokens,
            generation_batch_size=args.generation_batch_size,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.num_threads,
            draft_vocab_coverage=args.draft_vocab_coverage,
            max_draft_vocab_size=args.max_draft_vocab_size,
            num_steps=args.num_steps,
            soft_labels=args.soft_labels,
            precision=args.train_precision,
            epochs=args.epochs,
            learning_rate=args.learning_rate,
            batch_tokens=args.batch_tokens,
            eval_fraction=args.eval_fraction,
            checkpoint_every=args.checkpoint_every,
            seed=args.seed,
            meta={"command": "specdec train-draft " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])},
        )
        summary = run(config)
    except (TrainingError, PromptSourceError, ValueError, OSError) as exc:
        print(f"specdec train-draft: error: {exc}", file=sys.stderr)
        return 1
    accuracy = " ".join(f"{a:.2f}" for a in summary["held_out_accuracy_by_position"])
    print(
        f"wrote {args.output}: draft vocabulary {summary['draft_vocab_size']}, "
        f"{summary['num_train_tokens']} training tokens, held-out accuracy by position {accuracy}"
    )
    return 0
