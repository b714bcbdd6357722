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
from scheduler_service.frontends.choices import drafts_by_proposer
from scheduler_service.frontends.tokenizer import ChatTokenizer
from scheduler_service.frontends.tools import CallDelta, ToolOutputs, ToolPlan
from specdec.step import TopLogprobs

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


def usage(last_outputs: list[RequestOutput]) -> dict:
    """Token counts over a request's choices (each one's last output; the prompt counted once, as OpenAI does),
    with their speculative counters summed as an extension field."""
    first = last_outputs[0]
    num_completion_tokens = sum(o.num_completion_tokens for o in last_outputs)
    return {
        "prompt_tokens": first.num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": first.num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens},
        USAGE_EXTENSION: {
            "draft_tokens": sum(o.num_draft_tokens for o in last_outputs),
            "accepted_tokens": sum(o.num_accepted_tokens for o in last_outputs),
            "by_proposer": {
                name: {"draft_tokens": drafted, "accepted_tokens": accepted}
                for name, (drafted, accepted) in drafts_by_proposer(last_outputs).items()
            },
        },
    }


def _call_delta(d: CallDelta) -> dict:
    """OpenAI's streamed tool call piece: the id, type and name with a call's first piece."""
    function = {"arguments": d.arguments} if d.id is None else {"name": d.name, "arguments": d.arguments}
    head = {} if d.id is None else {"id": d.id, "type": "function"}
    return {"index": d.index, **head, "function": function}


def _token_logprob(text: str, logprob: float) -> dict:
    """Chat's form of a token and its logprob (bytes: the UTF-8 of the token's text)."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class _ChoiceText:
    """Where one choice's token texts stand: the token before the next one, the characters so far."""

    def __init__(self, last_prompt_token_id: int):
        self.previous_token_id = last_prompt_token_id
        self.num_token_chars = 0  # completions' text_offset: the token texts so far


class Reply:
    """One request's response objects, as a whole (`whole`) or as stream chunks (`chunks`), for its
    `num_choices` choices (OpenAI's `n`).

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
        num_choices: int = 1,
        tools: ToolPlan | None = None,
    ):
        self.is_chat = is_chat
        self.is_logprobs = is_logprobs
        self._tokenizer = tokenizer
        self._head = {
            "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}",
            "created": int(time.time()),
            "model": model,
        }
        self._texts = [_ChoiceText(last_prompt_token_id) for _ in range(num_choices)]
        self._tools = [ToolOutputs(tools) for _ in range(num_choices)]  # each choice's calls, read from its text

    def _token_text(self, token_id: int, previous: int) -> str:
        """The token's text as it reads after the previous token (with its leading space, say)."""
        decode = self._tokenizer.decode
        before = decode([previous], skip_special_tokens=False)
        return decode([previous, token_id], skip_special_tokens=False)[len(before) :]

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list[float], top: list[TopLogprobs]) -> dict | None:
        """Each token's logprob, and with top_logprobs its alternatives (each read after the same previous
        token as the chosen one)."""
        if not self.is_logprobs:
            return None
        state, texts, alternatives = self._texts[index], [], []
        for i, token_id in enumerate(token_ids):
            previous, state.previous_token_id = state.previous_token_id, token_id
            texts.append(self._token_text(token_id, previous))
            pairs = zip(top[i].token_ids, top[i].logprobs) if i < len(top) else ()
            alternatives.append([(self._token_text(t, previous), lp) for t, lp in pairs])
        if self.is_chat:
            return {
                "content": [
                    {
                        **_token_logprob(text, lp),
                        "top_logprobs": [_token_logprob(alt, alt_lp) for alt, alt_lp in alts],
                    }
                    for text, lp, alts in zip(texts, logprobs, alternatives)
                ]
            }
        offsets = []
        for text in texts:
            offsets.append(state.num_token_chars)
            state.num_token_chars += len(text)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [dict(alts) for alts in alternatives],
            "text_offset": offsets,
        }

    def _choice(self, index: int, outputs: list[RequestOutput], finish_reason: str | None, is_delta: bool) -> dict:
        """Choice `index` of these outputs (their text, tokens and logprobs together): content and tool calls as
        the request's tools read the text."""
        tools = self._tools[index]
        is_last = finish_reason is not None
        content, deltas = tools.read("".join(o.text for o in outputs), is_last)
        choice: dict = {"index": index}
        if not self.is_chat:
            choice["text"] = content
        elif is_delta:
            choice["delta"] = {"content": content} if content else {}
            if deltas:
                choice["delta"]["tool_calls"] = [_call_delta(d) for d in deltas]
        else:
            choice["message"] = {"role": "assistant", "content": None if tools.calls and not content else content}
            if tools.calls:
                choice["message"]["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in tools.calls
                ]
        choice["logprobs"] = self._logprobs(
            index,
            [t for o in outputs for t in o.new_token_ids],
            [lp for o in outputs for lp in o.logprobs],
            [t for o in outputs for t in o.top_logprobs],
        )
        choice["finish_reason"] = tools.finish_reason(finish_reason)
        return choice

    def whole(self, outputs_by_choice: list[list[RequestOutput]]) -> dict:
        """The chat.completion or text_completion object of a finished request (each choice's outputs)."""
        return {
            **self._head,
            "object": "chat.completion" if self.is_chat else "text_completion",
            "choices": [
                self._choice(i, outputs, outputs[-1].finish_reason, is_delta=False)
                for i, outputs in enumerate(outputs_by_choice)
            ],
            "usage": usage([outputs[-1] for outputs in outputs_by_choice]),
        }

    def _chunk(self, choices: list[dict], include_usage: bool, last_outputs: list[RequestOutput] | None = None) -> dict:
        chunk = {
            **self._head,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "choices": choices,
        }
        if include_usage:  # OpenAI: null on every chunk but the last, which has no choices
            chunk["usage"] = usage(last_outputs) if last_outputs is not None else None
        return chunk

    def first_chunks(self, include_usage: bool) -> list[dict]:
        """Chat streams begin with the assistant's role, for each choice."""
        if not self.is_chat:
            return []
        return [
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                include_usage,
            )
            for i in range(len(self._texts))
        ]

    def chunks(self, index: int, o: RequestOutput, include_usage: bool) -> list[dict]:
        """The stream chunks of choice `index`'s output: its content, tool call pieces and tokens, then (its last
        output) the finish reason."""
        chunks = []
        part = self._choice(index, [o], o.finish_reason, is_delta=True)
        finish_reason = part.pop("finish_reason")
        has_delta = part.get("delta") or (not self.is_chat and part["text"])
        if has_delta or o.new_token_ids:
            chunks.append(self._chunk([{**part, "finish_reason": None}], include_usage))
        if finish_reason is not None:
            final = {"index": index, **({"delta": {}} if self.is_chat else {"text": ""})}
            chunks.append(self._chunk([{**final, "logprobs": None, "finish_reason": finish_reason}], include_usage))
        return chunks

    def usage_chunk(self, last_outputs: list[RequestOutput]) -> dict:
        """The stream's last chunk with include_usage: no choices, the usage of them all."""
        return self._chunk([], True, last_outputs)
