"""Theoretical occupancy and waves, by the rules of NVIDIA's occupancy calculator.

NVIDIA rows follow `cuda_occupancy.h` (CUDA 13) with the default shared-memory carveout: registers are
allocated per warp in units of 256 and split across the SM's 4 sub-partitions (2 on CC 6.0); shared memory is
allocated in units of 256 bytes (CC 7.x) or 128 bytes (CC 8.0+), and from CC 8.0 the driver reserves 1 KB per
block.
AMD rows use the analogous wavefront rules (VGPRs per SIMD in units of 8, LDS in units of 512 bytes, at most
16 workgroups per CU); treat those as approximate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from forecaster_mcp.hardware.specs import GpuSpec

MAX_THREADS_PER_BLOCK = 1024
_SUB_PARTITIONS = 4
_REG_UNIT = 256

Limiter = Literal["warps", "registers", "shared_memory", "blocks", "none"]


@dataclass(frozen=True)
class OccupancyLimits:
    """Resident blocks per SM allowed by each resource, and the result."""

    by_warps: int
    by_registers: int
    by_shared_memory: int
    by_blocks: int
    active_blocks: int
    occupancy: float  # resident warps / maximum warps per SM, 0..1
    limited_by: Limiter  # the binding resource; "none" when the block cannot launch at all

    @property
    def launchable(self) -> bool:
        return self.active_blocks > 0


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy_limits(
    spec: GpuSpec, threads_per_block: int, registers_per_thread: int = 0, shared_mem_per_block: int = 0
) -> OccupancyLimits:
    """Per-resource block limits for one SM (CU). `shared_mem_per_block` is static + dynamic bytes."""
    if spec.vendor == "amd":
        return _amd_limits(spec, threads_per_block, registers_per_thread, shared_mem_per_block)
    big = 1 << 30
    warp = spec.warp_size
    max_warps = spec.max_threads_per_sm // warp
    if not 0 < threads_per_block <= MAX_THREADS_PER_BLOCK:
        return OccupancyLimits(0, 0, 0, spec.max_blocks_per_sm, 0, 0.0, "none")
    warps_per_block = -(-threads_per_block // warp)

    by_warps = max_warps // warps_per_block

    if registers_per_thread <= 0:
        by_regs = big
    elif registers_per_thread > spec.max_registers_per_thread:
        by_regs = 0
    else:
        regs_per_warp = _round_up(registers_per_thread * warp, _REG_UNIT)
        # The hardware checks a block as if its warps were spread over all sub-partitions at once.
        # GP100 (CC 6.0) SMs have two processing blocks, every other SM four (cuda_occupancy.h). A block that
        # fits GP100 but not GP10x's four is refused on GP100 too (the header's forward-compatibility check
        # within Pascal), so the four-partition check applies to every GPU.
        parts = 2 if spec.compute_capability == "6.0" else _SUB_PARTITIONS
        assumed = regs_per_warp * _round_up(warps_per_block, _SUB_PARTITIONS)
        if assumed > spec.registers_per_sm or regs_per_warp * warps_per_block > spec.registers_per_sm:
            by_regs = 0
        else:
            per_partition = (spec.registers_per_sm // parts) // regs_per_warp
            by_regs = per_partition * parts // warps_per_block

    major = spec.cc_major
    reserved = 1024 if major >= 8 else 0
    unit = 128 if major >= 8 else 256
    allocated = _round_up(max(shared_mem_per_block, 0) + reserved, unit)
    if allocated > spec.max_shared_mem_per_block_bytes + reserved:
        by_smem = 0
    elif allocated == 0:
        by_smem = big
    else:
        by_smem = spec.shared_mem_per_sm_bytes // allocated

    return _finish(by_warps, by_regs, by_smem, spec.max_blocks_per_sm, warps_per_block, max_warps)


def _amd_limits(spec: GpuSpec, threads: int, vgprs: int, lds: int) -> OccupancyLimits:
    big = 1 << 30
    wave = spec.warp_size
    simds = 2 if spec.arch.startswith(("gfx10", "gfx11", "gfx12")) else 4
    max_waves = spec.max_threads_per_sm // wave
    waves_per_simd = max_waves // simds
    if not 0 < threads <= MAX_THREADS_PER_BLOCK:
        return OccupancyLimits(0, 0, 0, spec.max_blocks_per_sm, 0, 0.0, "none")
    waves_per_block = -(-threads // wave)
    by_waves = max_waves // waves_per_block
    if vgprs <= 0:
        by_regs = big
    elif vgprs > spec.max_registers_per_thread:
        by_regs = 0
    else:
        per_lane = spec.registers_per_sm // simds // wave
        waves = min(waves_per_simd, per_lane // _round_up(vgprs, _vgpr_granule(spec)))
        by_regs = waves * simds // waves_per_block
    allocated = _round_up(max(lds, 0), 512)
    if allocated > spec.max_shared_mem_per_block_bytes:
        by_lds = 0
    elif allocated == 0:
        by_lds = big
    else:
        by_lds = spec.shared_mem_per_sm_bytes // allocated
    # LLVM's AMDGPU backend (getMaxWorkGroupsPerCU) caps workgroups of two or more waves at 16 per CU (their
    # barriers); a single-wave workgroup needs no barrier resource and is limited by waves alone.
    by_blocks = max_waves if waves_per_block == 1 else spec.max_blocks_per_sm
    return _finish(by_waves, by_regs, by_lds, by_blocks, waves_per_block, max_waves)


def _vgpr_granule(spec: GpuSpec) -> int:
    """VGPRs are allocated per wave in blocks of this many (LLVM getVGPRAllocGranule): 8 on gfx90a/gfx942, 4 on
    other GCN/CDNA wave64, 16 on RDNA2 wave32, 24 on RDNA3's 1.5x register file (gfx1100/gfx1101)."""
    arch = spec.arch
    if arch.startswith(("gfx90a", "gfx94", "gfx95")):
        return 8
    if arch.startswith(("gfx1100", "gfx1101", "gfx115")):
        return 24 if spec.warp_size == 32 else 12
    if arch.startswith(("gfx103", "gfx11", "gfx12")):
        return 16 if spec.warp_size == 32 else 8
    return 8 if spec.warp_size == 32 else 4


