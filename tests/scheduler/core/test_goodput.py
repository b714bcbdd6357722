"""The goodput policy as pure functions (cost model, acceptance estimates, choice of k), then in the scheduler."""

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.goodput import (
    AcceptanceEstimate,
    Candidate,
    CostCoefficients,
    StepCostModel,
    TreeAcceptance,
    choose_drafts,
    choose_num_drafts,
    expected_accepted,
)
from scheduler_service.core.policy import TREE_PROBE_INTERVAL, SpeculationPolicy, StepShape
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from specdec.step import DraftPreview, StepStats
from specdec.structured import FORCED_PROPOSER
from tests.scheduler.core.test_scheduler import FakeWorker, reference_output, run, streamed

K = 5
CHEAP_ROWS = CostCoefficients(c0=40.0, c_row=0.2, c_prefill=1.0, c_seq=0.0, c_ctx=0.0)  # CPU, batch 1
DEAR_ROWS = CostCoefficients(c0=5.0, c_row=4.0, c_prefill=1.0, c_seq=0.0, c_ctx=0.0)  # a row ~ a step


def candidate(acceptance: float, cap: int = K, context: int = 100, delivery: float = 1.0) -> Candidate:
    return Candidate(cap, context, (delivery,) * cap, (acceptance,) * cap)


def test_expensive_rows_and_low_acceptance_choose_zero():
    assert choose_num_drafts([candidate(0.1)] * 8, DEAR_ROWS, 0, 0, num_base_tokens=8) == [0] * 8


def test_cheap_rows_and_high_acceptance_choose_the_full_k():
    assert choose_num_drafts([candidate(0.9)] * 4, CHEAP_ROWS, 0, 0, num_base_tokens=4) == [K] * 4


def test_k_follows_each_sequence_acceptance_and_its_cap():
    mid = CostCoefficients(c0=20.0, c_row=1.0, c_prefill=1.0, c_seq=0.0, c_ctx=0.0)
    ks = choose_num_drafts([candidate(0.95), candidate(0.05), candidate(0.95, cap=2)], mid, 0, 0, 3)
    assert ks[0] > 0 and ks[1] == 0 and ks[2] == 2
    # Position by position: a sequence whose first draft is always accepted but never the second gets k = 1.
    one = Candidate(K, 100, (1.0,) * K, (0.99, 0.01, 0.01, 0.01, 0.01))
    assert choose_num_drafts([one], mid, 0, 0, 1) == [1]


def test_drafts_the_proposer_rarely_delivers_cost_little():
    """A suffix-like proposer: confident drafts, but long ones seldom. A large k is cheap where rows cost."""
    mid = CostCoefficients(c0=20.0, c_row=1.0, c_prefill=1.0, c_seq=0.0, c_ctx=0.0)
    rare_but_good = Candidate(16, 100, tuple(0.9**j for j in range(16)), (0.9,) * 16)
    always_but_poor = Candidate(16, 100, (1.0,) * 16, (0.3,) * 16)
    assert choose_num_drafts([rare_but_good, always_but_poor], mid, 0, 0, 2)[0] >= 10


def test_long_contexts_make_draft_rows_dearer():
    cost = CostCoefficients(c0=20.0, c_row=0.5, c_prefill=1.0, c_seq=0.0, c_ctx=2.0)
    short, long = candidate(0.8, context=100), candidate(0.8, context=8000)
    ks = choose_num_drafts([short, long], cost, 0, 0, 2)
    assert ks[0] >= 3 and ks[1] == 0


