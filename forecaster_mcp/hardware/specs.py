"""A table of GPU specifications and a forgiving name matcher.

INTERFACE (fixed; the table and matcher are filled in by the hardware work):
- GpuSpec: frozen dataclass below.
- lookup(name) -> GpuSpec | None: `A100`, `NVIDIA A100-PCIE-40GB`, `a100 80gb`, `H100`, `MI250X`... match.
- all_specs() -> list[GpuSpec].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GpuSpec:
    name: str  # canonical, e.g. "A100-PCIE-40GB"
    vendor: Literal["nvidia", "amd"]
    arch: str  # "sm_80", "gfx90a"
    compute_capability: str | None  # "8.0"; None for AMD
    sms: int  # SMs (NVIDIA) or CUs (AMD)
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int  # 32-bit registers
    max_registers_per_thread: int
    shared_mem_per_sm_bytes: int
    max_shared_mem_per_block_bytes: int
    l2_bytes: int
    mem_bandwidth_gbs: float  # peak DRAM/HBM bandwidth, GB/s
    fp32_tflops: float  # peak FP32 (non-tensor)
    fp16_tensor_tflops: float  # dense FP16/BF16 tensor throughput
    mem_gib: float
    warp_size: int = 32
    aliases: tuple[str, ...] = ()


_SPECS: list[GpuSpec] = []


def all_specs() -> list[GpuSpec]:
    return list(_SPECS)


def lookup(name: str) -> GpuSpec | None:
    raise NotImplementedError
