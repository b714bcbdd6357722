"""One scheduler at a time: the worker's session gate.

A scheduler starts a session with InitCache and gets a fresh random session
id; every step stream must carry it (an ExecuteModel call as metadata
`specdec-session-id`, a step socket's stream in its hello). Starting a
session drops every request the worker holds, so two schedulers never share
request state or KV blocks, and a request id can never reach state another
scheduler left behind.

Rules (all checked under one lock):
- a session may start while no other session's step stream is open, or when
  the caller names its own previous session (it gave up on that stream and
  rejoins), or with `take_over` (an operator replacing a scheduler);
- a stream opens only with the current session id, and at most one stream
  per session is open;
- a step of a session that is no longer current is refused (the worker's
  compute thread checks this right before it runs the step, so a step can
  never touch the state of the session that replaced it).
"""

import secrets
import threading
from typing import Callable, Iterator

import grpc

SESSION_METADATA_KEY = "specdec-session-id"


class SessionError(RuntimeError):
    """The call does not belong to the current session (FAILED_PRECONDITION)."""


class SessionGate:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.session_id: str | None = None
        self._open_stream_session_id: str | None = None  # the session whose step stream is open

    def begin(self, previous_session_id: str, take_over: bool) -> str:
        """Starts a new session and returns its id; raises SessionError while another one is in use.

        The caller drops the worker's request state (on the compute thread, before any step of the new session).
        """
        with self._lock:
            busy = self._open_stream_session_id
            if busy is not None and busy != previous_session_id and not take_over:
                raise SessionError(
                    "the worker serves another scheduler (its step stream is open); "
                    "a scheduler replacing it must take the worker over (--take-over-workers)"
                )
            self.session_id = secrets.token_hex(16)
            return self.session_id

    def open_stream(self, session_id: str | None) -> None:
        """Admits a step stream of the current session; raises SessionError otherwise."""
        with self._lock:
            if not session_id:
                raise SessionError(
                    f"no session: call InitCache, then send its session id as `{SESSION_METADATA_KEY}` metadata"
                )
            if session_id != self.session_id:
                raise SessionError("stale session: another InitCache started a new session since")
            if self._open_stream_session_id == session_id:
                raise SessionError("a step stream of this session is already open")
            self._open_stream_session_id = session_id

    def close_stream(self, session_id: str) -> None:
        with self._lock:
            if self._open_stream_session_id == session_id:
                self._open_stream_session_id = None

    def check_current(self, session_id: str) -> None:
        """Raises SessionError when `session_id` was replaced (call right before running its step)."""
        if session_id != self.session_id:
            raise SessionError("this session was replaced by a newer one (InitCache): its steps do not run")


def session_id_of(metadata) -> str | None:
    """The session id in a call's invocation metadata."""
    return next((value for key, value in metadata if key == SESSION_METADATA_KEY), None)


class StepAbort(Exception):
    """Ends a step stream with a status (gRPC's, whichever transport carries the stream) and a message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def session_stream(gate: SessionGate, session_id: str | None, run_steps: Callable[[str], Iterator]) -> Iterator:
    """A step stream's body: admits it as its session's one step stream (StepAbort FAILED_PRECONDITION
    otherwise), yields from run_steps(session_id), and closes the stream however it ends."""
    try:
        gate.open_stream(session_id)
    except SessionError as exc:
        raise StepAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    try:
        yield from run_steps(session_id)
    finally:
        gate.close_stream(session_id)


def grpc_step_stream(run_session: Callable[..., Iterator], request_iterator, context: grpc.ServicerContext) -> Iterator:
    """ExecuteModel's body: run_session(session id from the call's metadata, the requests, is the call still
    active) as a gRPC stream, a StepAbort ending it with its status."""
    session_id = session_id_of(context.invocation_metadata())
    try:
        yield from run_session(session_id, request_iterator, context.is_active)
    except StepAbort as exc:
        context.abort(exc.code, exc.message)
