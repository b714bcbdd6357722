"""Where a worker runs its models, and how much memory its KV cache may take there.

On the CPU the KV budget is --kv-cache-memory-gib. On CUDA it follows vLLM's
--gpu-memory-utilization: the worker may use that fraction of the GPU's total
memory in all, so the KV cache gets what is left of it once the weights are
loaded, less ACTIVATION_RESERVE_BYTES for what a step allocates on the side.
"""

import torch

from worker_service.runtime.dtypes import resolve_device

# Memory that torch's allocator does not show after the model loads: the CUDA context and kernel images
# (~0.5 GiB), and a step's activations and sampling tensors ([B, K+1, V] float32: 0.9 GiB at B = 256, K = 5,
# V = 150k). Not profiled: a step's size is the scheduler's choice, unknown to the worker at startup.
ACTIVATION_RESERVE_BYTES = 2 << 30
GIB = 2**30


def use_device(requested: str) -> torch.device:
    """Resolves --device (resolve_device) and makes a CUDA device the calling thread's current one, so kernels
    launch where the model lives. Raises ValueError naming --device."""
    num_cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device(resolve_device(requested, num_cuda_devices))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def gpu_kv_budget_bytes(
    total_bytes: int,
    free_bytes: int,
    used_bytes: int,
    utilization: float,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """KV bytes on a GPU with `total_bytes` (`free_bytes` free now) of which this process holds `used_bytes`
    (weights): total * utilization - used - reserve. ValueError when that is <= 0, or when it and the reserve
    do not fit in the free memory (other processes hold the rest)."""
    budget = int(total_bytes * utilization) - used_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {total_bytes * utilization / GIB:.2f} GiB of the GPU's "
            f"{total_bytes / GIB:.2f} GiB leaves no room for a KV cache after the weights ({used_bytes / GIB:.2f} "
            f"GiB) and the activation reserve ({reserve_bytes / GIB:.2f} GiB); raise it"
        )
    if budget + reserve_bytes > free_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: a {budget / GIB:.2f} GiB KV cache and the "
            f"{reserve_bytes / GIB:.2f} GiB activation reserve do not fit in the GPU's {free_bytes / GIB:.2f} GiB "
            "free memory (other processes use it); lower --gpu-memory-utilization"
        )
    return budget


def kv_cache_budget_bytes(device: torch.device, cpu_bytes: int, gpu_memory_utilization: float) -> int:
    """The worker's KV budget, once its models are loaded on `device` (the one place this is decided): `cpu_bytes`
    (--kv-cache-memory-gib) off CUDA, else what --gpu-memory-utilization leaves."""
    if device.type != "cuda":
        return cpu_bytes
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_bytes = torch.cuda.memory_reserved(device)  # the weights, as torch's allocator holds them
    return gpu_kv_budget_bytes(total_bytes, free_bytes, used_bytes, gpu_memory_utilization)


def describe(device: torch.device) -> str:
    """The device for a log line: "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3, 79.2 GiB)"."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / GIB:.1f} GiB)"


def host_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of `values` on its way to `device`: pinned for CUDA, so that a non-blocking copy from it
    does not wait for the GPU (a copy from pageable memory waits for the GPU's queued work first)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(lists: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One tensor on `device` per list, through one host tensor and one non-blocking copy."""
    host = host_tensor([x for values in lists for x in values], dtype, device)
    moved = host.to(device, non_blocking=True) if device.type != "cpu" else host
    return list(moved.split([len(values) for values in lists]))
