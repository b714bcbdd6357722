"""What every client API (gRPC, HTTP) shares: admission, validation, submission and the request's stream.

Both fronts turn their input into a `GenerateRequest`, open a Stream with it
and read RequestOutputs; every failure is an EngineError carrying the gRPC
status (the HTTP API maps it to an HTTP status). One validation path
(api.build_request), one bound on the calls in progress, one drain switch.
"""

import logging
import threading
from typing import Callable, Iterator

import grpc

from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.handle import EngineError, RequestHandle
from scheduler_service.core.request import RequestOutput
from scheduler_service.frontends.api import InvalidRequestError, build_request
from scheduler_service.frontends.structured import ConstraintCompiler
from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.frontends.tools import ToolPlan, ToolsError, plan_tools
from specdec.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)


class Stream:
    """One admitted request's outputs, in order. close() (idempotent, any thread) aborts the request if it has
    not finished, which frees its KV blocks, and gives its open-stream slot back."""

    def __init__(
        self, cluster: Cluster, handle: RequestHandle, release: Callable[[], None], tools: ToolPlan | None = None
    ):
        self.cluster = cluster
        self.handle = handle
        self.tools = tools  # the request's tool calling (None: no tools), for reading calls out of its text
        self.request_id = handle.request_id
        self._release = release
        self._lock = threading.Lock()
        self._is_closed = False

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output (blocking); raises EngineError when the request fails."""
        output = self.handle.get(timeout)
        if output.finish_reason is not None:
            self.handle.is_done = True
        return output

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every output up to the last one (with a finish_reason)."""
        while True:
            output = self.get()
            yield output
            if output.finish_reason is not None:
                return

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        try:
            if not self.handle.is_done:
                self.cluster.abort(self.request_id)
        finally:
            self._release()


class Frontend:
    """Admits client calls and hands their requests to the cluster.

    At most `max_open_streams` Generate/Complete calls and HTTP completions run at once (each holds a
    thread while it streams); beyond that a call gets RESOURCE_EXHAUSTED at once. While draining (SIGTERM)
    new calls get UNAVAILABLE. Health: serving once the cluster is attached and while a worker serves,
    and never again once draining; every change goes to the `on_health_changed` listeners.
    """

    def __init__(self, max_open_streams: int):
        self.cluster: Cluster | None = None
        self.tokenizer: ChatTokenizer | None = None
        self.max_open_streams = max_open_streams
        self._open_streams = threading.BoundedSemaphore(max_open_streams)
        self.is_draining = False
        self._is_worker_serving = False
        self.on_health_changed: list[Callable[[bool], None]] = []
        # Called for every constrained request admitted: the compile's seconds, None for a cache hit.
        self.on_constraint_compiled: list[Callable[[float | None], None]] = []
        self.constraints: ConstraintCompiler | None = None
        # Health changes come from the cluster's thread and the drain; one at a time, so that the last
        # state a listener hears is the current one (never SERVING again after the drain began).
        self._health_lock = threading.Lock()

    def attach(self, cluster: Cluster, tokenizer: ChatTokenizer) -> None:
        """Called once a worker has described the model: from now on a request can be admitted."""
        facts, options = cluster.facts, cluster.options
        tokenizer_json = getattr(tokenizer, "tokenizer_json", None)
        constraints = (
            None
            if tokenizer_json is None
            else ConstraintCompiler(
                tokenizer_json,
                facts.vocab_size,
                list(facts.eos_token_ids),
                options.structured_output_max_chars,
                options.structured_output_timeout_s,
                self._constraint_compiled,
            )
        )
        with self._health_lock:
            self.cluster, self.tokenizer, self.constraints = cluster, tokenizer, constraints
            self._health_changed()

    def _constraint_compiled(self, seconds: float | None) -> None:
        for listener in self.on_constraint_compiled:
            listener(seconds)

    @property
    def is_serving(self) -> bool:
        """Whether a request would be admitted now: the cluster is attached, a worker serves, no drain."""
        return self.cluster is not None and self._is_worker_serving and not self.is_draining

    def set_serving(self, is_worker_serving: bool) -> None:
        """The cluster's callback: whether at least one worker serves."""
        with self._health_lock:
            self._is_worker_serving = is_worker_serving
            self._health_changed()

    def begin_drain(self) -> None:
        """Not serving at once; new calls get UNAVAILABLE; calls in progress go on."""
        with self._health_lock:
            self.is_draining = True
            self._health_changed()

    def _health_changed(self) -> None:
        for listener in self.on_health_changed:
            listener(self.is_serving)

    def require_cluster(self) -> Cluster:
        if self.cluster is None:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the server is starting: no worker has answered yet")
        return self.cluster

    def open(self, request: pb.GenerateRequest | pb.CompleteRequest, deadline: float | None = None) -> Stream:
        """Admits, validates and submits a request; raises EngineError (the slot is then given back).

        deadline: the client's, as time.monotonic(), or None. The caller must close() the stream.
        """
        if self.is_draining:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down: retry on another replica")
        if not self._open_streams.acquire(blocking=False):
            raise EngineError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls in progress ({self.max_open_streams}, --max-open-streams): retry later",
            )
        try:
            cluster = self.require_cluster()
            tools = self._tools(cluster, request)
            return Stream(cluster, self._submit(cluster, request, deadline, tools), self._open_streams.release, tools)
        except BaseException:
            self._open_streams.release()
            raise

    @staticmethod
    def _tools(cluster: Cluster, request: pb.GenerateRequest | pb.CompleteRequest) -> ToolPlan | None:
        try:
            return plan_tools(request, cluster.options.tool_call_parser)
        except ToolsError as exc:
            raise EngineError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def _submit(
        self,
        cluster: Cluster,
        request: pb.GenerateRequest | pb.CompleteRequest,
        deadline: float | None,
        tools: ToolPlan | None,
    ) -> RequestHandle:
        facts = cluster.facts
        try:
            req = build_request(
                request,
                self.tokenizer,
                facts.vocab_size,
                list(facts.eos_token_ids),
                facts.config.max_model_len,
                None if self.constraints is None else self.constraints.compile,
                tools,
            )
            return cluster.submit(req, deadline)
        except KeyError as exc:
            raise EngineError(grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0])) from exc
        except (InvalidRequestError, ValueError) as exc:
            raise EngineError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
