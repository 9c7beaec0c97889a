"""Static features of HIP and OpenCL kernels read as those of their CUDA twins, Python ones holding CUDA in their
strings as that CUDA; Triton and other Python sources read only for what they say plainly."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp import Client
from tool_calls import call

from forecaster_mcp.forecast.base import PairQuery
from forecaster_mcp.forecast.features import (
    FITTED_TERMS,
    SourceFeatures,
    StaticFeatures,
    embedded_cuda,
    entry_parameter_count,
    fitted_values,
    kernel_features,
    prior_shift,
    python_source_features,
    source_features,
)
from forecaster_mcp.forecast.local import LocalForecaster
from forecaster_mcp.hardware.specs import lookup
from forecaster_mcp.models import Kernel, Language, Launch, Workload
from forecaster_mcp.server.app import build_server
from forecaster_mcp.service import Service
from forecaster_mcp.settings import Settings

# ---------------------------------------------------------------- twins: (CUDA, HIP, OpenCL) of each kernel

NAIVE_MM = (
    """
__global__ void mm(const float* a, const float* b, float* c, int n) {
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    float acc = 0.0f;
    for (int k = 0; k < n; ++k) acc += a[row * n + k] * b[k * n + col];
    c[row * n + col] = acc;
}
""",
    """
#include <hip/hip_runtime.h>
extern "C" __global__ void mm(const float* a, const float* b, float* c, int n) {
    int row = hipBlockIdx_y * hipBlockDim_y + hipThreadIdx_y;
    int col = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    float acc = 0.0f;
    for (int k = 0; k < n; ++k) acc += a[row * n + k] * b[k * n + col];
    c[row * n + col] = acc;
}
""",
    """
__kernel void mm(__global const float* a, __global const float* b, __global float* c, int n) {
    int row = get_global_id(1);
    int col = get_global_id(0);
    float acc = 0.0f;
    for (int k = 0; k < n; ++k) acc += a[row * n + k] * b[k * n + col];
    c[row * n + col] = acc;
}
""",
)
TILED_MM = (
    """
#define TILE 16
__global__ void mm(const float* __restrict__ a, const float* __restrict__ b, float* c, int n) {
    __shared__ float ta[TILE][TILE];
    __shared__ float tb[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < n / TILE; ++t) {
        ta[threadIdx.y][threadIdx.x] = a[row * n + t * TILE + threadIdx.x];
        tb[threadIdx.y][threadIdx.x] = b[(t * TILE + threadIdx.y) * n + col];
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += ta[threadIdx.y][k] * tb[k][threadIdx.x];
        __syncthreads();
    }
    c[row * n + col] = acc;
}
""",
    """
#include <hip/hip_runtime.h>
#define TILE 16
extern "C" __global__ __launch_bounds__(TILE * TILE)
void mm(const float* __restrict__ a, const float* __restrict__ b, float* c, int n) {
    __shared__ float ta[TILE][TILE];
    __shared__ float tb[TILE][TILE];
    int row = hipBlockIdx_y * TILE + hipThreadIdx_y;
    int col = hipBlockIdx_x * TILE + hipThreadIdx_x;
    float acc = 0.0f;
    for (int t = 0; t < n / TILE; ++t) {
        ta[hipThreadIdx_y][hipThreadIdx_x] = a[row * n + t * TILE + hipThreadIdx_x];
        tb[hipThreadIdx_y][hipThreadIdx_x] = b[(t * TILE + hipThreadIdx_y) * n + col];
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += ta[hipThreadIdx_y][k] * tb[k][hipThreadIdx_x];
        __syncthreads();
    }
    c[row * n + col] = acc;
}
""",
    """
#define TILE 16
__kernel __attribute__((reqd_work_group_size(TILE, TILE, 1)))
void mm(__global const float* restrict a, const __global float* restrict b, __global float* c, int n) {
    __local float ta[TILE][TILE];
    local float tb[TILE][TILE];
    int row = get_group_id(1) * TILE + get_local_id(1);
    int col = get_group_id(0) * TILE + get_local_id(0);
    float acc = 0.0f;
    for (int t = 0; t < n / TILE; ++t) {
        ta[get_local_id(1)][get_local_id(0)] = a[row * n + t * TILE + get_local_id(0)];
        tb[get_local_id(1)][get_local_id(0)] = b[(t * TILE + get_local_id(1)) * n + col];
        barrier(CLK_LOCAL_MEM_FENCE);
        __attribute__((opencl_unroll_hint))
        for (int k = 0; k < TILE; ++k) acc += ta[get_local_id(1)][k] * tb[k][get_local_id(0)];
        work_group_barrier(CLK_LOCAL_MEM_FENCE);
    }
    c[row * n + col] = acc;
}
""",
)
# A sum in which every thread adds its element to the result, and one reduced in registers first.
ATOMIC_SUM = (
    """
__global__ void rsum(const int* x, int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, x[i]);
}
""",
    """
__global__ void rsum(const int* x, int* out, int n) {
    int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (i < n) unsafeAtomicAdd(out, x[i]);
}
""",
    """
__kernel void rsum(__global const int* x, __global int* out, int n) {
    int i = get_global_id(0);
    if (i < n) atom_add(out, x[i]);
}
""",
)
SHUFFLE_SUM = (
    """
