"""The client API's security: API keys (every Generation RPC needs `authorization: Bearer <key>`) and TLS.

Health checking and reflection stay open (probes and tools need no key). A
call without a valid key ends with UNAUTHENTICATED before the servicer runs.
Neither the key presented nor any valid key ever appears in a message or a
log line, and keys are compared in constant time (ApiKeys, which the HTTP API
uses too).
"""

from collections.abc import Iterable
import hmac
import logging

import grpc

from specdec.security import channel_credentials, server_credentials
from specdec.v1 import generation_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_MISSING = "missing API key: send the metadata 'authorization: Bearer <key>'"
_INVALID = "invalid API key"


def bearer_token(authorization_values: Iterable[str]) -> str | None:
    """The token of the first `Bearer <token>` value (of `authorization` metadata or headers), or None."""
    for value in authorization_values:
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


class ApiKeys:
    """The accepted API keys: one check for every client port."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]
        if not self._keys:
            raise ValueError("an API key check needs at least one key")

    def is_valid(self, token: str) -> bool:
        """Constant-time comparison against every key (no early exit on a match)."""
        presented = token.encode()
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return any(matches)


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with `code`."""

    def deny(request_or_iterator, context):
        context.abort(code, message)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny, **kwargs)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Lets a call to `service` through only with a valid bearer key; other services are not checked."""

    def __init__(self, keys: Iterable[str], service: str):
        self._keys = ApiKeys(keys)
        self._prefix = f"/{service}/"

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self._prefix):
            return continuation(handler_call_details)
        token = bearer_token(
            value
            for key, value in handler_call_details.invocation_metadata or ()
            if key == "authorization" and isinstance(value, str)
        )
        if token is not None and self._keys.is_valid(token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        logger.debug("rejected %s: %s", method, "no key" if token is None else "invalid key")
        return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, _MISSING if token is None else _INVALID)


def security_hooks(opts) -> dict:
    """create_server's keyword arguments for SchedulerOptions' client-port TLS and API keys.

    Reads every credential file now, so that an unreadable one (CredentialError, one line) stops the
    process at start rather than at a worker's join. Logs the modes, never a key.
    """
    credentials = server_credentials(opts.client_tls)
    channel_credentials(opts.worker_tls)
    client_port = (
        "plaintext" if credentials is None else "mutual TLS" if opts.client_tls.requires_client_cert else "TLS"
    )
    logger.info(
        "client port: %s; API keys: %s; workers: %s",
        client_port,
        f"{len(opts.api_keys)} accepted" if opts.api_keys else "not required",
        "TLS" if opts.worker_tls.is_enabled else "plaintext",
    )
    interceptors = [ApiKeyInterceptor(opts.api_keys, SERVICE_NAME)] if opts.api_keys else []
    return dict(credentials=credentials, interceptors=interceptors)
