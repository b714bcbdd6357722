"""Serving block-quantized weights (--dtype q8_0, q4_1): which blocks each linear layer gets.

A quantized dtype keeps activations, norms and the KV cache in fp32 and
gives every linear layer llama.cpp's blocks (kernels/quantized.py): the
decoder layers' in the requested format, the output layer in OUTPUT_FORMAT
(as llama.cpp keeps it: the logits are the most sensitive). A linear's
blocks come from the GGUF the model was converted from when that tensor is
stored there in the very format (so the default model's Q4_1 file is served
as shipped, bit for bit), else llama.cpp's quantizer makes them here.

Each linear's `weight` is then set to its blocks' dequantised fp32 values,
which is what the CPU kernel computes with (bitwise), so the `transformers`
model stays the exact reference of what is served.
"""

import json
import logging
import pathlib

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel

from kernels.quantized import FORMAT_OF_GGML, FORMATS, QBLOCK, BlockWeight
from worker_service.fast_linear import BLOCK_WEIGHT
from worker_service.models import SOURCE_FILE

logger = logging.getLogger(__name__)

OUTPUT_FORMAT = "q8_0"  # the output layer's (lm_head) format under any quantized dtype


def source_gguf(model_path: str | pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a model comes from: itself, or the one its converted checkpoint names (when it is still
    there, unchanged in size); None for other checkpoints."""
    path = pathlib.Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    try:
        source = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    gguf_path = pathlib.Path(source.get("gguf", ""))
    if gguf_path.is_file() and gguf_path.stat().st_size == source.get("size"):
        return gguf_path
    logger.warning("%s names %s as its source, which is gone or changed: its weights will be quantized anew",
                   path / SOURCE_FILE, gguf_path)
    return None


def gguf_format(model_path: str | pathlib.Path) -> str | None:
    """The served block format (FORMATS) all the decoder layers' linear weights of the model's GGUF are in, or
    None (no GGUF, or weights in other or mixed formats)."""
    gguf_path = source_gguf(model_path)
    if gguf_path is None:
        return None
    formats = {FORMAT_OF_GGML.get(tensor.tensor_type) for tensor in gguf.GGUFReader(gguf_path).tensors
               if tensor.name.startswith("blk.") and len(tensor.shape) == 2}
    return formats.pop() if len(formats) == 1 else None


class _GGUFBlocks:
    """The block tensors of a GGUF file by `transformers` parameter name, in the rows transformers loads."""

    def __init__(self, gguf_path: pathlib.Path, model: PreTrainedModel):
        reader = gguf.GGUFReader(gguf_path)
        self.path = gguf_path
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}
        arch_field = reader.get_field("general.architecture")
        arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
        arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
        self.arch_name = arch_name
        self.names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers) if arch is not None else None
        self.config = model.config
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def get(self, param_name: str, format: str) -> BlockWeight | None:
        """The blocks of `param_name` ("model.layers.0.self_attn.q_proj.weight") when the GGUF stores it in
        `format`, else None."""
        if self.names is None:
            return None
        gguf_name = self.names.get_name(param_name, try_suffixes=(".weight",))
        if gguf_name is None:
            return None
        if gguf_name == "output.weight" and gguf_name not in self.tensors and self.tied:
            gguf_name = "token_embd.weight"  # a tied output layer is the embedding
        tensor = self.tensors.get(gguf_name)
        if tensor is None or FORMAT_OF_GGML.get(tensor.tensor_type) != format:
            return None
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        blocks = BlockWeight(format, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)), in_features)
        rows = self._row_order(gguf_name, blocks.out_features)
        return blocks if rows is None else blocks.take_rows(rows)

    def _row_order(self, gguf_name: str, num_rows: int) -> torch.Tensor | None:
        """llama.cpp stores Llama's q and k projections with the rows of each head interleaved for its RoPE;
        transformers undoes that when it loads them (its _reverse_permute_weights): the same order, here."""
        if self.arch_name != "llama" or not gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            return None
        heads = self.config.num_attention_heads
        if gguf_name.endswith(".attn_k.weight"):
            heads = getattr(self.config, "num_key_value_heads", None) or heads
        rows = torch.arange(num_rows).view(heads, num_rows // heads // 2, 2)  # row i takes stored row rows[i]
        return rows.transpose(1, 2).reshape(-1)


def quantize_model(model: PreTrainedModel, format: str, model_path: str | pathlib.Path) -> None:
    """Gives every linear layer of a CPU fp32 `model` its blocks (see the module docstring), in place; the
    packing (worker_service/fast_linear.py) then serves them. Linears whose inputs are not a multiple of
    QBLOCK stay fp32 (logged)."""
    if format not in FORMATS:
        raise ValueError(f"{format!r} is not a block format; one of {sorted(FORMATS)}")
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    gguf_path = source_gguf(model_path)
    source = _GGUFBlocks(gguf_path, model) if gguf_path is not None else None
    output = model.get_output_embeddings()
    counts = {"from the GGUF": 0, "quantized here": 0, "left in fp32": 0}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        if module.in_features % QBLOCK:
            counts["left in fp32"] += 1
            continue
        wanted = OUTPUT_FORMAT if module is output else format
        blocks = source.get(f"{name}.weight", wanted) if source is not None else None
        values = blocks.dequantize() if blocks is not None else None
        if blocks is not None and not torch.equal(values, module.weight):
            raise ValueError(f"{name}: the blocks in {gguf_path} do not dequantise to the weights transformers "
                             "loaded from it (an unknown tensor layout)")
        counts["from the GGUF" if blocks is not None else "quantized here"] += 1
        if blocks is None:
            blocks = BlockWeight.quantize(module.weight, wanted)
            values = blocks.dequantize()
        with torch.no_grad():
            module.weight.copy_(values)  # in place: a tied embedding keeps sharing it
        setattr(module, BLOCK_WEIGHT, blocks)
    logger.info("%s weights, linear layers: %s (the output layer in %s)", format,
                ", ".join(f"{count} {how}" for how, count in counts.items() if count), OUTPUT_FORMAT)
