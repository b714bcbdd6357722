"""The worker on one device, in one run: plain decoding vs `transformers`, and speculation vs plain.

    .venv/bin/python bench/bench_gpu.py --device cuda --dtype bfloat16      # the GPU numbers of the README
    .venv/bin/python bench/bench_gpu.py --device cuda --proposers "ngram;eagle3;eagle3,suffix"  # and the head
    .venv/bin/python bench/bench_gpu.py --device cpu --batches 1,2 --hf-batches 1 --spec-batches 1 \\
        --prompts-per-category 1 --new-tokens 16                         # a quick check that it runs

SmolLM2-135M-Instruct, greedy, prompts from Spec-Bench (first turn, chat
template; batch b takes b prompts, cycling through them):
- plain decoding tokens/s (all sequences together) at --batches, and
  `transformers` `generate` at --hf-batches (left-padded, no EOS stop);
- speculation (each of --proposers: n-gram by default; eagle3 drafts with the
  shipped head) at k in --ks vs plain decoding at --spec-batches, on the first
  N prompts of five categories; and how many outputs differ from plain.
For the attention kernels on the same device:
    .venv/bin/python bench/bench_paged_attention.py --device cuda --seqs 1,8,64 --contexts 512,4096 --q-lens 1,4
Saves JSON under bench/results/.
"""

import argparse
import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_spec import CATEGORIES  # noqa: E402
from bench.common import chat_ids, load_questions, save  # noqa: E402
from tests.worker.driver import Driver  # noqa: E402
from worker_service.runtime.default_model import DEFAULT_EAGLE3_HEAD, fetch_default_model  # noqa: E402
from worker_service.runtime.loader import load_model, load_tokenizer  # noqa: E402
from worker_service.speculation.build import build_worker  # noqa: E402
from worker_service.speculation.config import WorkerConfig  # noqa: E402

BLOCK_SIZE = 16
logger = logging.getLogger("bench.gpu")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def batch_of(prompts: list[list[int]], size: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(size)]


def worker_tok_s(
    worker, num_blocks: int, prompts: list[list[int]], new_tokens: int, k: int = 0, device: str = "cpu"
) -> tuple[float, list[list[int]]]:
    """Tokens/s of one Driver run (the prefill included), and the outputs."""
    outputs = []

    def run():
        outputs[:] = Driver(worker.execute, BLOCK_SIZE, num_blocks).generate(
            prompts, new_tokens, num_speculative_tokens=k
        )

    seconds = timed(device, run)
    return len(prompts) * new_tokens / seconds, outputs


def hf_tok_s(model, tokenizer, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, W] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run():
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )

    run()  # warm-up
    return len(prompts) * new_tokens / timed(device, run)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(args) -> None:
    path = str(fetch_default_model())
    tokenizer = load_tokenizer(path)
    questions = load_questions(categories=list(CATEGORIES), per_category=args.prompts_per_category)
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in questions]
    num_blocks = (
        max(args.batches + args.spec_batches) * (max(map(len, prompts)) + args.new_tokens + 8) // BLOCK_SIZE + 1
    )
    configs = [("none", 0)] + [(proposer, k) for proposer in args.proposers for k in args.ks]
    workers = {
        (proposer, k): build_worker(
            WorkerConfig(
                model=path,
                dtype=args.dtype,
                device=args.device,
                proposer=proposer,
                num_speculative_tokens=k,
                draft_model=str(DEFAULT_EAGLE3_HEAD) if "eagle3" in proposer else None,
            )
        )
        for proposer, k in configs
    }
    for (_, k), worker in workers.items():
        worker.init_cache(num_blocks, BLOCK_SIZE)
        worker_tok_s(worker, num_blocks, prompts[:1], 8, k, args.device)  # warm-up (kernel builds)
    plain = workers["none", 0]
    results = {"args": vars(args), "device": plain.config.device, "plain": {}, "hf": {}, "spec": {}}
    for batch in args.batches:  # each run once before it is timed, as hf_tok_s does (shapes, autotuning)
        worker_tok_s(plain, num_blocks, batch_of(prompts, batch), args.new_tokens, device=args.device)
        results["plain"][batch], _ = worker_tok_s(
            plain, num_blocks, batch_of(prompts, batch), args.new_tokens, device=args.device
        )
        logger.info("plain decoding, batch %d: %.1f tok/s", batch, results["plain"][batch])
    model = load_model(path, plain.config.dtype, torch.device(plain.config.device))
    for batch in args.hf_batches:
        results["hf"][batch] = hf_tok_s(model, tokenizer, batch_of(prompts, batch), args.new_tokens, args.device)
        logger.info("transformers generate, batch %d: %.1f tok/s", batch, results["hf"][batch])
    del model
    for batch in args.spec_batches:  # every prompt once, in groups of `batch`, every k on each group in turn
        seconds = {k: 0.0 for k in workers}
        outputs = {k: [] for k in workers}
        for start in range(0, len(prompts), batch):
            group = batch_of(prompts[start:] + prompts[:start], batch)
            for (proposer, k), worker in workers.items():
                tok_s, out = worker_tok_s(worker, num_blocks, group, args.new_tokens, k, args.device)
                seconds[proposer, k] += len(group) * args.new_tokens / tok_s
                outputs[proposer, k] += out
        base = ("none", 0)
        total = len(outputs[base]) * args.new_tokens
        results["spec"][batch] = {
            f"{proposer} k={k}": {
                "tok_s": total / seconds[proposer, k],
                "vs_plain": seconds[base] / seconds[proposer, k],
                "outputs_differing": sum(a != b for a, b in zip(outputs[proposer, k], outputs[base])),
            }
            for proposer, k in workers
        }
        logger.info("batch %d: %s", batch, results["spec"][batch])

    print(f"\nSmolLM2-135M on {results['device']}, {plain.config.dtype}, greedy, {args.new_tokens} new tokens")
    for batch, tok_s in results["plain"].items():
        hf = results["hf"].get(batch)
        versus = f"  ({tok_s / hf:.2f}x transformers generate: {hf:.1f} tok/s)" if hf else ""
        print(f"  plain decoding, batch {batch:3d}: {tok_s:8.1f} tok/s{versus}")
    for batch, row in results["spec"].items():
        print(f"  speculation, batch {batch:3d}: plain {row['none k=0']['tok_s']:.1f} tok/s")
        for name, r in row.items():
            if name != "none k=0":
                print(f"    {name:20s} {r['tok_s']:8.1f} tok/s ({r['vs_plain']:.2f}x, {r['outputs_differing']} differ)")
    save("gpu" if args.device.startswith("cuda") else f"device-{args.device}", results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batches", type=ints, default=[1, 8, 64], help="plain decoding batch sizes")
    parser.add_argument("--hf-batches", type=ints, default=[1, 8], help="transformers generate batch sizes")
    parser.add_argument("--spec-batches", type=ints, default=[1, 16], help="speculation vs plain batch sizes")
    parser.add_argument("--ks", type=ints, default=[3, 5])
    parser.add_argument(
        "--proposers",
        type=lambda text: [p for p in text.split(";") if p],
        default=["ngram"],
        help="semicolon-separated --proposer values, e.g. 'ngram;eagle3;eagle3,suffix'",
    )
    parser.add_argument("--prompts-per-category", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    ARGS = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(ARGS)
