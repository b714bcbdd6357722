"""A simulated worker: the worker semantics of specdec.step with a deterministic "model", no torch.

`FakeWorker` runs steps in-process (scheduler tests). `SimWorkerServer` serves
it as a real Worker gRPC service on 127.0.0.1, optionally taking a fixed time
per step (cluster tests, and bench/bench_scheduler_capacity.py). The model:
the next token is a function of the last token and the position; drafts are
right `num_accepted` times, then wrong. Its "KV" of a position is a key chained
over every token up to it (as a real model's KV depends on the whole prefix), and
it checks before each step that the request's blocks still hold its own keys: a
block overwritten, or a prefix-cache hit on other tokens, fails the step.
"""

from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.convert import step_request_from_proto, step_result_to_proto
from specdec.step import SequenceOutput, StepRequest, StepResult
from specdec.v1 import worker_pb2, worker_pb2_grpc
from worker_service.serving.session import SessionError, SessionGate, StepAbort, grpc_step_stream, session_stream
from worker_service.serving.step_socket import serve_steps

VOCAB_SIZE = 50
PIECES = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMN"  # one character per token id


def next_token(token_ids: list[int]) -> int:
    """The "model": (last * 7 + 3) % 50, shifted by the position so that outputs do not cycle quickly."""
    return (token_ids[-1] * 7 + 3 + len(token_ids)) % VOCAB_SIZE


def reference_output(prompt_token_ids: list[int], num_tokens: int) -> list[int]:
    token_ids = list(prompt_token_ids)
    for _ in range(num_tokens):
        token_ids.append(next_token(token_ids))
    return token_ids[len(prompt_token_ids) :]


class PieceTokenizer:
    """Each token id is one character of PIECES."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids)


@dataclass
class _WorkerState:
    """What a worker keeps per request."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    num_speculative_tokens: int
    keys: list[int]  # the KV key of each computed position

    def keys_from(self, start: int, token_ids: list[int]) -> list[int]:
        """The keys of `token_ids` written from position `start` on (after the computed ones before it)."""
        key, keys = self.keys[start - 1] if start else 0, []
        for token_id in token_ids:
            key = hash((key, token_id))
            keys.append(key)
        return keys


