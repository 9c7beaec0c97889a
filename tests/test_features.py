"""Static features: comments, the mini preprocessor, source constructs, launch/occupancy, the prior, ptxas."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from timing import fastest_s

from forecaster_mcp.forecast.features import (
    FITTED_TERMS,
    MAX_CONDITIONS,
    MAX_SHIFT_LOG2,
    MAX_TOTAL_SHIFT_LOG2,
    PRIOR_SD_LOG2,
    WORK_RATIO_CAP_LOG2,
    SourceFeatures,
    StaticFeatures,
    entry_parameter_count,
    entry_text,
    fitted_values,
    kernel_features,
    preprocess,
    prior_shift,
    source_features,
    strip_comments,
)
from forecaster_mcp.forecast.ptxas import (
    PtxasEntry,
    PtxasUsage,
    find_nvcc,
    nvcc_version,
    parse_ptxas,
    ptxas_usage,
    safe_options,
    stand_in_arch,
    supported_archs,
)
from forecaster_mcp.hardware.specs import lookup
from forecaster_mcp.models import Kernel, Launch, Workload

TILED = """
// a comment with __shared__ and float4 that must not count
#define TILE 16
/* block comment: wmma::mma_sync( */
__global__ void mm(const float* __restrict__ a, float* c, int n) {
#if USE_SHMEM
    __shared__ float tile[TILE][TILE];
    tile[threadIdx.y][threadIdx.x] = a[threadIdx.x];
    __syncthreads();
#else
    float v = __ldg(&a[threadIdx.x]);
#endif
    #pragma unroll
    for (int i = 0; i < n; i++) { c[i] += expf(a[i]) / 3.0f; }
}
"""


def test_strip_comments_keeps_code_strings_and_line_count() -> None:
    src = 'int a; // x\nconst char* s = "// not a comment";\n/* two\nlines */ int b;'
    out = strip_comments(src)
    assert "x" not in out.split("\n")[0]
    assert '"// not a comment"' in out
    assert "int b;" in out
    assert out.count("\n") == src.count("\n")


def test_digit_separators_start_no_character_literal() -> None:
    # The quote in 1'024 used to open a character literal to the line's end, so the comment after it counted.
    src = "const int n = 1'024; /* __shared__ float t[32]; atomicAdd(p, 1); */\nint m = 0xFF'FF; // __syncthreads();\n"
    out = strip_comments(src + "char c = u8'b'; char d = '/'; // gone\n")
    assert (
        "__shared__" not in out
        and "atomicAdd" not in out
        and "__syncthreads" not in out
        and "gone" not in out
    )
    assert "1'024;" in out and "0xFF'FF;" in out and "u8'b'" in out and "'/'" in out
    f = source_features(src + "__global__ void k(float* p) { p[0] = n; }\n", {})
    assert f.shared == 0 and f.atomics == 0 and f.barriers == 0


def test_preprocess_follows_defines_through_if_else() -> None:
    with_shmem = source_features(TILED, {"USE_SHMEM": 1})
    without = source_features(TILED, {"USE_SHMEM": 0})
    assert with_shmem.shared == 1 and with_shmem.barriers == 1
    assert without.shared == 0 and without.barriers == 0 and without.readonly >= 1
    # The comment's __shared__ / wmma text never counts.
    assert with_shmem.tensor_core == 0


@pytest.mark.parametrize(
    ("pragma", "unrolled"),
    [
        ("#pragma unroll", 1),
        ("#pragma unroll 4", 1),
        ("#pragma unroll 16", 1),
        ("#pragma unroll 1", 0),
        ("#pragma unroll (1)", 0),
        ("#  pragma unroll 1 ", 0),
    ],
)
def test_unroll_one_keeps_a_loop_rolled(pragma: str, unrolled: int) -> None:
    src = f"__global__ void k(float* a, int n) {{\n    {pragma}\n    for (int i = 0; i < n; i++) a[i] += 1.0f;\n}}\n"
    assert source_features(src, {}).unroll_pragmas == unrolled


def test_preprocess_undecidable_condition_keeps_both_branches() -> None:
    src = "#if FOO ? 1 : 0\nA_BRANCH\n#else\nB_BRANCH\n#endif\n"
    out = preprocess(src, {})
    assert "A_BRANCH" in out and "B_BRANCH" in out


def test_preprocess_ifdef_elif_and_source_macros() -> None:
    src = (
        "#define LEVEL 2\n#ifdef MISSING\nX1\n#elif LEVEL > 1 && defined(LEVEL)\nX2\n#else\nX3\n#endif\n"
        "#ifndef MISSING\nX4\n#endif\n"
    )
    out = preprocess(src, {})
    assert "X1" not in out and "X2" in out and "X3" not in out and "X4" in out
    # A -D define overrides the source's own default.
    assert "X2" not in preprocess(src, {"LEVEL": 0})


def test_source_features_find_the_constructs() -> None:
    src = """
    __global__ void k(float4* v, int* cnt) {
        float4 x = v[threadIdx.x];
        atomicAdd(cnt, 1);
        float s = __shfl_down_sync(0xffffffff, x.x, 1);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(0), "l"(v));
        wmma::mma_sync(acc, a_frag, b_frag, acc);
        double d = sin(1.0);
    }
    """
    f = source_features(src, {})
    assert f.vector_types >= 2
    assert f.atomics == 1
    assert f.warp_shuffles == 1
    assert f.async_copy >= 1
    assert f.tensor_core >= 1
    assert f.fp64 == 1 and f.transcendentals >= 1


def test_library_warp_reductions_count_as_shuffles() -> None:
    cg = """
    namespace cg = cooperative_groups;
    __global__ void k(const float* x, float* out) {
        auto tile = cg::tiled_partition<32>(cg::this_thread_block());
        float v = x[threadIdx.x];
        for (int o = 16; o > 0; o /= 2) v += tile.shfl_down(v, o);
        float w = cg::reduce(tile, v, cg::plus<float>());
        if (tile.thread_rank() == 0) out[blockIdx.x] = v + w;
    }
    """
    cub = """
    __global__ void k(const float* x, float* out) {
        typedef cub::BlockReduce<float, 256> BlockReduce;
        __shared__ typename BlockReduce::TempStorage temp;
        float s = BlockReduce(temp).Sum(x[threadIdx.x]);
        if (threadIdx.x == 0) out[blockIdx.x] = s;
    }
    """
    assert source_features(cg, {}).warp_shuffles == 2
    assert source_features(cub, {}).warp_shuffles >= 1
    assert source_features("__global__ void k(float* x) { x[0] = 1.0f; }", {}).warp_shuffles == 0


ARCH_GUARDED = """
#include <mma.h>
__global__ void mm(const half* a, float* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ half tile[256];
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, half, nvcuda::wmma::row_major> fa;
  __syncthreads();
#else
  c[threadIdx.x] = 0.0f;
#endif
#ifdef USE_FAST
  c[threadIdx.x] += 1.0f;
#endif
}
"""


def test_source_features_see_the_compilers_own_macros_and_flags() -> None:
    """`__CUDA_ARCH__` (from the GPU), `__CUDACC__` and the `-D`/`-U` flags of compile_options are what nvcc's
    device pass sees: arch-guarded tensor-core paths were dropped as if `__CUDA_ARCH__` were undefined, and a
    macro set by `-D` was ignored."""

    def features(spec: str | None, **kw: Any) -> SourceFeatures:
        gpu = lookup(spec) if spec else None
        return kernel_features(Kernel(source=ARCH_GUARDED, entry="mm", **kw), Workload(), gpu).source

    a100, v100, unknown = features("A100"), features("V100"), features(None)
    assert a100.tensor_core >= 1 and a100.shared == 1 and a100.barriers == 1
    assert v100.tensor_core == 0 and v100.shared == 0  # sm_70 compiles the other branch
    assert unknown.tensor_core >= 1 and unknown.shared == 1  # GPU unknown: both branches count
    assert features("A100", compile_options=["-DUSE_FAST"]).lines == a100.lines + 1
    assert features("A100", defines={"USE_FAST": 1}).lines == a100.lines + 1
    assert features("A100", compile_options=["-DUSE_FAST", "-UUSE_FAST"]).lines == a100.lines
    cudacc = kernel_features(
        Kernel(source="#ifdef __CUDACC__\n__global__ void k(float* a) { a[0] = 1; }\n#endif\n", entry="k"),
        Workload(),
        None,
    )
    assert cudacc.source.lines >= 1


def test_kernel_features_use_the_spec_only_when_known() -> None:
    k = Kernel(
        source=TILED, entry="mm", launch=Launch(grid=[432, 1, 1], block=[256, 1, 1]), defines={"USE_SHMEM": 1}
    )
    spec = lookup("A100")
    assert spec is not None
    known = kernel_features(k, Workload(), spec)
    assert known.threads_per_block == 256 and known.blocks == 432
    assert known.occupancy is not None and 0 < known.occupancy <= 1
    assert known.waves is not None and known.waves > 0
    assert known.sm_utilisation is not None and 0 < known.sm_utilisation <= 1
    assert known.numeric_defines == {"USE_SHMEM": 1.0}
    unknown = kernel_features(k, Workload(), None)
    assert unknown.occupancy is None and unknown.waves is None
    assert unknown.threads_per_block == 256


def test_sm_utilisation_counts_idle_sms_below_one_wave_and_the_tail_above() -> None:
    """A grid-stride launch of two blocks per SM keeps every SM busy (it was scored as a quarter-full wave and
    lost 0.8 log2 to a launch of a million blocks, the opposite of what the H200 measured); fewer blocks than
    SMs leave SMs idle; past one wave the partial last wave is the loss."""
    spec = lookup("H200")
    assert spec is not None

    def util(blocks: int) -> float:
        k = Kernel(source=TILED, entry="mm", launch=Launch(grid=[blocks, 1, 1], block=[256, 1, 1]))
        f = kernel_features(k, None, spec)
        assert f.blocks_per_sm == 8 and f.sm_utilisation is not None  # 256 threads, no registers known
        return f.sm_utilisation

    assert util(2 * spec.sms) == 1.0  # a quarter of the block slots, every SM busy
    assert util(spec.sms // 2) == pytest.approx(0.5, abs=0.01)  # half the SMs idle
    one_wave = 8 * spec.sms
    assert util(one_wave) == 1.0
    assert util(one_wave + spec.sms) == pytest.approx((9 / 8) / 2)  # a second wave one-eighth full
    gridstride = Kernel(source=TILED, entry="mm", launch=Launch(grid=[2 * spec.sms, 1, 1], block=[256, 1, 1]))
    many = Kernel(source=TILED, entry="mm", launch=Launch(grid=[1 << 20, 1, 1], block=[256, 1, 1]))
    fm, fg = kernel_features(many, None, spec), kernel_features(gridstride, None, spec)
    # Every SM busy either way: the utilisation term is neutral. The grid-stride kernel does 4096 times the
    # work per thread, which the fitted term counts, capped at 16 times.
    assert abs(prior_shift(fm, fg, fitted=False).mean_log2) < 0.05
    weights = {name: w for name, w, _ in FITTED_TERMS}
    assert prior_shift(fm, fg).mean_log2 == pytest.approx(
        weights["work_per_thread"] * WORK_RATIO_CAP_LOG2, abs=0.05
    )


def test_work_per_thread_compares_the_threads_launched_for_the_same_workload() -> None:
    def feats(grid: int, block: int | None) -> StaticFeatures:
        launch = Launch(grid=[grid, 1, 1], block=[block, 1, 1]) if block else None
        return kernel_features(Kernel(source=TILED, entry="mm", launch=launch), None, None)

    index = [name for name, _, _ in FITTED_TERMS].index("work_per_thread")
    one_per_element = feats(4096, 256)
    assert fitted_values(one_per_element, feats(1024, 256))[index] == 2.0  # 4 outputs per thread
    assert fitted_values(feats(1024, 256), one_per_element)[index] == -2.0
    assert fitted_values(one_per_element, feats(8192, 128))[index] == 0.0  # same threads, other block shape
    assert fitted_values(one_per_element, feats(1, 32))[index] == WORK_RATIO_CAP_LOG2
    assert fitted_values(one_per_element, feats(1024, None))[index] == 0.0  # no launch: no evidence
    assert "more work per thread" in prior_shift(one_per_element, feats(1024, 256)).reasons[0]
    # Between tuning variants of one source the thread count says nothing reliable: left out.
    variants = prior_shift(one_per_element, feats(1024, 256), same_family=True)
    assert variants.mean_log2 == 0.0 and variants.reasons == []


def test_prior_is_neutral_without_differences_hand_terms_mild_fitted_terms_capped() -> None:
    plain = Kernel(source="__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }", entry="k")
    same = prior_shift(kernel_features(plain, None, None), kernel_features(plain, None, None))
    assert same.mean_log2 == 0.0 and same.sd_log2 == PRIOR_SD_LOG2 and same.reasons == []

    tensor = Kernel(source="__global__ void k(float* a) { wmma::mma_sync(c, x, y, c); }", entry="k")
    hand = prior_shift(kernel_features(plain, None, None), kernel_features(tensor, None, None))
    assert 0 < hand.mean_log2 <= MAX_SHIFT_LOG2  # hand-set heuristics stay mild
    assert any("tensor cores" in r for r in hand.reasons)

    fancy = Kernel(
        source="__global__ void k(float4* a) { float4 v = a[threadIdx.x]; wmma::mma_sync(c, x, y, c); }",
        entry="k",
    )
    better = prior_shift(kernel_features(plain, None, None), kernel_features(fancy, None, None))
    weights = {name: w for name, w, _ in FITTED_TERMS}
    assert better.mean_log2 == pytest.approx(hand.mean_log2 + weights["vector_types"])
    worse = prior_shift(kernel_features(fancy, None, None), kernel_features(plain, None, None))
    assert worse.mean_log2 == pytest.approx(-better.mean_log2)

    # Every fitted term pointing the same way is still capped.
    a = Kernel(source=STRIDED_ROW + PER_ELEMENT_ATOMIC, entry="k")
    b = Kernel(source=WARP_ROW + "__shared__ float t[32]; __syncthreads(); float4 v;", entry="k")
    capped = prior_shift(kernel_features(a, None, None), kernel_features(b, None, None))
    assert capped.mean_log2 == MAX_TOTAL_SHIFT_LOG2
    assert capped.reasons[0].startswith("one global atomic per element")  # largest contribution first


def test_a_kernel_that_cannot_launch_is_the_slower_whichever_side_it_is() -> None:
    """Occupancy 0 (registers or shared memory beyond the SM's): the candidate was penalised even when the
    baseline could not launch either, and a baseline that could not launch said nothing."""
    plain = kernel_features(Kernel(source="__global__ void k(float* a) { a[0] = 1; }", entry="k"), None, None)
    runs, stuck = dataclasses.replace(plain, occupancy=0.5), dataclasses.replace(plain, occupancy=0.0)
    assert prior_shift(stuck, stuck).mean_log2 == 0.0
    assert prior_shift(runs, stuck).mean_log2 == -MAX_SHIFT_LOG2
    assert prior_shift(stuck, runs).mean_log2 == MAX_SHIFT_LOG2
    assert "baseline cannot launch" in prior_shift(stuck, runs).reasons[0]


STRIDED_ROW = """
__global__ void rows(const float* A, float* y, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < M) { const float* a = A + (size_t)row * N; float s = 0; for (int j = 0; j < N; ++j) s += a[j]; y[row] = s; }
}
"""
WARP_ROW = """
__global__ void rows(const float* A, float* y, int M, int N) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    const float* a = A + (size_t)warp * N;
    float s = 0; for (int j = lane; j < N; j += 32) s += a[j];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffff, s, o);
    if (lane == 0) y[warp] = s;
}
"""
PER_ELEMENT_ATOMIC = """
__global__ void hist(const int* d, int* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&h[d[i]], 1);
}
"""
PRIVATISED_ATOMICS = """
#define BINS 64
__global__ void hist(const int* d, int* h, int n) {
    __shared__ int sh[BINS];
    int* mine = sh;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&mine[d[i]], 1);
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        atomicAdd(&h[b], sh[b]);
    }
    if (threadIdx.x == 0) atomicAdd(&h[0], 0);
}
"""


LANE_PRODUCT = """
__global__ void k(float* o, float x0, float dx, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    {body}
}}
"""
BLOCK_SUM = """
__global__ void sum(const float* x, float* out, int n, bool done) {{
    __shared__ float s[256];
    int tid = threadIdx.x;
    s[tid] = x[blockIdx.x * 256 + tid];
    __syncthreads();
    {guard}
}}
"""

# A block-local counter or histogram in shared memory, bumped by every thread (stream compaction, histograms).
SHARED_ATOMIC = """
__global__ void count(const int* d, unsigned int* out, int n) {{
    {decl}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    bool keep = i < n && d[i] > 0;

    if (keep) atomicAdd(&{target}, 1u);
}}
"""


@pytest.mark.parametrize(
    ("source", "strided", "atomics"),
    [
        (STRIDED_ROW, 1, 0),
        (WARP_ROW, 0, 0),  # a warp index (x / 32) times N is the same row for the whole warp: coalesced
        (
            "__global__ void t(const float* in, float* out, int n) { int x = blockIdx.x * 32 + threadIdx.x; "
            "int y = blockIdx.y; out[x * n + y] = in[y * n + x]; }",
            1,
            0,
        ),
        (
            "#define TILE 32\n__global__ void t(float* a) { __shared__ float s[TILE * TILE]; "
            "s[threadIdx.x * TILE] = a[blockIdx.x * blockDim.x + threadIdx.x]; }",
            0,
            0,
        ),
        (PER_ELEMENT_ATOMIC, 0, 1),
        (PRIVATISED_ATOMICS, 0, 0),
        # A product with a lane-fast index is a stride only where it is an address: a subscript, a pointer, an
        # integer later used as an index; not arithmetic on values (a linspace, a scale, a hash).
        (LANE_PRODUCT.format(body="o[i] = x0 + i * dx;"), 0, 0),
        (LANE_PRODUCT.format(body="float w = i * dx; o[i] = w;"), 0, 0),
        (LANE_PRODUCT.format(body="int at = i * n; o[at] = x0;"), 1, 0),
        (LANE_PRODUCT.format(body="float* row = o + i * n; row[0] = x0;"), 1, 0),
        # A named compile-time constant is a literal (a tile or vector width), not a row length.
        (LANE_PRODUCT.format(body="const int vec = 4; o[i * vec] = x0;"), 0, 0),
        (LANE_PRODUCT.format(body="constexpr int kVec = 2 * 2; int at = i * kVec; o[at] = x0;"), 0, 0),
        ("template <typename T, int vec>\n" + LANE_PRODUCT.format(body="o[i * vec] = x0;"), 0, 0),
        (LANE_PRODUCT.format(body="const int stride = n * 2; o[i * stride] = x0;"), 1, 0),
        # One thread per block merges a reduction: however the guard is spelled, not a per-element atomic.
        (BLOCK_SUM.format(guard="float v = s[0];\nif (!threadIdx.x) atomicAdd(out, v);"), 0, 0),
        (BLOCK_SUM.format(guard="float v = s[0];\nif (threadIdx.x == 0 && n > 0) atomicAdd(out, v);"), 0, 0),
        (
            BLOCK_SUM.format(
                guard="if (tid < 1) {\n  float v = s[0];\n  v *= 2.0f;\n  atomicAdd(out, v);\n}"
            ),
            0,
            0,
        ),
        (BLOCK_SUM.format(guard="if (tid == 0)\n{\n  float v = s[0];\n\n  atomicAdd(out, v);\n}"), 0, 0),
        (BLOCK_SUM.format(guard="if (threadIdx.x != 0) return;\nfloat v = s[0];\natomicAdd(out, v);"), 0, 0),
        # A flag that is not a thread index guards nothing; a block closed before the atomic no longer does.
        (BLOCK_SUM.format(guard="if (!done) atomicAdd(out + tid, x[tid]);"), 0, 1),
        (BLOCK_SUM.format(guard="if (tid == 0) {\n  s[0] = 0;\n}\n\n\natomicAdd(out + tid, 1.0f);"), 0, 1),
        # Atomics on shared memory however it is declared: a scalar counter, an aligned array, a second name.
        (SHARED_ATOMIC.format(decl="__shared__ unsigned int c;", target="c"), 0, 0),
        (
            SHARED_ATOMIC.format(decl="__shared__ __align__(16) unsigned int c[64];", target="c[d[i] & 63]"),
            0,
            0,
        ),
        (
            SHARED_ATOMIC.format(decl="alignas(16) __shared__ unsigned int c[64];", target="c[d[i] & 63]"),
            0,
            0,
        ),
        (SHARED_ATOMIC.format(decl="__shared__ unsigned int a[64], c[64];", target="c[d[i] & 63]"), 0, 0),
        (SHARED_ATOMIC.format(decl="__shared__ unsigned int c;", target="out[d[i] & 63]"), 0, 1),
        # Past a cast of the address: the float max trick on a shared scalar, a 64-bit view of a global array.
        (
            SHARED_ATOMIC.format(decl="__shared__ int c;", target="c").replace(
                "(&c, 1u)", "((int*)&c, d[i])"
            ),
            0,
            0,
        ),
        (
            SHARED_ATOMIC.format(decl="__shared__ int c;", target="c").replace(
                "(&c, 1u)", "(reinterpret_cast<unsigned int*>(&c), 1u)"
            ),
            0,
            0,
        ),
        (
            SHARED_ATOMIC.format(decl="", target="out[i]").replace(
                "(&out[i], 1u)", "((unsigned long long*)&out[2 * i], 1ull)"
            ),
            0,
            1,
        ),
    ],
)
def test_access_pattern_passes(source: str, strided: int, atomics: int) -> None:
    f = source_features(source, {})
    assert (f.strided_access, f.thread_atomics) == (strided, atomics)


# ---------------------------------------------------------------- ptxas

PTXAS_OUTPUT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3addPfPKfi' for 'sm_80'
ptxas info    : Function properties for _Z3addPfPKfi
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 372 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
"""


