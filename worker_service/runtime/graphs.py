"""Decode and verify steps replayed as CUDA graphs (`--enforce-eager` turns them off).

On a GPU an eager step is ~1,200 kernel launches and the host work around them: 23 ms for an 8B-shaped model
whose weights take 3.6 ms to read (bench/results/gpu_check.json). A CUDA graph replays a step's launches from
one call. What a graph replays is fixed, its tensors' addresses and shapes, so a step must fit a captured one.

A step is graphed when each of its chunks is a chain whose rows all want logits (a decode: 1 row; a verify:
k + 1 rows; no prefill chunk, no draft tree) and it has at most BUCKETS[-1] of them. It is padded to a
GraphKey:
- the number of sequences up to the next of BUCKETS: a padding sequence has q rows at positions 0..q-1 on the
  scratch blocks;
- every sequence's rows up to the step's most, q: a padding row comes after its sequence's real rows, so the
  causal bound keeps it out of theirs (the attention kernel, whose tiles read up to their last row's keys,
  leaves stale non-finite values there out of the real rows' sums);
- the block tables to a power-of-two width.
Padding rows write their K/V into the runner's scratch blocks, past the scheduler's (never a request's), and
their logits are dropped. Each key's graph is captured at its first step, after one eager run on the same
buffers (it builds the Triton kernels), and replayed after; all share one memory pool, so a step's outputs
are copied out before the next replay.

An EAGLE-3 head's steps (a row per drafting chain, or a catch-up's row per committed position) are graphed
the same way on the head's own cache and scratch blocks (eagle3_head.py), their feature rows an extra input:
a draft of k tokens was k eager head steps (on an H200 at batch 1 eagle3 ran at 0.62x plain decoding).

The capture hides behind a replay class: CudaGraphReplay on CUDA, EagerReplay elsewhere (it calls the
function on the same static buffers), so the bookkeeping runs, and is tested, on the CPU.
"""

from collections.abc import Callable
from dataclasses import dataclass
import gc
import logging

import torch

from worker_service.runtime.attention import PagedMetadata
from worker_service.runtime.device import host_tensor, to_device
from worker_service.runtime.kv_cache import KVCache, position_slots, slot

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # sequences per graph
MAX_ROWS = 32  # rows per sequence a graph covers: a verify of up to 31 drafts
MAX_GRAPH_OUTPUT_BYTES = 256 << 20  # a graph's outputs at most (an 8B model's fp32 logits: 512 rows)
# (input_ids [n], positions [n], metadata, rows [n], *extra inputs [n, width]) -> outputs, each [n, ...] or None:
# the target's (logits [n, V] fp32, aux hidden [n, A] or None), an EAGLE-3 head's draft step (eagle3_head.py)
StepForward = Callable[..., tuple]


@dataclass(frozen=True)
class GraphKey:
    """The padded shape of a graphed step."""

    num_seqs: int
    rows: int  # per sequence
    table_width: int
    aux_layers: tuple[int, ...]  # what the forward keeps for an EAGLE-3 head: part of what it computes

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.rows


