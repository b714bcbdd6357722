"""Conversion between step dataclasses (specdec.step) and worker proto messages."""

from specdec import step
from specdec.v1 import worker_pb2 as pb


def _sampling_to_proto(s: step.RequestSampling) -> pb.RequestSampling:
    return pb.RequestSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        logprobs=s.logprobs,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=None if s.repetition_penalty == 1 else s.repetition_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        stop_token_ids=s.stop_token_ids,
        top_logprobs=s.top_logprobs,
    )


def shared_sampling_fields(m) -> dict:
    """The RequestSampling fields that the client's SamplingParams and the worker's RequestSampling messages
    both carry, under the same names and meaning (unset: their defaults)."""
    return dict(
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        logprobs=m.logprobs,
        min_p=m.min_p,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        min_tokens=m.min_tokens,
        top_logprobs=m.top_logprobs,
    )


def _sampling_from_proto(m: pb.RequestSampling, request_id: str) -> step.RequestSampling:
    """Raises ValueError naming the request when the parameters are invalid."""
    try:
        return step.RequestSampling(
            temperature=m.temperature,
            top_p=m.top_p,
            stop_token_ids=tuple(m.stop_token_ids),
            **shared_sampling_fields(m),
        )
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from exc


def step_request_to_proto(r: step.StepRequest) -> pb.ExecuteModelRequest:
    new = [
        pb.NewRequest(
            request_id=n.request_id,
            token_ids=n.token_ids,
            num_prompt_tokens=n.num_prompt_tokens,
            sampling=_sampling_to_proto(n.sampling),
            block_ids=n.block_ids,
            num_new_tokens=n.num_new_tokens,
            num_speculative_tokens=n.num_speculative_tokens,
            num_computed_tokens=n.num_computed_tokens,
            grammar=n.grammar,
            draft_tree_width=n.draft_tree_width,
        )
        for n in r.new_requests
    ]
    cached = [
        pb.CachedRequest(
            request_id=c.request_id,
            new_block_ids=c.new_block_ids,
            num_blocks_kept=c.num_blocks_kept,
            num_new_tokens=c.num_new_tokens,
            num_speculative_tokens=c.num_speculative_tokens,
            forced_drafts_only=c.forced_drafts_only,
            draft_tree_width=c.draft_tree_width,
        )
        for c in r.cached_requests
    ]
    return pb.ExecuteModelRequest(
        step_id=r.step_id, new_requests=new, cached_requests=cached, finished_request_ids=r.finished_request_ids
    )


def step_request_from_proto(m: pb.ExecuteModelRequest) -> step.StepRequest:
    """Raises ValueError (naming the request) for sampling parameters a step cannot use."""
    new = [
        step.NewRequest(
            request_id=n.request_id,
            token_ids=list(n.token_ids),
            num_prompt_tokens=n.num_prompt_tokens,
            sampling=_sampling_from_proto(n.sampling, n.request_id),
            block_ids=list(n.block_ids),
            num_new_tokens=n.num_new_tokens,
            num_speculative_tokens=n.num_speculative_tokens,
            num_computed_tokens=n.num_computed_tokens,
            grammar=n.grammar,
            draft_tree_width=n.draft_tree_width,
        )
        for n in m.new_requests
    ]
    cached = [
        step.CachedRequest(
            request_id=c.request_id,
            new_block_ids=list(c.new_block_ids),
            num_blocks_kept=c.num_blocks_kept,
            num_new_tokens=c.num_new_tokens,
            num_speculative_tokens=c.num_speculative_tokens,
            forced_drafts_only=c.forced_drafts_only,
            draft_tree_width=c.draft_tree_width,
        )
        for c in m.cached_requests
    ]
    return step.StepRequest(
        step_id=m.step_id, new_requests=new, cached_requests=cached, finished_request_ids=list(m.finished_request_ids)
    )


def step_result_to_proto(r: step.StepResult) -> pb.ExecuteModelResponse:
    outputs = [
        pb.SequenceOutput(
            request_id=o.request_id,
            token_ids=o.token_ids,
            logprobs=o.logprobs,
            top_logprobs=[pb.TopTokenLogprobs(token_ids=t.token_ids, logprobs=t.logprobs) for t in o.top_logprobs],
            num_draft_tokens=o.num_draft_tokens,
            num_accepted_tokens=o.num_accepted_tokens,
            num_kv_written_tokens=o.num_kv_written_tokens,
            proposer=o.proposer,
            num_forced_tokens_next=o.num_forced_tokens_next,
            draft_tree_depth=o.draft_tree_depth,
            accepted_draft_ranks=o.accepted_draft_ranks,
            next_draft=None
            if o.next_draft is None
            else pb.DraftPreview(num_drafts=o.next_draft.num_drafts, match_length=o.next_draft.match_length),
        )
        for o in r.outputs
    ]
    s = r.stats
    stats = pb.StepStats(
        propose_ms=s.propose_ms,
        score_ms=s.score_ms,
        verify_ms=s.verify_ms,
        total_ms=s.total_ms,
        num_speculating_seqs=s.num_speculating_seqs,
    )
    return pb.ExecuteModelResponse(step_id=r.step_id, outputs=outputs, stats=stats)


def step_result_from_proto(m: pb.ExecuteModelResponse) -> step.StepResult:
    outputs = [
        step.SequenceOutput(
            request_id=o.request_id,
            token_ids=list(o.token_ids),
            logprobs=list(o.logprobs),
            top_logprobs=[step.TopLogprobs(list(t.token_ids), list(t.logprobs)) for t in o.top_logprobs],
            num_draft_tokens=o.num_draft_tokens,
            num_accepted_tokens=o.num_accepted_tokens,
            num_kv_written_tokens=o.num_kv_written_tokens,
            proposer=o.proposer,
            num_forced_tokens_next=o.num_forced_tokens_next,
            draft_tree_depth=o.draft_tree_depth,
            accepted_draft_ranks=list(o.accepted_draft_ranks),
            next_draft=step.DraftPreview(o.next_draft.num_drafts, o.next_draft.match_length)
            if o.HasField("next_draft")
            else None,
        )
        for o in m.outputs
    ]
    s = m.stats
    stats = step.StepStats(
        propose_ms=s.propose_ms,
        score_ms=s.score_ms,
        verify_ms=s.verify_ms,
        total_ms=s.total_ms,
        num_speculating_seqs=s.num_speculating_seqs,
    )
    return step.StepResult(step_id=m.step_id, outputs=outputs, stats=stats)