def test_parse_ptxas_reads_each_entry() -> None:
    entries = parse_ptxas(PTXAS_OUTPUT)
    assert [e.name for e in entries] == ["_Z3addPfPKfi", "other"]
    add = entries[0]
    assert (add.registers, add.shared_bytes, add.spill_stores_bytes, add.spill_loads_bytes) == (
        40,
        1024,
        4,
        12,
    )
    assert add.spill_bytes == 16 and entries[1].shared_bytes == 0


def test_parse_ptxas_charges_a_noinline_helpers_spills_to_the_entry() -> None:
    # nvcc 13, sm_90, -maxrregcount=32: the spills of a __noinline__ helper are reported under its own name,
    # after the entry's block; they were dropped, so the kernel read as spilling nothing.
    out = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern' for 'sm_90'
ptxas info    : Function properties for kern
    1216 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1216 bytes cumulative stack size
ptxas info    : Compile time = 154.999 ms
ptxas info    : Function properties for _Z6helperPKfi
    0 bytes stack frame, 812 bytes spill stores, 848 bytes spill loads
"""
    (kern,) = parse_ptxas(out)
    assert (kern.name, kern.registers, kern.spill_stores_bytes, kern.spill_loads_bytes) == (
        "kern",
        32,
        812,
        848,
    )
    assert kern.stack_frame_bytes == 1216  # as reported (ptxas's cumulative figure counts the callee's frame)
    # Entries alone, as before: nothing added.
    assert [e.spill_bytes for e in parse_ptxas(PTXAS_OUTPUT)] == [16, 0]


def test_parse_ptxas_charges_each_entry_the_spills_of_the_helpers_it_calls() -> None:
    # nvcc 13, sm_90, -maxrregcount=32, two kernels: k3 calls a __noinline__ helper, k2 the recursive fib and the
    # helper. ptxas compiles a copy of the callees with each entry and reports them after that entry's block.
    # Every entry was charged every reported function's spills (k3 those of fib, which it never calls, and of
    # k2's copy of the helper: 744/780 instead of 788/824).
    out = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z2k3Pfi' for 'sm_90'
ptxas info    : Function properties for _Z2k3Pfi
    896 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 896 bytes cumulative stack size
ptxas info    : Compile time = 45.750 ms
ptxas info    : Function properties for _Z6helperPfi
    0 bytes stack frame, 788 bytes spill stores, 824 bytes spill loads
ptxas info    : Compiling entry function '_Z2k2Pfi' for 'sm_90'
ptxas info    : Function properties for _Z2k2Pfi
    896 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 896 bytes cumulative stack size
ptxas info    : Compile time = 46.498 ms
ptxas info    : Function properties for _Z3fibi
    24 bytes stack frame, 20 bytes spill stores, 20 bytes spill loads
ptxas info    : Function properties for _Z6helperPfi
    0 bytes stack frame, 724 bytes spill stores, 760 bytes spill loads
"""
    k3, k2 = parse_ptxas(out)
    assert (k3.name, k3.spill_stores_bytes, k3.spill_loads_bytes) == ("_Z2k3Pfi", 788, 824)
    assert (k2.name, k2.spill_stores_bytes, k2.spill_loads_bytes) == ("_Z2k2Pfi", 744, 780)
    # A function reported before any entry cannot be placed: every entry is charged it.
    (kern,) = parse_ptxas(
        "ptxas info    : Function properties for _Z6helperPfi$1\n"
        "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Compiling entry function 'kern' for 'sm_90'\n"
        "ptxas info    : Used 12 registers\n"
    )
    assert (kern.spill_stores_bytes, kern.spill_loads_bytes) == (8, 4)


