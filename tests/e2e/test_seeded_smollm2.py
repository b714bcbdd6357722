"""Seeded sampling with the embedded SmolLM2 is reproducible: alone, batched, preempted, with n-gram or suffix
speculation (`specdec serve` in this process, tests/serving.py), and after its worker process is killed
mid-stream (the request moves to the other worker)."""

import os
import pathlib
import signal
import threading
import time

import pytest

from specdec.v1 import generation_pb2 as pb
from tests.e2e.client import chat_prompts, serve, stream, stream_all
from tests.serving import serve_in_process

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Describe the water cycle.",
    "Give me three tips for learning a new language.",
    "What makes a good cup of coffee?",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Explain what a CPU does.",
    "Write a limerick about a cat.",
    "Why do leaves change colour in autumn?",
]
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


def seeded(prompt: list[int], seed: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    return chat_prompts(smollm2_path, QUESTIONS)


@pytest.fixture(scope="module")
def alone(smollm2_path, prompts):
    """Each request on its own (one at a time), no speculation: the reference."""
    with serve_in_process(["--model", str(smollm2_path), "--kv-cache-memory-gib", "0.25"]) as server:
        outputs = [stream(server.stub, seeded(p, 100 + i))[0] for i, p in enumerate(prompts)]
        batched = stream_all(server.stub, [seeded(p, 100 + i) for i, p in enumerate(prompts)])
    assert [tokens for tokens, _ in batched] == outputs  # batched with 7 others: the same tokens
    assert len({tuple(o) for o in outputs}) == len(outputs)
    return outputs


def test_preempted_and_with_ngram_speculation(smollm2_path, prompts, alone):
    args = [
        "--model",
        str(smollm2_path),
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "4",
        "--num-kv-blocks",
        "16",
        "--scheduling",
        "sync",  # preempts even with the shared template cached
        "--speculation-policy",
        "fixed",
    ]  # drafts every step, whatever the measured step times
    with serve_in_process(args) as server:
        results = stream_all(server.stub, [seeded(p, 100 + i) for i, p in enumerate(prompts)])
        info = server.wait_idle()
    assert [tokens for tokens, _ in results] == alone
    assert info.counters.num_preemptions > 0 and info.counters.num_accepted_tokens > 0


def test_with_suffix_speculation(smollm2_path, prompts, alone):
    """Twice: the second time the worker's index of recent outputs holds the first time's tokens."""
    # The fixed policy drafts every step: the goodput policy may leave a 24-token request at k = 0 between probes
    # (it learns from the first round that drafts cost more than they return), and then the index is never asked.
    args = [
        "--model",
        str(smollm2_path),
        "--kv-cache-memory-gib",
        "0.25",
        "--proposer",
        "suffix",
        "--num-speculative-tokens",
        "8",
        "--scheduling",
        "sync",
        "--speculation-policy",
        "fixed",
    ]
    requests = [seeded(p, 100 + i) for i, p in enumerate(prompts)]
    with serve_in_process(args) as server:
        first = stream_all(server.stub, requests)
        first_accepted = server.wait_idle().counters.num_accepted_tokens
        second = stream_all(server.stub, requests)
        second_accepted = server.wait_idle().counters.num_accepted_tokens - first_accepted
    assert [tokens for tokens, _ in first] == alone
    assert [tokens for tokens, _ in second] == alone
    assert second_accepted > first_accepted


def _worker_pids(serve_pid: int) -> list[int]:
    children = pathlib.Path(f"/proc/{serve_pid}/task/{serve_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def test_after_a_move(smollm2_path, prompts, alone):
    args = [
        "--model",
        str(smollm2_path),
        "--num-workers",
        "2",
        "--kv-cache-memory-gib",
        "0.25",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "3",
    ]
    with serve(args) as server:
        while sum(w.state == "serving" for w in server.info().workers) < 2:
            time.sleep(0.1)
        requests = [seeded(p, 100 + i) for i, p in enumerate(prompts)]
        results: list = [None] * len(requests)
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, stream(server.stub, requests[i])))
            for i in range(len(requests))
        ]
        for thread in threads:
            thread.start()
        while server.info().counters.num_emitted_tokens < 4 * len(requests):
            time.sleep(0.05)
        os.kill(_worker_pids(server.process.proc.pid)[0], signal.SIGKILL)
        for thread in threads:
            thread.join(300)
        info = server.info()
    assert [tokens for tokens, _ in results] == alone
    assert info.counters.num_moved_requests > 0
