"""The messages of one engine step, as plain dataclasses (no torch).

They map one-to-one onto `specdec.v1.worker_pb2` messages; `specdec.convert`
is the only place that converts between the two.
"""

from dataclasses import dataclass, field


@dataclass
class RequestSampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False


@dataclass
class NewRequest:
    """Full state of a request the worker does not hold (new, or resumed after preemption)."""

    request_id: str
    token_ids: list[int]          # prompt + tokens generated so far
    num_prompt_tokens: int
    sampling: RequestSampling
    block_ids: list[int]
    num_new_tokens: int           # tokens to compute this step
    num_speculative_tokens: int = 0


@dataclass
class CachedRequest:
    """Delta for a request the worker holds."""

    request_id: str
    new_block_ids: list[int]
    num_blocks_kept: int          # the table is cut to this length before appending
    num_new_tokens: int
    num_speculative_tokens: int | None = None


@dataclass
class StepRequest:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_lookahead_slots: int = 0
    running_queue_size: int = 0


@dataclass
class SequenceOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


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
