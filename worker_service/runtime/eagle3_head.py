"""EAGLE-3 draft heads: loading the layout published heads use, and the head's forward on its own paged KV.

A head (a directory: `config.json` + `*.safetensors`) reads the target's
residual stream entering three of its layers (the "auxiliary hidden states",
by default layers 2, L/2 and L-3, or `eagle_config.eagle_aux_hidden_state_layer_ids`),
fuses them with `fc` ([3 * target hidden] -> hidden), and runs one Llama decoder
layer whose attention reads [RMSNorm(embedding of the next token),
RMSNorm(features)] (2 x hidden wide) on a KV cache of its own, on the target's
block tables. Its `lm_head` scores a draft vocabulary; `d2t` maps a draft id to
the target id (`target = draft + d2t[draft]`). The head's pre-norm output is
the feature of the next draft step.

Tensor names, as the two common training stacks write them: SpecForge puts the
layer under `midlayer.`, vLLM's speculators under `layers.0.`; either may carry
a `model.` prefix. `embed_tokens` is optional (the target's is used).
"""

from dataclasses import dataclass
import json
import logging
import pathlib

from safetensors.torch import load_file
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from kernels.quantized import QBLOCK
from worker_service.runtime.attention import ATTENTION_NAME, PagedMetadata
from worker_service.runtime.backends.cpu_head import CpuHeadForward
from worker_service.runtime.dtypes import DEFAULT_QUANTIZED_ACTIVATIONS
from worker_service.runtime.fast_linear import can_pack, pack_linears, quantize_linear
from worker_service.runtime.graphs import CudaGraphReplay, StepGraphs, scratch_blocks_needed
from worker_service.runtime.kv_cache import KVCache, KVCacheSpec, transposes_keys

logger = logging.getLogger(__name__)

LAYER_PREFIXES = ("midlayer.", "layers.0.")  # SpecForge, speculators
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
HEAD_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
# On the CPU a head's step is a few rows through every weight once (memory bound): its linears are served as
# llama.cpp's q8_0 blocks (fast_linear.quantize_linear), a quarter of fp32's bytes, with the activations the
# target's take (--quantized-activations). The head only proposes, so this changes which drafts come (0.5% of
# argmaxes on random features), never the output.
HEAD_WEIGHT_FORMAT = "q8_0"


class HeadError(ValueError):
    """A head that cannot be loaded or does not fit the target; the message names what and both values."""


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads, as vLLM and SpecForge choose them by default."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _read_tensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HeadError(f"EAGLE-3 head {directory}: no *.safetensors file")
    tensors = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            tensors[name.removeprefix("model.")] = tensor
    return tensors


def _layer_tensors(tensors: dict[str, torch.Tensor], directory: pathlib.Path) -> dict[str, torch.Tensor]:
    """The decoder layer's tensors under their own names, whichever stack's prefix they carry."""
    prefix = next((p for p in LAYER_PREFIXES if f"{p}{LAYER_TENSORS[0]}" in tensors), None)
    if prefix is None:
        raise HeadError(
            f"EAGLE-3 head {directory}: no decoder layer: missing tensor "
            f"{' or '.join(p + LAYER_TENSORS[0] for p in LAYER_PREFIXES)}"
        )
    missing = [prefix + name for name in LAYER_TENSORS if prefix + name not in tensors]
    missing += [name for name in HEAD_TENSORS if name not in tensors]
    if missing:
        raise HeadError(f"EAGLE-3 head {directory}: missing tensor {missing[0]}")
    return {name: tensors[prefix + name] for name in LAYER_TENSORS}


@dataclass
class TargetFacts:
    """What a head must match of its target."""

    hidden_size: int
    vocab_size: int
    num_layers: int


