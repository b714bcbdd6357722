"""Suffix proposer, after SuffixDecoding (Snowflake ArcticInference): draft the tokens that followed earlier
occurrences of the sequence's suffix, in the request's own tokens and in recent requests' outputs.

Structure. A `TokenIndex` holds token sequences and maps every KEY_TOKENS-gram
in them (the last 2 and the last 8 tokens before each position) to its
MAX_POSITIONS_PER_KEY (16) most recent occurrences, each a packed
(sequence id, end) int. The 8-token keys find long matches that the 16 most
recent occurrences of a frequent 2-token key no longer hold. Two kinds of index:

- per request, over prompt + emitted tokens: each `propose` indexes only the
  tokens appended since the previous call (token ids only grow while the worker
  holds a request); `release` drops it, so a request that comes back with the
  same id starts afresh;
- per worker (`OutputCache`), over the OUTPUT tokens of released requests: at
  most `cache_tokens` tokens in all (an output longer than that keeps its last
  `cache_tokens` tokens). Adding an output evicts the least recently used
  requests' outputs first; an output that backed a chosen proposal counts as
  used. Adding a request id it holds replaces the old entry (a preempted request
  is released twice).

Memory: the global index holds at most `cache_tokens` tokens and at most
len(KEY_TOKENS) keys per token, each with at most 16 occurrences; a request's
index dies with the request.

Match rule. The candidates are the recorded occurrences of the sequence's last
8 tokens or, if none, of its last MIN_MATCH_TOKENS (2), that have at least one
following token (which excludes the sequence's trivial match with itself at its
end). A candidate's match length is how far it agrees with the sequence going
backwards, at most MAX_MATCH_TOKENS (32).

Confidence rule (the walk). At step i the voters are the candidates still
consistent with the draft so far that have an i-th following token, and among
those the ones with the longest match (shorter matches take over only when the
longer ones run out of tokens). The draft token is the voters' most frequent
next token (ties: the most recent occurrence); confidence *= its count / number
of voters; candidates with another next token drop out. The walk stops before a
token whose confidence falls below MIN_TOKEN_PROB (0.1), at k tokens, or at
ceil(MAX_SPEC_FACTOR * m) tokens, m the longest match (factor 1: a match of m
tokens drafts at most m tokens). The per-request and the global drafts compete
on their expected accepted length, the sum of the confidences along the path;
a tie goes to the per-request draft.

Trees (`tree_width` > 1). Where the voters disagree, the other tokens they
vote for are continuations too: the draft is then a tree (proposers/trees.py)
of the most confident nodes, at most `tree_width` children per node and k
nodes in all, each node's confidence its path's product of vote shares, the
tree starting with the chain the walk drafts.

Isolation. The global index only feeds proposals, and the target verifies every
draft (greedy: kept iff it equals the argmax; sampled: the rejection rule with
one-hot drafts, which emits exactly the tokens of a plain step), so another
request's text may shape a draft but never a request's output.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
import itertools
import math

from worker_service.speculation.proposers import Proposal, Proposer
from worker_service.speculation.proposers.trees import draft_width, grow_tree
from worker_service.speculation.request_state import RequestState

MIN_MATCH_TOKENS = 2
KEY_TOKENS = (MIN_MATCH_TOKENS, 8)  # ascending; the longest is looked up first
MAX_MATCH_TOKENS = 32
MAX_POSITIONS_PER_KEY = 16
MIN_TOKEN_PROB = 0.1
MAX_SPEC_FACTOR = 1.0
_END_BITS = 40  # packed occurrence: seq_id << _END_BITS | end
_END_MASK = (1 << _END_BITS) - 1


@dataclass
class Draft:
    """One walk's tokens, expected accepted length and the sequences that backed it."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the confidences along the path
    seq_ids: set[int] = field(default_factory=set)
    match_len: int = 0  # the longest candidate match behind it (0: no draft)
    parents: list[int] | None = None  # a tree: each token's parent row (0: the root); None: a chain
    ranks: list[int] | None = None  # a tree: the order its rows were chosen in (proposers/trees.py)


@dataclass(slots=True)
class Candidate:
    """An earlier occurrence of the sequence's suffix: seq[end - match_len:end] equals its last tokens."""

    match_len: int
    seq: list[int]
    end: int  # seq[end] is the first following token
    seq_id: int