def test_a_draft_row_costs_at_least_a_prefill_row():
    """A fit that put a row's cost on c_seq (plain steps have rows = seqs) must not make drafts look free: at 16
    sequences and 0.3 acceptance a draft row, priced as a prefill row, costs more than it returns; at batch 1,
    where a step's fixed cost dominates, the same drafts pay."""
    collinear = CostCoefficients(c0=10.0, c_row=0.05, c_prefill=0.9, c_seq=2.3, c_ctx=0.0)
    assert choose_num_drafts([candidate(0.3)] * 16, collinear, 0, 0, num_base_tokens=16) == [0] * 16
    assert choose_num_drafts([candidate(0.3)], collinear, 0, 0, num_base_tokens=1)[0] > 0
    # Teeth: with the fit's own c_row (no prefill rows seen, so no floor) the 16 sequences draft.
    unfloored = CostCoefficients(c0=10.0, c_row=0.05, c_prefill=0.0, c_seq=2.3, c_ctx=0.0)
    assert sum(choose_num_drafts([candidate(0.3)] * 16, unfloored, 0, 0, num_base_tokens=16)) > 0


def test_choice_is_the_best_over_all_k_vectors():
    """Brute force over every k vector of two sequences: the greedy prefix scan finds the maximum."""
    cost = CostCoefficients(c0=10.0, c_row=1.5, c_prefill=1.0, c_seq=0.5, c_ctx=0.1)
    cands = [Candidate(4, 300, (0.9, 0.8, 0.5, 0.3), (0.9, 0.7, 0.5, 0.2)), Candidate(3, 50, (1.0,) * 3, (0.6,) * 3)]

    def goodput(ks):
        tokens = 2 + sum(expected_accepted(c, k) for c, k in zip(cands, ks))
        rows = sum(1 + sum(c.delivery[:k]) for c, k in zip(cands, ks))
        attended = sum((1 + sum(c.delivery[:k])) * c.num_context_tokens for c, k in zip(cands, ks))
        return tokens / cost.step_ms(rows, 0, 2, attended)

    best = max(((a, b) for a in range(5) for b in range(4)), key=goodput)
    assert goodput(choose_num_drafts(cands, cost, 0, 0, 2)) == pytest.approx(goodput(best))


def test_acceptance_estimate_by_position():
    estimate = AcceptanceEstimate(decay=1.0)
    for _ in range(10):
        estimate.observe(num_requested=3, num_drafts=3, num_accepted=1)  # first accepted, second rejected
    assert estimate.acceptance(0, prior=0.5, weight=0.0) == 1.0
    assert estimate.acceptance(1, prior=0.5, weight=0.0) == 0.0
    assert estimate.acceptance(2, prior=0.5, weight=0.0) == 0.5  # never checked: the prior
    estimate.observe(num_requested=4, num_drafts=2, num_accepted=2)  # the proposer found only two
    assert [estimate.delivery(m, prior=1.0, weight=0.0) for m in range(4)] == [1.0, 1.0, 10 / 11, 0.0]


def test_cost_model_learns_a_linear_step_time():
    model = StepCostModel(decay=1.0)
    assert model.coefficients() is None
    shapes = [
        (1, 0, 1, 100),
        (6, 0, 1, 600),
        (16, 0, 8, 4000),
        (40, 300, 9, 90000),
        (3, 0, 2, 50),
        (64, 0, 16, 20000),
        (1, 500, 2, 130000),
        (8, 100, 3, 9000),
    ]
    for rows, prefill_rows, seqs, attended in shapes:
        model.observe(
            rows, prefill_rows, seqs, attended, 10 + 2 * rows + 0.25 * prefill_rows + 0.5 * seqs + 3 * attended / 1024
        )
    c = model.coefficients()
    assert (c.c0, c.c_row, c.c_prefill, c.c_seq, c.c_ctx) == pytest.approx((10, 2, 0.25, 0.5, 3), rel=1e-2)
    assert model.predict_ms(10, 0, 2, 2048) == pytest.approx(10 + 20 + 1 + 6, rel=1e-2)


