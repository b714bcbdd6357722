"""N-gram speculation in the worker vs no speculation vs `transformers` prompt lookup, batch 1, greedy.

    .venv/bin/python bench/bench_spec.py [--dtype float32] [--prompts-per-category 10] [--new-tokens 128]
        [--ks 2,3,4,5] [--hf-ks 2,3,4,5] [--repeats 1] [--skip-hf] [--threads N]

SmolLM2-135M-Instruct, the first N prompts of five Spec-Bench categories (first
turn, chat template). Every configuration runs on a prompt before the next
prompt starts (interleaved, rotating order), so machine noise hits them alike;
with --repeats R each prompt gets R such rounds and each configuration's
fastest run counts (a neighbour's burst can slow one run several times over):
- ours none: the worker without speculation;
- ours k=K: the worker's n-gram proposer (longest of 4..1-grams, latest match), up to K drafts;
- hf plain / hf pl k=K: `model.generate(do_sample=False[, prompt_lookup_num_tokens=K])`
  (transformers tries 2- then 1-grams and takes the earliest match).
Neither side stops at EOS, so all produce the same new_tokens tokens.

Prints per category and overall: tokens/s, tokens per target forward (the
prefill forward counts), draft acceptance, speedups vs ours none and vs
transformers prompt lookup at its best k, and geometric means over the
categories; then the multi-query vs batch-expansion scorer step time. Checks
that every speculative output equals the no-speculation output. Saves JSON
under bench/results/.
"""

import argparse
import dataclasses
import logging
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import chat_ids, load_questions, median_time, save  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model, load_tokenizer  # noqa: E402
from worker_service.runtime.runner import ModelRunner, SequenceChunk  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402
from worker_service.speculation.scorers import score_batch_expansion, score_multi_query  # noqa: E402
from worker_service.speculation.worker import Worker  # noqa: E402

CATEGORIES = ("summarization", "rag", "qa", "translation", "math_reasoning")
BLOCK_SIZE = 16
NUM_BLOCKS = 256  # longest prompt (~1400) + new tokens, and 8 x 310 tokens for the scorer timing
logger = logging.getLogger("bench.spec")


@dataclasses.dataclass
class Run:
    """One configuration on one prompt."""

    seconds: float
    num_forwards: int  # target forwards, prefill included
    num_emitted: int  # tokens emitted, before cutting to new_tokens
    num_drafts: int | None = None  # ours only (transformers does not say)
    num_accepted: int | None = None
    decode_ms: tuple[float, float, float] | None = None  # ours only: propose, score, verify summed over decodes
    token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)


def run_ours(worker: Worker, k: int, prompt: list[int], new_tokens: int) -> Run:
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    start = time.perf_counter()
    token_ids = driver.generate([prompt], new_tokens, num_speculative_tokens=k)[0]
    seconds = time.perf_counter() - start
    outs = [r.outputs[0] for r in driver.results]  # one per target forward (the 'finished' step is not kept)
    decodes = driver.results[1:]  # the first step is the prefill
    decode_ms = tuple(sum(getattr(r.stats, f) for r in decodes) for f in ("propose_ms", "score_ms", "verify_ms"))
    return Run(
        seconds,
        len(outs),
        sum(len(o.token_ids) for o in outs),
        sum(o.num_draft_tokens for o in outs),
        sum(o.num_accepted_tokens for o in outs),
        decode_ms,
        token_ids,
    )


def run_hf(model, counter: list[int], k: int, prompt: list[int], new_tokens: int) -> Run:
    ids = torch.tensor([prompt])  # [1, P]
    extra = {"prompt_lookup_num_tokens": k} if k else {}
    counter[0] = 0
    start = time.perf_counter()
    with torch.inference_mode():  # explicit mask: pad == <|im_end|>, which the chat prompt contains
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            **extra,
        )
    seconds = time.perf_counter() - start
    token_ids = out[0, len(prompt) :].tolist()
    return Run(seconds, counter[0], len(token_ids), token_ids=token_ids)


def build_configs(args) -> tuple[dict, ModelRunner, object]:
    """({name: fn(prompt_ids, new_tokens) -> Run}, runner, tokenizer); all workers share one runner (one cache)."""
    path = str(fetch_default_model())
    runner = ModelRunner(load_model(path, args.dtype))
    configs = {}

    def add_worker(name, cls, proposer, k):
        config = WorkerConfig(
            model=path, dtype=args.dtype, proposer=proposer, num_speculative_tokens=k, ngram_min=1, ngram_max=4
        )
        worker = cls(config, runner)
        worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)  # same shape for all: they use the runner's last cache
        configs[name] = lambda p, n: run_ours(worker, k, p, n)

    add_worker("ours none", Worker, "none", 0)
    for k in args.ks:
        add_worker(f"ours k={k}", Worker, "ngram", k)
    if not args.skip_hf:
        model, counter = load_model(path, args.dtype), [0]
        model.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        for k in [0, *args.hf_ks]:
            name = f"hf pl k={k}" if k else "hf plain"
            configs[name] = lambda p, n, k=k: run_hf(model, counter, k, p, n)
    return configs, runner, load_tokenizer(path)


