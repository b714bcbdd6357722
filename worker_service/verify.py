"""Turns a step's target logits into emitted tokens: keyed sampling, or rejection sampling of the drafts.

Row j of a sequence samples the token at absolute position ``num_tokens + j``
(``num_tokens``: prompt + every token emitted so far): a plain step samples
position n, a verify step with k drafts positions n..n+k. Each row's
randomness is keyed by (request seed, that position), and the accept rule
(worker_service/rejection_sampler.py) emits, for n-gram drafts, exactly the
tokens a plain step would have sampled; so a seeded request's tokens depend
neither on the batch nor on n-gram speculation.
"""

from dataclasses import dataclass
import itertools

import torch

from worker_service.rejection_sampler import RejectionSampler
from worker_service.request_state import RequestState
from worker_service.sampling import logits_to_probs, sampling_tensors

_sampler = RejectionSampler()


@dataclass
class VerifyResult:
    token_ids: list[list[int]]   # emitted tokens per sequence: accepted drafts + one recovered/bonus token
    logprobs: list[list[float]]  # target log-probability of each emitted token (empty unless requested)


def verify(states: list[RequestState], logits: torch.Tensor, drafts: list[list[int]],
           draft_probs: torch.Tensor | None) -> VerifyResult:
    """`logits` holds 1 + len(drafts[i]) rows per sequence, in order (`[N, V]`)."""
    rows_per_seq = [len(d) + 1 for d in drafts]
    if all(s.sampling.is_greedy for s in states):
        token_ids = _greedy(logits, drafts)
    else:
        row_params = [s.sampling for s, n in zip(states, rows_per_seq) for _ in range(n)]
        probs = logits_to_probs(logits, *sampling_tensors(row_params, logits.device))  # [N, V]
        token_ids = _rejection_sample(states, probs, drafts, draft_probs)
    logprobs = [[] for _ in states]
    if any(s.return_logprobs for s in states):
        logprobs = _logprobs(logits, rows_per_seq, token_ids)
    return VerifyResult(token_ids, logprobs)


def _greedy(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """Temperature 0: accept drafts while they equal the target argmax; then emit the argmax.

    This is the rejection rule with one-hot q and p (accept iff x == argmax q;
    the recovered token is argmax q at the first mismatch, the bonus token
    argmax q after the last draft), without building vocabulary-sized tensors.
    """
    targets = logits.argmax(dim=-1).tolist()  # [N]
    token_ids, offset = [], 0
    for draft in drafts:
        emitted = []
        for j, target in enumerate(targets[offset: offset + len(draft) + 1]):
            emitted.append(target)
            if j == len(draft) or draft[j] != target:
                break
        token_ids.append(emitted)
        offset += len(draft) + 1
    return token_ids


def _rejection_sample(states: list[RequestState], probs: torch.Tensor, drafts: list[list[int]],
                      draft_probs: torch.Tensor | None) -> list[list[int]]:
    """Pads the rows to [B, K+1, V] and runs the sampler; K = 0 is a plain sampling step."""
    num_seqs, num_vocab = len(states), probs.shape[-1]
    num_spec = max(len(d) for d in drafts)
    device = probs.device
    if num_spec == 0:
        target_probs = probs.unsqueeze(1)  # [B, 1, V]
    else:
        target_probs = torch.full((num_seqs, num_spec + 1, num_vocab), 1.0 / num_vocab, device=device)  # [B, K+1, V]
        offsets = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]
        for b, d in enumerate(drafts):
            target_probs[b, : len(d) + 1] = probs[offsets[b]: offsets[b + 1]]
    draft_ids = torch.tensor([d + [0] * (num_spec - len(d)) for d in drafts], dtype=torch.int64,
                             device=device).view(num_seqs, num_spec)  # [B, K]
    num_draft_tokens = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=device)  # [B]
    is_greedy = torch.tensor([s.sampling.is_greedy for s in states], device=device)  # [B]
    if draft_probs is not None:
        draft_probs = draft_probs[:, :num_spec].to(device)  # [B, K, V]
    output, num_emitted = _sampler(target_probs, draft_ids, num_draft_tokens, draft_probs, is_greedy,
                                   [s.sampling.seed for s in states], [s.num_tokens for s in states])
    return [row[:n] for row, n in zip(output.tolist(), num_emitted.tolist())]


def _logprobs(logits: torch.Tensor, rows_per_seq: list[int], token_ids: list[list[int]]) -> list[list[float]]:
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    out, offset = [], 0
    for n_rows, tokens in zip(rows_per_seq, token_ids):
        rows = torch.arange(offset, offset + len(tokens))
        out.append(log_probs[rows, torch.tensor(tokens)].tolist())
        offset += n_rows
    return out