class Eagle3Head(torch.nn.Module):
    """One EAGLE-3 head on the target's device, in the activation dtype; see the module docstring."""

    def __init__(
        self,
        config: LlamaConfig,
        tensors: dict[str, torch.Tensor],
        layer: dict[str, torch.Tensor],
        aux_layers: tuple[int, ...],
        target_embedding: torch.nn.Embedding,
    ):
        super().__init__()
        hidden = config.hidden_size
        self.aux_layers = aux_layers
        self.fc = _linear(tensors["fc.weight"])
        self.embed_tokens = (
            torch.nn.Embedding.from_pretrained(tensors["embed_tokens.weight"])
            if "embed_tokens.weight" in tensors
            else target_embedding
        )
        self.input_layernorm = _norm(layer["input_layernorm.weight"], config)
        self.hidden_norm = _norm(layer["hidden_norm.weight"], config)
        self.post_attention_layernorm = _norm(layer["post_attention_layernorm.weight"], config)
        config._attn_implementation = ATTENTION_NAME
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # q/k/v read 2 x hidden: embedding and feature
            setattr(self.self_attn, name, _linear(layer[f"self_attn.{name}.weight"]))
        self.mlp = LlamaMLP(config)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self.mlp, name, _linear(layer[f"mlp.{name}.weight"]))
        self.norm = _norm(tensors["norm.weight"], config)
        self.lm_head = _linear(tensors["lm_head.weight"])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("draft_to_target", torch.arange(len(tensors["d2t"])) + tensors["d2t"].long())
        self.kv_spec = KVCacheSpec(1, config.num_key_value_heads, self.self_attn.head_dim, torch.float32)
        self.kv_cache: KVCache | None = None
        self.fast: CpuHeadForward | None = None  # load_head sets it where the CPU kernels cover the head
        self.replay_type: type | None = None  # load_head sets CudaGraphReplay on CUDA (graphs.py)
        self.graphs: StepGraphs | None = None  # the draft steps' graphs (draft_step), made by init_cache
        assert 2 * hidden == self.self_attn.q_proj.in_features

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The head computes in float32 whatever the target's dtype (its features are cast on the way in)."""
        return self.norm.weight.dtype

    def use_graphs(self, replay_type: type | None) -> None:
        """Graphs the draft steps with `replay_type` (graphs.py) from the next init_cache on; None: never."""
        self.replay_type = replay_type

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocates the head's one-layer KV cache on the target's block ids (and, with graphs, scratch
        blocks past them for the padding rows)."""
        if self.graphs is not None:
            self.graphs.close()
        self.kv_cache = self.graphs = None  # freed first, as the target's (ModelRunner.init_cache)
        scratch = list(range(num_blocks, num_blocks + scratch_blocks_needed(block_size))) if self.replay_type else []
        transposed = transposes_keys(self.kv_spec, self.device)  # its attention: the dispatch or cpu_head's C
        self.kv_cache = KVCache(self.kv_spec, num_blocks + len(scratch), block_size, self.device, transposed)
        if self.replay_type is not None:
            hidden, draft_vocab = self.norm.weight.shape[0], self.lm_head.out_features
            # the outputs (pre-norm state, an int64 id, a probability) and what the pool keeps besides: the
            # draft vocabulary's scores and softmax of every row, its features and MLP activations
            row_bytes = 4 * hidden + 12 + 8 * draft_vocab + 4 * (hidden + self.mlp.intermediate_size)
            self.graphs = StepGraphs(
                self._draft_step, self.kv_cache, scratch, self.replay_type, row_bytes, extras=((hidden, self.dtype),)
            )

    def features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states [T, 3 x target hidden] fused into features [T, hidden]."""
        return self.fc(aux_hidden.to(self.dtype))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        meta: PagedMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over a packed batch: input_ids [T] (the token after each position), positions [T],
        features [T, hidden]. Writes the head's K/V of every row; returns (normed, pre-norm) [T, hidden], or
        only of `output_rows` (each the last row of its sequence: a catch-up needs one row's output). On the
        CPU the same step runs as direct kernel calls (cpu_head.CpuHeadForward), and there the other
        rows stop after writing their K/V."""
        if self.fast is not None:
            return self.fast(input_ids, positions, features, meta, output_rows)
        embeds = self.input_layernorm(self.embed_tokens(input_ids).to(features.dtype))
        residual = features
        x = torch.cat([embeds, self.hidden_norm(features)], dim=-1)  # [T, 2 x hidden]
        cos, sin = self.rotary_emb(x[None], positions[None])
        attn, _ = self.self_attn(x[None], position_embeddings=(cos, sin), attention_mask=None, paged_metadata=meta)
        residual = residual + attn[0]
        prenorm = residual + self.mlp(self.post_attention_layernorm(residual))
        if output_rows is not None:
            prenorm = prenorm[output_rows]
        return self.norm(prenorm), prenorm

    def draft_tokens(self, normed: torch.Tensor) -> tuple[list[int], list[float]]:
        """The head's argmax for each row, as target token ids, and its probability (the head's confidence)."""
        ids, probs = self._best(normed)
        return ids.tolist(), probs.tolist()

    def _best(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tokens on the device: target ids [T] int64, probabilities [T] fp32."""
        probs, ids = torch.softmax(self.lm_head(normed).float(), dim=-1).max(dim=-1)  # [T], [T]
        return self.draft_to_target[ids], probs

    def _draft_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata, rows: torch.Tensor, features
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A draft step of every row, all on the device (what graphs capture): (pre-norm [T, hidden], the next
        draft's target ids [T], their probabilities [T])."""
        normed, prenorm = self(input_ids, positions, features, meta)
        return (prenorm, *self._best(normed))

    def top_draft_tokens(self, normed: torch.Tensor, width: int) -> tuple[list[list[int]], list[list[float]]]:
        """The head's `width` likeliest tokens for each row (target ids), most likely first, and their
        probabilities."""
        probs, ids = torch.softmax(self.lm_head(normed).float(), dim=-1).topk(width, dim=-1)  # [T, W], [T, W]
        return self.draft_to_target[ids].tolist(), probs.tolist()


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    return linear


def _norm(weight: torch.Tensor, config: LlamaConfig) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=config.rms_norm_eps)
    norm.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    return norm


