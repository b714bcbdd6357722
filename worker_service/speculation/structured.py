"""Structured outputs on the worker: a matcher per constrained request, the mask of every scored position,
drafts checked against the grammar, and the tokens the grammar forces proposed as drafts.

Why speculation stays exact: the token at a position is sampled from the target's distribution *masked by
the grammar state of that position's own prefix* (the committed tokens and the drafts before it), which is
what constrained decoding without drafts samples there; so the accept rule (kernels/rejection_sampler.py)
compares each draft with the constrained target and the output is unchanged, greedy and keyed alike. A
draft the grammar forbids could never equal the masked target's token: it is cut off before scoring.

A matcher is rebuilt from the request's generated tokens when the request is (re)sent to a worker, so a
preempted or moved request goes on in the same grammar state. Grammars compile on a thread of their own
(llguidance releases the GIL), once per grammar text: a new request's grammar builds while its prompt
prefills, and only its first sampled position waits for it.
"""

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
import logging
import threading

from llguidance import LLMatcher
import torch

from kernels import token_bitmask
from specdec import structured
from worker_service.speculation.request_state import InvalidStepError, RequestState

logger = logging.getLogger(__name__)

FORCED = structured.FORCED_PROPOSER  # the proposer name of drafts the grammar forces
CACHE_SIZE = 256


class Grammars:
    """Compiled grammars by their text (a matcher at the start, copied for each request)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]):
        """tokenizer_json: reads the model's `tokenizer.json` text (on the compile thread, once)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_json = tokenizer_json
        self._tokenizer = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[str, Future] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def start(self, grammar: str) -> Future:
        """Begins compiling `grammar` (nothing to do when it is cached); the future holds its start matcher."""
        with self._lock:
            future = self._compiled.get(grammar)
            if future is None:
                if len(self._compiled) >= CACHE_SIZE:
                    self._compiled.popitem(last=False)
                future = self._compiled[grammar] = self._pool.submit(self._compile, grammar)
            else:
                self._compiled.move_to_end(grammar)
            return future

    def _compile(self, grammar: str) -> LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = structured.make_tokenizer(self._tokenizer_json(), self.vocab_size, self.eos_token_ids)
        return structured.compile_matcher(self._tokenizer, grammar)

    def matcher(self, state: RequestState) -> LLMatcher:
        """The request's matcher, built on first use: the grammar's start, advanced over its generated tokens."""
        if state.matcher is None:
            try:
                start = self.start(state.grammar).result()
            except Exception as exc:  # an invalid grammar, or a tokenizer llguidance cannot use
                raise InvalidStepError(f"request {state.request_id!r}: cannot compile its constraint: {exc}") from exc
            matcher = start.deep_copy()
            generated = state.token_ids[state.num_prompt_tokens :]
            if not matcher.consume_tokens(generated):
                raise InvalidStepError(
                    f"request {state.request_id!r}: its generated tokens do not follow its "
                    f"constraint ({matcher.get_error().strip()})"
                )
            state.matcher = matcher
        return state.matcher


def forced_tokens(matcher: LLMatcher, limit: int) -> list[int]:
    """The tokens the grammar forces next (at most `limit`): drafts that need no proposer."""
    return matcher.compute_ff_tokens()[:limit] if limit > 0 and not matcher.is_stopped() else []


def valid_drafts(matcher: LLMatcher, drafts: list[int], keep_first_forbidden: bool = False) -> list[int]:
    """A proposer's drafts up to the first one the grammar forbids.

    keep_first_forbidden: for drafts sampled from a draft model's distribution p (rejection sampling with
    p), the first forbidden draft is kept: the masked target gives it probability 0, so it is rejected for
    certain and the position samples normalize(max(q - p, 0)), as it must; cutting it would sample q there
    instead (exact only for drafts that are one-hot in p: n-gram, suffix, EAGLE-3, greedy)."""
    num_valid = matcher.validate_tokens(drafts)
    return drafts[: num_valid + 1 if keep_first_forbidden else num_valid]


def masks(matcher: LLMatcher, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """Bitmasks ([1 + len(drafts), ceil(V / 32)] int32) of the positions a verify step samples: position j's
    mask is the grammar state after the committed tokens and drafts[:j]. The matcher ends where it began."""
    bitmask = torch.full((len(drafts) + 1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    num_consumed = 0
    for j in range(len(drafts) + 1):
        fill_mask(matcher, bitmask[j])
        if j < len(drafts):
            if matcher.validate_tokens([drafts[j]]) != 1:  # a kept forbidden draft: it is rejected for certain,
                bitmask[j + 1 :] = 0  # the rows past it are never emitted (EOS only)
                break
            matcher.consume_token(drafts[j])
            num_consumed += 1
    if not matcher.rollback(num_consumed):
        raise RuntimeError(f"the grammar matcher could not step back {num_consumed} tokens: {matcher.get_error()}")
    return bitmask


def fill_mask(matcher: LLMatcher, words: torch.Tensor) -> None:
    """Writes the tokens the matcher allows next into `words` (one contiguous int32 row on the CPU).

    What llguidance.torch.fill_next_token_bitmask does, without importing that module: it compiles a function
    with torch.compile when imported, which took ~1.3 s of every worker's start for a function we do not use
    (the masks are applied by kernels/token_bitmask.py)."""
    if words.dtype != torch.int32 or not words.is_cpu or not words.is_contiguous():
        raise ValueError(f"a mask row must be contiguous int32 on the CPU, got {words.dtype} on {words.device}")
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def apply_masks(
    logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor], eos_token_ids: list[int]
) -> torch.Tensor:
    """`logits` ([N, V], the step's own: changed in place) with the tokens each bitmask forbids at -inf, in the
    rows given (bitmask i covers rows rows[i], rows[i] + 1, ...). A row that allows nothing (past the grammar's
    end) allows EOS. Masks are built for the model's output size (make_tokenizer's n_vocab), padded to whole
    words (kernels/token_bitmask.py: a C kernel for the CPU's fp32 logits, PyTorch elsewhere)."""
    if not rows:
        return logits
    index = torch.tensor([r + j for r, b in zip(rows, bitmasks) for j in range(b.shape[0])], dtype=torch.int64)
    return token_bitmask.apply_token_bitmask_(logits, index, torch.cat(bitmasks), eos_token_ids)


def advance(matcher: LLMatcher, emitted: list[int]) -> None:
    """Moves the matcher over a step's emitted tokens (up to the grammar's end: the request then stops)."""
    for token in emitted:
        if matcher.is_stopped():
            return
        if not matcher.consume_token(token):  # sampled under its mask: cannot happen
            logger.error("an emitted token left its constraint: %s", matcher.get_error())
            return
