"""Speculation policy: the one owner of each sequence's draft length k, step by step.

Each step the scheduler asks `plan_step` for the k of every decoding sequence;
it reserves exactly that many lookahead slots and sends the same k to the
worker, which may propose fewer (no match, the end of the model length) but
never more. Two policies (SPECULATION_POLICIES in config.py):

- "goodput" (default): the k per sequence that maximises expected emitted
  tokens per second of the step (goodput.py: objective, cost model, estimator).
  A sequence left at k = 0 is probed with one draft every `probe_interval`
  steps, so speculation comes back when the text turns repetitive; a probe
  that gets nothing accepted doubles that sequence's interval (up to
  MAX_PROBE_INTERVAL), one that gets a draft accepted resets it, and probes
  fall on steps numbered a multiple of PROBE_ALIGNMENT (or of a shorter
  interval), so sequences probe together: a proposer that runs a model (an
  EAGLE-3 head) then runs once for all of them, not in a step of its own for
  each, and a probe waits at most PROBE_ALIGNMENT - 1 steps for its turn. A
  structured-output request also gets k for the tokens its constraint forces
  next (the worker's last step said how many): those drafts need no proposer
  and are nearly always accepted, so they come whatever the proposer's
  estimates; steps that drafted them do not feed those estimates.
  Where the worker previews a copying proposer's next draft (SequenceOutput.
  next_draft, worker_service/speculation/proposers/preview.py), acceptance is learnt per
  class of the match behind it (match_class: none, 1, 2-3, 4-7, ...;
  worker-wide, with the sequence's own estimate as prior), since a long
  match is far more often accepted than a short one. A preview is *fresh*
  when no step of the sequence is in flight (sync scheduling): it is then
  the very draft the next step gets, so delivery is exact (no draft: k = 0,
  and no probe). With a step in flight (async) it describes the draft of
  the step before, so delivery is learnt per class too, apart from the
  fresh ones.
  With draft trees (the worker's --draft-tree-width W > 1) it also chooses,
  per sequence and step, a chain (width 1) or a tree of up to W children per
  node (StepPlan.tree_widths; goodput.py, Draft trees): it learns each
  sequence's tree values per node rank from its tree steps, its chain
  acceptance from its chain steps, and a sequence that has drafted chains
  for TREE_PROBE_INTERVAL steps drafts one tree, so a tree that lost once
  is tried again. Constrained requests draft chains (the worker masks one
  prefix per position).
- "fixed": every decoding sequence gets its full cap (and the worker's width).

Both keep the seed design's hard limit: with more than
`speculative_disable_queue_size` running requests every k is 0 (the worker
then runs a plain step), and speculation resumes once the load falls.
"""

from dataclasses import dataclass, field

from scheduler_service.core.goodput import (
    INITIAL_ACCEPTANCE,
    SEQUENCE_DECAY,
    WORKER_DECAY,
    AcceptanceEstimate,
    Candidate,
    StepCostModel,
    TreeAcceptance,
    choose_drafts,
)
from scheduler_service.core.request import Request
from specdec.structured import FORCED_PROPOSER

DEFAULT_PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
PROBE_ALIGNMENT = 8  # probes fall on steps numbered a multiple of this: short requests still get theirs
TREE_PROBE_INTERVAL = 16  # a sequence drafting chains drafts a tree after this many chain steps


@dataclass
class StepPlan:
    """The policy's decision for one step: k per decoding request (the lookahead slots reserved and sent),
    and the requests whose k is for the tokens their constraint forces only (the worker asks no proposer)."""

    ks: dict[str, int]
    forced_only: set[str] = field(default_factory=set)
    # (match class, fresh) of the preview each request's k was planned on: observe_sequence learns from it
    matches: dict[str, tuple[int, bool]] = field(default_factory=dict)
    # draft_tree_width per request (1: a chain; W: a tree); absent: 0, the worker's own --draft-tree-width
    tree_widths: dict[str, int] = field(default_factory=dict)