def test_cost_model_stays_sane_after_a_long_steady_stretch():
    """Hundreds of identical one-row steps, then prefills: the one-row prediction stays right and no
    marginal cost goes negative (recursive least squares with forgetting overshot here by 3x)."""
    model = StepCostModel()
    for step in range(300):
        model.observe(1 + step % 2 * 5, 0, 1, (1 + step % 2 * 5) * 900, 50.0 + step % 2 * 2.0)
    for prefill_rows in (900, 400, 1200):
        model.observe(0, prefill_rows, 1, 0, 40.0 + 1.6 * prefill_rows)
        assert model.predict_ms(1, 0, 1, 900) == pytest.approx(50.0, rel=0.1)
        assert model.predict_ms(6, 0, 1, 5400) == pytest.approx(52.0, rel=0.1)
    c = model.coefficients()
    assert min(c.c_row, c.c_prefill, c.c_seq, c.c_ctx) >= 0 and c.c_prefill == pytest.approx(1.6, rel=0.2)


# Steps a SmolLM2 worker with an EAGLE-3 head measured after it started (AMD EPYC, q4_1): (decode rows,
# prefill rows, sequences, attended), ms. Two short requests, then a constrained one whose prefill took 1.4 s
# (its grammar compiled beside it) where a similar one took 0.6 s.
MEASURED_STEPS = [
    ((0, 357, 1, 0), 614.29),
    ((2, 0, 1, 714), 14.28),
    ((1, 0, 1, 363), 12.17),
    ((3, 0, 1, 1077), 24.63),
    ((1, 0, 1, 364), 12.48),
    ((1, 0, 1, 361), 9.03),
    ((1, 0, 1, 362), 8.06),
    ((1, 0, 1, 363), 8.65),
    ((0, 421, 1, 0), 807.33),
    ((1, 0, 1, 437), 10.23),
    ((1, 0, 1, 438), 10.29),
    ((1, 0, 1, 439), 10.71),
    ((1, 0, 1, 440), 10.63),
    ((1, 0, 1, 441), 9.48),
    ((1, 0, 1, 442), 10.03),
    ((1, 0, 1, 443), 10.22),
    ((0, 363, 1, 0), 1421.4),
]


def test_one_slow_prefill_does_not_make_draft_rows_free():
    """The fit is of relative errors: after the measured steps above, a step of 1 + 5 drafts still costs
    clearly more than a plain decode (with absolute errors the 1.4 s prefill set the intercept, the row
    coefficient went to 0, and 6 rows were predicted at exactly the cost of 1), and the prefills are priced."""
    model = StepCostModel()
    for features, step_ms in MEASURED_STEPS:
        model.observe(*features, step_ms)
    one, six = model.predict_ms(1, 0, 1, 420), model.predict_ms(6, 0, 1, 6 * 420)
    assert 8 < one < 12 and six > one + 5 * 1.0
    assert 600 < model.predict_ms(0, 400, 1, 0) < 1200


@pytest.mark.parametrize("k, policy_name", [(0, "goodput"), (K, "fixed")])
def test_a_policy_that_prices_no_drafts_fits_no_cost_model(k, policy_name):
    """Without drafts to price (no proposer, or the fixed policy) the step-cost model is neither fitted nor asked
    for a prediction: that was a solve of the normal equations per step for nothing."""
    policy = SpeculationPolicy(k, None, policy_name)
    for rows in (1, 3, 6, 2, 5, 1, 4, 6):
        assert policy.observe_step(StepShape(rows, 0, 1, rows * 100), 10.0 + rows) is None
    assert policy.cost_model.num_observations == 0
    speculating = SpeculationPolicy(K, None, "goodput")
    predictions = [speculating.observe_step(StepShape(rows, 0, 1, rows * 100), 10.0 + rows) for rows in range(1, 9)]
    assert predictions[-1] == pytest.approx(18.0, rel=0.05) and speculating.cost_model.num_observations == 8


