"""Failover benchmark: SIGKILL one of two workers mid-stream; time until the moved requests' next token.

Starts two `specdec worker` processes (default model, one torch thread each)
and a `specdec scheduler` for both, streams --concurrency chat requests
(greedy, ignore_eos, --max-tokens each), kills worker 0 once every stream has
emitted a few tokens, and reports, for the requests that moved (the streams
with the longest gap after the kill; how many moved comes from the server's
counters), the time from SIGKILL to their next token, next to the other
streams' gap. Every stream must still complete with all its tokens.

    .venv/bin/python bench/bench_failover.py --concurrency 8 --max-tokens 96 [--worker-args "--proposer ngram ..."]

Results are saved in bench/results/failover-*.json.
"""

import argparse
import logging
import pathlib
import shlex
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.bench_serving import chat_request, interleaved_prompts  # noqa: E402
from bench.common import save  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402
from tests.processes import Process, running  # noqa: E402

logger = logging.getLogger("bench.failover")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--tokens-before-kill", type=int, default=8)
    parser.add_argument("--worker-args", default="", help="extra `specdec worker` flags")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    worker_argv = ["worker", "--port", "0", "--num-threads", "1", *shlex.split(args.worker_args)]
    workers = [Process(worker_argv) for _ in range(2)]
    try:
        addresses = [w.address() for w in workers]
        for w in workers:
            w.wait_for("model loaded")
        with running(["scheduler", "--port", "0", "--worker", addresses[0], "--worker", addresses[1]]) as sched:
            channel = grpc.insecure_channel(sched.address(who="scheduler "))
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            sched.wait_for("scheduler ready")
            while sum(w.state == "serving" for w in stub.GetServerInfo(pb.GetServerInfoRequest()).workers) < 2:
                time.sleep(0.1)
            prompts = interleaved_prompts()[: args.concurrency]
            arrivals: list[list[float]] = [[] for _ in prompts]
            counts = [0] * len(prompts)
            errors: list[str] = []

            def consume(i: int) -> None:
                try:
                    for response in stub.Generate(chat_request(prompts[i], args.max_tokens)):
                        if response.token_ids:
                            arrivals[i].append(time.perf_counter())
                            counts[i] += len(response.token_ids)
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            while min(counts) < args.tokens_before_kill:
                time.sleep(0.01)
            killed_at = time.perf_counter()
            workers[0].proc.kill()
            for t in threads:
                t.join(600)
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            channel.close()
    finally:
        for w in workers:
            w.stop()
    gaps = sorted(next((a for a in arr if a > killed_at), float("inf")) - killed_at for arr in arrivals)
    num_moved = int(info.counters.num_moved_requests)
    moved, others = gaps[len(gaps) - num_moved :], gaps[: len(gaps) - num_moved]
    row = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "num_moved": num_moved,
        "errors": errors,
        "all_complete": counts == [args.max_tokens] * len(prompts),
        "moved_next_token_s": moved,
        "others_next_token_s": others,
        "moved_median_s": statistics.median(moved) if moved else None,
        "others_median_s": statistics.median(others) if others else None,
    }
    logger.info(
        "%d of %d requests moved; SIGKILL -> their next token: median %.2f s, max %.2f s "
        "(the others' next token: median %.2f s); all complete: %s; errors: %d",
        num_moved,
        len(prompts),
        row["moved_median_s"] or 0,
        max(moved, default=0),
        row["others_median_s"] or 0,
        row["all_complete"],
        len(errors),
    )
    save("failover", {"args": vars(args), "result": row})


if __name__ == "__main__":
    main()
