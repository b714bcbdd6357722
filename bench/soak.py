"""Soak: a long mixed load on `specdec serve` with one worker SIGKILLed midway; checks nothing leaks or drifts.

Starts `specdec serve --num-workers 2 --proposer ngram --num-speculative-tokens 5 --port 0` (plus --serve-args),
computes a reference output for every greedy prompt (concurrency 1, speculation off for the request), then runs
--concurrency client loops for --duration seconds. Each loop sends short Spec-Bench chat prompts (ignore_eos,
--max-tokens each), half greedy and half sampled (temperature 0.8, one of 4 seeds, so (prompt, seed) repeats):
60% run to completion, 20% are cancelled after a few streamed messages, 10% get a deadline shorter than the
request (DEADLINE_EXCEEDED), 10% are bad inputs with their expected status code (see BAD_CASES). At --kill-at x
duration one worker process gets SIGKILL; serve restarts it and its requests move to the other worker.

    .venv/bin/python bench/soak.py                                  # 10 minutes
    .venv/bin/python bench/soak.py --duration 90 --serve-args "--scheduling sync"

Reports outcomes, unexpected errors, greedy outputs that differ from the reference (streamed prefixes of
cancelled requests included), seeded repeats that differ, KV blocks still allocated after the load, resident
memory of the serve and worker processes (at 20%, 2 minutes, 100% and after the load), TTFT and inter-token
latency, tokens/s, and the kill: time until the worker serves again and until the moved requests' next token.
Exits 1 when a target is missed: unexpected errors, greedy or seeded mismatches, leaked KV blocks, or resident
memory growth of 10% or more from the 2-minute sample to the end (only checked when the run has that sample).
Results are saved in bench/results/soak-*.json (or --out).
"""

import argparse
from dataclasses import dataclass, field
import json
import logging
import os
import pathlib
import platform
import random
import shlex
import signal
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.bench_serving import interleaved_prompts, percentile, wait_idle  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from tests.e2e.client import as_complete  # noqa: E402
from tests.processes import Process  # noqa: E402

logger = logging.getLogger("bench.soak")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVE_FLAGS = ["--num-workers", "2", "--proposer", "ngram", "--num-speculative-tokens", "5"]
SEEDS = (1, 2, 3, 4)
NUM_SAMPLED_PROMPTS = 4  # sampled requests use the first prompts only, so (prompt, seed) pairs repeat
SAMPLED_TEMPERATURE = 0.8
REQUEST_TIMEOUT_S = 300.0  # for requests meant to complete: a hung server shows as DEADLINE_EXCEEDED
BAD_INPUT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 15.0
PROGRESS_INTERVAL_S = 30.0
RSS_GROWTH_LIMIT = 0.10
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def bad_request(text: str, sampling: dict | None = None, **prompt_input) -> pb.GenerateRequest:
    """A short greedy chat request with `sampling` overrides and, when given, another prompt input."""
    if not prompt_input:
        prompt_input = {"messages": [pb.ChatMessage(role="user", content=text)]}
    return pb.GenerateRequest(
        sampling=pb.SamplingParams(**{"temperature": 0.0, "max_tokens": 16, **(sampling or {})}), **prompt_input
    )


# name: (expected status, request builder from a prompt text; None: a case with its own code path)
BAD_CASES = {
    "temperature_negative": (INVALID, lambda t: bad_request(t, {"temperature": -1.0})),
    "temperature_nan": (INVALID, lambda t: bad_request(t, {"temperature": float("nan")})),
    "temperature_inf": (INVALID, lambda t: bad_request(t, {"temperature": float("inf")})),
    "top_p_2": (INVALID, lambda t: bad_request(t, {"top_p": 2.0})),
    "token_id_out_of_vocab": (INVALID, lambda t: bad_request(t, prompt_token_ids=[1, 10**9])),
    "empty_prompt": (INVALID, lambda t: bad_request(t, prompt="")),
    "empty_messages": (INVALID, lambda t: bad_request(t, messages=[])),
    "role_im_end": (INVALID, lambda t: bad_request(t, messages=[pb.ChatMessage(role="<|im_end|>", content=t)])),
    "max_tokens_int32_max": (INVALID, lambda t: bad_request(t, {"max_tokens": 2**31 - 1})),
    "stop_strings_1000": (INVALID, lambda t: bad_request(t, {"stop": [f"stop{i}" for i in range(1000)]})),
    "duplicate_request_id": (grpc.StatusCode.ALREADY_EXISTS, None),
    "abort_unknown_id": (grpc.StatusCode.NOT_FOUND, None),
}
EXPECTED_ERROR = {"cancel": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}
OUTCOME_OF_ERROR = {"cancel": "cancelled", "deadline": "deadline"}


