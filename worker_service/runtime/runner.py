"""Runs a `transformers` causal LM over a packed batch on the paged KV cache.

One forward takes any mix of sequence chunks: a prefill chunk (many tokens,
with or without a cached prefix), a single-token decode, or a multi-token
query over a cached prefix (speculative scoring). Every chunk's tokens are
computed at positions `start_pos ..`, their K/V written into the blocks of
the chunk's block table, and logits are returned for its last `num_logits`
tokens only (the output layer is the costliest matmul of a small model).

A chunk may also be a draft tree (`parents`): its rows are written to slots
start_pos .. in row order but computed at positions start_pos + depth, each
attending to the cached prefix and its own path (kernels/draft_tree.py).
After acceptance, `keep_path` moves the accepted path's K/V to the positions
the next step reads.
"""

from dataclasses import dataclass
import logging

import torch
from transformers import PreTrainedModel

from kernels import paged_attention_cpu
from kernels._triton import HAS_TRITON
from kernels.draft_tree import DraftTrees
from worker_service.runtime import backends
from worker_service.runtime.attention import ATTENTION_NAME, PagedMetadata
from worker_service.runtime.device import to_device
from worker_service.runtime.dtypes import DEFAULT_QUANTIZED_ACTIVATIONS, resolve_kv_cache_dtype
from worker_service.runtime.fast_linear import pack_linears
from worker_service.runtime.graphs import CudaGraphReplay, StepGraphs, graph_key, scratch_blocks_needed
from worker_service.runtime.invariant_layers import make_batch_invariant
from worker_service.runtime.kv_cache import KVCache, KVCacheSpec, position_slots, slot, transposes_keys

logger = logging.getLogger(__name__)


@dataclass
class SequenceChunk:
    """The tokens of one sequence to compute in a forward pass."""

    token_ids: list[int]  # tokens at positions start_pos .. start_pos + len - 1
    start_pos: int  # tokens before this position already have their K/V cached
    block_table: list[int]  # block ids covering at least start_pos + len positions
    num_logits: int = 1  # logits wanted for the last num_logits tokens (0 for a mid-prompt chunk)
    parents: list[int] | None = None  # a draft tree: each row's parent row (-1: the cached prefix); None a chain