def run_all(configs: dict, prompts: list[tuple[str, list[int]]], new_tokens: int, repeats: int) -> dict:
    """runs[name] = [fastest of `repeats` Runs per prompt]; the configs' order rotates from round to round."""
    names = list(configs)
    for name in names:  # warm-up
        configs[name](prompts[0][1][:32], 4)
    runs = {name: [] for name in names}
    for i, (category, prompt) in enumerate(prompts):
        best = {}
        for r in range(repeats):  # a round runs every config once; each config's fastest run counts
            shift = (i * repeats + r) % len(names)
            for name in names[shift:] + names[:shift]:
                run = configs[name](prompt, new_tokens)
                if name not in best or run.seconds < best[name].seconds:
                    best[name] = run
        for name in names:
            runs[name].append(best[name])
        rates = "  ".join(f"{n.replace('ours ', '')} {new_tokens / runs[n][-1].seconds:.1f}" for n in names)
        logger.info("[%d/%d] %s (%d tokens) tok/s: %s", i + 1, len(prompts), category, len(prompt), rates)
    return runs


def summarize(runs: list[Run], new_tokens: int) -> dict:
    seconds = sum(r.seconds for r in runs)
    steps = sum(r.num_forwards for r in runs)
    row = {
        "tok_s": new_tokens * len(runs) / seconds,
        "seconds": seconds,
        "tokens_per_forward": sum(r.num_emitted for r in runs) / steps,
        "drafts_per_forward": None,
        "acceptance": None,
        "decode_step_ms": None,
    }
    if runs[0].num_drafts is not None:
        drafts = sum(r.num_drafts for r in runs)
        row["drafts_per_forward"] = drafts / steps
        row["acceptance"] = sum(r.num_accepted for r in runs) / drafts if drafts else None
        row["decode_step_ms"] = [sum(r.decode_ms[j] for r in runs) / (steps - len(runs)) for j in range(3)]
    return row


def add_speedups(table: dict, hf_best: str | None, hf_overall_best: str | None) -> None:
    """vs ours none, vs HF prompt lookup at the best k of this group and at the best k overall."""
    for row in table.values():
        row["vs_none"] = row["tok_s"] / table["ours none"]["tok_s"]
        row["vs_hf_best"] = row["tok_s"] / table[hf_best]["tok_s"] if hf_best else None
        row["vs_hf_overall_best"] = row["tok_s"] / table[hf_overall_best]["tok_s"] if hf_overall_best else None


def best_hf(table: dict) -> str | None:
    names = [n for n in table if n.startswith("hf pl k=")]
    return max(names, key=lambda n: table[n]["tok_s"]) if names else None


def mismatches(runs: dict, labels: list[str], new_tokens: int) -> dict:
    """Prompts whose output differs from the no-speculation output (ours vs ours, hf vs hf)."""
    counts = {}
    for name, name_runs in runs.items():
        reference = "ours none" if name.startswith("ours") else "hf plain"
        if name != reference and reference in runs:
            bad = [
                labels[i]
                for i, (a, b) in enumerate(zip(name_runs, runs[reference]))
                if a.token_ids[:new_tokens] != b.token_ids[:new_tokens]
            ]
            counts[name] = {"count": len(bad), "prompts": bad}
    if "hf plain" in runs:
        agree = sum(a.token_ids == b.token_ids for a, b in zip(runs["ours none"], runs["hf plain"]))
        counts["ours none vs hf plain (numerics)"] = {"count": len(labels) - agree, "prompts": []}
    return counts


def print_table(title: str, table: dict) -> None:
    print(f"\n{title}")
    print(
        f"  {'config':<16}{'tok/s':>8}{'tok/fwd':>9}{'drafts/fwd':>11}{'accept':>8}{'vs none':>9}"
        f"{'vs HF-PL best':>14}{'vs HF-PL all-best':>18}   decode step: propose/score/verify ms"
    )
    for name, row in table.items():
        accept = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        drafts = f"{row['drafts_per_forward']:.2f}" if row["drafts_per_forward"] is not None else "-"
        vs = [f"{row[key]:.2f}x" if row[key] is not None else "-" for key in ("vs_hf_best", "vs_hf_overall_best")]
        ms = "/".join(f"{t:.1f}" for t in row["decode_step_ms"]) if row["decode_step_ms"] else ""
        print(
            f"  {name:<16}{row['tok_s']:8.1f}{row['tokens_per_forward']:9.2f}{drafts:>11}"
            f"{accept:>8}{row['vs_none']:8.2f}x{vs[0]:>14}{vs[1]:>18}   {ms}"
        )


