"""Several proposers at once (`--proposer eagle3,suffix`): each drafts, and per sequence and step the draft
with the higher expected accepted length is scored.

A proposer's draft comes with its own estimate of how many of its tokens the target will accept (its
`score`: the head's probability products, the suffix tree's confidences; a proposer without one counts every
token). Those scales differ by proposer and by request, so each is calibrated by what happened: after every
step, every proposer's draft is compared with the tokens the target emitted (the accepted drafts and the
bonus token are the target's own choices at those positions), which tells how many of its tokens would have
been accepted — also for the drafts that were not scored (a lower bound when the whole emitted run matched).
The expected accepted length of a draft is then its score times the request's ratio of matched tokens to
score, shrunk towards the worker-wide ratio of that proposer.

Copying costs next to nothing; a proposer that runs a model (the EAGLE-3 head: a forward per draft) does not.
So the copying proposers draft first, and a model proposer drafts for a sequence only where the best copy is
expected to give fewer tokens than that proposer's drafts recently matched for the request (decayed like the
ratios; before its first draft for a request, and where no copy was found, always). On text that repeats,
the head then waits — its catch-up is deferred while it does not draft — and runs where there is nothing to
copy.

All drafts here are copy-like (no draft probabilities), so the keyed acceptance rule holds whichever wins:
the output is the target's, greedy or seeded.
"""

from dataclasses import dataclass, field

from worker_service.speculation.proposers import Proposal, Proposer, num_matching
from worker_service.speculation.proposers.trees import tree_depth

REQUEST_DECAY = 0.8  # a request's recent steps
WORKER_DECAY = 0.99  # the worker-wide ratio: the prior of a request
PRIOR_WEIGHT = 2.0  # score units of the worker-wide ratio in a request's estimate


@dataclass
class _Ratio:
    """Decayed sums of matched tokens and of the proposer's score."""

    decay: float
    matched: float = 0.0
    score: float = 0.0

    def observe(self, matched: int, score: float) -> None:
        self.matched = self.decay * self.matched + matched
        self.score = self.decay * self.score + score

    def value(self, prior: float, weight: float) -> float:
        return (self.matched + weight * prior) / (self.score + weight)


@dataclass
class _Request:
    ratios: dict[str, _Ratio] = field(default_factory=dict)
    # this step's drafts by proposer: (tokens, score, tree parents or None)
    last_drafts: dict[str, tuple[list[int], float, list[int] | None]] = field(default_factory=dict)
    recent_matched: dict[str, float] = field(default_factory=dict)  # decayed mean matched tokens, model proposers


class CombinedProposer(Proposer):
    """See the module docstring. `proposers`: name -> proposer, none with draft probabilities."""

    def __init__(self, proposers: dict[str, Proposer], max_drafts: dict[str, int]):
        self.proposers = proposers
        self.max_drafts = max_drafts  # per proposer: a head asked for a suffix-sized k would run 16 steps
        self.worker_ratios = {name: _Ratio(WORKER_DECAY) for name in proposers}
        self._requests: dict[str, _Request] = {}

    def propose(self, states: list, num_drafts: list[int]) -> Proposal:
        requests = [self._requests.setdefault(state.request_id, _Request()) for state in states]
        for request in requests:
            request.last_drafts = {}
        best = [([], "", 0.0, None, None) for _ in states]  # per sequence: (drafts, proposer, expected accepted,
        # parents, ranks)
        for name, proposer in sorted(self.proposers.items(), key=lambda item: item[1].runs_model):
            caps = [min(k, self.max_drafts[name]) for k in num_drafts]
            if proposer.runs_model:  # only where no copy is expected to do better
                caps = [
                    k if not b[0] or b[2] < r.recent_matched.get(name, float("inf")) else 0
                    for k, b, r in zip(caps, best, requests)
                ]
                if not any(caps):
                    continue
            proposal = proposer.propose(states, caps)
            for i, request in enumerate(requests):
                tokens = proposal.draft_token_ids[i]
                if not tokens:
                    continue
                score = proposal.scores[i] if proposal.scores is not None else float(len(tokens))
                parents = proposal.parents_of(i)
                request.last_drafts[name] = (tokens, score, parents)
                value = min(score * self._ratio(request, name), len(tokens) if parents is None else tree_depth(parents))
                if value > best[i][2]:
                    best[i] = (tokens, name, value, parents, proposal.ranks_of(i))
        return Proposal(
            [b[0] for b in best],
            None,
            scores=[b[2] for b in best],
            sources=[b[1] for b in best],
            parents=[b[3] for b in best],
            ranks=[b[4] for b in best],
        )

    def _ratio(self, request: _Request, name: str) -> float:
        prior = self.worker_ratios[name].value(1.0, PRIOR_WEIGHT)
        own = request.ratios.get(name)
        return prior if own is None else own.value(prior, PRIOR_WEIGHT)

    def after_verify(self, state, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        emitted = state.token_ids[num_tokens_before:]
        request = self._requests.get(state.request_id)
        if request is not None:
            for name, (tokens, score, parents) in request.last_drafts.items():
                matched = num_matching(tokens, emitted, parents)
                request.ratios.setdefault(name, _Ratio(REQUEST_DECAY)).observe(matched, score)
                self.worker_ratios[name].observe(matched, score)
                if self.proposers[name].runs_model:
                    recent = request.recent_matched.get(name)
                    request.recent_matched[name] = (
                        matched if recent is None else (REQUEST_DECAY * recent + (1 - REQUEST_DECAY) * matched)
                    )
            request.last_drafts = {}
        for proposer in self.proposers.values():
            proposer.after_verify(state, num_tokens_before, num_drafts, num_accepted)

    def after_step(self, states: list, chunks: list, num_committed: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.after_step(states, chunks, num_committed)

    def release(self, states: list) -> None:
        for state in states:
            self._requests.pop(state.request_id, None)
        for proposer in self.proposers.values():
            proposer.release(states)

    def num_kv_tokens(self, state) -> int | None:
        counts = [n for p in self.proposers.values() if (n := p.num_kv_tokens(state)) is not None]
        return min(counts) if counts else None
