"""The `transformers` attention function that runs models on our paged KV cache.

Registered under the name "specdec_paged". A model whose
`config._attn_implementation` is that name calls `paged_attention_forward` in
every attention layer with the query/key/value of a *packed* batch (batch
dimension 1, all sequences' tokens one after another). The function writes the
new K/V into the cache blocks at the slots of the block tables, then attends
each query token over its own sequence's blocks (causally, or along its draft
tree). The per-step
metadata travels as the `paged_metadata` keyword argument of the model's
forward, which `transformers` hands to every attention call.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kernels.draft_tree import DraftTrees
from kernels.paged_attention import paged_attention
from worker_service.runtime.kv_cache import KVCache

ATTENTION_NAME = "specdec_paged"


@dataclass
class PagedMetadata:
    """Where a packed batch's tokens live in the paged cache."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each packed token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32: token offsets of each sequence
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence including this step's tokens
    trees: DraftTrees | None = None  # sequences whose query rows form draft trees (kernels/draft_tree.py)
    max_query_len: int | None = None  # the most query rows of a sequence (None: unknown, bounded by T)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_metadata: PagedMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Writes K/V into the paged cache and attends over it. Returns `[1, T, H, D]`."""
    if paged_metadata is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs the paged_metadata forward argument")
    meta = paged_metadata
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)  # [T, KVH, D]
    layer_idx = module.layer_idx
    meta.kv_cache.write(layer_idx, k, v, meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(
        q,
        meta.kv_cache.key_caches[layer_idx],
        meta.kv_cache.value_caches[layer_idx],
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        meta.trees,
        meta.max_query_len,
        meta.kv_cache.keys_transposed,
    )  # [T, H, D]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
