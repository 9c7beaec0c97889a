"""A table of GPU specifications and a forgiving name matcher.

INTERFACE (fixed):
- GpuSpec: frozen dataclass below.
- lookup(name) -> GpuSpec | None: `A100`, `NVIDIA A100-PCIE-40GB`, `a100 80gb`, `H100`, `MI250X`... match.
- all_specs() -> list[GpuSpec].
- canonical_name(name) -> str, suggest(name) -> list[str].

Sources: vendor datasheets and whitepapers for SM counts, clocks, bandwidth, L2 and throughput; the CUDA
Programming Guide's per-compute-capability table and `cuda_occupancy.h` (CUDA 13) for per-SM limits.
Conventions, so rows are comparable:
- `fp32_tflops`: peak non-tensor FP32 at boost clock.
- `fp16_tensor_tflops`: dense (no 2:4 sparsity) FP16 inputs with FP32 accumulation, the mode GEMMs use by
  default. GeForce cards run that mode at half their FP16-accumulate rate, so their figure is the halved one.
  GPUs without matrix units (Pascal, Maxwell, MI50, RDNA2) list vector FP16 throughput instead (packed half2
  where the GPU has it; the FP32 rate on Maxwell, which computes half in FP32).
- `mem_gib`: nominal capacity as marketed, in GiB (a GPU's "80GB" is 80 GiB of memory chips).
- `shared_mem_per_sm_bytes` / `max_shared_mem_per_block_bytes`: the largest carveout and the opt-in per-block
  maximum (`cudaDevAttrMaxSharedMemoryPerBlockOptin`).
- AMD rows: `sms` counts compute units as HIP reports them (an MI250X is two devices of 110 CUs each, so
  its row is one GCD); per-CU limits are approximate (no vendor occupancy calculator); warp size is the
  wavefront size.

Matching rules (`lookup`): case, spaces, dashes and underscores do not matter; vendor and brand words
(NVIDIA, AMD, GeForce, Radeon, Instinct, Tesla, Quadro, "GPU") are ignored; a memory size ("80GB") and a
form factor ("SXM4", "PCIe", "NVL") narrow the choice and never widen it; a bare family name picks the
family's first row in the table (the SXM part with the most memory). The model itself must match exactly,
so "A10" never becomes "A100" and "RTX 3060" (desktop) never becomes the laptop part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
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

    @property
    def fp64_ratio(self) -> float:
        """How many times the FP32 throughput the FP64 throughput is below (_FP64_RATIO)."""
        return _FP64_RATIO.get(self.arch, 2.0)

    @property
    def cc_major(self) -> int:
        """The compute capability's major version (8 for "8.6"); 0 for AMD."""
        return int((self.compute_capability or "0.0").split(".")[0])

    @property
    def tensor_cores(self) -> bool:
        """Whether the GPU has matrix instructions: NVIDIA from Volta (CC 7.0) on, AMD CDNA (MFMA) and RDNA3
        (WMMA); not Pascal, Maxwell, Vega 20 (MI50) or RDNA2, whose `fp16_tensor_tflops` is vector FP16."""
        if self.vendor == "amd":
            return self.arch not in _AMD_WITHOUT_MATRIX
        return self.cc_major >= 7


KIB = 1024
MIB = 1024 * 1024

# Per-SM limits by compute capability: (arch, max threads/SM, max blocks/SM, shared memory per SM,
# opt-in shared memory per block). Registers are 64K per SM and 255 per thread on every row below.
_CC: dict[str, tuple[str, int, int, int, int]] = {
    "5.2": ("sm_52", 2048, 32, 96 * KIB, 48 * KIB),
    "6.0": ("sm_60", 2048, 32, 64 * KIB, 48 * KIB),
    "6.1": ("sm_61", 2048, 32, 96 * KIB, 48 * KIB),
    "7.0": ("sm_70", 2048, 32, 96 * KIB, 96 * KIB),
    "7.5": ("sm_75", 1024, 16, 64 * KIB, 64 * KIB),
    "8.0": ("sm_80", 2048, 32, 164 * KIB, 163 * KIB),
    "8.6": ("sm_86", 1536, 16, 100 * KIB, 99 * KIB),
    "8.9": ("sm_89", 1536, 24, 100 * KIB, 99 * KIB),
    "9.0": ("sm_90", 2048, 32, 228 * KIB, 227 * KIB),
    "10.0": ("sm_100", 2048, 32, 228 * KIB, 227 * KIB),
    # cuda_occupancy.h (CUDA 13) caps 12.x at 24 resident blocks per SM.
    "12.0": ("sm_120", 1536, 24, 100 * KIB, 99 * KIB),
}