@dataclass
class StepShape:
    """What a step ran, for the cost model: decode query rows (1 + drafts each), prefill rows,
    sequences, and the sum over rows of the context each attends to."""

    num_rows: int = 0
    num_prefill_rows: int = 0
    num_seqs: int = 0
    num_attended: int = 0

    def add(self, num_rows: int, num_context_tokens: int, is_decode: bool) -> None:
        """Adds a sequence's chunk. Only decode rows count as attended context: a prefill chunk's
        attention goes with its rows' coefficient (the two grow together and cannot be told apart)."""
        self.num_seqs += 1
        if is_decode:
            self.num_rows += num_rows
            self.num_attended += num_rows * num_context_tokens
        else:
            self.num_prefill_rows += num_rows


def match_class(match_length: int) -> int:
    """The class of a copied draft's context match whose acceptance the policy learns: 0 (no match), or the
    largest power of two <= its length (1, 2-3, 4-7, ...): a few classes, so each gathers steps quickly."""
    return 1 << (match_length.bit_length() - 1) if match_length > 0 else 0


def _match_key(request: Request) -> tuple[int, bool] | None:
    """(match class, fresh) of the request's last preview (None: none); fresh when no step is in flight."""
    preview = request.next_draft
    if preview is None:
        return None
    return match_class(preview.match_length), request.num_assumed_tokens == 0


