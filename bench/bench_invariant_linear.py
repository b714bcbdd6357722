"""The batch-invariant linear on a GPU: its time per layer shape against cuBLAS and the weight-read bound,
with K split (the default) and unsplit, and its rows' bits alone and in a batch.

    python3 bench/bench_invariant_linear.py [--shapes 8b,1b] [--rows 1,8,64,256] [--out DIR]

For each linear of a Llama-3.1-8B / Llama-3.2-1B decoder layer and the output layer (random bf16 weights):
the kernel time (CUDA graphs of the calls, so launches cost what they cost in a replayed step) of
`linear_triton` as shipped (K split by kernels.invariant_ops.k_splits for steps of up to SPLIT_ROWS rows),
of the same kernel with K unsplit (one program per tile, as before the split), and of cuBLAS (`x @ w.T`, not
batch invariant), at each --rows; the bound is the weight's bytes over the measured copy bandwidth. The
weights are cycled over copies larger than the L2 cache, so every call reads them from memory. Then, per
shape, whether each row of a --rows batch equals that row computed alone, bit for bit (split and unsplit
paths both run). Prints a table and writes invariant-linear.json into --out. Needs CUDA.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import copy_bandwidth  # noqa: E402
from kernels import invariant_ops  # noqa: E402

# (name, N, K) per layer; the output layer is the vocabulary's
LAYERS = {
    "8b": [
        ("q_proj", 4096, 4096),
        ("k_proj", 1024, 4096),
        ("o_proj", 4096, 4096),
        ("gate_proj", 14336, 4096),
        ("down_proj", 4096, 14336),
        ("lm_head", 128256, 4096),
    ],
    "1b": [
        ("q_proj", 2048, 2048),
        ("k_proj", 512, 2048),
        ("gate_proj", 8192, 2048),
        ("down_proj", 2048, 8192),
        ("lm_head", 128256, 2048),
    ],
}
L2_BYTES = 64 << 20


def graph_seconds(fn, calls: int, replays: int = 20) -> float:
    """Seconds per fn() call, fn captured `calls` times in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays / calls


def unsplit(n: int, k: int) -> tuple[int, int]:
    return 1, -(-k // invariant_ops.BLOCK_K) * invariant_ops.BLOCK_K


def timings(n, k, rows_list, device, bandwidth) -> dict:
    weight_bytes = n * k * 2
    copies = max(1, -(-2 * L2_BYTES // weight_bytes))
    generator = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn((n, k), generator=generator, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    result = {"bound_us": round(1e6 * weight_bytes / bandwidth, 2), "splits": invariant_ops.k_splits(n, k)[0]}
    shipped = invariant_ops.k_splits
    for rows in rows_list:
        x = torch.randn((rows, k), generator=generator, device=device, dtype=torch.bfloat16)
        row = {}
        for name, call, splits in (
            ("split", invariant_ops.linear_triton, shipped),
            ("unsplit", invariant_ops.linear_triton, unsplit),
            ("cublas", lambda x, w: x @ w.T, shipped),
        ):
            invariant_ops.k_splits = splits  # linear_triton looks it up at every call
            try:
                row[name] = round(1e6 * graph_seconds(lambda: [call(x, w) for w in weights], calls=1) / copies, 2)
            finally:
                invariant_ops.k_splits = shipped
        result[f"rows {rows}"] = row
    return result


def bitwise(n, k, most, device) -> dict:
    """Each of `most` rows computed alone and in the batch, split and unsplit paths: equal bits or not."""
    generator = torch.Generator(device=device).manual_seed(1)
    w = torch.randn((n, k), generator=generator, device=device, dtype=torch.bfloat16)
    x = torch.randn((most, k), generator=generator, device=device, dtype=torch.bfloat16)
    whole = invariant_ops.linear_triton(x, w)
    differing = 0
    for count in (1, 2, 7, 64, 65, most):
        differing += int(not torch.equal(invariant_ops.linear_triton(x[:count], w), whole[:count]))
    for start in (0, 5, 63, 64, most - 1):
        differing += int(
            not torch.equal(invariant_ops.linear_triton(x[start : start + 1], w), whole[start : start + 1])
        )
    return {"batches_checked": 11, "differing": differing}


def measure(shapes: list[str], rows_list: list[int], path: pathlib.Path) -> dict:
    """Every layer of `shapes` at each of rows_list, printed and written to `path` as it goes; per shape the
    sums of its layers' times ("<shape> sum": rows -> split / unsplit / cublas / bound, in us)."""
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    results = {"device": torch.cuda.get_device_name(device), "copy_tb_s": round(bandwidth / 1e12, 3), "layers": {}}
    print(f"{results['device']}: copy {results['copy_tb_s']} TB/s", flush=True)
    for shape in shapes:
        totals = {rows: {"split": 0.0, "unsplit": 0.0, "cublas": 0.0, "bound": 0.0} for rows in rows_list}
        differing = 0
        for name, n, k in LAYERS[shape]:
            key = f"{shape} {name} {n}x{k}"
            entry = timings(n, k, rows_list, device, bandwidth)
            entry["bitwise"] = bitwise(n, k, max(rows_list), device)
            differing += entry["bitwise"]["differing"]
            results["layers"][key] = entry
            for rows in rows_list:
                line = entry[f"rows {rows}"]
                for kind in ("split", "unsplit", "cublas"):
                    totals[rows][kind] += line[kind]
                totals[rows]["bound"] += entry["bound_us"]
                print(
                    f"{key:28s} splits {entry['splits']:2d} rows {rows:4d}: bound {entry['bound_us']:8.1f} us  "
                    f"split {line['split']:8.1f}  unsplit {line['unsplit']:8.1f}  cublas {line['cublas']:8.1f}",
                    flush=True,
                )
            print(f"{key:28s} rows differing alone vs batch: {entry['bitwise']['differing']}", flush=True)
            path.write_text(json.dumps(results, indent=2) + "\n")
        results[f"{shape} sum"] = {rows: {k: round(v, 1) for k, v in t.items()} for rows, t in totals.items()}
        results[f"{shape} differing"] = differing
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(shape, "sum of its layers (us):", json.dumps(results[f"{shape} sum"]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8b,1b")
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_invariant_linear needs CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    measure(args.shapes.split(","), [int(r) for r in args.rows.split(",")], args.out / "invariant-linear.json")


if __name__ == "__main__":
    main()