def test_safe_options_drop_anything_touching_files() -> None:
    opts = [
        "-O3",
        "--use_fast_math",
        "-maxrregcount=64",
        "-I/etc",
        "--include-path=/x",
        "-Xcompiler=-fplugin=x",
    ]
    assert safe_options(opts) == ["-O3", "--use_fast_math", "-maxrregcount=64"]
    # Relocatable device code leaves file-scope shared memory to the link: left out of the resource compile.
    assert safe_options(["-rdc=true", "--relocatable-device-code=true", "-rdc=false", "-O3"]) == ["-O3"]


SMALL = """
#ifndef BS
#define BS 128
#endif
__global__ void add(float* a, const float* __restrict__ b, int n) {
  __shared__ float s[BS];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  s[threadIdx.x] = b[i];
  __syncthreads();
  if (i < n) a[i] += s[(threadIdx.x + 1) % BS];
}
"""


@pytest.mark.anyio
async def test_ptxas_really_compiles_and_caches(tmp_path: Path) -> None:
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    k = Kernel(source=SMALL, entry="add", defines={"BS": 256})
    usage = await ptxas_usage(k, "sm_80", nvcc, tmp_path)
    assert usage is not None
    entry = usage.for_entry("add")  # found through the Itanium-mangled name
    assert entry is not None and entry.registers > 0
    assert entry.shared_bytes == 256 * 4  # the define reached the compiler
    assert len(list((tmp_path / "ptxas").glob("*.json"))) == 1
    t0 = time.perf_counter()
    again = await ptxas_usage(k, "sm_80", nvcc, tmp_path)
    assert again == usage and time.perf_counter() - t0 < 0.5  # from the cache, no second compile


