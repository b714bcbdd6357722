"""The GPU check: every measurement the GPU work is judged by, in phases that fit a lent GPU's calls.

`scripts/gpu_check.sh` runs it on the device machine (it installs the carried wheels and joins the carried
model first); each phase writes `gpu_check-<phase>.json` into --out as it goes, so a phase cut short still
returns what it measured. `merge` (run here) joins them into `bench/results/gpu_check.json`.

    python3 bench/gpu_check.py probe --out $OUT        # versions, the device, copy bandwidth, bf16 matmul rate
    python3 bench/gpu_check.py tier --out $OUT         # pytest -m gpu tests/kernels tests/worker
    python3 bench/gpu_check.py invariance --out $OUT   # a row's logits alone vs in batches of up to 256 rows
    python3 bench/gpu_check.py linears --out $OUT      # the invariant linear per 1B / 8B layer: split K or not
    python3 bench/gpu_check.py attention --out $OUT    # the paged attention kernel per call, 8B heads
    python3 bench/gpu_check.py profile --out $OUT      # a decode step's kernels, their count and time by kind
    python3 bench/gpu_check.py shapes --out $OUT       # 1B / 8B-shaped Llama: plain step vs bound, verify, HF
    python3 bench/gpu_check.py smollm2 --out $OUT      # SmolLM2: vs transformers, speculation, lossless checks
    python3 bench/gpu_check.py merge DIR               # here: DIR's phase files -> bench/results/gpu_check.json
                                                       # (--keep FILE: phases DIR lacks, from an earlier run)

On a CPU every phase runs too (`--device cpu --shape tiny`), to check the script without a GPU.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import copy_bandwidth, median_seconds, synchronize  # noqa: E402

BLOCK_SIZE = 16
# Llama-3.2-1B's, Llama-3.1-8B's and SmolLM2's shapes (random weights: nothing is carried), and a tiny one for
# the CPU.
SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(  # SmolLM2-135M's shape: the default model's steps without carrying its weights
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=True,
    ),
}
# Spec-Bench categories whose answers copy from the prompt (bench/bench_spec.py's): where n-gram drafts land.
GROUNDED = ("summarization", "rag", "qa", "translation", "math_reasoning")


class Phase:
    """One phase's results, written to `<out>/gpu_check-<name>.json` after every measure."""

    def __init__(self, name: str, out: pathlib.Path):
        self.path = out / f"gpu_check-{name}.json"
        self.data = {"phase": name, "measures": {}, "details": {}, "errors": {}}
        out.mkdir(parents=True, exist_ok=True)

    def measure(self, name: str, value) -> None:
        self.data["measures"][name] = value
        self.save()

    def detail(self, name: str, value) -> None:
        self.data["details"][name] = value
        self.save()

    def attempt(self, name: str, fn) -> None:
        """Runs fn(); an exception is recorded (not raised), so the next measure still runs."""
        started = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, none stops the phase
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"[:800]
            traceback.print_exc()
        self.data["details"].setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
        self.save()
        print(f"[gpu_check] {name}: {time.perf_counter() - started:.1f} s", flush=True)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def random_llama(shape: str, dtype: torch.dtype, device: torch.device, num_layers: int | None = None):
    """A Llama-architecture model of `shape` with seeded random weights, built on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES[shape])
    if num_layers:
        fields["num_hidden_layers"] = num_layers
    config = LlamaConfig(max_position_embeddings=4096, rope_theta=500000.0, **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def weight_read_bytes(model) -> int:
    """Bytes a decode step must read: every weight once; the input embedding only when it is also the output
    layer (a step reads one row of it otherwise)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        embed = model.get_input_embeddings().weight
        total -= embed.numel() * embed.element_size()
    return total


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=generator).tolist()


# --- probe -----------------------------------------------------------------------------------------------------