class FakeWorker:
    """Deterministic worker: the true next token is next_token(last); drafts are right `num_accepted` times."""

    def __init__(self, block_size: int, num_accepted=lambda step_id, request_id: 1_000, is_checking_kv: bool = True):
        self.block_size = block_size
        self.is_checking_kv = is_checking_kv  # off in benchmarks: the check reads every computed position
        self.num_accepted = num_accepted
        self.states: dict[str, _WorkerState] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> the key of what was written there
        self.num_emitted_by_id: dict[str, int] = defaultdict(int)

    def execute(self, step: StepRequest) -> StepResult:
        for request_id in step.finished_request_ids:
            del self.states[request_id]  # KeyError: told to drop a request it does not hold (a scheduler bug)
        scheduled = []
        for new in step.new_requests:
            assert new.request_id not in self.states, "a NewRequest for a request the worker holds"
            state = _WorkerState(list(new.token_ids), 0, list(new.block_ids), new.num_speculative_tokens, [])
            state.keys = state.keys_from(0, state.token_ids[: new.num_computed_tokens])  # a prefix-cache hit
            state.num_computed = new.num_computed_tokens
            self.states[new.request_id] = state
            scheduled.append((new.request_id, new.num_new_tokens))
        for cached in step.cached_requests:
            state = self.states[cached.request_id]
            assert cached.num_blocks_kept <= len(state.block_ids)
            state.block_ids = state.block_ids[: cached.num_blocks_kept] + cached.new_block_ids
            state.num_speculative_tokens = cached.num_speculative_tokens
            scheduled.append((cached.request_id, cached.num_new_tokens))
        outputs = [self._run(step, request_id, num_new) for request_id, num_new in scheduled]
        return StepResult(step.step_id, outputs)

    def _run(self, step: StepRequest, request_id: str, num_new: int) -> SequenceOutput:
        state = self.states[request_id]
        self._check_kv(request_id, state)
        num_pending = len(state.token_ids) - state.num_computed
        assert 1 <= num_new <= num_pending
        end = state.num_computed + num_new
        if end < len(state.token_ids):  # a prefill chunk short of the end: nothing emitted
            state.keys += self._write(state, state.num_computed, state.token_ids[state.num_computed : end])
            state.num_computed = end
            return SequenceOutput(request_id, [], num_kv_written_tokens=end)
        k = state.num_speculative_tokens if num_pending == 1 else 0
        true_next = reference_output(state.token_ids, k + 1)
        num_accepted = min(k, self.num_accepted(step.step_id, request_id))
        drafts = true_next[:num_accepted] + [(t + 1) % VOCAB_SIZE for t in true_next[num_accepted:k]]
        # The scheduler must have reserved every slot written: known tokens and k lookahead slots.
        assert len(state.block_ids) * self.block_size >= end + k, "block table does not cover the step"
        keys = self._write(state, state.num_computed, state.token_ids[state.num_computed : end] + drafts)
        state.keys += keys[: end - state.num_computed + num_accepted]  # rejected drafts' keys are not the tokens'
        emitted = true_next[: num_accepted + 1]
        state.token_ids += emitted
        state.num_computed = end + num_accepted
        self.num_emitted_by_id[request_id] += len(emitted)
        return SequenceOutput(
            request_id,
            emitted,
            num_draft_tokens=k,
            num_accepted_tokens=num_accepted,
            num_kv_written_tokens=state.num_computed,
        )

    def _write(self, state: _WorkerState, start: int, token_ids: list[int]) -> list[int]:
        keys = state.keys_from(start, token_ids)
        for position, key in enumerate(keys, start=start):
            self.kv[(state.block_ids[position // self.block_size], position % self.block_size)] = key
        return keys

    def _check_kv(self, request_id: str, state: _WorkerState) -> None:
        if not self.is_checking_kv:
            return
        for position in range(state.num_computed):
            block_id = state.block_ids[position // self.block_size]
            slot = self.kv.get((block_id, position % self.block_size))
            assert slot == state.keys[position], f"KV of {request_id} at {position} is not its own"


class SimWorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """The Worker service over a FakeWorker; each step takes `step_time_s` (slept, not computed)."""

    def __init__(
        self,
        health_servicer: health.HealthServicer,
        block_size: int,
        num_blocks: int,
        step_time_s: float,
        num_speculative_tokens: int,
        num_accepted,
        is_checking_kv: bool = True,
        model_id: str = "sim",
    ):
        self.is_checking_kv = is_checking_kv
        self.model_id = model_id
        self.health = health_servicer
        self.block_size, self.num_blocks = block_size, num_blocks
        self.step_time_s = step_time_s
        self.num_speculative_tokens = num_speculative_tokens
        self.num_accepted = num_accepted
        self.worker: FakeWorker | None = None
        self.sessions = SessionGate()  # the real worker's: one scheduler session at a time
        self.num_steps = 0
        self.step_port = 0  # SimWorkerServer's step socket, when it has one
        self.is_frozen = threading.Event()  # set: steps hang and health says NOT_SERVING
        self.lock = threading.Lock()

    def Describe(self, request, context):
        if self.is_frozen.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "frozen")  # a stopped process answers nothing
        return worker_pb2.DescribeResponse(
            model_id=self.model_id,
            vocab_size=VOCAB_SIZE,
            max_model_len=4096,
            kv_bytes_per_block=1024,
            num_blocks_capacity=self.num_blocks,
            eos_token_ids=[],
            dtype="float32",
            proposer="ngram" if self.num_speculative_tokens else "none",
            max_num_speculative_tokens=self.num_speculative_tokens,
            scorer="multi_query",
            device="cpu",
            step_port=self.step_port,
        )

    def InitCache(self, request, context):
        if self.is_frozen.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "frozen")
        assert request.block_size == self.block_size, "the test's block size differs from the scheduler's"
        with self.lock:  # like the real worker's compute thread: no step runs while a session starts
            try:
                session_id = self.sessions.begin(request.previous_session_id, request.take_over)
            except SessionError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            # Like the real worker: a new session holds no request.
            self.worker = FakeWorker(self.block_size, self.num_accepted, is_checking_kv=self.is_checking_kv)
        for name in ("", "specdec.v1.WorkerService"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return worker_pb2.InitCacheResponse(kv_cache_bytes=1024 * request.num_blocks, session_id=session_id)

    def ExecuteModel(self, request_iterator, context):
        yield from grpc_step_stream(self.run_session, request_iterator, context)

    def run_session(self, session_id, requests, is_active):
        """The real servicer's contract (both transports call it), steps read and run on the stream's thread."""
        return session_stream(
            self.sessions, session_id, lambda session_id: self._execute_steps(session_id, requests, is_active)
        )

    def _execute_steps(self, session_id: str, request_iterator, is_active):
        for request in request_iterator:
            start = time.perf_counter()
            while self.is_frozen.is_set() and is_active():
                time.sleep(0.05)
            if not is_active():
                return  # the scheduler gave up on this stream: its steps must not run any more
            with self.lock:
                try:
                    self.sessions.check_current(session_id)
                except SessionError as exc:
                    raise StepAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
                result = self.worker.execute(step_request_from_proto(request))
            self.num_steps += 1
            time.sleep(max(0.0, self.step_time_s - (time.perf_counter() - start)))
            result.stats.total_ms = (time.perf_counter() - start) * 1e3
            yield step_result_to_proto(result)

    def freeze(self, is_health_failing: bool = True) -> None:
        """Hangs like a stopped process: steps never answer, health checks fail (or, like a wedged compute
        thread, keep answering SERVING)."""
        self.is_frozen.set()
        if is_health_failing:
            for name in ("", "specdec.v1.WorkerService"):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def thaw(self) -> None:
        """Answers again, like a process continued after SIGSTOP."""
        self.is_frozen.clear()
        for name in ("", "specdec.v1.WorkerService"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)


class SimWorkerServer:
    """A SimWorkerServicer on 127.0.0.1 (port 0, or a given port to come back at the same address); TLS with
    `credentials`; with `step_socket`, its step stream on a step socket too (the worker's --step-port 0)."""

    def __init__(
        self,
        block_size: int = 4,
        num_blocks: int = 256,
        step_time_s: float = 0.0,
        num_speculative_tokens: int = 3,
        num_accepted=lambda step_id, request_id: 1_000,
        port: int = 0,
        is_checking_kv: bool = True,
        model_id: str = "sim",
        credentials: grpc.ServerCredentials | None = None,
        step_socket: bool = False,
    ):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
        health_servicer = health.HealthServicer()
        self.servicer = SimWorkerServicer(
            health_servicer,
            block_size,
            num_blocks,
            step_time_s,
            num_speculative_tokens,
            num_accepted,
            is_checking_kv,
            model_id,
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        address = f"127.0.0.1:{port}"
        self.port = (
            self.server.add_secure_port(address, credentials) if credentials else self.server.add_insecure_port(address)
        )
        assert self.port, f"cannot listen on 127.0.0.1:{port}"
        self.address = f"127.0.0.1:{self.port}"
        self.step_server = serve_steps(self.servicer, "127.0.0.1", 0) if step_socket else None
        self.server.start()

    def stop(self) -> None:
        """Stops at once: open step streams fail, as when the process is killed."""
        if self.step_server is not None:
            self.step_server.stop(grace_s=0)
        self.server.stop(grace=None).wait()
        self.servicer.is_frozen.clear()  # a frozen step ends (its stream is gone: the step fails to answer)


def partial_acceptance(step_id: int, request_id: str) -> int:
    """0..3 drafts accepted, varying by step and request: 1..4 tokens per sequence and step at k = 3."""
    return (step_id + sum(map(ord, request_id))) % 4


def main() -> None:
    """Serves N simulated workers in this process until stdin closes (for bench_scheduler_capacity.py)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--step-time-ms", type=float, default=30.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args()
    servers = [
        SimWorkerServer(
            args.block_size,
            args.num_blocks,
            args.step_time_ms / 1e3,
            args.num_speculative_tokens,
            partial_acceptance,
            is_checking_kv=False,
        )
        for _ in range(args.num_workers)
    ]
    print("sim workers", *[s.address for s in servers], flush=True)
    sys.stdin.read()
    for server in servers:
        server.stop()


if __name__ == "__main__":
    main()
