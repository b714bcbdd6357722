"""The Llama forward on the CPU as a short fixed sequence of C calls per decoder layer.

`transformers`' decoder layer runs ~50 small torch ops per layer (RMSNorm's
casts and reductions, rotate_half's slices and cat, SiLU, the residual adds),
each with its Python, dispatch and allocation cost: ~10 ms of a 35 ms SmolLM2
decode step on two cores, beside ~23 ms of matmuls. Here a layer is ten
calls into our kernels, every one batch invariant (each row alone, in a
fixed order), into buffers the step reuses, and one C call
(`specdec_llama_layers`, kernels/csrc/layer_ops_cpu.c) makes all of a step's
layers' calls, since from Python each of those ~300 calls cost a few
microseconds (~1.5 ms of a 7 ms decode step):

    x = add_rms_norm(h, residual)          # residual += h; RMSNorm (kernels/layer_ops_cpu.py)
    qkv = project(x); rope(q and k heads)  # fused q/k/v projection (kernels/linear_cpu.py)
    write_kv(k, v); attn = attention(q)    # the paged cache (kernels/paged_attention_cpu.py)
    h = project(attn)                      # o_proj
    x = add_rms_norm(h, residual)
    h = project(silu_mul(project(x)))      # fused gate/up, then down

It rounds where `transformers` rounds (fp32 math, intermediates kept in the
model's dtype), so its logits equal the `transformers` forward's up to the
order of a few sums (tests/worker/runtime/test_fast_forward.py). `transformers` stays
the loader (the weights, the rotary embedding's cos/sin, every config option)
and the reference; models this does not cover run its forward unchanged.
"""

import ctypes
from dataclasses import dataclass
import weakref

import torch
from transformers import PreTrainedModel

from kernels import layer_ops_cpu, linear_cpu, paged_attention_cpu
from kernels.cpu_build import DTYPE_CODES
from worker_service.runtime.attention import PagedMetadata
from worker_service.runtime.backends.cpu_calls import KernelLinear, RopeTable
from worker_service.runtime.fast_linear import PackedLinear, SharedInputLinears
from worker_service.runtime.kv_cache import KVCacheSpec

MODEL_TYPES = ("llama",)  # decoder layers of exactly the shape below (SmolLM2, Llama 2/3, TinyLlama)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: KernelLinear
    o_proj: KernelLinear
    post_norm: torch.Tensor
    gate_up: KernelLinear
    down: KernelLinear
    scaling: float


def linear_function():
    """The projections' C function that the layers' loop calls (tests swap in a batch-dependent one)."""
    return linear_cpu.c_library().specdec_linear


def _linear_args(linear: KernelLinear) -> layer_ops_cpu.LinearArgs:
    return layer_ops_cpu.LinearArgs(
        linear.weight_dtype, linear.weight, linear.in_features, linear.out_features, linear.bias
    )


def _layer_args(layer: _Layer) -> layer_ops_cpu.LayerArgs:
    linears = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    return layer_ops_cpu.LayerArgs(
        layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *map(_linear_args, linears), layer.scaling
    )


