"""--dtype q8_0 / q4_1: llama.cpp's weight blocks served by the CPU kernel (worker_service/runtime/quantization.py).

With fp32 activations a quantized model computes bitwise what the fp32
model computes on the blocks' dequantised weights, with int8 ones (the
default) close to it; a GGUF's own blocks are served as shipped (the
default model's Q4_1 file), and `auto` keeps a GGUF's quantization on the CPU.
"""

import gguf
import numpy as np
import pytest
import torch

from kernels.quantized import FORMATS, BlockWeight
from tests.worker.runtime.test_fast_forward import _run
from worker_service.runtime import quantization
from worker_service.runtime.dtypes import QUANTIZED_DTYPES, resolve_dtype
from worker_service.runtime.fast_linear import BLOCK_WEIGHT, PackedLinear, block_weight
from worker_service.runtime.loader import ModelLoadError, load_model
from worker_service.runtime.runner import ModelRunner
from worker_service.speculation.config import WorkerConfig


def test_the_dtype_names_are_the_kernel_formats():
    assert set(QUANTIZED_DTYPES) == set(FORMATS)


def test_blocks_round_trip_through_gguf_bytes():
    """Our blocks are gguf-py's bytes: its dequantisation and llama.cpp's quantizer agree with ours."""
    weight = torch.randn(48, 96)
    for format, fmt in FORMATS.items():
        blocks = BlockWeight.quantize(weight, format)
        assert blocks.blocks.shape == (48, 3 * fmt.block_bytes)
        reference = gguf.quants.quantize(weight.numpy(), fmt.ggml)
        assert np.array_equal(blocks.blocks.numpy(), reference)
        error = (blocks.dequantize() - weight).abs().max().item()
        assert 0 < error < {"q8_0": 0.02, "q4_1": 0.5}[format] * weight.abs().max().item()
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockWeight("q8_0", torch.zeros((2, 34), dtype=torch.uint8), 40)


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_a_quantized_model_computes_what_fp32_computes_on_its_dequantised_weights(tiny_pair, dtype):
    """Prefills, decodes and verify queries: with fp32 activations the quantized model's logits are bitwise
    those of the fp32 model whose weights are the blocks' dequantised values, and every linear is served from
    blocks; with int8 activations they are close to them, not bitwise."""
    model = load_model(tiny_pair.target_path, dtype)
    assert model.dtype == torch.float32
    output_layer = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            wanted = quantization.OUTPUT_FORMAT if module is output_layer else dtype
            assert block_weight(module).format == wanted
    fp32 = load_model(tiny_pair.target_path, "float32")
    fp32.load_state_dict(model.state_dict())  # the dequantised values
    int8 = load_model(tiny_pair.target_path, dtype)
    served, reference = ModelRunner(model, quantized_activations="fp32"), ModelRunner(fp32)
    assert {m.weight_format for m in served.model.modules() if isinstance(m, PackedLinear)} == {
        dtype,
        quantization.OUTPUT_FORMAT,
    }
    assert served.backend.name == "cpu_llama"
    for ours, theirs in zip(_run(served, 0), _run(reference, 0)):
        assert torch.equal(ours, theirs)
    int8_served = ModelRunner(int8)  # the default: int8 activations
    assert {m.weight_format for m in int8_served.model.modules() if isinstance(m, PackedLinear)} == {
        f"{dtype} x int8",
        f"{quantization.OUTPUT_FORMAT} x int8",
    }
    for ours, theirs in zip(_run(int8_served, 0), _run(reference, 0)):
        assert not torch.equal(ours, theirs)
        assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()


def test_inputs_not_a_multiple_of_the_block_stay_fp32(tmp_path):
    from tests.tiny_models import save_tiny_tokenizer, tiny_llama

    model = tiny_llama(seed=0, num_layers=1, hidden=48, heads=3, kv_heads=1)  # 48 inputs: not a block multiple
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    loaded = load_model(tmp_path, "q4_1")
    linears = [m for m in loaded.modules() if type(m) is torch.nn.Linear]
    assert [block_weight(m) is None for m in linears] == [m.in_features % 32 != 0 for m in linears]
    assert any(block_weight(m) is None for m in linears) and any(block_weight(m) for m in linears)


