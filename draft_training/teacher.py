"""Soft labels for a head: the target's own next-token distribution, recomputed from the stored features.

A shard keeps, for every position, the residual stream entering each auxiliary layer (the features the head
reads). The one entering the deepest of them is all the target's remaining layers need: running those layers
(causal attention over the conversation), its final norm and its output rows of the draft vocabulary over it
gives the target's distribution of the next token at every position, over the draft vocabulary. So a run
can train on the target's whole distribution (EAGLE-3 and SpecForge train on it alone: the forward KL to the
target), beside its greedy token (draft_training/trainer.py), from the same shards: no second pass over the
text, no new data.

The features are stored in bf16, so the distribution is the target's up to that rounding; it is a label, it
never reaches a served token.
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class TargetTail:
    """The target's layers from its deepest auxiliary layer on, its final norm and its draft-vocabulary rows."""

    def __init__(self, target, aux_layers: tuple[int, ...], output_weight: torch.Tensor, draft_to_target: torch.Tensor):
        deepest = max(aux_layers)
        self.slot = aux_layers.index(deepest)  # which third of a feature row enters that layer
        self.layers = list(target.model.layers[deepest:])
        self.norm = target.model.norm
        self.rotary = target.model.rotary_emb
        self.weight = output_weight.detach()[draft_to_target.to(output_weight.device)]  # [draft V, hidden]

    @torch.no_grad()
    def log_probs(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, len(aux_layers) x hidden] of positions 0 .. T - 1 (rows past a conversation's end
        are padding: mask what they give) -> [B, T, draft V] float: row p, the target's log-probability of each
        draft token being token p + 1, normalized over the draft vocabulary."""
        hidden_size = self.weight.shape[1]
        hidden = features[..., self.slot * hidden_size : (self.slot + 1) * hidden_size].to(self.weight.dtype)
        batch, length, _ = hidden.shape
        positions = torch.arange(length, device=hidden.device)[None].expand(batch, -1)
        position_embeddings = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = hidden + _causal_attention(layer.self_attn, layer.input_layernorm(hidden), position_embeddings)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return torch.log_softmax((self.norm(hidden) @ self.weight.T).float(), dim=-1)


def _causal_attention(attn, x: torch.Tensor, position_embeddings) -> torch.Tensor:
    """A Llama layer's self-attention over whole sequences, computed here: the served model's modules dispatch
    to the paged attention, which needs a step's KV cache."""
    batch, length, _ = x.shape
    head_dim = attn.head_dim
    q = attn.q_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    group = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
