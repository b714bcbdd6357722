"""The dtypes and devices a worker's models run on: the names the flags take and how "auto" resolves."""

import re

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what a model runs in
# llama.cpp's weight blocks (kernels/quantized.py's FORMATS): fp32 KV by default, the CPU only.
QUANTIZED_DTYPES = ("q8_0", "q4_1")
# How their linear layers take their fp32 inputs (--quantized-activations; runtime/fast_linear.py): int8,
# quantized per row and block of 32, integer dot products; fp32, exact (the fp32 model on the dequantised weights).
QUANTIZED_ACTIVATIONS = ("int8", "fp32")
DEFAULT_QUANTIZED_ACTIVATIONS = "int8"
# --kv-cache-dtype: auto is the model's activation dtype (activation_dtype); bfloat16 under an fp32 or
# block-quantized model halves the cache where the forward backend reads a bf16 cache under fp32 queries.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
DTYPE_ALIASES = {"half": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES, *QUANTIZED_DTYPES, *DTYPE_ALIASES)  # what --dtype takes
DEVICE_SPELLINGS = "auto, cpu, cuda or cuda:N"  # what --device takes
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def normalize_dtype(name: str) -> str:
    """The one spelling of a --dtype value: an alias becomes its dtype's name ("half" -> "float16")."""
    return DTYPE_ALIASES.get(name, name)


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device_type: str, gguf_format: str | None = None
) -> str:
    """The dtype a model runs in. "auto": the checkpoint's dtype on an accelerator (float32 when the
    checkpoint names none we run); on the CPU a GGUF's own block format when all its layers are in one of
    QUANTIZED_DTYPES (`gguf_format`: the default model is a Q4_1 GGUF), else float32. A quantized dtype on
    another device is a ValueError."""
    requested = normalize_dtype(requested)
    if requested in QUANTIZED_DTYPES and device_type != "cpu":
        raise ValueError(f"--dtype {requested} runs on the CPU only; on {device_type} use one of {DTYPE_NAMES}")
    if requested != "auto":
        return requested
    if device_type != "cpu":
        return checkpoint_dtype if checkpoint_dtype in DTYPE_NAMES else "float32"
    return gguf_format if gguf_format in QUANTIZED_DTYPES else "float32"


def activation_dtype(dtype: str) -> str:
    """The torch dtype name activations (and by default the KV cache) have under a resolved dtype."""
    return "float32" if dtype in QUANTIZED_DTYPES else dtype


def resolve_kv_cache_dtype(requested: str, model_dtype: str, bf16_under_fp32: bool, backend: str) -> str:
    """The KV cache's dtype name: "auto" and the model's own dtype are the model's; bfloat16 under an fp32
    model where its forward backend reads one (`bf16_under_fp32`). Anything else is a ValueError naming
    --kv-cache-dtype."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {requested!r}")
    if requested in ("auto", model_dtype):
        return model_dtype
    if requested == "bfloat16" and model_dtype == "float32" and bf16_under_fp32:
        return requested
    raise ValueError(
        f"--kv-cache-dtype {requested} needs a float32 or block-quantized (q8_0, q4_1) model on the CPU's Llama "
        f"forward; this model runs in {model_dtype} on the {backend} forward (use auto)"
    )


def check_device(name: str) -> str:
    """`name` if --device can take it (auto, cpu, cuda, cuda:N), else ValueError; whether the device exists is
    resolve_device's question."""
    if not _DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"--device must be {DEVICE_SPELLINGS}, got {name!r}")
    return name


def resolve_device(requested: str, num_cuda_devices: int) -> str:
    """The device a worker runs on: "auto" is cuda:0 when there is a CUDA device, else the CPU; "cuda" is cuda:0.
    Raises ValueError (naming --device) for a CUDA device this host does not have."""
    check_device(requested)
    if requested == "auto":
        return "cuda:0" if num_cuda_devices > 0 else "cpu"
    if requested == "cpu":
        return requested
    if num_cuda_devices == 0:
        raise ValueError(
            f"--device {requested}: CUDA is not available here (no CUDA device, or a CPU-only build "
            "of torch); use --device cpu"
        )
    index = int(requested.partition(":")[2] or 0)
    if index >= num_cuda_devices:
        raise ValueError(
            f"--device {requested}: this host has {num_cuda_devices} CUDA device(s), "
            f"cuda:0..cuda:{num_cuda_devices - 1}"
        )
    return f"cuda:{index}"
