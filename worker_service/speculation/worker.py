"""The worker: per-request state, and one propose -> score -> accept step.

`Worker.execute` takes a `StepRequest` and returns a `StepResult`. All
sequences of a step — prefill chunks, plain decodes and speculating decodes
with any number of drafts — run in ONE target forward pass; the batch is never
split into a speculative and a non-speculative pass.
"""

import collections
import contextlib
import dataclasses
import itertools
import logging
import time

import torch

from specdec import step
from worker_service.runtime.eagle3_head import Eagle3Head
from worker_service.runtime.runner import ModelRunner, SequenceChunk
from worker_service.speculation import structured
from worker_service.speculation.config import DEFAULT_NUM_SPECULATIVE_TOKENS, WorkerConfig
from worker_service.speculation.logits_processing import process_logits
from worker_service.speculation.proposers import Proposal, Proposer, num_matching
from worker_service.speculation.proposers.combined import CombinedProposer
from worker_service.speculation.proposers.draft import DraftProposer
from worker_service.speculation.proposers.eagle3 import Eagle3Proposer
from worker_service.speculation.proposers.ngram import NgramProposer
from worker_service.speculation.proposers.preview import PreviewingProposer
from worker_service.speculation.proposers.suffix import SuffixProposer
from worker_service.speculation.proposers.trees import chain_length, tree_depth
from worker_service.speculation.request_state import (
    InvalidStepError,
    RequestState,
    apply_cached,
    check_cached,
    check_schedulable,
    new_state,
)
from worker_service.speculation.scorers import SCORERS
from worker_service.speculation.verify import verify

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Drafts:
    """What the draft stage hands on, per scheduled sequence."""

    token_ids: list[list[int]]  # the drafts scored (forced tokens, or the proposer's, maybe cut)
    probs: torch.Tensor | None  # [B, K, V] draft probabilities; None: one-hot drafts
    sources: list[str] | None  # the proposer of each sequence's drafts; None: the configured one
    parents: list[list[int] | None]  # a tree's parent rows; None: a chain
    ranks: list[list[int] | None]  # the order a tree's rows were chosen in (None: row order)
    proposed: list[list[int]]  # the proposer's own drafts, before a constraint cut or replaced them
    proposed_parents: list[list[int] | None]  # ... and their tree

    @classmethod
    def none(cls, num_seqs: int) -> "Drafts":
        empty, nothing = [[] for _ in range(num_seqs)], [None] * num_seqs
        return cls(empty, None, None, nothing, nothing, empty, nothing)

    @classmethod
    def of(cls, proposal: Proposal, num_seqs: int) -> "Drafts":
        parents = proposal.parents or [None] * num_seqs
        return cls(
            proposal.draft_token_ids,
            proposal.draft_probs,
            proposal.sources,
            parents,
            [proposal.ranks_of(i) for i in range(num_seqs)],
            proposal.draft_token_ids,
            parents,
        )


class StageTimer:
    """Wall time per stage name, summed over the stage's spans (a stage may run in several pieces)."""

    def __init__(self):
        self.ms: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[stage] += (time.perf_counter() - start) * 1e3


