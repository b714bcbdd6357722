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

from dataclasses import dataclass
import json
import logging
import mmap
import pathlib
import struct

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel

from kernels.quantized import FORMAT_OF_GGML, FORMATS, QBLOCK, BlockWeight
from specdec.cache import SOURCE_FILE
from worker_service.runtime.fast_linear import BLOCK_WEIGHT, quantize_linear

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
    logger.warning(
        "%s names %s as its source, which is gone or changed: its weights will be quantized anew",
        path / SOURCE_FILE,
        gguf_path,
    )
    return None


def gguf_format(model_path: str | pathlib.Path) -> str | None:
    """The served block format (FORMATS) all the decoder layers' linear weights of the model's GGUF are in, or
    None (no GGUF, or weights in other or mixed formats)."""
    gguf_path = source_gguf(model_path)
    if gguf_path is None:
        return None
    _, tensors = _gguf_index(gguf_path)
    formats = {
        FORMAT_OF_GGML.get(tensor.ggml_type)
        for name, tensor in tensors.items()
        if name.startswith("blk.") and len(tensor.shape) == 2
    }
    return formats.pop() if len(formats) == 1 else None


# Bytes of GGUF's scalar metadata value types (gguf.GGUFValueType), for skipping values; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class _TensorInfo:
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    offset: int  # from the file's start


def _gguf_index(gguf_path: pathlib.Path) -> tuple[dict[str, str | int], dict[str, _TensorInfo]]:
    """A GGUF's scalar string/int metadata and its tensors' types, shapes and offsets, read in one pass.

    (gguf.GGUFReader parses every metadata value into numpy views, ~4 s for the default model's 49k-token
    vocabulary; this skips arrays.)"""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as data:  # released before the mapping closes
            return _parse_index(gguf_path, data)


def _parse_index(gguf_path: pathlib.Path, data: memoryview) -> tuple[dict[str, str | int], dict[str, _TensorInfo]]:
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string() -> str:
        nonlocal pos
        length = take("Q")
        pos += length
        return bytes(data[pos - length : pos]).decode("utf-8", errors="replace")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item_kind, count = take("IQ")
            for _ in range(count):
                value(item_kind)
            return None
        pos += _SCALAR_BYTES[kind]
        fmt = {4: "I", 5: "i", 10: "Q", 11: "q"}.get(kind)
        return struct.unpack_from("<" + fmt, data, pos - _SCALAR_BYTES[kind])[0] if fmt else None

    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file")
    pos = 4
    _version, num_tensors, num_fields = take("IQQ")
    metadata = {}
    for _ in range(num_fields):
        key = string()
        metadata[key] = value(take("I"))
    infos = []
    for _ in range(num_tensors):
        name = string()
        shape = tuple(take("Q") for _ in range(take("I")))
        infos.append((name, take("I"), shape, take("Q")))
    alignment = metadata.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    tensors = {
        name: _TensorInfo(gguf.GGMLQuantizationType(kind), shape, start + offset) for name, kind, shape, offset in infos
    }
    return metadata, tensors


class _GGUFBlocks:
    """The block tensors of a GGUF file by `transformers` parameter name, in the rows transformers loads."""

    def __init__(self, gguf_path: pathlib.Path, model: PreTrainedModel):
        self.path = gguf_path
        metadata, self.tensors = _gguf_index(gguf_path)
        self.arch_name = metadata.get("general.architecture")
        arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(self.arch_name)
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
        if tensor is None or FORMAT_OF_GGML.get(tensor.ggml_type) != format or len(tensor.shape) != 2:
            return None
        in_features, out_features = tensor.shape
        row_bytes = in_features // QBLOCK * FORMATS[format].block_bytes
        raw = np.fromfile(self.path, dtype=np.uint8, count=out_features * row_bytes, offset=tensor.offset)
        blocks = BlockWeight(format, torch.from_numpy(raw).view(out_features, row_bytes), in_features)
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
    packing (worker_service/runtime/fast_linear.py) then serves them. Linears whose inputs are not a multiple of
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
            raise ValueError(
                f"{name}: the blocks in {gguf_path} do not dequantise to the weights transformers "
                "loaded from it (an unknown tensor layout)"
            )
        counts["from the GGUF" if blocks is not None else "quantized here"] += 1
        if blocks is None:
            quantize_linear(module, wanted)
        else:
            setattr(module, BLOCK_WEIGHT, blocks)
    logger.info(
        "%s weights, linear layers: %s (the output layer in %s)",
        format,
        ", ".join(f"{count} {how}" for how, count in counts.items() if count),
        OUTPUT_FORMAT,
    )
