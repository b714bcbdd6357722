"""What a request's logits processing costs a step: `process_logits` (worker_service/speculation/
logits_processing.py) on a verify step's rows, against the forward it follows.

The server-level benchmark (bench/bench_sampling.py) compares speculation's speedup with and without a
penalty, but a penalty also changes the text, and with it what a copying proposer finds to copy: that part of
the difference is not the processing's cost. Here the processing alone, on SmolLM2's vocabulary (49,152),
per call, for a sequence of --prompt prompt tokens and --output emitted ones, plain decoding's 1 row and a
verify's k + 1 rows, batch 1 and 8:

    .venv/bin/python bench/bench_logits_processing.py [--prompt 300] [--output 100] [--repeats 200]
"""

import argparse
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from specdec import step  # noqa: E402
from worker_service.speculation.logits_processing import process_logits  # noqa: E402
from worker_service.speculation.request_state import RequestState  # noqa: E402

VOCAB = 49152
VARIANTS = {
    "repetition_penalty 1.1": dict(repetition_penalty=1.1),
    "presence + frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "logit_bias (4 tokens)": dict(logit_bias=((1, 2.0), (7, -1.0), (99, 5.0), (4000, -100.0))),
}


def states(batch: int, prompt: int, output: int, sampling: step.RequestSampling, rng: random.Random) -> list:
    return [
        RequestState(f"r{i}", [rng.randrange(VOCAB) for _ in range(prompt + output)], prompt, sampling, [], 0)
        for i in range(batch)
    ]


def ms_per_call(fn, repeats: int) -> float:
    """The best of 5 rounds' mean, in ms."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--output", type=int, default=100)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (V = {VOCAB})")
    print(f"{'processing':26s} {'batch':>5s} {'rows':>4s} {'ms':>7s}")
    for name, fields in VARIANTS.items():
        sampling = step.RequestSampling(temperature=0.0, **fields)
        for batch in (1, 8):
            seqs = states(batch, args.prompt, args.output, sampling, rng)
            for k in (0, args.k):
                drafts = [[rng.randrange(VOCAB) for _ in range(k)] for _ in seqs]
                logits = torch.randn(batch * (k + 1), VOCAB)
                ms = ms_per_call(lambda: process_logits(logits, seqs, drafts, [None] * batch), args.repeats)
                print(f"{name:26s} {batch:5d} {k + 1:4d} {ms:7.3f}")


if __name__ == "__main__":
    main()
