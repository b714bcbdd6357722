"""Shared pieces of the benchmark scripts: prompts, timing, result files."""

import json
import logging
import os
import pathlib
import platform
import statistics
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "spec_bench_dev.jsonl"
RESULTS = ROOT / "bench" / "results"

logger = logging.getLogger("bench")


def load_questions(path: pathlib.Path = DATA, categories: list[str] | None = None, per_category: int | None = None):
    """Spec-Bench questions (first turn), optionally the first N of some categories."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if categories is not None:
        rows = [r for r in rows if r["category"] in categories]
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for r in rows:
            counts[r["category"]] = counts.get(r["category"], 0) + 1
            if counts[r["category"]] <= per_category:
                kept.append(r)
        rows = kept
    return rows


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def process_tree(pid: int) -> list[int]:
    """A process and its live descendants (Linux /proc); [] for one that is gone."""
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            children = [
                int(c)
                for task in pathlib.Path(f"/proc/{p}/task").iterdir()
                for c in (task / "children").read_text().split()
            ]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(p)
        stack += children
    return found


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its live descendants; 0 for one that is gone.
    Benchmarks that keep several servers up read it around a timed run, to show the idle ones took no CPU
    from the one being timed."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in process_tree(pid):
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    return total


def thread_counters(pid: int) -> dict[str, tuple[float, int, int]]:
    """Per thread of `pid` (by thread id): (CPU seconds, voluntary, involuntary context switches) so far (Linux
    /proc). A voluntary switch is a thread that blocked (and later woke); an involuntary one, a thread the
    kernel preempted for another."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue
        switches = dict(line.split(":\t") for line in status.splitlines() if "ctxt_switches" in line)
        out[task.name] = (
            (int(stat[11]) + int(stat[12])) / ticks,
            int(switches["voluntary_ctxt_switches"]),
            int(switches["nonvoluntary_ctxt_switches"]),
        )
    return out


def wait_quiet(pids, window_s: float = 0.1, timeout_s: float = 30.0) -> float:
    """Waits until the process trees of `pids` use no CPU for `window_s` (at most `timeout_s`); returns the
    seconds waited. A server works on for a moment after its last answer (specdec's worker finishes the step it
    had started ahead, which the ended request no longer needs), and a benchmark that times another server
    meanwhile times both: on 2 cores, two teams of OpenMP threads spinning at their barriers slowed each other's
    steps from ~10 ms to ~2 s here."""
    start = time.monotonic()
    used = sum(map(process_tree_cpu_s, pids))
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        before, used = used, sum(map(process_tree_cpu_s, pids))
        if used - before < 0.01:  # under one clock tick (10 ms) in the window
            break
    return time.monotonic() - start


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, fn, repeats: int, warmup: int = 2) -> float:
    """The median wall time of fn() (host work included, as a serving step pays it), device synchronized."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, bytes read plus bytes written (the HBM ceiling a step is held to)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(device, lambda: dst.copy_(src), repeats=10)
    return 2 * num_bytes / seconds


def save(name: str, payload: dict) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        **payload,
    }
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    logger.info("saved %s", path)
    return path
