"""Per-request state the worker caches between steps, and the validation of step deltas.

Every check runs before any state changes, so a rejected step leaves the
worker exactly as it was (and it keeps serving).
"""

from dataclasses import dataclass, field, replace
import secrets

from specdec import step


class InvalidStepError(ValueError):
    """A step request the worker cannot execute (mapped to INVALID_ARGUMENT)."""


@dataclass
class RequestState:
    """What the worker knows of one request."""

    request_id: str
    token_ids: list[int]  # prompt + every emitted token
    num_prompt_tokens: int
    sampling: step.RequestSampling  # validated when the step was built; its seed is always set
    block_table: list[int]
    num_speculative_tokens: int  # this step's k (the scheduler's lookahead slots); drafts may be fewer
    forced_drafts_only: bool = False  # this step's k is for the constraint's forced tokens: no proposer
    draft_tree_width: int = 0  # this step's most children per draft (1: a chain; 0: the proposer's own width)
    num_computed_tokens: int = 0  # target KV written for token_ids[:num_computed_tokens]
    num_draft_computed_tokens: int = 0  # the same for the draft model's KV
    scheduled_new_tokens: int = field(default=0, repr=False)  # this step's chunk size
    grammar: str = field(default="", repr=False)  # structured outputs: the constraint ("": none)
    matcher: object | None = field(
        default=None, repr=False
    )  # its llguidance matcher (worker_service/speculation/structured.py)
    prompt_token_set: frozenset[int] | None = field(default=None, repr=False)  # logits_processing's, once made

    @property
    def is_constrained(self) -> bool:
        return bool(self.grammar)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def return_logprobs(self) -> bool:
        return self.sampling.logprobs


def _check_tokens(token_ids: list[int], vocab_size: int, request_id: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidStepError(f"request {request_id!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _check_blocks(block_ids: list[int], num_blocks: int, request_id: str) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise InvalidStepError(f"request {request_id!r}: block id {bad[0]} is outside the KV cache [0, {num_blocks})")


def new_state(r: step.NewRequest, vocab_size: int, num_blocks: int) -> RequestState:
    """Validates a NewRequest and builds its state (not yet registered)."""
    if not r.request_id:
        raise InvalidStepError("a new request has an empty request_id")
    if not r.token_ids:
        raise InvalidStepError(f"request {r.request_id!r}: no token ids")
    if not 0 < r.num_prompt_tokens <= len(r.token_ids):
        raise InvalidStepError(
            f"request {r.request_id!r}: num_prompt_tokens {r.num_prompt_tokens} must be in [1, {len(r.token_ids)}]"
        )
    _check_tokens(r.token_ids, vocab_size, r.request_id)
    _check_tokens(r.sampling.token_ids_in_params, vocab_size, r.request_id)
    if r.grammar and r.sampling.min_tokens:
        raise InvalidStepError(
            f"request {r.request_id!r}: min_tokens cannot be combined with a constraint (which ends the output)"
        )
    _check_blocks(r.block_ids, num_blocks, r.request_id)
    if r.num_speculative_tokens < 0:
        raise InvalidStepError(f"request {r.request_id!r}: num_speculative_tokens must be >= 0")
    if not 0 <= r.num_computed_tokens < len(r.token_ids):
        raise InvalidStepError(
            f"request {r.request_id!r}: num_computed_tokens {r.num_computed_tokens} must be in "
            f"[0, {len(r.token_ids) - 1}] (at least the last token is computed)"
        )
    sampling = r.sampling
    if sampling.seed is None:  # a scheduler that sends none: key this request's randomness by a fresh seed
        sampling = replace(sampling, seed=secrets.randbits(63))
    return RequestState(
        request_id=r.request_id,
        token_ids=list(r.token_ids),
        num_prompt_tokens=r.num_prompt_tokens,
        sampling=sampling,
        block_table=list(r.block_ids),
        num_speculative_tokens=r.num_speculative_tokens,
        scheduled_new_tokens=r.num_new_tokens,
        # A prefix-cache hit: the blocks hold every model's KV of these positions.
        num_computed_tokens=r.num_computed_tokens,
        num_draft_computed_tokens=r.num_computed_tokens,
        grammar=r.grammar,
        draft_tree_width=r.draft_tree_width,
    )


def check_cached(c: step.CachedRequest, state: RequestState | None, num_blocks: int) -> None:
    """Validates a CachedRequest delta against the request's state."""
    if state is None:
        raise InvalidStepError(
            f"unknown request id {c.request_id!r}: the worker holds no state for it (send it as a new request)"
        )
    if not 0 <= c.num_blocks_kept <= len(state.block_table):
        raise InvalidStepError(
            f"request {c.request_id!r}: num_blocks_kept {c.num_blocks_kept} is outside [0, {len(state.block_table)}]"
        )
    _check_blocks(c.new_block_ids, num_blocks, c.request_id)
    if c.num_speculative_tokens < 0:
        raise InvalidStepError(f"request {c.request_id!r}: num_speculative_tokens must be >= 0")


def apply_cached(c: step.CachedRequest, state: RequestState) -> None:
    """Applies a validated delta."""
    state.block_table = state.block_table[: c.num_blocks_kept] + list(c.new_block_ids)
    state.scheduled_new_tokens = c.num_new_tokens
    state.num_speculative_tokens = c.num_speculative_tokens
    state.forced_drafts_only = c.forced_drafts_only
    state.draft_tree_width = c.draft_tree_width


def check_schedulable(
    state: RequestState,
    block_size: int,
    max_model_len: int,
    max_num_speculative_tokens: int,
    max_draft_tree_width: int = 1,
) -> None:
    """The chunk fits the known tokens, k and the tree width are within the worker's, and the block table
    covers the chunk (plus k lookahead slots for a decode)."""
    if state.num_speculative_tokens > max_num_speculative_tokens:
        raise InvalidStepError(
            f"request {state.request_id!r}: num_speculative_tokens {state.num_speculative_tokens} "
            f"exceeds this worker's {max_num_speculative_tokens}"
        )
    if not 0 <= state.draft_tree_width <= max(max_draft_tree_width, 1):
        raise InvalidStepError(
            f"request {state.request_id!r}: draft_tree_width {state.draft_tree_width} is outside "
            f"[0, {max(max_draft_tree_width, 1)}] (this worker's --draft-tree-width)"
        )
    pending = state.num_tokens - state.num_computed_tokens
    if not 1 <= state.scheduled_new_tokens <= pending:
        raise InvalidStepError(
            f"request {state.request_id!r}: num_new_tokens {state.scheduled_new_tokens} must be "
            f"in [1, {pending}] (tokens not yet computed)"
        )
    end = state.num_computed_tokens + state.scheduled_new_tokens
    is_decode = pending == 1
    if is_decode:  # drafts go into the k lookahead slots
        end += state.num_speculative_tokens
    end = min(end, max_model_len)
    capacity = len(state.block_table) * block_size
    if capacity < end:
        raise InvalidStepError(
            f"request {state.request_id!r}: block table of {len(state.block_table)} blocks "
            f"({capacity} slots) is shorter than the {end} positions this step needs"
        )
