"""The Llama forward on a GPU as a short fixed sequence of Triton kernels per decoder layer.

`transformers`' decoder layer launches ~30 kernels per layer (RMSNorm's casts, rotate_half's slices and cat,
the K/V index copies, SiLU, the residual adds, three q/k/v and two gate/up GEMMs). In a CUDA graph their
launches cost nothing, but each still takes a few microseconds of the GPU for almost no work: an 8B-shaped
step spent more on them than on reading its weights (bench/results/gpu_check.json, profile). Here a layer is
nine launches (more where the linear splits K), every one batch invariant:

    x = add_rms_norm(h, residual)          # residual += h; RMSNorm (kernels/layer_ops.py)
    qkv = linear(x, [q; k; v])             # one projection (kernels/invariant_ops.py)
    rope_write_kv(qkv)                     # q rotated in place; k rotated and v written to the paged cache
    attn = paged_attention(q)              # kernels/paged_attention.py
    h = linear(attn, o)
    x = add_rms_norm(h, residual)
    h = linear(silu_mul(linear(x, [gate; up])), down)

Where a decode step's few rows make a linear split K, each linear's split sums go to the next kernel
(rope_write_kv, add_rms_norm, silu_mul), which adds them in the linear's own order: four launches a layer
fewer, the same bits.

The q/k/v and gate/up weights are joined once, and the model's own linears are made views of the joined
tensors (no second copy). It rounds where `transformers` rounds, so its logits equal the `transformers`
forward's up to the order of a few sums (tests/worker/runtime/test_gpu_forward.py); `transformers` stays the
loader (the weights, the rotary embedding's cos/sin) and the reference.
"""

from dataclasses import dataclass
import functools

import torch
from transformers import PreTrainedModel

from kernels import layer_ops
from kernels._triton import HAS_TRITON, INTERPRETED, TRITON_DEVICE_TYPES
from kernels.invariant_ops import linear_split_sums
from kernels.paged_attention import paged_attention_triton
from worker_service.runtime.attention import PagedMetadata
from worker_service.runtime.invariant_layers import InvariantLinear, InvariantRMSNorm, mismatch
from worker_service.runtime.kv_cache import KVCacheSpec

