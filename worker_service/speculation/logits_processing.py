"""A request's logits processing (min_tokens, logit_bias, the penalties) at every row it samples.

A verify step scores a sequence's rows for positions ``num_tokens + depth``:
row 0 the position after the emitted tokens, a draft's row the position after
that draft. Each row must see the logits plain decoding would see at its
position, so its prefix is the emitted tokens *and the drafts on the row's
own path* (a chain's row j: drafts 0..j-1; a tree's row: its ancestors and
itself). Penalties count the tokens of that prefix and min_tokens counts its
output tokens; a step's starting counts would be wrong from the second row
on. Each row is processed on its own, so its result does not depend on the
batch.

Order (vLLM's): min_tokens holds back the stop tokens, logit_bias adds, then
the repetition penalty (on prompt and output tokens: a positive logit is
divided by it, a negative one multiplied), the frequency penalty (times each
token's count in the output) and the presence penalty (once per token in the
output). Temperature, min_p, top-k and top-p come after, in sampling.py.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_service.speculation.request_state import RequestState


def row_paths(drafts: list[int], parents: list[int] | None) -> list[list[int]]:
    """The drafts on each of a sequence's 1 + len(drafts) rows' paths from the root, in order.

    ``parents[i]``: the parent row of draft i (row i + 1; 0 is the root); None: a chain."""
    if parents is None:
        return [drafts[:row] for row in range(len(drafts) + 1)]
    paths = [[]]
    for i, parent in enumerate(parents):
        paths.append(paths[parent] + [drafts[i]])  # a parent row comes before its children
    return paths


def process_logits(
    logits: torch.Tensor,  # [N, V]: 1 + len(drafts[i]) rows per sequence, in order
    states: list[RequestState],
    drafts: list[list[int]],
    parents: list[list[int] | None],
) -> torch.Tensor:  # [N, V] float32 where any sequence is processed, else `logits` itself
    """The logits with each processed sequence's rows processed along their own prefixes."""
    if not any(s.sampling.is_processed for s in states):
        return logits
    logits = logits.float().clone()  # [N, V]
    offset = 0
    for state, seq_drafts, seq_parents in zip(states, drafts, parents):
        num_rows = len(seq_drafts) + 1
        if state.sampling.is_processed:
            rows = logits[offset : offset + num_rows]  # [R, V] (a view: processed in place)
            process_rows(rows, state, row_paths(seq_drafts, seq_parents))
        offset += num_rows
    return logits


def process_rows(rows: torch.Tensor, state: RequestState, paths: list[list[int]]) -> None:
    """Processes one sequence's rows in place (`rows` `[R, V]` float32; `paths[r]`: the drafts before row r).

    The penalties touch only the tokens of the prompt, the output and the drafts: they are applied on those
    columns alone (`[R, C]`, C far below V), so a row costs what its context holds, not the vocabulary."""
    sampling, device = state.sampling, rows.device
    output = state.token_ids[state.num_prompt_tokens :]
    if sampling.min_tokens and sampling.stop_token_ids:
        held = [r for r, path in enumerate(paths) if len(output) + len(path) < sampling.min_tokens]
        if held:
            stop_ids = torch.tensor(sampling.stop_token_ids, device=device)  # [S]
            rows[torch.tensor(held, device=device).unsqueeze(1), stop_ids] = float("-inf")
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], device=device)  # [B]
        rows[:, ids] += torch.tensor([b for _, b in sampling.logit_bias], device=device)
    if sampling.repetition_penalty != 1 or sampling.frequency_penalty or sampling.presence_penalty:
        _penalise(rows, state, output, paths)


def _penalise(rows: torch.Tensor, state: RequestState, output: list[int], paths: list[list[int]]) -> None:
    """The repetition, frequency and presence penalties, on the columns of the tokens the rows have seen.

    The index lists go to torch through numpy (a list of a few hundred ints converts ~10x faster so), and the
    prompt's token set is kept on the state: a request pays for its prompt once, not at every step."""
    sampling, device = state.sampling, rows.device
    prompt = _prompt_tokens(state) if sampling.repetition_penalty != 1 else frozenset()
    columns = sorted(prompt.union(output, *paths))
    if not columns:
        return  # nothing seen yet: nothing to penalise
    column_of = {t: j for j, t in enumerate(columns)}
    counts = np.zeros(len(columns), dtype=np.float32)  # the emitted output's, then each row's path added
    np.add.at(counts, np.fromiter((column_of[t] for t in output), dtype=np.int64, count=len(output)), 1)
    row_counts = np.repeat(counts[None, :], len(paths), axis=0)  # [R, C]
    for r, path in enumerate(paths):
        np.add.at(row_counts[r], np.fromiter((column_of[t] for t in path), dtype=np.int64, count=len(path)), 1)
    row_counts = torch.from_numpy(row_counts).to(device)  # [R, C]
    column_ids = torch.from_numpy(np.array(columns, dtype=np.int64)).to(device)  # [C]
    sub = rows[:, column_ids]  # [R, C]
    if sampling.repetition_penalty != 1:
        in_prompt = np.fromiter((t in prompt for t in columns), dtype=bool, count=len(columns))
        seen = (row_counts > 0) | torch.from_numpy(in_prompt).to(device)  # [R, C]
        penalty = sampling.repetition_penalty
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if sampling.frequency_penalty:
        sub = sub - sampling.frequency_penalty * row_counts
    if sampling.presence_penalty:
        sub = sub - sampling.presence_penalty * (row_counts > 0)
    rows[:, column_ids] = sub


def _prompt_tokens(state: RequestState) -> frozenset[int]:
    """The set of the request's prompt tokens, made at its first penalised step and kept on the state."""
    if state.prompt_token_set is None:
        state.prompt_token_set = frozenset(state.token_ids[: state.num_prompt_tokens])
    return state.prompt_token_set
