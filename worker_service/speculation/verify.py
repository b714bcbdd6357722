"""Turns a step's target logits into emitted tokens: keyed sampling, or rejection sampling of the drafts.

Row j of a sequence samples the token at absolute position ``num_tokens + j``
(``num_tokens``: prompt + every token emitted so far): a plain step samples
position n, a verify step with k drafts positions n..n+k. Each row's
randomness is keyed by (request seed, that position). Drafts without probabilities
(n-gram, suffix, EAGLE-3: one-hot) are accepted while they equal the row's own sample,
which is the accept rule of kernels/rejection_sampler.py for one-hot drafts:
every emitted token is the one a plain step would have sampled, so a seeded
request's tokens depend neither on the batch nor on that speculation. A draft
model's drafts with their probabilities go through the rejection sampler
(worker_service/speculation/rejection_sampler.py).

A sequence's drafts may form a tree (`parents`): row j then samples position
``num_tokens + depth(j)``, and the accepted path follows those samples from
the root (kernels/tree_acceptance.py, where the rule is argued exact). Tree
drafts are one-hot (no draft probabilities).
"""

from dataclasses import dataclass
import itertools

import torch

from kernels.sampling_cpu import argmax_last
from kernels.tree_acceptance import accept_tree
from specdec.step import TopLogprobs
from worker_service.speculation.keyed_random import STREAM_TOKEN
from worker_service.speculation.proposers.trees import row_depths
from worker_service.speculation.rejection_sampler import RejectionSampler
from worker_service.speculation.request_state import RequestState
from worker_service.speculation.sampling import logits_to_probs, sample_rows, sampling_tensors

_sampler = RejectionSampler()


@dataclass
class VerifyResult:
    token_ids: list[list[int]]  # emitted tokens per sequence: accepted drafts + one recovered/bonus token
    logprobs: list[list[float]]  # target log-probability of each emitted token (empty unless requested)
    top_logprobs: list[list[TopLogprobs]]  # the likeliest tokens at each emitted position (top_logprobs > 0)
    paths: list[list[int]]  # accepted draft rows per sequence (1-based; a chain's 1..a, a tree's path)


def verify(
    states: list[RequestState],
    logits: torch.Tensor,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None,
    parents: list[list[int] | None] | None = None,
) -> VerifyResult:
    """`logits` holds 1 + len(drafts[i]) rows per sequence, in order (`[N, V]`); `parents[i]`, where given, the
    parent row (0: the root, the sequence's first row) of each of drafts[i]: a tree."""
    rows_per_seq = [len(d) + 1 for d in drafts]
    if draft_probs is None or all(s.sampling.is_greedy for s in states):
        # One-hot drafts (chains and trees; greedy rows read no draft probabilities): each row's sample, then
        # the path it accepts.
        token_ids, paths = _accept_one_hot(states, logits, drafts, parents)
    else:
        assert parents is None or all(p is None for p in parents), "tree drafts are one-hot"
        row_params = [s.sampling for s, n in zip(states, rows_per_seq) for _ in range(n)]
        probs = logits_to_probs(logits, *sampling_tensors(row_params, logits.device))  # [N, V]
        token_ids = _rejection_sample(states, probs, drafts, draft_probs)
        paths = [list(range(1, len(t))) for t in token_ids]
    logprobs, top_logprobs = [[] for _ in states], [[] for _ in states]
    if any(s.return_logprobs for s in states):
        logprobs, top_logprobs = _logprobs(logits, states, rows_per_seq, paths, token_ids)
    return VerifyResult(token_ids, logprobs, top_logprobs, paths)


