"""Goodput-driven draft length: a step-cost model, acceptance by draft position, and the choice of k.

The objective, per step. Sequences i = 1..B decode in the step; the policy picks
each one's draft length k_i in [0, cap_i] to maximise the expected tokens emitted
per second of the whole step:

    G(k) = (N + sum_i E_i(k_i)) / T(k)

    E_i(k) = sum_{j=1..k} q_i,j * prod_{m=1..j} a_i,m    (expected accepted drafts)
    T(k)   = c0 + c_row * rows + c_prefill * prefill_rows + c_seq * seqs + c_ctx * attended / 1024

where N is the tokens the step emits anyway (one per decode), a_i,m is the
probability that draft m of sequence i is accepted given drafts 1..m-1 were,
q_i,j the probability that its proposer drafts a j-th token at all (n-gram
finds no match, suffix stops where its confidence ends), rows = the decodes'
expected query rows sum_i (1 + sum_{j<=k_i} q_i,j), prefill_rows = the prefill chunks' tokens (their own
coefficient: a prefill row is a row of a large batched matmul, while a few
decode rows cost about as much as one on a CPU, so one slope would misjudge
drafts) and attended = sum over rows of the context that row attends to (long
contexts make a draft row dearer).

Increment (i, j) adds q_i,j prod a tokens for q_i,j extra rows, so its gain per
ms is prod_{m<=j} a_i,m / row cost, non-increasing in j; T is linear in the
rows, so the best k is a prefix of all draft increments sorted by gain per cost: `choose_num_drafts`
sorts them and takes the prefix with the highest G. O(B*K log(B*K)) in Python;
for B = 64, K = 5 about 0.1 ms.

The cost coefficients come from `StepCostModel`: least squares over the
worker's recent measured step times (`StepStats.total_ms`, exponentially
decayed), so the model follows the operating point (on a CPU, extra rows are almost free up to ~8
query rows and linear beyond; a local linear fit over recent steps tracks that). The fit is of
relative errors (each step weighs 1 / step_ms^2): a prefill step takes a hundred decode steps' time, and
with absolute errors one slow prefill decides the intercept and with it a decode row's cost (measured: a
1.4 s prefill among 17 steps, while the worker compiled a grammar, fitted a draft row at 0 ms, and the policy
then drafted an EAGLE-3 head at 7% acceptance).
Until it has seen `MIN_OBSERVATIONS` steps it reports no coefficients and the
policy drafts the full k (optimism gives the fit the varied row counts it needs).

Pricing a draft row: the fit's c_row + c_ctx * context / 1024, and never less than c_prefill. A draft row
does a prefill row's arithmetic in a smaller matmul, so it costs at least as much once the step is bound by
arithmetic; where the weights' reads bound it (a GPU, a CPU at batch 1), c_prefill is small beside a step
and the floor changes nothing. The floor is there because the fit cannot always tell the coefficients
apart: in plain steps rows = seqs, and attended context grows with both, so with a batch that stays at
one size the fit may put a row's cost on c_seq or c_ctx. Measured (AMD EPYC family 25 model 17, 2 threads,
SmolLM2 q4_1, 16 sequences): c_row = 0.05 ms and c_seq = 2.3 ms fitted, while an extra row cost 0.8-1.2 ms
and a prefill row 0.9; the policy drafted at 0.47 acceptance and served 0.92x plain decoding's tokens/s.

Acceptance: `AcceptanceEstimate` keeps exponentially decayed counts of drafts
tried and accepted per position, per sequence (recent history, decay 0.8 per
speculating step) and per worker (the prior of a new sequence, decay 0.99).

Draft trees (a worker with --draft-tree-width W > 1). A sequence may instead
draft a tree of at most k nodes, grown best-first (worker_service/speculation/proposers/
trees.py): the tree of budget j is the j nodes the proposer rates likeliest,
so budget j adds the j-th ranked node, whose value is the probability that
it lies on the accepted path. `TreeAcceptance` learns that value per rank
from the ranks of the accepted nodes the worker reports
(SequenceOutput.accepted_draft_ranks), and how often a tree has a j-th node
at all. A tree's increment j then adds q_j v_j tokens for q_j rows: nodes
are priced as rows, whatever their depth, and its expected accepted length
sum_j q_j v_j is that of the tree (each accepted node is one accepted
token). Before a worker has seen trees, a tree's values are the chain's
(the likeliest chain is a tree of that budget, and a calibrated proposer's
best j nodes are worth at least as much).

Chain or tree, per sequence (`choose_drafts`): each of a sequence's two
curves is worth its surplus at a token rate r, max_k sum_{j<=k} (gain_j -
r cost_j); the sequence takes the curve worth more (a tree on a tie), first at
the rate of a plain step, then at the goodput that choice reaches, and k
is chosen over the taken curves as above. A tree of one node is the chain of
one draft. So where extra nodes cost more than they return the sequence
gets a chain or k = 0, and where rows are cheap and the first guess is often
wrong (the second ranked node, a sibling, is worth more than the chain's
second draft) a tree.
"""

