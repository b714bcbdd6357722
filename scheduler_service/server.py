"""The Generation gRPC service (client API), with health checking and reflection."""

from concurrent import futures
from dataclasses import dataclass
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from scheduler_service.api import InvalidRequestError, build_request
from scheduler_service.engine import Engine, EngineError
from scheduler_service.request import RequestOutput
from scheduler_service.tokenizer import ChatTokenizer
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}


@dataclass
class ModelFacts:
    """What the API layer needs to know of the model the worker serves."""

    model_id: str
    vocab_size: int
    eos_token_ids: list[int]
    proposer: str


def _usage(o: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=o.num_prompt_tokens, completion_tokens=o.num_completion_tokens,
                    draft_tokens=o.num_draft_tokens, accepted_tokens=o.num_accepted_tokens)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Validates client requests, hands them to the engine and streams the outputs back."""

    def __init__(self):
        self.engine: Engine | None = None
        self.tokenizer: ChatTokenizer | None = None
        self.facts: ModelFacts | None = None

    def attach(self, engine: Engine, tokenizer: ChatTokenizer, facts: ModelFacts) -> None:
        self.engine, self.tokenizer, self.facts = engine, tokenizer, facts

    def _outputs(self, request, context):
        """Submits the request and yields its RequestOutputs; aborts the call with the right status."""
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting: the worker is not ready yet")
        try:
            req = build_request(request, self.tokenizer, self.facts.vocab_size, self.facts.eos_token_ids)
            handle = self.engine.submit(req)
        except KeyError as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0]))
        except (InvalidRequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A client that cancels or disconnects aborts the request, which frees its blocks.
        context.add_callback(lambda: handle.is_done or self.engine.abort(req.request_id))
        while True:
            try:
                output = handle.get()
            except EngineError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            yield output
            if output.finish_reason is not None:
                handle.is_done = True
                return

    def Generate(self, request, context):
        """Streams a completion: a message per step with new text, then finish reason and usage."""
        for o in self._outputs(request, context):
            final = o.finish_reason is not None
            if not (o.new_token_ids or o.text or final):
                continue
            yield pb.GenerateResponse(request_id=o.request_id, text=o.text, token_ids=o.new_token_ids,
                                      logprobs=o.logprobs, finish_reason=_FINISH[o.finish_reason],
                                      usage=_usage(o) if final else None)

    def Complete(self, request, context):
        """Runs a request to completion and returns everything at once."""
        text, ids, logprobs = [], [], []
        for o in self._outputs(request, context):
            text.append(o.text)
            ids.extend(o.new_token_ids)
            logprobs.extend(o.logprobs)
            if o.finish_reason is not None:
                return pb.CompleteResponse(request_id=o.request_id, text="".join(text), token_ids=ids,
                                           logprobs=logprobs, finish_reason=_FINISH[o.finish_reason],
                                           usage=_usage(o))

    def Abort(self, request, context):
        """Aborts a running request by id."""
        if self.engine is None or not self.engine.abort(request.request_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running request with id {request.request_id!r}")
        return pb.AbortResponse()

    def GetServerInfo(self, request, context):
        """Model, limits, KV usage and counters."""
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting: the worker is not ready yet")
        snap = self.engine.snapshot()
        c, st = snap.config, snap.stats
        num_sequence_steps = max(st.num_sequence_steps, 1)
        counters = pb.Counters(
            num_requests=st.num_requests, num_drafted_tokens=st.num_draft_tokens,
            num_accepted_tokens=st.num_accepted_tokens, num_emitted_tokens=st.num_emitted_tokens,
            acceptance_rate=st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else 0.0,
            mean_accepted_length=st.num_emitted_tokens / num_sequence_steps, num_steps=st.num_steps,
            num_steps_speculation_disabled=st.num_steps_speculation_disabled, num_preemptions=st.num_preemptions,
            worker_busy_seconds=snap.busy.worker_busy_s, active_wall_seconds=snap.busy.active_wall_s,
            num_worker_failures=snap.num_worker_failures)
        return pb.ServerInfo(
            model=self.facts.model_id, proposer=self.facts.proposer, num_speculative_tokens=c.num_speculative_tokens,
            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, block_size=c.block_size,
            num_kv_blocks=c.num_kv_blocks, num_free_kv_blocks=snap.num_free_blocks, scheduling=c.scheduling,
            speculative_disable_queue_size=c.speculative_disable_queue_size or 0, counters=counters,
            num_running=snap.num_running, num_waiting=snap.num_waiting)


def create_server(host: str, port: int, max_workers: int = 64):
    """A started server (health NOT_SERVING until attach); returns (server, servicer, health, bound port)."""
    # so_reuseport off: a port another server holds must fail to bind, not be shared.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=[("grpc.so_reuseport", 0)])
    health_servicer = health.HealthServicer()
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = GenerationServicer()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use?)")
    server.start()
    return server, servicer, health_servicer, bound


def set_serving(health_servicer: health.HealthServicer) -> None:
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
