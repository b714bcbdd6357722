"""Batched generation through our own worker, in process: the training responses are the target's own output.

A minimal scheduler: `batch_size` requests at a time, each with a block table
for its prompt plus `max_new_tokens`, one step for all of them until each stops
(a stop token or the length limit). The worker is the one serving uses, so the
tokens are exactly what the served target emits for the same request, and the
auxiliary hidden states it keeps for a head (the target runner's `aux_layers`)
are the features a served head reads: no second pass over the text.
"""

from collections.abc import Callable
from dataclasses import dataclass
import itertools

import torch

from specdec import step
from worker_service.speculation.worker import Worker


@dataclass
class Conversation:
    """A prompt and the target's completion (with its stop token when it stopped)."""

    token_ids: list[int]
    num_prompt_tokens: int
    aux_hidden: torch.Tensor | None = None  # [len - 1, 3 x hidden] bf16: the features of every position but the last


def generate(
    worker: Worker,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: set[int],
    sampling: Callable[[int], step.RequestSampling],
    batch_size: int,
    on_batch: Callable[[list[Conversation]], None] | None = None,
) -> list[Conversation]:
    """Prompt i's conversation, sampled with `sampling(i)`. With the target runner's aux_layers set, each
    conversation carries its features. `on_batch` sees each batch as it finishes (progress, saving)."""
    block_size = worker.block_size
    blocks_per_request = -(-(max(map(len, prompts), default=0) + max_new_tokens + 1) // block_size)
    if blocks_per_request * min(batch_size, len(prompts)) > worker.num_blocks:
        raise ValueError(
            f"the worker's KV cache ({worker.num_blocks} blocks of {block_size}) cannot hold "
            f"{batch_size} requests of {blocks_per_request} blocks"
        )
    conversations: list[Conversation] = []
    for start in range(0, len(prompts), batch_size):
        batch = _Batch(worker, list(enumerate(prompts[start : start + batch_size], start)), blocks_per_request)
        done = batch.run(max_new_tokens, stop_token_ids, sampling)
        conversations.extend(done)
        if on_batch is not None:
            on_batch(done)
    return conversations


class _Batch:
    """One batch of requests on the worker, from prefill to the last stop."""

    def __init__(self, worker: Worker, prompts: list[tuple[int, list[int]]], blocks_per_request: int):
        self.worker = worker
        self.prompts = prompts
        self.blocks_per_request = blocks_per_request
        self.ids = [f"g{i}" for i, _ in prompts]
        self.tokens = {rid: list(prompt) for rid, (_, prompt) in zip(self.ids, prompts)}
        self.features: dict[str, list[torch.Tensor]] = {rid: [] for rid in self.ids}
        self.step_ids = itertools.count()

    def run(
        self, max_new_tokens: int, stop_token_ids: set[int], sampling: Callable[[int], step.RequestSampling]
    ) -> list[Conversation]:
        new = [
            step.NewRequest(rid, prompt, len(prompt), sampling(i), self._blocks(row), len(prompt))
            for row, (rid, (i, prompt)) in enumerate(zip(self.ids, self.prompts))
        ]
        request = step.StepRequest(next(self.step_ids), new_requests=new)
        running = list(self.ids)
        while running:
            result = self.worker.execute(request)
            self._keep_features(running)
            finished = []
            for out in result.outputs:
                tokens = self.tokens[out.request_id]
                num_prompt = len(self.prompts[self.ids.index(out.request_id)][1])
                for token in out.token_ids:
                    tokens.append(token)
                    if token in stop_token_ids or len(tokens) - num_prompt >= max_new_tokens:
                        finished.append(out.request_id)
                        break
            running = [rid for rid in running if rid not in finished]
            request = step.StepRequest(
                next(self.step_ids),
                finished_request_ids=finished,
                cached_requests=[step.CachedRequest(rid, [], self.blocks_per_request, 1) for rid in running],
            )
        self.worker.execute(request)  # the last finished requests leave the worker
        return [self._conversation(rid, len(prompt)) for rid, (_, prompt) in zip(self.ids, self.prompts)]

    def _blocks(self, row: int) -> list[int]:
        return list(range(row * self.blocks_per_request, (row + 1) * self.blocks_per_request))

    def _keep_features(self, scheduled: list[str]) -> None:
        """The step's features, in the worker's chunk order: the scheduled requests in request order, each
        chunk's computed positions (the prompt at first, then the one pending token)."""
        aux = self.worker.target.last_aux_hidden
        if aux is None:
            return
        offset = 0
        for rid in scheduled:
            state = self.worker.requests[rid]
            num_rows = state.num_computed_tokens - sum(len(f) for f in self.features[rid])
            self.features[rid].append(aux[offset : offset + num_rows].to(torch.bfloat16))
            offset += num_rows
        assert offset == len(aux), "the step's rows are the scheduled chunks' positions"

    def _conversation(self, rid: str, num_prompt: int) -> Conversation:
        features = torch.cat(self.features[rid]) if self.features[rid] else None
        tokens = self.tokens[rid]
        if features is not None:
            features = features[: len(tokens) - 1]
        return Conversation(tokens, num_prompt, features)