# FP32 over FP64 arithmetic throughput by architecture (the CUDA programming guide's throughput table; AMD's
# ISA and product pages): data-centre parts run FP64 at half rate (CDNA2/3 vector FP64 at the full FP32 rate),
# Maxwell, consumer Pascal and Turing at 1/32, GeForce and workstation Ampere, Ada and Blackwell at 1/64, RDNA2 at
# 1/16. RDNA3 runs FP64 at the same 8 FLOPs a CU a clock as RDNA2, 1/16 of its single-issue FP32 rate, but its
# rows' FP32 counts dual issue (RX 7900 XTX: 61.4 TFLOPS FP32, 1.92 FP64), so the ratio to that figure is 32.
# Export parts with FP64 cut further than their chip's are not told apart.
_FP64_RATIO: dict[str, float] = {
    "sm_52": 32.0,
    "sm_60": 2.0,
    "sm_61": 32.0,
    "sm_70": 2.0,
    "sm_75": 32.0,
    "sm_80": 2.0,
    "sm_86": 64.0,
    "sm_89": 64.0,
    "sm_90": 2.0,
    "sm_100": 2.0,
    "sm_120": 64.0,
    "gfx906": 2.0,
    "gfx908": 2.0,
    "gfx90a": 1.0,
    "gfx942": 1.0,
    "gfx1030": 16.0,
    "gfx1032": 16.0,
    "gfx1100": 32.0,
}


def _nv(
    name: str,
    cc: str,
    *,
    sms: int,
    l2: int,
    bw: float,
    fp32: float,
    fp16: float,
    mem: float,
    aliases: tuple[str, ...] = (),
) -> GpuSpec:
    arch, threads, blocks, smem_sm, smem_block = _CC[cc]
    return GpuSpec(
        name=name,
        vendor="nvidia",
        arch=arch,
        compute_capability=cc,
        sms=sms,
        max_threads_per_sm=threads,
        max_blocks_per_sm=blocks,
        registers_per_sm=65536,
        max_registers_per_thread=255,
        shared_mem_per_sm_bytes=smem_sm,
        max_shared_mem_per_block_bytes=smem_block,
        l2_bytes=l2,
        mem_bandwidth_gbs=bw,
        fp32_tflops=fp32,
        fp16_tensor_tflops=fp16,
        mem_gib=mem,
        warp_size=32,
        aliases=aliases,
    )


# AMD per-CU limits by ISA: (wave size, max threads/CU, registers/CU, max VGPRs/thread).
# CDNA/GCN: 4 SIMDs per CU; gfx906 holds 10 waves per SIMD, gfx90a/gfx942 8, with 256 (gfx906) or 512
# (unified arch+acc) VGPRs per lane. RDNA in CU mode: 2 SIMD32 of 16 waves; 1024 VGPRs per lane (RDNA2)
# or 1536 (Navi 31). LLVM's AMDGPU backend caps workgroups of two or more waves at 16 per CU
# (max_blocks_per_sm; hardware/occupancy.py lets single-wave workgroups fill the CU's waves).
_AMD: dict[str, tuple[int, int, int, int]] = {
    "gfx906": (64, 2560, 65536, 256),
    # gfx908 (MI100): 10 waves per SIMD; its accumulation VGPRs serve matrix instructions only.
    "gfx908": (64, 2560, 65536, 256),
    "gfx90a": (64, 2048, 131072, 512),
    "gfx942": (64, 2048, 131072, 512),
    "gfx1030": (32, 1024, 65536, 256),
    "gfx1032": (32, 1024, 65536, 256),
    "gfx1100": (32, 1024, 98304, 256),
}


# AMD ISAs without matrix instructions (no MFMA or WMMA).
_AMD_WITHOUT_MATRIX = frozenset({"gfx906", "gfx1030", "gfx1032"})


def _amd(
    name: str,
    arch: str,
    *,
    cus: int,
    l2: int,
    bw: float,
    fp32: float,
    fp16: float,
    mem: float,
    aliases: tuple[str, ...] = (),
) -> GpuSpec:
    wave, threads, regs, max_regs = _AMD[arch]
    return GpuSpec(
        name=name,
        vendor="amd",
        arch=arch,
        compute_capability=None,
        sms=cus,
        max_threads_per_sm=threads,
        max_blocks_per_sm=16,
        registers_per_sm=regs,
        max_registers_per_thread=max_regs,
        shared_mem_per_sm_bytes=64 * KIB,  # LDS per CU (per WGP half on RDNA)
        max_shared_mem_per_block_bytes=64 * KIB,
        l2_bytes=l2,
        mem_bandwidth_gbs=bw,
        fp32_tflops=fp32,
        fp16_tensor_tflops=fp16,
        mem_gib=mem,
        warp_size=wave,
        aliases=aliases,
    )