def probe(args) -> None:
    phase = Phase("probe", args.out)
    device = torch.device(args.device)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "gguf", "llguidance", "grpc", "google.protobuf"):
        try:
            versions[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is what the probe reports
            versions[name] = f"missing ({type(exc).__name__})"
    phase.detail("versions", versions)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        phase.detail(
            "device",
            {
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            },
        )
    phase.detail("features", features())

    def bandwidth():
        phase.measure("copy_bandwidth_tb_s", round(copy_bandwidth(device, args.copy_bytes) / 1e12, 3))

    def matmul():
        n = args.matmul_size
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
        seconds = median_seconds(device, lambda: a @ b, repeats=10)
        phase.measure("bf16_matmul_tflops", round(2 * n**3 / seconds / 1e12, 1))

    phase.attempt("bandwidth", bandwidth)
    phase.attempt("matmul", matmul)


def features() -> dict:
    """What the GPU work may build on, as this torch has it."""
    found = {}
    try:
        from torch.nn.attention import varlen  # noqa: F401

        found["varlen_attn"] = hasattr(varlen, "varlen_attn")
    except ImportError:
        found["varlen_attn"] = False
    found["flash_sdp"] = bool(torch.backends.cuda.flash_sdp_enabled())
    found["cuda_graphs"] = hasattr(torch.cuda, "CUDAGraph")
    found["cuda"] = torch.cuda.is_available()
    return found


# --- tier ------------------------------------------------------------------------------------------------------


def tier(args) -> None:
    phase = Phase("tier", args.out)
    junit = args.out / "gpu_tier.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    command += ["--continue-on-collection-errors"]
    command += args.tier_paths
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (args.out / "gpu_tier.log").write_text(done.stdout + done.stderr)
    print(done.stdout[-4000:] + done.stderr[-2000:], flush=True)
    counts = junit_counts(junit) if junit.exists() else {}
    phase.detail("pytest", {"returncode": done.returncode, "seconds": round(time.perf_counter() - started, 1)})
    for name, value in counts.items():
        phase.measure(f"gpu_tier_{name}", value)
    phase.measure("gpu_tier_returncode", done.returncode)


def junit_counts(path: pathlib.Path) -> dict:
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failures - errors - skipped, "failed": failures + errors, "skipped": skipped}


# --- invariance ------------------------------------------------------------------------------------------------


def invariance(args) -> None:
    """Each mode in its own process (cuBLAS reads its workspace settings once, at its first matmul)."""
    phase = Phase("invariance", args.out)
    differing = 0
    for mode in args.modes:
        for dtype in args.dtypes:
            name = f"{mode} {dtype}"
            path = args.out / f"invariance-{mode}-{dtype}.tmp.json"
            command = [sys.executable, __file__, "invariance-one", "--mode", mode, "--dtype", dtype]
            command += ["--device", args.device, "--shape", args.shape, "--layers", str(args.layers)]
            command += ["--json", str(path), "--others", ",".join(map(str, args.others))]

            def one(command=command, path=path, name=name):
                nonlocal differing
                subprocess.run(command, check=True)
                result = json.loads(path.read_text())
                path.unlink()
                phase.detail(name, result)
                rows = [row for kind in ("decode", "verify6") for row in result[kind].values()]
                phase.measure(f"invariance_rows_differing {name}", sum(not row["bitwise"] for row in rows))
                phase.measure(f"graphs_steps_differing {name}", result["graphs_vs_eager"]["steps_differing"])
                if mode == "invariant":
                    differing += sum(not row["bitwise"] for row in rows)

            phase.attempt(name, one)
    phase.measure("invariance_rows_differing_invariant", differing)


def invariance_one(args) -> None:
    """A reference sequence's logits (a decode row; a verify of 6 rows) alone, then beside 1..N other sequences:
    bitwise equal or not, and the largest difference; and the forward's time at batch 1, 8 and 64."""
    if args.device == "cpu":  # the Triton kernels in the interpreter (set before they are defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from worker_service.runtime.invariant_layers import make_batch_invariant
    from worker_service.runtime.runner import ModelRunner, SequenceChunk

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = random_llama(args.shape, dtype, device, args.layers)
    if args.mode == "invariant":  # what the worker runs by default (--batch-invariant); on the CPU in the
        make_batch_invariant(model)  # interpreter
    runner = ModelRunner(model, batch_invariant=False, graphs=False)  # the layers alone; graphs below
    context, most = 96, max(args.others) + 1
    per_seq = -(-(context + 8) // BLOCK_SIZE)
    runner.init_cache(most * per_seq + 1, BLOCK_SIZE)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(most)]
    prompts = random_prompts(model.config.vocab_size, most, context + 12)  # verify rows, graphs_vs_eager's
    for start in range(0, most, 32):  # every sequence's prefix cached once
        runner.forward([SequenceChunk(prompts[i][:context], 0, tables[i]) for i in range(start, min(most, start + 32))])
    result = {"mode": args.mode, "dtype": args.dtype, "shape": args.shape, "layers": model.config.num_hidden_layers}
    for kind, rows in (("decode", 1), ("verify6", 6)):
        reference, result[kind] = None, {}
        for others in [0, *args.others]:
            chunks = [
                SequenceChunk(prompts[i][context : context + rows], context, tables[i], rows) for i in range(others + 1)
            ]
            logits = runner.forward(chunks)[:rows]
            reference = logits.clone() if reference is None else reference
            result[kind][f"+{others}"] = {
                "bitwise": bool(torch.equal(logits, reference)),
                "max_abs_diff": float((logits - reference).abs().max()),
            }
    result["forward_ms"] = {}
    for batch in (1, 8, 64):
        if batch <= most:
            chunks = [SequenceChunk(prompts[i][context : context + 1], context, tables[i]) for i in range(batch)]
            result["forward_ms"][f"decode batch {batch}"] = 1e3 * median_seconds(
                device, lambda: runner.forward(chunks), 10
            )
    result["graphs_vs_eager"] = graphs_vs_eager(model, runner, prompts, tables, context)
    pathlib.Path(args.json).write_text(json.dumps(result))


