"""`specdec generate`: stream a completion from a running server."""

import argparse
import sys

import grpc

from specdec import security
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.seed,
    )
    request = pb.GenerateRequest(sampling=sampling)
    if args.no_speculation:
        request.speculation.enabled = False
    if args.raw:
        request.prompt = args.prompt
    else:
        request.messages.add(role="user", content=args.prompt)
    return request


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """TLS when any of --ca-file/--cert-file/--key-file is given (ValueError for a bad combination)."""
    if not (args.ca_file or args.cert_file or args.key_file):
        return grpc.insecure_channel(args.address)
    if bool(args.cert_file) != bool(args.key_file):
        raise ValueError("--cert-file and --key-file go together: give both or neither")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=security.read_file(args.ca_file, "--ca-file"),
        private_key=security.read_file(args.key_file, "--key-file"),
        certificate_chain=security.read_file(args.cert_file, "--cert-file"),
    )
    return grpc.secure_channel(args.address, credentials, options=security.channel_options(args.server_name))


def generate(args: argparse.Namespace) -> int:
    try:
        channel = open_channel(args)
        api_key = args.api_key or security.load_client_api_key(args.api_key_file)  # the flag, file, or env
    except ValueError as exc:
        print(f"specdec generate: error: {exc}", file=sys.stderr)
        return 1
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            for response in stub.Generate(build_request(args), metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    u = response.usage
                    print(
                        f"\n[{pb.FinishReason.Name(response.finish_reason)}] prompt {u.prompt_tokens}, "
                        f"completion {u.completion_tokens}, drafted {u.draft_tokens}, "
                        f"accepted {u.accepted_tokens} tokens",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\nspecdec generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
