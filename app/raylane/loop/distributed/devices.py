"""What a device can do and what a rank holds: peak FLOP/s for MFU, memory for `strategy: auto`,
the memory figures of the summary, and the precision the loop computes in."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path

import torch

GIB = 1024**3
# The share of a device a layout chosen by the memory estimate may plan to fill (strategy.name, tp
# and ep: auto): the rest is for the allocator's fragmentation, the CUDA context and kernels'
# workspaces. And the optimizer states each parameter keeps (SGD: 1 with momentum, else 0).
AUTO_MARGIN = 0.85
OPTIMIZER_STATES = {"adam": 2, "adamw": 2}


def size_text(n_bytes: float) -> str:
    """Bytes in the unit that keeps 3 significant figures readable (`12.3 MiB`, `1.50 GiB`,
    `512 KiB`), so that sizes of small models differ visibly (not all `0.01 GiB`)."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= size:
            value = float(f"{n_bytes / size:.3g}")  # rounded first: 99.96 shows as 100, not 100.
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:#.3g} {unit}"
    return f"{n_bytes:.0f} B"


# Dense peak TFLOP/s (no 2:4 sparsity), as torchtitan's get_peak_flops and the vendors' sheets
# give them. fp32 is plain FP32 (TF32 is not enabled by raylane). Longest name first wins.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


# Memory per device, GiB, as the vendors' sheets give it (NVIDIA's H100 SXM/PCIe 80 GB, H100 NVL
# 94 GB, H200 141 GB, HGX B200 180 GB per GPU, A100 40 or 80 GB, L40S 48 GB, L4, A10G and A10 24
# GB, V100 16 or 32 GB): what `raylane check --world` (raylane.loop.rehearsal) weighs a rank
# against. torch reports a little less (an 80 GB H100's total_memory is ~79.6 GiB), which the
# rehearsal's 85% usable share (parallelize.AUTO_MARGIN) more than covers. Longest name first wins.
MEMORY_GIB: dict[str, float] = {
    "H100 PCIe": 80.0,
    "H100 NVL": 94.0,
    "H100": 80.0,
    "H200": 141.0,
    "B200": 180.0,
    "A100 40GB": 40.0,
    "A100": 80.0,
    "L40S": 48.0,
    "L4": 24.0,
    "A10G": 24.0,
    "A10": 24.0,
    "V100 16GB": 16.0,
    "V100": 32.0,
}


def named_gpu(name: str) -> str | None:
    """The table's name for a GPU model as a user writes it (`h100`, `A100 40GB`, `NVIDIA H200`), or None."""
    wanted = " ".join(name.upper().replace("NVIDIA", "").split())
    for key in sorted(MEMORY_GIB, key=len, reverse=True):
        if key.upper() == wanted:
            return key
    return None


def table_peak_flops(gpu: str, precision: str) -> float | None:
    """A table GPU's peak FLOP/s at `precision` (its family's: `A100 40GB` is an A100's)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if gpu.startswith(key):
            return PEAK_TFLOPS[key].get(precision, 0.0) * 1e12 or None
    return None


def peak_flops(device: torch.device, precision: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device at `precision`, or None when unknown (CPU without an override)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name and "PCIe" not in name and "NVL" not in name and _pcie_h100():
        name += " PCIe"
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key].get(precision, 0.0) * 1e12 or None
    return None


def _pcie_h100() -> bool:
    # The device name does not always say SXM or PCIe; the PCI device id does (0x2331 is PCIe).
    try:
        return any(p.read_text().strip() == "0x2331" for p in Path("/sys/bus/pci/devices").glob("*/device"))
    except OSError:
        return False


def device_memory_bytes(device: torch.device, override_gb: float | None, local_world_size: int) -> int:
    """Memory one rank may use: the GPU's, or on CPU this host's RAM shared by its ranks."""
    if override_gb:
        return int(override_gb * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().total // max(local_world_size, 1)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory allocated on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state held by this rank (its shards under FSDP)."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p)
        if p.grad is not None:
            total += _local_bytes(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _local_bytes(value)
    return total


def local_world_size(default: int = 1) -> int:
    """Ranks on this node, as torchrun and Ray Train export it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def largest_memory(state: int, device: torch.device) -> dict[str, int]:
    """Collective. The summary's memory figures, the largest over the ranks: the model and
    optimizer state a rank holds (`state`, this rank's), and the device's peak."""
    from raylane.loop.distributed.groups import all_reduce_max

    worst = all_reduce_max({"state_bytes_per_rank": state, "peak_bytes": peak_memory_bytes(device)}, device)
    return {k: int(v) for k, v in worst.items()}


class Precision:
    """`train.precision` in the loop: autocast under DDP and in one process (FSDP casts the
    parameters itself, through its MixedPrecisionPolicy), and fp16's gradient scaler."""

    def __init__(self, precision: str, strategy: str, device: torch.device) -> None:
        sharded = strategy in ("fsdp", "hsdp")
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}
        self.dtype = None if precision == "fp32" or sharded else half[precision]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