# Within a family the first row is what a bare family name resolves to.
_SPECS: list[GpuSpec] = [
    # Volta, GV100: 80 SMs, 6 MB L2, 900 GB/s HBM2. SXM2 boost 1530 MHz, PCIe 1380 MHz.
    _nv(
        "V100-SXM2-32GB", "7.0", sms=80, l2=6 * MIB, bw=900, fp32=15.7, fp16=125.0, mem=32, aliases=("V100",)
    ),
    _nv(
        "V100-SXM2-16GB", "7.0", sms=80, l2=6 * MIB, bw=900, fp32=15.7, fp16=125.0, mem=16, aliases=("V100",)
    ),
    _nv(
        "V100-PCIE-32GB", "7.0", sms=80, l2=6 * MIB, bw=900, fp32=14.0, fp16=112.0, mem=32, aliases=("V100",)
    ),
    _nv(
        "V100-PCIE-16GB", "7.0", sms=80, l2=6 * MIB, bw=900, fp32=14.0, fp16=112.0, mem=16, aliases=("V100",)
    ),
    # V100S: the PCIe V100 at 1601 MHz with 1134 GB/s HBM2. TITAN V: 80 SMs, 3 HBM2 stacks (4.5 MB L2).
    _nv("V100S-PCIE-32GB", "7.0", sms=80, l2=6 * MIB, bw=1134, fp32=16.4, fp16=130.0, mem=32),
    _nv("TITAN V", "7.0", sms=80, l2=4608 * KIB, bw=652.8, fp32=14.9, fp16=110.0, mem=12),
    # Pascal GP100 (CC 6.0): no tensor cores; fp16 is the packed half2 rate (2x FP32).
    _nv("P100-SXM2-16GB", "6.0", sms=56, l2=4 * MIB, bw=732, fp32=10.6, fp16=21.2, mem=16, aliases=("P100",)),
    _nv("P100-PCIE-16GB", "6.0", sms=56, l2=4 * MIB, bw=732, fp32=9.3, fp16=18.7, mem=16, aliases=("P100",)),
    _nv("P100-PCIE-12GB", "6.0", sms=56, l2=3 * MIB, bw=549, fp32=9.3, fp16=18.7, mem=12, aliases=("P100",)),
    # Ampere, GA100: 108 SMs at 1410 MHz, 40 MB L2; bandwidth differs by memory (HBM2 vs HBM2e) and board.
    _nv(
        "A100-SXM4-80GB",
        "8.0",
        sms=108,
        l2=40 * MIB,
        bw=2039,
        fp32=19.5,
        fp16=312.0,
        mem=80,
        aliases=("A100",),
    ),
    _nv(
        "A100-SXM4-40GB",
        "8.0",
        sms=108,
        l2=40 * MIB,
        bw=1555,
        fp32=19.5,
        fp16=312.0,
        mem=40,
        aliases=("A100",),
    ),
    _nv(
        "A100-PCIE-40GB",
        "8.0",
        sms=108,
        l2=40 * MIB,
        bw=1555,
        fp32=19.5,
        fp16=312.0,
        mem=40,
        aliases=("A100",),
    ),
    _nv(
        "A100-PCIE-80GB",
        "8.0",
        sms=108,
        l2=40 * MIB,
        bw=1935,
        fp32=19.5,
        fp16=312.0,
        mem=80,
        aliases=("A100",),
    ),
    # A30: a GA100 with 56 SMs, 24 MB L2 and 24 GB HBM2 at 933 GB/s.
    _nv("A30", "8.0", sms=56, l2=24 * MIB, bw=933, fp32=10.3, fp16=165.0, mem=24),
    # Hopper, GH100: 50 MB L2. SXM5 132 SMs; PCIe 114 SMs (HBM2e); NVL 132 SMs at a lower clock.
    _nv(
        "H100-SXM5-80GB",
        "9.0",
        sms=132,
        l2=50 * MIB,
        bw=3350,
        fp32=66.9,
        fp16=989.4,
        mem=80,
        aliases=("H100",),
    ),
    _nv(
        "H100-PCIE-80GB",
        "9.0",
        sms=114,
        l2=50 * MIB,
        bw=2000,
        fp32=51.2,
        fp16=756.5,
        mem=80,
        aliases=("H100",),
    ),
    _nv(
        "H100-NVL-94GB",
        "9.0",
        sms=132,
        l2=50 * MIB,
        bw=3900,
        fp32=60.0,
        fp16=835.5,
        mem=94,
        aliases=("H100",),
    ),
    # H200: the GH100 of the H100 SXM with 141 GB HBM3e.
    _nv(
        "H200-SXM-141GB",
        "9.0",
        sms=132,
        l2=50 * MIB,
        bw=4800,
        fp32=66.9,
        fp16=989.4,
        mem=141,
        aliases=("H200",),
    ),
    _nv(
        "H200-NVL-141GB",
        "9.0",
        sms=132,
        l2=50 * MIB,
        bw=4800,
        fp32=60.0,
        fp16=835.5,
        mem=141,
        aliases=("H200",),
    ),
    # GH200 Grace Hopper: the H100 SXM's GH100 with 96 GB HBM3 at 4 TB/s. nvidia-smi names the superchip by
    # its 480 GB of Grace LPDDR5X ("NVIDIA GH200 480GB"), so that is the size the name carries.
    _nv(
        "GH200-480GB",
        "9.0",
        sms=132,
        l2=50 * MIB,
        bw=4000,
        fp32=66.9,
        fp16=989.4,
        mem=96,
        aliases=("GH200",),
    ),
    # The HBM3e GH200: 144 GB at 4.9 TB/s; nvidia-smi names it "NVIDIA GH200 144G HBM3e" (G, not GB).
    _nv("GH200-144GB", "9.0", sms=132, l2=50 * MIB, bw=4900, fp32=66.9, fp16=989.4, mem=144),
    # Blackwell B200 as the HGX B200 board's GPU (1000 W; NVIDIA's HGX/GB200 NVL72 sheet, per GPU): 148 SMs,
    # 180 GB HBM3e at 7.7 TB/s (the driver's 7680-bit bus at 3996 MHz is 7.67), FP32 75 TFLOPS, FP16 tensor
    # 2.25 PFLOPS dense (4.5 sparse). The 80 TFLOPS and 8 TB/s often quoted are the GB200 NVL72's 1200 W GPU.
    # NVIDIA publishes no L2 figure; 126 MB is what the CUDA runtime reports for the two dies together.
    _nv("B200", "10.0", sms=148, l2=126 * MIB, bw=7700, fp32=75.0, fp16=2250.0, mem=180),
    # Ada, AD102/AD104.
    _nv("L40S", "8.9", sms=142, l2=96 * MIB, bw=864, fp32=91.6, fp16=362.05, mem=48),
    # L40: the L40S's AD102 without its doubled FP16/FP8 tensor rate.
    _nv("L40", "8.9", sms=142, l2=96 * MIB, bw=864, fp32=90.5, fp16=181.05, mem=48),
    _nv("L4", "8.9", sms=58, l2=48 * MIB, bw=300, fp32=30.3, fp16=121.0, mem=24),
    _nv(
        "RTX 6000 Ada",
        "8.9",
        sms=142,
        l2=96 * MIB,
        bw=960,
        fp32=91.1,
        fp16=364.2,
        mem=48,
        aliases=("RTX 6000 Ada Generation",),
    ),
    _nv("RTX 4090", "8.9", sms=128, l2=72 * MIB, bw=1008, fp32=82.6, fp16=165.2, mem=24),
    _nv("RTX 4080 SUPER", "8.9", sms=80, l2=64 * MIB, bw=736, fp32=52.2, fp16=104.4, mem=16),
    _nv("RTX 4080", "8.9", sms=76, l2=64 * MIB, bw=716.8, fp32=48.7, fp16=97.5, mem=16),
    _nv("RTX 4070 Ti", "8.9", sms=60, l2=48 * MIB, bw=504, fp32=40.1, fp16=80.2, mem=12),
    _nv("RTX 4070", "8.9", sms=46, l2=36 * MIB, bw=504, fp32=29.1, fp16=58.3, mem=12),
    # GeForce Ada at reference boost (4070 Ti SUPER 2610, 4070 SUPER 2475, 4060 Ti 2535, 4060 2460 MHz);
    # FP16 tensor with FP32 accumulation at the GeForce half rate (2x FP32), as for the cards above.
    _nv("RTX 4070 Ti SUPER", "8.9", sms=66, l2=48 * MIB, bw=672, fp32=44.1, fp16=88.2, mem=16),
    _nv("RTX 4070 SUPER", "8.9", sms=56, l2=48 * MIB, bw=504, fp32=35.5, fp16=71.0, mem=12),
    _nv("RTX 4060 Ti", "8.9", sms=34, l2=32 * MIB, bw=288, fp32=22.1, fp16=44.2, mem=8),
    _nv("RTX 4060 Ti 16GB", "8.9", sms=34, l2=32 * MIB, bw=288, fp32=22.1, fp16=44.2, mem=16),
    _nv("RTX 4060", "8.9", sms=24, l2=24 * MIB, bw=272, fp32=15.1, fp16=30.2, mem=8),
    # Blackwell GB202 (CC 12.0). RTX PRO 6000 Workstation: 188 SMs at 2617 MHz (fp16 = 188 x 1024 x 2.617).
    _nv("RTX 5090", "12.0", sms=170, l2=96 * MIB, bw=1792, fp32=104.8, fp16=209.5, mem=32),
    # RTX 5080 / 5070 Ti: GB203 at 2617 / 2452 MHz boost; FP16 scaled from the 5090 by SMs x clock.
    _nv("RTX 5080", "12.0", sms=84, l2=64 * MIB, bw=960, fp32=56.3, fp16=112.5, mem=16),
    _nv("RTX 5070 Ti", "12.0", sms=70, l2=48 * MIB, bw=896, fp32=43.9, fp16=87.7, mem=16),
    # RTX 5070 (GB205, 2512 MHz) and 5060 Ti (GB206, 2572 MHz; 8 and 16 GB cards), FP16 as 2x FP32.
    _nv("RTX 5070", "12.0", sms=48, l2=48 * MIB, bw=672, fp32=30.9, fp16=61.7, mem=12),
    _nv("RTX 5060 Ti", "12.0", sms=36, l2=32 * MIB, bw=448, fp32=23.7, fp16=47.4, mem=16),
    _nv("RTX 5060 Ti 8GB", "12.0", sms=36, l2=32 * MIB, bw=448, fp32=23.7, fp16=47.4, mem=8),
    _nv(
        "RTX PRO 6000 Blackwell",
        "12.0",
        sms=188,
        l2=128 * MIB,
        bw=1792,
        fp32=125.0,
        fp16=503.8,
        mem=96,
        aliases=("RTX PRO 6000", "RTX PRO 6000 Blackwell Workstation Edition"),
    ),
    # The passively cooled Server Edition (GDDR7 at 1597 GB/s) and the 300 W Max-Q: the same 188 SMs.
    _nv(
        "RTX PRO 6000 Blackwell Server Edition",
        "12.0",
        sms=188,
        l2=128 * MIB,
        bw=1597,
        fp32=120.0,
        fp16=483.6,
        mem=96,
    ),
    _nv(
        "RTX PRO 6000 Blackwell Max-Q",
        "12.0",
        sms=188,
        l2=128 * MIB,
        bw=1792,
        fp32=110.0,
        fp16=443.3,
        mem=96,
        aliases=("RTX PRO 6000 Blackwell Max-Q Workstation Edition",),
    ),
    # Ampere GA10x (CC 8.6).
    _nv("A10", "8.6", sms=72, l2=6 * MIB, bw=600, fp32=31.2, fp16=125.0, mem=24),
    # A10G (AWS G5 instances): GA102 with 80 SMs (deviceQuery: 10,240 cores) at 1710 MHz, 600 GB/s. NVIDIA
    # publishes no sheet for it; FP16 tensor is taken at the GeForce half rate (2x FP32), a lower bound.
    _nv("A10G", "8.6", sms=80, l2=6 * MIB, bw=600, fp32=35.0, fp16=70.0, mem=24),
    _nv("RTX A6000", "8.6", sms=84, l2=6 * MIB, bw=768, fp32=38.7, fp16=154.8, mem=48),
    _nv("A40", "8.6", sms=84, l2=6 * MIB, bw=696, fp32=37.4, fp16=149.7, mem=48),
    _nv("RTX A4000", "8.6", sms=48, l2=4 * MIB, bw=448, fp32=19.2, fp16=76.7, mem=16),
    _nv("RTX A5000", "8.6", sms=64, l2=6 * MIB, bw=768, fp32=27.8, fp16=111.1, mem=24),
    _nv("RTX 3090", "8.6", sms=82, l2=6 * MIB, bw=936, fp32=35.6, fp16=71.2, mem=24),
    _nv("RTX 3080 Ti", "8.6", sms=80, l2=6 * MIB, bw=912, fp32=34.1, fp16=68.2, mem=12),
    # The 10 GB RTX 3080 is the card a bare "RTX 3080" means; the 12 GB one has 70 SMs and a 384-bit bus.
    _nv("RTX 3080", "8.6", sms=68, l2=5 * MIB, bw=760, fp32=29.8, fp16=59.5, mem=10),
    _nv("RTX 3080 12GB", "8.6", sms=70, l2=6 * MIB, bw=912, fp32=30.6, fp16=61.3, mem=12),
    _nv("RTX 3070 Ti", "8.6", sms=48, l2=4 * MIB, bw=608, fp32=21.7, fp16=43.5, mem=8),
    _nv("RTX 3070", "8.6", sms=46, l2=4 * MIB, bw=448, fp32=20.3, fp16=40.6, mem=8),
    _nv("RTX 3060 Ti", "8.6", sms=38, l2=4 * MIB, bw=448, fp32=16.2, fp16=32.4, mem=8),
    _nv("RTX 3060", "8.6", sms=28, l2=3 * MIB, bw=360, fp32=12.7, fp16=25.5, mem=12),
    # Max-TGP laptop part (1703 MHz boost); lower-power laptops run slower.
    _nv(
        "RTX 3060 Laptop",
        "8.6",
        sms=30,
        l2=3 * MIB,
        bw=336,
        fp32=13.1,
        fp16=26.2,
        mem=6,
        aliases=("RTX 3060 Mobile",),
    ),
    # Turing (CC 7.5). 2080 Ti at the reference 1545 MHz boost.
    _nv("T4", "7.5", sms=40, l2=4 * MIB, bw=320, fp32=8.1, fp16=65.0, mem=16),
    _nv("RTX 2080 Ti", "7.5", sms=68, l2=5632 * KIB, bw=616, fp32=13.4, fp16=53.8, mem=11),
    _nv(
        "TITAN RTX", "7.5", sms=72, l2=6 * MIB, bw=672, fp32=16.3, fp16=130.5, mem=24, aliases=("RTX Titan",)
    ),
    # GeForce Turing at reference boost clocks (2080 Super 1815, 2080 1710, 2070 Super 1770, 2070 1620,
    # 2060 1680 MHz); FP16 tensor with FP32 accumulation at the GeForce half rate.
    _nv("RTX 2080 SUPER", "7.5", sms=48, l2=4 * MIB, bw=496, fp32=11.2, fp16=44.6, mem=8),
    _nv("RTX 2080", "7.5", sms=46, l2=4 * MIB, bw=448, fp32=10.1, fp16=40.3, mem=8),
    _nv("RTX 2070 SUPER", "7.5", sms=40, l2=4 * MIB, bw=448, fp32=9.1, fp16=36.2, mem=8),
    _nv("RTX 2070", "7.5", sms=36, l2=4 * MIB, bw=448, fp32=7.5, fp16=29.9, mem=8),
    _nv("RTX 2060", "7.5", sms=30, l2=3 * MIB, bw=336, fp32=6.5, fp16=25.8, mem=6),
    # Pascal GP102/GP104 (CC 6.1) and Maxwell GM200 (CC 5.2), the GPUs of many older autotuning recordings, at
    # reference boost clocks (1080 Ti 1582, Xp 1582, X Pascal 1531, 1080 1733, 1070 1683, P40 1531, P4 1063,
    # GTX TITAN X 1075, 980 Ti 1075 MHz). No tensor cores. The fp16 column is vector FP16 arithmetic, as for the
    # MI50: GP10x (CC 6.1) runs it at 1/64 of FP32 (the programming guide's throughput table: 2 results a clock
    # an SM against 128; cuda_fp16's half and half2 arithmetic is native f16 from CC 5.3), GM200 has none
    # (cuda_fp16 computes in FP32 below CC 5.3), so its rows hold the FP32 rate. "TITAN X" alone names two cards (Maxwell 2015, Pascal 2016) and matches neither.
    _nv("GTX 1080 Ti", "6.1", sms=28, l2=2816 * KIB, bw=484, fp32=11.3, fp16=0.177, mem=11),
    _nv("TITAN Xp", "6.1", sms=30, l2=3 * MIB, bw=547.7, fp32=12.1, fp16=0.190, mem=12),
    _nv(
        "TITAN X Pascal",
        "6.1",
        sms=28,
        l2=3 * MIB,
        bw=480,
        fp32=11.0,
        fp16=0.171,
        mem=12,
        aliases=("TITAN X (Pascal)",),
    ),
    _nv("GTX 1080", "6.1", sms=20, l2=2 * MIB, bw=320, fp32=8.9, fp16=0.139, mem=8),
    _nv("GTX 1070", "6.1", sms=15, l2=2 * MIB, bw=256, fp32=6.5, fp16=0.101, mem=8),
    _nv("P40", "6.1", sms=30, l2=3 * MIB, bw=346, fp32=11.8, fp16=0.184, mem=24),
    _nv("P4", "6.1", sms=20, l2=2 * MIB, bw=192, fp32=5.4, fp16=0.085, mem=8),
    _nv("GTX TITAN X", "5.2", sms=24, l2=3 * MIB, bw=336.5, fp32=6.6, fp16=6.6, mem=12),
    _nv("GTX 980 Ti", "5.2", sms=22, l2=3 * MIB, bw=336.5, fp32=6.1, fp16=6.1, mem=6),
    # AMD CDNA. MI250X: one of its two GCDs (HIP sees each as a device); the package is 220 CUs, 128 GB,
    # 3.2 TB/s, 47.9 TFLOPS FP32, 383 TFLOPS FP16 matrix.
    _amd("MI250X", "gfx90a", cus=110, l2=8 * MIB, bw=1638.4, fp32=23.95, fp16=191.5, mem=64),
    # MI300X: 304 CUs, 4 MB L2 per XCD (8 XCDs) in front of 256 MB Infinity Cache.
    _amd("MI300X", "gfx942", cus=304, l2=32 * MIB, bw=5300, fp32=81.7, fp16=1307.4, mem=192),
    # MI210: a single CDNA2 GCD with 104 CUs; MI300A: the APU, 228 CUs (6 XCDs) sharing 128 GB HBM3 with
    # the CPU; MI325X: the MI300X with 256 GB HBM3e at 6 TB/s; MI100: CDNA1, 120 CUs.
    _amd("MI210", "gfx90a", cus=104, l2=8 * MIB, bw=1638.4, fp32=22.6, fp16=181.0, mem=64),
    _amd("MI300A", "gfx942", cus=228, l2=24 * MIB, bw=5300, fp32=61.3, fp16=980.6, mem=128),
    _amd("MI325X", "gfx942", cus=304, l2=32 * MIB, bw=6000, fp32=81.7, fp16=1307.4, mem=256),
    _amd("MI100", "gfx908", cus=120, l2=8 * MIB, bw=1228.8, fp32=23.1, fp16=184.6, mem=32),
    # MI50 (Vega 20, 16 GB): no matrix units; fp16 is packed vector FP16.
    _amd("MI50", "gfx906", cus=60, l2=4 * MIB, bw=1024, fp32=13.3, fp16=26.5, mem=16),
    # RDNA workstation cards (Infinity Cache 32 MB / 64 MB behind the L2).
    _amd(
        "Radeon PRO W6600",
        "gfx1032",
        cus=28,
        l2=2 * MIB,
        bw=224,
        fp32=10.4,
        fp16=20.8,
        mem=8,
        aliases=("W6600",),
    ),
    _amd(
        "Radeon PRO W7800",
        "gfx1100",
        cus=70,
        l2=6 * MIB,
        bw=576,
        fp32=45.2,
        fp16=90.5,
        mem=32,
        aliases=("W7800",),
    ),
    _amd(
        "Radeon PRO W7900",
        "gfx1100",
        cus=96,
        l2=6 * MIB,
        bw=864,
        fp32=61.3,
        fp16=122.6,
        mem=48,
        aliases=("W7900",),
    ),
    # Consumer RDNA: FP32 counts RDNA3 dual issue, as the W7800 row does.
    _amd("RX 7900 XTX", "gfx1100", cus=96, l2=6 * MIB, bw=960, fp32=61.4, fp16=122.8, mem=24),
    _amd("RX 6900 XT", "gfx1030", cus=80, l2=4 * MIB, bw=512, fp32=23.0, fp16=46.1, mem=16),
]

