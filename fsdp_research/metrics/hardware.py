"""Devices and links from their vendors' datasheets, in one place: what MFU divides by and what the planner's
step-time model runs on. A leaf: imports nothing of ours."""

import re
from dataclasses import dataclass

import torch

# Peak dense TFLOP/s per device from the vendors' datasheets (no sparsity): (16-bit tensor cores, fp32 without
# TF32, which torch leaves off for matmuls by default). Matched in order against torch.cuda.get_device_name(),
# lowercased, on whole words: the variants of a part (H100 SXM/PCIe/NVL, L4/L40/L40S) differ by up to 1.3x.
PEAK_TFLOPS = (
    (r"\b(h100|h800)\b.*\bpcie\b", 756.0, 51.0),
    (r"\b(h100|h200)\b.*\bnvl\b", 835.0, 60.0),
    (r"\b(gh200|h200|h100|h800)\b", 989.0, 67.0),
    (r"\bgb200\b", 2500.0, 80.0),
    (r"\bb200\b", 2250.0, 75.0),
    (r"\b(a100|a800)\b", 312.0, 19.5),
    (r"\ba10g?\b", 125.0, 31.2),
    (r"\bl40s\b", 362.0, 91.6),
    (r"\bl40\b", 181.0, 90.5),
    (r"\bl4\b", 121.0, 30.3),
    (r"\bv100\b.*\bpcie\b", 112.0, 14.0),
    (r"\bv100\b", 125.0, 15.7),
    (r"\bt4\b", 65.0, 8.1),
    (r"\brtx 4090\b", 165.0, 82.6),
    (r"\ba6000\b", 154.8, 38.7),
    (r"\brtx 3090\b", 71.0, 35.6),
    (r"\bmi300x\b", 1307.0, 163.4),
    (r"\bmi250x?\b", 383.0, 95.7),
)


def peak_for(device_name: str, dtype: torch.dtype) -> float | None:
    """A device's peak TFLOP/s for matmuls in dtype, by its name; None for a device not in the table."""
    name = device_name.lower()
    for pattern, half, single in PEAK_TFLOPS:
        if re.search(pattern, name):
            return single if dtype is torch.float32 else half
    return None


@dataclass(frozen=True)
class Device:
    """What the step-time model needs of a device: its memory, the peak of its matmuls, its memory bandwidth,
    and the bandwidths (GB/s one way, per device) of its links: within a node (NVLink), across nodes (one
    InfiniBand NIC per device), to the host (PCIe, what cpu_offload crosses)."""

    name: str
    # The datasheet's memory ("80GB": about 79 GiB usable as torch counts it).
    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float
    memory_gbs: float
    nvlink_gbs: float
    ib_gbs: float
    pcie_gbs: float
    # Devices per node: groups up to this size talk over NVLink.
    per_node: int = 8


# SXM parts. NVLink: the datasheet's bidirectional total halved. InfiniBand: a 400 Gb/s NDR NIC per GPU (50 GB/s;
# A100 systems: 200 Gb/s HDR). PCIe: Gen5 x16 (Gen4 for A100 and L40S).
GPUS = {
    "h100": Device("h100", 80, 989.0, 67.0, 3350, 450, 50, 64),
    "h200": Device("h200", 141, 989.0, 67.0, 4800, 450, 50, 64),
    "b200": Device("b200", 180, 2250.0, 75.0, 8000, 900, 50, 64),
    "a100": Device("a100", 80, 312.0, 19.5, 2039, 300, 25, 32),
    "mi300x": Device("mi300x", 192, 1307.0, 163.4, 5300, 448, 50, 64),
    "l40s": Device("l40s", 48, 362.0, 91.6, 864, 32, 25, 32, per_node=4),
    # 24-48 GB cards without NVLink (an A6000 pair's bridge aside): peers talk over PCIe Gen4 x16 (32 GB/s), nodes
    # over a cloud instance's 100 Gb/s shared by its GPUs.
    "l4": Device("l4", 24, 121.0, 30.3, 300, 32, 3, 32),
    "a10g": Device("a10g", 24, 125.0, 31.2, 600, 32, 3, 32),
    "rtx4090": Device("rtx4090", 24, 165.0, 82.6, 1008, 32, 3, 32, per_node=4),
    "a6000": Device("a6000", 48, 154.8, 38.7, 768, 32, 3, 32, per_node=4),
}
# Shares of the datasheet peaks a training step reaches: dense matmuls of a well-fed transformer (torchtitan and
# OLMo-core report 40-55% MFU for 8B models on H100), collectives' bus bandwidth (NCCL's tests: about 80%).
COMPUTE_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.8
LINKS = ("nvlink", "ib")
# Device memory no tensor of the run can use: the CUDA context (kernels, cuBLAS/cuDNN workspaces) takes 0.5-1 GiB
# of every GPU before the first allocation (nvidia-smi's usage of a process that has only initialised CUDA).
CUDA_CONTEXT_GIB = 0.75
# An NCCL communicator's own device buffers (NCCL_BUFFSIZE's 4 MiB per channel, peer and protocol: a few hundred
# MiB on an NVLink node; NVLS takes more) and its creation time (ncclCommSplit, a collective over its ranks). Each
# process group a rank joins on CUDA is one: FSDP2 makes a DeviceMesh, two groups, per unit resharded to k ranks.
NCCL_COMMUNICATOR_GIB = 0.25
NCCL_COMMUNICATOR_INIT_S = 0.5
# A node's host memory bandwidth (two sockets of DDR5), which its ranks' cpu_offload copies and CPU optimizer
# steps share.
HOST_MEMORY_GBS = 300.0


def gpu_named(device_name: str) -> Device | None:
    """The table's device that torch.cuda.get_device_name() names (whole words; "RTX 4090" is rtx4090), or None."""
    name = device_name.lower()
    spaced = {key: re.sub(r"(?<=[a-z])(?=\d)", " ?", key) for key in GPUS}
    return next((GPUS[key] for key, pattern in spaced.items() if re.search(rf"\b{pattern}\b", name)), None)


def gpu(name: str) -> Device:
    """A device of the table by its name (h100, ...); KeyError names the ones there are."""
    key = name.lower()
    if key not in GPUS:
        raise KeyError(f"no device {name!r} in the table; use one of {', '.join(GPUS)}")
    return GPUS[key]