class TokenIndex:
    """Token sequences by id, and the most recent occurrences of every key in them."""

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}
        self.num_tokens = 0
        # key -> packed (seq_id, end), oldest first. Tuples of ints, which the garbage collector stops
        # tracking: 65k indexed tokens as lists made each full collection ~80 ms longer.
        self._occurrences: dict[tuple[int, ...], tuple[int, ...]] = {}

    def extend(self, seq_id: int, token_ids: list[int]) -> None:
        """Appends tokens to a sequence (a new one if `seq_id` is unknown) and indexes the keys they end."""
        seq = self.seqs.setdefault(seq_id, [])
        start = len(seq)
        seq.extend(token_ids)
        self.num_tokens += len(token_ids)
        base = seq_id << _END_BITS
        for end in range(max(start + 1, MIN_MATCH_TOKENS), len(seq) + 1):
            for n in KEY_TOKENS:
                if end < n:
                    break
                key = tuple(seq[end - n : end])
                positions = self._occurrences.get(key, ())
                self._occurrences[key] = positions[1 - MAX_POSITIONS_PER_KEY :] + (base | end,)

    def remove(self, seq_id: int) -> None:
        """Forgets a sequence and its occurrences."""
        seq = self.seqs.pop(seq_id)
        self.num_tokens -= len(seq)
        base = seq_id << _END_BITS
        for end in range(MIN_MATCH_TOKENS, len(seq) + 1):
            for n in KEY_TOKENS:
                if end < n:
                    break
                key = tuple(seq[end - n : end])
                positions = self._occurrences.get(key)
                if positions and base | end in positions:  # it may have been pushed out by newer occurrences
                    rest = tuple(p for p in positions if p != base | end)
                    if rest:
                        self._occurrences[key] = rest
                    else:
                        del self._occurrences[key]

    def candidates(self, tail: list[int]) -> list[Candidate]:
        """Occurrences of the suffix of `tail` (at most MAX_MATCH_TOKENS tokens) with a following token,
        most recent first."""
        for n in reversed(KEY_TOKENS):
            positions = self._occurrences.get(tuple(tail[-n:])) if len(tail) >= n else None
            found = []
            for packed in reversed(positions or ()):
                seq_id, end = packed >> _END_BITS, packed & _END_MASK
                seq = self.seqs[seq_id]
                if end < len(seq):
                    found.append(Candidate(_match_len(seq, end, tail, n), seq, end, seq_id))
            if found:
                return found
        return []


def _match_len(seq: list[int], end: int, tail: list[int], num_known: int) -> int:
    """How many tokens before seq[end] equal the end of `tail` (its last `num_known` are known to)."""
    limit = min(end, len(tail))
    if seq[end - limit : end] == tail[len(tail) - limit :]:
        return limit
    m = num_known
    while seq[end - 1 - m] == tail[-1 - m]:  # stops before `limit`: the full comparison failed
        m += 1
    return m


def walk(candidates: list[Candidate], max_tokens: int) -> Draft:
    """The draft that follows the candidates (the confidence rule of the module docstring)."""
    draft = Draft()
    if not candidates:
        return draft
    max_tokens = min(max_tokens, math.ceil(MAX_SPEC_FACTOR * max(c.match_len for c in candidates)))
    confidence, live, i = 1.0, candidates, 0
    while i < max_tokens:
        live = [c for c in live if c.end + i < len(c.seq)]
        if not live:
            break
        rest = _unanimous(live, i, max_tokens)
        if rest:  # every candidate agrees: copy, at the same confidence
            draft.token_ids += rest
            draft.score += confidence * len(rest)
            draft.seq_ids.update(c.seq_id for c in live)
            i += len(rest)
            continue
        token, share, live = votes(live, i)[0]
        confidence *= share
        if confidence < MIN_TOKEN_PROB:
            break
        draft.token_ids.append(token)
        draft.score += confidence
        draft.seq_ids.update(_voters(live))
        i += 1
    if draft.token_ids:
        draft.match_len = max(c.match_len for c in candidates)
    return draft


def votes(live: list[Candidate], i: int) -> list[tuple[int, float, list[Candidate]]]:
    """The next tokens after i tokens of a walk (the confidence rule): each with its share of the voters and the
    candidates that follow it, most voted first (ties: the first counted, the most recent occurrence)."""
    live = [c for c in live if c.end + i < len(c.seq)]
    if not live:
        return []
    longest = max(c.match_len for c in live)
    counts: dict[int, int] = {}
    for c in live:
        if c.match_len == longest:
            counts[c.seq[c.end + i]] = counts.get(c.seq[c.end + i], 0) + 1
    total = sum(counts.values())
    return [
        (token, n / total, [c for c in live if c.seq[c.end + i] == token])
        for token, n in sorted(counts.items(), key=lambda item: -item[1])
    ]


def _voters(live: list[Candidate]) -> set[int]:
    """The sequences behind a token: its candidates with the longest match."""
    longest = max(c.match_len for c in live)
    return {c.seq_id for c in live if c.match_len == longest}