MODEL_TYPES = ("llama",)  # decoder layers of exactly the shape above (SmolLM2, Llama 2/3, TinyLlama)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=8)
def kernels_fail(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the layer kernels (kernels/layer_ops.py) run on `device` in `dtype` and match their references
    on a small random case; else why not (a Triton build or a GPU that cannot run them): the model then keeps
    the `transformers` forward."""
    try:
        generator = torch.Generator().manual_seed(0)
        h, residual = (torch.randn((3, 64), generator=generator).to(device, dtype) for _ in range(2))
        weight = torch.randn(64, generator=generator).to(device, dtype)
        want = layer_ops.add_rms_norm_ref(h, residual.clone(), weight, 1e-6)
        got = layer_ops.add_rms_norm_triton(h, residual.clone(), weight, 1e-6)
        gate_up = torch.randn((3, 128), generator=generator).to(device, dtype)
        qkv = torch.randn((3, 4 * 16), generator=generator).to(device, dtype)  # 2 query heads, 1 KV head of 16
        cos, sin = (torch.randn((3, 16), generator=generator).to(device, dtype) for _ in range(2))
        slots = torch.tensor([0, 5, 2], device=device)
        caches = [torch.zeros((2, 4, 1, 16), device=device, dtype=dtype) for _ in range(4)]
        rope_ref, rope_got = qkv.clone(), qkv.clone()
        layer_ops.rope_write_kv_ref(rope_ref, cos, sin, 2, slots, caches[0], caches[1])
        layer_ops.rope_write_kv_triton(rope_got, cos, sin, 2, slots, caches[2], caches[3])
        # the same ops fed a linear's split sums (two halves of each input, fp32), as a decode step feeds them
        halves = [(t.float() / 2).expand(2, *t.shape).contiguous() for t in (h, gate_up, qkv)]
        split_caches = [torch.zeros_like(caches[0]) for _ in range(2)]
        split_q = layer_ops.rope_write_kv_triton(halves[2], cos, sin, 2, slots, *split_caches)
        return mismatch(
            (got, want),
            (layer_ops.silu_mul_triton(gate_up), layer_ops.silu_mul_ref(gate_up)),
            (rope_got, rope_ref),
            (caches[2], caches[0]),
            (caches[3], caches[1]),
            (layer_ops.add_rms_norm_triton(halves[0], residual.clone(), weight, 1e-6), want),
            (layer_ops.silu_mul_triton(halves[1], dtype), layer_ops.silu_mul_ref(gate_up)),
            (split_q, rope_ref[:, : 2 * 16]),
            (split_caches[0], caches[0]),
            (split_caches[1], caches[1]),
        )
    except Exception as exc:  # noqa: BLE001 - whatever stops the kernels is reported, and the model keeps its forward
        return f"{type(exc).__name__}: {exc}"


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 KVH) D, hidden]
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor
    scaling: float


def join(linears: list[torch.nn.Module]) -> torch.Tensor:
    """The linears' weights as one [sum N, K] tensor; each linear's weight becomes a view of its rows."""
    joined = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = joined[start : start + rows]
        start += rows
    return joined


class GpuLlamaForward:
    name = "gpu_llama"
    # Its attention is the Triton kernel, whatever the device (the interpreter's on the CPU): K in the usual layout.
    transposed_keys = False
    bf16_cache_under_fp32 = False

    """model.model's forward (the hidden states after the final norm) for a Llama on a GPU whose linears and
    norms are the batch-invariant ones (invariant_layers.make_batch_invariant)."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        self.model = model
        spec = KVCacheSpec.from_config(config, model.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.detach(),
                    join([attn.q_proj, attn.k_proj, attn.v_proj]),
                    attn.o_proj.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    join([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj.weight.detach(),
                    attn.scaling,
                )
            )
        self.final_norm = model.model.norm.weight.detach()

    @staticmethod
    def supports(model: PreTrainedModel) -> str | None:
        """None when this forward covers `model`, else why not."""
        config = model.config
        device = model.device.type
        if not HAS_TRITON or not (device in TRITON_DEVICE_TYPES or (device == "cpu" and INTERPRETED)):
            return f"a model on {device}" + ("" if HAS_TRITON else " without triton")
        if config.model_type not in MODEL_TYPES:
            return f"a {config.model_type} model"
        if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return f"hidden_act {config.hidden_act}, pretraining_tp {getattr(config, 'pretraining_tp', 1)}"
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return "linears with biases"
        if model.dtype not in DTYPES:
            return f"dtype {model.dtype}"
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if "dynamic" in rope_type or rope_type == "longrope":
            # its frequencies follow the batch's longest position: read on the host, and not batch invariant
            return f"rope_type {rope_type}"
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not (
                all(isinstance(m, InvariantLinear) for m in modules)
                and all(isinstance(n, InvariantRMSNorm) for n in norms)
            ):
                return "its linears and norms are not the batch-invariant ones (--no-batch-invariant)"
        reason = kernels_fail(model.device, model.dtype)
        if reason is not None:
            return f"its kernels fail on {model.device}: {reason}"
        return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedMetadata,
        rows: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ForwardBackend.__call__."""
        num_tokens = input_ids.shape[0]
        heads, q_width = self.num_heads, self.num_heads * self.head_dim
        residual = self.model.model.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: updated in place
        cos, sin = self.model.model.rotary_emb(residual[None], positions[None])  # [1, T, D] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        cache = meta.kv_cache
        device = residual.device
        tables, starts, lens = (t.to(device) for t in (meta.block_tables, meta.query_start_loc, meta.seq_lens))
        slots = meta.slot_mapping.to(device)
        trees = meta.trees.to(device) if meta.trees is not None else None
        hidden = residual.shape[1]
        aux = (
            torch.empty((num_tokens, len(aux_layers) * hidden), dtype=residual.dtype, device=device)
            if aux_layers
            else None
        )
        h = None
        for index, layer in enumerate(self.layers):
            x = layer_ops.add_rms_norm_triton(h, residual, layer.input_norm, self.eps)
            for slot in (j for j, i in enumerate(aux_layers) if i == index):  # the stream entering this layer
                aux[:, slot * hidden : (slot + 1) * hidden] = residual
            qkv = linear_split_sums(x, layer.qkv)  # [T, (H + 2 KVH) D], or its split sums
            key_cache, value_cache = cache.key_caches[index], cache.value_caches[index]
            query = layer_ops.rope_write_kv_triton(qkv, cos, sin, heads, slots, key_cache, value_cache)
            query = query.view(num_tokens, heads, self.head_dim)
            attn = paged_attention_triton(
                query, key_cache, value_cache, tables, starts, lens, layer.scaling, trees, meta.max_query_len
            )  # [T, H, D]
            # the split sums of a decode step's few rows are added by the next kernel, not by a second launch
            h = linear_split_sums(attn.view(num_tokens, q_width), layer.o_proj)
            x = layer_ops.add_rms_norm_triton(h, residual, layer.post_norm, self.eps)
            act = layer_ops.silu_mul_triton(linear_split_sums(x, layer.gate_up), residual.dtype)
            h = linear_split_sums(act, layer.down)
        # The last residual add and the final norm: only the rows whose logits are wanted.
        last = h.index_select(-2, rows.to(h.device)) if h is not None else None
        return layer_ops.add_rms_norm_triton(last, residual[rows], self.final_norm, self.eps), aux
