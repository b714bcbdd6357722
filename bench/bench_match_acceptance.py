"""How a copied draft's acceptance depends on the match behind it: n-gram and suffix drafts replayed offline.

    .venv/bin/python bench/bench_match_acceptance.py [--per-category 3] [--max-tokens 128] [--k 8]   # ~7 min

The default model answers the first turn of --per-category Spec-Bench
questions per category greedily (`transformers` generate, fp32). Then, at
every position of each answer, the n-gram proposer (`propose_ngram`, n 1..4)
and the suffix proposer's per-request index (`TokenIndex` + `walk`) draft up
to --k tokens from the prompt and the answer so far; a draft's accepted
length is its common prefix with the rest of the answer (greedy
verification). Grouped by the match behind the draft (n-gram: n; suffix: the
policy's match class, 2-3, 4-7, ...): positions, P(first draft accepted),
accepted and drafted tokens per position. This is what draft previews
(`--draft-previews`, worker_service/speculation/proposers/preview.py) let the goodput
policy learn. Then each answer is decoded step by step as greedy speculation at
k would decode it (a step emits its accepted drafts and one token more): tokens
per step is each proposer's ceiling over plain decoding, reached only where
draft rows cost nothing. Prints the CPU's model name; saves JSON under bench/results/.
"""

import argparse
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from bench.bench_linear import cpu_name  # noqa: E402
from bench.common import chat_ids, load_questions, save  # noqa: E402
from scheduler_service.core.policy import match_class  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.speculation.proposers import (
    num_matching,  # noqa: E402
    suffix,  # noqa: E402
)
from worker_service.speculation.proposers.ngram import propose_ngram  # noqa: E402


def answers(per_category: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) for the first turns of the benchmark questions."""
    model_dir = fetch_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = []
    for i, question in enumerate(load_questions(per_category=per_category)):
        prompt = chat_ids(tokenizer, question["turns"][0])
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        pairs.append((prompt, out[0, len(prompt) :].tolist()))
        print(f"answer {i + 1}: {len(pairs[-1][1])} tokens", flush=True)
    return pairs


def replay(pairs: list[tuple[list[int], list[int]]], k: int) -> dict[str, dict[int, list[int]]]:
    """Per proposer and match group: [positions, first accepted, accepted tokens, drafted tokens]."""
    stats = {
        "ngram": collections.defaultdict(lambda: [0, 0, 0, 0]),
        "suffix": collections.defaultdict(lambda: [0, 0, 0, 0]),
    }
    for prompt, answer in pairs:
        seq, index = prompt + answer, suffix.TokenIndex()
        for t in range(len(prompt), len(seq) - 1):
            context, truth = seq[:t], seq[t:]
            drafts, n = propose_ngram(context, 1, 4, k)
            index.extend(0, context[index.num_tokens :])
            draft = suffix.walk(index.candidates(context[-suffix.MAX_MATCH_TOKENS :]), k)
            groups = (("ngram", drafts, n), ("suffix", draft.token_ids, match_class(draft.match_len)))
            for name, tokens, group in groups:
                accepted, row = num_matching(tokens, truth), stats[name][group]
                row[0] += 1
                row[1] += accepted > 0
                row[2] += accepted
                row[3] += len(tokens)
    return {name: dict(sorted(groups.items())) for name, groups in stats.items()}


def ceilings(pairs: list[tuple[list[int], list[int]]], k: int) -> dict[str, dict[str, float]]:
    """Per proposer, decoding each answer step by step as greedy speculation would (a step emits its accepted
    drafts and one token more): tokens per step, drafts per step, and the share of drafts accepted. Tokens per
    step is the proposer's ceiling over plain decoding, reached only if draft rows cost nothing."""
    totals = {name: [0, 0, 0, 0] for name in ("ngram", "suffix")}  # steps, tokens, drafted, accepted
    for prompt, answer in pairs:
        seq = prompt + answer
        for name, row in totals.items():
            index, t = suffix.TokenIndex(), len(prompt)
            while t < len(seq):
                context, truth = seq[:t], seq[t:]
                if name == "ngram":
                    tokens = propose_ngram(context, 1, 4, k)[0]
                else:
                    index.extend(0, context[index.num_tokens :])
                    tokens = suffix.walk(index.candidates(context[-suffix.MAX_MATCH_TOKENS :]), k).token_ids
                accepted = num_matching(tokens, truth)
                emitted = min(accepted + 1, len(seq) - t)
                row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + emitted, row[2] + len(tokens), row[3] + accepted
                t += emitted
    return {
        name: {"tokens_per_step": tokens / steps, "drafts_per_step": drafted / steps, "acceptance": accepted / drafted}
        for name, (steps, tokens, drafted, accepted) in totals.items()
    }


def main(args) -> None:
    print(cpu_name())
    pairs = answers(args.per_category, args.max_tokens)
    limits = ceilings(pairs, args.k)
    stats = replay(pairs, args.k)
    for name, groups in stats.items():
        print(f"{name} (group: {'n' if name == 'ngram' else 'match class'}; 0 = no draft)")
        for group, (positions, first, accepted, drafted) in groups.items():
            print(
                f"  {group:3d}: positions {positions:5d}  P(first accepted) {first / positions:.2f}  "
                f"accepted/position {accepted / positions:.2f}  drafted/position {drafted / positions:.2f}"
            )
    print(f"decoded step by step, k = {args.k} (tokens per step: the ceiling over plain decoding with free rows)")
    for name, row in limits.items():
        print(
            f"  {name}: tokens/step {row['tokens_per_step']:.3f}  drafts/step {row['drafts_per_step']:.2f}  "
            f"acceptance {row['acceptance']:.2f}"
        )
    payload = {"args": vars(args), "cpu": cpu_name(), "stats": stats, "ceilings": limits}
    print(f"saved {save('match-acceptance', payload)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    main(parser.parse_args())
