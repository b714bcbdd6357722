"""Microbenchmark: time per call of the paged-attention reference on the CPU.

SmolLM2-like shapes (H=9, KVH=3, D=64, block_size 16) at a 300-token context.
Run: ``python bench/bench_paged_attention.py [--threads N]``.
"""

import argparse
import math
import time

import torch

from kernels.paged_attention import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_inputs(num_seqs: int, q_len: int, context_len: int, dtype: torch.dtype) -> tuple:
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
    return query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, 1 / math.sqrt(HEAD_DIM)


def time_per_call_us(args: tuple, num_rounds: int = 20, calls_per_round: int = 20) -> float:
    """Best round's mean time per call, in microseconds (robust to other load on the machine)."""
    for _ in range(10):
        paged_attention_ref(*args)
    best = float("inf")
    for _ in range(num_rounds):
        start = time.perf_counter()
        for _ in range(calls_per_round):
            paged_attention_ref(*args)
        best = min(best, (time.perf_counter() - start) / calls_per_round * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    cases = [("batch 1 decode", 1, 1), ("batch 8 decode", 8, 1), ("batch 1, 5-token query", 1, 5),
             ("batch 8, 5-token queries", 8, 5)]
    for dtype in (torch.float32, torch.bfloat16):
        for name, num_seqs, q_len in cases:
            us = time_per_call_us(make_inputs(num_seqs, q_len, 300, dtype))
            print(f"{str(dtype):15s} {name:26s} context 300: {us:8.1f} us/call")


if __name__ == "__main__":
    main()