def fitted_policy(cost: CostCoefficients, probe_interval: int = 4, max_draft_tree_width: int = 1) -> SpeculationPolicy:
    policy = SpeculationPolicy(
        K, None, "goodput", probe_interval=probe_interval, max_draft_tree_width=max_draft_tree_width
    )
    for rows in (1, 3, 6, 2, 5, 1, 4, 6):
        policy.observe_step(StepShape(rows, 0, 1, rows * 100), cost.step_ms(rows, 0, 1, rows * 100))
    return policy


def test_a_sequence_at_zero_is_probed_again():
    policy = fitted_policy(DEAR_ROWS)
    request = Request("r", [1, 2, 3], max_tokens=100)
    for _ in range(20):
        policy.observe_sequence(request, K, K, 0)  # nothing accepted
    ks = [policy.plan_step([request], StepShape(), 1, 1000).ks["r"] for _ in range(10)]
    assert ks == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]  # 4 steps at 0 at least, then the next multiple of 4
    for _ in range(10):  # the text turned repetitive: every draft accepted
        policy.observe_sequence(request, 1, 1, 1)
        policy.observe_sequence(request, K, K, K)
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] > 0


def test_probes_come_together_and_back_off_while_they_find_nothing():
    """Probes fall on steps numbered a multiple of the interval (of PROBE_ALIGNMENT once it is longer), so a
    sequence that stopped drafting later probes with the first (a head runs once for both); each probe that
    gets nothing accepted doubles the interval (4, 8, 16, ..), and one that gets a draft accepted sets it back."""
    policy = fitted_policy(DEAR_ROWS)  # probe interval 4
    a, b = Request("a", [1, 2, 3], max_tokens=500), Request("b", [1, 2, 3], max_tokens=500)
    for _ in range(20):
        for request in (a, b):
            policy.observe_sequence(request, K, K, 0)  # nothing accepted
    probes = {"a": [], "b": []}
    for step_number in range(1, 121):
        decodes = [a] if step_number < 3 else [a, b]  # b decodes from step 3 on
        plan = policy.plan_step(decodes, StepShape(), 2, 1000)
        for request in decodes:
            if plan.ks[request.request_id]:
                probes[request.request_id].append(step_number)
                policy.observe_sequence(request, 1, 1, 1 if step_number > 60 else 0)  # found nothing, until 60
    # Found nothing at 8, 24, 48 (intervals 8, 16, 32: at least that many steps at 0, then a multiple of 8);
    # found drafts at 88: every 8 steps again (at least 4 steps at 0, then a multiple of 4).
    assert probes["a"][:6] == probes["b"][:6] == [8, 24, 48, 88, 96, 104]
    assert a.acceptance.probe_interval == 4


def test_the_tokens_a_constraint_forces_are_allowed_whatever_the_proposer_estimates():
    """A request whose proposer's drafts are never accepted gets k = 0, except for the tokens its constraint
    forces next (the worker's count, capped at the request's k): k for those only, marked forced-only so the
    worker asks no proposer. Steps that drafted forced tokens leave the proposer's estimates as they were."""
    policy = fitted_policy(DEAR_ROWS, probe_interval=100)
    request = Request("r", [1, 2, 3], max_tokens=100, num_speculative_tokens=3)
    for _ in range(20):
        policy.observe_sequence(request, K, K, 0, "ngram")  # nothing accepted
    plan = policy.plan_step([request], StepShape(), 1, 1000)
    assert plan.ks["r"] == 0 and not plan.forced_only
    request.num_forced_tokens_next = 5
    plan = policy.plan_step([request], StepShape(), 1, 1000)
    assert plan.ks["r"] == 3 and plan.forced_only == {"r"}  # capped at the request's k
    before = (list(request.acceptance.num_accepted), request.last_proposer)
    for _ in range(10):
        policy.observe_sequence(request, 3, 3, 3, FORCED_PROPOSER)
    assert (list(request.acceptance.num_accepted), request.last_proposer) == before
    request.num_forced_tokens_next = 0
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == 0