def scratch_blocks_needed(block_size: int) -> int:
    """Blocks that hold MAX_ROWS padding rows."""
    return -(-MAX_ROWS // block_size)


def graph_key(chunks: list, aux_layers: tuple[int, ...], block_size: int) -> GraphKey | None:
    """The GraphKey a step of `chunks` (runner.SequenceChunk) is padded to, or None when it runs eagerly."""
    if not chunks or len(chunks) > BUCKETS[-1]:
        return None
    if any(c.parents is not None or c.num_logits != len(c.token_ids) or not c.token_ids for c in chunks):
        return None
    rows = max(len(c.token_ids) for c in chunks)
    if rows > MAX_ROWS:
        return None
    # a padding row of a sequence reads its table up to position start + rows - 1
    reach = (max(len(c.block_table), -(-(c.start_pos + rows) // block_size)) for c in chunks)
    widest = max(scratch_blocks_needed(block_size), *reach)
    width = max(8, 1 << (widest - 1).bit_length())
    return GraphKey(next(b for b in BUCKETS if b >= len(chunks)), rows, width, aux_layers)


class EagerReplay:
    """Runs the function each time, on the buffers it was given: the bookkeeping without a GPU."""

    def __init__(self, fn: Callable[[], tuple], pool=None):
        self.fn = fn

    def __call__(self) -> tuple:
        return self.fn()


class CudaGraphReplay:
    """Captures the function once (after a warm-up run on a side stream) and replays it."""

    def __init__(self, fn: Callable[[], tuple], pool=None):
        self.fn = fn  # the graph reads what fn holds (its row index): kept alive with it
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                fn()  # builds the Triton kernels and cuBLAS's handles, which a capture may not do
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn()

    def __call__(self) -> tuple:
        self.graph.replay()
        return self.outputs


class Graph:
    """One GraphKey's static inputs (one int64 and one int32 buffer, viewed as the forward's tensors, and a
    buffer per extra input) and its replay."""

    def __init__(self, key: GraphKey, kv_cache: KVCache, forward: StepForward, extras: tuple = ()):
        n, b, w = key.num_tokens, key.num_seqs, key.table_width
        device = kv_cache.key_caches[0].device
        self.key = key
        self.int64 = torch.zeros(3 * n, dtype=torch.int64, device=device)  # input ids, positions, slots
        self.int32 = torch.zeros(b * w + b + b + 1, dtype=torch.int32, device=device)  # tables, lens, starts
        input_ids, positions, slots = self.int64.split([n, n, n])
        tables, seq_lens, starts = self.int32.split([b * w, b, b + 1])
        # Held here: a captured graph reads these addresses at every replay.
        self.metadata = PagedMetadata(kv_cache, slots, tables.view(b, w), starts, seq_lens, max_query_len=key.rows)
        self.every_row = torch.arange(n, device=device)
        # extras: (width, dtype) of each extra per-row input; padding rows keep zeros (or an earlier step's rows)
        self.extras = tuple(torch.zeros((n, width), dtype=dtype, device=device) for width, dtype in extras)
        self.inputs = (input_ids, positions, self.metadata, self.every_row, *self.extras)
        self.forward = forward
        self.replay: Callable[[], tuple] | None = None  # set once the buffers hold a step (StepGraphs.run)

    def compute(self) -> tuple:
        """The forward over the buffers: what the replay captures (or, eager, calls)."""
        return self.forward(*self.inputs)


class StepGraphs:
    """The graphs of one KV cache (a ModelRunner's, or an EAGLE-3 head's): pads a step to its key, replays that
    key's graph (capturing it first), and returns the forward's outputs for the real rows, in the chunks'
    packed order. row_bytes: the outputs' bytes per row; extras: (width, dtype) of each extra per-row input
    the forward takes after the rows."""

    def __init__(
        self,
        forward: StepForward,
        kv_cache: KVCache,
        scratch: list[int],
        replay_type: type,
        row_bytes: int,
        extras: tuple = (),
    ):
        self.forward = forward
        self.row_bytes = row_bytes
        self.extras = extras
        self.kv_cache = kv_cache
        self.scratch = scratch  # block ids past the scheduler's: where padding rows write
        self.replay_type = replay_type
        self.pool = torch.cuda.graph_pool_handle() if replay_type is CudaGraphReplay else None
        self.graphs: dict[GraphKey, Graph] = {}
        self.failed: set[GraphKey] = set()  # keys whose capture failed: their steps run eagerly

    def close(self) -> None:
        """Drops every graph and frees what they held (their pool, their inputs, the KV cache they read): each
        graph's replay holds the graph, which holds the cache, a cycle that only the collector frees, and the
        owner's next cache may not fit beside the old one."""
        for graph in self.graphs.values():
            graph.replay = None
        self.graphs.clear()
        gc.collect()
        if self.pool is not None:
            torch.cuda.empty_cache()

    def run(self, chunks: list, key: GraphKey, extras: tuple = ()) -> tuple | None:
        """The forward's outputs for the real rows (each [N, ...], or None where the forward returns None);
        None when the step must run eagerly: its key's capture failed, or its outputs would pass
        MAX_GRAPH_OUTPUT_BYTES (each graph keeps its outputs in the pool). extras: each extra input's real
        rows, [N, width] on the device, in the chunks' packed order."""
        if key in self.failed or key.num_tokens * self.row_bytes > MAX_GRAPH_OUTPUT_BYTES:
            return None
        int64, int32, real = self.host_inputs(chunks, key)
        graph = self.graphs.get(key)
        new = graph is None
        if new:
            graph = Graph(key, self.kv_cache, self.forward, self.extras)
        device = graph.int64.device
        graph.int64.copy_(host_tensor(int64, torch.int64, device), non_blocking=True)
        graph.int32.copy_(host_tensor(int32, torch.int32, device), non_blocking=True)
        (rows,) = to_device([real], torch.int64, device)
        for buffer, values in zip(graph.extras, extras, strict=True):
            buffer.index_copy_(0, rows, values.to(buffer.dtype))
        if new:  # captured over this step's inputs (the warm-up runs it)
            try:
                graph.replay = self.replay_type(graph.compute, self.pool)
            except Exception:  # noqa: BLE001 - any capture failure: log it and run eagerly, never fail the step
                logger.exception("capturing a step graph (%s) failed: its steps run eagerly", key)
                self.failed.add(key)
                return None
            self.graphs[key] = graph
            logger.info("captured a step graph: %s", key)
        return tuple(output[rows] if output is not None else None for output in graph.replay())

    def host_inputs(self, chunks: list, key: GraphKey) -> tuple[list[int], list[int], list[int]]:
        """The step padded to `key`, as the two buffers' host values, and the packed rows of the real tokens."""
        q, width, size = key.rows, key.table_width, self.kv_cache.block_size
        scratch_slots = [slot(self.scratch, j, size) for j in range(q)]
        scratch_table = self.scratch + [self.scratch[0]] * (width - len(self.scratch))
        ids, positions, slots, tables, seq_lens, real = [], [], [], [], [], []
        for b in range(key.num_seqs):
            if b < len(chunks):
                chunk = chunks[b]
                length, start, table = len(chunk.token_ids), chunk.start_pos, chunk.block_table
                ids += chunk.token_ids + [0] * (q - length)
                slots += position_slots(table, start, start + length, size)
                slots += scratch_slots[length:]
                tables += table + [self.scratch[0]] * (width - len(table))
                real += range(b * q, b * q + length)
            else:  # a padding sequence, alone on the scratch blocks
                start = 0
                ids += [0] * q
                slots += scratch_slots
                tables += scratch_table
            positions += range(start, start + q)
            seq_lens.append(start + q)
        starts = [b * q for b in range(key.num_seqs + 1)]
        return ids + positions + slots, tables + seq_lens + starts, real
