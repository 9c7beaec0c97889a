"""GPU spec table, forgiving name matching, occupancy and waves."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forecaster_mcp.hardware.occupancy import (
    active_blocks_per_sm,
    occupancy_limits,
    theoretical_occupancy,
    waves,
)
from forecaster_mcp.hardware.specs import (
    GpuSpec,
    all_specs,
    canonical_name,
    lookup,
    same_architecture,
    suggest,
)


def spec(name: str) -> GpuSpec:
    found = lookup(name)
    assert found is not None, name
    return found


# ---------------------------------------------------------------- name matching


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("A100", "A100-SXM4-80GB"),
        ("a100 80gb", "A100-SXM4-80GB"),
        ("A100-80GB", "A100-SXM4-80GB"),
        ("a100 40gb", "A100-SXM4-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ("nvidia a100 pcie 40 GB", "A100-PCIE-40GB"),
        ("a100 pcie", "A100-PCIE-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("a100_sxm4_40gb", "A100-SXM4-40GB"),
        ("H100", "H100-SXM5-80GB"),
        ("h100 pcie", "H100-PCIE-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIE-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
        ("H100SXM", "H100-SXM5-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL-94GB"),
        ("h200", "H200-SXM-141GB"),
        ("H200 NVL", "H200-NVL-141GB"),
        ("B200", "B200"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("v100 pcie 32gb", "V100-PCIE-32GB"),
        ("A10", "A10"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("l40s", "L40S"),
        ("4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("geforce rtx 5090", "RTX 5090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("rtx a6000", "RTX A6000"),
        ("A6000", "RTX A6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell"),
        ("RTX PRO 6000", "RTX PRO 6000 Blackwell"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA GH200 480GB", "GH200-480GB"),
        ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),  # nvidia-smi writes G, not GB
        ("NVIDIA A10G 24GB", "A10G"),  # ... but the G of A10G is part of its name
        ("AMD Instinct MI300X VF", "MI300X"),  # an SR-IOV virtual function in a cloud VM
        ("GH200", "GH200-480GB"),
        # Names as the shared recordings write them (device_name, or the file stem).
        ("NVIDIA RTX A4000", "RTX A4000"),
        ("a4000", "RTX A4000"),
        ("AMD Radeon PRO W6600", "Radeon PRO W6600"),
        ("W7800", "Radeon PRO W7800"),
        ("AMD Instinct MI50/MI60", "MI50"),
        ("mi50", "MI50"),
        ("MI250X", "MI250X"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA GeForce RTX 2080 Ti", "RTX 2080 Ti"),
        ("RTX_2080_Ti", "RTX 2080 Ti"),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", "RTX 3060 Laptop"),
        ("RTX_3060_laptop", "RTX 3060 Laptop"),
        ("NVIDIA TITAN RTX", "TITAN RTX"),
        ("RTX_Titan", "TITAN RTX"),
        # nvidia-smi / rocm-smi names of GPUs outside the issue's list that users run.
        ("NVIDIA A800-SXM4-80GB", "A800-SXM4-80GB"),
        ("NVIDIA H800", "H800-SXM5-80GB"),
        ("NVIDIA H800 PCIe", "H800-PCIE-80GB"),
        ("NVIDIA A30", "A30"),
        ("NVIDIA L40", "L40"),
        ("Tesla P100-PCIE-16GB", "P100-PCIE-16GB"),
        ("Tesla V100S-PCIE-32GB", "V100S-PCIE-32GB"),
        ("NVIDIA TITAN V", "TITAN V"),
        ("NVIDIA GeForce RTX 3060", "RTX 3060"),
        ("NVIDIA GeForce RTX 3080", "RTX 3080"),
        ("NVIDIA GeForce RTX 3080 12GB", "RTX 3080 12GB"),
        ("NVIDIA GeForce RTX 3080 Ti", "RTX 3080 Ti"),
        ("NVIDIA GeForce RTX 4080 SUPER", "RTX 4080 SUPER"),
        ("NVIDIA GeForce RTX 4080", "RTX 4080"),
        ("NVIDIA GeForce RTX 2070 SUPER", "RTX 2070 SUPER"),
        ("NVIDIA GeForce RTX 5080", "RTX 5080"),
        ("NVIDIA RTX A5000", "RTX A5000"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell Server Edition"),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 Blackwell Max-Q"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4060 Ti", "RTX 4060 Ti"),
        ("NVIDIA GeForce RTX 4060 Ti 16GB", "RTX 4060 Ti 16GB"),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", "RTX 4070 Ti SUPER"),
        ("NVIDIA GeForce RTX 5060 Ti", "RTX 5060 Ti"),
        ("AMD Instinct MI210", "MI210"),
        ("AMD Instinct MI300A", "MI300A"),
        ("AMD Instinct MI100", "MI100"),
        ("AMD Radeon PRO W7900", "Radeon PRO W7900"),
        ("AMD Radeon RX 7900 XTX", "RX 7900 XTX"),
        # Pascal and Maxwell, as nvidia-smi and Kernel Tuner recordings name them.
        ("NVIDIA GeForce GTX 1080 Ti", "GTX 1080 Ti"),
        ("1080 Ti", "GTX 1080 Ti"),
        ("GTX_1080", "GTX 1080"),
        ("NVIDIA TITAN Xp", "TITAN Xp"),
        ("NVIDIA TITAN Xp COLLECTORS EDITION", "TITAN Xp"),
        ("NVIDIA TITAN X (Pascal)", "TITAN X Pascal"),
        ("GeForce GTX TITAN X", "GTX TITAN X"),
        ("GTX_Titan_X", "GTX TITAN X"),
        ("Tesla P40", "P40"),
        ("Tesla P4", "P4"),
    ],
)
def test_lookup_is_forgiving(query: str, expected: str) -> None:
    assert spec(query).name == expected


@pytest.mark.parametrize(
    "query",
    [
        "",
        "   ",
        "foo",
        "A100 16GB",  # no such memory size: never guess another row
        "RTX 3060 8GB",  # the desktop card has 12 GB; the 8 GB one is a different board
        "RTX 3090 Ti",  # a sibling is not the card
        "L20",
        "Quadro RTX 6000",  # not the RTX PRO 6000 Blackwell, nor the RTX 6000 Ada
        "RTX 6000",
        "RTX 4060 Ti 12GB",  # no such card
        "MI250",
        "RTX 4090 D",
        "A100X",
        "H100 NVL 80GB",
        "TITAN X",  # the Maxwell (2015) or the Pascal (2016) card
    ],
)
def test_lookup_refuses_unknown_names(query: str) -> None:
    assert lookup(query) is None


def test_a10_never_becomes_a100() -> None:
    assert spec("A10").sms == 72
    assert spec("A10G").sms == 80  # AWS's GA102 part is its own row, never the A10
    assert spec("A100").sms == 108


def test_siblings_stay_apart() -> None:
    # Desktop and laptop, L40 and L40S, a card and its SUPER / Ti / 12 GB versions are different rows.
    assert spec("RTX 3060").sms == 28 and spec("RTX 3060 Laptop").sms == 30
    assert spec("L40").fp16_tensor_tflops * 2 == pytest.approx(spec("L40S").fp16_tensor_tflops, abs=0.1)
    assert [spec(n).sms for n in ("RTX 3080", "RTX 3080 12GB", "RTX 3080 Ti")] == [68, 70, 80]
    assert [spec(n).sms for n in ("RTX 4080", "RTX 4080 Super")] == [76, 80]
    assert [spec(n).sms for n in ("RTX 4070", "RTX 4070 SUPER", "RTX 4070 Ti", "RTX 4070 Ti SUPER")] == [
        46,
        56,
        60,
        66,
    ]
    assert [
        spec(n).mem_gib for n in ("RTX 4060 Ti", "RTX 4060 Ti 16GB", "RTX 5060 Ti", "RTX 5060 Ti 8GB")
    ] == [8, 16, 16, 8]
    assert spec("A800").sms == spec("A100").sms and spec("H800 PCIe").sms == spec("H100 PCIe").sms


def test_every_name_and_alias_round_trips_and_names_are_unique() -> None:
    names = [s.name for s in all_specs()]
    assert len(names) == len(set(names))
    for s in all_specs():
        assert lookup(s.name) is s
        assert lookup(s.name.lower().replace("-", " ")) is s
        for alias in s.aliases:
            found = lookup(alias)
            assert found is not None and found.arch == s.arch, alias


def test_canonical_name_and_suggest() -> None:
    assert canonical_name("nvidia a100-pcie-40gb") == "A100-PCIE-40GB"
    assert canonical_name("  My Custom GPU  ") == "My Custom GPU"
    close = suggest("A100 16GB")
    assert close[:4] == ["A100-SXM4-80GB", "A100-SXM4-40GB", "A100-PCIE-40GB", "A100-PCIE-80GB"]
    assert "H100-SXM5-80GB" in suggest("H10")
    assert "RTX 4090" in suggest("rtx 4080")
    assert suggest("zzzzzzzz") == []
    # a letter O for a zero, an easy slip in a GPU name, found nothing to suggest
    assert suggest("H1OO")[0] == "H100-SXM5-80GB"
    assert suggest("b2oo")[0].startswith("B200")
    assert suggest("RTX 4O90")[0] == "RTX 4090"


def test_table_covers_the_required_gpus() -> None:
    for name in [
        "V100 16GB", "V100 32GB", "A100-PCIE-40GB", "A100-SXM4-40GB", "A100 80GB", "H100 SXM", "H100 PCIe",
        "H200", "B200", "L40S", "RTX 3090", "RTX 4090", "RTX 5090", "RTX A6000", "RTX PRO 6000 Blackwell",
        "MI250X", "MI300X", "RTX A4000", "Radeon PRO W6600", "W7800", "MI50", "RTX 2080 Ti",
        "RTX 3060 Laptop", "TITAN RTX", "T4", "L4", "A10",
    ]:  # fmt: skip
        assert lookup(name) is not None, name


def test_table_is_internally_consistent() -> None:
    for s in all_specs():
        assert s.max_shared_mem_per_block_bytes <= s.shared_mem_per_sm_bytes
        assert s.max_threads_per_sm % s.warp_size == 0
        assert s.fp32_tflops > 0
        if s.tensor_cores:
            assert s.fp16_tensor_tflops >= s.fp32_tflops
        else:
            # Vector FP16: twice FP32 where packed half2 runs at full rate, 1/64 of it on consumer Pascal (GP10x);
            # the slack is the datasheets' rounding.
            assert s.fp32_tflops / 64 * 0.98 <= s.fp16_tensor_tflops <= 2 * s.fp32_tflops * 1.02
        assert s.mem_bandwidth_gbs > 0 and s.l2_bytes > 0 and s.mem_gib > 0
        if s.vendor == "nvidia":
            assert s.compute_capability is not None
            assert s.arch == "sm_" + s.compute_capability.replace(".", "")
            assert s.warp_size == 32
        else:
            assert s.compute_capability is None and s.arch.startswith("gfx")


def test_datasheet_spot_values() -> None:
    a100 = spec("A100-PCIE-40GB")
    assert (a100.sms, a100.mem_bandwidth_gbs, a100.l2_bytes, a100.fp16_tensor_tflops) == (
        108,
        1555,
        40 * 2**20,
        312,
    )
    assert spec("A100 80GB").mem_bandwidth_gbs == 2039
    h100 = spec("H100")
    assert (h100.sms, h100.shared_mem_per_sm_bytes, h100.max_shared_mem_per_block_bytes) == (
        132,
        233472,
        232448,
    )
    assert spec("H100 PCIe").sms == 114
    assert spec("H200").mem_gib == 141 and spec("H200").mem_bandwidth_gbs == 4800
    assert (
        spec("RTX 4090").sms,
        spec("RTX 4090").max_threads_per_sm,
        spec("RTX 4090").max_blocks_per_sm,
    ) == (
        128,
        1536,
        24,
    )
    assert spec("T4").max_threads_per_sm == 1024 and spec("T4").max_blocks_per_sm == 16
    assert spec("MI250X").warp_size == 64 and spec("W6600").warp_size == 32
    gtx = spec("GTX 1080 Ti")
    assert (gtx.arch, gtx.sms, gtx.max_shared_mem_per_block_bytes, gtx.fp64_ratio) == (
        "sm_61",
        28,
        48 * 1024,
        32,
    )
    assert spec("GTX TITAN X").arch == "sm_52" and spec("GTX TITAN X").fp64_ratio == 32


def test_specs_import_stays_light() -> None:
    code = (
        "import sys, forecaster_mcp.hardware.specs, forecaster_mcp.hardware.occupancy;"
        "print(sorted(m for m in ('numpy', 'difflib', 'pydantic', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- occupancy

# Expected resident blocks per SM from NVIDIA's cuda_occupancy.h (CUDA 13), default carveout.
# (The implementation was also checked against it on 20,000 random launches.)
OCCUPANCY_CASES = [
    ("A100-PCIE-40GB", 256, 32, 0, 8, 1.0),
    ("A100-PCIE-40GB", 256, 64, 0, 4, 0.5),
    ("A100-PCIE-40GB", 128, 255, 0, 2, 0.125),
    ("A100-PCIE-40GB", 256, 32, 49152, 3, 0.375),
    ("A100-PCIE-40GB", 32, 16, 0, 32, 0.5),
    ("A100-PCIE-40GB", 256, 0, 166912, 1, 0.125),
    ("A100-PCIE-40GB", 256, 0, 166913, 0, 0.0),
    ("RTX 3090", 1024, 32, 0, 1, 2 / 3),
    ("RTX 3090", 96, 40, 20000, 4, 0.25),
    ("T4", 1024, 64, 0, 1, 1.0),
    ("V100-SXM2-16GB", 1024, 65, 0, 0, 0.0),
    ("V100-SXM2-16GB", 1024, 64, 0, 1, 0.5),
    ("H100", 384, 168, 100000, 1, 0.1875),
    ("H100", 128, 90, 0, 5, 0.3125),
    ("L4", 128, 0, 0, 12, 1.0),
    # Hand-computed: 1024 x 32 registers on sm_90 is 1024 registers a warp, 16 warps a partition, 2 blocks;
    # 128 x 255 on sm_86 rounds to 8192 a warp, 2 warps a partition, 2 blocks of 4 warps (8 of 48).
    ("H100", 1024, 32, 0, 2, 1.0),
    ("RTX 3090", 128, 255, 0, 2, 8 / 48),
    ("RTX 5090", 64, 0, 0, 24, 1.0),
    # GP100 splits registers over 2 processing blocks: 32768 // 1280 = 25 warps each (4 blocks give 24).
    ("P100-SXM2-16GB", 64, 40, 0, 25, 0.78125),
    ("P100-SXM2-16GB", 256, 32, 49152, 1, 0.125),
    # ... but a block that fits GP100's 2 partitions and not GP10x's 4 is refused on every Pascal (the
    # header's forward-compatibility check): 10 warps of 6144 registers pass as 10 x 6144, fail as 12 x 6144.
    ("P100-SXM2-16GB", 320, 192, 0, 0, 0.0),
    ("P100-PCIE-16GB", 565, 109, 0, 0, 0.0),
    ("GTX 1080 Ti", 128, 64, 0, 8, 0.5),
    ("GTX 1080 Ti", 256, 0, 49152, 2, 0.25),
    ("GTX TITAN X", 1024, 33, 0, 1, 0.5),
]


@pytest.mark.parametrize(("gpu", "threads", "regs", "smem", "blocks", "occupancy"), OCCUPANCY_CASES)
def test_occupancy_matches_nvidia_calculator(
    gpu: str, threads: int, regs: int, smem: int, blocks: int, occupancy: float
) -> None:
    s = spec(gpu)
    assert active_blocks_per_sm(s, threads, regs, smem) == blocks
    assert theoretical_occupancy(s, threads, regs, smem) == pytest.approx(occupancy)


def test_occupancy_names_the_limiting_resource() -> None:
    a100 = spec("A100-PCIE-40GB")
    assert occupancy_limits(a100, 256, 64, 0).limited_by == "registers"
    assert occupancy_limits(a100, 256, 32, 49152).limited_by == "shared_memory"
    assert occupancy_limits(a100, 32, 16, 0).limited_by == "blocks"
    assert occupancy_limits(spec("RTX 3090"), 1024, 32, 0).limited_by == "warps"
    limits = occupancy_limits(a100, 2048, 32, 0)
    assert not limits.launchable and limits.occupancy == 0.0 and limits.limited_by == "none"


def test_amd_occupancy_follows_wavefront_rules() -> None:
    mi250x = spec("MI250X")
    # llvm-calc-occupancy's documented example: gfx90a, 512 work-items, 50 VGPRs -> 8 waves per SIMD (full).
    assert theoretical_occupancy(mi250x, 512, 50, 0) == 1.0
    assert theoretical_occupancy(mi250x, 256, 128, 0) == 0.5  # 4 waves per SIMD
    assert active_blocks_per_sm(mi250x, 256, 0, 32768) == 2  # 64 KB LDS per CU
    # LLVM caps workgroups of two or more waves at 16 per CU; single-wave ones fill the CU's 32 wave slots.
    assert active_blocks_per_sm(mi250x, 128, 0, 0) == 16
    assert active_blocks_per_sm(mi250x, 64, 0, 0) == 32 and theoretical_occupancy(mi250x, 64, 0, 0) == 1.0
    assert theoretical_occupancy(spec("RX 7900 XTX"), 32, 0, 0) == 1.0  # wave32: one wave a workgroup
    # VGPRs are allocated in blocks of 4 on gfx908 (MI100: 84 -> 84, 3 waves per SIMD) and of 24 on gfx1100
    # (128 -> 144 of 1536: 10 waves per SIMD32, 2 workgroups of 8 waves per CU), as LLVM's granule says.
    assert active_blocks_per_sm(spec("MI100"), 256, 84, 0) == 3
    assert active_blocks_per_sm(spec("RX 7900 XTX"), 256, 128, 0) == 2


# A property, not a speed: no per-example deadline (Hypothesis' 200 ms default fails an example that a loaded
# machine merely paused), as the other property tests have.
@settings(deadline=None)
@given(
    gpu=st.sampled_from([s.name for s in all_specs()]),
    threads=st.integers(1, 1024),
    regs=st.integers(0, 255),
    smem=st.integers(0, 100_000),
)
def test_occupancy_is_bounded_and_monotone(gpu: str, threads: int, regs: int, smem: int) -> None:
    s = spec(gpu)
    occ = theoretical_occupancy(s, threads, regs, smem)
    assert 0.0 <= occ <= 1.0
    assert theoretical_occupancy(s, threads, min(regs + 8, 255), smem) <= occ
    assert theoretical_occupancy(s, threads, regs, smem + 4096) <= occ


def test_waves() -> None:
    a100 = spec("A100-PCIE-40GB")
    assert waves(a100, 216, 2) == 1.0
    assert waves(a100, 217, 2) == pytest.approx(217 / 216)
    assert waves(a100, 0, 2) == 0.0
    assert math.isinf(waves(a100, 10, 0))


def test_b200_is_the_hgx_board_gpu() -> None:
    """NVIDIA's HGX B200 sheet gives each GPU 75 TFLOP/s FP32 and 7.7 TB/s of HBM3e (the 80 TFLOP/s and 8 TB/s the
    row had are the GB200 NVL72's 1,200 W GPU's); the driver reports a 7680-bit bus at 3996 MHz, 7.67 TB/s. A
    bandwidth-bound kernel on a B200 was forecast against 4 % more bandwidth than the GPU has."""
    b200 = spec("NVIDIA B200")
    assert (b200.fp32_tflops, b200.mem_bandwidth_gbs, b200.fp16_tensor_tflops) == (75.0, 7700, 2250.0)
    assert (b200.sms, b200.mem_gib, b200.shared_mem_per_sm_bytes) == (148, 180, 228 * 1024)


@pytest.mark.parametrize(("gpu", "fp64_tflops"), [("RX 7900 XTX", 1.92), ("Radeon PRO W7900", 1.92)])
def test_rdna3_fp64_is_a_32nd_of_its_dual_issue_fp32(gpu: str, fp64_tflops: float) -> None:
    """Navi 31 runs FP64 at 8 FLOPs a CU a clock, 1/16 of its single-issue FP32 rate; the table's FP32 counts
    dual issue (61.4 TFLOP/s), so FP64 is 1/32 of that (1.92 TFLOP/s). The ratio of 16 said 3.8 TFLOP/s."""
    s = spec(gpu)
    assert s.fp32_tflops / s.fp64_ratio == pytest.approx(fp64_tflops, rel=0.02)
    # RDNA2 counts no dual issue: its FP32 figure is single issue, and 1/16 of it is its FP64 (6900 XT: 1.44).
    assert spec("RX 6900 XT").fp32_tflops / spec("RX 6900 XT").fp64_ratio == pytest.approx(1.44, rel=0.02)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gfx942", ["MI300X", "MI300A", "MI325X"]),
        ("gfx90a:sramecc+:xnack-", ["MI250X", "MI210"]),  # rocminfo's ISA name, target features and all
        ("GFX1100", ["Radeon PRO W7800", "Radeon PRO W7900", "RX 7900 XTX"]),
        ("sm_90", ["H100-SXM5-80GB", "H100-PCIE-80GB", "H100-NVL-94GB", "H200-SXM-141GB", "H200-NVL-141GB"]),
        ("sm_90a", ["H100-SXM5-80GB", "H100-PCIE-80GB", "H100-NVL-94GB", "H200-SXM-141GB", "H200-NVL-141GB"]),
        ("compute_100", ["B200"]),
    ],
)
def test_an_architecture_names_every_gpu_of_it(name: str, expected: list[str]) -> None:
    """An ISA or compute target ("gfx942", "sm_90") is no one GPU: lookup refuses it, and the rows it may mean are
    listed (first of all by suggest, which offered nothing at all for "gfx942" or "sm_90")."""
    assert lookup(name) is None
    rows = [s.name for s in same_architecture(name)]
    assert rows[: len(expected)] == expected
    assert all(spec(r).arch == spec(expected[0]).arch for r in rows)
    assert suggest(name, limit=3) == rows[:3]
    for other in ("H100", "MI300X", "gfx", "sm", "A100 sm80 edition", ""):
        assert same_architecture(other) == [], other
