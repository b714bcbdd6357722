"""What a structured-output constraint costs the worker per token, in-process: no server, no model forward.

    .venv/bin/python bench/bench_constraint.py [--passes 3]

For each JSON schema of bench_structured.py, a valid record is tokenized with
the default model's tokenizer and walked token by token as a constrained
plain step walks it: the grammar's mask for the next position
(worker_service/speculation/structured.masks), applying it to a row of logits
(apply_masks: the C kernel of kernels/token_bitmask.py; "apply_ref" its
PyTorch reference, for comparison), the tokens the grammar forces next (forced_tokens) and
advancing the matcher over the emitted token (advance). Prints ms per token
of each part (mean over the record, one line per pass) with the CPU's name;
saves JSON under bench/results/.
"""

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.bench_linear import cpu_name  # noqa: E402
from bench.bench_structured import ARTICLE_SCHEMA, PASSAGE_SCHEMA  # noqa: E402
from bench.common import save  # noqa: E402
from kernels import token_bitmask  # noqa: E402
from specdec.structured import to_grammar  # noqa: E402
from worker_service.runtime.default_model import fetch_default_model  # noqa: E402
from worker_service.speculation import structured  # noqa: E402

RECORDS = {
    "article": (
        ARTICLE_SCHEMA,
        {
            "title": "A new bridge opens in the old town centre",
            "people": ["Mayor Anna Smith", "John Doe"],
            "places": ["Springfield"],
            "topic": "world",
            "summary": "The town opened a long-awaited bridge across the river on Monday, after three years of "
            "construction and many delays.",
        },
    ),
    "passage": (
        PASSAGE_SCHEMA,
        {
            "subject": "The water cycle",
            "key_facts": [
                "Water evaporates from oceans and lakes.",
                "Clouds form as vapour cools.",
                "Rain returns it to the ground.",
            ],
            "sentiment": "neutral",
        },
    ),
}
PARTS = ("mask", "apply", "forced", "advance")
COMPARED = ("apply_ref",)  # timed beside the parts, not part of a step


def walk(start, token_ids: list[int], vocab_size: int, eos: list[int], logits: torch.Tensor) -> dict[str, float]:
    """ms per token of each part over one constrained walk of `token_ids`."""
    matcher, spent = start.deep_copy(), dict.fromkeys(PARTS + COMPARED, 0.0)
    for token in token_ids:
        t0 = time.perf_counter()
        bitmask = structured.masks(matcher, [], vocab_size)
        t1 = time.perf_counter()
        structured.apply_masks(logits.clone(), [0], [bitmask], eos)
        t2 = time.perf_counter()
        structured.forced_tokens(matcher, 16)
        t3 = time.perf_counter()
        structured.advance(matcher, [token])
        t4 = time.perf_counter()
        token_bitmask.apply_token_bitmask_reference(logits.clone(), torch.tensor([0]), bitmask, eos)
        t5 = time.perf_counter()
        for part, seconds in zip(PARTS + COMPARED, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            spent[part] += seconds
    return {part: seconds / len(token_ids) * 1e3 for part, seconds in spent.items()}


def main(args) -> None:
    model = fetch_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    eos = [tokenizer.eos_token_id]
    grammars = structured.Grammars(lambda: (model / "tokenizer.json").read_text(), vocab_size, eos)
    logits = torch.randn(1, vocab_size)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {model.name}: ms per token")
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "records": {}}
    for name, (schema, record) in RECORDS.items():
        start = grammars.start(to_grammar("json", json.dumps(schema))).result()
        token_ids = tokenizer(json.dumps(record))["input_ids"]
        walk(start, token_ids, vocab_size, eos, logits)  # warm-up
        passes = [walk(start, token_ids, vocab_size, eos, logits) for _ in range(args.passes)]
        report["records"][name] = {"num_tokens": len(token_ids), "passes": passes}
        for spent in passes:
            print(
                f"  {name} ({len(token_ids)} tokens): "
                + "  ".join(f"{p} {spent[p]:.3f}" for p in PARTS)
                + f"  total {sum(spent[p] for p in PARTS):.3f}  (apply_ref {spent['apply_ref']:.3f})"
            )
    # A verify step of k = 5 applies six rows' masks at once: the whole step's apply, kernel and reference.
    start = grammars.start(to_grammar("json", json.dumps(RECORDS["article"][0]))).result().deep_copy()
    bitmask = structured.masks(start, tokenizer(json.dumps(RECORDS["article"][1]))["input_ids"][:5], vocab_size)
    step_logits, rows = torch.randn(6, vocab_size), torch.arange(6)
    report["six_row_apply_ms"] = {}
    for label, apply in (
        ("kernel", token_bitmask.apply_token_bitmask_),
        ("reference", token_bitmask.apply_token_bitmask_reference),
    ):
        warm = step_logits.clone()  # in cache, as the scorer's logits are; applying again does the same work
        apply(warm, rows, bitmask, eos)
        begin = time.perf_counter()
        for _ in range(200):
            apply(warm, rows, bitmask, eos)
        report["six_row_apply_ms"][label] = (time.perf_counter() - begin) / 200 * 1e3
    print(
        "  six rows' masks applied at once (a k = 5 verify): "
        + "  ".join(f"{label} {ms:.3f} ms" for label, ms in report["six_row_apply_ms"].items())
    )
    print(f"saved {save('constraint', report)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=3)
    main(parser.parse_args())
