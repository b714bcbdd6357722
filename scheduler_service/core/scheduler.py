"""The scheduler: continuous batching, chunked prefill, lookahead slots, preemption by recompute.

One rule covers prefill, decode and speculation: each step, a running request
computes tokens from its num_computed_tokens position towards the tokens it
knows. A step that computes all of them samples: the worker emits 1 token, or
for a decode (exactly one pending token) 1..1+k tokens, k drafts having been
written into lookahead slots that the scheduler reserved.

Async mode: `schedule()` may run while the previous step is in flight. The
scheduler then assumes every draft of that step is accepted, and `update()`
corrects the counters when the real result arrives. Blocks a step in flight
may write are never freed before its result has been applied.

Prefix caching (block_manager.py): a request leaving the waiting queue starts
with the cached blocks of its longest cached prefix and computes from there;
after each result, the full blocks of committed tokens whose KV the worker
reports written (every model's) are offered to the cache, a finishing request's
included, before its blocks are released.
"""

from bisect import insort
from collections import deque
from dataclasses import dataclass, field
import logging

from scheduler_service.core.block_hash import BlockHashes, cache_root
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.detokenizer import IncrementalDetokenizer, Tokenizer
from scheduler_service.core.policy import SpeculationPolicy, StepPlan, StepShape
from scheduler_service.core.request import Request, RequestOutput, RequestStatus, ScheduledTokens
from scheduler_service.core.stats import SchedulerStats
from specdec.step import CachedRequest, NewRequest, SequenceOutput, StepRequest, StepResult

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """A step being built, then in flight until its result is applied."""

    step_id: int
    num_tokens_left: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    scheduled: dict[str, ScheduledTokens] = field(default_factory=dict)
    is_preempting: bool = False
    dropped_request_ids: list[str] = field(default_factory=list)  # sent as finished_request_ids
    num_running: int = 0  # requests that may run (the disable limit)
    num_drafts: dict[str, int] = field(default_factory=dict)  # the policy's k per decoding request
    forced_only: set[str] = field(default_factory=set)  # ... of which k is for forced tokens only
    matches: dict[str, tuple[int, bool]] = field(default_factory=dict)  # ... the previews they were planned on
    tree_widths: dict[str, int] = field(default_factory=dict)  # ... their draft_tree_width (absent: 0)


