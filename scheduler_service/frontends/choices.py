"""Several choices of one prompt (`n`), for both client APIs: one request per choice, the first computing the
prompt and the others sharing its KV blocks through the prefix cache.

Choice 0 opens first; the others open once its first output is out (its prompt computed), so they find the
prompt's full blocks in the prefix cache instead of computing them again. With a seed s, choice i samples with
seed s + i (mod 2**64): it equals that seed's request alone; without one, each gets its own seed when it
arrives (api.with_arrival_seed).
"""

import queue
import threading
from typing import Callable, Iterator

from scheduler_service.cluster.handle import EngineError
from scheduler_service.core.request import RequestOutput
from scheduler_service.frontends.frontend import Stream
from specdec.v1 import generation_pb2 as pb

MAX_CHOICES = 16  # each choice is a request of its own (and holds one of --max-open-streams)
MAX_SEED = 2**64


class ChoicesError(ValueError):
    """A bad `n` (INVALID_ARGUMENT)."""


def num_choices(request: pb.GenerateRequest | pb.CompleteRequest) -> int:
    """The request's `n` (unset: 1); raises ChoicesError outside [1, MAX_CHOICES]."""
    if not request.sampling.HasField("n"):
        return 1
    n = request.sampling.n
    if not 1 <= n <= MAX_CHOICES:
        raise ChoicesError(f"n must be in [1, {MAX_CHOICES}] (choices per request), got {n}")
    return n


def choice_requests(request: pb.GenerateRequest | pb.CompleteRequest) -> list:
    """One request per choice, n cleared in each: choice i's seed is the request's + i."""
    n = num_choices(request)
    requests = []
    for i in range(n):
        choice = type(request)()
        choice.CopyFrom(request)
        choice.sampling.ClearField("n")
        if request.sampling.HasField("seed"):
            choice.sampling.seed = (request.sampling.seed + i) % MAX_SEED
        requests.append(choice)
    return requests


def drafts_by_proposer(last_outputs: list[RequestOutput]) -> dict[str, tuple[int, int]]:
    """(drafted, accepted) by proposer over a request's choices (each one's last output), by name."""
    totals: dict[str, tuple[int, int]] = {}
    for o in last_outputs:
        for name, (drafted, accepted) in o.drafts_by_proposer.items():
            before = totals.get(name, (0, 0))
            totals[name] = (before[0] + drafted, before[1] + accepted)
    return dict(sorted(totals.items()))


class ChoiceStreams:
    """The streams of one request's choices. `open_first` admits choice 0 (raising EngineError as
    Frontend.open does); `outputs` yields (choice, output) for every choice, each choice's in order, opening
    the others after choice 0's first output; `close` (any thread) aborts whatever still runs."""

    def __init__(self, open_stream: Callable[[pb.GenerateRequest], Stream], requests: list):
        self._open = open_stream
        self._requests = requests
        self.streams: list[Stream] = []
        self._lock = threading.Lock()
        self._is_closed = False

    def open_first(self) -> Stream:
        self._add(self._open(self._requests[0]))
        return self.streams[0]

    def _add(self, stream: Stream) -> None:
        with self._lock:
            self.streams.append(stream)
            is_closed = self._is_closed
        if is_closed:  # closed meanwhile: this one too
            stream.close()

    def outputs(self) -> Iterator[tuple[int, RequestOutput]]:
        """Raises EngineError when a choice fails (the others are then closed by the caller's close())."""
        first = self.streams[0].get()
        yield 0, first
        if len(self._requests) == 1:
            while first.finish_reason is None:
                first = self.streams[0].get()
                yield 0, first
            return
        for request in self._requests[1:]:
            self._add(self._open(request))
        merged: queue.Queue = queue.Queue()
        readers = [i for i in range(len(self.streams)) if i > 0 or first.finish_reason is None]
        for i in readers:
            threading.Thread(target=self._read, args=(i, merged), name=f"choice-{i}", daemon=True).start()
        for _ in readers:
            while True:
                index, output = merged.get()
                if isinstance(output, EngineError):
                    raise output
                yield index, output
                if output.finish_reason is not None:
                    break

    def _read(self, index: int, merged: queue.Queue) -> None:
        try:
            for output in self.streams[index]:
                merged.put((index, output))
        except EngineError as exc:
            merged.put((index, exc))

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            streams = list(self.streams)
        for stream in streams:
            stream.close()