# A800 / H800: the A100 / H100 sold where export rules cap NVLink; the same chips, clocks and memory. A bare
# "A800" / "H800" picks the first of its rows, as a bare family name does.
_EXPORT_VARIANTS = (
    ("A100-SXM4-80GB", "A800-SXM4-80GB"),
    ("A100-PCIE-80GB", "A800-PCIE-80GB"),
    ("A100-PCIE-40GB", "A800-PCIE-40GB"),
    ("H100-SXM5-80GB", "H800-SXM5-80GB"),
    ("H100-PCIE-80GB", "H800-PCIE-80GB"),
)
_BY_NAME = {s.name: s for s in _SPECS}
_SPECS += [
    replace(_BY_NAME[original], name=name, aliases=(name.split("-")[0],))
    for original, name in _EXPORT_VARIANTS
]


def all_specs() -> list[GpuSpec]:
    return list(_SPECS)


# ---------------------------------------------------------------- matching

# Vendor and brand words that never distinguish one GPU from another.
_NOISE = frozenset(
    {
        "nvidia",
        "amd",
        "geforce",
        "radeon",
        "instinct",
        "tesla",
        "quadro",
        "gpu",
        "graphics",
        "accelerator",
        "workstation",
        "edition",
        "collectors",  # "NVIDIA TITAN Xp COLLECTORS EDITION", as nvidia-smi names the card
        "card",
        "vf",  # an SR-IOV virtual function of the card ("AMD Instinct MI300X VF" in a cloud VM)
        "hbm",
        "hbm2",
        "hbm2e",
        "hbm3",
        "hbm3e",
        "gddr6",
        "gddr6x",
        "gddr7",
    }
)
# 80GB, 80 GiB and nvidia-smi's "144G"; not the "10g" inside a model name such as A10G.
_MEM = re.compile(r"(?<![a-z0-9])(\d+)\s*g(?:i?b)?\b")
_FORM = re.compile(r"^(.*?)(sxm\d?|pcie|nvl|hgx|dgx)$")
_SEP = re.compile(r"[\s\-_/,.()\[\]:+]+")