FILE_SCOPE_SHARED = """
__shared__ float gtile[512];
extern "C" __global__ void kern(float* p) {
  gtile[threadIdx.x] = p[threadIdx.x];
  __syncthreads();
  p[threadIdx.x] = gtile[(threadIdx.x + 1) % 512];
}
"""


@pytest.mark.anyio
async def test_ptxas_counts_file_scope_shared_memory_of_a_kernel_built_with_rdc(tmp_path: Path) -> None:
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    k = Kernel(source=FILE_SCOPE_SHARED, entry="kern", compile_options=["-rdc=true"])
    usage = await ptxas_usage(k, "sm_80", nvcc, tmp_path)
    entry = usage.for_entry("kern") if usage is not None else None
    # With -rdc=true ptxas leaves the array to the link and reported no shared memory: 0 bytes.
    assert entry is not None and entry.shared_bytes == 512 * 4


@pytest.mark.anyio
async def test_ptxas_returns_none_when_it_cannot_compile(tmp_path: Path) -> None:
    k = Kernel(source=SMALL, entry="add")
    assert find_nvcc("/nonexistent/bin/nvcc") is None
    assert await ptxas_usage(k, "sm_80", "/nonexistent/bin/nvcc", tmp_path) is None
    assert await ptxas_usage(k.model_copy(update={"language": "opencl"}), "sm_80", "nvcc", tmp_path) is None
    assert await ptxas_usage(k, "not-an-arch", "nvcc", tmp_path) is None
    nvcc = find_nvcc(None)
    if nvcc is not None:
        broken = Kernel(source="__global__ void add( { syntax error", entry="add")
        assert await ptxas_usage(broken, "sm_80", nvcc, tmp_path) is None


@pytest.mark.anyio
async def test_ptxas_kills_a_hung_compiler(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    fake = tmp_path / "nvcc"
    # Stands in for a compiler that hangs: it records its pid and never finishes on its own.
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo "release 0.0"; exit 0; }\n'
        f"echo $$ > {pid_file}\necho $TMPDIR > {tmp_path / 'tmpdir'}\nexec sleep 60\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    k = Kernel(source=SMALL, entry="add")
    t0 = time.perf_counter()
    assert await ptxas_usage(k, "sm_80", str(fake), tmp_path / "cache", timeout_s=0.5) is None
    assert time.perf_counter() - t0 < 5.0
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # A timeout is not cached: the next call tries again.
    assert not (tmp_path / "cache" / "ptxas").exists() or not list(
        (tmp_path / "cache" / "ptxas").glob("*.json")
    )
    # nvcc's intermediates (tmpxft_*, which hold the source) went to a folder removed with the compile.
    left = (tmp_path / "tmpdir").read_text().strip()
    assert left and not await anyio.Path(left).exists()


def _fake_nvcc(path: Path, version: str, body: str) -> str:
    """A stand-in nvcc at `path`: `--version` prints `version`, any compile runs the shell `body`."""
    # It keeps a preprocessed source, as nvcc --keep does (the compile is checked by it).
    keep = 'p=; for a; do [ "$p" = --keep-dir ] && : > "$a/kernel.cpp1.ii"; p="$a"; done'
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\n{keep}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _ptxas_says(registers: int) -> str:
    return (
        "echo \"ptxas info    : Compiling entry function '_Z3addPfPKfi' for 'sm_80'\"\n"
        f"echo 'ptxas info    : Used {registers} registers, 360 bytes cmem[0]'"
    )


@pytest.mark.anyio
async def test_ptxas_cache_knows_the_compiler_version_and_skips_the_machines_failures(tmp_path: Path) -> None:
    """A toolkit upgraded behind the same path is not served the old one's figures; a compile killed by a
    signal (the OOM killer) or failing on a full disk is not cached as the source's failure."""
    k = Kernel(source=SMALL, entry="add")
    cache = tmp_path / "cache"
    nvcc = _fake_nvcc(tmp_path / "nvcc", "release 12.8", _ptxas_says(24))
    first = await ptxas_usage(k, "sm_80", nvcc, cache)
    assert first is not None and first.entries[0].registers == 24
    nvcc_version.cache_clear()  # a restart after the upgrade
    _fake_nvcc(tmp_path / "nvcc", "release 13.0", _ptxas_says(40))
    upgraded = await ptxas_usage(k, "sm_80", nvcc, cache)
    assert upgraded is not None and upgraded.entries[0].registers == 40
    for broken in ("kill -9 $$", "echo 'fatal: No space left on device' >&2; exit 1"):
        nvcc_version.cache_clear()
        other = Kernel(source=SMALL, entry="add", defines={"BS": 64})
        _fake_nvcc(tmp_path / "nvcc", "release 13.1", broken)
        assert await ptxas_usage(other, "sm_80", nvcc, cache) is None
        _fake_nvcc(tmp_path / "nvcc", "release 13.1", _ptxas_says(32))
        again = await ptxas_usage(other, "sm_80", nvcc, cache)
        assert again is not None and again.entries[0].registers == 32, broken
        for f in (cache / "ptxas").glob("*.json"):
            f.unlink()
    # A compile error is the source's own, and is cached.
    _fake_nvcc(tmp_path / "nvcc", "release 13.1", "echo 'kernel.cu(3): error: expected a )'; exit 1")
    assert await ptxas_usage(k, "sm_80", nvcc, cache) is None
    _fake_nvcc(tmp_path / "nvcc", "release 13.1", _ptxas_says(32))
    assert await ptxas_usage(k, "sm_80", nvcc, cache) is None


