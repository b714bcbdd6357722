"""Per-request state as the scheduler sees it, and what it reports per step."""

from dataclasses import dataclass, field, replace
import enum

from scheduler_service.core.block_hash import BlockHashes
from scheduler_service.core.detokenizer import IncrementalDetokenizer
from scheduler_service.core.goodput import AcceptanceEstimate, TreeAcceptance
from specdec.step import DraftPreview, RequestSampling, SequenceOutput, TopLogprobs


class RequestStatus(enum.Enum):
    """Lifecycle of a request: WAITING -> RUNNING (<-> PREEMPTED) -> FINISHED_*."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to recompute prompt + output
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """Whether the request will never run again."""
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    """One generation request: its inputs, stop conditions and scheduling state.

    Token counts, with T = num_tokens (prompt + confirmed output) and C =
    num_computed_tokens: while running, the worker holds KV for positions
    [0, C) and the tokens [C, T + num_assumed_tokens) are still to compute.
    In async mode C and num_assumed_tokens include the optimistic effect of
    the step in flight (every draft accepted); `Scheduler.update` corrects them.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: RequestSampling = field(default_factory=RequestSampling)
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    is_eos_ignored: bool = False
    stop_strings: list[str] = field(default_factory=list)
    is_speculation_enabled: bool = True
    num_speculative_tokens: int | None = None  # per-request k cap; None = the server's k
    grammar: str = ""  # structured outputs: the compiled constraint ("": none)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    arrival_index: int | None = None  # set by the scheduler; FCFS order
    num_computed_tokens: int = 0
    num_assumed_tokens: int = 0  # output tokens assumed from steps in flight
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_moves: int = 0  # times it resumed on another worker (bounded by the cluster)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    is_held_by_worker: bool = False
    acceptance: AcceptanceEstimate | None = field(default=None, repr=False)  # the policy's, by draft position
    # With several proposers: the policy's estimate per proposer, and the one that drafted last.
    acceptance_by_proposer: dict[str, AcceptanceEstimate] = field(default_factory=dict, repr=False)
    last_proposer: str = ""
    # With draft trees: the policy's value per node rank, and the steps it has drafted chains since its last tree.
    tree_acceptance: TreeAcceptance | None = field(default=None, repr=False)
    num_chain_steps: int = 0
    num_forced_tokens_next: int = 0  # the worker's last step: tokens the constraint forces next (free drafts)
    next_draft: DraftPreview | None = None  # the worker's last step: its copying proposer's next draft
    # proposer -> (draft tokens, accepted tokens) of this request
    drafts_by_proposer: dict[str, tuple[int, int]] = field(default_factory=dict)
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    block_hashes: BlockHashes | None = field(default=None, repr=False)  # of its committed full blocks (the scheduler's)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must hold at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(
                f"request {self.request_id!r}: num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if any(not s for s in self.stop_strings):
            raise ValueError(f"request {self.request_id!r}: stop strings must not be empty")
        if self.sampling.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens {self.sampling.min_tokens} is more than max_tokens {self.max_tokens}: lower min_tokens"
            )
        if self.sampling.min_tokens and self.grammar:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the output ends where its constraint does"
            )
        if self.sampling.min_tokens:  # the worker holds back whatever would end the request
            ending = [*self.stop_token_ids, *([] if self.is_eos_ignored else self.eos_token_ids)]
            self.sampling = replace(self.sampling, stop_token_ids=tuple(sorted(set(ending))))

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Confirmed output tokens (all of them were, or are being, streamed)."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + confirmed output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + confirmed output: what a (re)started worker state is built from."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_assumed(self) -> int:
        """num_tokens plus the tokens optimistically assumed from steps in flight."""
        return self.num_tokens + self.num_assumed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request ended (stopped, length or aborted)."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length", "abort", or None while unfinished."""
        return self.status.value if self.is_finished else None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute, assuming steps in flight accept every draft."""
        num_pending = self.num_tokens_assumed - self.num_computed_tokens
        assert num_pending >= 1, "a request always has at least one token to compute"
        return num_pending

    def num_tokens_left(self, max_model_len: int) -> int:
        """Output tokens still allowed, counting assumed tokens as emitted."""
        return min(
            self.max_tokens - self.num_output_tokens - self.num_assumed_tokens, max_model_len - self.num_tokens_assumed
        )

    def check_limits(self, max_model_len: int, num_kv_tokens: int) -> None:
        """Raises ValueError when the request can never be served by this scheduler."""
        if self.status is not RequestStatus.WAITING or self.output_token_ids:
            raise ValueError(f"request {self.request_id!r} is not a new request")
        if self.num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"request {self.request_id!r}: the prompt has {self.num_prompt_tokens} tokens; "
                f"max_model_len {max_model_len} leaves no room for output"
            )
        self.check_fits(max_model_len, num_kv_tokens)

    def check_fits(self, max_model_len: int, num_kv_tokens: int) -> None:
        """Raises ValueError when the request's longest possible sequence exceeds a KV pool."""
        # Lookahead is capped by the tokens left, so no step needs slots past this.
        num_tokens_max = min(self.num_prompt_tokens + self.max_tokens, max_model_len)
        if num_tokens_max > num_kv_tokens:
            raise ValueError(
                f"request {self.request_id!r} may need {num_tokens_max} KV slots; the pool "
                f"holds {num_kv_tokens}: lower max_tokens"
            )

    def assume_step(self, num_new_tokens: int, num_lookahead_slots: int) -> "ScheduledTokens":
        """Records a scheduled step optimistically and returns the request's part of it.

        A sampling step (it computes every known token) is assumed to emit
        1 + num_lookahead_slots tokens, every draft accepted, so
        num_computed_tokens is an upper bound of the worker's until corrected.
        """
        is_sampling = num_new_tokens == self.num_pending_tokens
        num_context_tokens = self.num_computed_tokens
        self.num_computed_tokens += num_new_tokens + num_lookahead_slots
        if is_sampling:
            self.num_assumed_tokens += 1 + num_lookahead_slots
        return ScheduledTokens(num_new_tokens, num_lookahead_slots, is_sampling, num_context_tokens)

    def apply_step_output(
        self, scheduled: "ScheduledTokens", output: SequenceOutput | None, max_model_len: int
    ) -> tuple[list[int], RequestStatus | None]:
        """Applies the worker's real output of a step: corrects the assumption, appends tokens.

        Returns the tokens kept and the finished status they cause (or None).
        """
        token_ids = output.token_ids if output is not None else []
        if scheduled.is_sampling:
            # The worker has now computed all but the last emitted token.
            self.num_computed_tokens -= 1 + scheduled.num_lookahead_slots - len(token_ids)
            self.num_assumed_tokens -= 1 + scheduled.num_lookahead_slots
        if output is not None:
            self.num_forced_tokens_next = output.num_forced_tokens_next
            self.next_draft = output.next_draft
            self.num_draft_tokens += output.num_draft_tokens
            self.num_accepted_tokens += output.num_accepted_tokens
            if output.num_draft_tokens and output.proposer:
                drafted, accepted = self.drafts_by_proposer.get(output.proposer, (0, 0))
                self.drafts_by_proposer[output.proposer] = (
                    drafted + output.num_draft_tokens,
                    accepted + output.num_accepted_tokens,
                )
        return self._append_output_tokens(token_ids, max_model_len)

    def _append_output_tokens(self, token_ids: list[int], max_model_len: int) -> tuple[list[int], RequestStatus | None]:
        # Tokens emitted after a stop token, a stop string or the length limit are dropped.
        for num_kept, token_id in enumerate(token_ids, start=1):
            self.output_token_ids.append(token_id)
            status = self._finish_status_for_last_token(max_model_len)
            can_stop = self.num_output_tokens > self.sampling.min_tokens  # a stop string ends after min_tokens
            if self.detokenizer is not None and self.detokenizer.add_token(token_id, can_stop):
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                return token_ids[:num_kept], status
        return list(token_ids), None

    def _finish_status_for_last_token(self, max_model_len: int) -> RequestStatus | None:
        token_id = self.output_token_ids[-1]
        if token_id in self.stop_token_ids or (not self.is_eos_ignored and token_id in self.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(
        self,
        new_token_ids: list[int],
        text: str,
        logprobs: list[float] | None = None,
        top_logprobs: list[TopLogprobs] | None = None,
    ) -> "RequestOutput":
        """This step's output with the usage counts so far."""
        return RequestOutput(
            self.request_id,
            new_token_ids,
            text,
            self.finish_reason,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            logprobs or [],
            self.num_cached_tokens or 0,
            dict(self.drafts_by_proposer),
            top_logprobs or [],
        )

    def reset_for_recompute(self) -> None:
        """Forgets all KV state after preemption; the output already streamed is kept."""
        assert self.num_assumed_tokens == 0, "a request with a step in flight is never preempted"
        self._forget_worker_state()
        self.num_preemptions += 1

    def reset_for_move(self) -> None:
        """Forgets all state on a worker that left: steps in flight there never complete.

        What was streamed (prompt + output_token_ids, the detokenizer's text) is kept; the
        request resumes elsewhere by recomputing it.
        """
        self.num_assumed_tokens = 0
        self._forget_worker_state()
        self.num_moves += 1

    def _forget_worker_state(self) -> None:
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.is_held_by_worker = False


@dataclass(frozen=True)
class ScheduledTokens:
    """A request's part of one step, as scheduled."""

    num_new_tokens: int
    num_lookahead_slots: int
    is_sampling: bool  # computes every known token, so the worker emits 1..1+num_lookahead_slots tokens
    num_context_tokens: int = 0  # KV positions before the chunk (as assumed when scheduled)

    @property
    def num_positions(self) -> int:
        """The KV positions the step may have written: [0, context + new tokens + lookahead slots)."""
        return self.num_context_tokens + self.num_new_tokens + self.num_lookahead_slots

    def can_emit(self, num_emitted: int) -> bool:
        """Whether a worker may emit `num_emitted` tokens for this part (validates results)."""
        if not self.is_sampling:
            return num_emitted == 0  # a prefill chunk short of the prompt's end
        return 1 <= num_emitted <= 1 + self.num_lookahead_slots


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, text delta, finish reason, usage."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: str | None  # None | "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_completion_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    logprobs: list[float] = field(default_factory=list)  # one per new token, when requested
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    drafts_by_proposer: dict[str, tuple[int, int]] = field(default_factory=dict)  # (drafted, accepted)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per new token, when requested