@pytest.mark.parametrize(
    "requested, checkpoint, device, source, expected",
    [
        ("auto", None, "cpu", "q4_1", "q4_1"),  # a Q4_1 GGUF (the default model) keeps its blocks
        ("auto", None, "cpu", None, "float32"),  # another checkpoint: float32 on the CPU
        ("auto", "bfloat16", "cuda", "q4_1", "bfloat16"),  # on a GPU the blocks are dequantised
        ("float32", None, "cpu", "q4_1", "float32"),  # --dtype says otherwise
        ("q8_0", None, "cpu", "q4_1", "q8_0"),
    ],
)
def test_resolve_dtype_keeps_a_gguf_quantization_on_the_cpu(requested, checkpoint, device, source, expected):
    assert resolve_dtype(requested, checkpoint, device, source) == expected


def test_a_quantized_dtype_on_a_gpu_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="q4_1 runs on the CPU only; on cuda use one of"):
        resolve_dtype("q4_1", None, "cuda")
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model("unused", "q8_0", "cuda")
    assert WorkerConfig(model="m", dtype="q4_1").dtype == "q4_1"


@pytest.mark.slow
def test_the_default_model_is_served_from_its_gguf_blocks(smollm2_path):
    """auto is q4_1 for the shipped GGUF; each decoder linear gets the file's bytes (q and k in the row order
    transformers loads), the output layer the file's q8_0 embedding; with fp32 activations the logits are
    bitwise fp32's."""
    assert quantization.gguf_format(smollm2_path) == "q4_1"
    gguf_path = quantization.source_gguf(smollm2_path)
    model = load_model(smollm2_path, "q4_1")
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    down = block_weight(model.model.layers[3].mlp.down_proj)
    assert down.format == "q4_1" and np.array_equal(down.blocks.numpy(), tensors["blk.3.ffn_down.weight"].data)
    head = block_weight(model.lm_head)
    assert head.format == "q8_0" and np.array_equal(head.blocks.numpy(), tensors["token_embd.weight"].data)
    q = block_weight(model.model.layers[0].self_attn.q_proj)
    stored = tensors["blk.0.attn_q.weight"].data
    assert sorted(map(bytes, q.blocks.numpy())) == sorted(map(bytes, stored))  # the same rows, reordered

    served = ModelRunner(model, quantized_activations="fp32")
    fp32 = ModelRunner(load_model(smollm2_path, "float32"))
    for ours, theirs in zip(_run(served, 1), _run(fp32, 1)):
        assert torch.equal(ours, theirs)


@pytest.mark.slow
def test_blocks_in_an_unknown_layout_are_refused(smollm2_path, monkeypatch):
    """The loader checks a GGUF tensor's blocks against the weights transformers loaded from the same file:
    with the q/k row order left out, it refuses the model instead of serving scrambled heads."""
    monkeypatch.setattr(quantization._GGUFBlocks, "_row_order", lambda self, name, rows: None)
    with pytest.raises(ModelLoadError, match="q_proj: the blocks in .* do not dequantise"):
        load_model(smollm2_path, "q4_1")


def test_a_checkpoint_whose_gguf_is_gone_is_quantized_anew(tiny_pair, tmp_path, caplog):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    for path in tiny_pair.target_path.iterdir():
        (checkpoint / path.name).write_bytes(path.read_bytes())
    (checkpoint / quantization.SOURCE_FILE).write_text('{"gguf": "/nonexistent/model.gguf", "size": 1}')
    assert quantization.source_gguf(checkpoint) is None
    assert "is gone or changed" in caplog.text
    model = load_model(checkpoint, "q8_0")
    assert getattr(model.model.layers[0].mlp.down_proj, BLOCK_WEIGHT).format == "q8_0"


@pytest.mark.slow
def test_the_gguf_index_agrees_with_gguf_py(smollm2_path):
    """Our one-pass reader of a GGUF's tensor table (fast: it skips the vocabulary) against gguf-py's."""
    gguf_path = quantization.source_gguf(smollm2_path)
    metadata, tensors = quantization._gguf_index(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    assert metadata["general.architecture"] == "llama" and len(tensors) == len(reader.tensors)
    for tensor in reader.tensors:
        ours = tensors[tensor.name]
        assert (ours.ggml_type, list(ours.shape), ours.offset) == (
            tensor.tensor_type,
            list(tensor.shape),
            tensor.data_offset,
        )