@pytest.mark.anyio
async def test_the_ptxas_cache_keeps_to_its_bound_dropping_the_least_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compares are free and every compile was kept: a client cycling a define over a source of a thousand kernels
    (ptxas reports each) grew the cache by 500 KB a compare, without end. Past its bound the least recently used
    results go (a later compare compiles them again)."""
    from forecaster_mcp.forecast import ptxas

    cache = tmp_path / "cache"
    nvcc = _fake_nvcc(tmp_path / "nvcc", "release 13.1", _ptxas_says(24))

    def kernel(n: int) -> Kernel:
        return Kernel(source=SMALL, entry="add", defines={"BS": n})

    def files() -> list[Path]:
        return list((cache / "ptxas").glob("*.json"))

    for n in range(3):
        assert await ptxas_usage(kernel(n), "sm_80", nvcc, cache) is not None
    one = files()[0].stat().st_size
    bound = 10 * one
    monkeypatch.setattr(ptxas, "PTXAS_CACHE_BYTES", bound)
    for n in range(3, 40):
        assert await ptxas_usage(kernel(n), "sm_80", nvcc, cache) is not None
        # Kernel 0 is asked about again and again: never the least recently used.
        assert await ptxas_usage(kernel(0), "sm_80", nvcc, cache) is not None
        assert sum(f.stat().st_size for f in files()) <= bound + one, f"{len(files())} results kept"
    kept = {f.name for f in files()}
    key = ptxas._cache_key(kernel(0), "sm_80", nvcc, [], "-arch=sm_80")
    assert f"{key}.json" in kept
    assert f"{ptxas._cache_key(kernel(39), 'sm_80', nvcc, [], '-arch=sm_80')}.json" in kept
    assert f"{ptxas._cache_key(kernel(1), 'sm_80', nvcc, [], '-arch=sm_80')}.json" not in kept
    assert await ptxas_usage(kernel(1), "sm_80", nvcc, cache) is not None  # compiled again


@pytest.mark.anyio
async def test_ptxas_compiles_device_code_only(tmp_path: Path) -> None:
    """Host code never reaches the host compiler or assembler: `asm(".incbin ...")` in it made the compile's
    success tell whether a file on the server exists (and could write gigabytes of object file)."""
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    for path in ("/etc/passwd", "/nonexistent/secret"):
        k = Kernel(source=SMALL + f'\nasm(".incbin \\"{path}\\"");\n', entry="add")
        usage = await ptxas_usage(k, "sm_80", nvcc, None)
        assert usage is not None and usage.for_entry("add") is not None, path
    relocatable = await ptxas_usage(
        Kernel(source=SMALL, entry="add", compile_options=["-dc"]), "sm_80", nvcc, None
    )
    assert relocatable is not None


# Fails on a source holding BROKEN as nvcc does (with host paths), compiles any other; `extra` runs first.
def _nvcc_rejecting_broken(path: Path, extra: str = "") -> str:
    return _fake_nvcc(
        path,
        "release 13.0",
        '[ "$1" = --list-gpu-code ] && exit 1\n'  # cannot say: each GPU's own architecture is used
        f"{extra}\n"
        'for a; do src="$a"; done\n'
        'if grep -q BROKEN "$src"; then\n'
        '  echo "$PWD/kernel.cu(5): error: identifier \\"BROKEN\\" is undefined"\n'
        '  echo "/usr/local/cuda/include/crt/host_defines.h(9): error: a second error"; exit 1\n'
        "fi\n" + _ptxas_says(32),
    )


def _pair(base: Kernel, cand: Kernel, hardware: str | None) -> Any:
    from forecaster_mcp.forecast.base import PairQuery

    workload = Workload(problem={"n": 1 << 20})
    return PairQuery(base, cand, workload, hardware or "unknown", lookup(hardware) if hardware else None)


@pytest.mark.anyio
async def test_a_kernel_whose_source_does_not_compile_is_forecast_to_fail(tmp_path: Path) -> None:
    """nvcc's compile error makes the kernel's chance of failing near 1 (a little less for an error found on a
    stand-in architecture), and the rationale says so with the first error line, host paths stripped. Before,
    a failed compile only took the ptxas features away: p_fail 0, and the head of measure_next."""
    from forecaster_mcp.forecast.local import (
        P_FAIL_COMPILE_ERROR,
        P_FAIL_COMPILE_ERROR_STAND_IN,
        LocalForecaster,
    )

    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    good = Kernel(source=SMALL, entry="add", launch=launch)
    broken = Kernel(source=SMALL + "\nint BROKEN_USE = BROKEN;\n", entry="add", launch=launch)
    nvcc = _nvcc_rejecting_broken(tmp_path / "nvcc")
    cache = tmp_path / "cache"
    f = LocalForecaster(None, nvcc=nvcc, cache_dir=cache, ptxas_wait_s=30.0)
    cand_fails, base_fails, stand_in = await f.forecast(
        [_pair(good, broken, "H100"), _pair(broken, good, "H100"), _pair(good, broken, None)]
    )
    assert cand_fails.extras["p_fail"] == P_FAIL_COMPILE_ERROR >= 0.95
    assert cand_fails.extras["p_fail_baseline"] == 0.0 and cand_fails.extras["compile_error"] == 1.0
    first_line = 'kernel.cu(5): error: identifier "BROKEN" is undefined'
    assert cand_fails.rationale.startswith(
        f"candidate does not compile (this server's nvcc for sm_90): {first_line}"
    )
    assert "a second error" not in cand_fails.rationale and "fmcp-ptxas" not in cand_fails.rationale
    assert base_fails.extras["p_fail_baseline"] == P_FAIL_COMPILE_ERROR and base_fails.extras["p_fail"] == 0.0
    assert base_fails.rationale.startswith("baseline does not compile") and first_line in base_fails.rationale
    # An unknown GPU is compiled for sm_80, a stand-in: an error there is less sure to recur on the real one.
    assert stand_in.extras["p_fail"] == P_FAIL_COMPILE_ERROR_STAND_IN < P_FAIL_COMPILE_ERROR
    assert "stand-in" in stand_in.rationale and first_line in stand_in.rationale
    # A header this machine lacks (a PyTorch extension's torch/extension.h) is no compile error of the kernel's:
    # no chance of failing, no compile_error flag (which makes the server call it slower and leave it out of
    # measure_next). Its device code is compiled without it for ptxas's figures, and the rationale says so.
    header = Kernel(source='#include "BROKEN/extension.h"\n' + SMALL, entry="add", launch=launch)
    missing = _fake_nvcc(
        tmp_path / "nvcc-no-header",
        "release 13.0",
        'for a; do src="$a"; done\ngrep -q BROKEN "$src" && '
        "{ echo 'kernel.cu:1:10: fatal error: BROKEN/extension.h: No such file or directory'; exit 1; }\n"
        + _ptxas_says(32),
    )
    (no_header,) = await LocalForecaster(None, nvcc=missing).forecast([_pair(good, header, "H100")])
    assert no_header.extras["p_fail"] == 0.0 and no_header.extras["p_fail_baseline"] == 0.0
    assert "compile_error" not in no_header.extras and "does not compile" not in no_header.rationale
    assert no_header.rationale.endswith(
        "; candidate: device code compiled here alone, without host code (this server's nvcc has no "
        "BROKEN/extension.h)"
    )
    # The error is the source's own: kept in the cache with its line, as a restarted server reads it.
    _fake_nvcc(tmp_path / "nvcc", "release 13.0", _ptxas_says(32))
    (again,) = await LocalForecaster(None, nvcc=nvcc, cache_dir=cache).forecast([_pair(good, broken, "H100")])
    assert again.extras["p_fail"] == P_FAIL_COMPILE_ERROR and first_line in again.rationale


@pytest.mark.parametrize(
    "trouble",
    [
        "kill -9 $$",  # killed by a signal (the OOM killer, an operator)
        "sleep 30",  # still compiling when the forecast stops waiting
        "echo 'fatal: No space left on device' >&2; exit 1",
        "echo \"nvcc fatal   : Unsupported gpu architecture 'compute_90'\"; exit 1",
        "echo 'error -- unsupported GNU version! gcc versions later than 13 are not supported!'; exit 1",
        "echo 'usage: prog [options]'; exit 2",  # a configured "nvcc" that is another program: no diagnostic
    ],
)
@pytest.mark.anyio
async def test_a_compile_that_fails_for_the_machines_reason_is_no_compile_error(
    tmp_path: Path, trouble: str
) -> None:
    """A timeout, a kill, a full disk, the compiler's own set-up or a failure without a diagnostic says nothing
    of the kernel: no chance of failing is added, as without nvcc or for a language nvcc does not take."""
    from forecaster_mcp.forecast.local import LocalForecaster

    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    good = Kernel(source=SMALL, entry="add", launch=launch)
    broken = Kernel(source=SMALL + "\nint BROKEN_USE = BROKEN;\n", entry="add", launch=launch)
    # `trouble` hits every compile; the plain error of a BROKEN source would follow it.
    nvcc = _nvcc_rejecting_broken(tmp_path / "nvcc", trouble)
    forecasters = [
        LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=0.5),
        LocalForecaster(None, nvcc=str(tmp_path / "missing-nvcc"), ptxas_wait_s=30.0),
    ]
    for f in forecasters:
        pairs = [_pair(good, broken, "H100"), _pair(broken, good, "H100")]
        for fc in await f.forecast(pairs):
            assert fc.extras["p_fail"] == fc.extras["p_fail_baseline"] == 0.0, trouble
            assert "compile" not in fc.rationale and "compile_error" not in fc.extras
    hip = broken.model_copy(update={"language": "hip"})
    (fc,) = await LocalForecaster(None, nvcc=_nvcc_rejecting_broken(tmp_path / "nvcc2")).forecast(
        [_pair(good, hip, "H100")]
    )
    assert fc.extras["p_fail"] == 0.0


def test_a_namespaced_kernel_is_found_among_others() -> None:
    usage = PtxasUsage(
        "sm_90", (PtxasEntry("_Z5otherPf", 8, 0, 0, 0, 0), PtxasEntry("_ZN3opt4gemvEPf", 10, 0, 0, 0, 0))
    )
    found = usage.for_entry("gemv")
    assert found is not None and found.registers == 10
    assert usage.for_entry("other") is not None and usage.for_entry("missing") is None


def test_features_describe_the_entry_kernel_not_its_neighbours() -> None:
    naive = """
    __global__ void add_naive(const float* a, const float* b, float* c, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) atomicAdd(&c[0], a[i] + b[i]);
    }
    """
    fast = """
    __device__ float4 load4(const float* p, int i) { return reinterpret_cast<const float4*>(p)[i]; }
    template <int BS>
    __global__ void __launch_bounds__(256) add_fast(const float* a, float* c, int n) {
        __shared__ float tile[BS];
        float4 v = load4(a, blockIdx.x * blockDim.x + threadIdx.x);
        tile[threadIdx.x] = v.x + v.y + v.z + v.w;
        __syncthreads();
        c[blockIdx.x] = tile[0];
    }
    """
    host = "\nvoid launch(float* a, float* c, int n) { add_fast<256><<<n / 1024, 256>>>(a, c, n); }\n"
    both = naive + fast + host
    assert source_features(both, {}, "add_fast") == source_features(fast + host, {}, "add_fast")
    alone = source_features(both, {}, "add_naive")
    assert alone.thread_atomics == 1 and alone.shared == 0 and alone.vector_types >= 1  # load4 stays
    # The whole source when the entry is not defined in it, or when none is given.
    assert (
        source_features(both, {}, "missing")
        == source_features(both, {})
        != source_features(both, {}, "add_fast")
    )
    declared = "__global__ void add_naive(const float*, const float*, float*, int);\n" + fast
    with_declaration = source_features(declared, {}, "add_fast")
    assert dataclasses.replace(with_declaration, lines=0) == dataclasses.replace(
        source_features(fast, {}, "add_fast"), lines=0
    )  # a declaration (no body) is left alone


def test_stand_in_arch_is_the_nearest_one_the_compiler_takes(tmp_path: Path) -> None:
    cuda13 = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "sm_121")
    cuda12_2 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
    assert stand_in_arch("sm_70", cuda13) == "sm_75"  # older than the window: the oldest it takes
    assert stand_in_arch("sm_60", cuda13) == "sm_75"
    assert stand_in_arch("sm_89", cuda13) == "sm_89"
    assert stand_in_arch("sm_120", cuda12_2) == "sm_90"  # newer than the window: the newest older one
    assert stand_in_arch("sm_100", cuda12_2) == "sm_90"
    assert stand_in_arch("sm_90a", cuda12_2) == "sm_90a" and stand_in_arch("sm_70", ()) == "sm_70"
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho sm_75\necho sm_80\necho compute_80\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert supported_archs(str(fake)) == ("sm_75", "sm_80")
    assert supported_archs(str(tmp_path / "missing")) == ()


@pytest.mark.anyio
async def test_a_gpu_outside_the_compilers_window_gets_registers_from_a_stand_in() -> None:
    """nvcc 13 no longer compiles for sm_70: a V100's registers come from sm_75, so the occupancy a heavy
    kernel loses shows in the prior (it did only for GPUs the local nvcc targets)."""
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.local import LocalForecaster

    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    if "sm_70" in supported_archs(nvcc):
        pytest.skip("this nvcc still compiles for sm_70")
    light = "__global__ void light(const float* a, float* b, int n) {\n"
    light += "    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = 2.0f * a[i]; }\n"
    heavy = """
    __global__ void heavy(const float* a, float* b, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
        float r[96];
        #pragma unroll
        for (int k = 0; k < 96; ++k) r[k] = a[(i + k * 977) % n];
        float s = 0.0f;
        #pragma unroll
        for (int k = 0; k < 96; ++k) s += r[k] * r[95 - k];
        b[i] = s;
    }
    """
    launch = Launch(grid=[4096, 1, 1], block=[256, 1, 1])
    base = Kernel(id="light", source=light, entry="light", launch=launch)
    cand = Kernel(id="heavy", source=heavy, entry="heavy", launch=launch)
    query = PairQuery(base, cand, Workload(), "V100", lookup("V100"))
    (forecast,) = await LocalForecaster(None, ptxas_wait_s=30.0).forecast([query])
    assert "occupancy (-)" in forecast.rationale


def test_if_conditions_are_evaluated_in_64_bits_without_eval() -> None:
    """An agent's `#if 1 << 1099511627776` must not make the server allocate 128 GB: beyond 64 bits a
    condition is undecided (both branches count), as the preprocessor's intmax_t would not hold it."""
    from forecaster_mcp.forecast.features import _eval_condition

    assert _eval_condition("1 << 1099511627776", {}) is None
    assert _eval_condition("A*A*A*A*A*A*A*A", {"A": "1000000"}) is None
    assert _eval_condition("(1 << 4) == 16 && !B", {}) is True
    assert _eval_condition("A >= 2 || defined(B)", {"A": "1"}) is False
    assert _eval_condition("1 < A < 3", {"A": "2"}) is True
    assert _eval_condition("__import__('os')", {}) is None


