"""Draft-model proposer: a smaller model run k times on its own paged KV cache.

The draft's KV cache uses the *same block tables* as the target's (its blocks
are the same ids in a separate tensor), so one allocation by the scheduler
covers both. Each request tracks how much of its sequence the draft has
computed; a proposal first catches the draft up (the pending last token, plus
any tokens emitted while speculation was off, plus the last draft token when
all drafts of the previous step were accepted and a bonus token followed —
without that KV the next proposal would differ from a fresh run), then
samples k tokens one at a time. The draft at position n+i is sampled with
noise keyed by (request seed, n+i) on its own stream (STREAM_DRAFT), so a
proposal is reproducible and independent of the target's accept uniforms and
sampling noise at the same positions.
"""

import torch

from worker_service.runtime.runner import ModelRunner, SequenceChunk
from worker_service.speculation.keyed_random import STREAM_DRAFT
from worker_service.speculation.proposers import Proposal, Proposer
from worker_service.speculation.request_state import RequestState
from worker_service.speculation.sampling import logits_to_probs, sample_from_probs, sampling_tensors


class DraftProposer(Proposer):
    """Proposes with a draft ModelRunner; requests keep `num_draft_computed_tokens` up to date."""

    runs_model = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, states: list[RequestState], num_drafts: list[int]) -> Proposal:
        """Samples num_drafts[i] tokens for states[i] (greedy or from the draft distribution p)."""
        num_spec = max(num_drafts, default=0)
        vocab = self.runner.vocab_size
        draft_probs = torch.zeros(
            (len(states), num_spec, vocab), dtype=torch.float32, device=self.runner.device
        )  # [B, K, V]
        drafts: list[list[int]] = [[] for _ in states]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        first = True
        for pos in range(num_spec):
            active = [i for i in active if num_drafts[i] > pos]
            chunks = [self._chunk(states[i], drafts[i], first) for i in active]
            logits = self.runner.forward(chunks)  # [len(active), V]
            params = [states[i].sampling for i in active]
            probs = logits_to_probs(logits, *sampling_tensors(params, logits.device))  # [len(active), V]
            tokens = sample_from_probs(
                probs,
                [states[i].sampling.seed for i in active],
                [states[i].num_tokens + pos for i in active],
                STREAM_DRAFT,
                [states[i].sampling.is_greedy for i in active],
            ).tolist()
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
            draft_probs[torch.tensor(active, device=probs.device), pos] = probs
            first = False
        for i in active_rows(num_drafts):
            # K/V of drafts 1..k-1 are written; the last draft's is not.
            states[i].num_draft_computed_tokens = states[i].num_tokens + num_drafts[i] - 1
        return Proposal(drafts, draft_probs)

    @staticmethod
    def _chunk(state: RequestState, drafts: list[int], is_first: bool) -> SequenceChunk:
        if is_first:  # catch up on every token the draft has not computed, the pending one included
            start = state.num_draft_computed_tokens
            return SequenceChunk(state.token_ids[start:], start, state.block_table)
        start = state.num_tokens + len(drafts) - 1
        return SequenceChunk([drafts[-1]], start, state.block_table)

    def num_kv_tokens(self, state: RequestState) -> int:
        """The draft model's KV covers the sequence up to here (it catches up lazily, at its next proposal)."""
        return state.num_draft_computed_tokens

    def after_verify(self, state: RequestState, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """Keeps the draft KV that is still valid after `num_accepted` of `num_drafts` drafts were accepted."""
        if num_drafts > 0:
            state.num_draft_computed_tokens = num_tokens_before + min(num_accepted, num_drafts - 1)


def active_rows(num_drafts: list[int]) -> list[int]:
    return [i for i, k in enumerate(num_drafts) if k > 0]