from dataclasses import dataclass, field

MIN_OBSERVATIONS = 4
CONTEXT_SCALE = 1024  # attended is counted in units of 1,024 query-row x context tokens
SEQUENCE_DECAY = 0.8  # a sequence's recent history: ~5 speculating steps
WORKER_DECAY = 0.99  # the worker-wide prior: ~100 sequence-steps
PRIOR_WEIGHT = 2.0  # pseudo-counts of the worker-wide prior in a sequence's estimate
INITIAL_ACCEPTANCE = 0.5  # before the worker has seen any draft
COST_DECAY = 0.99  # the cost model's memory: ~100 steps
MIN_STEP_MS = 0.01  # the cost model's weights: 1 / step_ms^2, from at least this


@dataclass
class AcceptanceEstimate:
    """Decayed counts, per draft position, of drafts requested / delivered by the proposer / checked / accepted."""

    decay: float = SEQUENCE_DECAY
    num_requested: list[float] = field(default_factory=list)  # [m]: steps whose k allowed a draft at m+1
    num_delivered: list[float] = field(default_factory=list)  # [m]: ... in which the proposer drafted one
    num_tried: list[float] = field(default_factory=list)  # [m]: drafts at position m+1 that were checked
    num_accepted: list[float] = field(default_factory=list)  # [m]: ... and accepted
    num_steps_without_drafts: int = 0  # consecutive steps the policy left the sequence at k = 0 (probing)
    probe_interval: int = 0  # steps between its probes (0: the policy's base); doubles while they fail
    is_probing: bool = False  # its last k was a probe's

    def observe(self, num_requested: int, num_drafts: int, num_accepted: int) -> None:
        """One step that asked for `num_requested` drafts: `num_drafts` came, the first `num_accepted` held.

        Draft m was checked when every earlier one was accepted: m <= num_accepted + 1.
        """
        if num_requested <= 0:
            return
        d = self.decay
        _grow(num_requested, self.num_requested, self.num_delivered, self.num_tried, self.num_accepted)
        for m in range(len(self.num_requested)):
            self.num_requested[m] = d * self.num_requested[m] + (m < num_requested)
            self.num_delivered[m] = d * self.num_delivered[m] + (m < num_drafts)
            self.num_tried[m] = d * self.num_tried[m] + (m < min(num_drafts, num_accepted + 1))
            self.num_accepted[m] = d * self.num_accepted[m] + (m < num_accepted)

    def acceptance(self, position: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """P(draft at `position` (0-based) accepted | earlier ones were), shrunk towards `prior`."""
        if position >= len(self.num_tried) or self.num_tried[position] + weight <= 0:
            return prior
        return (self.num_accepted[position] + weight * prior) / (self.num_tried[position] + weight)

    def delivery(self, position: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """P(the proposer drafts a token at `position` | k allowed it), shrunk towards `prior`: n-gram finds
        no match, suffix stops where its confidence ends, so a larger k costs only where drafts come."""
        if position >= len(self.num_requested) or self.num_requested[position] + weight <= 0:
            return prior
        return (self.num_delivered[position] + weight * prior) / (self.num_requested[position] + weight)


@dataclass
class TreeAcceptance:
    """Decayed counts, per node rank (the j-th node a best-first tree chose), of tree steps whose budget allowed
    it / whose tree had it / whose accepted path held it (module docstring: Draft trees)."""

    decay: float = SEQUENCE_DECAY
    num_requested: list[float] = field(default_factory=list)
    num_delivered: list[float] = field(default_factory=list)
    num_accepted: list[float] = field(default_factory=list)

    def observe(self, num_requested: int, num_nodes: int, accepted_ranks: list[int]) -> None:
        """One tree step with a budget of `num_requested` nodes: the tree had `num_nodes`, and its accepted path
        the nodes of these ranks (1-based)."""
        if num_requested <= 0:
            return
        d, accepted = self.decay, set(accepted_ranks)
        _grow(num_requested, self.num_requested, self.num_delivered, self.num_accepted)
        for m in range(len(self.num_requested)):
            self.num_requested[m] = d * self.num_requested[m] + (m < num_requested)
            self.num_delivered[m] = d * self.num_delivered[m] + (m < num_nodes)
            self.num_accepted[m] = d * self.num_accepted[m] + (m + 1 in accepted)

    def value(self, rank: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """P(the node of this rank (0-based) is accepted | the tree has it), shrunk towards `prior`."""
        if rank >= len(self.num_delivered):
            return prior
        return (self.num_accepted[rank] + weight * prior) / (self.num_delivered[rank] + weight)

    def delivery(self, rank: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """P(the tree has a node of this rank | the budget allowed it), shrunk towards `prior`."""
        if rank >= len(self.num_requested):
            return prior
        return (self.num_delivered[rank] + weight * prior) / (self.num_requested[rank] + weight)


def _grow(n: int, *counts: list[float]) -> None:
    """Extends each list of per-position counts with zeros to length n."""
    for c in counts:
        c += [0.0] * (n - len(c))


@dataclass(frozen=True)
class CostCoefficients:
    """Predicted step time in ms (module docstring: T)."""

    c0: float
    c_row: float  # per decode query row (1 + drafts per decoding sequence)
    c_prefill: float  # per prefill token
    c_seq: float
    c_ctx: float  # per CONTEXT_SCALE attended (row x context) tokens

    def step_ms(self, rows: float, prefill_rows: int, seqs: int, attended: float) -> float:
        return (
            self.c0
            + self.c_row * rows
            + self.c_prefill * prefill_rows
            + self.c_seq * seqs
            + self.c_ctx * attended / CONTEXT_SCALE
        )


class StepCostModel:
    """Least squares of the worker's step time on decode rows, prefill rows, sequences and attended context,
    over exponentially decayed recent steps, with the marginal costs kept >= 0.

    The decayed sums X'X and X'y are kept (O(25) per step); the coefficients are solved from them when asked
    (5 x 5 Gaussian elimination, a small ridge for directions the recent steps did not vary). A coefficient
    that comes out negative is fixed at 0 and the rest solved again (an active set), so the model predicts
    with the coefficients it fitted. Unlike recursive least squares with forgetting, a direction the data
    stops exciting (every step one row at batch 1) does not wind up and overshoot at the next prefill.
    """

    NUM_FEATURES = 5
    RIDGE = 1e-6  # relative to each feature's decayed sum of squares

    def __init__(self, decay: float = COST_DECAY) -> None:
        n = self.NUM_FEATURES
        self.decay = decay
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.num_observations = 0
        self._coefficients: CostCoefficients | None = None

    @staticmethod
    def _features(rows: float, prefill_rows: int, seqs: int, attended: float) -> list[float]:
        return [1.0, float(rows), float(prefill_rows), float(seqs), attended / CONTEXT_SCALE]

    def coefficients(self) -> CostCoefficients | None:
        """The fitted coefficients, or None before MIN_OBSERVATIONS steps."""
        if self.num_observations < MIN_OBSERVATIONS:
            return None
        if self._coefficients is None:
            self._coefficients = CostCoefficients(*self._solve())
        return self._coefficients

    def predict_ms(self, rows: float, prefill_rows: int, seqs: int, attended: float) -> float | None:
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients.step_ms(rows, prefill_rows, seqs, attended)

    def observe(self, rows: int, prefill_rows: int, seqs: int, attended: int, step_ms: float) -> None:
        """Adds one measured step; older steps weigh `decay` less per step, and each weighs 1 / step_ms^2
        (module docstring: relative errors)."""
        x, d = self._features(rows, prefill_rows, seqs, attended), self.decay
        w = 1.0 / max(step_ms, MIN_STEP_MS) ** 2
        for i, xi in enumerate(x):
            row = self.xtx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + w * xi * xj
            self.xty[i] = d * self.xty[i] + w * xi * step_ms
        self.num_observations += 1
        self._coefficients = None

    def _solve(self) -> list[float]:
        active = list(range(self.NUM_FEATURES))  # the intercept (0) is never fixed
        while True:
            a = []
            for i in active:  # the normal equations of the active features, each diagonal ridged
                row = [self.xtx[i][j] for j in active]
                row[len(a)] = row[len(a)] + (self.RIDGE * self.xtx[i][i] + 1e-12)
                a.append(row)
            theta = [0.0] * self.NUM_FEATURES
            for i, value in zip(active, _solve_linear(a, [self.xty[i] for i in active])):
                theta[i] = value
            negative = [i for i in active[1:] if theta[i] < 0]
            if not negative:
                return theta
            active.remove(min(negative, key=lambda i: theta[i]))


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; a is small and positive definite). Plain
    loops: the scheduler solves once a step while it speculates, and generators and lambdas doubled its time."""
    n = len(b)
    m = [row + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot, largest = col, abs(m[col][col])
        for r in range(col + 1, n):
            if abs(m[r][col]) > largest:
                pivot, largest = r, abs(m[r][col])
        m[col], m[pivot] = m[pivot], m[col]
        top = m[col]
        if top[col] == 0.0:
            continue
        for r in range(col + 1, n):
            row = m[r]
            factor = row[col] / top[col]
            for c in range(col, n + 1):
                row[c] -= factor * top[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        if row[r] != 0.0:
            total = 0
            for c in range(r + 1, n):
                total += row[c] * x[c]
            x[r] = (row[n] - total) / row[r]
    return x


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence the policy may let speculate."""

    cap: int  # most drafts allowed (server k, request's k, tokens left)
    num_context_tokens: int  # context the sequence's query rows attend to
    delivery: tuple[float, ...]  # q_1..q_cap: P(the proposer drafts a token at that position)
    acceptance: tuple[float, ...]  # a_1..a_cap: conditional acceptance by position
    # Where it may draft a tree instead (module docstring: Draft trees), per node rank: P(the tree has it) and
    # P(it is accepted | the tree has it). Empty: chains only.
    tree_delivery: tuple[float, ...] = ()
    tree_value: tuple[float, ...] = ()


def expected_accepted(candidate: Candidate, k: int) -> float:
    """E[accepted drafts | k allowed] = sum_{j<=k} q_j prod_{m<=j} a_m."""
    total, survive = 0.0, 1.0
    for q, a in zip(candidate.delivery[:k], candidate.acceptance[:k]):
        survive *= a
        total += q * survive
    return total


def choose_num_drafts(
    candidates: list[Candidate],
    cost: CostCoefficients,
    num_prefill_rows: int,
    num_prefill_seqs: int,
    num_base_tokens: float,
) -> list[int]:
    """The k per candidate maximising G(k) (module docstring) with chains; the step also runs prefill chunks.

    num_base_tokens: tokens the step emits with k = 0 for all (N).
    """
    return _select(
        [_chain_curve(c) for c in candidates], candidates, cost, num_prefill_rows, num_prefill_seqs, num_base_tokens
    )[0]


def choose_drafts(
    candidates: list[Candidate],
    cost: CostCoefficients,
    num_prefill_rows: int,
    num_prefill_seqs: int,
    num_base_tokens: float,
) -> tuple[list[int], list[bool]]:
    """The k per candidate, and whether it drafts a tree (module docstring: Chain or tree, per sequence)."""
    chains = [_chain_curve(c) for c in candidates]
    trees = [_tree_curve(c) for c in candidates]
    is_tree = [False] * len(candidates)
    if not any(trees):
        return choose_num_drafts(candidates, cost, num_prefill_rows, num_prefill_seqs, num_base_tokens), is_tree
    base_ms = _base_step_ms(candidates, cost, num_prefill_rows, num_prefill_seqs)
    rate = num_base_tokens / max(base_ms, 1e-9)
    for _ in range(2):  # at a plain step's rate, then at the goodput that choice reaches
        is_tree = [
            bool(tree) and _surplus(tree, rate, _row_ms(c, cost)) >= _surplus(chain, rate, _row_ms(c, cost))
            for c, chain, tree in zip(candidates, chains, trees)
        ]
        ks, rate = _select(
            [t if tree_taken else ch for ch, t, tree_taken in zip(chains, trees, is_tree)],
            candidates,
            cost,
            num_prefill_rows,
            num_prefill_seqs,
            num_base_tokens,
        )
    return ks, [tree_taken and k > 1 for tree_taken, k in zip(is_tree, ks)]


def _chain_curve(c: Candidate) -> list[tuple[float, float]]:
    """Per draft increment j: (accepted tokens it adds, P(a draft comes) = rows it adds)."""
    curve, survive = [], 1.0
    for q, a in zip(c.delivery[: c.cap], c.acceptance[: c.cap]):
        survive *= a
        if survive <= 0.0:
            break
        curve.append((q * survive, q))
    return curve


def _tree_curve(c: Candidate) -> list[tuple[float, float]]:
    """Per node increment j: (q_j v_j, q_j), the values kept non-increasing (a later rank is chosen as no
    likelier than an earlier one; a noisy estimate must not make a larger budget look better per row)."""
    curve, ceiling = [], 1.0
    for q, v in zip(c.tree_delivery[: c.cap], c.tree_value[: c.cap]):
        ceiling = min(ceiling, v)
        if ceiling <= 0.0:
            break
        curve.append((q * ceiling, q))
    return curve


def _row_ms(c: Candidate, cost: CostCoefficients) -> float:
    """What a draft row of this sequence costs (module docstring: Pricing a draft row): the fit's, and at least
    a prefill row's."""
    return max(cost.c_row + cost.c_ctx * c.num_context_tokens / CONTEXT_SCALE, cost.c_prefill)


def _surplus(curve: list[tuple[float, float]], rate: float, row_ms: float) -> float:
    """max_k sum_{j<=k} (gain_j - rate * cost_j): what the curve is worth at this token rate."""
    best = total = 0.0
    for gain, rows in curve:
        total += gain - rate * rows * row_ms
        best = max(best, total)
    return best


def _base_step_ms(
    candidates: list[Candidate], cost: CostCoefficients, num_prefill_rows: int, num_prefill_seqs: int
) -> float:
    attended = sum(c.num_context_tokens for c in candidates)
    return cost.step_ms(len(candidates), num_prefill_rows, num_prefill_seqs + len(candidates), attended)


def _select(
    curves: list[list[tuple[float, float]]],
    candidates: list[Candidate],
    cost: CostCoefficients,
    num_prefill_rows: int,
    num_prefill_seqs: int,
    num_base_tokens: float,
) -> tuple[list[int], float]:
    """The prefix of all increments, sorted by gain per ms, with the highest goodput; (k per curve, goodput)."""
    step_ms = _base_step_ms(candidates, cost, num_prefill_rows, num_prefill_seqs)
    increments = []  # (gain per ms, candidate index, gain, cost in ms)
    for i, (c, curve) in enumerate(zip(candidates, curves)):
        row_ms = _row_ms(c, cost)
        for gain, rows in curve:
            value = gain / rows if rows > 0 else 0.0  # per row it adds: a draft's acceptance, a node's value
            ratio = value / row_ms if row_ms > 0 else float("inf")
            increments.append((ratio, i, gain, rows * row_ms))
    increments.sort(key=lambda item: -item[0])  # stable: each sequence's positions stay in order
    tokens, best, best_len = num_base_tokens, num_base_tokens / max(step_ms, 1e-9), 0
    for n, (_, _, gain, row_ms) in enumerate(increments, start=1):
        tokens += gain
        step_ms += row_ms
        goodput = tokens / max(step_ms, 1e-9)
        if goodput > best:
            best, best_len = goodput, n
    ks = [0] * len(candidates)
    for _, i, _, _ in increments[:best_len]:
        ks[i] += 1
    return ks, best