__global__ void rsum(const int* x, int* out, int n) {
    int s = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) s += x[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffff, s, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
""",
    """
__global__ void rsum(const int* x, int* out, int n) {
    int s = 0;
    for (int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x; i < n; i += hipBlockDim_x * hipGridDim_x)
        s += x[i];
    for (int o = 32; o > 0; o >>= 1) s += __builtin_amdgcn_ds_swizzle(s, 0x401f);
    if ((hipThreadIdx_x & 63) == 0) atomicAdd(out, s);
}
""",
    """
__kernel void rsum(__global const int* x, __global int* out, int n) {
    int s = 0;
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) s += x[i];
    for (int o = 16; o > 0; o >>= 1) s += sub_group_shuffle_down(s, o);
    if (get_sub_group_local_id() == 0) atomic_add(out, s);
}
""",
)
HIST_GLOBAL = (
    """
__global__ void hist(const int* d, int* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&h[d[i]], 1);
}
""",
    """
__global__ void hist(const int* d, int* h, int n) {
    int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (i < n) atomicAdd(&h[d[i]], 1);
}
""",
    """
__kernel void hist(__global const int* d, __global int* h, int n) {
    int i = get_global_id(0);
    if (i < n) atomic_inc(&h[d[i]]);
}
""",
)
HIST_PRIVATE = (
    """
#define BINS 64
__global__ void hist(const int* d, int* h, int n) {
    __shared__ int sh[BINS];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&sh[d[i]], 1);
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) atomicAdd(&h[b], sh[b]);
}
""",
    """
#define BINS 64
__global__ void hist(const int* d, int* h, int n) {
    __shared__ int sh[BINS];
    int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (i < n) atomicAdd(&sh[d[i]], 1);
    __syncthreads();
    for (int b = hipThreadIdx_x; b < BINS; b += hipBlockDim_x) atomicAdd(&h[b], sh[b]);
}
""",
    """
#define BINS 64
__kernel void hist(__global const int* d, __global int* h, int n, __local int* sh) {
    uint i = get_global_id(0);
    if (i < n) atomic_inc(&sh[d[i]]);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint b = get_local_id(0); b < BINS; b += get_local_size(0)) atomic_add(&h[b], sh[b]);
}
""",
)
ROW_STRIDED = (
    """
__global__ void rows(const float* A, float* y, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < M) { const float* a = A + (size_t)row * N; float s = 0; for (int j = 0; j < N; ++j) s += a[j]; y[row] = s; }
}
""",
    """
__global__ void rows(const float* A, float* y, int M, int N) {
    int row = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (row < M) { const float* a = A + (size_t)row * N; float s = 0; for (int j = 0; j < N; ++j) s += a[j]; y[row] = s; }
}
""",
    """
__kernel void rows(__global const float* A, __global float* y, int M, int N) {
    int row = get_global_id(0);
    if (row < M) { __global const float* a = A + (size_t)row * N; float s = 0; for (int j = 0; j < N; ++j) s += a[j]; y[row] = s; }
}
""",
)
COLUMN_COALESCED = (
    """
__global__ void rows(const float* A, float* y, int M, int N) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col < N) { float s = 0; for (int i = 0; i < M; ++i) s += A[i * N + col]; y[col] = s; }
}
""",
    """
__global__ void rows(const float* A, float* y, int M, int N) {
    int col = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (col < N) { float s = 0; for (int i = 0; i < M; ++i) s += A[i * N + col]; y[col] = s; }
}
""",
    """
__kernel void rows(__global const float* A, __global float* y, int M, int N) {
    int col = get_global_id(0);
    if (col < N) { float s = 0; for (int i = 0; i < M; ++i) s += A[i * N + col]; y[col] = s; }
}
""",
)
SCALE = (
    """
__global__ void scale(const float* a, float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = 2.0f * a[i];
}
""",
    """
__global__ void scale(const float* a, float* b, int n) {
    int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (i < n) b[i] = 2.0f * a[i];
}
""",
    """
__kernel void scale(__global const float* a, __global float* b, int n) {
    int i = get_global_id(0);
    if (i < n) b[i] = 2.0f * a[i];
}
""",
)
SCALE4 = (
    """
__global__ void scale(const float* a, float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n / 4) { float4 v = reinterpret_cast<const float4*>(a)[i]; reinterpret_cast<float4*>(b)[i] = v; }
}
""",
    """
__global__ void scale(const float* a, float* b, int n) {
    int i = hipBlockIdx_x * hipBlockDim_x + hipThreadIdx_x;
    if (i < n / 4) { float4 v = reinterpret_cast<const float4*>(a)[i]; reinterpret_cast<float4*>(b)[i] = v; }
}
""",
    """