def _accept_one_hot(
    states: list[RequestState],
    logits: torch.Tensor,
    drafts: list[list[int]],
    parents: list[list[int] | None] | None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Every row's keyed sample y (argmax for greedy), at its position num_tokens + depth; then each sequence's
    accepted path: a chain accepts drafts while they equal y, a tree follows y from the root.

    This is the accept rule for one-hot drafts (kernels/rejection_sampler.py) computed on the rows themselves,
    so no [B, K+1, V] padding is built, and only the sampled rows get noise."""
    tree_parents = [
        [-1, *p] if p is not None else list(range(-1, len(d)))
        for d, p in zip(drafts, parents if parents is not None else [None] * len(drafts))
    ]
    row_params = [s.sampling for s, p in zip(states, tree_parents) for _ in p]
    sampled = [i for i, params in enumerate(row_params) if not params.is_greedy]
    targets = argmax_last(logits) if len(sampled) < len(row_params) else None  # [N]: the greedy rows' y
    if sampled:
        row_states = [s for s, p in zip(states, tree_parents) for _ in p]
        depth_of_row = [d for seq_parents in tree_parents for d in row_depths(seq_parents[1:])]
        index = torch.tensor(sampled, device=logits.device)  # [R]
        samples = sample_rows(
            logits if targets is None else logits[index],
            [row_params[i] for i in sampled],
            [row_states[i].sampling.seed for i in sampled],
            [row_states[i].num_tokens + depth_of_row[i] for i in sampled],
            STREAM_TOKEN,
        )  # [R]
        if targets is None:
            targets = samples  # [N]
        else:
            targets[index] = samples
    targets_host, token_ids, paths, offset = targets.tolist(), [], [], 0  # one copy to the host
    for draft, seq_parents in zip(drafts, tree_parents):
        rows = targets_host[offset : offset + len(seq_parents)]
        if parents is None or seq_parents[1:] == list(range(len(draft))):  # a chain
            emitted = _accepted_chain(rows, draft)
            path = list(range(1, len(emitted)))
        else:
            path, emitted = accept_tree(rows, [None, *draft], seq_parents)
        token_ids.append(emitted)
        paths.append(path)
        offset += len(seq_parents)
    return token_ids, paths


def _accepted_chain(targets: list[int], draft: list[int]) -> list[int]:
    """The emitted tokens of a chain: y_j while draft j equals it, then the y where they differ (or the bonus
    y after the last draft)."""
    for j, target in enumerate(targets):
        if j == len(draft) or draft[j] != target:
            return targets[: j + 1]
    raise AssertionError("a chain has one more row than drafts")


def _rejection_sample(
    states: list[RequestState], probs: torch.Tensor, drafts: list[list[int]], draft_probs: torch.Tensor | None
) -> list[list[int]]:
    """Pads the rows to [B, K+1, V] and runs the sampler; K = 0 is a plain sampling step."""
    num_seqs, num_spec = len(states), max(len(d) for d in drafts)
    device = probs.device
    target_probs = _pad_rows(probs, drafts, num_spec)  # [B, K+1, V]
    draft_ids = torch.tensor([d + [0] * (num_spec - len(d)) for d in drafts], dtype=torch.int64, device=device).view(
        num_seqs, num_spec
    )  # [B, K]
    num_draft_tokens = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=device)  # [B]
    is_greedy = torch.tensor([s.sampling.is_greedy for s in states], device=device)  # [B]
    if draft_probs is not None:
        draft_probs = draft_probs[:, :num_spec]  # [B, K, V]
    output, num_emitted = _sampler(
        target_probs,
        draft_ids,
        num_draft_tokens,
        draft_probs,
        is_greedy,
        [s.sampling.seed for s in states],
        [s.num_tokens for s in states],
    )
    rows = torch.cat([num_emitted.unsqueeze(1), output], dim=1).tolist()  # [B, 1 + K+1]: one copy to the host
    return [row[1 : 1 + row[0]] for row in rows]


def _pad_rows(probs: torch.Tensor, drafts: list[list[int]], num_spec: int) -> torch.Tensor:  # [B, K+1, V]
    """Sequence b's 1 + len(drafts[b]) rows of `probs` (`[N, V]`) at [b, :len + 1], in one scatter; uniform
    rows past them (never emitted)."""
    if num_spec == 0:
        return probs.unsqueeze(1)  # [B, 1, V]
    num_vocab, device = probs.shape[-1], probs.device
    seq_index = torch.tensor([b for b, d in enumerate(drafts) for _ in range(len(d) + 1)], device=device)  # [N]
    pos_index = torch.tensor([j for d in drafts for j in range(len(d) + 1)], device=device)  # [N]
    target_probs = torch.full((len(drafts), num_spec + 1, num_vocab), 1.0 / num_vocab, device=device)
    target_probs[seq_index, pos_index] = probs
    return target_probs


def _logprobs(
    logits: torch.Tensor,
    states: list[RequestState],
    rows_per_seq: list[int],
    paths: list[list[int]],
    token_ids: list[list[int]],
) -> tuple[list[list[float]], list[list[TopLogprobs]]]:
    """Each emitted token's log-probability in its row (the root's, then the accepted rows'), and where asked
    the row's likeliest tokens: a gather and a top-k on the device, and one copy of both to the host (on a GPU
    each copy waits for the GPU; token ids are exact in float64)."""
    starts = list(itertools.accumulate(rows_per_seq[:-1], initial=0))
    rows = [start + row for start, path in zip(starts, paths) for row in [0, *path]]
    columns = [t for tokens in token_ids for t in tokens]
    device = logits.device
    log_probs = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)  # [E, V]: emitted rows
    parts = [log_probs.gather(1, torch.tensor(columns, device=device)[:, None])]  # [E, 1]
    num_top = max(s.sampling.top_logprobs for s in states)
    if num_top:
        parts += log_probs.topk(num_top, dim=-1)  # values, ids: [E, num_top] each
    table = torch.cat([part.double() for part in parts], dim=1).tolist()  # [E, 1 + 2 num_top]
    flat = [row[0] for row in table]
    top_values = [row[1 : 1 + num_top] for row in table]
    top_ids = [[int(i) for i in row[1 + num_top :]] for row in table]
    out, top_out, offset = [], [], 0
    for state, tokens in zip(states, token_ids):
        out.append(flat[offset : offset + len(tokens)])
        n = state.sampling.top_logprobs
        top_out.append(
            [TopLogprobs(top_ids[e][:n], top_values[e][:n]) for e in range(offset, offset + len(tokens))] if n else []
        )
        offset += len(tokens)
    return out, top_out
