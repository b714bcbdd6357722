"""The EAGLE-3 head's own costs in-process, beside the target's: a draft step and a prompt catch-up.

    .venv/bin/python bench/bench_head_step.py                      # ~1 min on 2 cores
    .venv/bin/python bench/bench_head_step.py --dtype float32 --head DIR --prompt-tokens 1024

Loads the default model (--dtype) and an EAGLE-3 head (default: the one shipped for it), then times, each as
the median of --repeats calls:

- the target's prefill of --prompt-tokens, and its step over one sequence after --context-tokens of context with
  each of --rows rows (a decode, and a decode verifying drafts: what a draft's row costs);
- the head's draft step (one row, the same context);
- the head's catch-up over a --prompt-tokens prompt: every row through the whole layer, and with output_rows
  (the rows before the last only as far as their K/V, as Eagle3Proposer's catch-up runs it), and the `fc`
  over the target's features that both include.

Token ids and features are random: these are costs, not drafts. Results: bench/results/head-step-*.json.
"""

import argparse
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import median_time, save  # noqa: E402
from worker_service.runtime.default_model import DEFAULT_EAGLE3_HEAD, fetch_default_model  # noqa: E402
from worker_service.runtime.eagle3_head import TargetFacts, load_head  # noqa: E402
from worker_service.runtime.loader import load_model  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk, pack  # noqa: E402

BLOCK_SIZE = 16


def main(args) -> None:
    model = load_model(fetch_default_model(), args.dtype)
    config = model.config
    head = load_head(
        args.head,
        TargetFacts(config.hidden_size, config.vocab_size, config.num_hidden_layers),
        model.model.embed_tokens,
        torch.device("cpu"),
    )
    num_blocks = (max(args.prompt_tokens, args.context_tokens) + 1) // BLOCK_SIZE + 2
    table = list(range(num_blocks))
    target = ModelRunner(model)
    target.init_cache(num_blocks, BLOCK_SIZE)
    head.init_cache(num_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
    aux = torch.randn(args.prompt_tokens, 3 * config.hidden_size, generator=generator)
    context = prompt[: args.context_tokens]
    results = {}

    def time_ms(name: str, fn) -> None:
        results[name] = median_time(fn, args.repeats) * 1e3
        print(f"{name:<40} {results[name]:8.2f} ms", flush=True)

    time_ms("target prefill", lambda: target.forward([SequenceChunk(prompt, 0, table)]))
    target.forward([SequenceChunk(context, 0, table)])
    for rows in args.rows:
        time_ms(
            f"target step, {rows} row{'s' if rows > 1 else ''}",
            lambda: target.forward([SequenceChunk(prompt[:rows], len(context), table, num_logits=rows)]),
        )

    def head_call(chunks, features, output_rows: bool):
        batch = pack(chunks, head.kv_cache, head.device)
        return head(
            batch.input_ids, batch.positions, features, batch.metadata, batch.logits_indices if output_rows else None
        )

    catch_up = [SequenceChunk(prompt, 0, table, num_logits=1)]
    time_ms("head fc over the prompt's features", lambda: head.features(aux))
    time_ms("head catch-up, every row", lambda: head_call(catch_up, head.features(aux), False))
    time_ms("head catch-up, output_rows", lambda: head_call(catch_up, head.features(aux), True))
    head_call([SequenceChunk(context, 0, table)], head.features(aux[: len(context)]), True)
    feature = head.features(aux[:1])
    time_ms("head draft step", lambda: head_call([SequenceChunk([1], len(context), table)], feature, False))
    save("head-step", {"args": {**vars(args), "head": str(args.head)}, "ms": results})


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype (default: bfloat16)")
    parser.add_argument("--head", type=pathlib.Path, default=DEFAULT_EAGLE3_HEAD)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--context-tokens", type=int, default=300)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 6])
    parser.add_argument("--repeats", type=int, default=15)
    main(parser.parse_args())