_WORD = re.compile(r"[a-z0-9]+")


def name_words(name: str) -> list[str]:
    """The words of a GPU name that can tell GPUs apart (lower case; vendor, brand and memory-type words out)."""
    return [w for w in _WORD.findall(name.lower()) if w not in _NOISE]


@dataclass(frozen=True)
class _Query:
    model: str  # tokens joined without separators: "rtx4090", "a100", "rtx3060laptop"
    form: str | None  # "sxm", "pcie", "nvl"
    mem_gb: int | None


def _parse(name: str) -> _Query:
    text = name.lower().replace("laptop gpu", "laptop")
    mem: int | None = None
    found = _MEM.search(text)
    if found:
        mem = int(found.group(1))
        text = text[: found.start()] + " " + text[found.end() :]
    form: str | None = None
    words: list[str] = []
    for token in _SEP.split(text):
        if not token or token in _NOISE:
            continue
        split = _FORM.match(token)
        if split:
            kind = split.group(2)
            form = "sxm" if kind.startswith(("sxm", "hgx", "dgx")) else kind
            if split.group(1):
                words.append(split.group(1))
            continue
        words.append("laptop" if token == "mobile" else token)
    return _Query("".join(words), form, mem)


@dataclass(frozen=True)
class _Row:
    spec: GpuSpec
    models: frozenset[str]
    form: str | None
    mem_gb: int


