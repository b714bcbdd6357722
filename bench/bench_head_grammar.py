"""Would masking an EAGLE-3 head's drafts by the grammar help constrained requests? Its first draft, as drafted
and as the grammar would mask it, against the token the target emits.

    .venv/bin/python bench/bench_head_grammar.py                    # ~2 min on 2 cores
    .venv/bin/python bench/bench_head_grammar.py --num-texts 4 --offset 30 --top 20

The worker in-process with the shipped head, greedy, one draft every step (k = 1), forced drafts off, on
bench_structured.py's JSON-extraction jobs (--num-texts texts of each category from --offset; the default
offset is past the texts bench_structured.py uses with its defaults), each request constrained by its schema.
At every position of the record (up to its EOS) where the grammar allows more than one token (where it
forces one, forced drafts cost no head),
it records the head's first choice, whether the grammar allows it, and the likeliest token among the head's
--top that the grammar allows (the draft a grammar-masked head would make); after the step, whether each
equals the token the target emitted there. Prints the shares over all such positions. Not a speed benchmark.
Results: bench/results/head-grammar-*.json.

It watches the head through two of the proposer's own methods, wrapped here (the head's output rows of a
catch-up, and the proposer's call for the step): the shipped code has no hook for this, and needs none.
"""

import argparse
import json
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer  # noqa: E402

from bench.bench_structured import jobs_of  # noqa: E402
from bench.common import chat_ids, save  # noqa: E402
from specdec.structured import to_grammar  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import DEFAULT_EAGLE3_HEAD, fetch_default_model  # noqa: E402
from worker_service.speculation import structured  # noqa: E402
from worker_service.speculation.build import build_worker  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402
from worker_service.speculation.proposers.eagle3 import Eagle3Proposer  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 2048


class HeadWatch:
    """Per request, the head's --top likeliest first drafts after each catch-up, and at each step's proposal
    (where the grammar allows more than one token) what the module docstring records."""

    def __init__(self, worker, top: int):
        self.worker, self.top = worker, top
        proposer = worker.proposer
        assert isinstance(proposer, Eagle3Proposer), type(proposer)
        self.proposer, self.head = proposer, proposer.head
        self.tops: dict[str, list[int]] = {}
        self.records: list[dict] = []
        self._normed = None
        draft_tokens, catch_up, propose = self.head.draft_tokens, proposer._catch_up, proposer.propose

        def watched_draft_tokens(normed):
            self._normed = normed
            return draft_tokens(normed)

        def watched_catch_up(states):
            self._normed = None
            catch_up(states)
            if self._normed is not None:  # rows of the states the head left a first draft for, in order
                drafting = [s for s in states if s.request_id in proposer._next]
                rows, _ = self.head.top_draft_tokens(self._normed, self.top)
                self.tops.update((s.request_id, row) for s, row in zip(drafting, rows))

        def watched_propose(states, num_drafts):
            for state, k in zip(states, num_drafts):
                if k > 0 and state.is_constrained and state.request_id in self.tops:
                    self._record(state)
            return propose(states, num_drafts)

        self.head.draft_tokens, proposer._catch_up, proposer.propose = (
            watched_draft_tokens,
            watched_catch_up,
            watched_propose,
        )

    def _record(self, state) -> None:
        matcher = self.worker.grammars.matcher(state)
        if structured.forced_tokens(matcher, 1):
            return
        row = self.tops[state.request_id]
        allowed = [t for t in row if matcher.validate_tokens([t]) == 1]
        self.records.append(
            {
                "request_id": state.request_id,
                "position": state.num_tokens,
                "first": row[0],
                "first_allowed": allowed[:1] == row[:1],
                "masked": allowed[0] if allowed else None,
            }
        )


def main(args) -> None:
    model = str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    worker = build_worker(
        WorkerConfig(
            model=model,
            proposer="eagle3",
            draft_model=str(DEFAULT_EAGLE3_HEAD),
            num_speculative_tokens=1,
            forced_drafts=False,
        )
    )
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    watch = HeadWatch(worker, args.top)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    counts = {"positions": 0, "first_allowed": 0, "first_equal": 0, "masked_equal": 0}
    per_job = {}
    for n, job in enumerate(jobs_of(args.num_texts, args.text_chars, offset=args.offset)):
        prompt = chat_ids(tokenizer, job["prompt"])
        watch.records.clear()
        output = driver.generate(
            [prompt],
            args.max_tokens,
            num_speculative_tokens=1,
            grammar=to_grammar("json", json.dumps(job["schema"])),
            prefix=f"j{n}-",
        )[0]
        # The driver decodes past EOS to --max-tokens; only the record's own positions count (after it the
        # grammar allows EOS alone, and then nothing).
        end = next((i for i, t in enumerate(output) if t in worker.grammars.eos_token_ids), None)
        if end is None:
            print(f"{job['key']}: the record did not close within --max-tokens {args.max_tokens}; skipped")
            continue
        tokens = prompt + output[:end]
        job_counts = dict.fromkeys(counts, 0)
        for record in watch.records:
            if record["position"] >= len(tokens):
                continue
            emitted = tokens[record["position"]]
            for c in (counts, job_counts):
                c["positions"] += 1
                c["first_allowed"] += record["first_allowed"]
                c["first_equal"] += record["first"] == emitted
                c["masked_equal"] += record["masked"] == emitted
        per_job[job["key"]] = job_counts
        print(f"{job['key']}: a record of {end} tokens, {job_counts}", flush=True)
    total = max(counts["positions"], 1)
    shares = {key: counts[key] / total for key in ("first_allowed", "first_equal", "masked_equal")}
    print(
        f"\n{counts['positions']} positions where the grammar allows more than one token: the head's first choice "
        f"allowed {shares['first_allowed']:.3f}, equal to the target's token {shares['first_equal']:.3f}; the "
        f"likeliest allowed of its top {args.top} equal {shares['masked_equal']:.3f}"
    )
    save("head-grammar", {"args": vars(args), "counts": counts, "shares": shares, "per_job": per_job})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=4, help="texts per category")
    parser.add_argument("--offset", type=int, default=25, help="the first text of each category")
    parser.add_argument("--text-chars", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=320, help="enough for every record to close")
    parser.add_argument("--top", type=int, default=50, help="the head's likeliest first drafts the mask may pick from")
    logging.basicConfig(level=logging.WARNING)
    main(parser.parse_args())
