"""Loads target and draft models: a local Hugging Face checkpoint directory or a GGUF file."""

import logging
import pathlib
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from worker_service.runtime.dtypes import DTYPE_NAMES, QUANTIZED_DTYPES, activation_dtype
from worker_service.runtime.quantization import quantize_model

logger = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # torch.float32, torch.bfloat16, torch.float16


class ModelLoadError(RuntimeError):
    """The model path does not exist or does not hold a loadable causal LM."""


def _split_path(model_path: pathlib.Path) -> tuple[str, dict]:
    """from_pretrained arguments for a directory or a .gguf file."""
    if model_path.is_file() and model_path.suffix == ".gguf":
        return str(model_path.parent), {"gguf_file": model_path.name}
    if model_path.is_dir():
        return str(model_path), {}
    raise ModelLoadError(f"model path {model_path} is neither a checkpoint directory nor a .gguf file")


def load_model(
    model_path: str | pathlib.Path, dtype: str = "float32", device: torch.device | str = "cpu"
) -> PreTrainedModel:
    """Loads a causal LM in eval mode on `device` (GGUF weights are dequantised to `dtype`). A quantized dtype
    (QUANTIZED_DTYPES) loads fp32 on the CPU and gives the linears their blocks (runtime/quantization.py)."""
    if dtype not in DTYPES and dtype not in QUANTIZED_DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES) + list(QUANTIZED_DTYPES)}, got {dtype!r}")
    if dtype in QUANTIZED_DTYPES and torch.device(device).type != "cpu":
        raise ModelLoadError(f"dtype {dtype} runs on the CPU only, not on {device}")
    path, kwargs = _split_path(pathlib.Path(model_path))
    start = time.monotonic()
    logger.info("loading model %s (%s on %s)", model_path, dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[activation_dtype(dtype)], local_files_only=True, **kwargs
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {model_path}: {exc}") from exc
    model.to(device).eval().requires_grad_(False)  # loaded on the CPU first: GGUF dequantises there
    if dtype in QUANTIZED_DTYPES:
        try:
            quantize_model(model, dtype, model_path)
        except ValueError as exc:
            raise ModelLoadError(f"cannot serve {model_path} in {dtype}: {exc}") from exc
    logger.info("loaded %s in %.1f s", model_path, time.monotonic() - start)
    return model


def checkpoint_dtype(model_path: str | pathlib.Path) -> str | None:
    """The dtype the checkpoint's config names (`dtype`, formerly `torch_dtype`), e.g. "bfloat16"; None when
    it names none."""
    path, kwargs = _split_path(pathlib.Path(model_path))
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model config from {model_path}: {exc}") from exc
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype if isinstance(dtype, str) else None


def load_tokenizer(model_path: str | pathlib.Path) -> PreTrainedTokenizerBase:
    """Loads the tokenizer stored with the model (GGUF files carry theirs)."""
    path, kwargs = _split_path(pathlib.Path(model_path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load tokenizer from {model_path}: {exc}") from exc


def unquantized_copy(gguf_path: str | pathlib.Path) -> PreTrainedModel:
    """The GGUF model dequantised to fp32 as a plain (serialisable) `transformers` model."""
    dequantised = load_model(gguf_path, "float32")
    config = dequantised.config
    del config.quantization_config  # the weights are plain fp32 now
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict(), assign=True)
    model.tie_weights()
    return model.eval()
