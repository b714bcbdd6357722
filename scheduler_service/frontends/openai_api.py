"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health.

A thin front over the Frontend the gRPC service uses (same admission bound,
validation, drain and cluster; no extra hop). Request outputs come from a
blocking queue: each wait runs on a pool of max_open_streams threads of its
own, so long waits never starve the event loop or anyio's default pool.
A client that disconnects (streaming or not) aborts its request, which frees
its KV blocks. Every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` and the HTTP status of its
gRPC status (openai_replies.HTTP_STATUS); bad parameters get 400, not 422.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
import contextlib
import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
import grpc
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler_service.cluster.handle import EngineError
from scheduler_service.core.request import RequestOutput
from scheduler_service.frontends.auth import ApiKeys, bearer_token
from scheduler_service.frontends.choices import ChoicesError, ChoiceStreams, choice_requests
from scheduler_service.frontends.frontend import Frontend
from scheduler_service.frontends.openai_protocol import ChatCompletionRequest, CompletionRequest, InvalidParamError
from scheduler_service.frontends.openai_replies import Reply, engine_error_body, error_body, http_status

logger = logging.getLogger(__name__)

OWNED_BY = "specdec"
HEALTH_PATH = "/health"  # open: probes need no key
MAX_BODY_BYTES = 4 << 20  # as gRPC's default message limit
# Every 400 says so, whichever layer refused it (pydantic, the OpenAI mapping, api.build_request).
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.name.lower()


def _error(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def _sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class ApiKeyMiddleware:
    """Every request but /health needs `Authorization: Bearer <key>` with a valid key (401 otherwise).

    Plain ASGI (no body read, no wrapped receive), so it runs before the body is parsed and leaves
    disconnect detection alone.
    """

    def __init__(self, app, keys: ApiKeys):
        self.app = app
        self._keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != HEALTH_PATH:
            token = bearer_token(v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization")
            if token is None or not self._keys.is_valid(token):
                message = (
                    "missing API key: send the header 'Authorization: Bearer <key>'"
                    if token is None
                    else "invalid API key"
                )
                response = _error(
                    401,
                    message,
                    "invalid_request_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Bodies over MAX_BODY_BYTES get 413 before they are read whole (gRPC's limit is the same)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "invalid_request_error")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            await response(scope, receive, send)
            return
        num_bytes, is_refused = 0, False

        async def limited_receive():
            """A body without content-length (chunked) is counted as it comes; past the limit, the client
            gets the 413 and the app sees a disconnect (what it sends then is dropped)."""
            nonlocal num_bytes, is_refused
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > MAX_BODY_BYTES and not is_refused:
                is_refused = True
                await response(scope, receive, send)
            return {"type": "http.disconnect"} if is_refused else message

        async def guarded_send(message):
            if not is_refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


class EventStream(StreamingResponse):
    """Server-sent events whose requests are closed however the response ends (finished, failed, or the
    client gone: Starlette then cancels the stream, and close() aborts the requests)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], choices: ChoiceStreams):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._choices = choices

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.close()


async def _until_disconnected(receive) -> None:
    """Returns when the client has gone (the body is read already: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class OpenAIApi:
    """The routes and what they share: the Frontend, the thread pool for output waits, the start time."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.pool = ThreadPoolExecutor(frontend.max_open_streams, thread_name_prefix="http-stream")
        self.created = int(time.time())

    async def outputs(self, choices: ChoiceStreams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs, each wait on this API's own thread pool."""
        iterator = choices.outputs()
        while (item := await asyncio.get_running_loop().run_in_executor(self.pool, next, iterator, None)) is not None:
            yield item

    async def complete(self, body: ChatCompletionRequest | CompletionRequest, request: Request) -> Response:
        """Both completion endpoints: map, open a stream, then stream events or return the whole reply."""
        facts = self.frontend.require_cluster().facts
        model_id = facts.served_model_name
        if body.model and not facts.is_named(body.model):  # absent: the served model
            return _error(
                404,
                f"the model {body.model!r} does not exist: this server serves {model_id!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        try:
            pb_request = body.to_proto()
        except InvalidParamError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param, INVALID_ARGUMENT)
        try:
            requests = choice_requests(pb_request)
        except ChoicesError as exc:
            return _error(400, str(exc), "invalid_request_error", "n", INVALID_ARGUMENT)
        choices = ChoiceStreams(self.frontend.open, requests)
        first = await run_in_threadpool(choices.open_first)  # tokenises: off the event loop
        is_chat = isinstance(body, ChatCompletionRequest)
        reply = Reply(
            is_chat,
            first.request_id,
            model_id,
            self.frontend.tokenizer,
            bool(body.logprobs) if is_chat else body.logprobs is not None,
            first.handle.request.prompt_token_ids[-1],
            len(requests),
            first.tools,
        )
        if body.stream:
            return EventStream(self._events(choices, reply, body.include_usage), choices)
        try:
            return await self._whole(choices, reply, request)
        finally:
            choices.close()

    async def _events(self, choices: ChoiceStreams, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in reply.first_chunks(include_usage):
                yield _sse(chunk)
            last: dict[int, RequestOutput] = {}
            async for index, output in self.outputs(choices):
                for chunk in reply.chunks(index, output, include_usage):
                    yield _sse(chunk)
                if output.finish_reason is not None:
                    last[index] = output
            if include_usage:
                yield _sse(reply.usage_chunk([last[i] for i in sorted(last)]))
        except EngineError as exc:  # the status line has gone out: the error is an event
            yield _sse(engine_error_body(exc))
        yield _sse("[DONE]")

    async def _whole(self, choices: ChoiceStreams, reply: Reply, request: Request) -> Response:
        """Waits for the whole reply; a client that disconnects meanwhile aborts the requests."""

        async def collect() -> list[list[RequestOutput]]:
            outputs: dict[int, list[RequestOutput]] = {}
            async for index, output in self.outputs(choices):
                outputs.setdefault(index, []).append(output)
            return [outputs[i] for i in sorted(outputs)]

        collecting = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_until_disconnected(request.receive))
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collecting.done():
            logger.info("client gone: request %s aborted", choices.streams[0].request_id)
            choices.close()
            collecting.cancel()
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(reply.whole(collecting.result()))

    def models(self) -> dict:
        model_id = self.frontend.require_cluster().facts.served_model_name
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": self.created, "owned_by": OWNED_BY}],
        }

    def health(self) -> Response:
        """200 while a worker serves and the server is not draining, else 503."""
        if self.frontend.is_serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not serving"}, status_code=503)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's errors as one OpenAI error with 400 (FastAPI's default is 422)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return _error(
            400,
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
            "invalid_request_error",
            code=INVALID_ARGUMENT,
        )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return _error(400, message, "invalid_request_error", param, INVALID_ARGUMENT)


def create_app(frontend: Frontend, api_keys: frozenset[str] = frozenset()) -> FastAPI:
    """The HTTP API over `frontend`; with api_keys, every route but /health needs one of them."""
    api = OpenAIApi(frontend)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        api.pool.shutdown(wait=False, cancel_futures=True)  # the server has stopped: no stream is read any more

    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware)
    if api_keys:  # added last: outermost, so a request without a key is refused before its body is read
        app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(api_keys))

    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(
        EngineError, lambda request, exc: JSONResponse(engine_error_body(exc), status_code=http_status(exc.code)[0])
    )
    app.add_exception_handler(
        StarletteHTTPException,
        lambda request, exc: _error(
            exc.status_code, str(exc.detail), "invalid_request_error", headers=getattr(exc, "headers", None)
        ),
    )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions: messages rendered with the model's chat template."""
        return await api.complete(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) completions: one prompt, text or token ids."""
        return await api.complete(body, request)

    @app.get("/v1/models")
    def models() -> dict:
        """The served model."""
        return api.models()

    @app.get(HEALTH_PATH)
    def health() -> Response:
        """Readiness: 200 serving, 503 starting, without a worker, or draining."""
        return api.health()

    return app
