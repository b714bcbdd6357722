"""Microbenchmark: keyed Exp(1) noise over SmolLM2's vocabulary, and one sampling step with it.

For 1, 6, 8 and 48 rows of V = 49152 (a plain decode step samples one row per
sequence; a batch of 8 sequences verifying k = 5 n-gram drafts samples 48):

- keyed noise: ``keyed_exponential`` (worker_service/speculation/keyed_random.py)
- exponential_: ``torch.empty(N, V).exponential_()``, the stateful-RNG noise it replaced
- sampling step: logits -> ``logits_to_probs`` -> keyed exponential race (``sample_from_probs``)
- step with exponential_: the same step with ``exponential_`` noise

Times are the best round's mean (robust to other load on a shared machine).
Run: ``.venv/bin/python bench/bench_keyed_noise.py [--threads N]``; the JSON goes to bench/results/.
"""

import argparse
import logging
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import save  # noqa: E402
from kernels.rejection_sampler import race  # noqa: E402
from specdec.step import RequestSampling  # noqa: E402
from worker_service.speculation.keyed_random import STREAM_TOKEN, keyed_exponential  # noqa: E402
from worker_service.speculation.sampling import logits_to_probs, sample_from_probs, sampling_tensors  # noqa: E402

NUM_VOCAB = 49152  # SmolLM2
ROW_COUNTS = (1, 6, 8, 48)
logger = logging.getLogger("bench")


def best_ms(fn, num_rounds: int = 40, calls_per_round: int = 5) -> float:
    """Best round's mean time per call, in milliseconds."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(num_rounds):
        start = time.perf_counter()
        for _ in range(calls_per_round):
            fn()
        best = min(best, (time.perf_counter() - start) / calls_per_round * 1e3)
    return best


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def measure(num_rows: int) -> dict:
    """Times of the four operations for one row count."""
    seeds = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(num_rows)]
    positions = [300 + i for i in range(num_rows)]
    logits = torch.randn(num_rows, NUM_VOCAB) * 3  # [N, V]
    params = sampling_tensors([RequestSampling(temperature=0.8, seed=s) for s in seeds])

    def keyed_step():
        probs = logits_to_probs(logits, *params)  # [N, V]
        return sample_from_probs(probs, seeds, positions, STREAM_TOKEN)

    def exponential_step():
        probs = logits_to_probs(logits, *params)  # [N, V]
        return race(probs, torch.empty(num_rows, NUM_VOCAB).exponential_())

    return {
        "rows": num_rows,
        "keyed_noise_ms": best_ms(lambda: keyed_exponential(seeds, positions, STREAM_TOKEN, NUM_VOCAB)),
        "exponential_ms": best_ms(lambda: torch.empty(num_rows, NUM_VOCAB).exponential_()),
        "keyed_step_ms": best_ms(keyed_step),
        "exponential_step_ms": best_ms(exponential_step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, V = {NUM_VOCAB}")
    print(f"{'rows':>5} {'keyed noise':>12} {'exponential_':>13} {'step (keyed)':>13} {'step (exponential_)':>20}")
    rows = []
    for num_rows in ROW_COUNTS:
        logger.info("timing %d rows", num_rows)
        r = measure(num_rows)
        rows.append(r)
        print(
            f"{num_rows:>5} {r['keyed_noise_ms']:>9.3f} ms {r['exponential_ms']:>10.3f} ms "
            f"{r['keyed_step_ms']:>10.3f} ms {r['exponential_step_ms']:>17.3f} ms"
        )
    save("keyed-noise", {"cpu_model": cpu_model(), "num_vocab": NUM_VOCAB, "rows": rows})


if __name__ == "__main__":
    main()
