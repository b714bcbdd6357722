"""Microbenchmark: time per call of each paged-attention path on one device.

Heads of SmolLM2 (H=9, KVH=3, D=64; the default) or Llama-3's 1B / 8B shapes (--shape), block_size 16. On the
CPU: the batch-invariant C kernel over K kept transposed in its blocks (what the worker runs,
worker_service/runtime/kv_cache.py) and over the usual layout, vs the SDPA path; --cflags builds the C kernel
with more flags (`-march=x86-64-v3`: the AVX2 path AMD Zen 3 runs); on CUDA: Triton vs the SDPA path,
and --before FILE adds the Triton kernel of another revision of kernels/paged_attention.py
(`git show REV:kernels/paged_attention.py > FILE`). On CUDA the Triton kernels are timed in a CUDA graph (the
GPU's time per call, as a graphed step runs them); SDPA's path, which reads the lengths on the host, per
launch. Run:

    python bench/bench_paged_attention.py [--threads N]                        # CPU, context 300
    python bench/bench_paged_attention.py --cflags=-march=x86-64-v3 --seqs 1 --contexts 300,1000  # the AVX2 path
    python bench/bench_paged_attention.py --device cuda --shape 8b --seqs 1,8,64 --contexts 512,4096 --q-lens 1,6
"""

import argparse
import functools
import importlib.util
import json
import math
import time

import torch

from kernels import paged_attention_cpu
from kernels._triton import HAS_TRITON
from kernels.cpu_build import load_library
from kernels.paged_attention import paged_attention_sdpa, paged_attention_triton

BLOCK_SIZE = 16
SHAPES = {"smollm2": (9, 3, 64), "1b": (32, 8, 64), "8b": (32, 8, 128)}  # (heads, KV heads, head dim)


def make_inputs(
    num_seqs: int, q_len: int, context_len: int, dtype: torch.dtype, device: str, shape: str = "smollm2"
) -> tuple:
    """A batch of ``num_seqs`` sequences, each ``q_len`` query tokens ending at ``context_len``."""
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = SHAPES[shape]
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


def graph_time_per_call_us(function, args: tuple, num_rounds: int = 20, calls_per_round: int = 20) -> float:
    """Best round's time per call of `calls_per_round` calls replayed from one CUDA graph (the function must
    not read the device from the host)."""
    for _ in range(3):
        function(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_round):
            function(*args)
    graph.replay()
    best = float("inf")
    for _ in range(num_rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls_per_round * 1e6)
    return best


def load_before(path: str):
    """The Triton path of another revision's kernels/paged_attention.py, saved at `path`."""
    spec = importlib.util.spec_from_file_location("paged_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention_triton


def paths(device: str, cflags: str = "") -> dict:
    """The implementations to time on this device: the worker's own path first, SDPA last. Each takes the inputs
    make_inputs gives (a CPU path that reads K transposed transposes it once per case: `transposed_inputs`)."""
    if device.startswith("cuda"):
        return (
            {"triton": paged_attention_triton, "sdpa": paged_attention_sdpa}
            if HAS_TRITON
            else {"sdpa": paged_attention_sdpa}
        )
    if not paged_attention_cpu.available():
        return {"sdpa": paged_attention_sdpa}
    build = paged_attention_cpu.bind(load_library("paged_attention_cpu", tuple(cflags.split()))) if cflags else None
    c_kernel = functools.partial(paged_attention_cpu.paged_attention_cpu, function=build)
    return {
        "c, K^T": functools.partial(c_kernel, keys_transposed=True),
        "c kernel": c_kernel,
        "sdpa": paged_attention_sdpa,
    }


def transposed_inputs(inputs: tuple) -> tuple:
    """make_inputs' tuple with K as a CPU KVCache keeps it: [num_blocks, KVH, D, block_size]."""
    query, key_cache, *rest = inputs
    return (query, key_cache.permute(0, 2, 3, 1).contiguous(), *rest)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def measure(
    device: str,
    shape: str,
    seqs: list[int],
    q_lens: list[int],
    contexts: list[int],
    dtypes: list[str],
    before: str | None = None,
    cflags: str = "",
    split_keys: list[int] = (),
) -> list[dict]:
    """Times every path on every case; prints a row per case and returns them. split_keys: the Triton kernel
    again with its keys cut at each of these instead of SPLIT_KEYS (CUDA)."""
    functions = paths(device, cflags)
    on_cuda = device.startswith("cuda")
    if "triton" in functions:
        splits = {f"split {n}": functools.partial(paged_attention_triton, split_keys=n) for n in split_keys}
        functions = {"triton": functions.pop("triton"), **splits, **functions}
    if before and on_cuda:
        functions = {"before": load_before(before), **functions}
    threads = torch.get_num_threads()
    built = f", C kernel built with {cflags}" if cflags and not on_cuda else ""
    print(f"torch {torch.__version__}, {threads} threads, device {device}, {shape}{built}; us per call")
    print(f"{'dtype':9s} {'seqs':>5s} {'q_len':>5s} {'context':>7s} " + " ".join(f"{n:>9s}" for n in functions))
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for num_seqs in seqs:
            for q_len in q_lens:
                for context in contexts:
                    inputs = make_inputs(num_seqs, q_len, context, dtype, device, shape)
                    times = {}
                    for name, function in functions.items():
                        if name == "triton" or name.startswith("split"):  # launched for the rows there are
                            function = functools.partial(function, max_query_len=q_len)
                        # SDPA's path reads the lengths on the host: no graph can capture it
                        graphed = graph_time_per_call_us(function, inputs) if on_cuda and name != "sdpa" else None
                        args = transposed_inputs(inputs) if name == "c, K^T" else inputs
                        times[name] = graphed if graphed is not None else time_per_call_us(function, args)
                    rows.append(dict(dtype=dtype_name, seqs=num_seqs, q_len=q_len, context=context, us=times))
                    print(
                        f"{dtype_name:9s} {num_seqs:5d} {q_len:5d} {context:7d} "
                        + " ".join(f"{t:9.1f}" for t in times.values())
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=ints, default=[1, 8], help="sequences per call, comma-separated")
    parser.add_argument("--q-lens", type=ints, default=[1, 5], help="query tokens per sequence")
    parser.add_argument("--contexts", type=ints, default=[300], help="context tokens per sequence")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    parser.add_argument("--before", default=None, help="another revision's kernels/paged_attention.py (CUDA)")
    parser.add_argument("--split-keys", type=ints, default=[], help="CUDA: also time Triton cut at these keys")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--cflags", default="", help="CPU: build the C kernel with these extra flags (space-separated)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(
        args.device,
        args.shape,
        args.seqs,
        args.q_lens,
        args.contexts,
        args.dtypes.split(","),
        args.before,
        args.cflags,
        args.split_keys,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
