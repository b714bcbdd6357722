"""What the client API holds of a request in the cluster: its output stream, and the errors it can end with."""

from dataclasses import dataclass
import queue
import time

import grpc

from scheduler_service.cluster.engine import WorkerEngine
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestOutput


class EngineError(RuntimeError):
    """A request cannot complete: carries the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModelFacts:
    """What the API layer needs to know of the model the workers serve (from the first worker)."""

    model_id: str  # the workers' (every worker must serve the same)
    served_model_name: str  # what clients see: --served-model-name (the CLI's default: the model's name)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    proposer: str
    config: SchedulerConfig  # the first worker's scheduler config: the API's limits

    def is_named(self, name: str) -> bool:
        """Whether a client's model name means this model: the served name, or the workers' model id."""
        return name in (self.served_model_name, self.model_id)


class RequestHandle:
    """The outputs of one request, in order; the last has a finish_reason (or is an EngineError)."""

    def __init__(self, request: Request, client_deadline: float | None):
        self.request = request
        self.request_id = request.request_id
        self.client_deadline = client_deadline  # time.monotonic() deadline, or None
        self.engine: WorkerEngine | None = None  # None while waiting for a worker
        self.wait_deadline: float | None = None
        self.outputs: queue.Queue = queue.Queue()
        self.is_done = False
        self.arrival_s = time.monotonic()  # request-latency metrics (metrics.RequestMetrics)
        self.last_token_s: float | None = None  # when the last output with tokens was handed over

    def get(self, timeout: float | None = None) -> RequestOutput:
        item = self.outputs.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item


class RequestObserver:
    """Told of every output the cluster hands to a request's stream, and of every request it fails (lock held).

    This one does nothing; the process's request metrics (process/metrics.py) override both, so the cluster
    never imports the metrics that read it.
    """

    def on_output(self, handle: RequestHandle, output: RequestOutput) -> None:
        pass

    def on_failed(self, handle: RequestHandle) -> None:
        pass
