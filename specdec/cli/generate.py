"""`specdec generate`: stream a completion from a running server."""

import argparse
import sys

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=args.max_tokens, stop=args.stop, seed=args.seed)
    request = pb.GenerateRequest(sampling=sampling)
    if args.no_speculation:
        request.speculation.enabled = False
    if args.raw:
        request.prompt = args.prompt
    else:
        request.messages.messages.add(role="user", content=args.prompt)
    return request


def generate(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(build_request(args)):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    u = response.usage
                    print(f"\n[{pb.FinishReason.Name(response.finish_reason)}] prompt {u.prompt_tokens}, "
                          f"completion {u.completion_tokens}, drafted {u.draft_tokens}, "
                          f"accepted {u.accepted_tokens} tokens", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nspecdec generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