__kernel void scale(__global const float* a, __global float* b, int n) {
    int i = get_global_id(0);
    if (i < n / 4) { float4 v = vload4(i, a); vstore4(v, i, b); }
}
""",
)

Dim3 = tuple[int, int, int]
LANGUAGES: tuple[Language, ...] = ("cuda", "hip", "opencl")
# (name, baseline twins, candidate twins, launch of each, the fitted term the candidate changes and its value)
PAIRS = [
    ("shared-memory tiling", NAIVE_MM, TILED_MM, ((64, 64, 1), (16, 16, 1)), "tiling", 1.0),
    ("warp shuffles", ATOMIC_SUM, SHUFFLE_SUM, ((4096, 1, 1), (256, 1, 1)), "warp_shuffles", 1.0),
    ("privatised histogram", HIST_GLOBAL, HIST_PRIVATE, ((4096, 1, 1), (256, 1, 1)), "thread_atomics", -1.0),
    ("coalesced columns", ROW_STRIDED, COLUMN_COALESCED, ((16, 1, 1), (256, 1, 1)), "strided_access", -1.0),
    ("float4 loads", SCALE, SCALE4, ((4096, 1, 1), (256, 1, 1)), "vector_types", 1.0),
]


def _features(source: str, language: Language, entry: str, grid: Dim3, block: Dim3) -> StaticFeatures:
    kernel = Kernel(source=source, entry=entry, language=language, launch=Launch(grid=grid, block=block))
    return kernel_features(kernel, Workload(), lookup("MI300X"))


def _entry(source: str) -> str:
    return source.split("(", 1)[0].split()[-1]


def _counts(f: SourceFeatures) -> SourceFeatures:
    """The counts that describe a kernel: not its length, nor the divisions (the "/" of `#include
    <hip/hip_runtime.h>` counts as one, as in CUDA)."""
    return dataclasses.replace(f, lines=0, divisions=0)


@pytest.mark.parametrize(("name", "baselines", "candidates", "launch", "term", "value"), PAIRS)
def test_hip_and_opencl_twins_get_the_cuda_kernels_features(
    name: str,
    baselines: tuple[str, str, str],
    candidates: tuple[str, str, str],
    launch: tuple[Dim3, Dim3],
    term: str,
    value: float,
) -> None:
    """Each kernel written in HIP or OpenCL reads as its CUDA twin: the same source counts (shared memory,
    barriers, shuffles, atomics, vector types, read-only and unrolled loads, the strided-access and per-element
    atomic passes), hence the same fitted terms against its naive twin. Before, `__local` memory,
    `barrier(...)`, `get_global_id(0)`, hipThreadIdx_x, `sub_group_reduce_add` or `vload4` read as nothing."""
    grid, block = launch
    values = {}
    for language, base, cand in zip(LANGUAGES, baselines, candidates, strict=True):
        fb = _features(base, language, _entry(base), grid, block)
        fc = _features(cand, language, _entry(cand), grid, block)
        values[language] = fitted_values(fb, fc)
        cuda_b = _features(baselines[0], "cuda", _entry(base), grid, block)
        cuda_c = _features(candidates[0], "cuda", _entry(cand), grid, block)
        assert _counts(fb.source) == _counts(cuda_b.source), (name, language, "baseline")
        assert _counts(fc.source) == _counts(cuda_c.source), (name, language, "candidate")
    assert values["hip"] == values["opencl"] == values["cuda"], name
    names = [t for t, _, _ in FITTED_TERMS]
    assert values["cuda"][names.index(term)] == value, name


# ---------------------------------------------------------------- each spelling on its own


def _one(language: Language, body: str, params: str = "const float* x, float* out, int n") -> SourceFeatures:
    qualifier = "__kernel" if language == "opencl" else "__global__"
    return source_features(f"{qualifier} void k({params}) {{\n{body}\n}}\n", {}, "k", language)


@pytest.mark.parametrize(
    ("language", "body", "feature", "count"),
    [
        (
            "hip",
            "typedef hipcub::WarpReduce<float> R; __shared__ typename R::TempStorage t[4];",
            "warp_shuffles",
            1,
        ),
        ("hip", "typedef hipcub::BlockReduce<float, 256> R;", "warp_shuffles", 1),
        ("hip", "int v = __builtin_amdgcn_ds_bpermute(4 * (threadIdx.x ^ 1), 0);", "warp_shuffles", 1),
        ("hip", "int v = __builtin_amdgcn_ds_swizzle(0, 0x041f);", "warp_shuffles", 1),
        ("hip", "int v = __builtin_amdgcn_mov_dpp(0, 0x111, 0xf, 0xf, false);", "warp_shuffles", 1),
        ("hip", "int v = __builtin_amdgcn_update_dpp(0, 1, 0x111, 0xf, 0xf, false);", "warp_shuffles", 1),
        ("hip", "__shfl_down(1.0f, 1);", "warp_shuffles", 1),
        ("hip", "acc = __builtin_amdgcn_mfma_f32_32x32x8f16(a, b, acc, 0, 0, 0);", "tensor_core", 1),
        ("hip", "rocwmma::mma_sync(acc, fa, fb, acc);", "tensor_core", 2),  # as CUDA's wmma::mma_sync
        ("hip", "acc = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(a, b, acc);", "tensor_core", 1),
        ("hip", "__builtin_amdgcn_s_barrier();", "barriers", 1),
        ("hip", "__hip_bfloat162 v;", "vector_types", 1),
        # A CUDA source that happens to spell these is not read as HIP.
        ("cuda", "acc = __builtin_amdgcn_mfma_f32_32x32x8f16(a, b, acc, 0, 0, 0);", "tensor_core", 0),
        ("opencl", "__local float t[64]; t[get_local_id(0)] = 0;", "shared", 1),
        ("opencl", "local float t[64]; t[get_local_id(0)] = 0;", "shared", 1),
        ("opencl", "barrier(CLK_LOCAL_MEM_FENCE);", "barriers", 1),
        ("opencl", "work_group_barrier(CLK_GLOBAL_MEM_FENCE);", "barriers", 1),
        ("opencl", "atomic_inc(out);", "atomics", 1),
        ("opencl", "atom_add(out, 1);", "atomics", 1),
        (
            "opencl",
            "atomic_work_item_fence(CLK_GLOBAL_MEM_FENCE, memory_order_release, memory_scope_device);",
            "atomics",
            0,
        ),
        ("opencl", "float s = sub_group_reduce_add(x[0]);", "warp_shuffles", 1),
        ("opencl", "float s = sub_group_shuffle_xor(x[0], 1);", "warp_shuffles", 1),
        ("opencl", "float s = intel_sub_group_shuffle_down(x[0], x[1], 1);", "warp_shuffles", 1),
        ("opencl", "float4 v = vload4(0, x);", "vector_types", 2),
        ("opencl", "vstore8(v, 0, out);", "vector_types", 1),
        ("opencl", "int16 v; double2 d; half4 h; uint2 u;", "vector_types", 4),
        ("opencl", "float3 v = vload3(0, x);", "vector_types", 0),
        ("opencl", "#pragma unroll\nfor (int i = 0; i < 4; ++i) out[i] = 0;", "unroll_pragmas", 1),
        (
            "opencl",
            "__attribute__((opencl_unroll_hint))\nfor (int i = 0; i < 4; ++i) out[i] = 0;",
            "unroll_pragmas",
            1,
        ),
        (
            "opencl",
            "__attribute__((opencl_unroll_hint(4))) for (int i = 0; i < 8; ++i) out[i] = 0;",
            "unroll_pragmas",
            1,
        ),
        (
            "opencl",
            "__attribute__((opencl_unroll_hint(1))) for (int i = 0; i < 8; ++i) out[i] = 0;",
            "unroll_pragmas",
            0,
        ),
        ("opencl", "event_t e = async_work_group_copy(t, x, 64, 0);", "async_copy", 1),
        ("opencl", "out[0] = native_exp(x[0]) + rsqrt(x[1]);", "transcendentals", 2),
    ],
)
def test_each_dialect_spelling_counts_as_its_cuda_construct(
    language: Language, body: str, feature: str, count: int
) -> None:
    assert getattr(_one(language, body), feature) == count


@pytest.mark.parametrize(
    ("params", "readonly"),
    [
        ("__global const float* restrict x, __global float* out", 1),
        ("const __global float* restrict x, __global float* out", 1),
        ("global const float4* restrict x, global float* out", 1),
        ("__global const float* x, __global float* restrict out", 0),
    ],
)
def test_opencl_restrict_reads_as_cuda_restrict(params: str, readonly: int) -> None:
    assert _one("opencl", "out[0] = x[0];", params).readonly == readonly


def test_dialect_data_flow_passes_read_the_thread_index_however_spelled() -> None:
    # Row-strided through each spelling of the lane index; per-element atomics on a local array are not global.
    spellings: list[tuple[Language, str]] = [
        ("hip", "hipThreadIdx_x"),
        ("hip", "__builtin_amdgcn_workitem_id_x()"),
        ("opencl", "get_local_id(0)"),
        ("opencl", "get_global_id(0)"),
    ]
    for language, index in spellings:
        f = _one(language, f"int r = {index};\nout[r * n] = x[r * n];")
        assert f.strided_access == 2, (language, index)
    f = _one("opencl", "atomic_add(&t[x[get_local_id(0)]], 1);", "__global const int* x, __local int* t")
    assert f.atomics == 1 and f.thread_atomics == 0 and f.shared == 1
    f = _one("opencl", "if (get_local_id(0) == 0) atomic_add(out, 1);", "__global int* out")
    assert f.thread_atomics == 0


def test_entry_is_cut_from_hip_and_opencl_files_of_several_kernels() -> None:
    hip = """