def graphs_vs_eager(model, eager, prompts, tables, context) -> dict:
    """Steps replayed from CUDA graphs (EagerReplay off CUDA) against the same steps run eagerly, on the same
    cached prefixes: decodes of 3 sequences (bucket 4, one padding sequence), verifies of mixed rows (padding
    rows), each shape replayed three times. With invariant layers every logit must match bitwise."""
    from worker_service.runtime.graphs import EagerReplay
    from worker_service.runtime.runner import ModelRunner, SequenceChunk

    graphed = ModelRunner(model, batch_invariant=False)
    if graphed.replay_type is None:
        graphed.use_graphs(EagerReplay)
    graphed.init_cache(eager.kv_cache.num_blocks, BLOCK_SIZE)
    graphed.forward([SequenceChunk(prompts[i][:context], 0, tables[i]) for i in range(3)])
    differing, steps = 0, 0
    for rows in ([1, 1, 1], [4, 1, 2], [6, 6, 3]):
        for position in range(context, context + 3):  # the same shape three times: replays, not captures
            chunks = [
                SequenceChunk(prompts[i][position : position + n], position, tables[i], n) for i, n in enumerate(rows)
            ]
            differing += int(not torch.equal(graphed.forward(chunks), eager.forward(chunks)))
            steps += 1
    return {"steps": steps, "steps_differing": differing, "graphs": len(graphed.graphs.graphs)}


# --- linears ---------------------------------------------------------------------------------------------------


def linears(args) -> None:
    """The batch-invariant linear layer by layer (bench/bench_invariant_linear.py): K split (the default)
    against unsplit and cuBLAS, and against the weight-read bound, for the 1B / 8B shapes' layers."""
    from bench.bench_invariant_linear import measure

    phase = Phase("linears", args.out)

    def run():
        results = measure(args.shapes, args.rows, args.out / "invariant-linear.json")
        phase.detail("layers", results["layers"])
        for shape in args.shapes:
            sums = results[f"{shape} sum"]
            phase.detail(f"{shape} sum", sums)
            phase.measure(f"linears_{shape}_differing", results[f"{shape} differing"])
            for rows in args.rows:
                row = sums[rows]
                phase.measure(f"linears_{shape}_rows{rows}_split_vs_unsplit", round(row["unsplit"] / row["split"], 3))
                phase.measure(f"linears_{shape}_rows{rows}_split_vs_cublas", round(row["cublas"] / row["split"], 3))
                phase.measure(f"linears_{shape}_rows{rows}_bound_share", round(row["bound"] / row["split"], 3))

    if torch.device(args.device).type == "cuda":
        phase.attempt("linears", run)
    else:
        phase.detail("skipped", "needs CUDA")


# --- attention -------------------------------------------------------------------------------------------------


# The attention kernel's keys cut at these too (the worker's SPLIT_KEYS is 512): a split per program, so shorter
# ones put more programs on the GPU at batch 1; the phase times them to choose.
ATTENTION_SPLITS = (128, 256)


