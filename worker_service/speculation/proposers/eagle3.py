"""EAGLE-3 proposer: a draft head reading the target's own hidden states (worker_service/runtime/eagle3_head.py).

The head at position p reads the token at p + 1 and the target's features of
position p, and predicts the token at p + 2. Its K/V lives on the target's
block tables, in a cache of its own. The head *catches up* on every position
the target commits (a prefill chunk's tokens; a decode's pending token and
accepted drafts), with the features the target computed for them in the same
pass: no extra target pass, and the head's K/V below its own computed count
(`num_draft_computed_tokens`) is always that of committed tokens. When the
last committed position's token was sampled, the head's output there is the
first draft of the next step, and its pre-norm state the feature of the
second: `propose` then runs the head up to k - 1 times, feeding back its own
state, while the product of the head's probabilities of its drafts stays
above MIN_CONFIDENCE.

When it catches up: right after the step for a sequence the head drafted for
in this step (it will most likely draft in the next), else later. A sequence
the scheduler's policy keeps at k = 0, or whose drafts the grammar forces (the
head does not pay for it), keeps the
target's features of its committed positions aside, and the head runs over
them in one chunk when the sequence drafts again or CATCH_UP_EVERY positions
have gathered: so a sequence that does not draft costs almost no head work,
and the policy, which times the steps, sees the head's cost where drafting
causes it. The head's K/V is a function of the tokens and features alone
(its linears are batch invariant), so when it runs does not change a draft.
A catch-up needs the output of each sequence's last position only (the next
first draft): the positions before it only write their K/V (Eagle3Head.forward,
output_rows), which on the CPU skips their attention, o_proj and MLP.

The drafts are the head's argmax mapped to target ids, deterministic given the
context, and are verified like copied drafts (no draft probabilities): a draft
is accepted exactly when it equals the target's (keyed) sample, so the output
is the target's, greedy or seeded, whatever the head proposes.

Trees (`tree_width` W > 1), as EAGLE-2 grows them: the head's W likeliest
tokens at each expanded node are candidates, a candidate's confidence the
product of the head's probabilities along its path. Level by level (one head
call for every sequence's level), the W most confident candidates of the
newest level are expanded, the head running over them with their parents'
features, writing its K/V at lookahead slots after the committed positions
(at most k - 1 rows, the slots the scheduler reserved) and attending along
the tree (kernels/draft_tree.py). The draft is then the k most confident
candidates (proposers/trees.py); candidates below MIN_CONFIDENCE are left out,
except the first. The head's K/V of the drafted rows is scratch: the catch-up
rewrites the accepted path's positions from the target's features.
"""

from dataclasses import dataclass, replace
import itertools

import torch

from kernels.draft_tree import DraftTrees
from worker_service.runtime.eagle3_head import Eagle3Head
from worker_service.runtime.graphs import graph_key
from worker_service.runtime.runner import ModelRunner, SequenceChunk, pack
from worker_service.speculation.proposers import Proposal, Proposer
from worker_service.speculation.proposers.trees import best_nodes, draft_width
from worker_service.speculation.request_state import RequestState

# A chain stops growing once the head's probability that all its drafts are accepted falls below this (EAGLE-2's
# observation: a head's confidence tracks its acceptance): later drafts would cost a head step and a scored row
# each for little gain. The goodput policy sees the shorter drafts as delivery below 1 at those positions.
MIN_CONFIDENCE = 0.1

# Committed positions a sequence that does not draft may keep waiting for the head: bounds the features kept
# aside (3 x hidden each) and the positions the prefix cache cannot keep yet (it keeps blocks every model wrote).
CATCH_UP_EVERY = 32


@dataclass
class _Next:
    """What the head left for a sequence's next proposal."""

    first_draft: int
    probability: float  # the head's probability of first_draft
    feature: torch.Tensor  # [hidden]: the head's pre-norm output at the last committed position
    top_drafts: list[int]  # with trees: the head's tree_width likeliest tokens there, most likely first
    top_probabilities: list[float]