class SpeculationPolicy:
    """Decides every sequence's k for every step, and learns from what the steps returned."""

    def __init__(
        self,
        num_speculative_tokens: int,
        speculative_disable_queue_size: int | None,
        policy: str = "goodput",
        probe_interval: int = DEFAULT_PROBE_INTERVAL,
        max_draft_tree_width: int = 1,
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_disable_queue_size = speculative_disable_queue_size
        self.is_goodput = policy == "goodput"
        self.probe_interval = probe_interval
        self.num_planned_steps = 0  # steps the goodput policy planned: probes fall on multiples of PROBE_ALIGNMENT
        self.cost_model = StepCostModel()
        self.worker_acceptance = AcceptanceEstimate(decay=WORKER_DECAY)  # the prior of every sequence
        # With several proposers on the worker: acceptance learnt per proposer (the one that drafted each step).
        self.worker_acceptance_by_proposer: dict[str, AcceptanceEstimate] = {}
        # With previews: delivery and acceptance learnt per (match_class, fresh) of the preview planned on.
        self.acceptance_by_match: dict[tuple[int, bool], AcceptanceEstimate] = {}
        self.max_draft_tree_width = max_draft_tree_width
        self.worker_tree_acceptance = TreeAcceptance(decay=WORKER_DECAY)  # every sequence's tree prior

    def is_disabled_for_step(self, num_running: int) -> bool:
        """Whether the running-queue size switches speculation off for a step."""
        limit = self.speculative_disable_queue_size
        return limit is not None and num_running > limit

    def num_speculative_tokens_for(self, request: Request, max_model_len: int) -> int:
        """The request's k cap: min(server k, its override), or 0 when it opted out.

        Lowered near the end, as drafts past max_tokens or max_model_len would be
        wasted work and KV slots.
        """
        if not request.is_speculation_enabled:
            return 0
        k = self.num_speculative_tokens
        if request.num_speculative_tokens is not None:
            k = min(k, request.num_speculative_tokens)
        return min(k, max(request.num_tokens_left(max_model_len) - 1, 0))

    def plan_step(self, decodes: list[Request], other: StepShape, num_running: int, max_model_len: int) -> StepPlan:
        """k per decoding request for a step that also runs `other` (prefill chunks)."""
        if self.is_disabled_for_step(num_running) or self.num_speculative_tokens == 0:
            return StepPlan({r.request_id: 0 for r in decodes})
        caps = [self.num_speculative_tokens_for(r, max_model_len) for r in decodes]
        cost = self.cost_model.coefficients() if self.is_goodput else None
        if cost is None:  # "fixed", or the cost model has not seen enough steps yet
            return StepPlan({r.request_id: cap for r, cap in zip(decodes, caps)})
        matches = [_match_key(r) for r in decodes]
        candidates = [self._candidate(r, cap, match) for r, cap, match in zip(decodes, caps, matches)]
        ks, trees = choose_drafts(
            candidates, cost, other.num_prefill_rows, other.num_seqs, num_base_tokens=len(decodes)
        )
        plan = StepPlan({})
        self.num_planned_steps += 1
        for request, cap, k, match, tree in zip(decodes, caps, ks, matches, trees):
            if self.max_draft_tree_width > 1:  # a constrained request drafts a chain (the worker masks one prefix)
                plan.tree_widths[request.request_id] = 1 if request.grammar else self._tree_width(request, k, tree)
            estimate = self._estimate(request)
            interval = estimate.probe_interval or self.probe_interval
            no_drafts = match is not None and match[1] and request.next_draft.num_drafts == 0  # fresh: none come
            if (
                k == 0
                and cap > 0
                and not no_drafts
                and estimate.num_steps_without_drafts >= interval
                and self.num_planned_steps % min(interval, PROBE_ALIGNMENT) == 0
            ):
                k, estimate.is_probing = 1, True  # probe: acceptance may have come back (its answer: observe)
            estimate.num_steps_without_drafts = 0 if k > 0 else estimate.num_steps_without_drafts + 1
            if match is not None:
                plan.matches[request.request_id] = match
            # The tokens its constraint forces next cost no proposer and are nearly always accepted: allowed
            # whatever the proposer's estimates say (where those alone give k = 0, for them only).
            forced = min(request.num_forced_tokens_next, cap)
            if forced > k:
                if k == 0:
                    plan.forced_only.add(request.request_id)
                k = forced
            plan.ks[request.request_id] = k
        return plan

    def _tree_width(self, request: Request, k: int, is_tree: bool) -> int:
        """The width sent with k: the worker's W for a tree, 1 for a chain; a sequence that drafted chains for
        TREE_PROBE_INTERVAL steps drafts a tree (its tree values may have risen since it last did)."""
        if k > 1 and not is_tree and request.num_chain_steps >= TREE_PROBE_INTERVAL:
            is_tree = True
        if k > 1:
            request.num_chain_steps = 0 if is_tree else request.num_chain_steps + 1
        return self.max_draft_tree_width if is_tree else 1

    def _estimate(self, request: Request) -> AcceptanceEstimate:
        if request.acceptance is None:
            request.acceptance = AcceptanceEstimate()
        return request.acceptance

    def _candidate(self, request: Request, cap: int, match: tuple[int, bool] | None) -> Candidate:
        """Acceptance, and how deep drafts go, from the steps of the proposer that drafted the request's last
        drafts (the worker picks a proposer per step, and keeps picking the one that does well: a head's short
        chains must not cut a suffix's long copies to one token); whether a first draft comes at all, from every
        step of the request; `match`: the request's _match_key, where the worker previewed its draft."""
        estimate, prior = self._estimate(request), self.worker_acceptance
        first = estimate.delivery(0, prior.delivery(0, 1.0))
        delivery = [estimate.delivery(m, prior.delivery(m, 1.0)) for m in range(cap)]
        by_proposer = request.acceptance_by_proposer.get(request.last_proposer)
        if by_proposer is not None:
            # a request moved from another worker brings its own estimates; this worker may not know the proposer yet
            estimate = by_proposer
            prior = self.worker_acceptance_by_proposer.get(request.last_proposer, self.worker_acceptance)
            # observed only in steps where that proposer drafted: depth given a first draft
            delivery = [first] + [first * estimate.delivery(m, prior.delivery(m, 1.0)) for m in range(1, cap)]
        acceptance = tuple(estimate.acceptance(m, prior.acceptance(m, INITIAL_ACCEPTANCE)) for m in range(cap))
        tree_delivery, tree_value = self._tree_curve(request, delivery, acceptance, cap)
        if match is not None:  # the worker previewed the draft: acceptance by its match's class
            by_match = self.acceptance_by_match.get(match)
            if by_match is not None:
                acceptance = tuple(by_match.acceptance(m, a) for m, a in enumerate(acceptance))
            if match[1]:  # fresh: the very draft the step gets; no slot for a draft that will not come
                cap = min(request.next_draft.num_drafts, cap)
                delivery = [1.0] * cap
            elif by_match is not None:
                delivery = [by_match.delivery(m, q) for m, q in enumerate(delivery)]
        return Candidate(
            cap,
            request.num_computed_tokens,
            tuple(delivery[:cap]),
            acceptance[:cap],
            tree_delivery[:cap],
            tree_value[:cap],
        )

    def _tree_curve(
        self, request: Request, delivery, acceptance, cap: int
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per node rank, P(the tree has it) and its value, from the request's tree steps, shrunk towards the
        worker's, shrunk towards the chain's draft at that position (goodput.py, Draft trees); () without
        trees or for a constrained request."""
        if self.max_draft_tree_width <= 1 or request.grammar:
            return (), ()
        own = request.tree_acceptance or TreeAcceptance()
        worker = self.worker_tree_acceptance
        chain_values, survive = [], 1.0
        for a in acceptance[:cap]:
            survive *= a
            chain_values.append(survive)
        tree_delivery = tuple(own.delivery(j, worker.delivery(j, q)) for j, q in enumerate(delivery[:cap]))
        tree_value = tuple(own.value(j, worker.value(j, v)) for j, v in enumerate(chain_values))
        return tree_delivery, tree_value

    def observe_sequence(
        self,
        request: Request,
        num_requested: int,
        num_drafts: int,
        num_accepted: int,
        proposer: str = "",
        match: tuple[int, bool] | None = None,
    ) -> None:
        """A sequence's step result: k requested, drafts proposed, drafts accepted, by which proposer; `match`:
        the step's StepPlan.matches entry."""
        if proposer == FORCED_PROPOSER:  # the constraint's tokens, not the proposer's: plan_step allows them
            return
        estimate = self._estimate(request)
        if estimate.is_probing and num_requested > 0:  # the probe's answer: probe as often, or half as often
            interval = estimate.probe_interval or self.probe_interval
            estimate.probe_interval = self.probe_interval if num_accepted else min(2 * interval, MAX_PROBE_INTERVAL)
            estimate.is_probing = False
        if num_requested > 0:
            estimate.observe(num_requested, num_drafts, num_accepted)
            self.worker_acceptance.observe(num_requested, num_drafts, num_accepted)
            if match is not None:
                self.acceptance_by_match.setdefault(match, AcceptanceEstimate(decay=WORKER_DECAY)).observe(
                    num_requested, num_drafts, num_accepted
                )
            if num_drafts > 0 and proposer:
                request.last_proposer = proposer
                for estimates, decay in (
                    (request.acceptance_by_proposer, SEQUENCE_DECAY),
                    (self.worker_acceptance_by_proposer, WORKER_DECAY),
                ):
                    estimates.setdefault(proposer, AcceptanceEstimate(decay=decay)).observe(
                        num_requested, num_drafts, num_accepted
                    )

    def observe_tree(
        self, request: Request, num_requested: int, num_nodes: int, accepted_ranks: list[int], proposer: str = ""
    ) -> None:
        """A sequence's tree step: its node budget, the nodes the tree had, the ranks of the accepted ones."""
        if request.tree_acceptance is None:
            request.tree_acceptance = TreeAcceptance()
        request.tree_acceptance.observe(num_requested, num_nodes, accepted_ranks)
        self.worker_tree_acceptance.observe(num_requested, num_nodes, accepted_ranks)
        if proposer:
            request.last_proposer = proposer

    @property
    def prices_drafts(self) -> bool:
        """Whether the policy prices drafts with its step-cost model: goodput, with drafts to price."""
        return self.is_goodput and self.num_speculative_tokens > 0

    def observe_step(self, shape: StepShape, step_ms: float) -> float | None:
        """A step's measured time; returns what the model predicted for it beforehand (None: no model yet, or
        a policy that prices nothing, whose model is never fitted: a fit and a prediction per step cost the
        scheduler ~0.05 ms of Python at every step)."""
        if step_ms <= 0 or not self.prices_drafts:  # step_ms 0: a worker that does not measure (simulated)
            return None
        features = (shape.num_rows, shape.num_prefill_rows, shape.num_seqs, shape.num_attended)
        predicted = self.cost_model.predict_ms(*features)
        self.cost_model.observe(*features, step_ms)
        return predicted