#include <hip/hip_runtime.h>
extern "C" __global__ void naive(int* h, const int* d) { atomicAdd(&h[d[hipThreadIdx_x]], 1); }
extern "C" __global__ __launch_bounds__(256) __attribute__((amdgpu_waves_per_eu(2)))
void fast(float* y, const float* x) {
    __shared__ float t[256]; t[threadIdx.x] = x[threadIdx.x]; __syncthreads(); y[threadIdx.x] = t[0];
}
"""
    opencl = """
__kernel void naive(__global int* h, __global const int* d) { atomic_inc(&h[d[get_global_id(0)]]); }
kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void fast(__global float* y, __global const float* x) {
    local float t[256]; t[get_local_id(0)] = x[get_global_id(0)]; barrier(CLK_LOCAL_MEM_FENCE); y[0] = t[0];
}
"""
    files: list[tuple[Language, str]] = [("hip", hip), ("opencl", opencl)]
    for language, source in files:
        fast = source_features(source, {}, "fast", language)
        naive = source_features(source, {}, "naive", language)
        assert (fast.shared, fast.barriers, fast.atomics, fast.thread_atomics) == (1, 1, 0, 0), language
        assert (naive.shared, naive.barriers, naive.atomics, naive.thread_atomics) == (0, 0, 1, 1), language
    assert entry_parameter_count(hip, "fast") == 2


ARCH_GUARDED_HIP = """
#include <hip/hip_runtime.h>
__global__ void mm(const _Float16* a, float* c) {
#if defined(__gfx90a__) || defined(__gfx942__)
  acc = __builtin_amdgcn_mfma_f32_32x32x8f16(fa, fb, acc, 0, 0, 0);
#elif defined(__HIP_PLATFORM_NVIDIA__) && __CUDA_ARCH__ >= 800
  nvcuda::wmma::mma_sync(acc, fa, fb, acc);
#else
  c[threadIdx.x] = 0.0f;
#endif
}
"""


def test_hip_sources_see_hipccs_own_macros_for_the_gpu() -> None:
    """hipcc defines the architecture (`__gfx942__`) and platform macros: a matrix-core path guarded by them was
    dropped as if compiled for nothing."""

    def tensor(gpu: str | None) -> int:
        kernel = Kernel(source=ARCH_GUARDED_HIP, entry="mm", language="hip")
        return kernel_features(kernel, Workload(), lookup(gpu) if gpu else None).source.tensor_core

    assert tensor("MI300X") == 1 and tensor("MI250X") == 1
    assert tensor("MI100") == 0  # gfx908: the fallback
    assert tensor("A100") >= 1 and tensor("V100") == 0  # HIP on NVIDIA: nvcc's macros
    assert tensor(None) == 0  # neither platform known


def test_opencl_version_conditions_count_both_ways() -> None:
    source = """
