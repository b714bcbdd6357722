"""The Llama forward on the CPU as a short fixed sequence of C calls per decoder layer.

`transformers`' decoder layer runs ~50 small torch ops per layer (RMSNorm's
casts and reductions, rotate_half's slices and cat, SiLU, the residual adds),
each with its Python, dispatch and allocation cost: ~10 ms of a 35 ms SmolLM2
decode step on two cores, beside ~23 ms of matmuls. Here a layer is ten
direct calls into our kernels, every one batch invariant (each row alone, in a
fixed order), into buffers the step reuses:

    x = add_rms_norm(h, residual)          # residual += h; RMSNorm (kernels/layer_ops_cpu.py)
    qkv = project(x); rope(q and k heads)  # fused q/k/v projection (kernels/linear_cpu.py)
    write_kv(k, v); attn = attention(q)    # the paged cache (kernels/paged_attention_cpu.py)
    h = project(attn)                      # o_proj
    x = add_rms_norm(h, residual)
    h = project(silu_mul(project(x)))      # fused gate/up, then down

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
from kernels.cpu_build import DTYPE_CODES
from worker_service.attention import PagedMetadata
from worker_service.fast_linear import PackedLinear, SharedInputLinears
from worker_service.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama",)  # decoder layers of exactly the shape below (SmolLM2, Llama 2/3, TinyLlama)


@dataclass
class _Linear:
    """A packed projection: its kernel arguments, ready for a direct call."""

    weight_dtype: int
    weight: int            # packed weight's data pointer
    in_features: int
    out_features: int
    bias: int | None       # fp32 bias's data pointer
    tensors: tuple         # what the pointers point into, kept alive

    @classmethod
    def of(cls, module: PackedLinear) -> "_Linear":
        bias = module.bias
        return cls(module.weight_code, module.packed_weight.data_ptr(), module.in_features,
                   module.out_features, bias.data_ptr() if bias is not None else None, (module.packed_weight, bias))

    @classmethod
    def outputs(cls, module: PackedLinear, start: int, end: int) -> "_Linear | None":
        """The projection onto outputs [start, end) of `module` alone, on its packed weight's groups (each
        output's chain is the same, so each gets the same bits); None unless `start` begins a group (0 does)."""
        group = linear_cpu.group_out()
        if start % group:
            return None
        packed, bias = module.packed_weight[start // group:-(-end // group)], module.bias
        bias = bias[start:end] if bias is not None else None
        return cls(module.weight_code, packed.data_ptr(), module.in_features, end - start,
                   bias.data_ptr() if bias is not None else None, (packed, bias))


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
    """model.model's forward (the hidden states after the final norm) for a packed CPU Llama.

    The tensors are checked here and once per step; the kernels are then called directly (their Python
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
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach().contiguous(), _Linear.of(attn.q_proj_k_proj_v_proj.fused),
                _Linear.of(attn.o_proj), layer.post_attention_layernorm.weight.detach().contiguous(),
                _Linear.of(mlp.gate_proj_up_proj.fused), _Linear.of(mlp.down_proj), attn.scaling))
        self.final_norm = model.model.norm.weight.detach().contiguous()
        self.intermediate = self.layers[0].gate_up.out_features // 2

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
            if not (isinstance(qkv, SharedInputLinears) and qkv.sizes == qkv_sizes
                    and isinstance(gate_up, SharedInputLinears) and gate_up.sizes[0] == gate_up.sizes[1]
                    and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)):
                return "its linears are not packed and fused (fast_linear.pack_linears)"
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata,
                 rows: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T]; returns the normed hidden states of `rows` ([N] int64), [N, hidden], and
        the residual stream entering each of `aux_layers` for every row, [T, len(aux_layers) x hidden] (None
        without aux_layers)."""
        num_tokens, hidden, dtype = input_ids.shape[0], self.hidden, self.dtype
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        qkv_width = q_width + 2 * kv_width
        residual = self.model.model.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: updated in place
        cos, sin = self.model.model.rotary_emb(residual[None], positions[None])  # [1, T, D] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        cache = meta.kv_cache
        assert residual.is_contiguous() and residual.dtype == dtype == cache.spec.dtype and cos.dtype == dtype
        assert cache.block_size * kv_width == cache.key_caches[0][0].numel()  # [blocks, block size, KVH, D]
        tables, starts, lens, slots = (t.contiguous() for t in (meta.block_tables, meta.query_start_loc,
                                                                 meta.seq_lens, meta.slot_mapping))
        assert tables.dtype == starts.dtype == lens.dtype == torch.int32 and slots.dtype == torch.int64
        trees = paged_attention_cpu.contiguous_trees(meta.trees, tables.shape[0], num_tokens)
        # One buffer per intermediate, reused by every layer (each kernel writes its output whole).
        x, h, attn = (torch.empty((num_tokens, width), dtype=dtype) for width in (hidden, hidden, q_width))
        qkv = torch.empty((num_tokens, qkv_width), dtype=dtype)
        gate_up, act = torch.empty((num_tokens, 2 * self.intermediate), dtype=dtype), \
            torch.empty((num_tokens, self.intermediate), dtype=dtype)
        code, size, threads = DTYPE_CODES[dtype], residual.element_size(), torch.get_num_threads()
        ops, attention = layer_ops_cpu.c_library(), paged_attention_cpu.kernel()
        linear = project  # looked up once per step (a test replaces it to give the check teeth)
        q_ptr = qkv.data_ptr()
        aux = torch.empty((num_tokens, len(aux_layers) * hidden), dtype=dtype) if aux_layers else None
        for index, layer in enumerate(self.layers):
            ops.specdec_add_rms_norm(code, h.data_ptr() if index else None, hidden, residual.data_ptr(), hidden,
                                     layer.input_norm.data_ptr(), x.data_ptr(), hidden, num_tokens, hidden,
                                     self.eps, threads)
            for slot in (j for j, i in enumerate(aux_layers) if i == index):  # the stream entering this layer
                aux[:, slot * hidden:(slot + 1) * hidden] = residual
            linear(layer.qkv, x, qkv)
            ops.specdec_rope(code, q_ptr, qkv_width, num_tokens, heads + kv_heads, head_dim, cos.data_ptr(),
                             sin.data_ptr(), head_dim, threads)
            key_cache, value_cache = cache.key_caches[index], cache.value_caches[index]
            ops.specdec_write_kv(code, q_ptr + q_width * size, q_ptr + (q_width + kv_width) * size, qkv_width,
                                 num_tokens, kv_width, slots.data_ptr(), key_cache.data_ptr(),
                                 value_cache.data_ptr())
            status = attention(code, q_ptr, qkv_width, head_dim, key_cache.data_ptr(), value_cache.data_ptr(),
                               tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(),
                               attn.data_ptr(), tables.shape[0], heads, kv_heads, head_dim, cache.block_size,
                               float(layer.scaling), *paged_attention_cpu.tree_arguments(trees), threads)
            if status != 0:
                raise ValueError(f"paged_attention_cpu failed (status {status})")
            linear(layer.o_proj, attn, h)
            ops.specdec_add_rms_norm(code, h.data_ptr(), hidden, residual.data_ptr(), hidden,
                                     layer.post_norm.data_ptr(), x.data_ptr(), hidden, num_tokens, hidden,
                                     self.eps, threads)
            linear(layer.gate_up, x, gate_up)
            ops.specdec_silu_mul(code, gate_up.data_ptr(), 2 * self.intermediate, num_tokens, self.intermediate,
                                 act.data_ptr(), self.intermediate, threads)
            linear(layer.down, act, h)
        # The last residual add and the final norm: only the rows whose logits are wanted.
        return layer_ops_cpu.add_rms_norm(h[rows], residual[rows], self.final_norm, self.eps), aux


class FastHeadForward:
    """An EAGLE-3 head's step (worker_service/eagle3.py, Eagle3Head.forward) as direct kernel calls, in fp32:

        x = [rms_norm(embedding), rms_norm(features)]   # both written into one [T, 2 x hidden] buffer
        qkv = project(x); rope; write_kv; attn = attention(q)   # the head's paged KV, along draft trees too
        residual = features + project(attn); x = rms_norm(residual)      # add_rms_norm
        prenorm = residual + project(silu_mul(project(x)))              # fused gate/up, then down
        normed = rms_norm(prenorm)

    transformers' modules cost the head ~150 small torch ops a step, more than its matmuls on a CPU; the
    kernels are those of FastLlamaForward, so each row is computed alone (batch invariant) as there.

    With `output_rows` (the last row of some sequences), every row writes its K/V but only those rows run on
    from the attention: a catch-up over many committed positions needs their K/V and one row's output, and
    the rest of the layer (attention, o_proj, the MLP) is ~60% of a row's cost. The other rows project only
    k and v (the fused projection's outputs past q, when q fills whole weight groups), the output rows q
    too. Each output row attends to its sequence's whole context as it would in the full step, so it gets
    the same bits.
    """

    def __init__(self, head: torch.nn.Module):
        attn, mlp = head.self_attn, head.mlp
        self.head = head
        self.hidden = head.norm.weight.shape[0]
        self.num_heads, self.num_kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)
        self.eps = head.norm.variance_epsilon
        self.qkv, self.o_proj = _Linear.of(attn.q_proj_k_proj_v_proj.fused), _Linear.of(attn.o_proj)
        q_width = self.num_heads * self.head_dim
        self.q = _Linear.outputs(attn.q_proj_k_proj_v_proj.fused, 0, q_width)
        self.kv = _Linear.outputs(attn.q_proj_k_proj_v_proj.fused, q_width, self.qkv.out_features)
        self.gate_up, self.down = _Linear.of(mlp.gate_proj_up_proj.fused), _Linear.of(mlp.down_proj)
        self.intermediate = self.gate_up.out_features // 2
        self.norms = tuple(n.weight.detach().float().contiguous() for n in (
            head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm))

    @staticmethod
    def supports(head: torch.nn.Module) -> str | None:
        """None when this forward covers `head`, else why not."""
        attn, mlp = head.self_attn, head.mlp
        if head.norm.weight.device.type != "cpu" or head.norm.weight.dtype != torch.float32:
            return f"a head in {head.norm.weight.dtype} on {head.norm.weight.device.type}"
        if not (layer_ops_cpu.available() and paged_attention_cpu.available() and linear_cpu.available()):
            return "the C kernels are not built"
        if attn.head_dim > paged_attention_cpu.MAX_HEAD_DIM or attn.head_dim % 2:
            return f"head_dim {attn.head_dim}"
        if attn.config.hidden_act != "silu" or getattr(attn.config, "attention_bias", False):
            return f"hidden_act {attn.config.hidden_act}, attention_bias"
        qkv, gate_up = getattr(attn, "q_proj_k_proj_v_proj", None), getattr(mlp, "gate_proj_up_proj", None)
        if not (isinstance(qkv, SharedInputLinears) and isinstance(gate_up, SharedInputLinears)
                and gate_up.sizes[0] == gate_up.sizes[1]
                and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)):
            return "its linears are not packed and fused (fast_linear.pack_linears)"
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                 meta: PagedMetadata, output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As Eagle3Head.forward: (normed, pre-norm), [T, hidden] or [len(output_rows), hidden]; writes the
        head's K/V of every row."""
        num_tokens, hidden, dtype = input_ids.shape[0], self.hidden, torch.float32
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        qkv_width = q_width + 2 * kv_width
        embeds = self.head.embed_tokens(input_ids).to(dtype).contiguous()  # the target's embedding may be bf16
        residual = features.to(dtype).contiguous()  # a copy of it becomes the pre-norm output, in place
        cos, sin = self.head.rotary_emb(embeds[None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        cache = meta.kv_cache
        assert cache.spec.dtype == dtype and cos.dtype == dtype
        tables, starts, lens, slots = (t.contiguous() for t in (meta.block_tables, meta.query_start_loc,
                                                                 meta.seq_lens, meta.slot_mapping))
        trees = paged_attention_cpu.contiguous_trees(meta.trees, tables.shape[0], num_tokens)
        x, qkv = torch.empty((num_tokens, 2 * hidden), dtype=dtype), torch.empty((num_tokens, qkv_width), dtype=dtype)
        code, size, threads = DTYPE_CODES[dtype], 4, torch.get_num_threads()
        ops, attention = layer_ops_cpu.c_library(), paged_attention_cpu.kernel()
        input_norm, hidden_norm, post_norm, final_norm = self.norms
        ops.specdec_add_rms_norm(code, None, hidden, embeds.data_ptr(), hidden, input_norm.data_ptr(), x.data_ptr(),
                                 2 * hidden, num_tokens, hidden, self.eps, threads)
        ops.specdec_add_rms_norm(code, None, hidden, residual.data_ptr(), hidden, hidden_norm.data_ptr(),
                                 x.data_ptr() + hidden * size, 2 * hidden, num_tokens, hidden, self.eps, threads)
        q_of_outputs_only = output_rows is not None and self.kv is not None
        if q_of_outputs_only:  # k and v of every row here, q of the output rows below
            project(self.kv, x, qkv[:, q_width:], qkv_width)
        else:
            project(self.qkv, x, qkv)
        q_ptr = qkv.data_ptr()
        rope_from, rope_heads = (q_width, kv_heads) if q_of_outputs_only else (0, heads + kv_heads)
        ops.specdec_rope(code, q_ptr + rope_from * size, qkv_width, num_tokens, rope_heads, head_dim,
                         cos.data_ptr(), sin.data_ptr(), head_dim, threads)
        key_cache, value_cache = cache.key_caches[0], cache.value_caches[0]
        ops.specdec_write_kv(code, q_ptr + q_width * size, q_ptr + (q_width + kv_width) * size, qkv_width,
                             num_tokens, kv_width, slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr())
        q_stride = qkv_width
        if output_rows is None:
            residual = residual.clone()  # the caller's features stay as they are
        else:  # only these rows go on, each its sequence's last (a chain's), as one-row queries
            assert trees is None, "output rows are the last rows of chains"
            sequences = torch.searchsorted(starts[1:].long(), output_rows, right=True)
            residual = residual[output_rows]  # indexing copies
            tables, lens = tables[sequences].contiguous(), lens[sequences].contiguous()
            num_tokens = len(output_rows)
            if num_tokens == 0:
                return residual, residual
            if q_of_outputs_only:
                q, q_stride = torch.empty((num_tokens, q_width), dtype=dtype), q_width
                project(self.q, x[output_rows].contiguous(), q)
                cos, sin = cos[output_rows].contiguous(), sin[output_rows].contiguous()  # kept while the C reads
                ops.specdec_rope(code, q.data_ptr(), q_width, num_tokens, heads, head_dim, cos.data_ptr(),
                                 sin.data_ptr(), head_dim, threads)
            else:
                q = qkv[output_rows].contiguous()
            starts, q_ptr = torch.arange(num_tokens + 1, dtype=starts.dtype), q.data_ptr()
        attn = torch.empty((num_tokens, q_width), dtype=dtype)
        h, normed = torch.empty((num_tokens, hidden), dtype=dtype), torch.empty((num_tokens, hidden), dtype=dtype)
        gate_up = torch.empty((num_tokens, 2 * self.intermediate), dtype=dtype)
        act = torch.empty((num_tokens, self.intermediate), dtype=dtype)
        status = attention(code, q_ptr, q_stride, head_dim, key_cache.data_ptr(), value_cache.data_ptr(),
                           tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), attn.data_ptr(),
                           tables.shape[0], heads, kv_heads, head_dim, cache.block_size, self.scaling,
                           *paged_attention_cpu.tree_arguments(trees), threads)
        if status != 0:
            raise ValueError(f"paged_attention_cpu failed (status {status})")
        project(self.o_proj, attn, h)
        ops.specdec_add_rms_norm(code, h.data_ptr(), hidden, residual.data_ptr(), hidden, post_norm.data_ptr(),
                                 normed.data_ptr(), hidden, num_tokens, hidden, self.eps, threads)
        project(self.gate_up, normed, gate_up)  # `normed` is free until the final norm
        ops.specdec_silu_mul(code, gate_up.data_ptr(), 2 * self.intermediate, num_tokens, self.intermediate,
                             act.data_ptr(), self.intermediate, threads)
        project(self.down, act, h)
        ops.specdec_add_rms_norm(code, h.data_ptr(), hidden, residual.data_ptr(), hidden, final_norm.data_ptr(),
                                 normed.data_ptr(), hidden, num_tokens, hidden, self.eps, threads)
        return normed, residual


def project(layer: _Linear, source: torch.Tensor, target: torch.Tensor, target_stride: int | None = None) -> None:
    """target = source @ W.T + b, row by row: the packed linear kernel called directly (contiguous rows; the
    target's rows `target_stride` apart, default its width)."""
    status = linear_cpu.c_library().specdec_linear(
        DTYPE_CODES[source.dtype], source.data_ptr(), layer.in_features, source.shape[0], layer.in_features,
        layer.weight_dtype, layer.weight, layer.out_features, layer.bias, target.data_ptr(),
        target_stride or layer.out_features, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"linear_cpu failed (status {status}) for {source.shape[0]} rows")


def build(model: PreTrainedModel) -> FastLlamaForward | None:
    """The fast forward for `model`, or None (logged) when `transformers`' forward must run it."""
    reason = FastLlamaForward.supports(model)
    if reason is not None:
        logger.info("the transformers forward runs this model (the fast CPU forward does not cover %s)", reason)
        return None
    logger.info("the fast CPU forward runs this model (%d decoder layers as direct kernel calls)",
                len(model.model.layers))
    return FastLlamaForward(model)
