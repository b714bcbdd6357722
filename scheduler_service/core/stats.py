"""The scheduler's counters: what one worker's scheduler has done since start (GetServerInfo, Prometheus,
the stats line read them, summed over workers)."""

from dataclasses import dataclass, field, fields
from itertools import zip_longest


@dataclass
class SchedulerStats:
    """Counters since start, for GetServerInfo."""

    num_requests: int = 0
    num_steps: int = 0
    num_steps_speculation_disabled: int = 0  # steps auto-disabled by the running-queue size
    # [k]: decoding (request, step) pairs the policy gave k drafts. A tuple, like the one below.
    num_sequence_steps_by_k: tuple[int, ...] = ()
    num_drafts: int = 0  # (request, step) pairs with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: (request, step) pairs that accepted draft position i; a pair that accepted n drafts counts at
    # 0..n-1 (accepted drafts are a prefix), so the sum is num_accepted_tokens. A tuple: snapshots share it.
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # The same by the proposer that drafted (several proposers at once): proposer -> count / per-position
    # counts. Replaced, never changed in place, as the tuples are.
    num_draft_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens_per_pos_by_proposer: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Draft trees: [d] / [n]: (request, step) pairs whose drafts formed a tree d deep / of n nodes.
    num_tree_steps_by_depth: tuple[int, ...] = ()
    num_tree_steps_by_nodes: tuple[int, ...] = ()
    num_prompt_tokens: int = 0  # prompts of requests that emitted their first token
    num_emitted_tokens: int = 0  # tokens delivered to clients
    num_sequence_steps: int = 0  # (request, step) pairs that delivered tokens
    num_preemptions: int = 0
    # The prefix cache, in tokens: tokens of requests as they left the waiting queue, and of those the ones
    # found cached (vLLM's prefix_cache_queries / _hits); cached blocks evicted for new use.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_prefix_cache_evictions: int = 0
    # The cost model's step-time prediction (made before the step's time was known) against the measured
    # time, over the steps it predicted.
    num_predicted_steps: int = 0
    predicted_step_s: float = 0.0
    measured_step_s: float = 0.0
    step_time_abs_error_s: float = 0.0
    # Every step's time as the worker measured it, and its proposing part (StepStats.propose_ms).
    worker_step_s: float = 0.0
    propose_s: float = 0.0

    @classmethod
    def total(cls, stats: list["SchedulerStats"]) -> "SchedulerStats":
        """The sum of several workers' counters (the tuples of counts element-wise)."""

        def add(values):
            if isinstance(values[0], tuple):
                return tuple(map(sum, zip_longest(*values, fillvalue=0)))
            if isinstance(values[0], dict):
                keys = sorted({key for value in values for key in value})
                return {key: add([value[key] for value in values if key in value]) for key in keys}
            return sum(values)

        if not stats:
            return cls()
        return cls(**{f.name: add([getattr(s, f.name) for s in stats]) for f in fields(cls)})

    def count_ks(self, ks: list[int]) -> None:
        """Adds one step's decoding (request, step) pairs, by the k the policy gave each."""
        by_k = list(self.num_sequence_steps_by_k)
        by_k += [0] * (max(ks, default=-1) + 1 - len(by_k))
        for k in ks:
            by_k[k] += 1
        self.num_sequence_steps_by_k = tuple(by_k)

    def count_prediction(self, predicted_ms: float, measured_ms: float) -> None:
        self.num_predicted_steps += 1
        self.predicted_step_s += predicted_ms / 1e3
        self.measured_step_s += measured_ms / 1e3
        self.step_time_abs_error_s += abs(predicted_ms - measured_ms) / 1e3

    def count_speculation(
        self, num_draft_tokens: int, num_accepted_tokens: int, proposer: str = "", draft_tree_depth: int = 0
    ) -> None:
        """Adds one (request, step) pair's drafts and accepted drafts, the proposer that drafted them, and the
        shape of a tree of drafts (its depth; 0: a chain)."""
        if draft_tree_depth > 0:
            self.num_tree_steps_by_depth = _count_at(self.num_tree_steps_by_depth, draft_tree_depth)
            self.num_tree_steps_by_nodes = _count_at(self.num_tree_steps_by_nodes, num_draft_tokens)
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if num_draft_tokens > 0:
            self.num_drafts += 1
        self.num_accepted_tokens_per_pos = _count_positions(self.num_accepted_tokens_per_pos, num_accepted_tokens)
        if num_draft_tokens > 0 and proposer:
            by_proposer = dict(self.num_draft_tokens_by_proposer)
            by_proposer[proposer] = by_proposer.get(proposer, 0) + num_draft_tokens
            self.num_draft_tokens_by_proposer = by_proposer
            per_pos = dict(self.num_accepted_tokens_per_pos_by_proposer)
            per_pos[proposer] = _count_positions(per_pos.get(proposer, ()), num_accepted_tokens)
            self.num_accepted_tokens_per_pos_by_proposer = per_pos


def _count_at(counts: tuple[int, ...], index: int) -> tuple[int, ...]:
    """The counts with one more at `index`."""
    grown = list(counts) + [0] * (index + 1 - len(counts))
    grown[index] += 1
    return tuple(grown)


def _count_positions(per_pos: tuple[int, ...], num_accepted_tokens: int) -> tuple[int, ...]:
    """Per-position counts with one more pair that accepted positions 0..num_accepted_tokens-1."""
    counts = list(per_pos) + [0] * (num_accepted_tokens - len(per_pos))
    for position in range(num_accepted_tokens):
        counts[position] += 1
    return tuple(counts)