def attention(args) -> None:
    """The paged attention kernel per call (bench/bench_paged_attention.py, in CUDA graphs) at the 8B shape's
    heads: Triton against SDPA, and against another revision's kernel where --before names its file."""
    from bench.bench_paged_attention import measure

    phase = Phase("attention", args.out)
    before = args.before if args.before and pathlib.Path(args.before).exists() else None
    phase.detail("before", before and str(args.before))

    def run():
        rows = measure(
            args.device,
            args.shape,
            args.seqs,
            args.q_lens,
            args.contexts,
            ["bfloat16"],
            before,
            split_keys=ATTENTION_SPLITS,
        )
        phase.detail("rows", rows)
        for row in rows:
            name = f"attention_{args.shape}_bs{row['seqs']}_q{row['q_len']}_ctx{row['context']}"
            us = row["us"]
            own = us[next(name for name in us if name != "before")]  # the worker's path: paths() lists it first
            phase.measure(f"{name}_us", round(own, 1))
            for other in ("before", "sdpa", *(f"split {n}" for n in ATTENTION_SPLITS)):
                if other in us:
                    phase.measure(f"{name}_vs_{other.replace(' ', '')}", round(us[other] / own, 2))

    phase.attempt("attention", run)


# --- profile ---------------------------------------------------------------------------------------------------

# Kernel names (substrings) of a decode step's parts; the rest is "other" (torch's elementwise ops, copies).
KERNEL_KINDS = (
    ("linear", ("_linear_kernel", "_sum_splits_kernel", "gemm", "gemv", "cutlass")),
    ("attention", ("_paged_attention_kernel", "_combine_splits_kernel")),
    ("rms_norm", ("_rms_norm_kernel",)),  # and _add_rms_norm_kernel
    ("rope_kv", ("_rope_write_kv_kernel",)),
    ("silu_mul", ("_silu_mul_kernel",)),
)


def kernel_kind(name: str) -> str:
    for kind, parts in KERNEL_KINDS:
        if any(part in name for part in parts):
            return kind
    return "other"