def _model_keys(name: str) -> set[str]:
    model = _parse(name).model
    keys = {model}
    # "4090" and "a6000" name their cards unambiguously; "titan" alone does not.
    if model.startswith(("rtx", "gtx")) and any(c.isdigit() for c in model[3:]):
        keys.add(model[3:])
    if model.startswith("pro") and any(c.isdigit() for c in model[3:]):
        keys.add(model[3:])
    return keys


@lru_cache(maxsize=1)
def _rows() -> tuple[_Row, ...]:
    rows = []
    for spec in _SPECS:
        parsed = _parse(spec.name)
        models = _model_keys(spec.name)
        for alias in spec.aliases:
            models |= _model_keys(alias)
        mem = parsed.mem_gb if parsed.mem_gb is not None else round(spec.mem_gib)
        rows.append(_Row(spec, frozenset(models), parsed.form, mem))
    return tuple(rows)


def _match(query: _Query) -> GpuSpec | None:
    if not query.model:
        return None
    for row in _rows():
        if query.model not in row.models:
            continue
        # A stated form factor or memory size must agree; an unstated one takes the family default.
        # Rows without a form factor come in one form only, so any stated form is accepted.
        if query.form is not None and row.form is not None and query.form != row.form:
            continue
        if query.mem_gb is not None and query.mem_gb != row.mem_gb:
            continue
        return row.spec
    return None


