"""The messages of one engine step, as plain dataclasses (no torch).

They map one-to-one onto `specdec.v1.worker_pb2` messages; `specdec.convert`
is the only place that converts between the two.
"""

from dataclasses import dataclass, field
import math

MAX_SEED = 2**64 - 1  # seeds are uint64 on the wire


@dataclass(frozen=True)
class RequestSampling:
    """How one request samples: the single validated type on both sides of the wire.

    ``temperature == 0`` is greedy decoding; ``top_k == 0`` and ``top_p == 1``
    switch those filters off; ``seed`` keys the request's randomness (``None``:
    the scheduler or worker picks one); ``logprobs`` asks for the log-probability
    of every emitted token. Raises ``ValueError`` with a message a user can act on.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1] or unset, got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be true or false, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0


@dataclass
class NewRequest:
    """Full state of a request the worker does not hold (new, or resumed after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt + tokens generated so far
    num_prompt_tokens: int
    sampling: RequestSampling
    block_ids: list[int]
    num_new_tokens: int  # tokens to compute this step
    num_speculative_tokens: int = 0  # this step's k (lookahead slots reserved); the worker may propose fewer
    num_computed_tokens: int = 0  # KV already in the first blocks (a prefix-cache hit); computing starts here
    grammar: str = ""  # the output's constraint, as llguidance compiles it ("": unconstrained)
    draft_tree_width: int = 0  # this step's most children per draft (CachedRequest)


@dataclass
class CachedRequest:
    """Delta for a request the worker holds."""

    request_id: str
    new_block_ids: list[int]
    num_blocks_kept: int  # the table is cut to this length before appending
    num_new_tokens: int
    num_speculative_tokens: int = 0  # this step's k, sent every step
    forced_drafts_only: bool = False  # k is for the constraint's forced tokens: no proposer call
    draft_tree_width: int = 0  # this step's most children per draft (1: a chain; 0: the worker's own width)


@dataclass
class StepRequest:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DraftPreview:
    """A copying proposer's draft for a sequence's next step: how many drafts, on how long a context match."""

    num_drafts: int
    match_length: int


@dataclass
class SequenceOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_kv_written_tokens: int = 0  # positions [0, n) with every model's KV written: cacheable full blocks
    proposer: str = ""  # the proposer whose drafts were scored ("" without drafts)
    num_forced_tokens_next: int = 0  # tokens the constraint forces after the emitted ones (at most k)
    next_draft: DraftPreview | None = None  # a copying proposer's draft for the next step (None: no preview)
    draft_tree_depth: int = 0  # the drafts formed a tree this deep (num_draft_tokens: its nodes); 0: a chain
    accepted_draft_ranks: list[int] = field(default_factory=list)  # a tree's accepted nodes' ranks (1: likeliest)


@dataclass
class StepStats:
    propose_ms: float = 0.0
    score_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    num_speculating_seqs: int = 0


@dataclass
class StepResult:
    step_id: int
    outputs: list[SequenceOutput] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)
