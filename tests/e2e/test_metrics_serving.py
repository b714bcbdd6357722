"""`specdec serve --metrics-port P --worker-metrics-port Q` (in this process, tests/serving.py): both endpoints,
scraped over HTTP, with the tiny pair, and checked by Prometheus' own `promtool check metrics` (scripts/test.sh
puts it in .venv/bin)."""

import pathlib
import subprocess
import sys

import grpc

from specdec.v1 import generation_pb2 as pb
from tests.e2e.client import greedy_request, stream_all
from tests.processes import free_ports
from tests.scheduler.process.test_metrics import Scrape
from tests.serving import serve_in_process
from worker_service.serving.metrics import METRICS as WORKER_METRICS

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40] * 12, [10, 11, 12, 10, 11, 12, 10]]
PROMTOOL = pathlib.Path(sys.executable).parent / "promtool"


def test_scheduler_and_worker_metrics_ports(tiny_pair):
    scheduler_port, worker_port = free_ports(2)
    args = [
        "--model",
        str(tiny_pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--metrics-port",
        str(scheduler_port),
        "--worker-metrics-port",
        str(worker_port),
    ]
    with serve_in_process(args) as server:
        results = stream_all(server.stub, [greedy_request(p, 24) for p in PROMPTS])
        info = server.wait_idle()
        scheduler, worker = Scrape(scheduler_port), Scrape(worker_port)
        _fail_and_cancel_one(server.stub)
        server.wait_idle()
        after_errors = Scrape(scheduler_port), Scrape(worker_port)
    assert all(last.finish_reason == pb.FINISH_REASON_LENGTH for _, last in results)
    assert scheduler.value("specdec_generation_tokens_total") == sum(len(tokens) for tokens, _ in results)
    assert scheduler.value("specdec_request_success_total", finished_reason="length") == len(PROMPTS)
    drafted = scheduler.value("specdec_spec_decode_num_draft_tokens_total")
    assert drafted == info.counters.num_drafted_tokens > 0  # repetitive prompts: n-gram drafts
    per_pos = scheduler.by_label("specdec_spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert sum(per_pos.values()) == scheduler.value("specdec_spec_decode_num_accepted_tokens_total")
    assert scheduler.value("specdec_kv_cache_usage_perc") == 0.0

    # The worker's step histograms: one observation per step, and the phases fit in the whole step.
    num_steps = worker.value("specdec_worker_steps_total")
    assert num_steps == info.counters.num_steps > 0
    for phase in ("", "_propose", "_score", "_verify"):
        assert worker.value(f"specdec_worker_step{phase}_seconds_count") == num_steps
    assert 0 < worker.value("specdec_worker_step_score_seconds_sum") <= worker.value("specdec_worker_step_seconds_sum")
    assert worker.value("specdec_worker_speculating_seqs_total") > 0
    assert worker.exposed_names() == {name for name, _, _ in WORKER_METRICS}
    for endpoint in after_errors:
        check = subprocess.run(
            [str(PROMTOOL), "check", "metrics"], input=endpoint.text, capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, f"promtool check metrics:\n{check.stdout}{check.stderr}"


def _fail_and_cancel_one(stub) -> None:
    """A request the worker cannot take (its prompt outside the vocabulary), and one the client cancels."""
    try:
        list(stub.Generate(greedy_request([10**6], 4)))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        raise AssertionError("a prompt outside the vocabulary was served")
    call = stub.Generate(greedy_request([5, 6], 400))
    next(call)
    call.cancel()
