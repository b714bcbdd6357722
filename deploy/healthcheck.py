#!/usr/bin/env python3
"""gRPC health check for containers: exit 0 if the service is SERVING, else 1.

    python deploy/healthcheck.py --address 127.0.0.1:50052 --service specdec.v1.Worker [--allow-not-serving]

`--allow-not-serving` only checks that the server answers: a worker reports
NOT_SERVING until a scheduler has called InitCache, and must not be marked
unhealthy for that. Exit 1 (never 2, which Docker reserves) on any failure.
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str, timeout_s: float) -> int:
    """Returns the HealthCheckResponse status; raises grpc.RpcError when unreachable or unknown."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help='health service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--allow-not-serving", action="store_true", help="healthy if it answers at all")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"healthcheck: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    ok = status == health_pb2.HealthCheckResponse.SERVING or args.allow_not_serving
    print(f"healthcheck: {args.address} {args.service or '(server)'}: {name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
