"""Microbenchmark: time per call of each paged-attention path on one device.

SmolLM2-like shapes (H=9, KVH=3, D=64, block_size 16). On the CPU: the
batch-invariant C kernel (what the worker runs) vs the SDPA path; on CUDA:
Triton vs the SDPA path. Run:

    python bench/bench_paged_attention.py [--threads N]                        # CPU, context 300
    python bench/bench_paged_attention.py --device cuda --seqs 1,8,64 --contexts 512,4096 --q-lens 1
"""

import argparse
import math
import time

import torch

from kernels import paged_attention_cpu
from kernels._triton import HAS_TRITON
from kernels.paged_attention import paged_attention_sdpa, paged_attention_triton

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_inputs(num_seqs: int, q_len: int, context_len: int, dtype: torch.dtype, device: str) -> tuple:
    """A batch of ``num_seqs`` sequences, each ``q_len`` query tokens ending at ``context_len``."""
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 8
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, dtype=dtype)  # [num_blocks, block_size, KVH, D]
    value_cache = torch.randn(cache_shape, dtype=dtype)  # [num_blocks, block_size, KVH, D]
    block_ids = torch.randperm(num_blocks, dtype=torch.int32)[: num_seqs * blocks_per_seq]
    block_tables = block_ids.view(num_seqs, blocks_per_seq)  # [B, max_blocks] shuffled ids
    query = torch.randn(num_seqs * q_len, NUM_HEADS, HEAD_DIM, dtype=dtype)  # [T, H, D]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len  # [B+1]
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)  # [B]
    tensors = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    return (*(t.to(device) for t in tensors), 1 / math.sqrt(HEAD_DIM))


def time_per_call_us(function, args: tuple, num_rounds: int = 20, calls_per_round: int = 20) -> float:
    """Best round's mean time per call, in microseconds (robust to other load on the machine)."""
    synchronize = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    for _ in range(10):
        function(*args)
    best = float("inf")
    for _ in range(num_rounds):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls_per_round):
            function(*args)
        synchronize()
        best = min(best, (time.perf_counter() - start) / calls_per_round * 1e6)
    return best


def paths(device: str) -> dict:
    """The implementations to time on this device: the worker's own path first, SDPA last."""
    if device.startswith("cuda"):
        return (
            {"triton": paged_attention_triton, "sdpa": paged_attention_sdpa}
            if HAS_TRITON
            else {"sdpa": paged_attention_sdpa}
        )
    own = {"c kernel": paged_attention_cpu.paged_attention_cpu} if paged_attention_cpu.available() else {}
    return {**own, "sdpa": paged_attention_sdpa}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=ints, default=[1, 8], help="sequences per call, comma-separated")
    parser.add_argument("--q-lens", type=ints, default=[1, 5], help="query tokens per sequence")
    parser.add_argument("--contexts", type=ints, default=[300], help="context tokens per sequence")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    functions = paths(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; us per call")
    print(f"{'dtype':9s} {'seqs':>5s} {'q_len':>5s} {'context':>7s} " + " ".join(f"{n:>9s}" for n in functions))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for num_seqs in args.seqs:
            for q_len in args.q_lens:
                for context in args.contexts:
                    inputs = make_inputs(num_seqs, q_len, context, dtype, args.device)
                    times = [time_per_call_us(f, inputs) for f in functions.values()]
                    print(
                        f"{dtype_name:9s} {num_seqs:5d} {q_len:5d} {context:7d} " + " ".join(f"{t:9.1f}" for t in times)
                    )


if __name__ == "__main__":
    main()