# Draft trees. The first guess is often wrong (a chain's first draft: 0.4), but a sibling often right: the
# tree's node ranked 2 is accepted 0.35 of the time, where the chain's second draft is 0.4 x 0.8 = 0.32.
UNSURE_CHAIN = (0.4, 0.8, 0.8, 0.8, 0.8)
UNSURE_TREE = (0.4, 0.35, 0.3, 0.28, 0.25)


def tree_candidate(chain: tuple[float, ...], tree: tuple[float, ...]) -> Candidate:
    return Candidate(K, 100, (1.0,) * K, chain, (1.0,) * K, tree)


def test_a_tree_when_rows_are_cheap_and_the_first_guess_is_often_wrong():
    ks, trees = choose_drafts([tree_candidate(UNSURE_CHAIN, UNSURE_TREE)], CHEAP_ROWS, 0, 0, 1)
    assert ks == [K] and trees == [True]


def test_no_drafts_where_nodes_cost_more_than_they_return():
    assert choose_drafts([tree_candidate(UNSURE_CHAIN, UNSURE_TREE)], DEAR_ROWS, 0, 0, 1) == ([0], [False])


def test_a_chain_where_a_tree_s_extra_nodes_return_less_than_the_chain_s_drafts():
    """A sure chain (0.9 per draft) and a tree whose proposer ranks poor siblings second: the chain's drafts are
    worth more than the tree's nodes at every budget, so a chain of the full k."""
    ks, trees = choose_drafts([tree_candidate((0.9,) * K, (0.9, 0.3, 0.3, 0.3, 0.3))], CHEAP_ROWS, 0, 0, 1)
    assert ks == [K] and trees == [False]
    mid = CostCoefficients(c0=10.0, c_row=3.0, c_prefill=1.0, c_seq=0.0, c_ctx=0.0)
    ks, trees = choose_drafts([tree_candidate((0.9, 0.2, 0.2, 0.2, 0.2), (0.9, 0.3, 0.3, 0.3, 0.3))], mid, 0, 0, 1)
    assert ks == [1] and trees == [False]  # only the first draft pays; a tree of one node is that chain


def test_tree_values_per_rank_are_learnt_from_the_accepted_ranks():
    estimate = TreeAcceptance(decay=1.0)
    estimate.observe(4, 4, [1, 3])
    estimate.observe(4, 2, [2])
    estimate.observe(0, 0, [])  # no budget: nothing learnt
    assert estimate.num_requested == [2, 2, 2, 2] and estimate.num_delivered == [2, 2, 1, 1]
    assert estimate.value(0, 0.0, weight=0) == 0.5 and estimate.value(2, 0.0, weight=0) == 1.0
    assert estimate.value(3, 0.0, weight=0) == 0.0 and estimate.delivery(2, 0.0, weight=0) == 0.5
    assert estimate.value(7, 0.25) == 0.25  # a rank never allowed: the prior


def observe_unsure(policy: SpeculationPolicy, request: Request, num_steps: int = 20) -> None:
    """Chain steps whose first draft is accepted 2 times in 5 (the second never), and tree steps that hold the
    right token 4 times in 5, twice as the sibling ranked 2 and its child."""
    request.num_computed_tokens = 100  # the context the fitted steps' rows attended to
    for step_number in range(num_steps):
        policy.observe_sequence(request, K, K, 1 if step_number % 5 < 2 else 0)
        policy.observe_tree(request, K, K, [1, 4] if step_number % 5 < 2 else [2, 3] if step_number % 5 < 4 else [])


