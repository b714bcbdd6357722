"""OpenAI's response objects from RequestOutputs: whole replies, stream chunks, usage, logprobs and errors.

Usage carries the prompt tokens found in the prefix cache as OpenAI does
(`usage.prompt_tokens_details.cached_tokens`), and the request's
speculative-decoding counters in an extension field,
`usage.speculative_decoding = {"draft_tokens", "accepted_tokens"}`.
"""

import time

import grpc

from scheduler_service.cluster.handle import EngineError
from scheduler_service.core.request import RequestOutput
from scheduler_service.frontends.tokenizer import ChatTokenizer

USAGE_EXTENSION = "speculative_decoding"
# gRPC status -> (HTTP status, OpenAI error type); any other status: 500, server_error.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a gRPC status code."""
    return HTTP_STATUS.get(code, (500, "server_error"))


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def engine_error_body(exc: EngineError) -> dict:
    return error_body(str(exc), http_status(exc.code)[1], code=exc.code.name.lower())


def usage(o: RequestOutput) -> dict:
    """Token counts, with the speculative counters of this request as an extension field."""
    return {
        "prompt_tokens": o.num_prompt_tokens,
        "completion_tokens": o.num_completion_tokens,
        "total_tokens": o.num_prompt_tokens + o.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.num_cached_tokens},
        USAGE_EXTENSION: {
            "draft_tokens": o.num_draft_tokens,
            "accepted_tokens": o.num_accepted_tokens,
            "by_proposer": {
                name: {"draft_tokens": drafted, "accepted_tokens": accepted}
                for name, (drafted, accepted) in sorted(o.drafts_by_proposer.items())
            },
        },
    }


class Reply:
    """One request's response objects, as a whole (`whole`) or as stream chunks (`chunks`).

    is_chat: chat.completion(.chunk) objects, else text_completion; is_logprobs: each token's logprob
    (chat: `logprobs.content`; completions: tokens, token_logprobs, top_logprobs, text_offset).
    """

    def __init__(
        self,
        is_chat: bool,
        request_id: str,
        model: str,
        tokenizer: ChatTokenizer,
        is_logprobs: bool,
        last_prompt_token_id: int,
    ):
        self.is_chat = is_chat
        self.is_logprobs = is_logprobs
        self._tokenizer = tokenizer
        self._head = {
            "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}",
            "created": int(time.time()),
            "model": model,
        }
        self._previous_token_id = last_prompt_token_id
        self._num_token_chars = 0  # completions' text_offset: the token texts so far

    def _token_text(self, token_id: int) -> str:
        """The token's text as it reads after the previous token (with its leading space, say)."""
        decode, previous = self._tokenizer.decode, self._previous_token_id
        self._previous_token_id = token_id
        before = decode([previous], skip_special_tokens=False)
        return decode([previous, token_id], skip_special_tokens=False)[len(before) :]

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict | None:
        if not self.is_logprobs:
            return None
        texts = [self._token_text(t) for t in token_ids]
        if self.is_chat:
            return {
                "content": [
                    {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                    for text, lp in zip(texts, logprobs)
                ]
            }
        offsets = []
        for text in texts:
            offsets.append(self._num_token_chars)
            self._num_token_chars += len(text)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{} for _ in texts],
            "text_offset": offsets,
        }

    def _choice(
        self, text: str | None, token_ids: list[int], logprobs: list[float], finish_reason: str | None, is_delta: bool
    ) -> dict:
        choice: dict = {"index": 0}
        if not self.is_chat:
            choice["text"] = text or ""
        elif is_delta:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = self._logprobs(token_ids, logprobs)
        choice["finish_reason"] = finish_reason
        return choice

    def whole(self, outputs: list[RequestOutput]) -> dict:
        """The chat.completion or text_completion object of a finished request."""
        last = outputs[-1]
        choice = self._choice(
            "".join(o.text for o in outputs),
            [t for o in outputs for t in o.new_token_ids],
            [lp for o in outputs for lp in o.logprobs],
            last.finish_reason,
            is_delta=False,
        )
        return {
            **self._head,
            "object": "chat.completion" if self.is_chat else "text_completion",
            "choices": [choice],
            "usage": usage(last),
        }

    def _chunk(self, choices: list[dict], include_usage: bool, o: RequestOutput | None = None) -> dict:
        chunk = {
            **self._head,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "choices": choices,
        }
        if include_usage:  # OpenAI: null on every chunk but the last, which has no choices
            chunk["usage"] = usage(o) if o is not None else None
        return chunk

    def first_chunks(self, include_usage: bool) -> list[dict]:
        """Chat streams begin with the assistant's role."""
        if not self.is_chat:
            return []
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._chunk([choice], include_usage)]

    def chunks(self, o: RequestOutput, include_usage: bool) -> list[dict]:
        """The stream chunks of one output: its text and tokens, then (the last output) the finish reason."""
        chunks = []
        if o.text or o.new_token_ids:
            chunks.append(
                self._chunk([self._choice(o.text, o.new_token_ids, o.logprobs, None, is_delta=True)], include_usage)
            )
        if o.finish_reason is not None:
            final = self._choice(None, [], [], o.finish_reason, is_delta=True)
            final["logprobs"] = None
            chunks.append(self._chunk([final], include_usage))
            if include_usage:
                chunks.append(self._chunk([], include_usage, o))
        return chunks
