"""The paged KV cache: per layer, K and V in `[num_blocks, block_size, kv_heads, head_dim]` blocks; K in
`[num_blocks, kv_heads, head_dim, block_size]` where the CPU's C attention kernel reads it (`transposes_keys`):
there 16 keys' dimension d lie side by side, one vector, where the other layout took 64 shuffles per 16 keys
and 16 dimensions to transpose (scalar loads without AVX-512)."""

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from kernels import paged_attention_cpu
from kernels.cpu_build import DTYPE_CODES


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape facts of one model's KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> "KVCacheSpec":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element_size


def slot(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's `position` (computed on the host: the runner's pack and graphs' inputs)."""
    return block_table[position // block_size] * block_size + position % block_size


def position_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """slot() of each of a sequence's positions start .. end - 1, a block's run at a time."""
    found = []
    for index in range(start // block_size, -(-end // block_size)):
        base = (block_table[index] - index) * block_size  # position p of this block: slot base + p
        found.extend(range(base + max(start, index * block_size), base + min(end, (index + 1) * block_size)))
    return found


def transposes_keys(spec: KVCacheSpec, device: torch.device | str) -> bool:
    """Whether a cache of `spec` on `device` keeps K transposed: where the CPU's C attention kernel is what
    reads it (the attention dispatch's choice on the CPU, kernels/paged_attention.py)."""
    return (
        torch.device(device).type == "cpu"
        and spec.dtype in DTYPE_CODES
        and spec.head_dim <= paged_attention_cpu.MAX_HEAD_DIM
        and paged_attention_cpu.available()
    )


class KVCache:
    """K/V block tensors for every layer of one model. Slot s = block_id * block_size + offset.
    keys_transposed: K in [num_blocks, kv_heads, head_dim, block_size] (the module docstring)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        keys_transposed: bool = False,
    ):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys_transposed = keys_transposed
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        key_shape = (num_blocks, spec.num_kv_heads, spec.head_dim, block_size) if keys_transposed else shape
        self.key_caches = [torch.zeros(key_shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.spec.bytes_per_block(self.block_size) * self.num_blocks

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores this step's K/V (`[T, KVH, D]`) at their slots (`[T]` int64)."""
        flat_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        if self.keys_transposed:
            blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
            self.key_caches[layer_idx][blocks, :, :, offsets] = key.to(self.spec.dtype)
        else:
            self.key_caches[layer_idx].view(flat_shape).index_copy_(0, slot_mapping, key.to(self.spec.dtype))
        self.value_caches[layer_idx].view(flat_shape).index_copy_(0, slot_mapping, value.to(self.spec.dtype))

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s K as `[num_blocks, block_size, kv_heads, head_dim]` (a view, or a transposed copy)."""
        cache = self.key_caches[layer_idx]
        return cache.permute(0, 3, 1, 2).contiguous() if self.keys_transposed else cache

    def move(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copies every layer's K/V at `source_slots` to `target_slots` (`[N]` int64 each; all sources are read
        before any target is written, so the two may overlap)."""
        for caches, transposed in ((self.key_caches, self.keys_transposed), (self.value_caches, False)):
            for cache in caches:
                if transposed:
                    size = self.block_size
                    moved = cache[source_slots // size, :, :, source_slots % size]  # [N, KVH, D]: a copy
                    cache[target_slots // size, :, :, target_slots % size] = moved
                    continue
                flat = cache.view(-1, self.spec.num_kv_heads, self.spec.head_dim)
                flat.index_copy_(0, target_slots, flat.index_select(0, source_slots))
