"""EAGLE-3 proposer: a draft head reading the target's own hidden states (worker_service/eagle3.py).

The head at position p reads the token at p + 1 and the target's features of
position p, and predicts the token at p + 2. Its K/V lives on the target's
block tables, in a cache of its own. Each step, after verification, the head
*catches up* on every position the target committed in that step (a prefill
chunk's tokens; a decode's pending token and accepted drafts), with the
features the target computed for them in the same pass: no extra target pass,
and the head's K/V below the target's computed count is always that of
committed tokens. When the step sampled, the head's output at the last
committed position is the first draft of the next step, and its pre-norm
state the feature of the second: `propose` then runs the head k - 1 times,
feeding back its own state.

The drafts are the head's argmax mapped to target ids, deterministic given the
context, and are verified like copied drafts (no draft probabilities): a draft
is accepted exactly when it equals the target's (keyed) sample, so the output
is the target's, greedy or seeded, whatever the head proposes.
"""

from dataclasses import dataclass

import torch

from worker_service.eagle3 import Eagle3Head
from worker_service.model_runner import ModelRunner, SequenceChunk, pack
from worker_service.proposers import Proposal, Proposer
from worker_service.request_state import RequestState


@dataclass
class _Next:
    """What the head left for a sequence's next proposal."""

    first_draft: int
    feature: torch.Tensor  # [hidden]: the head's pre-norm output at the last committed position


class Eagle3Proposer(Proposer):
    """See the module docstring. The target runner captures the head's auxiliary hidden states."""

    def __init__(self, head: Eagle3Head, target: ModelRunner):
        self.head = head
        self.target = target
        target.aux_layers = head.aux_layers
        self._next: dict[str, _Next] = {}

    def propose(self, states: list[RequestState], num_drafts: list[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in states]
        active = [i for i, k in enumerate(num_drafts) if k > 0 and states[i].request_id in self._next]
        features = {}
        for i in active:
            nxt = self._next[states[i].request_id]
            drafts[i].append(nxt.first_draft)
            features[i] = nxt.feature
        for depth in range(1, max((num_drafts[i] for i in active), default=0)):
            rows = [i for i in active if num_drafts[i] > depth]
            # Draft d (1-based) is the token at position num_tokens + d - 1; the head reads it one position
            # earlier (at p, the token at p + 1), with its own pre-norm output at the position before as feature.
            chunks = [SequenceChunk([drafts[i][-1]], states[i].num_tokens + depth - 2, states[i].block_table)
                      for i in rows]
            normed, prenorm = self._run(chunks, torch.stack([features[i] for i in rows]))
            for row, (i, token) in enumerate(zip(rows, self.head.draft_tokens(normed))):
                drafts[i].append(token)
                features[i] = prenorm[row]
        return Proposal(drafts, None)

    def after_step(self, states: list[RequestState], chunks: list[SequenceChunk], num_committed: list[int]) -> None:
        """Catches the head up on the positions the target committed in this step (see the module docstring)."""
        aux = self.target.last_aux_hidden  # [T, 3 x target hidden], the step's packed rows in chunk order
        rows, head_chunks, sampled = [], [], []
        offset = 0
        for state, chunk, num in zip(states, chunks, num_committed):
            start = chunk.start_pos
            if num > 0:
                # Position p reads the token at p + 1 (all committed: the last is this step's sample, if any).
                head_chunks.append(SequenceChunk(state.token_ids[start + 1:start + num + 1], start,
                                                 state.block_table, num_logits=1 if chunk.num_logits else 0))
                rows.extend(range(offset, offset + num))
                sampled.append(chunk.num_logits > 0)
                state.num_draft_computed_tokens = start + num
            offset += len(chunk.token_ids)
        if not head_chunks:
            return
        features = self.head.features(aux[torch.tensor(rows, device=aux.device)])
        normed, prenorm = self._run(head_chunks, features, last_rows=True)
        tokens = self.head.draft_tokens(normed)
        committed = [s for s, n in zip(states, num_committed) if n > 0]
        for row, (state, is_sampled) in enumerate(zip(committed, sampled)):
            if is_sampled:
                self._next[state.request_id] = _Next(tokens[row], prenorm[row])
            else:
                self._next.pop(state.request_id, None)

    def _run(self, chunks: list[SequenceChunk], features: torch.Tensor,
             last_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over packed chunks; returns (normed, pre-norm) of every row, or of each chunk's last row."""
        batch = pack(chunks, self.head.kv_cache, features.device)
        normed, prenorm = self.head(batch.input_ids, batch.positions, features, batch.metadata)
        if last_rows:
            last = batch.metadata.query_start_loc[1:].long() - 1
            return normed[last], prenorm[last]
        return normed, prenorm

    def num_kv_tokens(self, state: RequestState) -> int:
        return state.num_draft_computed_tokens

    def release(self, states: list[RequestState]) -> None:
        for state in states:
            self._next.pop(state.request_id, None)