def test_the_policy_sends_a_tree_s_width_where_rows_are_cheap_and_a_chain_or_nothing_where_they_are_dear():
    cheap = fitted_policy(CHEAP_ROWS, probe_interval=100, max_draft_tree_width=3)
    request = Request("r", [1, 2, 3], max_tokens=100)
    observe_unsure(cheap, request)
    plan = cheap.plan_step([request], StepShape(), 1, 1000)
    assert plan.ks["r"] > 1 and plan.tree_widths == {"r": 3}
    dear = fitted_policy(DEAR_ROWS, probe_interval=100, max_draft_tree_width=3)
    request = Request("r", [1, 2, 3], max_tokens=100)
    observe_unsure(dear, request)
    plan = dear.plan_step([request], StepShape(), 1, 1000)
    assert plan.ks["r"] <= 1 and plan.tree_widths == {"r": 1}
    constrained = Request("c", [1, 2, 3], max_tokens=100, grammar="start: /[a-z]+/")
    observe_unsure(cheap, constrained)
    plan = cheap.plan_step([constrained], StepShape(), 1, 1000)
    assert plan.ks["c"] > 1 and plan.tree_widths == {"c": 1}  # masks follow one prefix per position
    chains_only = fitted_policy(CHEAP_ROWS, probe_interval=100)
    assert chains_only.plan_step([request], StepShape(), 1, 1000).tree_widths == {}  # the worker's own width


def test_a_sequence_drafting_chains_tries_a_tree_again():
    """Trees that lost (their siblings never accepted) give chains; every TREE_PROBE_INTERVAL chain steps the
    sequence drafts one tree, whose result updates its tree values."""
    policy = fitted_policy(CHEAP_ROWS, probe_interval=100, max_draft_tree_width=2)
    request = Request("r", [1, 2, 3], max_tokens=1000)
    for _ in range(20):
        policy.observe_sequence(request, K, K, K)
        policy.observe_tree(request, K, K, [1])
    widths = [
        policy.plan_step([request], StepShape(), 1, 1000).tree_widths["r"] for _ in range(2 * TREE_PROBE_INTERVAL + 2)
    ]
    assert widths == ([1] * TREE_PROBE_INTERVAL + [2]) * 2


class TimedWorker(FakeWorker):
    """The simulated worker, reporting a step time linear in its query rows (what the cost model fits)."""

    def __init__(self, block_size: int, ms_per_row: float, num_accepted):
        super().__init__(block_size, num_accepted)
        self.ms_per_row = ms_per_row

    def execute(self, step):
        result = super().execute(step)
        num_new = {r.request_id: r.num_new_tokens for r in step.new_requests}
        num_new.update({c.request_id: c.num_new_tokens for c in step.cached_requests})
        rows = sum(num_new.values()) + sum(o.num_draft_tokens for o in result.outputs)
        result.stats = StepStats(total_ms=10.0 + self.ms_per_row * rows)
        return result


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_scheduler_sends_the_policy_k_and_reserves_exactly_that(scheduling):
    """Every step's k per sequence is the lookahead reserved for it; the table covers it; outputs exact."""
    config = SchedulerConfig(num_kv_blocks=200, block_size=4, num_speculative_tokens=K, scheduling=scheduling)
    scheduler = Scheduler(config)
    # r0 accepts everything, r1 nothing: the goodput policy soon gives r1 k = 0 and r0 the full k.
    worker = TimedWorker(4, ms_per_row=4.0, num_accepted=lambda step_id, rid: K if rid == "r0" else 0)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3 + i], max_tokens=60))
    ks_by_id: dict[str, list[int]] = {"r0": [], "r1": []}

    def on_step(step):
        plan = scheduler._in_flight[-1]
        for c in step.cached_requests:
            assert c.num_speculative_tokens == plan.scheduled[c.request_id].num_lookahead_slots
            ks_by_id[c.request_id].append(c.num_speculative_tokens)
        for n in step.new_requests:
            assert n.num_speculative_tokens == plan.scheduled[n.request_id].num_lookahead_slots == 0

    outputs = run(scheduler, worker, on_step=on_step)
    for i in range(2):
        assert streamed(outputs[f"r{i}"]) == reference_output([1, 2, 3 + i], 60)
    assert ks_by_id["r1"][-5:].count(0) >= 3 and K in ks_by_id["r0"][-5:]
    stats = scheduler.stats
    assert stats.num_predicted_steps > 0 and stats.step_time_abs_error_s < 0.1 * stats.measured_step_s
    assert sum(stats.num_sequence_steps_by_k) == sum(len(v) for v in ks_by_id.values())
    assert scheduler.num_free_blocks == config.num_kv_blocks