__kernel void k(__global int* out) {
#if __OPENCL_C_VERSION__ >= 200
    out[0] = work_group_reduce_add(out[get_local_id(0)]);
#else
    out[0] = 0;
#endif
}
"""
    f = kernel_features(Kernel(source=source, entry="k", language="opencl"), Workload(), lookup("MI300X"))
    assert f.source.warp_shuffles == 1


@pytest.mark.anyio
@pytest.mark.parametrize("hardware", ["MI300X", "H100"])
async def test_compare_kernels_forecasts_every_language_side_by_side(tmp_path: Path, hardware: str) -> None:
    """Through the tool: a CUDA baseline against its HIP and OpenCL twins (the same kernel: the prior says so)
    and a Triton kernel; nothing is compiled but the CUDA source, nothing fails."""
    launch = {"grid": [4096, 1, 1], "block": [256, 1, 1]}
    candidates = [
        {"id": "cuda", "source": HIST_PRIVATE[0], "entry": "hist", "launch": launch},
        {"id": "hip", "source": HIST_PRIVATE[1], "entry": "hist", "language": "hip", "launch": launch},
        {"id": "opencl", "source": HIST_PRIVATE[2], "entry": "hist", "language": "opencl", "launch": launch},
        {"id": "triton", "source": TRITON, "entry": "hist", "language": "triton", "launch": launch},
    ]
    service = await Service.open(Settings.from_env(home=tmp_path, measurer="none"))
    try:
        async with Client(build_server(service)) as client:
            out = await call(client, "compare_kernels", {"candidates": candidates, "hardware": hardware})
    finally:
        await service.close()
    results = {r["id"]: r for r in out["candidates"]}
    for twin in ("hip", "opencl"):
        assert "no informative static difference" in results[twin]["rationale"], results[twin]["rationale"]
        assert abs(results[twin]["p_faster"] - 0.5) < 0.01
    assert "triton source read for tl.dot and fp64 only" in results["triton"]["rationale"]


@pytest.mark.parametrize(
    ("language", "unit"),
    [
        ("opencl", "get_global_id(0) * n\n"),
        ("opencl", "__kernel __attribute__((a(b(\n"),
        ("opencl", "__local float* \n"),
        ("hip", 'extern "C" __global__ __attribute__((x(\n'),
        ("hip", "hipThreadIdx_x * n\n"),
        ("triton", '"""\ntl.dot(((\n'),
        ("triton", "@triton.jit\ndef f(x):\n    return f(x)\n"),
    ],
)
def test_a_crafted_dialect_source_is_read_in_linear_time(language: Language, unit: str) -> None:
    # A hang guard with a generous bound, as test_features' for CUDA (each of these takes about 1 s here).
    source = unit * (300_000 // len(unit)) + "\n__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n"
    start = time.perf_counter()
    source_features(source, {"A": 1}, "k", language)
    source_features(source, {"A": 1}, "f", language)
    assert time.perf_counter() - start < 10.0


@pytest.mark.anyio
async def test_only_cuda_sources_are_given_to_nvcc(tmp_path: Path) -> None:
    """The ptxas features come from nvcc, which takes CUDA only: a HIP, OpenCL, Triton or Python kernel is never
    compiled (nor charged a compile error), a CUDA one is. Nor is the CUDA in a Python kernel's strings: CuPy
    compiles it with NVRTC and torch with its own headers and flags, which this nvcc would not match."""
    log = tmp_path / "compiles.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "release 13.0"; exit 0; }}\necho "$@" >> {log}\nexit 1\n'
    )
    nvcc.chmod(0o755)
    forecaster = LocalForecaster(None, nvcc=str(nvcc), cache_dir=tmp_path / "cache", ptxas_wait_s=30.0)
    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    twins: list[tuple[Language, str]] = [
        ("hip", HIST_PRIVATE[1]),
        ("opencl", HIST_PRIVATE[2]),
        ("triton", TRITON),
        ("python", TRITON),
        ("python", _cupy_raw_kernel(HIST_PRIVATE[0], "hist")),
    ]
    for language, source in twins:
        base = Kernel(source=source, entry="hist", language=language, launch=launch)
        cand = base.model_copy(update={"defines": {"BINS": 32}})
        (fc,) = await forecaster.forecast([PairQuery(base, cand, Workload(), "H100", lookup("H100"))])
        assert "compile_error" not in fc.extras and fc.extras["p_fail"] == 0.0, language
    assert not log.exists()
    cuda = Kernel(source=HIST_PRIVATE[0], entry="hist", launch=launch)
    await forecaster.forecast(
        [
            PairQuery(
                cuda, cuda.model_copy(update={"defines": {"BINS": 32}}), Workload(), "H100", lookup("H100")
            )
        ]
    )
    assert log.exists()


# ---------------------------------------------------------------- Triton and Python

TRITON = '''
import triton
import triton.language as tl


@triton.jit
def _bucket(x):
    """Which bin: // is floor division here, not a comment."""
    return x // 4


@triton.jit
def hist(x_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # if the block is partial, mask it
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # else: nothing to do
    x = tl.load(x_ptr + offs, mask=mask)
    tl.atomic_add(h_ptr + _bucket(x), 1, mask=mask)


@triton.jit
def mm(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + tl.arange(0, BM)[:, None] * K + k + tl.arange(0, BK)[None, :])
        b = tl.load(b_ptr + (k + tl.arange(0, BK))[:, None] * BM + tl.arange(0, BM)[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + tl.arange(0, BM)[:, None] * BM + tl.arange(0, BM)[None, :], acc)
'''


def test_triton_sources_are_read_as_python_for_what_they_say_plainly() -> None:
    """A Triton kernel was read as C: `# if ...` comments as #if directives, `//` (floor division) as a comment,
    the other kernels of its file counted with it, and `tl.atomic_add` on a block of pointers as CUDA's one
    global atomic per element: the prior's largest term (-4 log2), said of a kernel that is not CUDA. Now the
    entry and the helpers it calls are read as Python; the thread-level constructs stay 0 (Triton's compiler
    chooses them); tl.dot counts as tensor cores, except a call asking for IEEE fp32."""
    hist = source_features(TRITON, {}, "hist", "triton")
    mm = source_features(TRITON, {}, "mm", "triton")
    assert (hist.atomics, hist.thread_atomics, hist.tensor_core, hist.loops) == (1, 0, 0, 0)
    assert (mm.atomics, mm.thread_atomics, mm.tensor_core, mm.loops) == (0, 0, 1, 1)
    for f in (hist, mm):
        zero = ("shared", "barriers", "warp_shuffles", "vector_types", "strided_access", "readonly")
        assert all(getattr(f, name) == 0 for name in zero)
    # The helper hist calls is read with it; mm does not call it.
    assert hist.lines > mm.lines - 4 and source_features(TRITON, {}, "_bucket", "triton").atomics == 0
    ieee = TRITON.replace("tl.dot(a, b)", 'tl.dot(a, b, input_precision="ieee")')
    assert source_features(ieee, {}, "mm", "triton").tensor_core == 0
    no_tf32 = TRITON.replace("tl.dot(a, b)", "tl.dot(a, b, allow_tf32=False)")
    assert source_features(no_tf32, {}, "mm", "python").tensor_core == 0
    commented = TRITON.replace("acc += tl.dot(a, b)", "acc += tl.sum(a) # not tl.dot(a, b)")
    assert source_features(commented, {}, "mm", "triton").tensor_core == 0
    # An entry not defined at the top level: the whole file.
    assert source_features(TRITON, {}, "missing", "triton").tensor_core == 1


@pytest.mark.anyio
@pytest.mark.parametrize("language", ["triton", "python"])
async def test_a_python_pair_is_forecast_from_what_its_source_says(language: Language) -> None:
    """compare_kernels' static prior for two Triton kernels: no CUDA term read into them, and the rationale
    says how little of their sources was read. Before: 'one global atomic per element (+)', p_faster 1.00
    for the kernel without tl.atomic_add."""
    launch = Launch(grid=(4096, 1, 1), block=(128, 1, 1))
    atomic = Kernel(id="a", source=TRITON, entry="hist", language=language, launch=launch)
    plain = Kernel(
        id="b",
        source=TRITON.replace("tl.atomic_add(", "tl.store("),
        entry="hist",
        language=language,
        launch=launch,
    )
    workload = Workload(problem={"n": 1 << 20})
    query = PairQuery(atomic, plain, workload, "H100", lookup("H100"))
    (fc,) = await LocalForecaster(None, nvcc="/nonexistent/nvcc").forecast([query])
    assert "atomic" not in fc.rationale
    assert f"{language} source read for tl.dot and fp64 only" in fc.rationale
    assert abs(sum(fc.probs[4:]) - 0.5) < 0.01


# ---------------------------------------------------------------- CUDA in a Python source's strings

# A kernel kept beside the one launched, with every construct the fitted terms read: read with it, it would
# change each pair's terms.
BESIDE = r"""
extern "C" __global__ void beside(const float* x, float* out, int n) {
    __shared__ float t[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float4 v = reinterpret_cast<const float4*>(x)[i];
    t[threadIdx.x] = v.x;
    __syncthreads();
    float s = t[threadIdx.x] + __shfl_down_sync(0xffffffff, v.y, 1);
    atomicAdd(&out[i % 7], s);
    out[i * n] = s;
}
"""


def _cupy_raw_kernel(cuda: str, name: str) -> str:
    return f'''"""A CuPy kernel: this docstring says __global__ but holds none."""
import cupy as cp

_kernel = cp.RawKernel(r\'\'\'{cuda}\'\'\', "{name}")
_beside = cp.RawKernel(r\'\'\'{BESIDE}\'\'\', "beside")  # a twin kept for comparison, never launched by run


def run(*args, grid=(4096,), block=(256,)):
    _kernel(grid, block, args)
'''


def _cupy_raw_module(cuda: str, name: str) -> str:
    # Implicitly concatenated one-line literals, escapes and all, and an f-string without placeholders.
    lines = "\n".join(f"    {line!r}" for line in cuda.splitlines(keepends=True))
    beside = BESIDE.replace("{", "{{").replace("}", "}}")
    return f"""import cupy


class Kernels:
    def __init__(self):
        self.module = cupy.RawModule(code=(
{lines}
        ))
        self.beside = cupy.RawModule(code=f'''{beside}''')

    def forward(self, *args):
        self.module.get_function("{name}")((4096,), (256,), args)
"""


def _torch_load_inline(cuda: str, name: str) -> str:
    del name  # the host wrapper launches it
    return f'''import torch
from torch.utils.cpp_extension import load_inline

CPP = "torch::Tensor launch(torch::Tensor x);"
CUDA = r"""
#include <torch/extension.h>
{cuda}
torch::Tensor launch(torch::Tensor x) {{ return x; }}
"""
BESIDE = r"""{BESIDE}"""
_ext = load_inline(name="ext", cpp_sources=CPP, cuda_sources=CUDA, functions=["launch"])
_beside = load_inline(name="beside", cpp_sources=CPP, cuda_sources=BESIDE, functions=["launch"])


def forward(x):
    return _ext.launch(x)
'''


# (wrapper, the entry given: the Python that launches the kernel, or the kernel itself)
EMBEDDINGS = [
    (_cupy_raw_kernel, "run"),
    (_cupy_raw_kernel, None),
    (_cupy_raw_module, "forward"),
    (_cupy_raw_module, None),
    (_torch_load_inline, "forward"),
]


@pytest.mark.parametrize(("name", "baselines", "candidates", "launch", "term", "value"), PAIRS)
@pytest.mark.parametrize(("wrap", "entry"), EMBEDDINGS)
def test_cuda_in_python_strings_gets_the_cuda_pairs_features(
    name: str,
    baselines: tuple[str, str, str],
    candidates: tuple[str, str, str],
    launch: tuple[Dim3, Dim3],
    term: str,
    value: float,
    wrap: Callable[[str, str], str],
    entry: str | None,
) -> None:
    """A Python kernel launching CUDA C from a string (CuPy's RawKernel or RawModule, torch's load_inline)
    reads as that CUDA: the same counts, fitted terms and prior shift as the plain-CUDA pair, whether the entry
    given is the Python function launching it or the `__global__` kernel, and whatever else the module keeps
    beside it. Before, it was read for tl.dot and fp64 only: every pair had the plain 0.5 prior."""
    grid, block = launch
    spec = lookup("H100")
    cuda_b, cuda_c = baselines[0], candidates[0]

    def features(source: str, language: Language, kernel_entry: str) -> StaticFeatures:
        kernel = Kernel(
            source=source, entry=kernel_entry, language=language, launch=Launch(grid=grid, block=block)
        )
        return kernel_features(kernel, Workload(), spec)

    plain = [features(src, "cuda", _entry(src)) for src in (cuda_b, cuda_c)]
    embedded = [features(wrap(src, _entry(src)), "python", entry or _entry(src)) for src in (cuda_b, cuda_c)]
    for p, e in zip(plain, embedded, strict=True):
        assert e.source.embedded_cuda == 1
        assert _counts(dataclasses.replace(e.source, embedded_cuda=0)) == _counts(p.source), name
    assert fitted_values(*embedded) == fitted_values(*plain)
    assert fitted_values(*plain)[[t for t, _, _ in FITTED_TERMS].index(term)] == value
    assert prior_shift(*embedded) == prior_shift(*plain)


CUPY_SHUFFLE = _cupy_raw_kernel(SHUFFLE_SUM[0], "rsum")


@pytest.mark.parametrize(
    ("source", "entry"),
    [
        (TRITON, "hist"),  # no CUDA at all
        (CUPY_SHUFFLE.replace("def run(*args", "def run(*args,,"), "run"),  # not Python
        ('f"""' + SHUFFLE_SUM[0].replace("16", "{o}") + '"""\n', "rsum"),  # made at run time
        ("# " + SHUFFLE_SUM[0].replace("\n", "\n# ") + "\ndef rsum(x):\n    return x\n", "rsum"),  # comments
        ('"""' + SHUFFLE_SUM[0] + '"""\nimport cupy\n', "rsum"),  # a docstring
        (TRITON + CUPY_SHUFFLE, "hist"),  # a Triton kernel beside a CuPy one it never launches
    ],
)
def test_python_without_cuda_strings_is_read_as_before(source: str, entry: str) -> None:
    """A Python source whose entry reaches no CUDA string (none there, a syntax error, a comment or a docstring
    saying `__global__`, an f-string with placeholders, a CuPy kernel beside a Triton entry) is read as Python,
    as before."""
    read = source_features(source, {}, entry, "python")
    assert read == python_source_features(source, entry)
    assert read.embedded_cuda == 0 and read.warp_shuffles == 0


def test_the_kernel_read_is_the_entrys_else_the_one_launched_else_the_only_one() -> None:
    """Which kernel of a Python source's CUDA is read: the `entry` when it is a kernel there; else the one named
    to RawKernel or get_function by the Python `entry` reaches; else the only one; else all of them."""
    two = r'''
import cupy as cp

SRC = r"""
extern "C" __global__ void a(float* x) { x[threadIdx.x] = __shfl_down_sync(0xffffffff, x[0], 1); }
extern "C" __global__ void b(float* x, int n) { atomicAdd(&x[threadIdx.x % 3], 1.0f); }
"""
mod = cp.RawModule(code=SRC)


def launch_a(x):
    mod.get_function("a")((1,), (32,), (x,))


def launch_both(x, n):
    mod.get_function("a")((1,), (32,), (x,))
    mod.get_function("b")((1,), (32,), (x, n))
'''

    def read(source: str, entry: str) -> str | None:
        found = embedded_cuda(source, entry)
        assert found is not None
        return found.entry

    assert (read(two, "a"), read(two, "b"), read(two, "launch_a"), read(two, "launch_both")) == (
        "a",
        "b",
        "a",
        None,
    )
    both = source_features(two, {}, "launch_both", "python")
    assert (both.warp_shuffles, both.atomics) == (1, 1)
    only_b = source_features(two, {}, "b", "python")
    assert (only_b.warp_shuffles, only_b.atomics) == (0, 1)
    assert read(two.replace('extern "C" __global__ void b', "__device__ void b"), "not_named_here") == "a"


@pytest.mark.anyio
async def test_a_cupy_pair_is_forecast_as_its_cuda_pair() -> None:
    """compare_kernels' static prior for two CuPy kernels, a shuffle reduction against one atomic per element:
    the CUDA pair's p_faster, and the rationale says the CUDA in the strings was read. Before: 0.50, 'python
    source read for tl.dot and fp64 only'."""
    launch = Launch(grid=(4096, 1, 1), block=(256, 1, 1))
    workload = Workload(problem={"n": 1 << 24})
    forecaster = LocalForecaster(None, nvcc="/nonexistent/nvcc")
    p_faster = {}
    for language, wrap in (("cuda", lambda s: s), ("python", lambda s: _cupy_raw_kernel(s, "rsum"))):
        base = Kernel(id="a", source=wrap(ATOMIC_SUM[0]), entry="rsum", language=language, launch=launch)
        cand = Kernel(id="b", source=wrap(SHUFFLE_SUM[0]), entry="rsum", language=language, launch=launch)
        (fc,) = await forecaster.forecast([PairQuery(base, cand, workload, "H100", lookup("H100"))])
        p_faster[language] = sum(fc.probs[4:])
        if language == "python":
            assert "python source read for the CUDA in its string literals" in fc.rationale, fc.rationale
            assert "tl.dot" not in fc.rationale and "warp shuffles (+)" in fc.rationale
    assert p_faster["python"] == pytest.approx(p_faster["cuda"]) and p_faster["cuda"] > 0.95


@pytest.mark.parametrize(
    ("crafted", "parsed"),
    [
        ("x = (" + "1, " * 20_000 + ")\n", True),  # as many nodes as the size parsed allows
        ("x = 1\n" * 10_000, True),  # as many statements
        ('"a"' + ' + "a"' * 10_000 + "\n", False),  # a concatenation nested too deep for the AST
        (
            "def f0(): pass\n" + "".join(f"def f{i}(): f{i - 1}()\n" for i in range(1, 3_000)),
            True,
        ),  # a call chain
        ('k = cp.RawKernel("__global__ void k(){}", "k")\n' * 1_200, True),  # many kernels
        ("x = '\\d'\n" * 6_000, True),  # invalid escapes (a warning each)
        ("(" * 60_000, False),  # nesting beyond the parser's limits
    ],
)
def test_a_crafted_python_source_is_read_in_bounded_time(crafted: str, parsed: bool) -> None:
    """Python's parser reads a source only up to 64 KB that spells `__global__`; syntax and recursion errors mean
    no embedded CUDA; its warnings are not logged; a 1 MB source is read as Python."""
    source = '__global__ = """__global__ void k(float* x) { x[0] = 1; }"""\n' + crafted
    assert len(source) < 64 * 1024
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        for entry in ("k", "f2999", "missing"):
            source_features(source, {}, entry, "python")
        assert (embedded_cuda(source, "k") is not None) == parsed
        huge = source + "x = 1\n" * 200_000
        assert embedded_cuda(huge, "k") is None
        assert source_features(huge, {}, "k", "python") == python_source_features(huge, "k")
    assert time.perf_counter() - start < 10.0
    assert not logged, logged[0]
