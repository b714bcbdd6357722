"""The Llama forward on the CPU as a short fixed sequence of C calls per decoder layer.

`transformers`' decoder layer runs ~50 small torch ops per layer (RMSNorm's
casts and reductions, rotate_half's slices and cat, SiLU, the residual adds),
each with its Python, dispatch and allocation cost: ~10 ms of a 35 ms SmolLM2
decode step on two cores, beside ~23 ms of matmuls. Here a layer is seven
calls into our kernels, every one batch invariant (each row alone, in a fixed
order):

    x = add_rms_norm(h, residual)          # residual += h; RMSNorm (kernels/layer_ops_cpu.py)
    qkv = linear(x); rope_(q and k heads)  # fused q/k/v projection (kernels/linear_cpu.py)
    write K/V; attn = paged_attention(q)   # kernels/paged_attention_cpu.py
    h = linear(attn)                       # o_proj
    x = add_rms_norm(h, residual)
    h = linear(silu_mul(linear(x)))        # fused gate/up, then down

It rounds where `transformers` rounds (fp32 math, intermediates kept in the
model's dtype), so its logits equal the `transformers` forward's up to the
order of a few sums (tests/worker/test_fast_forward.py). `transformers` stays
the loader (the weights, the rotary embedding's cos/sin, every config option)
and the reference; models this does not cover run its forward unchanged.
"""

from dataclasses import dataclass
import logging

import torch
from transformers import PreTrainedModel

from kernels import layer_ops_cpu, linear_cpu, paged_attention_cpu
from kernels.paged_attention import paged_attention
from worker_service.attention import PagedMetadata
from worker_service.fast_linear import PackedLinear, SharedInputLinears

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama",)  # decoder layers of exactly the shape below (SmolLM2, Llama 2/3, TinyLlama)


@dataclass
class _Linear:
    """A packed projection's tensors, for a direct kernel call."""

    packed_weight: torch.Tensor
    out_features: int
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module: PackedLinear) -> "_Linear":
        return cls(module.packed_weight, module.out_features, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear_cpu.linear_cpu(x, self.packed_weight, self.out_features, self.bias)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: _Linear
    o_proj: _Linear
    post_norm: torch.Tensor
    gate_up: _Linear
    down: _Linear
    scaling: float


class FastLlamaForward:
    """model.model's forward (the hidden states after the final norm) for a packed CPU Llama."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach(), _Linear.of(attn.q_proj_k_proj_v_proj.fused),
                _Linear.of(attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                _Linear.of(mlp.gate_proj_up_proj.fused), _Linear.of(mlp.down_proj), attn.scaling))
        self.final_norm = model.model.norm.weight.detach()

    @staticmethod
    def supports(model: PreTrainedModel) -> str | None:
        """None when this forward covers `model`, else why not."""
        config = model.config
        if model.device.type != "cpu" or config.model_type not in MODEL_TYPES:
            return f"a {config.model_type} model on {model.device.type}"
        if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return f"hidden_act {config.hidden_act}, pretraining_tp {getattr(config, 'pretraining_tp', 1)}"
        if not (layer_ops_cpu.available() and paged_attention_cpu.available()):
            return "the C kernels are not built"
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_sizes = [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = getattr(attn, "q_proj_k_proj_v_proj", None), getattr(mlp, "gate_proj_up_proj", None)
            if not (isinstance(qkv, SharedInputLinears) and qkv.sizes == qkv_sizes
                    and isinstance(gate_up, SharedInputLinears) and gate_up.sizes[0] == gate_up.sizes[1]
                    and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)):
                return "its linears are not packed and fused (fast_linear.pack_linears)"
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata,
                 rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; returns the normed hidden states of `rows` ([N] int64), [N, hidden]."""
        num_tokens = input_ids.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        residual = self.model.model.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: updated in place
        cos, sin = self.model.model.rotary_emb(residual[None], positions[None])  # [1, T, D] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        cache = meta.kv_cache
        h = None
        for index, layer in enumerate(self.layers):
            x = layer_ops_cpu.add_rms_norm(h, residual, layer.input_norm, self.eps)
            qkv = layer.qkv(x)  # [T, q_width + 2 * kv_width]
            layer_ops_cpu.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
            q = qkv[:, :q_width].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_width:q_width + kv_width].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_width + kv_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
            cache.write(index, k, v, meta.slot_mapping)
            out = paged_attention(q, cache.key_caches[index], cache.value_caches[index], meta.block_tables,
                                  meta.query_start_loc, meta.seq_lens, layer.scaling)  # [T, H, D]
            h = layer.o_proj(out.view(num_tokens, q_width))
            x = layer_ops_cpu.add_rms_norm(h, residual, layer.post_norm, self.eps)
            h = layer.down(layer_ops_cpu.silu_mul(layer.gate_up(x)))
        # The last residual add and the final norm: only the rows whose logits are wanted.
        return layer_ops_cpu.add_rms_norm(h[rows], residual[rows], self.final_norm, self.eps)


def build(model: PreTrainedModel) -> FastLlamaForward | None:
    """The fast forward for `model`, or None (logged) when `transformers`' forward must run it."""
    reason = FastLlamaForward.supports(model)
    if reason is not None:
        logger.info("the transformers forward runs this model (the fast CPU forward does not cover %s)", reason)
        return None
    return FastLlamaForward(model)
