"""How forced drafts and a copying proposer could share a structured-output step: offline replay, no timing.

    .venv/bin/python bench/bench_forced_replay.py [--num-texts 10] [--k 5,16]

Generates the constrained greedy answers of bench_structured.py's JSON-extraction jobs once (one
`specdec serve --proposer none`), then replays each answer step by step as a speculating worker would
draft it, with n-gram prompt lookup (the worker's propose_ngram, its default n = 1..4) and the grammar's
forced tokens (worker_service/speculation/structured.forced_tokens), at a fixed k per step. A draft is accepted while
it equals the answer's next token (greedy: the answer *is* the target's choice), so the replay counts the
steps each drafting scheme takes without running the target. Schemes, per step:

- ngram: the proposer's k drafts, cut at the first one the grammar forbids (`--no-forced-drafts`);
- forced, else ngram: the forced tokens when the grammar forces any, else the proposer's (the worker today);
- forced, then ngram: the forced tokens, and the proposer's drafts after them up to k (the proposer looking
  up the context extended by the forced tokens).

Prints steps, tokens per step, scored rows per step (1 + drafts) and drafts proposed/accepted by source;
saves JSON under bench/results/.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer  # noqa: E402

from bench.bench_serving import spawned  # noqa: E402
from bench.bench_structured import Server, jobs_of, run_job  # noqa: E402
from bench.common import chat_ids, save  # noqa: E402
from specdec.structured import to_grammar  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.speculation import structured  # noqa: E402
from worker_service.speculation.proposers.ngram import propose_ngram  # noqa: E402

SCHEMES = ("ngram", "forced, else ngram", "forced, then ngram")


def drafts_of(scheme: str, matcher, context: list[int], k: int) -> list[tuple[int, str]]:
    """One step's drafts under `scheme`, each with its source."""
    forced = structured.forced_tokens(matcher, k) if scheme != "ngram" else []
    if forced and scheme == "forced, else ngram":
        return [(t, "forced") for t in forced]
    copied, _ = propose_ngram(context + forced, 1, 4, k - len(forced))
    valid = structured.valid_drafts(matcher, forced + copied)[len(forced) :]
    return [(t, "forced") for t in forced] + [(t, "ngram") for t in valid]


def replay(scheme: str, start, prompt: list[int], answer: list[int], k: int, totals: dict) -> None:
    matcher, pos = start.deep_copy(), 0
    while pos < len(answer):
        drafts = drafts_of(scheme, matcher, prompt + answer[:pos], k)
        accepted = next(
            (j for j, (t, _) in enumerate(drafts) if pos + j >= len(answer) or t != answer[pos + j]), len(drafts)
        )
        for j, (_, source) in enumerate(drafts):
            counts = totals["drafts"].setdefault(source, [0, 0])
            counts[0] += 1
            counts[1] += j < accepted
        emitted = answer[pos : pos + accepted + 1]
        structured.advance(matcher, emitted)
        pos += len(emitted)
        totals["steps"] += 1
        totals["rows"] += 1 + len(drafts)
    totals["tokens"] += len(answer)


def main(args) -> None:
    jobs = jobs_of(args.num_texts, args.text_chars)
    with spawned("--proposer none --max-num-seqs 16 --kv-cache-memory-gib 0.5") as address:
        server = Server("none", address, constrained=True)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda job: run_job(server, job, args.max_tokens, 600)["token_ids"], jobs))
    model = fetch_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    grammars = structured.Grammars(lambda: (model / "tokenizer.json").read_text(), vocab_size, [tokenizer.eos_token_id])
    print(f"{len(jobs)} jobs, {sum(map(len, answers))} answer tokens (constrained greedy, the default model)")
    report = {"args": vars(args), "num_tokens": sum(map(len, answers)), "results": []}
    for k in args.k:
        for scheme in SCHEMES:
            totals = {"steps": 0, "rows": 0, "tokens": 0, "drafts": {}}
            for job, answer in zip(jobs, answers):
                start = grammars.start(to_grammar("json", json.dumps(job["schema"]))).result()
                replay(scheme, start, chat_ids(tokenizer, job["prompt"]), answer, k, totals)
            drafted = ", ".join(f"{s} {d}/{a}" for s, (d, a) in sorted(totals["drafts"].items()))
            print(
                f"k={k:<3} {scheme:20s} steps {totals['steps']:5d}  tokens/step "
                f"{totals['tokens'] / totals['steps']:.2f}  rows/step {totals['rows'] / totals['steps']:.2f}  "
                f"drafts/accepted: {drafted}"
            )
            report["results"].append({"k": k, "scheme": scheme, **totals})
    print(f"saved {save('forced-replay', report)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=10, help="texts per category (summarization, rag)")
    parser.add_argument("--text-chars", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument(
        "--k",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[5, 16],
        help="drafts per step: n-gram's default 5, suffix's 16",
    )
    main(parser.parse_args())
