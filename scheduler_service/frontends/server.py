"""The Generation gRPC service (client API), with health checking and reflection."""

from concurrent import futures
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from scheduler_service.cluster.cluster import Cluster, ClusterSnapshot
from scheduler_service.cluster.handle import EngineError
from scheduler_service.cluster.pipeline import BusyStats
from scheduler_service.core.request import RequestOutput
from scheduler_service.core.stats import SchedulerStats
from scheduler_service.frontends.choices import (
    ChoicesError,
    ChoiceStreams,
    choice_requests,
    drafts_by_proposer,
    num_choices,
)
from scheduler_service.frontends.frontend import Frontend
from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.frontends.tools import ToolCall, ToolOutputs
from specdec.step import TopLogprobs
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}


def _tool_calls(calls: list[ToolCall]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def _top_logprobs(top: list[TopLogprobs]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs) for t in top]


def _usage(last_outputs: list[RequestOutput]) -> pb.Usage:
    """The usage of a request's choices (each one's last output; the prompt counted once)."""
    first = last_outputs[0]
    return pb.Usage(
        prompt_tokens=first.num_prompt_tokens,
        completion_tokens=sum(o.num_completion_tokens for o in last_outputs),
        draft_tokens=sum(o.num_draft_tokens for o in last_outputs),
        accepted_tokens=sum(o.num_accepted_tokens for o in last_outputs),
        cached_prompt_tokens=first.num_cached_tokens,
        proposers=[
            pb.ProposerUsage(proposer=name, draft_tokens=drafted, accepted_tokens=accepted)
            for name, (drafted, accepted) in drafts_by_proposer(last_outputs).items()
        ],
    )


def _counters(
    st: SchedulerStats, busy: BusyStats, num_failures: int, num_moved: int = 0, num_requests: int | None = None
) -> pb.Counters:
    return pb.Counters(
        num_requests=st.num_requests if num_requests is None else num_requests,
        num_drafted_tokens=st.num_draft_tokens,
        num_accepted_tokens=st.num_accepted_tokens,
        num_emitted_tokens=st.num_emitted_tokens,
        acceptance_rate=st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else 0.0,
        mean_accepted_length=st.num_emitted_tokens / max(st.num_sequence_steps, 1),
        num_steps=st.num_steps,
        num_steps_speculation_disabled=st.num_steps_speculation_disabled,
        num_preemptions=st.num_preemptions,
        worker_busy_seconds=busy.worker_busy_s,
        active_wall_seconds=busy.active_wall_s,
        num_worker_failures=num_failures,
        num_moved_requests=num_moved,
        num_accepted_tokens_per_pos=st.num_accepted_tokens_per_pos,
        num_sequence_steps_by_k=st.num_sequence_steps_by_k,
        num_predicted_steps=st.num_predicted_steps,
        predicted_step_seconds=st.predicted_step_s,
        measured_step_seconds=st.measured_step_s,
        step_time_abs_error_seconds=st.step_time_abs_error_s,
        prefix_cache_queries=st.num_prefix_cache_queries,
        prefix_cache_hits=st.num_prefix_cache_hits,
        num_prefix_cache_evictions=st.num_prefix_cache_evictions,
        worker_step_seconds=st.worker_step_s,
        propose_seconds=st.propose_s,
        num_tree_steps_by_depth=st.num_tree_steps_by_depth,
        num_tree_steps_by_nodes=st.num_tree_steps_by_nodes,
    )