def walk_tree(candidates: list[Candidate], max_nodes: int, max_width: int) -> Draft:
    """The tree of the most confident continuations (Trees in the module docstring)."""
    if not candidates:
        return Draft()
    match_len = max(c.match_len for c in candidates)
    tree = grow_tree(votes, candidates, max_nodes, math.ceil(MAX_SPEC_FACTOR * match_len), max_width, MIN_TOKEN_PROB)
    if not tree.token_ids:
        return Draft()
    return Draft(
        tree.token_ids, tree.score, set().union(*map(_voters, tree.states)), match_len, tree.parents, tree.ranks
    )


def _unanimous(live: list[Candidate], i: int, max_tokens: int) -> list[int]:
    """The continuation from step i that every candidate shares, as far as the first one goes; [] if none."""
    first = live[0]
    rest = first.seq[first.end + i : first.end + max_tokens]
    for c in live[1:]:
        if c.seq[c.end + i : c.end + i + len(rest)] != rest:
            return []
    return rest


class OutputCache:
    """The worker's index over recent requests' outputs: at most `max_tokens` tokens, LRU by request."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.index = TokenIndex()
        self._seq_ids: OrderedDict[str, int] = OrderedDict()  # request id -> seq id, least recently used first
        self._request_ids: dict[int, str] = {}
        self._next_seq_id = itertools.count()

    @property
    def request_ids(self) -> list[str]:
        """The requests held, least recently used first."""
        return list(self._seq_ids)

    def add(self, request_id: str, output: list[int]) -> None:
        """Holds this output (replacing the request's earlier one), evicting the least recently used."""
        self.discard(request_id)
        output = output[max(len(output) - self.max_tokens, 0) :]
        if len(output) <= MIN_MATCH_TOKENS:  # no key with a following token
            return
        while self.index.num_tokens + len(output) > self.max_tokens:
            self.discard(next(iter(self._seq_ids)))
        seq_id = next(self._next_seq_id)
        self.index.extend(seq_id, output)
        self._seq_ids[request_id] = seq_id
        self._request_ids[seq_id] = request_id

    def discard(self, request_id: str) -> None:
        """Forgets the request's output (if held)."""
        seq_id = self._seq_ids.pop(request_id, None)
        if seq_id is not None:
            self.index.remove(seq_id)
            del self._request_ids[seq_id]

    def touch(self, seq_ids: set[int]) -> None:
        """Marks these outputs as used (most recently)."""
        for seq_id in seq_ids:
            self._seq_ids.move_to_end(self._request_ids[seq_id])


class SuffixProposer(Proposer):
    """Drafts from the request's own tokens or from recent outputs on this worker, whichever promises more."""

    reports_match = True

    def __init__(self, cache_tokens: int, tree_width: int = 1):
        self.outputs = OutputCache(cache_tokens) if cache_tokens > 0 else None  # None: no global index
        self.tree_width = tree_width  # 1: chains
        self._own: dict[str, TokenIndex] = {}  # request id -> index over its prompt + emitted tokens (seq id 0)

    def propose(self, states: list[RequestState], num_drafts: list[int]) -> Proposal:
        drafts = [self._propose_one(s, k) if k > 0 else Draft() for s, k in zip(states, num_drafts)]
        return Proposal(
            [d.token_ids for d in drafts],
            scores=[d.score for d in drafts],
            match_lengths=[d.match_len for d in drafts],
            parents=[d.parents for d in drafts],
            ranks=[d.ranks for d in drafts],
        )

    @staticmethod
    def _walk(candidates: list[Candidate], k: int, width: int) -> Draft:
        return walk(candidates, k) if width == 1 else walk_tree(candidates, k, width)

    def _propose_one(self, state: RequestState, k: int) -> Draft:
        own = self._own.setdefault(state.request_id, TokenIndex())
        own.extend(0, state.token_ids[own.num_tokens :])
        tail = state.token_ids[-MAX_MATCH_TOKENS:]
        width = draft_width(state, self.tree_width)
        best = self._walk(own.candidates(tail), k, width)
        if self.outputs is not None:
            other = self._walk(self.outputs.index.candidates(tail), k, width)
            if other.score > best.score:
                self.outputs.touch(other.seq_ids)
                best = other
        return best

    def release(self, states: list[RequestState]) -> None:
        """Drops the requests' own indexes; their outputs go to the global index."""
        for state in states:
            self._own.pop(state.request_id, None)
            if self.outputs is not None:
                self.outputs.add(state.request_id, state.token_ids[state.num_prompt_tokens :])