def test_acceptance_is_learnt_per_proposer_and_k_follows_the_one_drafting():
    """Several proposers on the worker: the policy keeps an estimate per proposer, and a sequence's candidate
    uses the estimate of the proposer that drafted its last drafts (a poor one does not drag a good one down)."""
    policy = SpeculationPolicy(K, None)
    request = Request("r", [1, 2, 3], max_tokens=50)
    for _ in range(20):
        policy.observe_sequence(request, K, K, K, proposer="suffix")  # suffix: always all accepted
        policy.observe_sequence(request, K, K, 0, proposer="eagle3")  # eagle3: never
    assert request.last_proposer == "eagle3"
    low = policy._candidate(request, K, None).acceptance
    policy.observe_sequence(request, K, K, K, proposer="suffix")
    high = policy._candidate(request, K, None).acceptance
    assert low[0] < 0.2 and min(high) > 0.8  # later positions of eagle3 were never tried: the prior
    assert set(policy.worker_acceptance_by_proposer) == {"suffix", "eagle3"}


def test_a_request_moved_from_another_worker_keeps_its_per_proposer_estimates():
    """Each worker's engine has its own policy: a request that drafted with "suffix" elsewhere reaches one that
    has not seen "suffix" yet, and gets a candidate from its own estimates (a KeyError here failed the engine
    loop, and with it every request on the worker)."""
    request = Request("r", [1, 2, 3], max_tokens=50)
    for _ in range(10):
        SpeculationPolicy(K, None).observe_sequence(request, K, K, K, proposer="suffix")
    fresh = SpeculationPolicy(K, None)
    candidate = fresh._candidate(request, K, None)
    assert min(candidate.acceptance) > 0.7 and len(candidate.delivery) == K


def test_draft_depth_is_learnt_per_proposer_too():
    """A head's chains stop after one draft, a suffix's copies run to K: once the suffix drafted last, the
    candidate expects deep drafts (with one delivery estimate for both, the head's short chains would keep the
    suffix to about one draft); whether any draft comes stays the request's, over every step."""
    policy = SpeculationPolicy(K, None)
    request = Request("r", [1, 2, 3], max_tokens=50)
    for _ in range(20):
        policy.observe_sequence(request, K, K, K, proposer="suffix")
        policy.observe_sequence(request, K, 1, 1, proposer="eagle3")
        policy.observe_sequence(request, K, 0, 0)  # no proposer found a draft
    policy.observe_sequence(request, K, K, K, proposer="suffix")
    deep = policy._candidate(request, K, None).delivery
    policy.observe_sequence(request, K, 1, 1, proposer="eagle3")
    shallow = policy._candidate(request, K, None).delivery
    assert 0.6 < deep[0] < 0.8 and 0.6 < shallow[0] < 0.8  # about 2 of 3 steps drafted
    assert min(deep[1:]) > 0.9 * deep[0] and max(shallow[1:]) < 0.2
    # Without a proposer name (a single proposer), the one estimate of every step is used, as before.
    single = Request("s", [1, 2, 3], max_tokens=50)
    policy.observe_sequence(single, K, K, K)
    assert single.acceptance_by_proposer == {} and single.last_proposer == ""