def profile(args) -> None:
    """Where an eager decode step's GPU time goes (torch.profiler, invariant layers): kernels per step and
    their time by kind, for the 1B / 8B shapes at batch 1, with `transformers`' layers and with the GPU
    forward (backends/gpu_llama.py); against the graphed step's wall time, the rest is the gaps between
    kernels and the host's share. (On a CPU: the step's top-level ops, to check the script.)"""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from worker_service.runtime.invariant_layers import make_batch_invariant
    from worker_service.runtime.runner import ModelRunner, SequenceChunk

    phase = Phase("profile", args.out)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"

    def decode_step(model, prompt, backend: str, graphs: bool):
        """A runner with the prompt prefilled, and its next decode step."""
        per_seq = -(-(args.context + 16) // BLOCK_SIZE)
        table = list(range(1, 1 + per_seq))
        runner = ModelRunner(model, backend=backend, batch_invariant=False, graphs=graphs)
        runner.init_cache(per_seq + 1, BLOCK_SIZE)
        runner.forward([SequenceChunk(prompt, 0, table)])
        step = [SequenceChunk(prompt[:1], args.context, table)]
        return lambda: runner.forward(step)

    def per_step(entries) -> dict:
        return {k: {"count": v["count"] / args.steps, "us": round(v["us"] / args.steps, 1)} for k, v in entries}

    def one(shape, model, prompt, backend):
        step = decode_step(model, prompt, backend, graphs=False)
        result = {"eager_step_ms": round(1e3 * median_seconds(device, step, args.repeats), 3)}
        with torch_profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            synchronize(device)
        kinds: dict[str, dict] = {}
        names: dict[str, dict] = {}
        for event in prof.events():
            kept = event.device_type == torch.autograd.DeviceType.CUDA if on_cuda else event.cpu_parent is None
            if not kept:
                continue
            for entries, key in ((kinds, kernel_kind(event.name)), (names, event.name[:80])):
                entry = entries.setdefault(key, {"count": 0, "us": 0.0})
                entry["count"] += 1
                entry["us"] += event.time_range.elapsed_us()
        result["kinds_per_step"] = per_step(kinds.items())
        result["top_kernels_per_step"] = per_step(sorted(names.items(), key=lambda item: -item[1]["us"])[:25])
        result["kernels_per_step"] = sum(v["count"] for v in result["kinds_per_step"].values())
        result["kernel_ms_per_step"] = round(sum(v["us"] for v in result["kinds_per_step"].values()) / 1e3, 3)
        graphed = decode_step(model, prompt, backend, graphs=True)
        result["graphed_step_ms"] = round(1e3 * median_seconds(device, graphed, args.repeats), 3)
        phase.detail(f"{shape} {backend}", result)
        for name in ("kernels_per_step", "kernel_ms_per_step", "graphed_step_ms"):
            phase.measure(f"profile_{shape}_{backend}_{name}", result[name])
        for kind, entry in result["kinds_per_step"].items():
            phase.measure(f"profile_{shape}_{backend}_{kind}_ms_per_step", round(entry["us"] / 1e3, 3))

    for shape in args.shapes:
        model = random_llama(shape, torch.bfloat16, device)
        if on_cuda:
            make_batch_invariant(model)
        model.set_attn_implementation("sdpa")
        prompt = random_prompts(model.config.vocab_size, 1, args.context)[0]
        for backend in args.backends:
            if backend == "gpu_llama" and not on_cuda:
                continue
            phase.attempt(f"{shape} {backend}", lambda b=backend, m=model, p=prompt, s=shape: one(s, m, p, b))
        del model
        if on_cuda:
            torch.cuda.empty_cache()


# --- shapes ----------------------------------------------------------------------------------------------------


def shapes(args) -> None:
    """Per shape: transformers `generate` first (our runner replaces the model's layers in place), then our
    worker with cuBLAS (--no-batch-invariant), then with the batch-invariant layers (the default)."""
    from worker_service.runtime.invariant_layers import make_batch_invariant

    phase = Phase("shapes", args.out)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, args.copy_bytes) if device.type == "cuda" else None
    phase.detail("copy_bandwidth_tb_s", bandwidth and round(bandwidth / 1e12, 3))
    for shape in args.shapes:
        model = random_llama(shape, torch.bfloat16, device)
        prompts = random_prompts(model.config.vocab_size, 8, args.context)
        details = {"weight_gb": round(weight_read_bytes(model) / 1e9, 3)}
        if bandwidth:
            details["bound_ms"] = round(1e3 * weight_read_bytes(model) / bandwidth, 3)
        phase.detail(shape, details)
        for compiled in (False, True) if shape in args.hf_compiled_shapes else (False,):
            name = "hf_compiled" if compiled else "hf_eager"

            def hf(model=model, compiled=compiled, name=name, details=details):
                ms = 1e3 * hf_decode_seconds(model, prompts[:1], args.new_tokens, device, compiled)
                details[f"{name}_step_ms_bs1"] = round(ms, 3)

            phase.attempt(f"{shape} {name}", hf)
        # cuBLAS eagerly (the worker before its GPU work), then the invariant layers eagerly and with graphs.
        for mode in ("cublas eager", "invariant eager", "invariant graphs"):
            if mode == "invariant eager" and device.type != "cpu":
                make_batch_invariant(model)
            ours_shape(args, phase, shape, model, prompts, details, mode)
        ours, cublas = details.get("invariant graphs", {}), details.get("cublas eager", {})
        eager = details.get("invariant eager", {})
        if "step_ms_bs1" in ours:
            if bandwidth:
                phase.measure(f"plain_{shape}_bs1_bound_share", round(details["bound_ms"] / ours["step_ms_bs1"], 3))
            for name in ("hf_eager", "hf_compiled"):
                if f"{name}_step_ms_bs1" in details:
                    ratio = details[f"{name}_step_ms_bs1"] / ours["step_ms_bs1"]
                    phase.measure(f"plain_{shape}_bs1_vs_{name}", round(ratio, 3))
            if "step_ms_bs1" in eager:
                phase.measure(f"graphs_speedup_{shape}_bs1", round(eager["step_ms_bs1"] / ours["step_ms_bs1"], 3))
        if "step_ms_bs1" in eager and "step_ms_bs1" in cublas:
            phase.measure(f"invariance_cost_{shape}_bs1", round(eager["step_ms_bs1"] / cublas["step_ms_bs1"], 3))
        if "verify5_vs_decode" in ours:
            phase.measure(f"verify5_vs_decode_{shape}_bs1", ours["verify5_vs_decode"])
        phase.detail(shape, details)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def ours_shape(args, phase, shape, model, prompts, details, mode) -> None:
    """Our worker's plain decode step at --batches, and a forward of 1, 2, 4, 6 rows per sequence (decode, and
    verifies of 1, 3, 5 drafts) at batch 1 and 8, into details[mode] ("... graphs": CUDA graphs on)."""
    from worker_service.runtime.runner import ModelRunner, SequenceChunk
    from worker_service.speculation.config import WorkerConfig
    from worker_service.speculation.worker import Worker

    device = torch.device(args.device)
    model.set_attn_implementation("sdpa")  # ModelRunner registers its paged attention again
    # the caller made the layers invariant or not; graphs only where the replay is CUDA's
    runner = ModelRunner(model, batch_invariant=False, graphs=mode.endswith("graphs"))
    worker = Worker(WorkerConfig(model=f"random-{shape}", device=str(device), dtype="bfloat16"), runner)
    per_seq = -(-(args.context + args.new_tokens + 16) // BLOCK_SIZE)
    num_blocks = 8 * per_seq + 1
    worker.init_cache(num_blocks, BLOCK_SIZE)
    results = details.setdefault(mode, {})

    def plain(batch):
        ms = 1e3 * decode_seconds(worker, num_blocks, prompts[:batch], args.new_tokens, device)
        results[f"step_ms_bs{batch}"] = round(ms, 3)

    def verify(batch):
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
        runner.forward([SequenceChunk(prompts[i], 0, tables[i]) for i in range(batch)])
        times = {}
        for rows in (1, 2, 4, 6):
            chunks = [SequenceChunk(prompts[i][:rows], args.context, tables[i], rows) for i in range(batch)]
            times[rows] = median_seconds(device, lambda chunks=chunks: runner.forward(chunks), args.repeats)
        results[f"forward_ms_bs{batch}"] = {rows: round(1e3 * t, 3) for rows, t in times.items()}
        if batch == 1:
            results["verify5_vs_decode"] = round(times[6] / times[1], 3)

    for batch in args.batches:
        phase.attempt(f"{shape} {mode} plain bs{batch}", lambda batch=batch: plain(batch))
    for batch in (1, 8):
        phase.attempt(f"{shape} {mode} verify bs{batch}", lambda batch=batch: verify(batch))
    phase.detail(shape, details)


def decode_seconds(worker, num_blocks, prompts, new_tokens, device) -> float:
    """Seconds per decode step: a run of new_tokens + 1 tokens less a run of 1 (the prefill), over new_tokens."""
    from tests.worker.driver import Driver

    def run(tokens):
        return lambda: Driver(worker.execute, BLOCK_SIZE, num_blocks).generate(prompts, tokens)

    whole = median_seconds(device, run(new_tokens + 1), repeats=2, warmup=1)
    prefill = median_seconds(device, run(1), repeats=3, warmup=1)
    return (whole - prefill) / new_tokens


def hf_decode_seconds(model, prompts, new_tokens, device, compiled: bool) -> float:
    """transformers `generate`'s seconds per decode step, measured as decode_seconds does; compiled: its static
    cache with the forward compiled (mode reduce-overhead: CUDA graphs), its fastest plain path."""
    ids = torch.tensor(prompts, device=device)
    if compiled:  # generate compiles the forward itself for a static cache (its compile_config: CUDA graphs)
        model.generation_config.cache_implementation = "static"

    def run(tokens):
        def generate():
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        return generate

    whole = median_seconds(device, run(new_tokens + 1), repeats=2, warmup=2 if compiled else 1)
    prefill = median_seconds(device, run(1), repeats=3, warmup=1)
    return (whole - prefill) / new_tokens


# --- smollm2 ---------------------------------------------------------------------------------------------------


def smollm2(args) -> None:
    from bench.common import chat_ids, load_questions
    from tests.worker.driver import Driver
    from worker_service.runtime.default_model import DEFAULT_EAGLE3_HEAD, fetch_default_model
    from worker_service.runtime.loader import load_model, load_tokenizer
    from worker_service.speculation.build import build_worker
    from worker_service.speculation.config import WorkerConfig

    phase = Phase("smollm2", args.out)
    device = torch.device(args.device)
    path = str(fetch_default_model())
    tokenizer = load_tokenizer(path)
    questions = load_questions(args.data, categories=list(GROUNDED), per_category=args.per_category)
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in questions]
    phase.detail("prompts", {"count": len(prompts), "categories": list(GROUNDED), "new_tokens": args.new_tokens})
    configs = {
        "plain": dict(proposer="none", num_speculative_tokens=0),
        "plain --no-batch-invariant": dict(proposer="none", num_speculative_tokens=0, batch_invariant=False),
        "plain --enforce-eager": dict(proposer="none", num_speculative_tokens=0, enforce_eager=True),
        "ngram": dict(proposer="ngram", num_speculative_tokens=5),
        "suffix": dict(proposer="suffix", num_speculative_tokens=5),
        "eagle3": dict(proposer="eagle3", num_speculative_tokens=5),
        "eagle3,suffix": dict(proposer="eagle3,suffix", num_speculative_tokens=5),
        "eagle3,suffix tree 2": dict(proposer="eagle3,suffix", num_speculative_tokens=5, draft_tree_width=2),
    }
    workers = {}
    for name, fields in configs.items():
        head = str(DEFAULT_EAGLE3_HEAD) if "eagle3" in fields["proposer"] else None
        config = WorkerConfig(model=path, dtype=args.dtype, device=args.device, draft_model=head, **fields)
        workers[name] = build_worker(config)
    most = max([1, *args.batches])
    num_blocks = most * -(-(max(map(len, prompts)) + args.new_tokens + 16) // BLOCK_SIZE) + 1
    for worker in workers.values():
        worker.init_cache(num_blocks, BLOCK_SIZE)

    def generate(name, group):
        k = configs[name]["num_speculative_tokens"]
        driver = Driver(workers[name].execute, BLOCK_SIZE, num_blocks)
        return driver.generate(group, args.new_tokens, num_speculative_tokens=k)

    for name in workers:  # warm-up: kernel builds, autotuning
        generate(name, prompts[:1])
    outputs: dict[tuple[str, int], list] = {}

    def batch_one():
        seconds = {name: 0.0 for name in workers}
        for prompt in prompts:
            for name in workers:
                synchronize(device)
                start = time.perf_counter()
                outputs.setdefault((name, 1), []).extend(generate(name, [prompt]))
                synchronize(device)
                seconds[name] += time.perf_counter() - start
        tok_s = {name: len(prompts) * args.new_tokens / s for name, s in seconds.items()}
        phase.detail("bs1_tok_s", {name: round(v, 1) for name, v in tok_s.items()})
        phase.detail("bs1_speedup", {name: round(seconds["plain"] / s, 3) for name, s in seconds.items()})
        phase.measure("ngram_smollm2_bs1_speedup_grounded", round(seconds["plain"] / seconds["ngram"], 3))
        phase.measure("graphs_speedup_smollm2_bs1", round(seconds["plain --enforce-eager"] / seconds["plain"], 3))
        phase.measure(
            "eagle3_suffix_smollm2_bs1_speedup_grounded", round(seconds["plain"] / seconds["eagle3,suffix"], 3)
        )

    phase.attempt("batch 1", batch_one)

    def versus_hf():
        model = load_model(path, workers["plain"].config.dtype, device)
        group = prompts[: args.hf_prompts]
        hf = sum(hf_decode_seconds(model, [p], args.new_tokens, device, compiled=False) for p in group)
        ours = sum(decode_seconds(workers["plain"], num_blocks, [p], args.new_tokens, device) for p in group)
        phase.detail(
            "decode_step_ms_bs1",
            {"ours": round(1e3 * ours / len(group), 3), "hf_eager": round(1e3 * hf / len(group), 3)},
        )
        phase.measure("plain_smollm2_bs1_vs_hf_eager", round(hf / ours, 3))

    phase.attempt("versus transformers", versus_hf)

    def lossless(batch):
        group = [prompts[i % len(prompts)] for i in range(batch)]
        tok_s = {}
        for name in workers:
            start = time.perf_counter()
            outputs[name, batch] = generate(name, group)
            synchronize(device)
            tok_s[name] = round(batch * args.new_tokens / (time.perf_counter() - start), 1)
        alone = {tuple(p): out for p, out in zip(prompts, outputs["plain", 1])}
        differing = {
            name: {
                "vs_plain_same_batch": sum(a != b for a, b in zip(outputs[name, batch], outputs["plain", batch])),
                "vs_plain_batch_1": sum(out != alone[tuple(p)] for p, out in zip(group, outputs[name, batch])),
            }
            for name in workers
        }
        phase.detail(f"batch {batch}", {"tok_s": tok_s, "differing": differing})

    for batch in args.batches:
        phase.attempt(f"batch {batch}", lambda batch=batch: lossless(batch))
    # Outputs that differ from plain decoding of the prompt alone (batch 1): each worker's at every batch.
    cublas = "plain --no-batch-invariant"
    totals = {False: 0, True: 0}
    plain_alone = outputs.get(("plain", 1), [])
    for name in workers:
        count = sum(out != plain for out, plain in zip(outputs.get((name, 1), []), plain_alone))
        for batch in args.batches:
            if (row := phase.data["details"].get(f"batch {batch}")) is not None:
                count += row["differing"][name]["vs_plain_batch_1"]
        totals[name == cublas] += count
    phase.measure("outputs_differing_smollm2", totals[False])
    phase.measure("cublas_plain_differing_smollm2", totals[True])  # the cost of --no-batch-invariant


# --- merge -----------------------------------------------------------------------------------------------------


def merge(args) -> None:
    """Joins the phases' files into one results file: device, commit, date, torch, measures, details."""
    phases = {}
    for path in sorted(pathlib.Path(args.dir).glob("gpu_check-*.json")):
        data = json.loads(path.read_text())
        phases[data["phase"]] = data
    probe_details = phases.get("probe", {}).get("details", {})
    measures = {name: value for data in phases.values() for name, value in data["measures"].items()}
    details = {name: data["details"] for name, data in phases.items()}
    carried = {}
    if args.keep:  # the phases this run did not run, from an earlier results file, with its commit and date
        earlier = json.loads(pathlib.Path(args.keep).read_text())
        for name in earlier["details"]:
            if name not in phases:
                details[name] = earlier["details"][name]
                carried[name] = earlier.get("carried", {}).get(
                    name, {"commit": earlier["commit"], "date": earlier["date"]}
                )
        for name, value in earlier["measures"].items():  # those no phase of this run measured
            measures.setdefault(name, value)
    # Outputs (speculative or plain, at any batch) that differ from plain decoding of the prompt alone.
    measures["outputs_differing"] = sum(v for k, v in measures.items() if k.startswith("outputs_differing_"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "device": probe_details.get("device", {}).get("name", "unknown"),
        "commit": args.commit or commit.stdout.strip(),
        "date": args.date or datetime.date.today().isoformat(),
        "torch": probe_details.get("versions", {}).get("torch"),
        "carried": carried,
        "measures": measures,
        "details": details,
        "errors": {name: data["errors"] for name, data in phases.items() if data["errors"]},
    }
    target = pathlib.Path(args.target)
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["measures"], indent=2))
    print(f"wrote {target}")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="phase", required=True)

    def phase(name, fn, **kwargs):
        p = sub.add_parser(name, **kwargs)
        p.set_defaults(fn=fn)
        if name != "merge":
            p.add_argument("--device", default="cuda")
            p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "gpu_check_out")))
        return p

    p = phase("probe", probe)
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--matmul-size", type=int, default=8192)
    p = phase("tier", tier)
    p.add_argument("--tier-paths", type=words, default=["tests/kernels", "tests/worker", "tests/draft_training"])
    p = phase("invariance", invariance)
    p.add_argument("--modes", type=words, default=["cublas", "invariant"])
    p.add_argument("--dtypes", type=words, default=["bfloat16", "float32"])
    p.add_argument("--shape", default="1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--others", type=ints, default=[1, 3, 7, 15, 31, 63, 127, 255])
    p = phase("invariance-one", invariance_one)
    p.add_argument("--mode", choices=("cublas", "invariant"), required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--shape", default="1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--others", type=ints, required=True)
    p.add_argument("--json", required=True)
    p = phase("linears", linears)
    p.add_argument("--shapes", type=words, default=["8b", "1b"])
    p.add_argument("--rows", type=ints, default=[1, 8, 64, 256])
    p = phase("attention", attention)
    p.add_argument("--shape", default="8b")
    p.add_argument("--seqs", type=ints, default=[1, 8, 64])
    p.add_argument("--q-lens", type=ints, default=[1, 6])
    p.add_argument("--contexts", type=ints, default=[512, 4096])
    p.add_argument("--before", default=str(ROOT / ".gpu" / "paged_attention_before.py"))
    p = phase("profile", profile)
    p.add_argument("--shapes", type=words, default=["8b", "1b", "smollm2"])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backends", type=words, default=["transformers", "gpu_llama"])
    p.add_argument("--repeats", type=int, default=20)
    p = phase("shapes", shapes)
    p.add_argument("--shapes", type=words, default=["1b", "8b"])
    p.add_argument("--hf-compiled-shapes", type=words, default=["1b"])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p = phase("smollm2", smollm2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--data", type=pathlib.Path, default=ROOT.parent / "shared" / "data" / "spec_bench_dev.jsonl")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batches", type=ints, default=[8, 32, 64])
    p.add_argument("--hf-prompts", type=int, default=2)
    p = phase("merge", merge)
    p.add_argument("dir")
    p.add_argument("--target", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    p.add_argument("--commit", default="")
    p.add_argument("--date", default="")
    p.add_argument("--keep", default=None, help="an earlier results file: its phases this run lacks are kept")
    return top


if __name__ == "__main__":
    ARGS = parser().parse_args()
    ARGS.fn(ARGS)