class Eagle3Proposer(Proposer):
    """See the module docstring. The target runner captures the head's auxiliary hidden states."""

    runs_model = True

    def __init__(
        self, head: Eagle3Head, target: ModelRunner, min_confidence: float = MIN_CONFIDENCE, tree_width: int = 1
    ):
        self.head = head
        self.min_confidence = min_confidence
        self.tree_width = tree_width  # 1: chains
        self.target = target
        target.aux_layers = head.aux_layers
        self._next: dict[str, _Next] = {}  # only while the head is caught up
        # The target's auxiliary hidden states of committed positions the head has not run over, by request:
        # rows of positions num_draft_computed_tokens, .., num_computed_tokens - 1, in order.
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._drafted: set[str] = set()  # the sequences the head was asked to draft for in this step

    def propose(self, states: list[RequestState], num_drafts: list[int]) -> Proposal:
        self._drafted = {s.request_id for s, k in zip(states, num_drafts) if k > 0}
        self._catch_up([s for s, k in zip(states, num_drafts) if k > 0 and s.request_id in self._pending])
        widths = [draft_width(s, self.tree_width) if k > 0 else 1 for s, k in zip(states, num_drafts)]
        if max(widths, default=1) > 1:
            return self._propose_trees(states, num_drafts, widths)
        drafts: list[list[int]] = [[] for _ in states]
        active = [i for i, k in enumerate(num_drafts) if k > 0 and states[i].request_id in self._next]
        features, confidence, scores = {}, {}, [0.0] * len(states)
        for i in active:
            nxt = self._next[states[i].request_id]
            drafts[i].append(nxt.first_draft)
            features[i] = nxt.feature
            confidence[i] = scores[i] = nxt.probability
        for depth in range(1, max((num_drafts[i] for i in active), default=0)):
            rows = [i for i in active if num_drafts[i] > depth and confidence[i] >= self.min_confidence]
            if not rows:
                break
            # Draft d (1-based) is the token at position num_tokens + d - 1; the head reads it one position
            # earlier (at p, the token at p + 1), with its own pre-norm output at the position before as feature.
            chunks = [
                SequenceChunk([drafts[i][-1]], states[i].num_tokens + depth - 2, states[i].block_table) for i in rows
            ]
            tokens, probabilities, prenorm = self._draft_step(chunks, torch.stack([features[i] for i in rows]))
            for row, (i, token, probability) in enumerate(zip(rows, tokens, probabilities)):
                drafts[i].append(token)
                features[i] = prenorm[row]
                confidence[i] *= probability  # P(drafts 1..depth+1 all accepted), if the head is calibrated
                scores[i] += confidence[i]
        return Proposal(drafts, None, scores=scores)

    def _propose_trees(self, states: list[RequestState], num_drafts: list[int], widths: list[int]) -> Proposal:
        """Trees as the module docstring grows them, at most widths[i] children per node (1: a chain)."""
        active = [i for i, k in enumerate(num_drafts) if k > 0 and states[i].request_id in self._next]
        # Per sequence, the candidates: (parent candidate or -1, token, confidence, depth).
        nexts = {i: self._next[states[i].request_id] for i in active}
        candidates = {
            i: [
                (-1, token, p, 1)
                for token, p in _distinct(nexts[i].top_drafts, nexts[i].top_probabilities)[: widths[i]]
            ]
            for i in active
        }
        expanded = {i: {} for i in active}  # candidate -> (its row's position in the cache, its path, pre-norm)
        for depth in range(1, max((num_drafts[i] for i in active), default=0)):
            level = {}
            for i in active:
                room = num_drafts[i] - 1 - len(expanded[i])
                newest = [n for n, (_, _, p, d) in enumerate(candidates[i]) if d == depth and p >= self.min_confidence]
                level[i] = sorted(newest, key=lambda n: -candidates[i][n][2])[: min(widths[i], room)]
            rows = [(i, n) for i in active for n in level[i]]
            if not rows:
                break
            normed, prenorm = self._run_level(states, candidates, expanded, level, depth)
            tops, probabilities = self.head.top_draft_tokens(normed, max(widths[i] for i, _ in rows))
            for row, (i, n) in enumerate(rows):
                expanded[i][n] = (*expanded[i][n][:2], prenorm[row])
                confidence = candidates[i][n][2]
                candidates[i] += [
                    (n, token, confidence * p, depth + 1)
                    for token, p in _distinct(tops[row], probabilities[row])[: widths[i]]
                ]
        drafts, parents, scores = [[] for _ in states], [None] * len(states), [0.0] * len(states)
        ranks: list[list[int] | None] = [None] * len(states)
        for i in active:
            kept = [n for n, (_, _, p, _) in enumerate(candidates[i]) if n == 0 or p >= self.min_confidence]
            index = {n: j for j, n in enumerate(kept)}  # kept candidates' parents are kept (more confident)
            tree = best_nodes(
                [index.get(candidates[i][n][0], -1) for n in kept],
                [candidates[i][n][1] for n in kept],
                [candidates[i][n][2] for n in kept],
                num_drafts[i],
            )
            drafts[i], scores[i] = tree.token_ids, tree.score
            if widths[i] > 1:  # width 1: the chain it is
                parents[i], ranks[i] = tree.parents, tree.ranks
        return Proposal(drafts, None, scores=scores, parents=parents, ranks=ranks)

    def _run_level(self, states, candidates, expanded, level, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over one level's expanded candidates of every sequence (one call): each at the position
        after its parent's, its K/V at the next free lookahead slot, attending to the committed positions and
        its path."""
        chunks, positions, features, paths, prefix_lens = [], [], [], [], []
        for i, nodes in level.items():
            if not nodes:
                continue
            state, nxt = states[i], self._next[states[i].request_id]
            assert state.num_draft_computed_tokens == state.num_tokens - 1
            first_slot = state.num_tokens - 1 + len(expanded[i])
            chunks.append(SequenceChunk([candidates[i][n][1] for n in nodes], first_slot, state.block_table))
            prefix_lens.append(state.num_tokens - 1)
            for j, n in enumerate(nodes):
                parent = candidates[i][n][0]
                above = expanded[i][parent][1] if parent >= 0 else []
                expanded[i][n] = (first_slot + j, [*above, first_slot + j])
                paths.append(expanded[i][n][1])
                positions.append(state.num_tokens + depth - 2)
                features.append(expanded[i][parent][2] if parent >= 0 else nxt.feature)
        batch = pack(chunks, self.head.kv_cache, self.head.device)
        starts = batch.metadata.query_start_loc.tolist()[:-1]
        batch.metadata.trees = DraftTrees.from_paths(starts, prefix_lens, paths).to(self.head.device)
        return self.head(
            batch.input_ids, torch.tensor(positions, device=self.head.device), torch.stack(features), batch.metadata
        )

    def after_step(self, states: list[RequestState], chunks: list[SequenceChunk], num_committed: list[int]) -> None:
        """Keeps the features of the positions the target committed in this step, and catches the head up on
        them now where the module docstring says."""
        aux = self.target.last_aux_hidden  # [T, 3 x target hidden], the step's packed rows in chunk order
        now, offset = [], 0
        for state, chunk, num in zip(states, chunks, num_committed):
            if num > 0:
                pending = self._pending.setdefault(state.request_id, [])
                pending.append(aux[offset : offset + num].clone())  # positions chunk.start_pos .. + num - 1
                self._next.pop(state.request_id, None)
                waiting = state.num_computed_tokens - state.num_draft_computed_tokens
                if state.request_id in self._drafted or waiting >= CATCH_UP_EVERY:
                    now.append(state)
            offset += len(chunk.token_ids)
        self._drafted = set()
        self._catch_up(now)

    def _catch_up(self, states: list[RequestState]) -> None:
        """Runs the head over each state's pending positions (one packed call); where the next step may draft,
        keeps the head's first draft for it."""
        if not states:
            return
        head_chunks, features = [], []
        for state in states:
            start, end = state.num_draft_computed_tokens, state.num_computed_tokens
            rows = torch.cat(self._pending.pop(state.request_id))
            assert rows.shape[0] == end - start, (state.request_id, rows.shape[0], start, end)
            # Position p reads the token at p + 1 (known for every committed position: the prompt's, or a sample).
            # One token past the committed ones (a decode's pending token): the next step may draft after it.
            drafts_next = state.num_tokens == end + 1
            head_chunks.append(
                SequenceChunk(
                    state.token_ids[start + 1 : end + 1], start, state.block_table, num_logits=1 if drafts_next else 0
                )
            )
            features.append(rows)
            state.num_draft_computed_tokens = end
        features = self.head.features(torch.cat(features))
        # a verify's shape at most (this step's k + 1 positions; a prompt's catch-up runs eagerly): few graph keys
        max_rows = 1 + max(state.num_speculative_tokens for state in states)
        graphed = self._graphed_catch_up(head_chunks, features, max_rows) if self.tree_width == 1 else None
        if graphed is not None:
            tokens, probabilities, prenorm = graphed
        else:
            normed, prenorm = self._run(head_chunks, features, last_rows=True)
            if not len(normed):  # no sequence drafts after these positions yet (a prompt still prefilling)
                return
            if self.tree_width > 1:  # one pass of the head's output layer; a chain's first draft is the likeliest
                tops, top_probabilities = self.head.top_draft_tokens(normed, self.tree_width)
                tokens, probabilities = [row[0] for row in tops], [row[0] for row in top_probabilities]
            else:
                tokens, probabilities = self.head.draft_tokens(normed)
        if self.tree_width == 1:
            tops, top_probabilities = [[t] for t in tokens], [[p] for p in probabilities]
        drafting = [state for state, chunk in zip(states, head_chunks) if chunk.num_logits]
        for row, state in enumerate(drafting):
            self._next[state.request_id] = _Next(
                tokens[row], probabilities[row], prenorm[row], tops[row], top_probabilities[row]
            )

    def _run(
        self, chunks: list[SequenceChunk], features: torch.Tensor, last_rows: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over packed chunks; returns (normed, pre-norm) of every row, or (`last_rows`) only of the
        last row of each chunk with num_logits, the others only writing their K/V."""
        batch = pack(chunks, self.head.kv_cache, features.device)
        output_rows = batch.logits_indices if last_rows else None
        return self.head(batch.input_ids, batch.positions, features, batch.metadata, output_rows)

    def _graphed_catch_up(self, chunks: list[SequenceChunk], features: torch.Tensor, max_rows: int) -> tuple | None:
        """A catch-up whose every sequence drafts next (one row per committed position, a verify's shape) as
        a replayed graph of the head's draft step: the last rows' (target ids, probabilities, pre-norm
        states); None when it runs eagerly (a sequence has more than max_rows positions)."""
        if self.head.graphs is None or not all(c.num_logits for c in chunks):
            return None
        if max(len(c.token_ids) for c in chunks) > max_rows:
            return None
        every_row = [replace(c, num_logits=len(c.token_ids)) for c in chunks]
        out = self._draft_step(every_row, features, eager=False)
        if out is None:
            return None
        ids, probabilities, prenorm = out
        last = [end - 1 for end in itertools.accumulate(len(c.token_ids) for c in chunks)]
        return (
            [ids[i] for i in last],
            [probabilities[i] for i in last],
            prenorm[torch.tensor(last, device=prenorm.device)],
        )

    def _draft_step(self, chunks: list[SequenceChunk], features: torch.Tensor, eager: bool = True) -> tuple | None:
        """A head step over every row of `chunks` (a chain's next position, or a catch-up's positions): each
        row's (target id, the head's probability) of the next draft, and pre-norm states [N, hidden]. On CUDA
        a replayed graph (the head's draft step padded to a graphs.GraphKey, as the target's steps are), else
        the head's eager step (eager False: None instead)."""
        if self.head.graphs is not None:
            key = graph_key(chunks, (), self.head.kv_cache.block_size)
            out = self.head.graphs.run(chunks, key, (features,)) if key is not None else None
            if out is not None:
                prenorm, ids, probabilities = out
                return ids.tolist(), probabilities.tolist(), prenorm
        if not eager:
            return None
        normed, prenorm = self._run(chunks, features)
        return (*self.head.draft_tokens(normed), prenorm)

    def num_kv_tokens(self, state: RequestState) -> int:
        return state.num_draft_computed_tokens

    def release(self, states: list[RequestState]) -> None:
        for state in states:
            self._next.pop(state.request_id, None)
            self._pending.pop(state.request_id, None)


def _distinct(tokens: list[int], probabilities: list[float]) -> list[tuple[int, float]]:
    """Siblings with distinct target tokens (draft ids that map to one target token merge, their probabilities
    summed), the likeliest first."""
    merged: dict[int, float] = {}
    for token, probability in zip(tokens, probabilities):
        merged[token] = merged.get(token, 0.0) + probability
    return sorted(merged.items(), key=lambda item: -item[1])
