"""A request's structured-output constraint, compiled before it is queued: bounded in size and time.

Compiling runs on a small pool of its own threads (llguidance releases the GIL while it builds a grammar),
never on the engine's step loop; the calling request's thread waits at most `timeout_s`. The result, the
grammar text the workers compile again, is cached by the constraint's text, so a repeated schema costs a
dictionary lookup.
"""

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
import threading
import time

import grpc

from scheduler_service.cluster.handle import EngineError
from specdec import structured
from specdec.v1 import generation_pb2 as pb

CACHE_SIZE = 256
NUM_COMPILE_THREADS = 2


class ConstraintInputError(ValueError):
    """An invalid constraint (INVALID_ARGUMENT): the message names the problem."""


class _TokenizerUnusable(RuntimeError):
    """llguidance cannot use this model's tokenizer: no constraint can be served (not the client's fault)."""


class ConstraintCompiler:
    """Turns `StructuredOutputs` into the grammar text a NewRequest carries ("" when unconstrained)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        max_chars: int,
        timeout_s: float,
        on_compiled: Callable[[float | None], None] | None = None,
    ):
        """on_compiled(seconds): called for every constrained request admitted; seconds is None for a cache hit."""
        self._tokenizer_args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="constraint-compile")
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._on_compiled = on_compiled or (lambda seconds: None)
        self._pool.submit(self._warm_up)  # llguidance's tokenizer (~0.2 s) is built now, not by the first request

    def _warm_up(self) -> None:
        try:
            self._llg_tokenizer()
        except _TokenizerUnusable:
            pass  # each constrained request is told

    def compile(self, outputs: pb.StructuredOutputs) -> str:
        """Raises ConstraintInputError (bad or too large) or EngineError RESOURCE_EXHAUSTED (too slow)."""
        kind = outputs.WhichOneof("constraint")
        if kind is None:
            return ""
        value = tuple(outputs.choice.choices) if kind == "choice" else getattr(outputs, kind)
        if kind == "json_object" and not value:
            raise ConstraintInputError("structured_outputs.json_object must be true when it is set")
        size = 0 if kind == "json_object" else sum(map(len, value)) if kind == "choice" else len(value)
        if size > self.max_chars:
            raise ConstraintInputError(
                f"the {kind} constraint has {size} characters: at most {self.max_chars} (--structured-output-max-chars)"
            )
        key = (kind, value)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is not None:
            self._on_compiled(None)
            return grammar
        start = time.monotonic()
        future = self._pool.submit(self._compile, kind, value)
        future.add_done_callback(lambda done: self._keep(key, done))  # a late result serves the next request
        try:
            grammar = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise EngineError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"compiling the {kind} constraint took longer than {self.timeout_s:g} s "
                "(--structured-output-timeout): simplify it",
            ) from None
        except structured.ConstraintError as exc:
            raise ConstraintInputError(str(exc)) from exc
        except _TokenizerUnusable as exc:
            raise EngineError(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from exc
        self._on_compiled(time.monotonic() - start)
        return grammar

    def _keep(self, key: tuple, future) -> None:
        """Caches a compiled grammar (also one that came after its request had given up)."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            self._cache[key] = future.result()
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def _compile(self, kind: str, value) -> str:
        """The grammar, once a matcher has been built from it with the model's tokenizer (as a worker will)."""
        grammar = structured.to_grammar(kind, value)
        structured.compile_matcher(self._llg_tokenizer(), grammar)
        return grammar

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = structured.make_tokenizer(*self._tokenizer_args)
                except Exception as exc:  # e.g. a model vocabulary smaller than the tokenizer's, no EOS
                    raise _TokenizerUnusable(
                        f"structured outputs are not available for this model: llguidance "
                        f"cannot use its tokenizer ({exc})"
                    ) from exc
            return self._tokenizer