def _workers(snap: ClusterSnapshot) -> list[pb.WorkerStatus]:
    return [
        pb.WorkerStatus(
            address=w.address,
            state=w.state.value,
            num_running=w.num_running,
            num_waiting=w.num_waiting,
            num_free_kv_blocks=w.num_free_blocks,
            num_kv_blocks=w.num_total_blocks,
            counters=_counters(w.stats, w.busy, w.num_failures),
            last_error=w.last_error or "",
            num_cached_kv_blocks=w.num_cached_blocks,
        )
        for w in snap.workers
    ]


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The gRPC front: admission, validation and submission are the Frontend's (shared with the HTTP API).

    The server has max_open_streams threads for the streaming calls (the Frontend's bound) and
    NUM_RESERVED_THREADS more, so health checks, GetServerInfo and Abort are never starved.
    """

    def __init__(self, health_servicer: health.HealthServicer, frontend: Frontend):
        self.frontend = frontend
        self.health = health_servicer
        frontend.on_health_changed.append(self._set_health)

    @property
    def cluster(self) -> Cluster | None:
        return self.frontend.cluster

    def attach(self, cluster: Cluster, tokenizer: ChatTokenizer) -> None:
        """Called once a worker has described the model."""
        self.frontend.attach(cluster, tokenizer)

    def set_serving(self, is_serving: bool) -> None:
        """The cluster's callback: SERVING (once attached) while a worker serves, never again once draining."""
        self.frontend.set_serving(is_serving)

    def begin_drain(self) -> None:
        """NOT_SERVING at once; new calls get UNAVAILABLE; calls in progress go on."""
        self.frontend.begin_drain()

    def _set_health(self, is_serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (SERVICE_NAME, ""):
            self.health.set(name, status)

    def _require_cluster(self, context) -> Cluster:
        try:
            return self.frontend.require_cluster()
        except EngineError as exc:
            context.abort(exc.code, str(exc))

    def _outputs(self, request, context):
        """Submits the request (one per choice with n > 1) and yields (choice, output, content, finish reason,
        tool calls): each output with what its tools read of its text (the content, and the calls with the last
        output); aborts the call with the right status."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            choices = ChoiceStreams(lambda r: self.frontend.open(r, deadline), choice_requests(request))
            first = choices.open_first()
        except ChoicesError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineError as exc:
            context.abort(exc.code, str(exc))
        # A client that cancels or disconnects aborts the requests, which frees their blocks.
        if not context.add_callback(choices.close):  # the call already ended
            choices.close()
        tools = [ToolOutputs(first.tools) for _ in range(num_choices(request))]
        try:
            for index, o in choices.outputs():
                is_last = o.finish_reason is not None
                content, _ = tools[index].read(o.text, is_last)
                calls = _tool_calls(tools[index].calls) if is_last else []
                yield index, o, content, tools[index].finish_reason(o.finish_reason), calls
        except EngineError as exc:
            context.abort(exc.code, str(exc))
        finally:
            choices.close()

    def Generate(self, request, context):
        """Streams a completion: a message per step with new text, then finish reason, usage and tool calls
        (with n > 1, each choice's messages carry its index)."""
        for index, o, content, finish_reason, tool_calls in self._outputs(request, context):
            final = o.finish_reason is not None
            if not (o.new_token_ids or content or final):
                continue
            yield pb.GenerateResponse(
                request_id=o.request_id,
                text=content,
                token_ids=o.new_token_ids,
                logprobs=o.logprobs,
                top_logprobs=_top_logprobs(o.top_logprobs),
                finish_reason=_FINISH[finish_reason],
                usage=_usage([o]) if final else None,
                tool_calls=tool_calls,
                index=index,
            )

    def Complete(self, request, context):
        """Runs a request to completion and returns everything at once (with n > 1, every choice)."""
        choices: dict[int, pb.CompleteChoice] = {}
        last: dict[int, RequestOutput] = {}
        for index, o, content, finish_reason, tool_calls in self._outputs(request, context):
            choice = choices.setdefault(index, pb.CompleteChoice(index=index))
            choice.text += content
            choice.token_ids.extend(o.new_token_ids)
            choice.logprobs.extend(o.logprobs)
            choice.top_logprobs.extend(_top_logprobs(o.top_logprobs))
            if o.finish_reason is not None:
                choice.finish_reason = _FINISH[finish_reason]
                choice.tool_calls.extend(tool_calls)
                last[index] = o
        ordered = [choices[i] for i in sorted(choices)]
        first = ordered[0]
        return pb.CompleteResponse(
            request_id=last[0].request_id,
            text=first.text,
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            finish_reason=first.finish_reason,
            usage=_usage([last[i] for i in sorted(last)]),
            tool_calls=first.tool_calls,
            choices=ordered if len(ordered) > 1 else [],
        )

    def Abort(self, request, context):
        """Aborts a running request by id."""
        if self.cluster is None or not self.cluster.abort(request.request_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running request with id {request.request_id!r}")
        return pb.AbortResponse()

    def GetServerInfo(self, request, context):
        """Model, limits, KV usage and counters: totals, and each worker's."""
        cluster = self._require_cluster(context)
        facts, snap = cluster.facts, cluster.snapshot()
        c = facts.config
        serving = [w for w in snap.workers if w.num_total_blocks]
        counters = _counters(
            snap.stats, snap.busy, snap.num_worker_failures, snap.num_moved_requests, snap.num_requests
        )
        return pb.GetServerInfoResponse(
            model=facts.served_model_name,
            proposer=facts.proposer,
            num_speculative_tokens=c.num_speculative_tokens,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            block_size=c.block_size,
            num_kv_blocks=sum(w.num_total_blocks for w in serving),
            num_free_kv_blocks=sum(w.num_free_blocks for w in serving),
            scheduling=c.scheduling,
            speculation_policy=c.speculation_policy,
            speculative_disable_queue_size=c.speculative_disable_queue_size or 0,
            counters=counters,
            num_running=sum(w.num_running for w in snap.workers),
            num_waiting=sum(w.num_waiting for w in snap.workers) + snap.num_waiting_for_worker,
            workers=_workers(snap),
            enable_prefix_caching=c.enable_prefix_caching,
            routing=cluster.options.routing,
            num_cached_kv_blocks=sum(w.num_cached_blocks for w in serving),
        )


# Server threads beyond the streaming calls' bound: health checks, GetServerInfo, Abort, reflection.
NUM_RESERVED_THREADS = 16


def create_server(
    host: str,
    port: int,
    max_open_streams: int = 512,
    credentials: grpc.ServerCredentials | None = None,
    interceptors=(),
):
    """A started server (health NOT_SERVING until a worker serves); returns (server, servicer, bound port).

    credentials: a TLS port (specdec.security.server_credentials), else plaintext; interceptors: e.g. the
    API-key check (auth.py).
    """
    # so_reuseport off: a port another server holds must fail to bind, not be shared.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_open_streams + NUM_RESERVED_THREADS),
        options=[("grpc.so_reuseport", 0)],
        interceptors=list(interceptors),
    )
    health_servicer = health.HealthServicer()
    servicer = GenerationServicer(health_servicer, Frontend(max_open_streams))
    servicer.set_serving(False)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use?)")
    server.start()
    return server, servicer, bound