class Worker:
    """Holds the target (and draft model or EAGLE-3 head) and the requests' cached state."""

    def __init__(
        self,
        config: WorkerConfig,
        target: ModelRunner,
        draft: ModelRunner | None = None,
        head: Eagle3Head | None = None,
    ):
        self.config = config
        self.target = target
        self.draft = draft
        self.head = head
        self.proposer = self._make_proposer()
        self.score = SCORERS[config.scorer]
        model_limit = getattr(target.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        self.requests: dict[str, RequestState] = {}
        self.block_size: int | None = None
        self.num_blocks = 0
        self._grammars: structured.Grammars | None = None  # built with the first constrained request

    def _make_proposer(self) -> Proposer | None:
        """The configured proposer; several at once run as one CombinedProposer."""
        names = [n for n in self.config.proposer_names if n != "none"]
        proposers = {name: self._make_one(name) for name in names}
        if len(proposers) > 1:  # each drafts at most its own default k (and the worker's k)
            return CombinedProposer(
                proposers,
                {
                    name: min(DEFAULT_NUM_SPECULATIVE_TOKENS[name], self.config.num_speculative_tokens)
                    for name in proposers
                },
            )
        proposer = next(iter(proposers.values()), None)
        if proposer is not None and proposer.reports_match and self.config.draft_previews:
            return PreviewingProposer(proposer)
        return proposer

    def _make_one(self, name: str) -> Proposer:
        if name == "ngram":
            return NgramProposer(self.config.ngram_min, self.config.ngram_max, self.config.draft_tree_width)
        if name == "draft":
            if self.draft is None:
                raise ValueError("proposer 'draft' needs a draft model runner")
            if self.draft.vocab_size != self.target.vocab_size:
                raise ValueError(
                    f"the draft's vocabulary ({self.draft.vocab_size}) differs from the target's "
                    f"({self.target.vocab_size})"
                )
            return DraftProposer(self.draft)
        if name == "suffix":
            return SuffixProposer(self.config.suffix_cache_tokens, self.config.draft_tree_width)
        if self.head is None:
            raise ValueError("proposer 'eagle3' needs an EAGLE-3 head")
        return Eagle3Proposer(self.head, self.target, tree_width=self.config.draft_tree_width)

    @property
    def eos_token_ids(self) -> list[int]:
        """The target's end-of-sequence tokens (its generation config's)."""
        eos = self.target.model.generation_config.eos_token_id
        return eos if isinstance(eos, list) else ([eos] if eos is not None else [])

    @property
    def grammars(self) -> structured.Grammars:
        """The structured-output grammars (the tokenizer is read from the target's checkpoint once)."""
        if self._grammars is None:
            from worker_service.runtime.loader import load_tokenizer

            def tokenizer_json() -> str:  # read on the compile thread, not the step loop
                return load_tokenizer(self.config.model).backend_tokenizer.to_str()

            self._grammars = structured.Grammars(tokenizer_json, self.target.vocab_size, self.eos_token_ids)
        return self._grammars

    @property
    def is_ready(self) -> bool:
        return self.block_size is not None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Target + draft (or head) KV bytes of one block."""
        return sum(owner.kv_spec.bytes_per_block(block_size) for owner in self._kv_owners())

    def _kv_owners(self) -> list:
        """Every model with a paged KV cache on the same block ids."""
        return [owner for owner in (self.target, self.draft, self.head) if owner is not None]

    def drop_requests(self) -> None:
        """Forgets every request (a new scheduler session starts)."""
        self._release(list(self.requests))

    def _release(self, request_ids) -> None:
        """Forgets these requests (unknown ids are ignored); the proposer sees their state first."""
        dropped = [self.requests.pop(rid) for rid in request_ids if rid in self.requests]
        if self.proposer is not None and dropped:
            self.proposer.release(dropped)

    def init_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocates the target's and the draft's caches (same block ids); drops every request."""
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidStepError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        if (num_blocks, block_size) != (self.num_blocks, self.block_size):
            self.drop_requests()
            for owner in self._kv_owners():
                owner.init_cache(num_blocks, block_size)
            self.num_blocks, self.block_size = num_blocks, block_size
        return self.kv_bytes_per_block(block_size) * num_blocks

    def execute(self, request: step.StepRequest) -> step.StepResult:
        """Runs one step. Raises InvalidStepError (state unchanged) for a step it cannot run."""
        start = time.perf_counter()
        if not self.is_ready:
            raise InvalidStepError("the KV cache is not initialised: call InitCache first")
        scheduled = self._apply(request)
        stats = step.StepStats()
        outputs = self._run(scheduled, stats) if scheduled else []
        stats.total_ms = (time.perf_counter() - start) * 1e3
        return step.StepResult(step_id=request.step_id, outputs=outputs, stats=stats)

    def _apply(self, request: step.StepRequest) -> list[RequestState]:
        """Validates the whole step, then updates the cached state; returns the scheduled requests."""
        finished = set(request.finished_request_ids)
        staged = {rid: s for rid, s in self.requests.items() if rid not in finished}
        news = []
        for r in request.new_requests:
            if r.request_id in staged or any(n.request_id == r.request_id for n in news):
                raise InvalidStepError(f"request {r.request_id!r} is already running on this worker")
            news.append(new_state(r, self.target.vocab_size, self.num_blocks))
        for c in request.cached_requests:
            check_cached(c, staged.get(c.request_id), self.num_blocks)
        originals = {c.request_id: dataclasses.replace(staged[c.request_id]) for c in request.cached_requests}
        for c in request.cached_requests:
            apply_cached(c, staged[c.request_id])
        scheduled = news + [staged[c.request_id] for c in request.cached_requests]
        try:
            for state in scheduled:
                check_schedulable(
                    state,
                    self.block_size,
                    self.max_model_len,
                    self.max_num_speculative_tokens,
                    self.max_draft_tree_width,
                )
        except InvalidStepError:
            for rid, original in originals.items():  # roll back: the step is rejected whole
                vars(staged[rid]).update(vars(original))
            raise
        self._release(finished)
        self.requests.update({s.request_id: s for s in news})
        for state in news:
            if state.is_constrained:  # compiles beside the steps; the first sampled position waits for it
                self.grammars.start(state.grammar)
        return scheduled

    @property
    def max_num_speculative_tokens(self) -> int:
        """The most drafts per sequence and step this worker proposes (its K; 0 without a proposer)."""
        return self.config.num_speculative_tokens if self.proposer is not None else 0

    @property
    def max_draft_tree_width(self) -> int:
        """The most children per draft the scheduler may ask for (1: chains only)."""
        return self.config.draft_tree_width if self.proposer is not None else 1

    def _num_drafts(self, state: RequestState) -> int:
        """The drafts to ask of the proposer: the scheduler's k for a decode, fewer only near max_model_len."""
        if state.num_tokens - state.num_computed_tokens != 1:
            return 0
        return self._within_model_len(state, state.num_speculative_tokens)

    def _within_model_len(self, state: RequestState, num_drafts: int) -> int:
        """At most `num_drafts` drafts, fewer where they would pass max_model_len."""
        return max(min(num_drafts, self.max_model_len - state.num_tokens - 1), 0)

    def _run(self, scheduled: list[RequestState], stats: step.StepStats) -> list[step.SequenceOutput]:
        """One step in four stages: draft, score (the target's one forward), verify, commit."""
        timer = StageTimer()
        with timer("propose"):
            drafts = self._draft(scheduled)
        with timer("score"):
            chunks = [self._chunk(s, d, p) for s, d, p in zip(scheduled, drafts.token_ids, drafts.parents)]
            logits = self.score(self.target, chunks)  # [sum(num_logits), V]
        with timer("verify"):
            sampling_rows = [i for i, c in enumerate(chunks) if c.num_logits > 0]
            result = self._verify(scheduled, logits, drafts, sampling_rows)
            outputs = self._commit(scheduled, chunks, drafts, sampling_rows, result)
        with timer("propose"):  # the proposer's catch-up and previews: its work, not verification
            self._after_step(scheduled, chunks, sampling_rows, outputs)
        with timer("verify"):
            self._report_kv(scheduled, sampling_rows, outputs)
        stats.propose_ms, stats.score_ms, stats.verify_ms = (timer.ms[n] for n in ("propose", "score", "verify"))
        stats.num_speculating_seqs = sum(1 for d in drafts.token_ids if d)
        return list(outputs.values())

    def _draft(self, scheduled: list[RequestState]) -> Drafts:
        """Each sequence's drafts: the tokens its constraint forces, else the proposer's (cut where the grammar
        forbids one), up to the scheduler's k."""
        num_slots = [self._num_drafts(s) for s in scheduled]
        is_constrained = any(s.is_constrained for s in scheduled)
        forced = self._forced_drafts(scheduled, num_slots) if is_constrained else [[] for _ in scheduled]
        # The proposer drafts where the constraint forces nothing, unless the scheduler's k was for forced tokens.
        num_drafts = [0 if f or s.forced_drafts_only else k for s, k, f in zip(scheduled, num_slots, forced)]
        drafts = Drafts.none(len(scheduled))
        if any(num_drafts):  # every k = 0: a plain step, the proposer is not called
            drafts = Drafts.of(self.proposer.propose(scheduled, num_drafts), len(scheduled))
        if not is_constrained:
            return drafts
        # A constrained sequence drafts the tree's first chain (masks follow one prefix).
        token_ids, parents = list(drafts.token_ids), list(drafts.parents)
        for i, state in enumerate(scheduled):
            if state.is_constrained and parents[i] is not None:
                token_ids[i], parents[i] = token_ids[i][: chain_length(parents[i])], None
        token_ids, probs, sources = self._constrain_drafts(scheduled, forced, token_ids, drafts.probs, drafts.sources)
        parents = [None if f else p for p, f in zip(parents, forced)]
        return dataclasses.replace(drafts, token_ids=token_ids, probs=probs, sources=sources, parents=parents)

    def _verify(self, scheduled: list[RequestState], logits: torch.Tensor, drafts: Drafts, sampling_rows: list[int]):
        """The emitted tokens of the sequences that sample (`sampling_rows`): constrained rows' logits masked,
        each row processed along its own prefix (penalties, bias, min_tokens), then each draft accepted or not
        by the accept rule in verify.py."""
        states = [scheduled[i] for i in sampling_rows]
        token_ids = [drafts.token_ids[i] for i in sampling_rows]
        parents = [drafts.parents[i] for i in sampling_rows]
        if any(s.is_constrained for s in scheduled):
            logits = self._mask(logits, states, token_ids)
        logits = process_logits(logits, states, token_ids, parents)  # [N, V]
        return verify(states, logits, token_ids, None if drafts.probs is None else drafts.probs[sampling_rows], parents)

    def _commit(
        self,
        scheduled: list[RequestState],
        chunks: list[SequenceChunk],
        drafts: Drafts,
        sampling_rows: list[int],
        result,
    ) -> dict[str, step.SequenceOutput]:
        """Moves each tree's accepted path where a chain's would be, advances every sequence past its scheduled
        tokens and appends the emitted ones (_accept); the outputs, with what each sequence drafted and accepted."""
        parents = drafts.parents
        if any(p is not None for p in parents):
            self._keep_paths(scheduled, chunks, sampling_rows, parents, result.paths)
        outputs = {s.request_id: step.SequenceOutput(request_id=s.request_id, token_ids=[]) for s in scheduled}
        for state in scheduled:
            state.num_computed_tokens += state.scheduled_new_tokens
        for row, i in enumerate(sampling_rows):
            out = outputs[scheduled[i].request_id]
            self._accept(
                scheduled[i], drafts.token_ids[i], drafts.proposed[i], drafts.proposed_parents[i], result, row, out
            )
            if drafts.token_ids[i]:
                out.proposer = drafts.sources[i] if drafts.sources is not None else self.config.proposer
            if parents[i] is not None:
                out.draft_tree_depth = tree_depth(parents[i])
                order = drafts.ranks[i] or range(1, len(parents[i]) + 1)  # a proposer that gave none: rows in order
                out.accepted_draft_ranks = [order[path_row - 1] for path_row in result.paths[row]]
        return outputs

    def _after_step(
        self,
        scheduled: list[RequestState],
        chunks: list[SequenceChunk],
        sampling_rows: list[int],
        outputs: dict[str, step.SequenceOutput],
    ) -> None:
        """The proposer hears the positions committed this step (the chunk's tokens and accepted drafts); a
        previewing proposer looks up each sampled sequence's next drafts now."""
        if self.proposer is None:
            return
        self.proposer.after_step(
            scheduled, chunks, [s.num_computed_tokens - c.start_pos for s, c in zip(scheduled, chunks)]
        )
        if isinstance(self.proposer, PreviewingProposer) and sampling_rows:
            sampled = [scheduled[i] for i in sampling_rows]
            caps = [self._within_model_len(s, self.max_num_speculative_tokens) for s in sampled]
            for state, preview in zip(sampled, self.proposer.preview(sampled, caps)):
                outputs[state.request_id].next_draft = preview

    def _report_kv(
        self, scheduled: list[RequestState], sampling_rows: list[int], outputs: dict[str, step.SequenceOutput]
    ) -> None:
        """What the scheduler needs of the KV after the step: the positions every model wrote, and the tokens
        a constraint forces next (the next step's free drafts)."""
        for state in scheduled:
            outputs[state.request_id].num_kv_written_tokens = self._num_kv_written_tokens(state)
        for i in sampling_rows:  # their matchers are built (a prompt still prefilling may wait for its grammar)
            outputs[scheduled[i].request_id].num_forced_tokens_next = self._num_forced_next(scheduled[i])

    def _forced_drafts(self, scheduled: list[RequestState], num_slots: list[int]) -> list[list[int]]:
        """Per sequence, the tokens its constraint forces next, up to its k (none with --no-forced-drafts)."""
        if not self.config.forced_drafts:
            return [[] for _ in scheduled]
        return [
            structured.forced_tokens(self.grammars.matcher(s), k) if s.is_constrained and k else []
            for s, k in zip(scheduled, num_slots)
        ]

    def _num_forced_next(self, state: RequestState) -> int:
        """The tokens the constraint forces after the emitted ones (at most K): the next step's free drafts."""
        if not (state.is_constrained and self.config.forced_drafts and self.max_num_speculative_tokens):
            return 0
        return len(structured.forced_tokens(self.grammars.matcher(state), self.max_num_speculative_tokens))

    def _constrain_drafts(
        self,
        scheduled: list[RequestState],
        forced: list[list[int]],
        drafts: list[list[int]],
        draft_probs,
        sources: list[str] | None,
    ):
        """Constrained sequences' drafts: the grammar's forced tokens (proposer "forced", one-hot draft
        probabilities), else the proposer's drafts cut at the first one the grammar forbids."""
        drafts, sources = list(drafts), list(sources) if sources is not None else None
        longest = max(map(len, forced), default=0)
        if draft_probs is not None and draft_probs.shape[1] < longest:  # the proposer drafted less deep elsewhere
            draft_probs = torch.nn.functional.pad(draft_probs, (0, 0, 0, longest - draft_probs.shape[1]))
        for i, state in enumerate(scheduled):
            if forced[i]:
                drafts[i] = forced[i]
                if sources is None:
                    sources = [self.config.proposer] * len(scheduled)
                sources[i] = structured.FORCED
                if draft_probs is not None:
                    draft_probs[i].zero_()
                    device = draft_probs.device
                    draft_probs[
                        i, torch.arange(len(drafts[i]), device=device), torch.tensor(drafts[i], device=device)
                    ] = 1.0
            elif state.is_constrained and drafts[i]:
                sampled_from_p = draft_probs is not None and not state.sampling.is_greedy
                drafts[i] = structured.valid_drafts(
                    self.grammars.matcher(state), drafts[i], keep_first_forbidden=sampled_from_p
                )
        return drafts, draft_probs, sources

    def _mask(self, logits, states: list[RequestState], drafts: list[list[int]]):
        """The logits of constrained sequences' rows masked by the grammar state of each row's prefix."""
        rows, bitmasks, offset = [], [], 0
        for state, draft in zip(states, drafts):
            if state.is_constrained:
                rows.append(offset)
                bitmasks.append(structured.masks(self.grammars.matcher(state), draft, self.target.vocab_size))
            offset += len(draft) + 1
        return structured.apply_masks(logits, rows, bitmasks, self.eos_token_ids)

    def _num_kv_written_tokens(self, state: RequestState) -> int:
        """Positions whose KV every model has written: the target's computed tokens, the proposer's if it has KV."""
        num_proposer = self.proposer.num_kv_tokens(state) if self.proposer is not None else None
        return state.num_computed_tokens if num_proposer is None else min(state.num_computed_tokens, num_proposer)

    @staticmethod
    def _chunk(state: RequestState, drafts: list[int], parents: list[int] | None = None) -> SequenceChunk:
        """The sequence's target rows: its scheduled tokens, then its drafts (a chain, or a tree after the one
        pending token: drafts come only after it)."""
        begin = state.num_computed_tokens
        tokens = state.token_ids[begin : begin + state.scheduled_new_tokens] + drafts
        completes = begin + state.scheduled_new_tokens == state.num_tokens
        if parents is not None:
            assert state.scheduled_new_tokens == 1 and len(parents) == len(drafts)
            parents = [-1, *parents]
        return SequenceChunk(
            tokens, begin, state.block_table, num_logits=(1 + len(drafts)) if completes else 0, parents=parents
        )

    def _keep_paths(
        self,
        scheduled: list[RequestState],
        chunks: list[SequenceChunk],
        sampling_rows: list[int],
        parents: list[list[int] | None],
        paths: list[list[int]],
    ) -> None:
        """Moves each tree's accepted path where a chain's accepted drafts would be: its K/V in the target's
        cache, and its rows of the features the target kept for an EAGLE-3 head (the head catches up on
        committed positions in order, proposers/eagle3.py)."""
        offsets = list(itertools.accumulate((len(c.token_ids) for c in chunks), initial=0))
        aux = self.target.last_aux_hidden
        order = list(range(offsets[-1]))  # aux row per packed row
        for row, i in enumerate(sampling_rows):
            if parents[i] is None:
                continue
            self.target.keep_path(chunks[i].block_table, chunks[i].start_pos, paths[row])
            for depth, path_row in enumerate(paths[row], start=1):
                order[offsets[i] + depth] = offsets[i] + path_row
        if aux is not None and order != list(range(offsets[-1])):
            self.target.last_aux_hidden = aux[torch.tensor(order, device=aux.device)]

    def _accept(
        self,
        state: RequestState,
        drafts: list[int],
        proposed: list[int],
        proposed_parents,
        result,
        row: int,
        out: step.SequenceOutput,
    ) -> None:
        """Appends the emitted tokens; accepted drafts' K/V (already in the cache) count as computed.

        `proposed`: the proposer's own drafts (a tree where `proposed_parents` is given), which a constraint may
        have cut or replaced (`drafts` were scored); the proposer hears how many of its own drafts the emitted
        tokens confirm."""
        emitted = result.token_ids[row]
        num_accepted = len(emitted) - 1
        num_tokens_before = state.num_tokens
        state.token_ids.extend(emitted)
        state.num_computed_tokens += num_accepted
        if state.matcher is not None:
            structured.advance(state.matcher, emitted)
        if self.proposer is not None:
            num_confirmed = (
                num_accepted
                if proposed is drafts
                else min(num_matching(proposed, emitted, proposed_parents), num_accepted)
            )
            self.proposer.after_verify(state, num_tokens_before, len(proposed), num_confirmed)
        out.token_ids = emitted
        out.logprobs = result.logprobs[row] if state.return_logprobs else []
        out.top_logprobs = result.top_logprobs[row] if state.return_logprobs else []
        out.num_draft_tokens, out.num_accepted_tokens = len(drafts), num_accepted
