"""An EAGLE-3 head's step on the CPU as direct kernel calls (the head's model: runtime/eagle3_head.py)."""

import torch

from kernels import layer_ops_cpu, linear_cpu, paged_attention_cpu
from kernels.cpu_build import DTYPE_CODES
from worker_service.runtime.attention import PagedMetadata
from worker_service.runtime.backends.cpu_calls import KernelLinear, RopeTable, project
from worker_service.runtime.fast_linear import PackedLinear, SharedInputLinears


class CpuHeadForward:
    """An EAGLE-3 head's step (runtime/eagle3_head.py, Eagle3Head.forward) as direct kernel calls, in fp32:

        x = [rms_norm(embedding), rms_norm(features)]   # both written into one [T, 2 x hidden] buffer
        qkv = project(x); rope; write_kv; attn = attention(q)   # the head's paged KV, along draft trees too
        residual = features + project(attn); x = rms_norm(residual)      # add_rms_norm
        prenorm = residual + project(silu_mul(project(x)))              # fused gate/up, then down
        normed = rms_norm(prenorm)

    transformers' modules cost the head ~150 small torch ops a step, more than its matmuls on a CPU; the
    kernels are those of CpuLlamaForward, so each row is computed alone (batch invariant) as there.

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
        self.qkv, self.o_proj = KernelLinear.of(attn.q_proj_k_proj_v_proj.fused), KernelLinear.of(attn.o_proj)
        q_width = self.num_heads * self.head_dim
        self.q = KernelLinear.outputs(attn.q_proj_k_proj_v_proj.fused, 0, q_width)
        self.kv = KernelLinear.outputs(attn.q_proj_k_proj_v_proj.fused, q_width, self.qkv.out_features)
        self.gate_up, self.down = KernelLinear.of(mlp.gate_proj_up_proj.fused), KernelLinear.of(mlp.down_proj)
        self.intermediate = self.gate_up.out_features // 2
        self.rope = RopeTable(head.rotary_emb, torch.float32)
        self.norms = tuple(
            n.weight.detach().float().contiguous()
            for n in (head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm)
        )

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
        if not (
            isinstance(qkv, SharedInputLinears)
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
        features: torch.Tensor,
        meta: PagedMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Eagle3Head.forward: (normed, pre-norm), [T, hidden] or [len(output_rows), hidden]; writes the
        head's K/V of every row."""
        num_tokens, hidden, dtype = input_ids.shape[0], self.hidden, torch.float32
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        qkv_width = q_width + 2 * kv_width
        embeds = self.head.embed_tokens(input_ids).to(dtype).contiguous()  # the target's embedding may be bf16
        residual = features.to(dtype).contiguous()  # a copy of it becomes the pre-norm output, in place
        cos, sin = self.rope(positions)
        cache = meta.kv_cache
        assert cache.spec.dtype == dtype and cos.dtype == dtype
        tables, starts, lens, slots = (
            t.contiguous() for t in (meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.slot_mapping)
        )
        trees = paged_attention_cpu.contiguous_trees(meta.trees, tables.shape[0], num_tokens)
        x, qkv = torch.empty((num_tokens, 2 * hidden), dtype=dtype), torch.empty((num_tokens, qkv_width), dtype=dtype)
        code, size, threads = DTYPE_CODES[dtype], 4, torch.get_num_threads()
        ops, attention = layer_ops_cpu.c_library(), paged_attention_cpu.kernel()
        input_norm, hidden_norm, post_norm, final_norm = self.norms
        ops.specdec_add_rms_norm(
            code,
            None,
            hidden,
            embeds.data_ptr(),
            hidden,
            input_norm.data_ptr(),
            x.data_ptr(),
            2 * hidden,
            num_tokens,
            hidden,
            self.eps,
            threads,
        )
        ops.specdec_add_rms_norm(
            code,
            None,
            hidden,
            residual.data_ptr(),
            hidden,
            hidden_norm.data_ptr(),
            x.data_ptr() + hidden * size,
            2 * hidden,
            num_tokens,
            hidden,
            self.eps,
            threads,
        )
        q_of_outputs_only = output_rows is not None and self.kv is not None
        if q_of_outputs_only:  # k and v of every row here, q of the output rows below
            project(self.kv, x, qkv[:, q_width:], qkv_width)
        else:
            project(self.qkv, x, qkv)
        q_ptr = qkv.data_ptr()
        rope_from, rope_heads = (q_width, kv_heads) if q_of_outputs_only else (0, heads + kv_heads)
        ops.specdec_rope(
            code,
            q_ptr + rope_from * size,
            qkv_width,
            num_tokens,
            rope_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            head_dim,
            threads,
        )
        key_cache, value_cache = cache.key_caches[0], cache.value_caches[0]
        cache_code = DTYPE_CODES[cache.spec.dtype]
        ops.specdec_write_kv(
            code,
            cache_code,
            q_ptr + q_width * size,
            q_ptr + (q_width + kv_width) * size,
            qkv_width,
            num_tokens,
            kv_width,
            slots.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            cache.block_size,
            cache.keys_transposed,
        )
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
                ops.specdec_rope(
                    code,
                    q.data_ptr(),
                    q_width,
                    num_tokens,
                    heads,
                    head_dim,
                    cos.data_ptr(),
                    sin.data_ptr(),
                    head_dim,
                    threads,
                )
            else:
                q = qkv[output_rows].contiguous()
            starts, q_ptr = torch.arange(num_tokens + 1, dtype=starts.dtype), q.data_ptr()
        attn = torch.empty((num_tokens, q_width), dtype=dtype)
        h, normed = torch.empty((num_tokens, hidden), dtype=dtype), torch.empty((num_tokens, hidden), dtype=dtype)
        gate_up = torch.empty((num_tokens, 2 * self.intermediate), dtype=dtype)
        act = torch.empty((num_tokens, self.intermediate), dtype=dtype)
        status = attention(
            code,
            cache_code,
            q_ptr,
            q_stride,
            head_dim,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            starts.data_ptr(),
            lens.data_ptr(),
            attn.data_ptr(),
            tables.shape[0],
            heads,
            kv_heads,
            head_dim,
            cache.block_size,
            self.scaling,
            *paged_attention_cpu.tree_arguments(trees),
            cache.keys_transposed,
            threads,
        )
        if status != 0:
            raise ValueError(f"paged_attention_cpu failed (status {status})")
        project(self.o_proj, attn, h)
        ops.specdec_add_rms_norm(
            code,
            h.data_ptr(),
            hidden,
            residual.data_ptr(),
            hidden,
            post_norm.data_ptr(),
            normed.data_ptr(),
            hidden,
            num_tokens,
            hidden,
            self.eps,
            threads,
        )
        project(self.gate_up, normed, gate_up)  # `normed` is free until the final norm
        ops.specdec_silu_mul(
            code,
            gate_up.data_ptr(),
            2 * self.intermediate,
            num_tokens,
            self.intermediate,
            act.data_ptr(),
            self.intermediate,
            threads,
        )
        project(self.down, act, h)
        ops.specdec_add_rms_norm(
            code,
            h.data_ptr(),
            hidden,
            residual.data_ptr(),
            hidden,
            final_norm.data_ptr(),
            normed.data_ptr(),
            hidden,
            num_tokens,
            hidden,
            self.eps,
            threads,
        )
        return normed, residual