class Scheduler:
    """FCFS continuous-batching scheduler for one worker's KV pool (pure Python).

    Use: `add_request`; then repeatedly `schedule()` -> send to the worker ->
    `update(result)`. In async mode one more `schedule()` may come before the
    previous step's `update()`.
    """

    def __init__(
        self, config: SchedulerConfig, tokenizer: Tokenizer | None = None, stats: SchedulerStats | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self._cache_root = cache_root(*config.kv_cache_facts)
        self.policy = SpeculationPolicy(
            config.num_speculative_tokens,
            config.speculative_disable_queue_size,
            config.speculation_policy,
            max_draft_tree_width=config.max_draft_tree_width,
        )
        self.stats = stats if stats is not None else SchedulerStats()  # passed on: counters outlive a scheduler
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index
        self._requests: dict[str, Request] = {}  # every request whose blocks/ids are not released yet
        self._in_flight: deque[_Step] = deque()
        self._worker_drop_ids: list[str] = []  # sent as the next step's finished_request_ids
        self._next_step_id = 0
        self._next_arrival_index = 0

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks; back at num_kv_blocks once every request has ended and no step is in flight."""
        return self.block_manager.num_free_blocks

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled whose results have not been applied yet."""
        return len(self._in_flight)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """A request whose state is still held (running, waiting, or finished with a step in flight)."""
        return self._requests.get(request_id)

    def take_live_requests(self) -> list[Request]:
        """Empties the scheduler after its worker left; returns the unfinished requests, reset for a move.

        Steps in flight will never complete; the returned requests keep what was streamed and
        resume elsewhere by recompute. Finished ones are simply forgotten. The scheduler holds
        nothing afterwards (its block pool is back at full).
        """
        live = sorted((r for r in self._requests.values() if not r.is_finished), key=lambda r: r.arrival_index)
        for request in self._requests.values():
            if self.block_manager.has_blocks(request.request_id):
                self.block_manager.free(request.request_id)
        for request in live:
            request.reset_for_move()
        self._requests.clear()
        self.running.clear()
        self.waiting.clear()
        self._in_flight.clear()
        self._worker_drop_ids = []
        return live

    def resume_requests(self, requests: list[Request]) -> None:
        """Queues requests moved from another worker at the front, in the given order.

        Raises ValueError (nothing queued) when one can never fit this worker's KV pool.
        """
        num_kv_tokens = self.config.num_kv_blocks * self.config.block_size
        for request in requests:
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            request.check_fits(self.config.max_model_len, num_kv_tokens)
        for request in reversed(requests):
            request.arrival_index = -self._next_arrival_index  # before every request that arrived here
            self._next_arrival_index += 1
            self._requests[request.request_id] = request
            self.waiting.appendleft(request)

    def add_request(self, request: Request) -> None:
        """Queues a new request (FCFS); raises ValueError when it can never be served."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {request.request_id!r}: stop strings need a tokenizer")
        request.check_limits(self.config.max_model_len, self.config.num_kv_blocks * self.config.block_size)
        request.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.stop_strings)
        self._requests[request.request_id] = request
        self.waiting.append(request)
        self.stats.num_requests += 1

    def abort(self, request_id: str) -> bool:
        """Finishes a request as aborted and frees its blocks (after any step in flight that uses them).

        Returns False for an unknown or already finished request.
        """
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        logger.debug("aborted %s", request_id)
        return True

    def schedule(self) -> StepRequest | None:
        """Builds the next step, or returns None when nothing can run now.

        In async mode None with a step in flight means: apply its result first.
        """
        max_in_flight = 1 if self.config.is_async else 0
        if len(self._in_flight) > max_in_flight:
            raise RuntimeError(
                f"{len(self._in_flight)} steps in flight ({self.config.scheduling} "
                "scheduling); apply a result with update() first"
            )
        plan = _Step(self._next_step_id, num_tokens_left=self.config.max_num_batched_tokens)
        plan.num_running = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        decided = self._plan_num_drafts(plan.num_running)
        plan.num_drafts, plan.forced_only, plan.matches = decided.ks, decided.forced_only, decided.matches
        plan.tree_widths = decided.tree_widths
        self._schedule_running(plan)
        if not plan.is_preempting:  # memory is short: admit nobody this step
            self._schedule_waiting(plan)
        if not plan.scheduled:
            return None
        return self._emit_step(plan)

    def _plan_num_drafts(self, num_running: int) -> StepPlan:
        """The policy's k for every running decode, decided up front for the whole step."""
        decodes, other = [], StepShape()
        for request in self.running:
            if request.status is not RequestStatus.RUNNING or self._is_certain_to_finish(request):
                continue
            if request.num_pending_tokens == 1:
                decodes.append(request)
            else:
                other.add(request.num_pending_tokens, request.num_computed_tokens, is_decode=False)
        return self.policy.plan_step(decodes, other, num_running, self.config.max_model_len)

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Applies the oldest in-flight step's result; returns what each live request produced.

        Outputs of requests that finished or were aborted earlier are dropped.
        """
        if not self._in_flight or result.step_id != self._in_flight[0].step_id:
            expected = self._in_flight[0].step_id if self._in_flight else None
            raise ValueError(f"result for step {result.step_id}, expected step {expected}")
        step = self._in_flight[0]
        outputs_by_id = self._check_result(step, result)
        self._in_flight.popleft()
        self._observe(step, result, outputs_by_id)
        request_outputs = []
        for request_id, scheduled in step.scheduled.items():
            request = self._requests[request_id]  # released only once no step in flight holds it
            if request.is_finished:
                continue
            output = self._apply_output(request, scheduled, outputs_by_id.get(request_id))
            if output is not None:
                request_outputs.append(output)
        for request_id in step.scheduled:
            self._settle_blocks(request_id)
        return request_outputs

    def _schedule_running(self, plan: _Step) -> None:
        for request in list(self.running):
            if plan.num_tokens_left == 0:
                break
            if request.status is not RequestStatus.RUNNING or self._is_certain_to_finish(request):
                continue
            num_new, num_lookahead = self._plan_tokens(request, plan)
            num_tokens_total = request.num_computed_tokens + num_new
            if not self._make_room(request, num_tokens_total, num_lookahead, plan):
                continue
            request_id = request.request_id
            # Invariant: the table is a prefix of the worker's (only trims happened since the last send).
            num_blocks_kept = len(self.block_manager.block_table(request_id))
            new_block_ids = self.block_manager.append_slots(request_id, num_tokens_total, num_lookahead)
            plan.cached_requests.append(
                CachedRequest(
                    request_id,
                    new_block_ids,
                    num_blocks_kept,
                    num_new,
                    num_speculative_tokens=num_lookahead,
                    forced_drafts_only=num_lookahead > 0 and request_id in plan.forced_only,
                    draft_tree_width=plan.tree_widths.get(request_id, 0),
                )
            )
            self._commit(request, plan, num_new, num_lookahead)

    def _schedule_waiting(self, plan: _Step) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs and plan.num_tokens_left > 0:
            request = self.waiting[0]
            cached_block_ids = self.cached_prefix(request)
            request.num_computed_tokens = num_cached = len(cached_block_ids) * self.config.block_size
            num_new, num_lookahead = self._plan_tokens(request, plan)
            num_tokens_total = num_cached + num_new + num_lookahead
            if not self.block_manager.can_allocate(num_tokens_total, cached_block_ids):
                request.num_computed_tokens = 0
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            block_ids = self.block_manager.allocate(request.request_id, num_tokens_total, cached_block_ids)
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=lambda r: r.arrival_index)
            request.is_held_by_worker = True
            self._count_cache_query(request, num_cached)
            plan.new_requests.append(
                NewRequest(
                    request.request_id,
                    request.all_token_ids,
                    request.num_prompt_tokens,
                    request.sampling,
                    block_ids,
                    num_new,
                    num_lookahead,
                    num_cached,
                    request.grammar,
                )
            )
            self._commit(request, plan, num_new, num_lookahead)

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks this worker holds of the request's longest cached prefix (a routing hint too)."""
        return self.block_manager.cached_prefix(self._block_hashes(request), request.num_tokens)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks of committed tokens, under this worker's root (none, and no
        hashing, with prefix caching off)."""
        if not self.block_manager.enable_prefix_caching:
            return []
        hashes = request.block_hashes
        if hashes is None or hashes.root != self._cache_root or hashes.block_size != self.config.block_size:
            hashes = request.block_hashes = BlockHashes(self._cache_root, self.config.block_size)
        if len(hashes.hashes) < request.num_tokens // self.config.block_size:
            hashes.extend(request.all_token_ids)
        return hashes.hashes

    def _count_cache_query(self, request: Request, num_cached: int) -> None:
        self.stats.num_prefix_cache_queries += request.num_tokens
        self.stats.num_prefix_cache_hits += num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached

    def _plan_tokens(self, request: Request, plan: _Step) -> tuple[int, int]:
        """(num_new_tokens, num_lookahead_slots) of the request this step.

        Only a decode (exactly one pending token) speculates: the policy's k, as far as the step's
        token budget allows. The lookahead slots reserved are the k sent to the worker.
        """
        num_new = min(request.num_pending_tokens, plan.num_tokens_left)
        k = plan.num_drafts.get(request.request_id, 0) if num_new == request.num_pending_tokens == 1 else 0
        return num_new, min(k, plan.num_tokens_left - num_new)

    def _commit(self, request: Request, plan: _Step, num_new: int, num_lookahead: int) -> None:
        plan.scheduled[request.request_id] = request.assume_step(num_new, num_lookahead)
        plan.num_tokens_left -= num_new + num_lookahead

    def _make_room(self, request: Request, num_tokens_total: int, num_lookahead: int, plan: _Step) -> bool:
        """Preempts the latest arrivals until the request's slots fit; False when it cannot run now."""
        while not self.block_manager.can_append_slots(request.request_id, num_tokens_total, num_lookahead):
            victim = self._pick_victim(plan)
            if victim is None:
                return False  # async: the rest is held by the step in flight; retry after its result
            self._preempt(victim)
            plan.is_preempting = True
            if victim is request:
                return False
        return True

    def _pick_victim(self, plan: _Step) -> Request | None:
        """The most recently arrived running request that neither this step nor a step in flight uses."""
        for request in reversed(self.running):
            if request.request_id not in plan.scheduled and not self._is_in_flight(request.request_id):
                return request
        return None

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free every block; the request resumes at the front of the queue."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        if request.is_held_by_worker:
            self._worker_drop_ids.append(request.request_id)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        logger.info(
            "preempted %s (%d tokens to recompute); %d free blocks",
            request.request_id,
            request.num_tokens,
            self.num_free_blocks,
        )

    def _emit_step(self, plan: _Step) -> StepRequest:
        step = StepRequest(
            step_id=plan.step_id,
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            finished_request_ids=self._worker_drop_ids,
        )
        plan.dropped_request_ids, self._worker_drop_ids = self._worker_drop_ids, []
        self._in_flight.append(plan)
        self._next_step_id += 1
        self.stats.num_steps += 1
        self.stats.num_prefix_cache_evictions += self.block_manager.take_num_evictions()
        if self.policy.num_speculative_tokens > 0 and self.policy.is_disabled_for_step(plan.num_running):
            self.stats.num_steps_speculation_disabled += 1
        self.stats.count_ks(
            [s.num_lookahead_slots for rid, s in plan.scheduled.items() if rid in plan.num_drafts and s.is_sampling]
        )
        return step

    def _observe(self, step: _Step, result: StepResult, outputs_by_id: dict[str, SequenceOutput]) -> None:
        """Feeds the policy: each sequence's drafts and acceptance, and the step's real shape and time."""
        shape = StepShape()
        for request_id, scheduled in step.scheduled.items():
            output = outputs_by_id.get(request_id)
            num_drafts = output.num_draft_tokens if output is not None else 0
            is_decode = scheduled.is_sampling and scheduled.num_new_tokens == 1
            shape.add(scheduled.num_new_tokens + num_drafts, scheduled.num_context_tokens, is_decode)
            request = self._requests[request_id]
            if output is not None and not request.is_finished and output.draft_tree_depth:
                self.policy.observe_tree(
                    request,
                    scheduled.num_lookahead_slots,
                    output.num_draft_tokens,
                    output.accepted_draft_ranks,
                    output.proposer,
                )
            elif output is not None and not request.is_finished:
                self.policy.observe_sequence(
                    request,
                    scheduled.num_lookahead_slots,
                    output.num_draft_tokens,
                    output.num_accepted_tokens,
                    output.proposer,
                    step.matches.get(request_id),
                )
        self.stats.worker_step_s += result.stats.total_ms / 1e3
        self.stats.propose_s += result.stats.propose_ms / 1e3
        predicted_ms = self.policy.observe_step(shape, result.stats.total_ms)
        if predicted_ms is not None:
            self.stats.count_prediction(predicted_ms, result.stats.total_ms)
        if logger.isEnabledFor(logging.DEBUG):  # the cost model's data, one line a step (--log-level DEBUG)
            logger.debug(
                "step %d: %d decode rows (%d drafts), %d prefill rows, %d seqs, %d attended: %.2f ms "
                "(proposing %.2f), predicted %s",
                step.step_id,
                shape.num_rows,
                sum(o.num_draft_tokens for o in outputs_by_id.values()),
                shape.num_prefill_rows,
                shape.num_seqs,
                shape.num_attended,
                result.stats.total_ms,
                result.stats.propose_ms,
                "-" if predicted_ms is None else f"{predicted_ms:.2f} ms",
            )

    def _check_result(self, step: _Step, result: StepResult) -> dict[str, SequenceOutput]:
        """Validates the worker's outputs against what the step allowed, before changing any state."""
        outputs_by_id = {output.request_id: output for output in result.outputs}
        for request_id in outputs_by_id.keys() - step.scheduled.keys():
            raise ValueError(f"step {step.step_id}: output for {request_id!r}, which the step did not run")
        for request_id, scheduled in step.scheduled.items():
            output = outputs_by_id.get(request_id)
            num_emitted = len(output.token_ids) if output is not None else 0
            if not scheduled.can_emit(num_emitted):
                raise ValueError(
                    f"step {step.step_id}: worker emitted {num_emitted} tokens for {request_id!r} "
                    f"(scheduled {scheduled})"
                )
            if output is not None and not 0 <= output.num_kv_written_tokens <= scheduled.num_positions:
                raise ValueError(
                    f"step {step.step_id}: worker reports KV written for {output.num_kv_written_tokens} "
                    f"positions of {request_id!r}; the step reached {scheduled.num_positions}"
                )
        return outputs_by_id

    def _apply_output(
        self, request: Request, scheduled: ScheduledTokens, output: SequenceOutput | None
    ) -> RequestOutput | None:
        new_token_ids, status = request.apply_step_output(scheduled, output, self.config.max_model_len)
        if output is not None:
            self.stats.count_speculation(
                output.num_draft_tokens, output.num_accepted_tokens, output.proposer, output.draft_tree_depth
            )
            # Before a finishing request releases its blocks: the KV of its committed tokens stays reusable.
            self._cache_blocks(request, output.num_kv_written_tokens)
        if not new_token_ids:
            return None  # a prefill chunk short of the prompt's end
        if request.num_output_tokens == len(new_token_ids):  # its first tokens: the prompt is processed
            self.stats.num_prompt_tokens += request.num_prompt_tokens
        text = request.detokenizer.next_text_delta(status is not None) if request.detokenizer is not None else ""
        if status is not None:
            self._finish(request, status)
        self.stats.num_emitted_tokens += len(new_token_ids)
        self.stats.num_sequence_steps += 1
        if output is None:
            return request.make_output(new_token_ids, text)
        num_new = len(new_token_ids)
        return request.make_output(new_token_ids, text, output.logprobs[:num_new], output.top_logprobs[:num_new])

    def _cache_blocks(self, request: Request, num_kv_written_tokens: int) -> None:
        """Offers the request's full blocks of committed tokens with every model's KV written to the cache."""
        if self.block_manager.has_blocks(request.request_id):
            num_written = min(num_kv_written_tokens, request.num_tokens)  # tokens after a stop are not committed
            self.block_manager.cache_blocks(request.request_id, self._block_hashes(request), num_written)

    def _is_in_flight(self, request_id: str) -> bool:
        return any(request_id in step.scheduled for step in self._in_flight)

    def _is_certain_to_finish(self, request: Request) -> bool:
        """Whether steps in flight end the request by length even if they emit only one token each."""
        num_sure = sum(
            1 for step in self._in_flight if (s := step.scheduled.get(request.request_id)) is not None and s.is_sampling
        )
        return num_sure > 0 and (
            request.num_output_tokens + num_sure >= request.max_tokens
            or request.num_tokens + num_sure >= self.config.max_model_len
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        self._release_when_idle(request)

    def _settle_blocks(self, request_id: str) -> None:
        """After a result: release a finished request, or free a running one's over-reserved blocks."""
        request = self._requests.get(request_id)
        if request is None:
            return  # finished by this result and released at once
        if request.is_finished:
            self._release_when_idle(request)
        elif request.status is RequestStatus.RUNNING:
            # num_computed_tokens includes the worst case of a step still in flight, so the
            # blocks that step may write are kept.
            self.block_manager.trim(request_id, request.num_computed_tokens)

    def _release_when_idle(self, request: Request) -> None:
        """Frees a finished request's blocks and forgets it, unless a step in flight still uses them.

        The worker is told to drop it at the next step.
        """
        if self._is_in_flight(request.request_id):
            return  # released by update() of the last step that holds it
        if self.block_manager.has_blocks(request.request_id):
            self.block_manager.free(request.request_id)
        if request.is_held_by_worker:
            self._worker_drop_ids.append(request.request_id)
            request.is_held_by_worker = False
        del self._requests[request.request_id]
        logger.debug(
            "released %s (%s); %d free blocks", request.request_id, request.finish_reason, self.num_free_blocks
        )
