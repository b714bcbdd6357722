"""Turning target logits into token distributions, and sampling from them.

Small pure functions in the spirit of gpt-fast's ``logits_to_probs`` /
``sample``, batched with per-row parameters so one call serves a whole step.
Sampling is an exponential race, ``argmax(probs / E)`` with ``E ~ Exp(1)``,
which picks token v with probability ``probs[v]``; each row's noise is keyed
by (request seed, token position) (worker_service/speculation/keyed_random.py), so a
seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import sampling_cpu
from kernels.rejection_sampler import race
from kernels.sampling_cpu import argmax_last, softmax_last, top_k_top_p_rows
from specdec.step import RequestSampling
from worker_service.speculation.keyed_random import keyed_exponential, noise_keys


def sampling_tensors(
    params: Sequence[RequestSampling], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack per-request params into the ``(temperature, top_k, top_p, min_p)`` tensors
    that :func:`logits_to_probs` takes (top_k 0 = off)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)  # [N]
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)  # [N]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)  # [N]
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)  # [N]
    return temperature, top_k, top_p, min_p


def logits_to_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 = off
    min_p: torch.Tensor | None = None,  # [N] float in [0, 1], 0 = off; None: off for every row
) -> torch.Tensor:  # [N, V] float32
    """Per-row temperature, min-p, top-k then top-p, renormalised; greedy rows
    get a one-hot on the argmax.

    min-p drops the tokens less likely than ``min_p`` times the likeliest
    token (after temperature); top-p keeps the smallest set of most likely
    tokens whose mass is at least ``top_p`` (always at least the top token).
    On the CPU the softmax, and top-k and top-p, are C passes (kernels/sampling_cpu.py: our own exp; top-k
    and top-p sort no row, equal logits rank by index); elsewhere torch's softmax and the sort below.
    """
    logits = logits.float()  # [N, V]
    is_greedy = temperature == 0  # [N]
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)  # [N]
    scaled = logits / safe_temperature.unsqueeze(1).float()  # [N, V]
    if min_p is not None and bool((min_p > 0).any()):
        scaled = _drop_below_min_p(scaled, min_p)  # [N, V]
    if bool(((top_k > 0) | (top_p < 1)).any()):
        probs = top_k_top_p_rows(scaled, top_k, top_p)  # [N, V]: the CPU's, without sorting the rows
        if probs is None:
            probs = _top_k_top_p_probs(scaled, top_k, top_p)  # [N, V]
    else:
        probs = softmax_last(scaled)  # [N, V]
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_last(logits).unsqueeze(1), 1.0)  # [N, V]
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)  # [N, V]
    return probs


def _drop_below_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:  # [N, V]
    """`scaled` (`[N, V]`) with the tokens whose probability is below min_p x the row's top one set to -inf:
    p_v < min_p p_max  <=>  scaled_v < scaled_max + log(min_p), with no softmax needed."""
    top = scaled.max(dim=-1, keepdim=True).values  # [N, 1]
    threshold = top + torch.log(min_p).unsqueeze(1)  # [N, 1] (min_p 0: -inf, nothing dropped)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _top_k_top_p_probs(
    scaled: torch.Tensor,  # [N, V] temperature-scaled logits
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, V] float32
    """Softmax restricted to each row's top-k / top-p set, in sorted order and
    scattered back to vocabulary order."""
    num_vocab = scaled.shape[-1]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [N, V], [N, V]
    rank = torch.arange(num_vocab, device=scaled.device)  # [V]
    k = torch.where(top_k > 0, top_k, num_vocab).unsqueeze(1)  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))  # [N, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    # A token is dropped when the tokens ranked above it already reach top_p;
    # the top token (mass above it: 0) always stays. top_p == 1 drops nothing,
    # even when rounding makes the cumulative sum reach 1 early.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
    is_dropped = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # [N, V]
    sorted_probs = sorted_probs.masked_fill(is_dropped, 0.0)  # [N, V]
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # [N, V]
    return torch.zeros_like(sorted_probs).scatter_(1, sorted_ids, sorted_probs)  # [N, V]


def sample_from_probs(
    probs: torch.Tensor,  # [N, V]
    seeds: Sequence[int],  # N request seeds
    positions: Sequence[int],  # N absolute positions of the sampled tokens
    stream: int,
    is_greedy: Sequence[bool] | None = None,  # N; None: every row samples
) -> torch.Tensor:  # [N] int64
    """One token per row by the exponential race with keyed noise, ``argmax(probs / E(seed, position))``.

    Greedy rows (one-hot probs) take their argmax: no noise is computed for them.
    """
    rows = [i for i in range(len(seeds)) if is_greedy is None or not is_greedy[i]]
    if len(rows) == len(seeds):
        return _keyed_race(probs.float(), seeds, positions, stream)  # [N]
    tokens = race(probs.float(), torch.ones_like(probs, dtype=torch.float32))  # [N]: the greedy rows' argmax
    if rows:
        index = torch.tensor(rows, device=probs.device)
        tokens[index] = _keyed_race(
            probs[index].float(), [seeds[i] for i in rows], [positions[i] for i in rows], stream
        )
    return tokens


def _keyed_race(probs: torch.Tensor, seeds, positions, stream: int) -> torch.Tensor:  # [N] int64
    """``race(probs, keyed_exponential(...))``: on the CPU one C pass with no noise tensor (bitwise the same
    token), elsewhere the two passes."""
    library = sampling_cpu.c_library() if probs.device.type == "cpu" else None
    if library is not None:
        row_keys, column_hashes = noise_keys(seeds, positions, stream, probs.shape[-1], probs.device)
        temperature = torch.zeros(len(seeds))  # the rows are distributions
        tokens = sampling_cpu.keyed_race_rows(probs, temperature, row_keys, column_hashes, library)
        if tokens is not None:
            return tokens
    return race(probs, keyed_exponential(seeds, positions, stream, probs.shape[-1], probs.device))


def sample_rows(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[RequestSampling],  # N, none greedy
    seeds: Sequence[int],  # N request seeds
    positions: Sequence[int],  # N absolute positions of the sampled tokens
    stream: int,
) -> torch.Tensor:  # [N] int64
    """Each row's keyed sample: ``race(logits_to_probs(row), E(seed, position))``, the rows all sampled.

    On the CPU one C pass per row (kernels/sampling_cpu.py's keyed_race_rows) computes the distribution, the
    noise and the race with no [N, V] temporaries. A row with top-k, top-p or min-p gets its distribution from
    logits_to_probs first, and its token is bitwise the passes'; a row with a temperature alone races the
    softmax's weights before their normalisation, which could move its token from the passes' only where two
    scores are within rounding. Each row's token depends on that row alone.
    """
    library = sampling_cpu.c_library() if logits.device.type == "cpu" else None
    tokens = None if library is None else _sample_rows_in_c(logits.float(), params, seeds, positions, stream, library)
    if tokens is None:  # the distribution, then its race
        tokens = _keyed_race(
            logits_to_probs(logits, *sampling_tensors(params, logits.device)), seeds, positions, stream
        )
    return tokens  # [N]


def _sample_rows_in_c(logits, params, seeds, positions, stream, library) -> torch.Tensor | None:  # [N] int64
    """sample_rows through keyed_race_rows: logits and a temperature per row, or the row's distribution (and
    temperature 0) where logits_to_probs filters it; None if the pass could not run."""
    filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
    values = logits  # [N, V]
    if filtered:
        index = torch.tensor(filtered)  # [F]
        probs = logits_to_probs(logits[index], *sampling_tensors([params[i] for i in filtered]))  # [F, V]
        values = probs if len(filtered) == len(params) else logits.index_copy(0, index, probs)  # [N, V]
    temperature = torch.tensor([p.temperature for p in params])  # [N]
    temperature[filtered] = 0.0
    row_keys, column_hashes = noise_keys(seeds, positions, stream, logits.shape[-1], logits.device)
    return sampling_cpu.keyed_race_rows(values, temperature, row_keys, column_hashes, library)
