"""The training set of a head: conversations with the target's features, stored in shards; the draft
vocabulary; held-out split; padded batches and each unrolled step's labels."""

from collections import Counter
import pathlib
import random

import torch

from draft_training.generation import Conversation

IGNORE = -100  # a label that does not count (prompt positions, past the end, outside the draft vocabulary)


def save_shard(path: pathlib.Path, conversations: list[Conversation]) -> None:
    """Writes one shard atomically (an interrupted write is never taken for a finished shard)."""
    partial = path.with_suffix(".partial")
    torch.save(
        [
            {
                "token_ids": torch.tensor(c.token_ids, dtype=torch.int32),
                "num_prompt_tokens": c.num_prompt_tokens,
                "aux_hidden": c.aux_hidden,
            }
            for c in conversations
        ],
        partial,
    )
    partial.replace(path)


def load_shards(paths: list[pathlib.Path]) -> list[Conversation]:
    return [
        Conversation(row["token_ids"].tolist(), row["num_prompt_tokens"], row["aux_hidden"])
        for path in paths
        for row in torch.load(path)
    ]


def draft_vocabulary(conversations: list[Conversation], coverage: float, max_size: int) -> tuple[torch.Tensor, float]:
    """The most frequent response tokens (what the head must predict), fewest that reach `coverage` of the
    response tokens, at most `max_size`; returns (draft id -> target id [Vd], the coverage reached)."""
    counts = Counter(t for c in conversations for t in c.token_ids[c.num_prompt_tokens :])
    total = sum(counts.values())
    chosen, covered = [], 0
    for token, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= max_size or (chosen and covered >= coverage * total):
            break
        chosen.append(token)
        covered += count
    return torch.tensor(chosen, dtype=torch.int64), covered / max(total, 1)


def split(conversations: list[Conversation], eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle, the held-out part at least one conversation when there are two."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    num_eval = min(max(round(eval_fraction * len(order)), 1 if len(order) > 1 else 0), len(order) - 1)
    return [conversations[i] for i in order[num_eval:]], [conversations[i] for i in order[:num_eval]]


def batches(conversations: list[Conversation], max_tokens: int) -> list[list[Conversation]]:
    """Conversations of similar length together, at most `max_tokens` padded tokens a batch (one at least)."""
    ordered = sorted(conversations, key=lambda c: len(c.token_ids))
    out, current = [], []
    for conversation in ordered:
        longest = max([len(c.token_ids) for c in current] + [len(conversation.token_ids)])
        if current and longest * (len(current) + 1) > max_tokens:
            out.append(current)
            current = []
        current.append(conversation)
    if current:
        out.append(current)
    return out


def collate(batch: list[Conversation], num_steps: int, device: torch.device):
    """(token ids [B, L], features [B, L - 1, 3 x hidden] float, per step j target labels [B, L - 1]: row p's
    label is token p + j + 2 where that is a response token, else IGNORE)."""
    length = max(len(c.token_ids) for c in batch)
    tokens = torch.zeros(len(batch), length, dtype=torch.int64)
    features = torch.zeros(len(batch), length - 1, batch[0].aux_hidden.shape[-1])
    is_label = torch.zeros(len(batch), length + num_steps + 1, dtype=torch.bool)
    for b, c in enumerate(batch):
        tokens[b, : len(c.token_ids)] = torch.tensor(c.token_ids)
        features[b, : len(c.aux_hidden)] = c.aux_hidden.float()
        is_label[b, c.num_prompt_tokens : len(c.token_ids)] = True
    padded = torch.nn.functional.pad(tokens, (0, num_steps + 1))
    rows = length - 1
    labels = [
        torch.where(is_label[:, j + 2 : j + 2 + rows], padded[:, j + 2 : j + 2 + rows], IGNORE)
        for j in range(num_steps)
    ]
    return tokens.to(device), features.to(device), [label.to(device) for label in labels]