def test_if_conditions_that_grow_or_nest_without_end_are_undecided() -> None:
    """`#define A A+A+A+A+A+A` then `#if A` expands sixfold per level (it held the event loop for 30 s), and
    `#if - - - ... 1` recursed out of Python's parser: both are undecided (both branches count), not errors."""
    from forecaster_mcp.forecast.features import _eval_condition

    assert _eval_condition("A", {"A": "+".join(["A"] * 6)}) is None
    assert _eval_condition("B", {"B": "1+" * 3000 + "1"}) is None
    assert _eval_condition("-" * 3000 + "1", {}) is None
    assert _eval_condition("-" * 3 + "1", {}) is True
    src = "#define A A+A+A+A+A+A\n#if A\nint x;\n#else\nint y;\n#endif\n"
    assert "int x;" in preprocess(src, {}) and "int y;" in preprocess(src, {})


def test_a_literal_left_open_ends_at_its_line() -> None:
    # As the compiler reads it; it also keeps each quote of '"\\"\\"...' from scanning to the line's end.
    out = strip_comments('char* s = "open \\" // not a comment\nint a; // gone\nchar c = \'x; /* z */\n')
    assert out.splitlines() == ['char* s = "open \\" // not a comment', "int a; ", "char c = 'x; /* z */"]
    assert strip_comments('"\\' * 50_000) == '"\\' * 50_000


def test_if_conditions_follow_c_arithmetic() -> None:
    """`/` truncates toward zero and `%` takes the dividend's sign in C (Python floors), and comparisons do
    not chain: `1 < A < 3` is `(1 < A) < 3`. A tuning macro like `#if (OFFSET / 2) == -1` must pick the branch
    nvcc compiles."""
    from forecaster_mcp.forecast.features import _eval_condition

    assert _eval_condition("(-7 / 2) == -3", {}) is True
    assert _eval_condition("(OFF / 2) == -1", {"OFF": "-3"}) is True
    assert _eval_condition("(-7 % 2) == -1", {}) is True
    assert _eval_condition("(7 % -2) == 1", {}) is True
    assert _eval_condition("(-8 / -2) == 4 && (-8 % 3) == -2", {}) is True
    assert _eval_condition("1 < A < 3", {"A": "5"}) is True
    assert _eval_condition("3 > A > 1", {"A": "2"}) is False
    assert _eval_condition("A / 0", {"A": "1"}) is None
    src = "#if (OFF / 2) == -1\nint near;\n#else\nint far;\n#endif\n"
    out = preprocess(src, {"OFF": -3})
    assert "near" in out and "far" not in out