def could_be(name: str, spec: GpuSpec) -> bool:
    """Whether `name` may mean the GPU of `spec` although `lookup(name)` picks another row of its family: the
    same model, and no form factor or memory size stated that `spec` contradicts ("A100 40GB" may be an
    A100-PCIE-40GB; "A100 SXM4" or "A100 80GB" is not)."""
    if not name or len(name) > 200:
        return False
    query = _parse(name)
    row = next((r for r in _rows() if r.spec == spec), None)
    if row is None or not query.model or query.model not in row.models:
        return False
    if query.form is not None and row.form is not None and query.form != row.form:
        return False
    return query.mem_gb is None or query.mem_gb == row.mem_gb


@lru_cache(maxsize=512)
def lookup(name: str) -> GpuSpec | None:
    """The spec for a GPU name as a person, nvidia-smi or rocm-smi would write it; None when unknown."""
    if not name or len(name) > 200:
        return None
    spec = _match(_parse(name))
    if spec is None and "/" in name:
        # Driver names such as "AMD Instinct MI50/MI60" list siblings: the first one that matches wins.
        for part in name.split("/"):
            spec = _match(_parse(part))
            if spec is not None:
                break
    return spec


# An ISA or compute target as compilers, rocminfo and HIP print them: "gfx942", "gfx90a:sramecc+:xnack-", "sm_90",
# "sm_90a", "compute_80".
_ARCH_NAME = re.compile(r"(gfx[0-9a-f]{3,4})(?::[a-z0-9+\-:]*)?|(?:sm|compute)_?(\d{2,3})[af]?")