def load_head(
    directory: str | pathlib.Path,
    target: TargetFacts,
    target_embedding: torch.nn.Embedding,
    device: torch.device,
    quantized_activations: str = DEFAULT_QUANTIZED_ACTIVATIONS,
    graphs: bool = True,
) -> Eagle3Head:
    """Loads and checks a head against its target; HeadError names what does not fit (both values).
    `quantized_activations`: how its q8_0 linears take their inputs on the CPU (runtime/fast_linear.py);
    `graphs`: on CUDA, its draft steps replay CUDA graphs (False: --enforce-eager)."""
    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise HeadError(f"EAGLE-3 head {directory}: no config.json")
    raw = json.loads(config_path.read_text())
    tensors = _read_tensors(directory)
    layer = _layer_tensors(tensors, directory)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")})
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in != 3 * target.hidden_size:
        raise HeadError(
            f"EAGLE-3 head {directory}: it reads hidden states of size {fc_in // 3} (fc takes "
            f"{fc_in}); the target's hidden size is {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        raise HeadError(
            f"EAGLE-3 head {directory}: vocabulary {config.vocab_size}; the target's is {target.vocab_size}"
        )
    aux = tuple(
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    )
    if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
        raise HeadError(
            f"EAGLE-3 head {directory}: it reads target layers {list(aux)}; the target has {target.num_layers} layers"
        )
    if len(tensors["d2t"]) != tensors["lm_head.weight"].shape[0]:
        raise HeadError(
            f"EAGLE-3 head {directory}: d2t maps {len(tensors['d2t'])} draft ids; lm_head scores "
            f"{tensors['lm_head.weight'].shape[0]}"
        )
    head = Eagle3Head(config, tensors, layer, aux, target_embedding).to(device).eval()
    if device.type == "cpu" and can_pack(head):  # a step reads every weight once: a quarter of fp32's bytes
        for module in head.modules():
            if type(module) is torch.nn.Linear and module.in_features % QBLOCK == 0:
                quantize_linear(module, HEAD_WEIGHT_FORMAT)
    # On the CPU: the batch-invariant kernel, so a catch-up equals a fresh run's prefill.
    pack_linears(head, quantized_activations)
    reason = CpuHeadForward.supports(head)
    head.fast = CpuHeadForward(head) if reason is None else None
    head.use_graphs(CudaGraphReplay if graphs and device.type == "cuda" else None)
    if reason is not None and device.type == "cpu":
        logger.info("the EAGLE-3 head runs transformers' modules (the fast CPU forward does not cover %s)", reason)
    logger.info(
        "EAGLE-3 head %s: draft vocabulary %d, reads target layers %s",
        directory,
        tensors["lm_head.weight"].shape[0],
        list(aux),
    )
    return head