@dataclass(eq=False)
class Record:
    """One client request: what it was meant to do and what happened."""

    kind: str  # "complete", "cancel", "deadline" or a BAD_CASES name
    prompt_index: int | None = None
    seed: int | None = None  # None: greedy
    start_s: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens in the message)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    outcome: str | None = None  # completed, cancelled, deadline, bad_input_as_expected, unexpected
    detail: str = ""


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB; None when it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Server:
    """`specdec serve` as a child process; finds its worker processes and always stops all of them."""

    def __init__(self, flags: list[str]):
        self.process = Process(["serve", "--port", "0", *flags])
        self.seen_worker_pids: set[int] = set()

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def worker_pids(self) -> list[int]:
        """The serve process's children whose command line is a `specdec ... worker`, oldest first."""
        pids = []
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.pid and b"worker" in cmdline:
                pids.append(int(stat.parent.name))
        self.seen_worker_pids.update(pids)
        return sorted(pids)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 30 s (tests.processes.Process.stop); then any worker serve left behind."""
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave the server running
            signal.signal(signum, signal.SIG_IGN)
        self.worker_pids()  # while serve is their parent: if it dies on SIGTERM before stopping them, they stay
        code = self.process.stop()
        for pid in self.seen_worker_pids:  # workers run in their own session: a killed serve leaves them
            try:
                if b"specdec" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    logger.warning("killed worker %d left behind by serve", pid)
            except OSError:
                pass
        logger.info("server stopped (exit code %s)", code)


class Soak:
    """The client loops, the checks on their outputs, and the monitor (progress, memory, the kill)."""

    def __init__(self, args, server: Server, stub, prompts: list[str]):
        self.args, self.server, self.stub, self.prompts = args, server, stub, prompts
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.active: set[Record] = set()
        self.references: dict[int, list[int]] = {}
        self.seeded_first: dict[tuple[int, int], list[int]] = {}
        self.greedy_mismatches: list[dict] = []
        self.seeded_mismatches: list[dict] = []
        self.rss: dict[str, dict] = {}
        self.kill: dict | None = None
        self.bad_case_names = [n for n in BAD_CASES if n not in args.skip_bad_case]
        self.end_s = 0.0  # time.monotonic() when the loops stop starting requests
        self.start_perf_s = 0.0  # time.perf_counter() when the load started

    def workload_request(self, prompt_index: int, seed: int | None, request_id: str = "") -> pb.GenerateRequest:
        sampling = pb.SamplingParams(
            temperature=0.0 if seed is None else SAMPLED_TEMPERATURE, max_tokens=self.args.max_tokens, ignore_eos=True
        )
        if seed is not None:
            sampling.seed = seed
        request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
        request.messages.add(role="user", content=self.prompts[prompt_index])
        return request

    def compute_references(self) -> None:
        """Each greedy prompt's output at concurrency 1 with speculation off: what every greedy run must emit."""
        for i in range(len(self.prompts)):
            request = self.workload_request(i, None)
            request.speculation.enabled = False
            self.references[i] = list(self.stub.Complete(as_complete(request), timeout=REQUEST_TIMEOUT_S).token_ids)
        logger.info("reference outputs for %d greedy prompts computed", len(self.prompts))

    # The client side.

    def client_loop(self, index: int) -> None:
        rng = random.Random(f"{self.args.seed}-{index}")
        n = 0
        while time.monotonic() < self.end_s:
            draw = rng.random()
            if draw < 0.1:
                self.run_bad_case(rng, f"soak-{index}-{n}")
            else:
                kind = "deadline" if draw < 0.2 else "cancel" if draw < 0.4 else "complete"
                self.run_workload(rng, kind)
            n += 1

    def new_record(self, rng: random.Random, kind: str) -> Record:
        if rng.random() < 0.5:
            return Record(kind, rng.randrange(len(self.prompts)))
        return Record(kind, rng.randrange(min(NUM_SAMPLED_PROMPTS, len(self.prompts))), rng.choice(SEEDS))

    def run_workload(self, rng: random.Random, kind: str, request_id: str = "", on_first=None) -> None:
        rec = self.new_record(rng, kind)
        timeout_s = rng.uniform(0.2, 1.0) if kind == "deadline" else REQUEST_TIMEOUT_S
        cancel_after = rng.randint(1, max(1, self.args.max_tokens // 8)) if kind == "cancel" else None
        code, message = self.stream(
            rec, self.workload_request(rec.prompt_index, rec.seed, request_id), timeout_s, cancel_after, on_first
        )
        if rec.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.check_completed(rec)
        elif code is not None and code == EXPECTED_ERROR.get(kind):
            rec.outcome = OUTCOME_OF_ERROR[kind]
            self.check_output(rec, self.expected_output(rec), is_partial=True)
        else:
            rec.outcome, rec.detail = "unexpected", f"{code.name if code else 'OK'}: {message}"
        self.add(rec)

    def stream(self, rec: Record, request, timeout_s: float, cancel_after: int | None, on_first):
        """Consumes one Generate stream into `rec`; (status code, message) of its error, or (None, why it ended)."""
        rec.start_s = time.perf_counter()
        call = self.stub.Generate(request, timeout=timeout_s)
        with self.lock:
            self.active.add(rec)
        try:
            for n, response in enumerate(call, 1):
                if response.token_ids:
                    rec.arrivals.append((time.perf_counter(), len(response.token_ids)))
                    rec.token_ids.extend(response.token_ids)
                rec.finish_reason = response.finish_reason
                if n == 1 and on_first is not None:
                    on_first()
                if n == cancel_after and not rec.finish_reason:
                    call.cancel()
            return None, "the stream ended without a finish reason"
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        finally:
            with self.lock:
                self.active.discard(rec)

    def run_bad_case(self, rng: random.Random, request_id: str) -> None:
        name = rng.choice(self.bad_case_names)
        expected, build = BAD_CASES[name]
        rec = Record(name, start_s=time.perf_counter())
        if name == "abort_unknown_id":
            try:
                self.stub.Abort(
                    pb.AbortRequest(request_id=f"soak-unknown-{uuid.uuid4().hex}"), timeout=BAD_INPUT_TIMEOUT_S
                )
                code, message = None, "Abort of an unknown id succeeded"
            except grpc.RpcError as exc:
                code, message = exc.code(), exc.details()
        elif name == "duplicate_request_id":
            # The holder is a workload request that runs to completion; its first message proves it is running.
            result = []
            self.run_workload(
                rng,
                "complete",
                request_id,
                on_first=lambda: result.append(self.expect_rejection(self.workload_request(0, None, request_id))),
            )
            code, message = result[0] if result else (None, "the holder failed before its first message")
        else:
            code, message = self.expect_rejection(build(self.prompts[rng.randrange(len(self.prompts))]))
        rec.outcome = "bad_input_as_expected" if code == expected else "unexpected"
        rec.detail = f"{code.name if code else 'OK'}: {message}"
        self.add(rec)

    def expect_rejection(self, request) -> tuple:
        """Sends a request that should fail; (status code, message), or (None, ...) when it streamed (cancelled)."""
        call = self.stub.Generate(request, timeout=BAD_INPUT_TIMEOUT_S)
        try:
            next(call)
        except StopIteration:
            return None, "accepted: the stream ended without a message"
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        call.cancel()
        return None, "accepted: it streamed tokens (cancelled)"

    def add(self, rec: Record) -> None:
        with self.lock:
            self.records.append(rec)

    # The checks.

    def expected_output(self, rec: Record) -> list[int] | None:
        if rec.seed is None:
            return self.references[rec.prompt_index]
        with self.lock:
            return self.seeded_first.get((rec.prompt_index, rec.seed))

    def check_completed(self, rec: Record) -> None:
        rec.outcome = "completed"
        if len(rec.token_ids) != self.args.max_tokens or rec.finish_reason != pb.FINISH_REASON_LENGTH:
            rec.outcome = "unexpected"
            rec.detail = (
                f"finished ({pb.FinishReason.Name(rec.finish_reason)}) with {len(rec.token_ids)} of "
                f"{self.args.max_tokens} tokens although ignore_eos is set"
            )
        if rec.seed is not None:
            with self.lock:
                self.seeded_first.setdefault((rec.prompt_index, rec.seed), rec.token_ids)
        self.check_output(rec, self.expected_output(rec), is_partial=False)

    def check_output(self, rec: Record, expected: list[int] | None, is_partial: bool) -> None:
        """Records a mismatch when the output (or the streamed prefix of a partial one) differs from `expected`."""
        if expected is None or rec.token_ids == expected[: len(rec.token_ids) if is_partial else None]:
            return
        at = next(
            (i for i, (a, b) in enumerate(zip(rec.token_ids, expected)) if a != b),
            min(len(rec.token_ids), len(expected)),
        )
        mismatch = {
            "kind": rec.kind,
            "outcome": rec.outcome,
            "prompt_index": rec.prompt_index,
            "seed": rec.seed,
            "first_difference_at": at,
            "got": rec.token_ids,
            "expected": expected,
        }
        with self.lock:
            (self.greedy_mismatches if rec.seed is None else self.seeded_mismatches).append(mismatch)

    # The monitor.

    def sample_rss(self, label: str) -> None:
        workers = {pid: rss_kib(pid) for pid in self.server.worker_pids()}
        self.rss[label] = {"serve_kib": rss_kib(self.server.pid), "workers_kib": workers}
        logger.info(
            "RSS at %s: serve %s MiB, workers %s MiB",
            label,
            _mib(self.rss[label]["serve_kib"]),
            ", ".join(f"{pid}: {_mib(kib)}" for pid, kib in workers.items()),
        )

    def kill_worker(self) -> None:
        pids = self.server.worker_pids()
        if not pids:
            logger.error("no worker process found to kill")
            return
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
        with self.lock:
            in_flight = list(self.active)
        killed_s = time.perf_counter()
        os.kill(pids[0], signal.SIGKILL)
        self.kill = {
            "pid": pids[0],
            "at_s": killed_s,
            "in_flight": in_flight,
            "serving_again_s": None,
            "num_failures_before": info.counters.num_worker_failures,
            "num_moved_before": info.counters.num_moved_requests,
        }
        logger.info("SIGKILL worker %d with %d requests in flight", pids[0], len(in_flight))

    def poll_restart(self) -> None:
        """Sets serving_again_s once the failure is seen and every worker serves again."""
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
        if info.counters.num_worker_failures > self.kill["num_failures_before"] and all(
            w.state == "serving" for w in info.workers
        ):
            self.kill["serving_again_s"] = time.perf_counter() - self.kill["at_s"]
            logger.info("both workers serve again %.1f s after the kill", self.kill["serving_again_s"])

    def monitor(self, start_s: float) -> None:
        """Until the load ends: progress every ~30 s, memory samples, the kill and the restart."""
        d = self.args.duration
        samples = {"20%": 0.2 * d, **({"2min": 120.0} if d > 120 else {})}
        kill_after_s = self.args.kill_at * d if self.args.kill_at > 0 else None
        next_progress_s = PROGRESS_INTERVAL_S
        while (elapsed := time.monotonic() - start_s) < d:
            for label, at_s in list(samples.items()):
                if elapsed >= at_s:
                    self.sample_rss(label)
                    del samples[label]
            if kill_after_s is not None and elapsed >= kill_after_s:
                self.kill_worker()
                kill_after_s = None
            if self.kill and self.kill["serving_again_s"] is None:
                self.poll_restart()
            if elapsed >= next_progress_s:
                self.progress(elapsed)
                next_progress_s += PROGRESS_INTERVAL_S
            time.sleep(0.25)
        self.sample_rss("100%")

    def progress(self, elapsed_s: float) -> None:
        with self.lock:
            done = len(self.records)
            unexpected = [r for r in self.records if r.outcome == "unexpected"]
            num_tokens = sum(len(r.token_ids) for r in self.records)
        logger.info(
            "%4.0f s: %d requests done, %d unexpected errors%s, %.1f tok/s; %d greedy mismatches",
            elapsed_s,
            done,
            len(unexpected),
            f" (last: {unexpected[-1].kind}: {unexpected[-1].detail})" if unexpected else "",
            num_tokens / elapsed_s,
            len(self.greedy_mismatches),
        )


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}"


def run(args, server: Server) -> dict:
    """Waits for the server, computes the references, runs the load and returns the report."""
    address = server.process.address(who="scheduler ")
    server.process.wait_for("scheduler ready")
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        while not all(w.state == "serving" for w in stub.GetServerInfo(pb.GetServerInfoRequest()).workers):
            time.sleep(0.2)
        prompts = [p for p in interleaved_prompts() if len(p) <= args.max_prompt_chars][: args.num_prompts]
        soak = Soak(args, server, stub, prompts)
        soak.compute_references()
        start_s, start_perf_s = time.monotonic(), time.perf_counter()
        soak.end_s, soak.start_perf_s = start_s + args.duration, start_perf_s
        threads = [threading.Thread(target=soak.client_loop, args=(i,), daemon=True) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        soak.monitor(start_s)
        for t in threads:
            t.join()
        load_s = time.perf_counter() - start_perf_s
        info = wait_idle(stub, SETTLE_TIMEOUT_S)
        soak.sample_rss("end")
    return build_report(args, soak, info, load_s)


def kill_report(soak: Soak, info: pb.GetServerInfoResponse) -> dict | None:
    """The kill: when, how long until both workers served again, and the next token of the moved requests.

    The moved requests are taken as the in-flight streams with the longest wait for their next token after the
    kill (how many moved comes from the server's counters), as in bench_failover.py.
    """
    k = soak.kill
    if k is None:
        return None
    gaps = sorted(
        t - k["at_s"]
        for t in (next((t for t, _ in r.arrivals if t > k["at_s"]), None) for r in k["in_flight"])
        if t is not None
    )
    num_moved = info.counters.num_moved_requests - k["num_moved_before"]
    moved, others = gaps[len(gaps) - num_moved :] if num_moved else [], gaps[: len(gaps) - num_moved]
    return {
        "pid": k["pid"],
        "at_s_after_start": k["at_s"] - soak.start_perf_s,
        "num_in_flight": len(k["in_flight"]),
        "serving_again_s": k["serving_again_s"],
        "num_moved": num_moved,
        "moved_next_token_median_s": statistics.median(moved) if moved else None,
        "moved_next_token_max_s": max(moved, default=None),
        "others_next_token_median_s": statistics.median(others) if others else None,
    }


def rss_report(rss: dict) -> dict:
    """Growth of each process's RSS from the 2-minute sample (else the 20% one) to the end, same pid only."""
    base_label = "2min" if "2min" in rss else "20%"
    base, end = rss.get(base_label), rss["end"]
    growth = {}
    if base is not None:
        pairs = {
            "serve": (base["serve_kib"], end["serve_kib"]),
            **{f"worker {pid}": (kib, end["workers_kib"].get(pid)) for pid, kib in base["workers_kib"].items()},
        }
        growth = {name: (b1 - b0) / b0 if b0 and b1 else None for name, (b0, b1) in pairs.items()}
    return {"samples": rss, "growth_from": base_label, "growth": growth, "is_growth_checked": base_label == "2min"}


def outcome_report(records: list[Record]) -> dict:
    """Requests by outcome, each bad-input case's tally, and the unexpected ones grouped by (kind, code)."""
    outcomes = {
        o: sum(r.outcome == o for r in records)
        for o in ("completed", "cancelled", "deadline", "bad_input_as_expected", "unexpected")
    }
    bad_cases = {
        name: {
            "expected": code.name,
            "as_expected": sum(r.kind == name and r.outcome != "unexpected" for r in records),
            "unexpected": sum(r.kind == name and r.outcome == "unexpected" for r in records),
        }
        for name, (code, _) in BAD_CASES.items()
    }
    unexpected: dict[tuple, dict] = {}
    for r in records:
        if r.outcome == "unexpected":
            entry = unexpected.setdefault((r.kind, r.detail.split(":")[0]), {"count": 0, "example": r.detail})
            entry["count"] += 1
    return {
        "num_requests": len(records),
        "outcomes": outcomes,
        "deadline_cases_completed_in_time": sum(r.kind == "deadline" and r.outcome == "completed" for r in records),
        "bad_cases": bad_cases,
        "unexpected": [{"kind": kind, "code": code, **v} for (kind, code), v in unexpected.items()],
    }


def build_report(args, soak: Soak, info: pb.GetServerInfoResponse, load_s: float) -> dict:
    records = soak.records
    ttfts = [r.arrivals[0][0] - r.start_s for r in records if r.arrivals]
    itls = [(t - t0) / n for r in records for (t0, _), (t, n) in zip(r.arrivals, r.arrivals[1:])]
    leaked = [
        {
            "address": w.address,
            "state": w.state,
            "num_kv_blocks": w.num_kv_blocks,
            "num_free_kv_blocks": w.num_free_kv_blocks,
            "leaked": w.num_kv_blocks - w.num_free_kv_blocks,
        }
        for w in info.workers
    ]
    rss = rss_report(soak.rss)
    report = {
        "args": vars(args),
        "serve_flags": SERVE_FLAGS + shlex.split(args.serve_args),
        "num_prompts": len(soak.prompts),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        **outcome_report(records),
        "greedy_mismatches": soak.greedy_mismatches,
        "seeded_mismatches": soak.seeded_mismatches,
        "num_seeded_repeats_checked": sum(r.seed is not None and r.outcome == "completed" for r in records)
        - len(soak.seeded_first),
        "kv": {
            "workers": leaked,
            "total_leaked": sum(w["leaked"] for w in leaked),
            "num_running": info.num_running,
            "num_waiting": info.num_waiting,
        },
        "rss": rss,
        "load_s": load_s,
        "num_tokens": sum(len(r.token_ids) for r in records),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "kill": kill_report(soak, info),
        "counters": {
            "num_moved_requests": info.counters.num_moved_requests,
            "num_worker_failures": info.counters.num_worker_failures,
            "num_preemptions": info.counters.num_preemptions,
            "acceptance_rate": info.counters.acceptance_rate,
        },
    }
    report["tokens_per_s"] = report["num_tokens"] / load_s
    growths = [g for g in rss["growth"].values() if g is not None]
    report["targets"] = {
        "no_unexpected_errors": report["outcomes"]["unexpected"] == 0,
        "no_greedy_mismatches": not soak.greedy_mismatches,
        "no_seeded_mismatches": not soak.seeded_mismatches,
        "no_leaked_kv_blocks": report["kv"]["total_leaked"] == 0,
        "rss_growth_below_10pct": (not rss["is_growth_checked"] or all(g < RSS_GROWTH_LIMIT for g in growths)),
    }
    report["passed"] = all(report["targets"].values())
    return report


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def print_summary(report: dict) -> None:
    o = report["outcomes"]
    print(
        f"\nsoak: {report['num_requests']} requests in {report['load_s']:.0f} s "
        f"(concurrency {report['args']['concurrency']}, max_tokens {report['args']['max_tokens']}, "
        f"serve {' '.join(report['serve_flags'])})"
    )
    print(
        "outcomes: "
        + ", ".join(f"{k} {v}" for k, v in o.items())
        + f"  (deadline cases that completed in time: {report['deadline_cases_completed_in_time']})"
    )
    print(
        "bad inputs: "
        + ", ".join(
            f"{n} {c['as_expected']}/{c['as_expected'] + c['unexpected']}" for n, c in report["bad_cases"].items()
        )
    )
    for u in report["unexpected"]:
        print(f"  UNEXPECTED x{u['count']} {u['kind']}: {u['example'][:200]}")
    print(
        f"greedy outputs differing from the reference: {len(report['greedy_mismatches'])}; "
        f"seeded repeats differing: {len(report['seeded_mismatches'])} "
        f"(of {report['num_seeded_repeats_checked']} completed repeats)"
    )
    kv = report["kv"]
    print(
        f"KV blocks leaked after the load: {kv['total_leaked']} ("
        + ", ".join(f"{w['address']} {w['state']}: {w['leaked']} of {w['num_kv_blocks']}" for w in kv["workers"])
        + ")"
    )
    rss = report["rss"]
    for label, sample in rss["samples"].items():
        print(
            f"RSS {label:>4}: serve {_mib(sample['serve_kib'])} MiB, workers "
            + ", ".join(f"{pid}: {_mib(kib)} MiB" for pid, kib in sample["workers_kib"].items())
        )
    checked = "" if rss["is_growth_checked"] else " (not checked: no 2-minute sample)"
    print(
        f"RSS growth {rss['growth_from']} -> end{checked}: "
        + ", ".join(f"{name} {'-' if g is None else f'{g:+.1%}'}" for name, g in rss["growth"].items())
    )
    print(
        f"TTFT p50 {_ms(report['ttft_p50_s'])}, p99 {_ms(report['ttft_p99_s'])}; "
        f"inter-token p50 {_ms(report['itl_p50_s'])}, p99 {_ms(report['itl_p99_s'])}; "
        f"{report['tokens_per_s']:.1f} tok/s ({report['num_tokens']} tokens)"
    )
    k = report["kill"]
    if k:
        print(
            f"kill: worker {k['pid']} at {k['at_s_after_start']:.0f} s with {k['num_in_flight']} streams in flight; "
            f"serving again after {_s(k['serving_again_s'])}; {k['num_moved']} requests moved, next token after "
            f"median {_s(k['moved_next_token_median_s'])}, max {_s(k['moved_next_token_max_s'])} "
            f"(others: median {_s(k['others_next_token_median_s'])})"
        )
    missed = [name for name, ok in report["targets"].items() if not ok]
    print("PASSED" if report["passed"] else f"FAILED: {', '.join(missed)}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16, help="client loops")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="seeds the client loops' choices")
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="SIGKILL a worker at this fraction of --duration (0: no kill)"
    )
    parser.add_argument("--num-prompts", type=int, default=8, help="distinct prompts (Spec-Bench first turns)")
    parser.add_argument("--max-prompt-chars", type=int, default=700, help="only prompts at most this long")
    parser.add_argument("--serve-args", default="", help="extra `specdec serve` flags")
    parser.add_argument(
        "--skip-bad-case",
        action="append",
        default=[],
        choices=list(BAD_CASES),
        help="leave out a bad-input case (repeatable)",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="result file (default bench/results/soak-<timestamp>.json)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.kill_at < 1:
        parser.error(f"--kill-at must be in [0, 1), got {args.kill_at}")
    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--duration, --concurrency and --max-tokens must be positive")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the server like Ctrl-C does
    out = args.out or ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    logger.info("starting specdec serve %s", " ".join(SERVE_FLAGS + shlex.split(args.serve_args)))
    server = Server(SERVE_FLAGS + shlex.split(args.serve_args))
    try:
        report = run(args, server)
    except KeyboardInterrupt:
        logger.error("interrupted: stopping the server")
        return 130
    except (AssertionError, grpc.RpcError) as exc:
        logger.error("soak failed: %s\nlast server output:\n%s", exc, "\n".join(server.process.lines[-40:]))
        return 2
    finally:
        server.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print_summary(report)
    logger.info("saved %s", out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