def _finish(
    by_warps: int, by_regs: int, by_smem: int, by_blocks: int, warps_per_block: int, max_warps: int
) -> OccupancyLimits:
    active = min(by_warps, by_regs, by_smem, by_blocks)
    limiter: Limiter
    if active == 0:
        limiter = "none"
    elif active == by_regs:
        limiter = "registers"
    elif active == by_smem:
        limiter = "shared_memory"
    elif active == by_warps:
        limiter = "warps"
    else:
        limiter = "blocks"
    big = 1 << 30
    occupancy = active * warps_per_block / max_warps if max_warps else 0.0
    return OccupancyLimits(
        by_warps=by_warps,
        by_registers=min(by_regs, big),
        by_shared_memory=min(by_smem, big),
        by_blocks=by_blocks,
        active_blocks=active,
        occupancy=min(occupancy, 1.0),
        limited_by=limiter,
    )


def active_blocks_per_sm(
    spec: GpuSpec, threads_per_block: int, registers_per_thread: int = 0, shared_mem_per_block: int = 0
) -> int:
    """Resident blocks per SM; 0 when the block cannot launch (too many threads, registers or bytes)."""
    return occupancy_limits(spec, threads_per_block, registers_per_thread, shared_mem_per_block).active_blocks


def theoretical_occupancy(
    spec: GpuSpec, threads_per_block: int, registers_per_thread: int = 0, shared_mem_per_block: int = 0
) -> float:
    """Resident warps over the SM's maximum (0..1); 0.0 when the block cannot launch.

    `registers_per_thread` 0 means unknown (registers do not limit); shared memory is static + dynamic bytes.
    """
    return occupancy_limits(spec, threads_per_block, registers_per_thread, shared_mem_per_block).occupancy


def waves(spec: GpuSpec, blocks: int, blocks_per_sm: int) -> float:
    """How many times the grid fills the GPU: blocks / (SMs x resident blocks per SM).

    A fractional part is a partial last wave (a tail of idle SMs). `math.inf` when no block fits on an SM.
    """
    if blocks <= 0:
        return 0.0
    if blocks_per_sm <= 0:
        return math.inf
    return blocks / (spec.sms * blocks_per_sm)