def test_entry_parameter_count_reads_the_entry_signature_only() -> None:
    assert (
        entry_parameter_count("__global__ void k(float* a, const float* __restrict__ b, int n) {}", "k") == 3
    )
    templated = (
        "template <int N, typename T> __global__ void __launch_bounds__(256) k(T* a, std::pair<int,int> p) {}"
    )
    assert entry_parameter_count(templated, "k") == 2
    assert entry_parameter_count('extern "C" __global__ void k(void) {}', "k") == 0
    assert (
        entry_parameter_count("__global__ void k(float* x /* data, in place */, int n // n, m\n) {}", "k")
        == 2
    )
    # Not the entry's definition, or one the preprocessor shapes: no count rather than a wrong one.
    assert entry_parameter_count("__global__ void other(int a) {} void k(int a, int b);", "k") is None
    assert entry_parameter_count("__global__ void k(float* x,\n#if A\n int n\n#endif\n) {}", "k") is None
    assert entry_parameter_count("__global__ void k(float* x, int n", "k") is None


# Crafted sources that made a pattern rescan the rest of the text from every repetition (quadratic, one of them
# exponential): a 75 KB candidate held the server's event loop for 45 s. Each is now read in linear time.
CRAFTED = [
    "/*a",
    "__global__ a ",
    "__shared__ a ",
    "for(i=",
    "int a = ",
    "atomicAdd(",
    "__syncthreads",
    "x[threadIdx.x * ",
    "__global__ void a(){",
    "a",
    ("atomicAdd(x, 1); " * 60 + "for (" * 190)[:1990]
    + "\n",  # an atomic and a for-header per line: 21 s before
]


