"""The messages of one engine step, as plain dataclasses (no torch).

They map one-to-one onto `specdec.v1.worker_pb2` messages; `specdec.convert`
is the only place that converts between the two.
"""

from dataclasses import dataclass, field
import math

MAX_SEED = 2**64 - 1  # seeds are uint64 on the wire


MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS_ENTRIES = 1024
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence_penalty / frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class RequestSampling:
    """How one request samples: the single validated type on both sides of the wire.

    ``temperature == 0`` is greedy decoding; ``top_k == 0``, ``top_p == 1`` and
    ``min_p == 0`` switch those filters off; ``seed`` keys the request's
    randomness (``None``: the scheduler or worker picks one); ``logprobs`` asks
    for the log-probability of every emitted token, ``top_logprobs`` for that
    many of the likeliest tokens at each emitted position too.

    Logits processing (worker_service/speculation/logits_processing.py), per
    sampled position and along each draft's own prefix: ``min_tokens`` forbids
    ``stop_token_ids`` (the tokens that would end the request: EOS unless
    ignored, and the request's stop tokens) until that many tokens are out;
    ``logit_bias`` adds to given tokens' logits; ``repetition_penalty`` (> 1
    discourages) scales the logits of tokens in the prompt or output;
    ``frequency_penalty`` subtracts per occurrence in the output and
    ``presence_penalty`` once for any occurrence. Raises ``ValueError`` with a
    message a user can act on.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ascending ids
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # what min_tokens holds back (the scheduler fills it in)
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1] or unset, got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be true or false, got {self.logprobs!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}] (0 = off), got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty!r}")
        self._check_logit_bias()
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int):
            raise ValueError(f"top_logprobs must be an integer, got {self.top_logprobs!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES}")
        low, high = LOGIT_BIAS_RANGE
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not _is_number(bias) or not low <= bias <= high:
                raise ValueError(f"logit_bias values must be in [{low}, {high}], got {bias!r} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0

    @property
    def is_processed(self) -> bool:
        """True when the request's logits are processed before sampling (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or (self.min_tokens and self.stop_token_ids)
        )

    @property
    def token_ids_in_params(self) -> list[int]:
        """Every token id the parameters name (to check against the vocabulary)."""
        return [t for t, _ in self.logit_bias] + list(self.stop_token_ids)


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
class TopLogprobs:
    """The likeliest tokens at one emitted position, likeliest first, and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class SequenceOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per emitted token (top_logprobs > 0)
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