@dataclass
class PackedBatch:
    """Chunks flattened into the tensors one forward pass needs."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64: packed rows whose logits are returned
    metadata: PagedMetadata


def pack(chunks: list[SequenceChunk], kv_cache: KVCache, device: torch.device) -> PackedBatch:
    """Builds the packed inputs and cache metadata for `chunks` (see SequenceChunk).

    The index lists are built on the host and reach `device` in two copies (to_device): no per-sequence
    device work, and on CUDA no copy that waits for the GPU.
    """
    input_ids, rows, slots, logits_indices, starts, seq_lens = [], [], [], [], [0], []
    block_size = kv_cache.block_size
    for chunk in chunks:
        num_tokens = len(chunk.token_ids)
        offset = starts[-1]
        input_ids.extend(chunk.token_ids)
        rows.extend(range(chunk.start_pos, chunk.start_pos + num_tokens))
        slots.extend(position_slots(chunk.block_table, chunk.start_pos, chunk.start_pos + num_tokens, block_size))
        logits_indices.extend(range(offset + num_tokens - chunk.num_logits, offset + num_tokens))
        starts.append(offset + num_tokens)
        seq_lens.append(chunk.start_pos + num_tokens)
    # `rows`: where each token's K/V goes; `positions`: where it is computed (a tree row: at its depth).
    trees, positions = None, rows
    if any(c.parents is not None for c in chunks):
        parents = [p for c in chunks for p in (c.parents if c.parents is not None else range(-1, len(c.token_ids) - 1))]
        trees = DraftTrees.from_parents(starts, seq_lens, parents)
        chunk_starts = [c.start_pos for c in chunks for _ in c.token_ids]
        is_tree = [bool(tree) for c, tree in zip(chunks, trees.is_tree.tolist()) for _ in c.token_ids]
        positions = [
            start + depth if tree else row
            for start, depth, tree, row in zip(chunk_starts, trees.depths.tolist(), is_tree, rows)
        ]
        trees = trees.to(device)
    max_blocks = max(len(c.block_table) for c in chunks)
    # The block tables padded with block 0 (never read: seq_lens bound every access).
    tables = [b for c in chunks for b in c.block_table + [0] * (max_blocks - len(c.block_table))]
    rows_t, positions_t, input_ids_t, logits_t, slot_mapping = to_device(
        [rows, positions if trees is not None else [], input_ids, logits_indices, slots], torch.int64, device
    )
    block_tables, query_start_loc, seq_lens_t = to_device([tables, starts, seq_lens], torch.int32, device)
    block_tables = block_tables.view(len(chunks), max_blocks)  # [B, M]
    metadata = PagedMetadata(
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        trees=trees,
        max_query_len=max(len(c.token_ids) for c in chunks),
    )
    return PackedBatch(
        input_ids=input_ids_t,
        positions=rows_t if trees is None else positions_t,
        logits_indices=logits_t,
        metadata=metadata,
    )


class ModelRunner:
    """Owns one model and its paged KV cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        backend: str | None = None,
        batch_invariant: bool = True,
        graphs: bool = True,
        quantized_activations: str = DEFAULT_QUANTIZED_ACTIVATIONS,
        kv_cache_dtype: str = "auto",
    ):
        """backend: a name of backends.BACKENDS; None: the first that covers the model (backends.choose).
        batch_invariant: on a GPU, the linear layers and RMSNorms run our batch-invariant Triton kernels
        (invariant_layers.py); the CPU's kernels are batch invariant either way.
        graphs: on CUDA, decode and verify steps replay CUDA graphs (graphs.py; False: --enforce-eager).
        quantized_activations: how a CPU model's block-quantized linears take their inputs (fast_linear.py).
        kv_cache_dtype: KV_CACHE_DTYPES' (dtypes.py); a ValueError where the backend cannot keep that one."""
        self.model = model
        model.set_attn_implementation(ATTENTION_NAME)
        if model.device.type == "cpu":
            paged_attention_cpu.available()  # builds the CPU attention kernel (or warns) now, not in a step
        pack_linears(model, quantized_activations)  # CPU only; other devices keep nn.Linear
        if batch_invariant and model.device.type != "cpu":
            if HAS_TRITON:
                make_batch_invariant(model)
            else:
                logger.warning("triton is not importable: this %s model is not batch invariant", model.device.type)
        self.backend = backends.choose(model) if backend is None else backends.build(backend, model)
        self.device = model.device
        self.dtype = model.dtype
        model_dtype = str(model.dtype).removeprefix("torch.")
        cache_dtype = resolve_kv_cache_dtype(
            kv_cache_dtype, model_dtype, self.backend.bf16_cache_under_fp32, self.backend.name
        )
        self.kv_spec = KVCacheSpec.from_config(model.config, getattr(torch, cache_dtype))
        self.vocab_size = model.config.vocab_size
        self.kv_cache: KVCache | None = None
        # Layers whose input (the residual stream entering them) a forward keeps for an EAGLE-3 head, and what
        # the last forward kept: [T, len(aux_layers) x hidden], every packed row (proposers/eagle3.py).
        self.aux_layers: tuple[int, ...] = ()
        self.last_aux_hidden: torch.Tensor | None = None
        self.replay_type = CudaGraphReplay if graphs and model.device.type == "cuda" else None
        self.graphs: StepGraphs | None = None  # made by init_cache when replay_type is set

    def use_graphs(self, replay_type: type | None) -> None:
        """Graphs eligible steps with `replay_type` (graphs.py) from the next init_cache on; None: never."""
        self.replay_type = replay_type

    def init_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """(Re)allocates the KV cache; every cached K/V is dropped."""
        if self.graphs is not None:
            self.graphs.close()
        self.kv_cache = self.graphs = None  # freed first: the old and the new cache may not both fit in the budget
        scratch = list(range(num_blocks, num_blocks + scratch_blocks_needed(block_size))) if self.replay_type else []
        transposed = self.backend.transposed_keys and transposes_keys(self.kv_spec, self.device)
        self.kv_cache = KVCache(self.kv_spec, num_blocks + len(scratch), block_size, self.device, transposed)
        if self.replay_type is not None:  # the scratch blocks past the scheduler's take graphs' padding rows
            self.graphs = StepGraphs(self._forward_rows, self.kv_cache, scratch, self.replay_type, 4 * self.vocab_size)
        logger.info(
            "allocated %d KV blocks of %d tokens (%.1f MiB)", num_blocks, block_size, self.kv_cache.num_bytes / 2**20
        )
        return self.kv_cache

    def keep_path(self, block_table: list[int], start_pos: int, path_rows: list[int]) -> None:
        """After a draft tree was verified: moves the K/V of its accepted rows (`path_rows`, root's children
        first; row r was written at start_pos + r) to start_pos + 1, + 2, ..., where the next step reads them.
        Row 0 (the root) is in place already; a row already in place is not moved."""
        moves = [(start_pos + row, start_pos + depth) for depth, row in enumerate(path_rows, start=1) if row != depth]
        if moves:
            size = self.kv_cache.block_size
            slots = [[slot(block_table, p, size) for p in ends] for ends in zip(*moves)]
            self.kv_cache.move(*(torch.tensor(s, dtype=torch.int64, device=self.device) for s in slots))

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Computes every chunk; returns fp32 logits `[sum(num_logits), V]` in chunk order."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not initialised")
        if self.graphs is not None:
            key = graph_key(chunks, self.aux_layers, self.kv_cache.block_size)
            out = self.graphs.run(chunks, key) if key is not None else None
            if out is not None:
                logits, self.last_aux_hidden = out
                return logits
        batch = pack(chunks, self.kv_cache, self.device)
        logits, self.last_aux_hidden = self._forward_rows(
            batch.input_ids, batch.positions, batch.metadata, batch.logits_indices
        )
        return logits

    def _forward_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedMetadata, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backend and the output layer: fp32 logits of `rows` ([N, V]; the output layer is the costliest
        matmul of a small model, so only these rows get it), and the aux hidden states of every row."""
        hidden, aux = self.backend(input_ids, positions, metadata, rows, self.aux_layers)  # [N, hidden]
        return self.model.lm_head(hidden).float(), aux