def report(runs: dict, categories: list[str], labels: list[str], new_tokens: int) -> dict:
    overall = {name: summarize(r, new_tokens) for name, r in runs.items()}
    overall_best = best_hf(overall)
    tables = {}
    for category in CATEGORIES:
        idx = [i for i, c in enumerate(categories) if c == category]
        tables[category] = {name: summarize([r[i] for i in idx], new_tokens) for name, r in runs.items()}
        add_speedups(tables[category], best_hf(tables[category]), overall_best)
        print_table(
            f"{category} ({len(idx)} prompts; HF prompt lookup best here: {best_hf(tables[category])})",
            tables[category],
        )
    add_speedups(overall, overall_best, overall_best)
    print_table(f"overall ({len(labels)} prompts, pooled; HF prompt lookup best: {overall_best})", overall)
    geomean = {
        name: {
            key: math.exp(statistics.fmean(math.log(tables[c][name][key]) for c in CATEGORIES))
            for key in ("vs_none", "vs_hf_best", "vs_hf_overall_best")
            if overall[name][key] is not None
        }
        for name in runs
    }
    print("\ngeometric mean over the categories of the per-category speedup")
    for name, row in geomean.items():
        print(f"  {name:<16}" + "  ".join(f"{key} {value:.2f}x" for key, value in row.items()))
    return {"categories": tables, "overall": overall, "hf_overall_best": overall_best, "geomean": geomean}


def bench_scorers(runner: ModelRunner, repeats: int = 20) -> dict:
    """Step time of one 5-token query per sequence over a 300-token cached prefix, multi-query vs expansion."""
    blocks_per_seq = -(-310 // BLOCK_SIZE)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(8)]
    runner.forward([SequenceChunk(list(range(1000 + i, 1300 + i)), 0, t, 1) for i, t in enumerate(tables)])
    results = {}
    for batch in (1, 8):
        chunks = [SequenceChunk([42, 43, 44, 45, 46], 300, t, num_logits=5) for t in tables[:batch]]
        scorers = {"multi_query": score_multi_query, "batch_expansion": score_batch_expansion}
        diff = (scorers["multi_query"](runner, chunks) - scorers["batch_expansion"](runner, chunks)).abs().max()
        times = {name: [] for name in scorers}
        for _ in range(repeats):  # interleaved
            for name, score in scorers.items():
                times[name].append(median_time(lambda: score(runner, chunks), 1) * 1e3)
        results[f"batch_{batch}"] = {
            **{f"{n}_ms": statistics.median(t) for n, t in times.items()},
            "max_abs_logit_diff": float(diff),
        }
        row = results[f"batch_{batch}"]
        print(
            f"  batch {batch}: multi-query {row['multi_query_ms']:.1f} ms, batch expansion "
            f"{row['batch_expansion_ms']:.1f} ms ({row['batch_expansion_ms'] / row['multi_query_ms']:.2f}x), "
            f"max |logit diff| {row['max_abs_logit_diff']:.1e}"
        )
    return results


def main(args):
    configs, runner, tokenizer = build_configs(args)
    questions = load_questions(categories=list(CATEGORIES), per_category=args.prompts_per_category)
    questions.sort(key=lambda q: CATEGORIES.index(q["category"]))
    prompts = [(q["category"], chat_ids(tokenizer, q["turns"][0])) for q in questions]
    labels = [f"{q['category']}#{q['question_id']}" for q in questions]
    logger.info(
        "%d prompts x %d configs x %d repeats x %d new tokens",
        len(prompts),
        len(configs),
        args.repeats,
        args.new_tokens,
    )
    runs = run_all(configs, prompts, args.new_tokens, args.repeats)
    print(
        f"\nSmolLM2-135M, {args.dtype}, {torch.get_num_threads()} threads, batch 1, greedy, "
        f"{args.new_tokens} new tokens, no EOS stop, fastest of {args.repeats} per prompt"
    )
    summary = report(runs, [c for c, _ in prompts], labels, args.new_tokens)
    found = mismatches(runs, labels, args.new_tokens)
    print("\noutputs differing from the no-speculation output (prompts):")
    for name, row in found.items():
        print(f"  {name:<34}{row['count']:3d} / {len(prompts)}  {' '.join(row['prompts'])}")
    print(f"\nscorer step, 5-token query per sequence over a 300-token prefix ({args.dtype}):")
    scorers = bench_scorers(runner)
    raw = {name: [dataclasses.asdict(r) | {"token_ids": None} for r in r_list] for name, r_list in runs.items()}
    save(
        "spec", {"args": vars(args), "prompts": labels, **summary, "mismatches": found, "scorers": scorers, "runs": raw}
    )


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts-per-category", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int_list, default=[2, 3, 4, 5], help="our k values, e.g. 2,3,4,5")
    parser.add_argument("--hf-ks", type=int_list, default=None, help="transformers' k values (default: --ks)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per prompt; each config's fastest counts")
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ARGS = parser.parse_args()
    ARGS.hf_ks = ARGS.hf_ks if ARGS.hf_ks is not None else ARGS.ks
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(ARGS)
