#!/usr/bin/env python3
"""gRPC health check for containers: exit 0 if the service is SERVING, else 1.

    python deploy/healthcheck.py --address 127.0.0.1:50052 --service specdec.v1.WorkerService [--allow-not-serving]

`--allow-not-serving` only checks that the server answers: a worker reports
NOT_SERVING until a scheduler has called InitCache, and must not be marked
unhealthy for that. Exit 1 (never 2, which Docker reserves) on any failure.

A TLS server (`--ssl-certfile`): `--ca-file` (its CA), and for mutual TLS
(`--ssl-ca-certs`) `--cert-file`/`--key-file`; `--server-name` when the
certificate does not name the address. Health needs no API key.
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --ca-file/--cert-file is given."""
    if not (args.ca_file or args.cert_file):
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(_read(args.ca_file), _read(args.key_file), _read(args.cert_file))
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def check(channel: grpc.Channel, service: str, timeout_s: float) -> int:
    """Returns the HealthCheckResponse status; raises grpc.RpcError when unreachable or unknown."""
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help='health service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--allow-not-serving", action="store_true", help="healthy if it answers at all")
    parser.add_argument("--ca-file", help="TLS: the CA of the server's certificate")
    parser.add_argument("--cert-file", help="mutual TLS: a client certificate (with --key-file)")
    parser.add_argument("--key-file", help="private key of --cert-file")
    parser.add_argument("--server-name", help="TLS: the name the server's certificate carries")
    args = parser.parse_args(argv)
    try:
        status = check(open_channel(args), args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"healthcheck: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    ok = status == health_pb2.HealthCheckResponse.SERVING or args.allow_not_serving
    print(f"healthcheck: {args.address} {args.service or '(server)'}: {name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