def same_architecture(name: str) -> list[GpuSpec]:
    """The table's GPUs of the architecture `name` spells ("gfx942", "sm_90"), in table order: an architecture
    is no one GPU (gfx942 is the MI300X, MI300A and MI325X), so `lookup` refuses it. Empty for any other name."""
    found = _ARCH_NAME.fullmatch(name.strip().lower()) if len(name) <= 200 else None
    if found is None:
        return []
    arch = found.group(1) or f"sm_{found.group(2)}"
    return [s for s in _SPECS if s.arch == arch]


def canonical_name(name: str) -> str:
    """The table's name for a known GPU, else the input stripped."""
    spec = lookup(name)
    return spec.name if spec is not None else name.strip()


def suggest(name: str, limit: int = 5) -> list[str]:
    """Known GPU names close to `name`, for "did you mean" messages (same family first)."""
    import difflib  # only error paths need it; keep it off the start-up path

    query = _parse(name)
    out: list[str] = [s.name for s in same_architecture(name)]
    if query.model and not out:
        out += [row.spec.name for row in _rows() if query.model in row.models]
    by_key: dict[str, str] = {}
    for row in _rows():
        for key in row.models:
            by_key.setdefault(key, row.spec.name)
        by_key.setdefault(row.spec.name.lower(), row.spec.name)
    probe = query.model or name.lower().strip()
    if not out and any(c.isdigit() for c in probe) and "o" in probe:
        # A letter O typed for a zero ("H1OO", "B2OO"): difflib finds half the characters wrong and no match.
        zeros = _parse(name.replace("o", "0").replace("O", "0"))
        if zeros.model:
            out += [row.spec.name for row in _rows() if zeros.model in row.models]
    for key in difflib.get_close_matches(probe, list(by_key), n=limit * 2, cutoff=0.6):
        out.append(by_key[key])
    unique = list(dict.fromkeys(out))
    return unique[:limit]
