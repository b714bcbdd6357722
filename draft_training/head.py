"""The EAGLE-3 head as it trains: the serving head's computation (worker_service/runtime/eagle3_head.py), unrolled over
several draft steps at once ("training-time test"), and saved in the layout the worker loads.

Step 0 over a sequence x_0 .. x_{T-1} with the target's auxiliary hidden states a_p: row p reads the token
x_{p+1} and the features fc(a_p) at position p, and predicts x_{p+2} (the head's catch-up, all rows at once).
Step j >= 1, row p, is the head's j-th own draft step after a context ending at x_{p+1}: it reads x_{p+j+1}
(the token the earlier steps should have drafted) and, as features, its own pre-norm output of step j - 1 at
row p, sits at position p + j, and predicts x_{p+j+2}. It attends to what the serving head's cache holds at
that moment: step 0's keys at positions 0 .. p (computed from the target's features) and its own keys of
steps 1 .. j at row p. So each step trains exactly the computation that drafts at that depth.
"""

import json
import pathlib

from safetensors.torch import save_file
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

ARCHITECTURE = "LlamaForCausalLMEagle3"


def head_config(target: LlamaConfig, draft_vocab_size: int, aux_layers: tuple[int, ...]) -> dict:
    """The head's config.json: a one-layer Llama shaped like a target layer, plus the draft vocabulary and
    the target layers it reads."""
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": _rope_theta(target),
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }


def _rope_theta(config: LlamaConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class TrainableHead(torch.nn.Module):
    """The head's weights (SpecForge's names, `midlayer.` for the decoder layer) and its unrolled forward."""

    def __init__(
        self,
        config: dict,
        embedding: torch.Tensor,
        target_lm_head: torch.Tensor,
        target_norm: torch.Tensor,
        draft_to_target: torch.Tensor,
    ):
        super().__init__()
        llama = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "eagle_config")})
        hidden, heads, kv_heads, head_dim = (
            llama.hidden_size,
            llama.num_attention_heads,
            llama.num_key_value_heads,
            config["head_dim"],
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)  # the target's, frozen
        self.fc = torch.nn.Linear(3 * config["target_hidden_size"], hidden, bias=False)
        self.midlayer = torch.nn.Module()
        layer = self.midlayer
        layer.input_layernorm = LlamaRMSNorm(hidden, llama.rms_norm_eps)
        layer.hidden_norm = LlamaRMSNorm(hidden, llama.rms_norm_eps)
        layer.post_attention_layernorm = LlamaRMSNorm(hidden, llama.rms_norm_eps)
        layer.self_attn = torch.nn.Module()
        layer.self_attn.q_proj = torch.nn.Linear(2 * hidden, heads * head_dim, bias=False)
        layer.self_attn.k_proj = torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        layer.self_attn.v_proj = torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        layer.self_attn.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        layer.mlp = LlamaMLP(llama)
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
        # The output side starts as the target's: its final norm and its output rows of the draft vocabulary.
        self.norm = LlamaRMSNorm(hidden, llama.rms_norm_eps)
        self.norm.weight.data.copy_(target_norm.float())
        self.lm_head = torch.nn.Linear(hidden, len(draft_to_target), bias=False)
        self.lm_head.weight.data.copy_(target_lm_head.detach().float()[draft_to_target])
        self.register_buffer("draft_to_target", draft_to_target.long(), persistent=False)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.config = config

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """input_ids [B, T], aux_hidden [B, T, 3 x target hidden] -> per step j, logits [B, T - 1, draft V]
        of row p predicting x_{p+j+2} (rows past the end read padding: mask their labels)."""
        batch, length = input_ids.shape
        rows = length - 1
        padded = torch.nn.functional.pad(input_ids, (0, num_steps))  # [B, T + steps]
        features = self.fc(aux_hidden[:, :rows].float())  # [B, R, H]
        keys, values, logits = [], [], []
        for j in range(num_steps):
            tokens = padded[:, j + 1 : j + 1 + rows]  # [B, R]
            positions = torch.arange(j, j + rows, device=input_ids.device)[None].expand(batch, -1)
            prenorm = self._layer(tokens, positions, features, keys, values)
            logits.append(self.lm_head(self.norm(prenorm)))  # [B, R, draft V]
            features = prenorm
        return logits

    def _layer(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        layer = self.midlayer
        embeds = layer.input_layernorm(torch.nn.functional.embedding(tokens, self.embedding))
        x = torch.cat([embeds, layer.hidden_norm(features)], dim=-1)  # [B, R, 2H]
        batch, rows, _ = x.shape
        q = layer.self_attn.q_proj(x).view(batch, rows, self.num_heads, self.head_dim).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(batch, rows, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(batch, rows, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # [B, heads, R, D], [B, kv heads, R, D]
        group = self.num_heads // self.num_kv_heads
        keys.append(k.repeat_interleave(group, dim=1))
        values.append(v.repeat_interleave(group, dim=1))
        attn = _ttt_attention(q, keys, values, self.head_dim**-0.5)  # [B, heads, R, D]
        attn = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(batch, rows, -1))
        residual = features + attn
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def save(self, directory: pathlib.Path) -> None:
        """Writes config.json and model.safetensors (bf16 weights, as published heads are) that load_head reads."""
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in self.named_parameters()}
        draft_to_target = self.draft_to_target.cpu()  # the head may have trained on CUDA
        d2t = draft_to_target - torch.arange(len(draft_to_target))
        t2d = torch.zeros(self.config["vocab_size"], dtype=torch.bool)
        t2d[draft_to_target] = True
        tensors.update({"d2t": d2t, "t2d": t2d})
        save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Row p of the newest step attends to step 0's keys at rows <= p and to each later step's key at row p."""
    rows = q.shape[2]
    scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * scale]  # [B, heads, R, R]
    causal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [((q * k).sum(-1) * scale)[..., None] for k in keys[1:]]  # each [B, heads, R, 1]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = torch.matmul(probs[..., :rows], values[0])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., rows + i, None] * v
    return out