class CpuLlamaForward:
    name = "cpu_llama"
    transposed_keys = True  # its attention is the C kernel, which reads K transposed (kv_cache.py)
    bf16_cache_under_fp32 = True  # its C K/V write rounds, its attention widens

    """model.model's forward (the hidden states after the final norm) for a packed CPU Llama.

    The tensors are checked here and once per step; then one C call runs the layers (the kernels' Python
    wrappers' checks and allocations cost more than the kernels at batch 1), into buffers the step reuses
    from layer to layer.
    """

    def __init__(self, model: PreTrainedModel):
        config = model.config
        self.model = model
        self.dtype = model.dtype
        spec = KVCacheSpec.from_config(config, model.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.detach().contiguous(),
                    KernelLinear.of(attn.q_proj_k_proj_v_proj.fused),
                    KernelLinear.of(attn.o_proj),
                    layer.post_attention_layernorm.weight.detach().contiguous(),
                    KernelLinear.of(mlp.gate_proj_up_proj.fused),
                    KernelLinear.of(mlp.down_proj),
                    attn.scaling,
                )
            )
        self.final_norm = model.model.norm.weight.detach().contiguous()
        self.rope = RopeTable(model.model.rotary_emb, model.dtype)
        self.intermediate = self.layers[0].gate_up.out_features // 2
        self.layer_args = (layer_ops_cpu.LayerArgs * len(self.layers))(*map(_layer_args, self.layers))
        self._addresses: tuple | None = None  # (a weak reference to a KVCache, its K and V addresses as C arrays)

    def _cache_addresses(self, cache) -> tuple:
        """The layers' K and V cache addresses as C arrays, made once per cache (weakly held: init_cache frees
        the old cache before making the new one)."""
        if self._addresses is None or self._addresses[0]() is not cache:
            arrays = (
                (ctypes.c_void_p * len(self.layers))(*(t.data_ptr() for t in caches))
                for caches in (cache.key_caches, cache.value_caches)
            )
            self._addresses = (weakref.ref(cache), *arrays)
        return self._addresses[1:]

    @staticmethod
    def supports(model: PreTrainedModel) -> str | None:
        """None when this forward covers `model`, else why not."""
        config = model.config
        if model.device.type != "cpu" or config.model_type not in MODEL_TYPES:
            return f"a {config.model_type} model on {model.device.type}"
        if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return f"hidden_act {config.hidden_act}, pretraining_tp {getattr(config, 'pretraining_tp', 1)}"
        if not (layer_ops_cpu.available() and paged_attention_cpu.available() and linear_cpu.available()):
            return "the C kernels are not built"
        if model.dtype not in DTYPE_CODES:
            return f"dtype {model.dtype}"
        spec = KVCacheSpec.from_config(config, model.dtype)
        if spec.head_dim > paged_attention_cpu.MAX_HEAD_DIM or spec.head_dim % 2:
            return f"head_dim {spec.head_dim}"
        qkv_sizes = [config.num_attention_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = getattr(attn, "q_proj_k_proj_v_proj", None), getattr(mlp, "gate_proj_up_proj", None)
            if not (
                isinstance(qkv, SharedInputLinears)
                and qkv.sizes == qkv_sizes
                and isinstance(gate_up, SharedInputLinears)
                and gate_up.sizes[0] == gate_up.sizes[1]
                and isinstance(attn.o_proj, PackedLinear)
                and isinstance(mlp.down_proj, PackedLinear)
            ):
                return "its linears are not packed and fused (fast_linear.pack_linears)"
        return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedMetadata,
        rows: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T]; returns the normed hidden states of `rows` ([N] int64), [N, hidden], and
        the residual stream entering each of `aux_layers` for every row, [T, len(aux_layers) x hidden] (None
        without aux_layers)."""
        num_tokens, hidden, dtype = input_ids.shape[0], self.hidden, self.dtype
        q_width = self.num_heads * self.head_dim
        qkv_width = q_width + 2 * self.num_kv_heads * self.head_dim
        residual = self.model.model.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: updated in place
        cos, sin = self.rope(positions)  # [T, D] each
        cache = meta.kv_cache
        assert residual.is_contiguous() and residual.dtype == dtype and cos.dtype == dtype
        assert paged_attention_cpu.cache_dtype_fits(dtype, cache.spec.dtype)
        assert cache.block_size * self.num_kv_heads * self.head_dim == cache.value_caches[0][0].numel()
        tables, starts, lens, slots = (
            t.contiguous() for t in (meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.slot_mapping)
        )
        assert tables.dtype == starts.dtype == lens.dtype == torch.int32 and slots.dtype == torch.int64
        trees = paged_attention_cpu.contiguous_trees(meta.trees, tables.shape[0], num_tokens)
        # One buffer per intermediate, reused by every layer (each kernel writes its output whole).
        x, h, attn = (torch.empty((num_tokens, width), dtype=dtype) for width in (hidden, hidden, q_width))
        qkv = torch.empty((num_tokens, qkv_width), dtype=dtype)
        gate_up = torch.empty((num_tokens, 2 * self.intermediate), dtype=dtype)
        act = torch.empty((num_tokens, self.intermediate), dtype=dtype)
        key_caches, value_caches = self._cache_addresses(cache)
        is_tree, prefix_lens, depths, paths, path_stride = paged_attention_cpu.tree_arguments(trees)
        # The residual stream entering each of aux_layers, [T, len(aux_layers) x hidden] (EAGLE-3's inputs).
        aux = torch.empty((num_tokens, len(aux_layers) * hidden), dtype=dtype) if aux_layers else None
        aux_indices = (ctypes.c_int64 * max(len(aux_layers), 1))(*aux_layers)
        step = layer_ops_cpu.StepArgs(
            DTYPE_CODES[dtype], num_tokens, hidden, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate, torch.get_num_threads(), self.eps,
            *(t.data_ptr() for t in (residual, x, h, attn, qkv, gate_up, act, cos, sin, slots, tables)),
            tables.stride(0), tables.shape[0], cache.block_size, starts.data_ptr(), lens.data_ptr(),
            is_tree, prefix_lens, depths, paths, path_stride,
            ctypes.addressof(key_caches), ctypes.addressof(value_caches), DTYPE_CODES[cache.spec.dtype],
            cache.keys_transposed,
            ctypes.cast(linear_function(), ctypes.c_void_p).value,
            ctypes.cast(paged_attention_cpu.kernel(), ctypes.c_void_p).value,
            aux.data_ptr() if aux is not None else None, ctypes.addressof(aux_indices), len(aux_layers),
        )  # fmt: skip
        status = layer_ops_cpu.c_library().specdec_llama_layers(ctypes.byref(step), self.layer_args, len(self.layers))
        if status != 0:
            kernel = "linear_cpu" if status == 1 else "paged_attention_cpu"
            raise ValueError(f"{kernel} failed (status {step.failed_status}) for {num_tokens} rows")
        # The last residual add and the final norm: only the rows whose logits are wanted.
        return layer_ops_cpu.add_rms_norm(h[rows], residual[rows], self.final_norm, self.eps), aux
