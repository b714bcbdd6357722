"""Previews: a copying proposer's draft for a sequence's next step, looked up right after this step.

The scheduler decides each step's k before the worker drafts, so on its own
it plans from each sequence's recent history. But whether a copy is accepted
depends on the match it comes from: on Spec-Bench answers of SmolLM2, an
n-gram draft after a 1-token match had its first token accepted 22% of the
time, after a 4-token match 84%; a suffix draft behind 16 or more matching
tokens 98-99% (bench/bench_match_acceptance.py).
So with --draft-previews, right after a step the worker looks up each
sampling sequence's next draft at its full k (`preview`) and reports how
many drafts it holds and the match length (SequenceOutput.next_draft); the
scheduler learns acceptance by match length and gives k where the match
promises tokens (scheduler_service/core/policy.py). Off by default: in
bench_goodput.py it measured 1.04-1.07x for n-gram at batch 1 and 0.94-1.05x
for suffix (README, Benchmarks).

The lookup runs once: the next step takes its drafts from the kept preview
(cut to that step's k) where the sequence's tokens have not changed since,
and asks the proposer only for the others. A copying proposer's draft at k is
the first k tokens of its draft at a larger k, so this changes no draft
unless the worker's index of other requests' outputs changed in between;
either way the target verifies every draft, so no output changes.
"""

from dataclasses import dataclass

from specdec.step import DraftPreview
from worker_service.speculation.proposers import Proposal, Proposer
from worker_service.speculation.proposers.trees import first_ranks


@dataclass
class _Kept:
    num_tokens: int  # the sequence's token count when it was looked up
    num_asked: int  # the most drafts it was looked up for
    drafts: list[int]
    match_length: int
    parents: list[int] | None  # a tree's (its first k rows, depth first, are a tree too)
    ranks: list[int] | None
    width: int  # the sequence's draft_tree_width then: a step of another width looks up afresh


class PreviewingProposer(Proposer):
    """Wraps a proposer with `reports_match`; every hook goes to it."""

    def __init__(self, proposer: Proposer):
        assert proposer.reports_match
        self.proposer = proposer
        self._kept: dict[str, _Kept] = {}

    def preview(self, states: list, max_drafts: list[int]) -> list[DraftPreview]:
        """Looks up each state's next draft (up to max_drafts[i] tokens) and keeps it for the next step."""
        proposal = self.proposer.propose(states, max_drafts)
        previews = []
        for i, (state, k, drafts, match_length) in enumerate(
            zip(states, max_drafts, proposal.draft_token_ids, proposal.match_lengths)
        ):
            self._kept[state.request_id] = _Kept(
                state.num_tokens,
                k,
                drafts,
                match_length,
                proposal.parents_of(i),
                proposal.ranks_of(i),
                state.draft_tree_width,
            )
            previews.append(DraftPreview(len(drafts), match_length))
        return previews

    def propose(self, states: list, num_drafts: list[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in states]
        parents: list[list[int] | None] = [None] * len(states)
        ranks: list[list[int] | None] = [None] * len(states)
        match_lengths = [0] * len(states)
        ask = []
        for i, (state, k) in enumerate(zip(states, num_drafts)):
            kept = self._kept.pop(state.request_id, None)
            if k <= 0:
                continue
            if (
                kept is not None
                and kept.num_tokens == state.num_tokens
                and k <= kept.num_asked
                and kept.width == state.draft_tree_width
            ):
                drafts[i], match_lengths[i] = kept.drafts[:k], kept.match_length
                if kept.parents is not None:
                    parents[i] = kept.parents[: len(drafts[i])]
                    ranks[i] = first_ranks(kept.ranks, len(drafts[i])) if kept.ranks is not None else None
            else:
                ask.append(i)
        if ask:
            proposal = self.proposer.propose([states[i] for i in ask], [num_drafts[i] for i in ask])
            for j, (i, tokens, match_length) in enumerate(zip(ask, proposal.draft_token_ids, proposal.match_lengths)):
                drafts[i], match_lengths[i] = tokens, match_length
                parents[i], ranks[i] = proposal.parents_of(j), proposal.ranks_of(j)
        return Proposal(drafts, match_lengths=match_lengths, parents=parents, ranks=ranks)

    def after_verify(self, state, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        self.proposer.after_verify(state, num_tokens_before, num_drafts, num_accepted)

    def after_step(self, states: list, chunks: list, num_committed: list[int]) -> None:
        self.proposer.after_step(states, chunks, num_committed)

    def release(self, states: list) -> None:
        for state in states:
            self._kept.pop(state.request_id, None)
        self.proposer.release(states)

    def num_kv_tokens(self, state) -> int | None:
        return self.proposer.num_kv_tokens(state)