@pytest.mark.parametrize("unit", CRAFTED)
def test_a_crafted_source_is_read_in_linear_time(unit: str) -> None:
    # A hang guard with a generous bound, not a speed target: 300 KB took minutes to hours before.
    source = unit * (300_000 // len(unit)) + "\n__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n"
    start = time.perf_counter()
    source_features(source, {"A": 1}, "k")
    entry_parameter_count(source, "k")
    strip_comments(source)
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("name", ["__shfl_", "__reduce_"])
def test_a_long_identifier_made_of_intrinsic_names_is_read_in_linear_time(name: str) -> None:
    """`__shfl\\w*\\s*\\(` was tried from every `__shfl` inside one long identifier, each try a scan to its end:
    20 KB of `__shfl_` took 4 s, 60 KB about 40 s, and a 1 MB source (the size a kernel may have) hours."""
    source = (
        name * (60_000 // len(name))
        + "\n__global__ void k(float* x) { x[threadIdx.x] = __shfl_sync(~0u, 1.0f, 0); }\n"
    )
    kernel = Kernel(source=source, entry="k")
    # A hang guard with generous headroom (it takes about 0.2 s), not a speed target.
    assert fastest_s(lambda: kernel_features(kernel, None, lookup("A100")), 5.0) < 5.0
    assert source_features(source, {}, "k").warp_shuffles == 1


def test_nested_kernel_headers_are_matched_in_linear_time() -> None:
    # A hang guard, not a speed target: each kernel's "(" was matched by a scan to its ")" (114 KB: 27 s).
    n = 16_000
    source = "__global__ void f(" * n + ")" * n + "\n__global__ void k(float* x) { x[0] = 1.0f; }\n"
    start = time.perf_counter()
    assert "void k(" in entry_text(source, "k")
    assert entry_parameter_count(source, "k") == 1
    assert time.perf_counter() - start < 10.0


def test_conditions_past_the_per_source_budget_count_both_branches() -> None:
    """Each #if costs an expansion and a parse; 1 MB of them took 43 s. Past MAX_CONDITIONS in one source the
    rest are undecided, as a condition that cannot be evaluated is: both branches kept."""
    block = "#if 0\nDROPPED\n#endif\n"
    text = preprocess(block * MAX_CONDITIONS + "#if 0\nKEPT\n#endif\n", {})
    assert "DROPPED" not in text and "KEPT" in text


def test_a_kernel_name_is_found_however_its_declaration_is_spelled() -> None:
    # The string search that replaced the kernel-name pattern reads the same names.
    spelled = {
        "__global__ void k(int a) {}": 1,
        "__global__\nvoid\n__launch_bounds__(128, 2)\nk (int a, int b) {}": 2,
        'extern "C" __global__ __noinline__ void k(float* __restrict__ x, int n, int m) {}': 3,
        "template <typename T> __global__ void k(T* a, T* b, T* c, T* d) {}": 4,
        "__global__ void (k)(int a) {}": None,  # not a plain name before its "("
        "__global__ void k2(int a) {} __global__ void k(int a, int b) {}": 2,
        "__global__ void " + " " * 500 + "k(int a) {}": None,  # beyond reach of __global__
    }
    for source, count in spelled.items():
        assert entry_parameter_count(source, "k") == count, source


@pytest.mark.anyio
async def test_a_kernel_for_an_architecture_specific_target_gets_its_registers(tmp_path: Path) -> None:
    """wgmma compiles only for sm_90a: the compile dropped the kernel's -arch=sm_90a for plain sm_90 and failed,
    so such kernels (and their cached failure, shared with the plain kernel's key) had no ptxas features."""
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    if "sm_90" not in supported_archs(nvcc):
        pytest.skip("this nvcc does not target sm_90")
    source = (
        '__global__ void k(float* a) { asm volatile("wgmma.fence.sync.aligned;\\n"); a[threadIdx.x] = 1; }\n'
    )
    plain = Kernel(source=source, entry="k")
    assert await ptxas_usage(plain, "sm_90", nvcc, tmp_path) is None  # not for plain sm_90: cached so
    for option in ("-arch=sm_90a", "-gencode=arch=compute_90a,code=sm_90a"):
        usage = await ptxas_usage(
            Kernel(source=source, entry="k", compile_options=[option]), "sm_90", nvcc, tmp_path
        )
        assert usage is not None and usage.for_entry("k") is not None, option


def test_ptxas_compiles_never_read_the_servers_stdin(tmp_path: Path) -> None:
    """On a stdio server, standard input is the client's requests: a compile inherited it, so a source reading
    '/dev/stdin' (through a directive macros write) took them, and its error line showed them."""
    nvcc = _fake_nvcc(
        tmp_path / "nvcc", "release 13.0", 'echo "kernel.cu(1): error: read [$(head -c 40)]"; exit 1'
    )
    script = (
        "import anyio\n"
        "from forecaster_mcp.forecast.ptxas import ptxas_result\n"
        "from forecaster_mcp.models import Kernel\n"
        "k = Kernel(source='__global__ void k() {}', entry='k')\n"
        f"print(anyio.run(ptxas_result, k, 'sm_80', {nvcc!r}, None, 60.0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input='{"jsonrpc": "2.0", "method": "tools/call"}\n',
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "PtxasError" in done.stdout and "read []" in done.stdout, done.stdout + done.stderr
    assert "jsonrpc" not in done.stdout


@pytest.mark.anyio
async def test_a_kernel_ptxas_did_not_compile_is_not_set_beside_anothers_registers(tmp_path: Path) -> None:
    """A CUDA kernel of 255 registers a thread (one block of 256 threads per SM: occupancy 1/8) against its own
    HIP twin, which ptxas does not compile: the twin's occupancy counted no registers (1.0), and the occupancy
    term gave it 0.5 log2 (p_faster 0.66) for being read less. Both are read without ptxas's figures now."""
    from forecaster_mcp.forecast.local import LocalForecaster

    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    cuda = Kernel(source=SMALL, entry="add", launch=launch)
    hip = Kernel(source=SMALL, entry="add", launch=launch, language="hip")
    nvcc = _fake_nvcc(tmp_path / "nvcc", "release 13.0", _ptxas_says(255))
    f = LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=30.0)
    twin, reverse, both_cuda = await f.forecast(
        [
            _pair(cuda, hip, "H100"),
            _pair(hip, cuda, "H100"),
            _pair(cuda, cuda.model_copy(update={"id": "b"}), "H100"),
        ]
    )
    assert twin.extras["mu_log2"] == 0.0 and reverse.extras["mu_log2"] == 0.0
    assert "occupancy" not in twin.rationale and "occupancy" not in reverse.rationale
    # Two compiled kernels still compare their registers (here alike: no term either).
    assert both_cuda.extras["mu_log2"] == 0.0


def test_fp64_costs_as_much_more_as_the_gpu_runs_it_slower() -> None:
    """The fp64 term was 0.1 log2 on every GPU: a kernel accumulating in double against its float twin on an
    RTX 4090 (FP64 at 1/64 of FP32) was judged as on an H100 (1/2). It grows with log2 of the ratio now, and
    stays as it was on the data-centre GPUs the corpus was measured on."""
    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    body = "__global__ void k(const float* x, float* y) { int i = blockIdx.x * blockDim.x + threadIdx.x; "
    single = Kernel(source=body + "float s = x[i]; y[i] = s * s; }", entry="k", launch=launch)
    double = Kernel(source=body + "double s = x[i]; y[i] = s * s; }", entry="k", launch=launch)

    def shift(gpu: str | None) -> float:
        spec = lookup(gpu) if gpu else None
        fs, fd = kernel_features(single, None, spec), kernel_features(double, None, spec)
        return prior_shift(fs, fd, fitted=False).mean_log2

    assert shift("H100") == pytest.approx(-0.1) and shift("MI250X") == pytest.approx(-0.1)
    assert shift(None) == pytest.approx(-0.1)
    assert shift("RTX 4090") == pytest.approx(-0.6) and shift("T4") == pytest.approx(-0.5)
    assert shift("RX 7900 XTX") == pytest.approx(-0.5) and shift("RX 6900 XT") == pytest.approx(-0.4)


def test_tensor_cores_count_only_on_a_gpu_that_has_them() -> None:
    """A wmma kernel against a plain one got +0.35 log2 "tensor cores" on every GPU, also on a GTX 1080 Ti, an
    MI50 or an RDNA2 card, which have no matrix instructions (on Pascal nvcc refuses mma for the architecture)."""
    plain = Kernel(source="__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }", entry="k")
    tensor = Kernel(source="__global__ void k(float* a) { wmma::mma_sync(c, x, y, c); }", entry="k")

    def reasons(gpu: str | None) -> str:
        spec = lookup(gpu) if gpu else None
        return " ".join(
            prior_shift(kernel_features(plain, None, spec), kernel_features(tensor, None, spec)).reasons
        )

    for gpu in ("A100", "RTX 4090", "V100", "MI250X", "RX 7900 XTX", None):
        assert "tensor cores" in reasons(gpu), gpu
    for gpu in ("GTX 1080 Ti", "P100", "MI50", "Radeon PRO W6600"):
        assert "tensor cores" not in reasons(gpu), gpu


@pytest.mark.anyio
async def test_a_compiled_kernel_that_cannot_launch_says_so_beside_one_ptxas_did_not_compile(
    tmp_path: Path,
) -> None:
    """255 registers a thread at 1024 threads leave a kernel no block on an SM: it cannot launch, whatever the
    other kernel's resources. Compared like for like with kernels a crowded call did not compile, that fact was
    dropped with its registers, and the kernel that cannot run was judged as one that does (mu 0, no reason)."""
    from forecaster_mcp.forecast.local import LocalForecaster

    launch = Launch(grid=(4096, 1, 1), block=(1024, 1, 1))
    heavy = Kernel(id="heavy", source=SMALL, entry="add", launch=launch, defines={"BS": 1024})
    nvcc = _fake_nvcc(tmp_path / "nvcc", "release 13.0", _ptxas_says(255))
    f = LocalForecaster(
        None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=30.0, max_ptxas_per_call=1
    )
    await f.forecast([_pair(heavy, heavy.model_copy(update={"id": "same"}), "H100")])  # compiles it alone
    # Two other kernels (their own families) in one call: past the cap, neither is compiled.
    others = [
        Kernel(
            id=f"k{i}", source=SMALL + f"// variant {i}\n", entry="add", launch=launch, defines={"BS": 1024}
        )
        for i in range(2)
    ]
    forward, reverse, _ = await f.forecast(
        [_pair(others[0], heavy, "H100"), _pair(heavy, others[0], "H100"), _pair(heavy, others[1], "H100")]
    )
    assert "candidate cannot launch at this block size" in forward.rationale
    assert forward.extras["mu_log2"] == pytest.approx(-0.6)
    assert "baseline cannot launch at this block size" in reverse.rationale
    assert reverse.extras["mu_log2"] == pytest.approx(0.6)


_WMMA = """#include <mma.h>
using namespace nvcuda;
__global__ void add(half* a, half* b, float* c) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
  wmma::fill_fragment(fc, 0.0f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, b, 16);
  wmma::mma_sync(fc, fa, fb, fc);
  wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
}
"""


@pytest.mark.anyio
async def test_tensor_core_instructions_on_a_gpu_without_them_are_forecast_to_fail(tmp_path: Path) -> None:
    """A wmma kernel cannot compile for a Pascal GPU (CUDA declares wmma from sm_70 on), nor an MFMA builtin for
    an MI50; ptxas, run for a newer stand-in architecture (nvcc 13 starts at sm_75), compiles it, so the pair
    was forecast near 50/50 with no chance of failing. Now its chance of failing is high and the rationale
    leads with why; a source that tests the architecture (a fallback path) is left as it was."""
    from forecaster_mcp.forecast.local import P_FAIL_NO_MATRIX_UNITS, LocalForecaster

    launch = Launch(grid=(1, 1, 1), block=(32, 1, 1))
    plain = Kernel(source=SMALL, entry="add", launch=launch)
    wmma = Kernel(source=_WMMA, entry="add", launch=launch)
    guarded = Kernel(
        source="#if __CUDA_ARCH__ >= 700\n" + _WMMA + "#else\n" + SMALL + "#endif\n",
        entry="add",
        launch=launch,
    )
    mfma_src = (
        "__global__ void add(float* c, float a, float b) {\n"
        "  float4 acc = {0, 0, 0, 0};\n"
        "  acc = __builtin_amdgcn_mfma_f32_4x4x1f32(a, b, acc, 0, 0, 0);\n"
        "  c[threadIdx.x] = acc.x;\n}\n"
    )
    mfma = Kernel(source=mfma_src, entry="add", launch=launch, language="hip")
    hip_plain = Kernel(source=SMALL, entry="add", launch=launch, language="hip")
    nvcc = _fake_nvcc(tmp_path / "nvcc", "release 13.0", "exit 0\n")
    f = LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=30.0)
    pascal, p100, turing, base_pascal, fallback, mi50, mi250x = await f.forecast(
        [
            _pair(plain, wmma, "GTX 1080 Ti"),
            _pair(plain, wmma, "P100"),
            _pair(plain, wmma, "T4"),
            _pair(wmma, plain, "GTX 1080 Ti"),
            _pair(plain, guarded, "GTX 1080 Ti"),
            _pair(hip_plain, mfma, "MI50"),
            _pair(hip_plain, mfma, "MI250X"),
        ]
    )
    assert pascal.extras["p_fail"] == p100.extras["p_fail"] == P_FAIL_NO_MATRIX_UNITS >= 0.9
    assert pascal.rationale.startswith(
        "candidate uses tensor-core instructions (wmma, mma, ldmatrix...), which sm_61 lacks (tensor cores from "
        "sm_70 on): it cannot compile there; if both ran,"
    )
    assert turing.extras["p_fail"] == 0.0 and "cannot compile" not in turing.rationale
    assert (
        base_pascal.extras["p_fail_baseline"] == P_FAIL_NO_MATRIX_UNITS
        and base_pascal.extras["p_fail"] == 0.0
    )
    assert base_pascal.rationale.startswith("baseline uses tensor-core instructions")
    assert fallback.extras["p_fail"] == 0.0 and "cannot compile" not in fallback.rationale
    assert mi50.extras["p_fail"] == P_FAIL_NO_MATRIX_UNITS
    assert mi50.rationale.startswith("candidate uses matrix instructions (MFMA, WMMA), which gfx906 lacks")
    assert mi250x.extras["p_fail"] == 0.0