def test_previewed_drafts_get_k_by_the_acceptance_of_their_match_length():
    """The worker previews each sequence's next copied draft: the policy learns acceptance per match class
    across sequences, and plans on the class of this step's match (a long match drafts, a short one on the same
    sequence does not). A fresh preview (no step in flight) is the step's very draft: no more drafts than it
    holds, none and no probe where it holds none. A stale one (async: a step in flight) describes the step
    before: how many drafts come is learnt per class too."""
    policy = fitted_policy(CostCoefficients(c0=10.0, c_row=1.5, c_prefill=1.0, c_seq=0.0, c_ctx=0.0), probe_interval=1)
    trainer = Request("t", [1, 2, 3], max_tokens=500)
    for length, accepted in ((16, K), (1, 0)):  # long matches: every draft accepted; 1-token matches: none
        for _ in range(30):
            trainer.next_draft = DraftPreview(K, length)
            plan = policy.plan_step([trainer], StepShape(), 1, 1000)
            policy.observe_sequence(trainer, K, K, accepted, "suffix", plan.matches["t"])
    assert set(policy.acceptance_by_match) == {(1, True), (16, True)}
    request = Request("r", [1, 2, 3], max_tokens=500)
    request.next_draft = DraftPreview(K, 20)  # class 16
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == K
    request.next_draft = DraftPreview(2, 17)
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == 2  # as many as the preview holds
    request.next_draft = DraftPreview(K, 1)
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == 0
    request.next_draft = DraftPreview(0, 0)
    assert [policy.plan_step([request], StepShape(), 1, 1000).ks["r"] for _ in range(20)] == [0] * 20  # no probe
    # Stale: "no match" one step back, yet the step in flight's successor found long drafts, all accepted.
    request.num_assumed_tokens = 1
    for _ in range(30):
        plan = policy.plan_step([request], StepShape(), 1, 1000)
        assert plan.matches["r"] == (0, False)
        policy.observe_sequence(request, K, K, K, "suffix", (0, False))
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == K
    request.num_assumed_tokens = 0
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == 0  # fresh: no draft comes
    # Without a preview (a proposer that runs a model): the sequence's own estimate, which saw only acceptance.
    request.next_draft = None
    assert policy.plan_step([request], StepShape(), 1, 1000).ks["r"] == K


class PreviewingWorker(TimedWorker):
    """A timed worker whose outputs preview the next draft: a long match for r0, no match for r1."""

    def execute(self, step):
        result = super().execute(step)
        for out in result.outputs:
            if out.token_ids:
                out.next_draft = DraftPreview(K, 16) if out.request_id == "r0" else DraftPreview(0, 0)
        return result


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_the_scheduler_feeds_the_policy_the_preview_each_step_was_planned_on(scheduling):
    """Each step's result is learnt under the match class of the preview its k was planned on, fresh in sync
    scheduling, stale (a step in flight) in async; a fresh preview with no draft gets k = 0 every step."""
    config = SchedulerConfig(num_kv_blocks=200, block_size=4, num_speculative_tokens=K, scheduling=scheduling)
    scheduler = Scheduler(config)
    worker = PreviewingWorker(4, ms_per_row=1.0, num_accepted=lambda step_id, rid: K)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3 + i], max_tokens=60))
    ks_by_id: dict[str, list[int]] = {"r0": [], "r1": []}
    outputs = run(
        scheduler,
        worker,
        on_step=lambda step: [ks_by_id[c.request_id].append(c.num_speculative_tokens) for c in step.cached_requests],
    )
    for i in range(2):
        assert streamed(outputs[f"r{i}"]) == reference_output([1, 2, 3 + i], 60)
    fresh = scheduling == "sync"
    learnt = scheduler.policy.acceptance_by_match
    assert (16, fresh) in learnt and (16, not fresh) not in learnt
    assert learnt[(16, fresh)].acceptance(0, 0.0, weight=0.0) == 1.0  # r0's drafts, all accepted
    if fresh:
        assert set(ks_by_id["r1"][8:]) == {0} and K in ks_by_id["r0"][8:]
    assert scheduler.num_free_blocks == config.num_kv_blocks
