"""The launch a kernel's own host code gives it (forecast/host_launch.py), and the static prior that uses it."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import pytest
from timing import fastest_s

from forecaster_mcp.forecast import host_launch
from forecaster_mcp.forecast.base import PairQuery
from forecaster_mcp.forecast.features import device_code_alone, kernel_features
from forecaster_mcp.forecast.host_launch import SourceLaunch, source_launch
from forecaster_mcp.forecast.local import LocalForecaster
from forecaster_mcp.forecast.ptxas import (
    MAX_MISSING_HEADERS,
    PtxasError,
    PtxasUsage,
    compiler_env,
    find_nvcc,
    missing_header,
    ptxas_results,
)
from forecaster_mcp.hardware.specs import lookup
from forecaster_mcp.models import BufferArg, Kernel, Launch, Workload

N = 1 << 24
WL = Workload.model_validate(
    {
        "problem": {"N": N},
        "args": [
            {
                "name": "x",
                "dtype": "float32",
                "shape": [4096, 4096],
                "init": "random_uniform",
                "intent": "in",
            },
            {"name": "n", "dtype": "int32", "value": N},
        ],
    }
)
KERNEL = (
    "__global__ void k(const float* x, float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; }\n"
)


def read(host: str, workload: Workload | None = WL, **kw: object) -> SourceLaunch | None:
    return source_launch(Kernel(source=KERNEL + host, entry="k", **kw), workload)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "grid", "block", "shared"),
    [
        # literals and a ceiling division by the workload's size (problem N, matched ignoring case)
        ("void f(int n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", (65536, 1, 1), (256, 1, 1), 0),
        # const variables, std::min, a stream argument
        (
            "void f(int n) { const int threads = 512; const int blocks = std::min((n + threads - 1) / threads, 4096);"
            " k<<<blocks, threads, 0, stream>>>(0, 0, n); }",
            (4096, 1, 1),
            (512, 1, 1),
            0,
        ),
        # dim3 variables, a #define, sizeof in the dynamic shared memory
        (
            "#define TILE 16\nvoid f() { dim3 block(TILE, TILE); dim3 grid((4096 + TILE - 1) / TILE, 4096 / TILE);"
            " k<<<grid, block, TILE * TILE * sizeof(float)>>>(0, 0, 0); }",
            (256, 256, 1),
            (16, 16, 1),
            1024,
        ),
        # a PyTorch extension: the size from a buffer argument's shape, template arguments on the kernel
        (
            "torch::Tensor forward(torch::Tensor x) { int n = x.numel(); int threads = 128;"
            " k<<<CEIL_DIV(n, threads * 4), dim3(threads)>>>(x.data_ptr<float>(), 0, n); }",
            (32768, 1, 1),
            (128, 1, 1),
            0,
        ),
        (
            "void f() { hipLaunchKernelGGL(k, dim3(100), dim3(64), 0, 0, a, b, c); }",
            (100, 1, 1),
            (64, 1, 1),
            0,
        ),
        # the kernel's defines pick the #if branch of the host code too
        (
            "#if WIDE\n#define B 1024\n#else\n#define B 64\n#endif\nvoid f() { k<<<8, B>>>(0, 0, 0); }",
            (8, 1, 1),
            (64, 1, 1),
            0,
        ),
    ],
)
def test_reads_the_launch_the_host_code_gives(
    host: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int
) -> None:
    assert read(host) == SourceLaunch(grid, block, shared)


@pytest.mark.parametrize(
    "host",
    [
        "void f() { int b = 4; b *= 2; k<<<b, 128>>>(0, 0, 0); }",  # changed in place
        "void f() { k<<<10, 128>>>(0, 0, 0); k<<<20, 128>>>(0, 0, 0); }",  # two launches disagree
        "void f() { int sms; cudaDeviceGetAttribute(&sms, attr, 0); k<<<sms * 4, 128>>>(0, 0, 0); }",  # run time
        "void f(int m) { k<<<(m + 127) / 128, 128>>>(0, 0, 0); }",  # a size the workload does not name
        "void f() { k<<<1 << 70, 128>>>(0, 0, 0); }",  # beyond 64 bits
        "void f(int n) { k<<<n > 10 ? 4 : 8, 128>>>(0, 0, 0); }",  # a ternary
        "void f() { k<<<1.5e3, 128>>>(0, 0, 0); }",  # not a whole number
        "void f() { k<<<(1 << 40), 128>>>(0, 0, 0); }",  # over the grid's limit
    ],
)
def test_a_grid_it_cannot_be_sure_of_is_left_unknown_and_the_block_kept(host: str) -> None:
    assert read(host) == SourceLaunch(None, (128, 1, 1), 0)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        # a dim3's member changed in place: += /= ++
        (
            "void f(int n) { dim3 grid(n / 256); if (n % 256) grid.x += 1; k<<<grid, 256>>>(0, 0, n); }",
            SourceLaunch(None, (256, 1, 1), 0),
        ),
        (
            "void f() { dim3 block(256); block.x /= 2; k<<<64, block>>>(0, 0, 0); }",
            SourceLaunch((64, 1, 1), None, 0),
        ),
        (
            "void f() { dim3 block(256); block.x++; k<<<64, block>>>(0, 0, 0); }",
            SourceLaunch((64, 1, 1), None, 0),
        ),
        # set through its address at run time: the initial value is not the one launched
        (
            "void f() { int bs = 256; int mg = 0; cudaOccupancyMaxPotentialBlockSize(&mg, &bs, k, 0, 0);"
            " k<<<64, bs>>>(0, 0, 0); }",
            SourceLaunch((64, 1, 1), None, 0),
        ),
        (
            'int main() { int n = 1024; scanf("%d", &n); k<<<(n + 255) / 256, 256>>>(0, 0, n); }',
            SourceLaunch(None, (256, 1, 1), 0),
        ),
        (
            "int main() { int n = 1024; std::cin >> n; k<<<(n + 255) / 256, 256>>>(0, 0, n); }",
            SourceLaunch(None, (256, 1, 1), 0),
        ),
        # a member through a pointer is not the variable
        (
            "void f(Opts* o, int threads) { o->threads = 1024; k<<<8, threads>>>(0, 0, 0); }",
            SourceLaunch((8, 1, 1), None, 0),
        ),
        # a binary `&` is no address taken
        (
            "void f() { const int t = 128; int r = 7 & t; k<<<4, t>>>(0, 0, 0); }",
            SourceLaunch((4, 1, 1), (128, 1, 1), 0),
        ),
    ],
)
def test_a_name_changed_at_run_time_is_not_read_at_its_first_value(host: str, expected: SourceLaunch) -> None:
    assert read(host) == expected


@pytest.mark.parametrize(
    ("defines", "block"),
    [
        ("#define B 64\n#undef B\n#define B 1024\n", None),  # defined again after #undef
        ("#if FOO(3)\n#define B 1024\n#else\n#define B 64\n#endif\n", None),  # an #if that cannot be decided
        ("#if CUDART_VERSION >= 11000\n#define B 1024\n#else\n#define B 64\n#endif\n", None),  # toolkit's
        (
            "#ifdef __CUDACC__\n#define B 1024\n#else\n#define B 64\n#endif\n",
            (1024, 1, 1),
        ),  # nvcc's host pass
        (
            "#ifdef __CUDA_ARCH__\n#define B 1024\n#else\n#define B 64\n#endif\n",
            (64, 1, 1),
        ),  # device pass only
        ("#define B 64\n#define B 64\n", (64, 1, 1)),  # the same twice
    ],
)
def test_a_define_the_host_pass_may_see_two_ways_is_not_read(
    defines: str, block: tuple[int, int, int] | None
) -> None:
    assert read(defines + "void f() { k<<<8, B>>>(0, 0, 0); }") == SourceLaunch((8, 1, 1), block, 0)


@pytest.mark.parametrize(
    ("host", "grid"),
    [
        # a main's own test size, not the workload's n = N = 1 << 24: what it launches there is not read
        ("int main() { const int n = 1 << 20; k<<<(n + 255) / 256, 256>>>(0, 0, n); }", None),
        ("#define N (1 << 20)\nint main() { k<<<(N + 255) / 256, 256>>>(0, 0, N); }", None),
        # the same size as the workload's (or from its buffer's shape), read
        ("int main() { const int n = 1 << 24; k<<<(n + 255) / 256, 256>>>(0, 0, n); }", (65536, 1, 1)),
        (
            "void f(torch::Tensor x) { int n = x.numel(); k<<<(n + 255) / 256, 256>>>(0, 0, n); }",
            (65536, 1, 1),
        ),
    ],
)
def test_a_size_the_source_and_the_workload_disagree_on_is_not_read(
    host: str, grid: tuple[int, int, int] | None
) -> None:
    assert read(host) == SourceLaunch(grid, (256, 1, 1), 0)


def test_the_kernels_own_define_is_what_it_is_compiled_with() -> None:
    host = "void f() { k<<<(N + 255) / 256, 256>>>(0, 0, N); }"
    assert read(host, defines={"N": 1 << 20}) == SourceLaunch((4096, 1, 1), (256, 1, 1), 0)


def test_a_hip_launch_of_a_template_split_at_its_comma_is_not_read() -> None:
    host = "void f() { hipLaunchKernelGGL(k<float, 4>, dim3(64), dim3(256), 0, 0, a); }"
    assert read(host) is None  # was block [64, 1, 1]: the grid, read one argument late
    named = "void f() { hipLaunchKernelGGL(HIP_KERNEL_NAME(k<float, 4>), dim3(64), dim3(256), 0, 0, a); }"
    assert read(named) == SourceLaunch((64, 1, 1), (256, 1, 1), 0)


def test_occupancy_is_not_counted_without_the_dynamic_shared_memory_a_kernel_uses() -> None:
    # `tile * sizeof(T)`: not read. The kernel uses dynamic shared memory, so its occupancy is not known; the
    # block and grid still count (total threads).
    kernel = (
        "__global__ void k(const float* x, float* y, int n) { extern __shared__ float tile[]; }\n"
        "template <typename T> void f(int n, int tile) { k<<<(n + 255) / 256, 256, tile * sizeof(T)>>>(0, 0, n); }"
    )
    f = kernel_features(Kernel(source=kernel, entry="k"), WL, lookup("H100"))
    assert (f.threads_per_block, f.blocks, f.dynamic_shared_bytes, f.occupancy) == (256, 65536, None, None)
    plain = kernel.replace("extern __shared__ float tile[];", "")
    assert kernel_features(Kernel(source=plain, entry="k"), WL, lookup("H100")).occupancy is not None


def test_no_launch_or_an_impossible_block_says_nothing() -> None:
    assert read("void f() { other<<<4, 128>>>(0, 0, 0); }") is None  # launches another kernel only
    assert read("void f() { k<<<m, 2048>>>(0, 0, 0); }") is None  # 2048 threads: no GPU runs that block
    assert read("", None) is None
    # A variable assigned two different values is not guessed between (another function's `t` is another
    # variable: test_a_name_is_the_declaration_its_scope_gives).
    assert read("int t = 64;\nvoid f() { t = 128; }\nvoid g() { k<<<4, t>>>(0, 0, 0); }") == SourceLaunch(
        (4, 1, 1), None, 0
    )


def test_a_kernel_sent_with_its_launch_keeps_it_and_python_is_not_read() -> None:
    host = "void f() { k<<<4, 64>>>(0, 0, 0); }"
    given = Kernel(source=KERNEL + host, entry="k", launch=Launch(grid=(8, 1, 1), block=(256, 1, 1)))
    f = kernel_features(given, WL, lookup("H100"))
    assert (f.threads_per_block, f.blocks, f.launch_from_source) == (256, 8, None)
    python = Kernel(source="k<<<4, 64>>>()", entry="k", language="python")
    assert source_launch(python, WL) is None


READ = SourceLaunch((4, 1, 1), (64, 1, 1), 0)


@pytest.mark.parametrize(
    ("junk", "expected"),
    [
        ("a=" * 400_000, READ),  # an assignment scanned to its `;` from every position
        ("dim3 a(" * 120_000, READ),  # declarations whose parentheses never close
        ("hipLaunchKernelGGL(" * 40_000, READ),  # calls that never close
        ("k<<<" * 200_000, None),  # launches that never end: the last ones end at the real launch's `>>>`
        ("a++ " * 200_000, READ),
        (("hipLaunchKernelGGL(k," + "(" * 30) * 15_000, None),  # HIP launches of the entry that never close
    ],
)
def test_hostile_host_code_stays_cheap(junk: str, expected: SourceLaunch | None) -> None:
    # 1 MB of one of these took 2-8 s each before the name lookups were made per name and bounded (0.1-0.4 s).
    started = time.perf_counter()
    found = read((junk + "void f() { k<<<4, 64>>>(0, 0, 0); }")[-1_000_000:])
    assert found == expected
    assert time.perf_counter() - started < 10.0


def test_names_are_worked_out_once_and_launch_sites_are_bounded() -> None:
    # Names defined by names, each three times over: worked out once each, not 3^6 times.
    chain = (
        "".join(f"const int a{i} = a{i + 1} + a{i + 1} + a{i + 1};\n" for i in range(6))
        + "const int a6 = 1;\n"
    )
    assert read(chain + "void f() { k<<<a0, 64>>>(0, 0, 0); }") == SourceLaunch((3**6, 1, 1), (64, 1, 1), 0)
    # Past MAX_SITES launch sites nothing is read.
    assert read("void f() {" + " k<<<4, 64>>>(0, 0, 0);" * 40 + "}") is None


def _pair(host_b: str, host_c: str, launches: bool) -> PairQuery:
    naive = (
        "__global__ void k(const float* x, float* y, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) y[i] = 2.0f * x[i];\n}\n"
    )
    strided = (
        "__global__ void k(const float* x, float* y, int n) {\n"
        "  int base = (blockIdx.x * blockDim.x + threadIdx.x) * 16;\n"
        "  for (int j = 0; j < 16; ++j) if (base + j < n) y[base + j] = 2.0f * x[base + j];\n}\n"
    )
    b_launch = Launch(grid=(N // 256, 1, 1), block=(256, 1, 1)) if launches else None
    c_launch = Launch(grid=(N // 256 // 16, 1, 1), block=(256, 1, 1)) if launches else None
    b = Kernel(id="naive", source=naive + host_b, entry="k", launch=b_launch)
    c = Kernel(id="per16", source=strided + host_c, entry="k", launch=c_launch)
    return PairQuery(b, c, WL, "H100", lookup("H100"))


@pytest.mark.anyio
async def test_the_prior_forecasts_a_source_launched_kernel_as_one_sent_with_that_launch() -> None:
    host_b = "void run(const float* x, float* y, int n) { k<<<(n + 255) / 256, 256>>>(x, y, n); }\n"
    host_c = "void run(const float* x, float* y, int n) { k<<<(n / 16 + 255) / 256, 256>>>(x, y, n); }\n"
    f = LocalForecaster(None, nvcc=None, ptxas_wait_s=0.0)
    [given] = await f.forecast([_pair("", "", launches=True)])
    [read_] = await f.forecast([_pair(host_b, host_c, launches=False)])
    [neither] = await f.forecast([_pair("", "", launches=False)])
    # The work-per-thread term needs both launches: without them the pair is forecast without it.
    assert read_.p_faster == pytest.approx(given.p_faster, abs=1e-9)
    assert read_.extras["mu_log2"] == pytest.approx(given.extras["mu_log2"], abs=1e-9)
    assert neither.extras["mu_log2"] != pytest.approx(given.extras["mu_log2"], abs=1e-3)
    assert "launch read from the source's host code" in read_.rationale
    assert "candidate's grid [4096, 1, 1], block [256, 1, 1]" in read_.rationale
    assert "launch read" not in given.rationale


TORCH_HEAD = "#include <torch/extension.h>\n"
TORCH_NAIVE = (
    TORCH_HEAD
    + """
__global__ void relu(const float* __restrict__ x, float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.f);
}
torch::Tensor forward(torch::Tensor x) {
  auto y = torch::empty_like(x);
  int n = x.numel();
  const int threads = 256;
  relu<<<(n + threads - 1) / threads, threads>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}
"""
)
TORCH_VEC4 = (
    TORCH_HEAD
    + """
__global__ void relu(const float4* __restrict__ x, float4* __restrict__ y, int n4) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n4) { float4 v = x[i]; v.x = fmaxf(v.x, 0.f); v.y = fmaxf(v.y, 0.f);
                v.z = fmaxf(v.z, 0.f); v.w = fmaxf(v.w, 0.f); y[i] = v; }
}
torch::Tensor forward(torch::Tensor x) {
  auto y = torch::empty_like(x);
  int n = x.numel();
  const int threads = 256;
  relu<<<(n / 4 + threads - 1) / threads, threads>>>(
      reinterpret_cast<const float4*>(x.data_ptr<float>()), reinterpret_cast<float4*>(y.data_ptr<float>()), n / 4);
  return y;
}
"""
)


@pytest.mark.anyio
async def test_a_pytorch_extension_is_forecast_not_failed_where_torch_is_not_installed(
    tmp_path: Path,
) -> None:
    """The real nvcc finds no torch/extension.h here. That is no compile error of the kernel's (it was p_fail 0.9
    on both sides, so never `faster` and never in measure_next); its launch comes from its own wrapper."""
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    f = LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "ptxas", ptxas_wait_s=60.0)
    base = Kernel(id="naive", source=TORCH_NAIVE, entry="relu")
    cand = Kernel(id="vec4", source=TORCH_VEC4, entry="relu")
    [out] = await f.forecast([PairQuery(base, cand, WL, "H100", lookup("H100"))])
    assert out.extras["p_fail"] == 0.0 and out.extras["p_fail_baseline"] == 0.0
    assert "compile_error" not in out.extras and "does not compile" not in out.rationale
    assert "this server's nvcc has no torch/extension.h" in out.rationale
    assert "candidate's grid [16384, 1, 1], block [256, 1, 1]" in out.rationale
    assert out.p_faster > 0.5  # vector loads and four elements a thread: the prior's terms, as without torch


def _nvcc() -> str:
    nvcc = find_nvcc(None)
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    return nvcc


async def _compiled(nvcc: str, tmp_path: Path, *kernels: Kernel) -> dict[str, PtxasUsage | PtxasError]:
    found = await ptxas_results({k.id: (k, "sm_90") for k in kernels}, nvcc, tmp_path / "cache", 120.0)
    return {str(key): result for key, result in found.items()}


@pytest.mark.anyio
async def test_a_pytorch_extension_s_device_code_is_compiled_alone_for_its_register_counts(
    tmp_path: Path,
) -> None:
    """Its kernel is plain CUDA: only the wrapper needs torch. Compiled without the headers this nvcc lacks (each
    found by its own compile) and without the host code using them, ptxas gives the kernel's registers, and the
    forecast says how they were had. Before, it was read without register counts."""
    nvcc = _nvcc()
    two_headers = TORCH_NAIVE.replace(
        TORCH_HEAD,
        TORCH_HEAD + "#include <ATen/cuda/CUDAContext.h>  /* stream */\n#include <cuda_runtime.h>\n",
    )
    kernels = [
        Kernel(id="naive", source=two_headers, entry="relu"),
        Kernel(id="vec4", source=TORCH_VEC4, entry="relu"),
    ]
    found = await _compiled(nvcc, tmp_path, *kernels)
    for k in kernels:
        usage = found[str(k.id)]
        assert isinstance(usage, PtxasUsage), usage
        entry = usage.for_entry("relu")
        assert entry is not None and 0 < entry.registers <= 32
    naive, vec4 = (found[str(k.id)] for k in kernels)
    assert isinstance(naive, PtxasUsage) and isinstance(vec4, PtxasUsage)
    assert naive.without_headers == ("ATen/cuda/CUDAContext.h", "torch/extension.h")
    assert vec4.without_headers == ("torch/extension.h",)
    # A restarted server reads the same from the cache.
    again = await _compiled(nvcc, tmp_path, *kernels)
    assert again == found

    f = LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=60.0)
    [out] = await f.forecast([PairQuery(kernels[0], kernels[1], WL, "H100", lookup("H100"))])
    assert out.extras["p_fail"] == 0.0 and out.extras["p_fail_baseline"] == 0.0
    assert out.rationale.endswith(
        "; candidate and baseline: device code compiled here alone, without host code (this server's nvcc has "
        "no ATen/cuda/CUDAContext.h, torch/extension.h)"
    )
    assert "read without register counts" not in out.rationale


@pytest.mark.anyio
async def test_device_code_that_needs_the_missing_header_itself_stays_read_without_register_counts(
    tmp_path: Path,
) -> None:
    """Device code using torch's types, a template instantiated only by the wrapper's AT_DISPATCH, or more
    missing headers than are looked for: the compile alone gives nothing, and the kernel keeps the first missing
    header as its (not failing) compile result, read without registers as before."""
    nvcc = _nvcc()
    typed = TORCH_NAIVE.replace(
        "const float* __restrict__ x, float* __restrict__ y", "const at::Half* x, float* y"
    )
    typed = typed.replace("fmaxf(x[i], 0.f)", "fmaxf(static_cast<float>(x[i]), 0.f)")
    template = (
        TORCH_HEAD
        + """
template <typename scalar_t>
__global__ void relu(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] > 0 ? x[i] : 0;
}
torch::Tensor forward(torch::Tensor x) {
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "relu", ([&] {
    relu<scalar_t><<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.numel());
  }));
  return y;
}
"""
    )
    many = "".join(f"#include <nowhere{i}.h>\n" for i in range(MAX_MISSING_HEADERS + 1)) + TORCH_NAIVE
    kernels = [
        Kernel(id="typed", source=typed, entry="relu"),
        Kernel(id="template", source=template, entry="relu"),
        Kernel(id="many", source=many, entry="relu"),
    ]
    found = await _compiled(nvcc, tmp_path, *kernels)
    for k, first in zip(kernels, ("torch/extension.h", "torch/extension.h", "nowhere0.h"), strict=True):
        error = found[str(k.id)]
        assert isinstance(error, PtxasError) and missing_header(error) == first, (k.id, error)
    f = LocalForecaster(None, nvcc=nvcc, cache_dir=tmp_path / "cache", ptxas_wait_s=60.0)
    [out] = await f.forecast([PairQuery(kernels[0], kernels[1], WL, "H100", lookup("H100"))])
    assert out.extras["p_fail"] == 0.0 and out.extras["p_fail_baseline"] == 0.0
    assert "read without register counts" in out.rationale and "compiled here alone" not in out.rationale


def test_device_code_alone_blanks_only_the_missing_headers_and_cuts_the_host_code() -> None:
    source = (
        '#include <torch/extension.h> // the wrapper\n  #  include "c10/cuda/CUDAGuard.h"\n#include <cuda_fp16.h>\n'
        + TORCH_NAIVE.removeprefix(TORCH_HEAD)
    )
    alone = device_code_alone(source, frozenset({"torch/extension.h", "c10/cuda/CUDAGuard.h"}), "relu")
    assert alone.startswith(" // the wrapper\n\n#include <cuda_fp16.h>\n")
    assert "__global__ void relu" in alone and "forward" not in alone and "torch::" not in alone
    assert device_code_alone(source, frozenset(), "relu").startswith(
        "#include <torch/extension.h> // the wrapper"
    )


KERNEL_WITH_MAIN = """
#include <cstdio>
#define N_ELEMS (1 << 20)
#define DEVICE_INLINE __device__ __forceinline__
const int SCALE = 2;
DEVICE_INLINE float twice(float v) { return SCALE * v; }
__host__ __device__ float half_of(float v) { return 0.5f * v; }
struct Pair { float a, b; __device__ float sum() const { return a + b; } };
namespace util {
void fill(float* h, int n) { for (int i = 0; i < n; ++i) h[i] = i / 3.0f; }
__device__ float id(float v) { return v; }
}
__global__ void k(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = twice(half_of(util::id(x[i])));
}
static double max_error(const float* a, const float* b, int n) {
  double err = 0.0;
  for (int i = 0; i < n; ++i) err = fmax(err, fabs((double)a[i] - (double)b[i]) / 7.0);
  return err;
}
int main() {
  float *h = (float*)malloc(N_ELEMS * sizeof(float));
  util::fill(h, N_ELEMS);
  k<<<N_ELEMS / 256, 256>>>(h, h, N_ELEMS);
  printf("%g\\n", max_error(h, h, N_ELEMS));
  return 0;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &main, "k"); }
"""


def test_host_code_is_not_read_as_the_kernels() -> None:
    """main's double-precision check, its loops and divisions were counted as the kernel's (fp64 on a GeForce
    weighs 6x in the prior); what the kernel uses stays: device functions (one qualified through a macro),
    __host__ __device__ ones, structs, namespaces' device functions, file-scope constants and #defines."""
    from forecaster_mcp.forecast.features import source_features, without_host_code

    kept = without_host_code(KERNEL_WITH_MAIN, "k")
    for gone in ("int main()", "max_error(const", "void fill(", "PYBIND11_MODULE"):
        assert gone not in kept
    for stays in (
        "#define N_ELEMS",
        "const int SCALE = 2;",
        "DEVICE_INLINE float twice",
        "__host__ __device__ float half_of",
        "struct Pair",
        "__device__ float id",
        "__global__ void k(",
    ):
        assert stays in kept
    f = source_features(KERNEL_WITH_MAIN, {}, "k")
    assert f.fp64 == 0 and f.loops == 0 and f.divisions == 0
    assert source_features(KERNEL_WITH_MAIN.replace("int main()", "__device__ int main2()"), {}, "k").fp64 > 0


def test_host_code_cut_leaves_what_it_cannot_read_alone() -> None:
    from forecaster_mcp.forecast.features import without_host_code

    # A kernel qualified through a macro is the entry: never cut, even where __global__ is written elsewhere.
    macro = (
        "#define KERNEL __global__\n__global__ void other() {}\nKERNEL void k(float* y) { y[0] = 1.0 / 3; }\n"
    )
    assert "KERNEL void k" in without_host_code(macro, "k")
    assert (
        without_host_code("void f() { double d = 1; }\n", "f") == "void f() { double d = 1; }\n"
    )  # no kernel
    unbalanced = "__global__ void k() {}\nvoid f() { {\n"
    assert without_host_code(unbalanced, "k") == unbalanced
    many = "__global__ void k() {}\n" + "".join(f"void h{i}() {{ double d = {i}; }}\n" for i in range(300))
    assert without_host_code(many, "k") == many  # past 256 host functions nothing is cut


def test_host_code_cut_keeps_device_code_reached_any_way() -> None:
    """Device functions qualified through a macro are kept however the kernel reaches them: a call chain deeper
    than the rounds once followed (f5 lost its shared memory and shuffle), an operator overload (no name to
    look for), a function pointer and a template argument (named, not called)."""
    from forecaster_mcp.forecast.features import source_features

    main = "int main() { double err = 0.0; return 0; }\n"
    chain = (
        "#define DEV __device__ __forceinline__\n"
        "DEV float f5(float x) { __shared__ float s[32]; return __shfl_down_sync(0xffffffff, x, 1) + s[0]; }\n"
        + "".join(f"DEV float f{i}(float x) {{ return f{i + 1}(x); }}\n" for i in range(4, 0, -1))
        + "__global__ void k(float* x) { x[threadIdx.x] = f1(x[threadIdx.x]); }\n"
    )
    f = source_features(chain + main, {}, "k")
    assert (f.shared, f.warp_shuffles, f.fp64) == (1, 1, 0)
    operator = (
        "#define HD __host__ __device__ __forceinline__\n"
        "HD float4 operator+(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z, (double)a.w); }\n"
        "__global__ void k(float4* x) { x[threadIdx.x] = x[threadIdx.x] + x[0]; }\n"
    )
    f = source_features(operator + main, {}, "k")
    assert f.fp64 == 1 and f.vector_types == 4
    shuffle = "DEV float op(float a) { return __shfl_xor_sync(0xffffffff, a, 1); }\n"
    pointer = (
        "#define DEV __device__\ntypedef float (*op_t)(float);\n" + shuffle + "__device__ op_t p_op = op;\n"
        "__global__ void k(float* x) { x[threadIdx.x] = p_op(x[threadIdx.x]); }\n"
    )
    assert source_features(pointer + main, {}, "k").warp_shuffles == 1
    template = (
        "#define DEV __device__\n" + shuffle + "template <float (*OP)(float)> __device__ float red(float a) "
        "{ return OP(a); }\n__global__ void k(float* x) { x[threadIdx.x] = red<op>(x[threadIdx.x]); }\n"
    )
    assert source_features(template + main, {}, "k").warp_shuffles == 1


def test_host_code_cut_stays_cheap_on_a_crafted_source() -> None:
    from forecaster_mcp.forecast.features import without_host_code

    # 1 MB of device code beside 250 host functions that call each other, the first called from device code:
    # a call search per function over the rest took 17 s; one scan of the rest and of each span kept, 0.6 s.
    # Reached from device code, the whole chain is device code (macro-qualified): all of it is kept.
    dev = (
        "__global__ void k(float* y) { y[0] = 1; }\n" + "__device__ float d(float v) { return v; }\n" * 22_000
    )
    host = "__device__ float z() { return h0(); }\n" + "".join(
        f"void h{i}() {{ h{i + 1}(); }}\n" for i in range(250)
    )
    started = time.perf_counter()
    kept = without_host_code(dev + host, "k")
    assert time.perf_counter() - started < 10.0
    assert "void h0()" in kept and "void h249()" in kept
    alone = without_host_code(dev + host.replace("return h0();", "return 0;"), "k")
    assert "void h0()" not in alone and "void h249()" not in alone


def test_launch_sites_that_are_not_read_count_toward_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each `hipLaunchKernelGGL(k,` looks for its closing parenthesis over 4,000 characters: 1 MB of ones that
    # never close (or have too few arguments) took 2-8 s when only the sites read counted toward MAX_SITES.
    scans = []
    real = host_launch._closing

    def closing(text: str, start: int, limit: int = 4000) -> int | None:
        scans.append(start)
        return real(text, start, limit)

    monkeypatch.setattr(host_launch, "_closing", closing)
    for junk in ("hipLaunchKernelGGL(k," + "(" * 30, "hipLaunchKernelGGL(k, 1, 2)"):
        scans.clear()
        assert read(junk * 15_000 + "void f() { k<<<4, 64>>>(0, 0, 0); }") is None
        assert len(scans) <= host_launch.MAX_SITES
    assert read(" k<<<" * 100_000 + "void f() { k<<<4, 64>>>(0, 0, 0); }") is None


def test_a_parameter_of_the_launching_function_is_its_callers() -> None:
    # main's own `threads` is not the value `launch(512)` passes (it read block 128): the 512 its one call passes.
    shadowed = "void launch(int threads) { k<<<8, threads>>>(0, 0, 0); }\nint main() { int threads = 128; launch(512); }"
    assert read(shadowed) == SourceLaunch((8, 1, 1), (512, 1, 1), 0)
    assert read(shadowed.replace("launch(512)", "launch(threads)")) == SourceLaunch((8, 1, 1), None, 0)
    dims = "void launch(dim3 grid, dim3 block) { k<<<grid, block>>>(0, 0, 0); }\n"
    assert read(dims + "int main() { dim3 grid(4), block(64); launch(grid, block); }") is None
    # A parameter the workload names is the workload's size (main's test size 1 << 20 is not).
    sized = (
        "void run(int n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }\nint main() { int n = 1 << 20; run(n); }"
    )
    assert read(sized) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    assert read(sized, None) == SourceLaunch(None, (256, 1, 1), 0)


LAUNCH = (
    "void launch(const float* x, float* y, int n, int threads = 256) {"
    " k<<<(n + threads - 1) / threads, threads>>>(x, y, n); }\n"
)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        # every caller leaves `threads` out: it is 256 (nothing was read: the block is the grid's divisor)
        (LAUNCH + "int main() { launch(0, 0, 1 << 24); }", SourceLaunch((65536, 1, 1), (256, 1, 1), 0)),
        # the default on the forward declaration only, the definition after the caller
        (
            "void launch(const float*, float*, int, int threads = 256);\n"
            "int main() { launch(0, 0, 1 << 24); }\n" + LAUNCH.replace(" = 256", ""),
            SourceLaunch((65536, 1, 1), (256, 1, 1), 0),
        ),
        # a caller passing it: the caller's value, which is not read
        (LAUNCH + "int main() { launch(0, 0, 1 << 24); launch(0, 0, 1 << 24, 128); }", None),
        # called by none here (a library's entry), or bound to Python, which passes every argument (pybind11 and
        # load_inline's `functions=[...]` do not carry C++ defaults): Python's
        (LAUNCH, None),
        (
            LAUNCH + 'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("launch", &launch); }\n'
            "int main() { launch(0, 0, 1 << 24); }",
            None,
        ),
        # changed in the function itself: not the default any more
        (
            LAUNCH.replace("{ k<<<", "{ if (n < 4096) threads = 64; k<<<")
            + "int main() { launch(0, 0, 1 << 24); }",
            None,
        ),
    ],
)
def test_a_default_every_caller_leaves_out_is_the_parameter_s_value(
    host: str, expected: SourceLaunch | None
) -> None:
    assert read(host) == expected


def test_claude_is_told_where_the_launch_of_a_whole_file_comes_from() -> None:
    from forecaster_mcp.forecast.prompt import build_user_prompt, default_features_fn, features_text

    host = "void run(const float* x, float* y, int n) { k<<<(n + 255) / 256, 256>>>(x, y, n); }\n"
    q = _pair(host, host, launches=False)
    text = build_user_prompt(q, features_text(default_features_fn(), q))
    # It said "derived by the caller from the defines", a tuning loop's case, beside a file that launches it.
    assert "derived by the caller" not in text
    assert (
        "launch: not given; the source's host code launches it (what could be read of it: launch_from_source)"
        in text
    )
    assert "launch_from_source: grid [65536, 1, 1], block [256, 1, 1]" in text
    bare = _pair("", "", launches=False)
    assert "launch: not given (derived by the caller from the defines)" in build_user_prompt(bare)
    # A file that launches another kernel only is not said to launch this one.
    other = _pair("void run() { other<<<4, 64>>>(); }\n", "", launches=False)
    assert build_user_prompt(other).count("launch: not given (derived by the caller from the defines)") == 2


@pytest.mark.parametrize(
    "host",
    [
        # `-> const` read two ways at each repeat (the trailing return type among the repeated qualifiers): 17 s
        "void f()" + " -> const" * 16 + " !{}\n",
        # a name looked for at every letter of a 2,000-letter word: 47 s for 1 MB of these
        ("a" * 1990 + " !(x) {}\n") * 100,
        (("f <" + "a" * 150 + "> ") * 12 + "!(x) {}\n") * 500,  # 3.4 s
        ("namespace " * 199 + "!{}\n") * 500,  # 1.2 s
    ],
)
def test_host_code_cut_has_no_slow_header(host: str) -> None:
    from forecaster_mcp.forecast.features import source_features

    assert fastest_s(lambda: source_features(KERNEL + host, {}, "k"), 2.0) < 2.0


def test_launching_functions_parameters_are_read_cheaply() -> None:
    # The enclosing function's name was looked for at every letter of its header's words: 33 s for a 40 KB one.
    source = "a" * 200_000 + " !(int t) { k<<<3, t>>>(0, 0, 0); }\n"
    assert read(source) == SourceLaunch((3, 1, 1), None, 0)
    # Each run reads afresh, not from source_launch's cache of results.
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(source)), 2.0) < 2.0


def test_a_brace_in_a_string_is_no_structure() -> None:
    from forecaster_mcp.forecast.features import source_features, without_host_code

    src = (
        '__global__ void k(float* y) { if (threadIdx.x == 0) printf("}"); __shared__ float s[32]; y[0] = s[0]; }\n'
        'int main() { double e = 0.0; printf("{%g", e); return 0; }\n'
    )
    kept = without_host_code(src, "k")
    assert "__shared__ float s[32]" in kept and "int main" not in kept
    f = source_features(src, {}, "k")
    assert f.shared == 1 and f.fp64 == 0


@pytest.mark.parametrize(
    ("message", "header"),
    [
        (
            'kernel.cu(1): catastrophic error: cannot open source file "torch/extension.h"',
            "torch/extension.h",
        ),
        ("kernel.cu:1:10: fatal error: torch/extension.h: No such file or directory", "torch/extension.h"),
        ("kernel.cu:2:10: fatal error: 'ATen/ATen.h' file not found", "ATen/ATen.h"),  # nvcc -ccbin clang
        (
            "kernel.cu(3): fatal error C1083: Cannot open include file: 'cutlass/gemm.h': No such file or directory",
            "cutlass/gemm.h",
        ),  # MSVC
        (
            "kernel.cu(3): fatal error C1083: Datei (Include) kann nicht ge\u00f6ffnet werden: 'torch/extension.h': "
            "No such file or directory",
            "torch/extension.h",
        ),  # a German MSVC: read by its number
        ('kernel.cu(5): error: identifier "BROKEN" is undefined', None),
        ("kernel.cu:4:3: error: 'x' file not found in the kernel's own words", None),
    ],
)
def test_missing_headers_are_read_from_each_host_compiler_s_message(message: str, header: str | None) -> None:
    assert missing_header(PtxasError("sm_90", message)) == header


@pytest.mark.parametrize(
    ("message", "header"),
    [
        (
            "kernel.cu(3): fatal error C1083: Impossible d'ouvrir le fichier include : 'torch/extension.h' : "
            "No such file or directory",
            "torch/extension.h",
        ),  # French: the apostrophe of "d'ouvrir" opened the first quoted name
        (
            'kernel.cu(3): fatal error C1083: Datei (Include) kann nicht ge\u00f6ffnet werden: "torch/extension.h": '
            "No such file or directory",
            "torch/extension.h",
        ),  # German: double quotes
        (
            "kernel.cu(3): fatal error C1083: \u65e0\u6cd5\u6253\u5f00\u5305\u62ec\u6587\u4ef6: "
            "\u201ctorch/extension.h\u201d: No such file or directory",
            "torch/extension.h",
        ),  # Chinese: curly quotes
        (
            "kernel.cu(3): fatal error C1083: \u041d\u0435 \u0443\u0434\u0430\u0435\u0442\u0441\u044f "
            "\u043e\u0442\u043a\u0440\u044b\u0442\u044c \u0444\u0430\u0439\u043b \u0432\u043a\u043b\u044e"
            "\u0447\u0435\u043d\u0438\u0435: torch/extension.h: No such file or directory",
            "torch/extension.h",
        ),  # Russian: no quotes
        (
            "kernel.cu(3): fatal error C1083: include \u30d5\u30a1\u30a4\u30eb\u3092\u958b\u3051\u307e\u305b"
            "\u3093\u3002'torch/extension.h':No such file or directory",
            "torch/extension.h",
        ),  # Japanese
    ],
)
def test_a_localised_msvc_s_missing_header_is_read(message: str, header: str) -> None:
    """MSVC's C1083 as its language packs word it (as public build logs show them, the C runtime's 'No such file or
    directory' after the name in English in all of them): the first quoted name after the number was the French
    "ouvrir le fichier include : " (the apostrophe of "d'ouvrir"), and German (double quotes), Chinese (curly
    quotes) and Russian (none) were not read, so the device code was never compiled alone."""
    assert missing_header(PtxasError("sm_90", message)) == header


def test_compiler_messages_are_asked_for_in_english(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcc's messages follow gettext's LANGUAGE: under a German locale its missing header was 'schwerwiegender
    Fehler: ...: Datei oder Verzeichnis nicht gefunden', which missing_header and first_error_line do not read."""
    monkeypatch.setenv("LANGUAGE", "de")
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    env = compiler_env(TMPDIR="/tmp/x")
    assert env["LANGUAGE"] == "en" and env["LC_ALL"] == "de_DE.UTF-8" and env["TMPDIR"] == "/tmp/x"


def test_a_forward_declaration_does_not_keep_its_host_function() -> None:
    """`void launch(...);` above the kernel read as a use of launch: its loop, its division and main's fp64 check
    it calls were counted as the kernel's. Declaration and definition go together; a declared function kept code
    really uses stays, declaration and all."""
    from forecaster_mcp.forecast.features import source_features, without_host_code

    declared = (
        "#include <cstdio>\n"
        "void launch(const float* x, float* y, int n);  // below main's kernel\n"
        "double check(const float* y, int n);\n"
        "int n_blocks(int n) noexcept;\n"
        "__global__ void k(const float* x, float* y, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2.f * x[i];\n}\n"
        'int main() { launch(0, 0, 1 << 20); printf("%g\\n", check(0, 1 << 20)); return 0; }\n'
        "void launch(const float* x, float* y, int n) {\n"
        "  for (int r = 0; r < 10; ++r) k<<<n_blocks(n), 256>>>(x, y, n);\n}\n"
        "double check(const float* y, int n) { double e = 0.0; for (int i = 0; i < n; ++i) e += y[i] / 3.0; "
        "return e; }\n"
        "int n_blocks(int n) noexcept { return (n + 255) / 256; }\n"
    )
    kept = without_host_code(declared, "k")
    for gone in ("launch", "check", "n_blocks", "int main"):
        assert gone not in kept, gone
    assert "__global__ void k(" in kept
    f = source_features(declared, {}, "k")
    assert (f.fp64, f.loops, f.divisions) == (0, 0, 0)
    # A host function a struct the kernel's file keeps calls is used: kept with its declaration.
    used = declared + "struct Runner { void go() { launch(0, 0, 1); } };\n"
    kept = without_host_code(used, "k")
    assert "void launch(const float* x, float* y, int n);" in kept and "for (int r = 0" in kept
    assert "double check(" not in kept
    # An initialised variable and a function pointer are not declarations of the function they name.
    variables = (
        declared + "int blocks = n_blocks(4096);\nvoid (*runner)(const float*, float*, int) = launch;\n"
    )
    kept = without_host_code(variables, "k")
    assert (
        "int n_blocks(int n) noexcept {" in kept and "void launch(const float* x, float* y, int n) {" in kept
    )


def test_a_comment_above_a_host_function_does_not_name_it() -> None:
    """`// host side (the tile)` above `int tile()` named the function `side` (the word before the comment's
    parenthesis): the struct using tile() lost it, and the device code compiled alone (device_code_alone) did
    not compile."""
    from forecaster_mcp.forecast.features import without_host_code

    src = (
        "// host side (the tile)\nconstexpr int tile() { return 32; }\n"
        "struct Shape { int t = tile(); };\n"
        "__global__ void k(float* y) { y[threadIdx.x] = 1.f; }\n"
        "/* main (host) */ int main() { return 0; }\n"
    )
    kept = without_host_code(src, "k")
    assert "constexpr int tile() { return 32; }" in kept and "int main" not in kept


def test_declarations_are_read_cheaply() -> None:
    from forecaster_mcp.forecast.features import source_features

    for junk in (
        ("a" * 1990 + " (x);\n") * 500,
        "f(x) ;" * 150_000,
        ("void g(" + "int, " * 400 + "int);\n") * 500,
        "#define A(x) f(x); g(x); h(x)\n" * 30_000,  # each line's marks: the macro's
        "#;\n" * 330_000,
        "#define A " + "f(x); " * 170_000 + "\n",
    ):
        source = KERNEL + junk + "int main() { return 0; }\n"
        assert fastest_s(lambda text=source: source_features(text, {}, "k"), 5.0) < 5.0


def _load_inline(cuda: str) -> str:
    return (
        "import torch\nfrom torch.utils.cpp_extension import load_inline\n\n"
        f'cuda_source = r"""\n{cuda}\n"""\n'
        'module = load_inline(name="ext", cpp_sources="torch::Tensor forward(torch::Tensor x);", '
        'cuda_sources=cuda_source, functions=["forward"])\n\n'
        "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return module.forward(x)\n"
    )


def inputs(**shapes: list[int]) -> Workload:
    """A workload of float32 input buffers, in the order given."""
    args = [
        {"name": n, "dtype": "float32", "shape": shape, "init": "random_uniform", "intent": "in"}
        for n, shape in shapes.items()
    ]
    return Workload.model_validate({"args": args})


def test_the_launch_of_a_load_inline_kernel_is_read_from_its_cuda_string() -> None:
    """KernelBench's form, which agents write for torch: a Python module whose CUDA string holds the kernel and
    the C++ wrapper launching it. The launch was read only from a CUDA source: the Python twin of a CUDA file
    lost its block size, grid and the work-per-thread term (corpus_lopo --load-inline: accuracy 0.796, ECE
    0.094, 26.8% decided against 0.822, 0.075, 30.9% for the same kernels with their launches; now equal)."""
    wl = inputs(x=[1 << 24])
    for cuda, grid in ((TORCH_NAIVE, 65536), (TORCH_VEC4, 16384)):
        python = Kernel(source=_load_inline(cuda), entry="ModelNew", language="python")
        assert source_launch(python, wl) == SourceLaunch((grid, 1, 1), (256, 1, 1), 0)
        assert host_launch.launches_itself(python)
        f = kernel_features(python, wl, lookup("H100"), None)
        assert (f.threads_per_block, f.blocks) == (256, grid)
        assert f.launch_from_source == f"grid [{grid}, 1, 1], block [256, 1, 1]"
    # CuPy launches from Python (`kernel((grid,), (block,), args)`): read by python_launch (tests/test_python_launch.py).
    cupy = (
        "import cupy as cp\nk = cp.RawKernel(r'''extern \"C\" __global__ void relu(float* x, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = fmaxf(x[i], 0.f); }''', 'relu')\n"
        "def run(x):\n    k(((x.size + 255) // 256,), (256,), (x, x.size))\n"
    )
    python = Kernel(source=cupy, entry="run", language="python")
    assert source_launch(python, wl) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    assert host_launch.launches_itself(python)


def test_a_kernel_with_launch_bounds_in_a_python_string_is_its_entry() -> None:
    """`__global__ void __launch_bounds__(256) k(...)` in a Python source's CUDA was read as a kernel named
    `__launch_bounds__`: its launch was looked for under that name, and the features were the whole text's."""
    from forecaster_mcp.forecast.features import embedded_cuda

    bounded = TORCH_NAIVE.replace("__global__ void relu(", "__global__ void __launch_bounds__(256) relu(")
    embedded = embedded_cuda(_load_inline(bounded), "ModelNew")
    assert embedded is not None and embedded.entry == "relu"
    python = Kernel(source=_load_inline(bounded), entry="ModelNew", language="python")
    assert source_launch(python, WL) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def test_an_include_is_no_division_and_no_line_of_the_kernel() -> None:
    from forecaster_mcp.forecast.features import source_features

    plain = source_features(TORCH_NAIVE.removeprefix(TORCH_HEAD), {}, "relu")
    with_torch = source_features(TORCH_NAIVE + '#include "ATen/cuda/CUDAContext.h"\n', {}, "relu")
    assert with_torch == plain and plain.divisions == 0


def test_a_statement_on_a_macro_line_does_not_start_the_next_function() -> None:
    """The PyTorch tutorial's `#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)`, and a `do { ... }
    while (0)` macro: the rest of the #define line after its `;` or `}` was read as the start of the next
    statement. `torch::Tensor forward(torch::Tensor x);` below it was named `CHECK_CONTIGUOUS` (used by
    CHECK_INPUT: not a declaration of forward, which it then kept, torch and all, in the device code compiled
    alone), and a host function below the do-while macro was named `while` and cut with the macro's ` while (0)`."""
    checks = (
        "#include <torch/extension.h>\n"
        '#define CHECK_CUDA(x) TORCH_CHECK(x.device().is_cuda(), #x " must be a CUDA tensor")\n'
        '#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")\n'
        "#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)\n\n"
        "torch::Tensor forward(torch::Tensor x);\n"
        + TORCH_NAIVE.removeprefix(TORCH_HEAD)
        + 'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }\n'
    )
    alone = device_code_alone(checks, frozenset({"torch/extension.h"}), "relu")
    assert "#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)\n" in alone
    assert "__global__ void relu" in alone and "forward" not in alone and "torch::" not in alone

    from forecaster_mcp.forecast.features import without_host_code

    do_while = (
        "#define SWAP(a, b) do { float t = a; a = b; b = t; } while (0)\n"
        "void launch(float* x) { k<<<1, 1>>>(x, x, 1); }\n"
        + KERNEL.replace("int i =", "float u = x[0], v = y[0]; SWAP(u, v); int i =")
    )
    kept = without_host_code(do_while, "k")
    assert "#define SWAP(a, b) do { float t = a; a = b; b = t; } while (0)\n" in kept
    assert "void launch" not in kept


def test_what_a_kept_declaration_uses_is_kept() -> None:
    """A declaration is no use of the function it declares, but it is of what its default arguments call: a
    kept `void launch(float* x, int n = threads());` lost `threads`, which the declaration kept before."""
    from forecaster_mcp.forecast.features import without_host_code

    src = (
        "int threads() { return 256; }\n"
        "void launch(float* x, int n = threads());\n"
        + KERNEL
        + "struct Runner { void go() { launch(0); } };\n"
        "void launch(float* x, int n) { k<<<1, n>>>(x, x, n); }\n"
        "int main() { return 0; }\n"
    )
    kept = without_host_code(src, "k")
    assert "int threads() { return 256; }" in kept and "int n = threads());" in kept
    assert "int main" not in kept


def test_host_functions_in_an_extern_c_block_are_cut() -> None:
    """Read where string literals are blanked, `extern "C" {` was `extern " " {`: no block to look into, so the
    ctypes wrapper inside it (its loop, its fp64 check) stayed as the kernel's, and a PyTorch extension's
    `extern "C" { void launch(...) }` stayed in the device code compiled alone."""
    from forecaster_mcp.forecast.features import source_features, without_host_code

    for lang in ("C", "C++"):
        src = (
            KERNEL
            + f'extern "{lang}" {{\n'
            + "void launch(const float* x, float* y, int n) { for (int r = 0; r < 10; ++r) "
            "k<<<(n + 255) / 256, 256>>>(x, y, n); }\n"
            "double check(const float* y, int n) { double e = 0.0; for (int i = 0; i < n; ++i) e += y[i] / 3.0; "
            "return e; }\n}\n"
        )
        kept = without_host_code(src, "k")
        assert f'extern "{lang}" {{' in kept and "launch" not in kept and "check" not in kept, lang
        f = source_features(src, {}, "k")
        assert (f.fp64, f.loops, f.divisions) == (0, 0, 0), lang


@pytest.mark.anyio
async def test_device_code_that_found_no_compile_slot_is_compiled_alone_by_a_later_call(
    tmp_path: Path,
) -> None:
    """The compile alone is one more compile, which on a busy server may find no slot within the wait: it says
    nothing of the kernel, as a first compile that found none does not. The key is `unstarted` (so the forecaster
    keeps no features read without register counts for it), not settled as the missing header's."""
    from forecaster_mcp.compile_slots import COMPILE_SLOTS
    from forecaster_mcp.forecast.ptxas import ptxas_result

    nvcc = _nvcc()
    k = Kernel(id="naive", source=TORCH_NAIVE, entry="relu")
    first = await ptxas_result(k, "sm_90", nvcc, tmp_path / "cache", timeout_s=120.0)  # cached: the header's
    assert isinstance(first, PtxasError) and missing_header(first) == "torch/extension.h"
    limit = COMPILE_SLOTS.limit
    COMPILE_SLOTS.set_limit(1)
    try:
        assert await COMPILE_SLOTS.acquire(0)  # another call's compile holds the only slot
        try:
            unstarted: set[str] = set()
            found = await ptxas_results(
                {"naive": (k, "sm_90")}, nvcc, tmp_path / "cache", 0.5, unstarted=unstarted
            )
        finally:
            COMPILE_SLOTS.release()
    finally:
        COMPILE_SLOTS.set_limit(limit)
    assert unstarted == {"naive"}
    assert isinstance(found.get("naive"), PtxasError)  # this call still reads it as not failing
    again = await _compiled(nvcc, tmp_path, k)
    assert isinstance(again["naive"], PtxasUsage) and again["naive"].without_headers == ("torch/extension.h",)


def test_a_wrapper_named_as_its_kernel_is_host_code() -> None:
    """`torch::Tensor relu(torch::Tensor x)` beside `__global__ void relu(...)`: the wrapper was kept as the entry
    (and by the kernel's own name), torch code and all, so the device code compiled alone did not compile. A
    kernel qualified through a macro (`KERNEL void k(`) is still the entry."""
    from forecaster_mcp.forecast.features import device_code_alone, without_host_code

    same = TORCH_NAIVE.replace("torch::Tensor forward(", "torch::Tensor relu(")
    kept = without_host_code(same, "relu")
    assert "__global__ void relu(" in kept and "torch::Tensor relu(" not in kept
    assert "torch::" not in device_code_alone(same, frozenset({"torch/extension.h"}), "relu")
    macro = (
        "#define KERNEL __global__\n__global__ void other() {}\nKERNEL void k(float* y) { y[0] = 1.0 / 3; }\n"
    )
    assert "KERNEL void k" in without_host_code(macro, "k")


def test_a_device_overload_named_as_its_kernel_and_called_by_it_is_kept() -> None:
    """`HD float gelu(float v)` (HD a macro for `__host__ __device__`) called by `__global__ void gelu(...)`: a
    host-looking function named as a plain `__global__` entry was cut as its wrapper, whatever the kernel's body
    said, so the kernel lost its helper (its tanhf: transcendentals 0) and its device code compiled alone called a
    function cut from it (nvcc: 'argument of type "float" is incompatible with parameter of type "const float *"').
    A call of the entry's name outside its own definitions is a use, as any other name's is."""
    from forecaster_mcp.forecast.features import source_features, without_host_code

    helper = "HD inline float gelu(float v) { return 0.5f * v * (1.f + tanhf(0.79788456f * v)); }\n"
    kernel = (
        "__global__ void gelu(const float* x, float* y, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) y[i] = gelu(x[i]);\n}\n"
    )
    wrapper = "int main() { gelu<<<1, 256>>>(nullptr, nullptr, 0); return 0; }\n"
    source = "#define HD __host__ __device__\n" + helper + kernel + wrapper
    kept = without_host_code(source, "gelu")
    assert helper in kept and kernel in kept and "int main" not in kept
    assert source_features(source, {}, "gelu").transcendentals == 1
    # A comment naming the kernel is no call of it: the wrapper of its name is still cut.
    same = TORCH_NAIVE.replace("torch::Tensor forward(", "// relu's wrapper\ntorch::Tensor relu(")
    assert "torch::Tensor relu(" not in without_host_code(same, "relu")


def test_a_wrapper_s_tensors_stand_for_the_workload_s_inputs_in_order() -> None:
    """`torch::Tensor forward(torch::Tensor input)` sized by `input.numel()` beside a workload whose input is `x`:
    only the block was read. A wrapper taking exactly the workload's inputs, none by its name, takes them by
    position (a KernelBench module passes its inputs in order)."""

    def workload(*names: str) -> Workload:
        out = {"name": "out", "dtype": "float32", "shape": [1 << 24], "init": "zeros", "intent": "out"}
        ins = inputs(**{n: [1 << 24] for n in names})
        return ins.model_copy(update={"args": [*ins.args, BufferArg.model_validate(out)]})

    source = TORCH_NAIVE
    for was in ("torch::Tensor x)", "empty_like(x)", "x.numel()", "x.data_ptr"):
        source = source.replace(was, was.replace("x", "input"))
    renamed = Kernel(source=source, entry="relu")
    assert "input.numel()" in renamed.source and "x.numel()" not in renamed.source
    assert source_launch(renamed, workload("x")) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # Two inputs for one tensor, or a tensor that is the workload's by name elsewhere: not by position.
    assert source_launch(renamed, workload("x", "w")) == SourceLaunch(None, (256, 1, 1), 0)
    two = TORCH_NAIVE.replace(
        "torch::Tensor forward(torch::Tensor x)", "torch::Tensor forward(torch::Tensor out)"
    )
    assert source_launch(
        Kernel(source=two.replace("x.numel()", "out.numel()"), entry="relu"), workload("x")
    ) == (
        SourceLaunch((65536, 1, 1), (256, 1, 1), 0)  # `out` by its own name
    )


def test_a_helper_s_tensors_are_its_caller_s_not_the_workload_s_inputs() -> None:
    """A helper launching the kernel, called by the wrapper with other tensors (`launch(c, a)`: the output first),
    took the workload's inputs by position: `out.numel()` read as the first input's, a grid 64 times too small.
    Its tensors are the wrapper's, whatever Python passes."""
    workload = inputs(x=[1024, 64], w=[64, 4096])
    helper = (
        "static void launch(torch::Tensor out, torch::Tensor in) {\n"
        "  int n = out.numel();\n"
        "  k<<<(n + 255) / 256, 256>>>(in.data_ptr<float>(), out.data_ptr<float>(), n);\n"
        "}\n"
    )
    wrapper = (
        "torch::Tensor forward(torch::Tensor a, torch::Tensor b) {\n"
        "  auto c = torch::empty({a.size(0), b.size(1)}, a.options());\n"
        "  launch(c, a);\n  return c;\n}\n"
    )
    kernel = TORCH_HEAD + "__global__ void k(const float* x, float* y, int n) {}\n"
    assert source_launch(Kernel(source=kernel + helper + wrapper, entry="k"), workload) == SourceLaunch(
        None, (256, 1, 1), 0
    )
    # The same function called by none (the one Python calls) takes them by position.
    alone = helper.replace("static void launch", "torch::Tensor forward").replace("}\n", "  return out;\n}\n")
    assert source_launch(Kernel(source=kernel + alone, entry="k"), workload) == SourceLaunch(
        (256, 1, 1), (256, 1, 1), 0
    )


def test_a_wrapper_named_in_its_binding_s_docstring_is_not_called_there() -> None:
    """`m.def("forward", &forward, "relu forward (CUDA)")`: the docstring's `forward (` is no call of the
    wrapper, which still takes the workload's input by position."""
    source = TORCH_NAIVE
    for was in ("torch::Tensor x)", "empty_like(x)", "x.numel()", "x.data_ptr"):
        source = source.replace(was, was.replace("x", "input"))
    bound = source + (
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.def("forward", &forward, "relu forward (CUDA)");\n}\n'
    )
    workload = inputs(x=[1 << 24])
    assert source_launch(Kernel(source=bound, entry="relu"), workload) == SourceLaunch(
        (65536, 1, 1), (256, 1, 1), 0
    )


@pytest.mark.parametrize("tensors", ["std::vector<torch::Tensor> xs", "at::TensorList xs"])
def test_a_wrapper_taking_a_list_of_tensors_takes_none_by_position(tensors: str) -> None:
    """`forward(std::vector<torch::Tensor> xs, torch::Tensor weight)`: the list holds inputs, so the next tensor is
    no input at the next position; `weight` (a module's parameter here) was read as the workload's second input
    (or first, beside an `at::TensorList` not counted)."""
    workload = inputs(x=[1 << 20], y=[1 << 22])
    source = (
        TORCH_HEAD + "__global__ void k(const float* x, float* y, int n) {}\n"
        f"torch::Tensor forward({tensors}, torch::Tensor weight) {{\n"
        "  int n = weight.size(0);\n  auto c = torch::empty({n});\n"
        "  k<<<(n + 255) / 256, 256>>>(xs[0].data_ptr<float>(), c.data_ptr<float>(), n);\n  return c;\n}\n"
    )
    for args in (workload.args, workload.args[:1]):
        assert source_launch(
            Kernel(source=source, entry="k"), workload.model_copy(update={"args": args})
        ) == SourceLaunch(None, (256, 1, 1), 0)


def test_a_tensor_the_wrapper_makes_is_sized_as_it_is_made() -> None:
    """`auto out = torch::empty({16}, x.options())` sized the launch by `out.numel()` from the workload's buffer
    `out` of 4M elements (review finding). A tensor the source makes is not the workload's: one made like another
    (`empty_like(x)`, `zeros_like`, `x.clone()`) has that one's shape, one made otherwise is not read."""
    workload = inputs(x=[1 << 22])
    out = BufferArg.model_validate(
        {"name": "out", "dtype": "float32", "shape": [1 << 22], "init": "zeros", "intent": "out"}
    )
    workload = workload.model_copy(update={"args": [*workload.args, out]})

    def wrapper(made: str) -> Kernel:
        return Kernel(
            source=TORCH_HEAD + "__global__ void k(const float* x, float* y, int n) {}\n"
            "torch::Tensor forward(torch::Tensor x) {\n"
            f"  auto out = {made};\n  int n = out.numel();\n"
            "  k<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);\n  return out;\n}\n",
            entry="k",
        )

    assert source_launch(wrapper("torch::empty({16}, x.options())"), workload) == SourceLaunch(
        None, (256, 1, 1), 0
    )
    for like in ("torch::empty_like(x)", "at::zeros_like(x, x.options())", "x.clone()"):
        assert source_launch(wrapper(like), workload) == SourceLaunch((16384, 1, 1), (256, 1, 1), 0), like
    # Made like a tensor the workload does not size: not read.
    assert source_launch(wrapper("torch::empty_like(w)"), workload) == SourceLaunch(None, (256, 1, 1), 0)


# A load_inline kernel whose block size is a template's placeholder (`{BLOCK}`), as agents write it: C's braces
# doubled for Python's formatting.
TEMPLATED = """
#include <torch/extension.h>
__global__ void relu(const float* x, float* y, int n) {{
    __shared__ float tile[{BLOCK}];
    int i = blockIdx.x * {BLOCK} + threadIdx.x;
    if (i < n) {{ tile[threadIdx.x] = x[i]; y[i] = fmaxf(tile[threadIdx.x], 0.f) + i % 7; }}
}}
torch::Tensor forward(torch::Tensor x) {{
    auto y = torch::empty_like(x);
    int n = x.numel();
    relu<<<(n + {BLOCK} - 1) / {BLOCK}, {BLOCK}>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}}
"""


def _templated(make: str, head: str = "BLOCK = 256\n") -> str:
    """A load_inline module whose CUDA string `cuda_src` is made by `make` (its text as `T` there)."""
    return (
        "import string\nimport torch\nfrom torch.utils.cpp_extension import load_inline\n"
        + head
        + make
        + '\nmod = load_inline(name="ext", cpp_sources="torch::Tensor forward(torch::Tensor x);", '
        'cuda_sources=cuda_src, functions=["forward"])\n\n'
        "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return mod.forward(x)\n"
    )


_UNBRACED = TEMPLATED.replace("{{", "{").replace("}}", "}")
_TEMPLATE_FORMS = {
    "f-string": 'cuda_src = f"""' + TEMPLATED + '"""',
    "format, a literal": 'cuda_src = """' + TEMPLATED + '""".format(BLOCK=256)',
    "format, a constant": 'cuda_src = """' + TEMPLATED + '""".format(BLOCK=BLOCK)',
    "format by position": 'cuda_src = """' + TEMPLATED.replace("{BLOCK}", "{0}") + '""".format(BLOCK)',
    "a named template formatted": 'TEMPLATE = """'
    + TEMPLATED
    + '"""\ncuda_src = TEMPLATE.format(BLOCK=BLOCK)',
    "% formatting": 'cuda_src = """'
    + _UNBRACED.replace("%", "%%").replace("{BLOCK}", "%(BLOCK)d")
    + '""" % {"BLOCK": BLOCK}',
    "string.Template": 'cuda_src = string.Template("""'
    + _UNBRACED.replace("{BLOCK}", "${BLOCK}")
    + '""").substitute(BLOCK=BLOCK)',
    "concatenation": 'cuda_src = """' + _UNBRACED.replace("{BLOCK}", '""" + str(BLOCK) + """') + '"""',
    "replace": 'cuda_src = """'
    + _UNBRACED.replace("{BLOCK}", "BLOCK_SIZE")
    + '""".replace("BLOCK_SIZE", str(BLOCK))',
    "a named template replaced twice": 'TEMPLATE = """'
    + _UNBRACED.replace("{BLOCK}", "BLOCK_SIZE").replace("float", "SCALAR")
    + '"""\ncuda_src = TEMPLATE.replace("SCALAR", "float").replace("BLOCK_SIZE", str(BLOCK))',
}


@pytest.mark.parametrize("form", list(_TEMPLATE_FORMS))
def test_a_cuda_template_of_module_constants_is_read_as_the_cuda_it_makes(form: str) -> None:
    """CUDA in a Python string made from a template whose values are literals or module constants (an f-string, a
    `.format`, `%`, string.Template, `+ str(BLOCK) +`) reads as the CUDA it makes: the same features and launch
    as the string written out. Before, an f-string was read as Python (no launch, no shared memory), `.format`'s
    template was read raw (no launch: `<<<(n + {BLOCK} - 1) / {BLOCK}, {BLOCK}>>>`), `%`'s too (each `%(BLOCK)d`
    a division more), and a concatenation's first piece alone."""
    from forecaster_mcp.forecast.features import source_features

    wl = inputs(x=[1 << 24])
    plain = _templated('cuda_src = r"""' + _UNBRACED.replace("{BLOCK}", "256") + '"""')
    templated = _templated(_TEMPLATE_FORMS[form])
    for source in (plain, templated):
        python = Kernel(source=source, entry="ModelNew", language="python")
        assert source_launch(python, wl) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0), form
    assert source_features(templated, {}, "ModelNew", "python") == source_features(
        plain, {}, "ModelNew", "python"
    )


@pytest.mark.parametrize(
    "make",
    [
        'cuda_src = """' + TEMPLATED.replace("{BLOCK}", "{1}") + '""".format(*SIZES, 256)',
        'cuda_src = """'
        + _UNBRACED.replace("%", "%%").replace("{BLOCK}", "%d")
        + '""" % (*SIZES, 256, 256, 256, 256)',
    ],
    ids=["format", "percent"],
)
def test_a_template_value_after_a_starred_argument_is_not_known(make: str) -> None:
    """`.format(*sizes, 256)` and `% (*sizes, 256)`: which value a position takes depends on how many the starred
    one holds. `{1}` was read as the 256 written second (the grid of a 256-thread block), and the `%d`s after the
    first as the 256s."""
    wl = inputs(x=[1 << 24])
    templated = _templated(make, "SIZES = make_sizes()\n")
    assert source_launch(Kernel(source=templated, entry="ModelNew", language="python"), wl) is None


@pytest.mark.parametrize(
    "form",
    [
        "format, a literal",
        "% formatting",
        "string.Template",
        "f-string",
        "a named template, **values",
        "replace",
    ],
)
def test_a_cuda_template_of_values_known_at_run_time_reads_no_placeholder(form: str) -> None:
    """A template's value known only at run time (`BLOCK = int(os.environ.get(...))`) is not read: no launch of
    it, and the template's own `{BLOCK}`, `{{`, `%(BLOCK)d` or `%%` are not read as the kernel's code. Before, a
    `%` template's `%(BLOCK)d` and `%%` each read as a division. An f-string is not read as CUDA (as before)."""
    from forecaster_mcp.forecast.features import python_source_features, source_features

    head = "import os\nBLOCK = int(os.environ.get('BLOCK', 256))\n"
    forms = {
        **_TEMPLATE_FORMS,
        "a named template, **values": 'TEMPLATE = """' + TEMPLATED + '"""\n'
        'cuda_src = TEMPLATE.format(**{"BLOCK": BLOCK})',
    }
    make = forms[form].replace("format(BLOCK=256)", "format(BLOCK=BLOCK)")
    templated = _templated(make, head)
    plain = _templated('cuda_src = r"""' + _UNBRACED.replace("{BLOCK}", "256") + '"""', head)
    python = Kernel(source=templated, entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) is None
    read = source_features(templated, {}, "ModelNew", "python")
    if form == "f-string":
        assert read == python_source_features(templated, "ModelNew")
        return
    expected = source_features(plain, {}, "ModelNew", "python")
    assert (read.divisions, read.shared, read.lines, read.embedded_cuda) == (
        expected.divisions,
        expected.shared,
        expected.lines,
        1,
    )


@pytest.mark.parametrize(
    "fill",
    [
        'f"__global__ void k() {{}}' + "{A}" * 9_000 + '"',
        '"__global__ void k() {{}}' + "{A}" * 9_000 + '".format(A=A)',
        '"__global__ void k() {}' + "%(A)s" * 6_000 + '" % {"A": A}',
        '"__global__ void k() {}' + "Z" * 9_000 + '".replace("Z", A)',
        '"__global__ void k() {}' + "Z" * 9_000 + '".replace("Z", A).replace("x", A)',
    ],
)
def test_a_template_filled_past_any_kernel_s_size_is_not_read(fill: str) -> None:
    """A 64 KB source filling a template with thousands of copies of a 30 KB constant would make a string of
    hundreds of MB: a template's text is read only up to four times the largest source parsed."""
    from forecaster_mcp.forecast.features import embedded_cuda

    source = 'A = "' + "x" * 30_000 + '"\nsrc = ' + fill + "\n"
    assert fastest_s(lambda: embedded_cuda(source, "k"), 2.0) < 2.0  # nothing kept between runs
    found = embedded_cuda(source, "k")
    assert found is None or len(found.text) <= 4 * 64 * 1024


def test_many_templates_filled_in_one_module_are_read_within_one_bound() -> None:
    """Each filled template was bounded on its own: a 62 KB source of 550 f-strings, each eight copies of a 30 KB
    constant after a `__global__`, made 130 MB of CUDA and took 8 s to read. The strings of one module
    are made up to the bound in all."""
    from forecaster_mcp.forecast.features import embedded_cuda

    lines = ['C = "' + "a" * 30_000 + '"']
    lines += [f'k{i} = f"__global__ void k{i}() {{{{}}}}' + "{C}" * 8 + '"' for i in range(550)]
    source = "\n".join(lines) + "\n"
    assert len(source) < 64 * 1024
    assert fastest_s(lambda: embedded_cuda(source, None), 2.0) < 2.0


@pytest.mark.parametrize(
    "fill",
    [
        'f"__global__ void k(int* x) {{ x[0] = {B}; }}"',
        '"__global__ void k(int* x) {{ x[0] = {B}; }}".format(B=B)',
        '"__global__ void k(int* x) { x[0] = %d; }" % B',
        '"__global__ void k(int* x) { x[0] = " + str(B) + "; }"',
    ],
)
def test_a_template_filled_with_a_huge_hexadecimal_constant_is_not_an_error(fill: str) -> None:
    """`B = 0xfff...` of 5,000 digits is a valid literal, but `str()` of it raised ValueError (past Python's 4,300
    digits of integer string conversion) out of the source's reading: such a value is not read."""
    from forecaster_mcp.forecast.features import embedded_cuda

    source = "B = 0x" + "f" * 5_000 + "\nsrc = " + fill + "\n"
    found = embedded_cuda(source, "k")
    assert found is None or "fff" not in found.text


@pytest.mark.parametrize(
    "condition",
    ["#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800", "#if (BLOCK > 128)", "#ifdef USE_BOUNDS"],
)
def test_a_directive_between_a_kernel_s_qualifier_and_its_name_is_not_its_name(condition: str) -> None:
    """`__global__ void` then `#if defined(...)` / `__launch_bounds__(...)` / `#endif` then the name: the
    directive's `defined(` was read as the kernel's parameter list, the kernel named `defined` (`#if (BLOCK > 128)`:
    `if`). In a Python string the entry was then no kernel there: the naive kernel beside it counted in the
    features (its atomics), and the launch was not read."""
    from forecaster_mcp.forecast.features import embedded_cuda, entry_text, source_features

    naive = "__global__ void naive(float* x, int n) { int i = threadIdx.x; if (i < n) atomicAdd(x, x[i]); }\n"
    fast = (
        f"template <int BLOCK>\n__global__ void\n{condition}\n__launch_bounds__(BLOCK, 2)\n#endif\n"
        "fast(const float* x, float* y, int n) { int i = blockIdx.x * BLOCK + threadIdx.x; if (i < n) y[i] = x[i]; }\n"
        "torch::Tensor forward(torch::Tensor x) { auto y = torch::empty_like(x); int n = x.numel();\n"
        "  fast<256><<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n); return y; }\n"
    )
    assert "naive" not in entry_text(naive + fast, "fast")
    source = _load_inline(naive + fast)
    embedded = embedded_cuda(source, "ModelNew")
    assert embedded is not None and embedded.entry == "fast"
    assert source_features(source, {}, "ModelNew", "python").atomics == 0
    python = Kernel(source=source, entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    "caller",
    [
        "int main() { Op op; op.launch(1 << 24, 1024); op.run(1 << 24); }",
        "int main() { Op* op = new Op(); op->launch(1 << 24, 1024); op->run(1 << 24); }",
        "void Op::go(int n) { this->launch(n, 1024); }",
    ],
)
def test_a_method_s_default_counts_its_calls_through_an_object(caller: str) -> None:
    """A method defined outside its class (the class in a header not sent) called `op.launch(n, 1024)` passes
    `threads`: its default is not the launch's, though its own class's call (`launch(n)`) leaves it out."""
    host = (
        '#include "op.h"\n'
        "void Op::launch(int n, int threads = 256) { k<<<(n + threads - 1) / threads, threads>>>(0, 0, n); }\n"
        "void Op::run(int n) { launch(n); }\n"
    )
    assert read(host + "int main() { Op op; op.run(1 << 24); }", None) == SourceLaunch(None, (256, 1, 1), 0)
    assert read(host + caller, None) is None


def test_a_default_of_a_function_python_binds_is_python_s() -> None:
    """load_inline's `functions=[...]` binds each function named to Python, which passes every argument: a
    default the wrapper's own call leaves out is not the launch where Python calls `launch` itself."""
    cuda = (
        TORCH_HEAD + "__global__ void k(const float* x, float* y, int n) {}\n"
        "void launch(const float* x, float* y, int n, int threads = 256) {\n"
        "  k<<<(n + threads - 1) / threads, threads>>>(x, y, n);\n}\n"
        "torch::Tensor forward(torch::Tensor x) {\n  auto y = torch::empty_like(x);\n"
        "  launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());\n  return y;\n}\n"
    )
    wl = inputs(x=[1 << 24])
    source = _load_inline(cuda)
    wrapped = Kernel(source=source, entry="ModelNew", language="python")
    assert source_launch(wrapped, wl) == SourceLaunch(None, (256, 1, 1), 0)
    bound = source.replace('functions=["forward"]', 'functions=["forward", "launch"]')
    assert source_launch(Kernel(source=bound, entry="ModelNew", language="python"), wl) is None


def sized(**problem: int) -> Workload:
    return Workload.model_validate({"problem": problem})


BIG = inputs(x=[3_000_000_000])  # 3e9 elements: past int's 2^31 - 1
FORWARD = "torch::Tensor forward(torch::Tensor x) {{ {n} k<<<(n + 255) / 256, 256>>>(0, 0, n); return x; }}"
MN = "void f() {{ int M = 65536; int N = 65536; {total} k<<<total / 256, 256>>>(0, 0, 0); }}"


@pytest.mark.parametrize(
    ("host", "workload", "grid"),
    [
        # `1 << 31` is an int: past its range (negative since C++20, undefined before), not 2^31
        ("void f() { int blocks = (1 << 31) / 1024; k<<<blocks, 256>>>(0, 0, 0); }", None, None),
        ("void f() { k<<<(1 << 31) / 1024, 256>>>(0, 0, 0); }", None, None),
        ("void f() { k<<<(1u << 31) / 1024, 256>>>(0, 0, 0); }", None, 2097152),
        ("void f() { size_t blocks = (1ull << 31) / 1024; k<<<blocks, 256>>>(0, 0, 0); }", None, 2097152),
        # an int holding a 3e9-element tensor's numel wraps; 64-bit ones hold it
        (FORWARD.format(n="int n = x.numel();"), BIG, None),
        (FORWARD.format(n="const int32_t n = x.numel();"), BIG, None),
        (FORWARD.format(n="int64_t n = x.numel();"), BIG, 11718750),
        (FORWARD.format(n="auto n = x.numel();"), BIG, 11718750),
        (FORWARD.format(n="size_t n = x.size(0);"), BIG, 11718750),
        # int * int overflows in int, stored where it may be: the product is int's
        (MN.format(total="int total = M * N;"), None, None),
        (MN.format(total="size_t total = M * N;"), None, None),
        (MN.format(total="size_t total = (size_t)M * N;"), None, 16777216),
        (MN.format(total="int64_t total = static_cast<int64_t>(M) * N;"), None, 16777216),
        (MN.format(total="long long total = 1LL * M * N;"), None, 16777216),
        # an int parameter the workload sizes past int's range; a 64-bit one holds it
        ("void f(int n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", sized(n=3_000_000_000), None),
        ("void f(long long n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", sized(n=3_000_000_000), 11718750),
        # `n + 255` in int overflows for n near 2^31, before the division
        ("void f(int n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", sized(n=2**31 - 100), None),
        ("void f(int n) { k<<<n / 256 + 1, 256>>>(0, 0, n); }", sized(n=2**31 - 100), 8388608),
        ("void f(int n) { k<<<(int)((n + 255LL) / 256), 256>>>(0, 0, n); }", sized(n=2**31 - 100), 8388608),
        # casts nest, each read in its turn
        ("void f() { k<<<" + "(int)" * 75 + "4, 256>>>(0, 0, 0); }", None, 4),
        # unsigned arithmetic wraps, as C++ defines: 0u - 1 is 2^32 - 1 (C division read as 0)
        ("void f() { unsigned n = 0; k<<<(n - 1) / 256 + 1, 256>>>(0, 0, 0); }", None, 16777216),
        ("void f() { unsigned n = 3000000000u; k<<<n / 256, 256>>>(0, 0, 0); }", None, 11718750),
    ],
)
def test_launch_arithmetic_is_done_in_the_source_s_integer_types(
    host: str, workload: Workload | None, grid: int | None
) -> None:
    """`int` is 32 bits: a value past its range in a launch expression (an int name given one, an int product, an
    int parameter the workload sizes so) is undefined in C++ (or wraps negative), not the large grid it read as."""
    expected = (grid, 1, 1) if grid is not None else None
    assert read(host, workload) == SourceLaunch(expected, (256, 1, 1), 0)


def test_c_expressions_python_cannot_read_warn_nothing() -> None:
    # Launch sizes and #if conditions are read through Python's parser: `256and` (a digit run against a keyword)
    # made it print "SyntaxWarning: invalid decimal literal" to the server's stderr for each such source.
    from forecaster_mcp.forecast.features import source_features

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read("void f(int n) { k<<<(n + 255) / 256and, 256>>>(0, 0, n); }") == SourceLaunch(
            None, (256, 1, 1), 0
        )
        source_features("#if 1and\n#endif\n" + KERNEL, {}, "k")
    assert [str(w.message) for w in caught] == []


def test_the_defaults_of_many_launching_functions_are_read_cheaply() -> None:
    """Each call of a launching function was placed among the host functions by walking them all: 32 defaulted
    launchers called 63 times each after 80,000 small functions (1 MB) took 10 s."""
    launchers = "".join(
        f"void l{i}(int n, int t{i} = 256) {{ k<<<(n + t{i} - 1) / t{i}, t{i}>>>(0, 0, n); }}\n"
        for i in range(32)
    )
    call_each = " ".join(f"l{i}(1);" for i in range(32))
    calls = "".join(f"void c{j}() {{ {call_each} }}\n" for j in range(63))
    source = "void z() {}\n" * 80_000 + launchers + calls
    # n: the 1 every call passes
    assert read(source, None) == SourceLaunch((1, 1, 1), (256, 1, 1), 0)
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(source, None)), 2.0) < 2.0


U16 = "void f() {{ {decl} k<<<{grid}, 256>>>(0, 0, 0); }}"


@pytest.mark.parametrize(
    ("host", "workload", "grid"),
    [
        # narrow integer types hold what they can: a short past its range is unknown, a uint16_t wraps
        (U16.format(decl="short b = 40000;", grid="b"), None, None),
        (U16.format(decl="uint16_t b = 70000;", grid="b"), None, 4464),
        (U16.format(decl="unsigned short b = 70000;", grid="b"), None, 4464),
        (U16.format(decl="", grid="(short)70000"), None, None),
        (U16.format(decl="", grid="static_cast<uint16_t>(70000)"), None, 4464),
        # and are promoted to int: 65535 * 65535 overflows int; 256 * 256 is 65536, not 0
        (U16.format(decl="uint16_t a = 65535;", grid="a * a / 65536"), None, None),
        (U16.format(decl="unsigned short a = 256;", grid="a * a / 256"), None, 256),
        # a char's sign is the platform's, a bool is 0 or 1, a float divides as floats: none read as integers
        (U16.format(decl="char c = 200;", grid="c"), None, None),
        (U16.format(decl="bool b = 5;", grid="b"), None, None),
        (U16.format(decl="", grid="static_cast<float>(1000) / 256 * 2"), None, None),
        (U16.format(decl="int b = static_cast<double>(1000) / 256 * 1000;", grid="b"), None, None),
        # a type the source names (`using`, `typedef`) is that type; one not read is unknown, not 64 bits
        ("using idx_t = int;\n" + FORWARD.format(n="idx_t n = x.numel();"), BIG, None),
        ("typedef int idx_t;\n" + FORWARD.format(n="const idx_t n = x.numel();"), BIG, None),
        ("typedef int64_t idx_t;\n" + FORWARD.format(n="idx_t n = x.numel();"), BIG, 11718750),
        (FORWARD.format(n="index_t n = x.numel();"), BIG, None),
        (
            "using idx_t = int;\nvoid f(idx_t n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }",
            sized(n=3 * 10**9),
            None,
        ),
        (
            "using idx_t = long;\nvoid f(idx_t n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }",
            sized(n=3 * 10**9),
            11718750,
        ),
        ("void f(index_t n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", sized(n=3 * 10**9), None),
        ("void f(const int& n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }", sized(n=3 * 10**9), None),
        # still read: auto, a dim3 assigned a number, an int reference that holds the size
        (FORWARD.format(n="const auto n = x.numel();"), BIG, 11718750),
        (
            "void f(const int& n) { dim3 g = (n + 255) / 256; k<<<g, 256>>>(0, 0, n); }",
            sized(n=1 << 24),
            65536,
        ),
    ],
)
def test_a_type_the_evaluator_does_not_read_is_not_taken_for_another(
    host: str, workload: Workload | None, grid: int | None
) -> None:
    """e7a7a64 read a declaration or cast of a type it does not know (`short`, `uint16_t`, `char`, `bool`,
    `float`, an alias) as its value's type, or dropped the cast: `uint16_t b = 70000` launched 70000 blocks, not
    4464; `idx_t n = x.numel()` of 3e9 elements with `using idx_t = int;` read as the 3e9 an int cannot hold."""
    expected = (grid, 1, 1) if grid is not None else None
    assert read(host, workload) == SourceLaunch(expected, (256, 1, 1), 0)


def _many_names(small_functions: int) -> str:
    """32 launchers reading the same 60 names, each name declared 60 times, then `small_functions` empty functions."""
    names = [f"a{i}" for i in range(60)]
    expr = " + ".join(names)
    launchers = "".join(f"void l{j}(int p{j}) {{ k<<<{expr}, 256>>>(0, 0, p{j}); }}\n" for j in range(32))
    return launchers + "".join(f"int {n} = 1;\n" * 60 for n in names) + "void z() {}\n" * small_functions


def test_the_names_of_many_launching_functions_are_looked_up_once() -> None:
    """Each launching function's names were looked up afresh (a scan of the text each, several patterns): 32
    launchers reading the same 60 names, each declared 60 times, before 70,000 small functions (0.9 MB) took
    350 s. They are looked up once a source, as MAX_NAMES counts them: 0.9 s for this 0.12 MB one (2.1 s with
    20,000 small functions, too near the limit on a busy machine)."""
    source = _many_names(small_functions=5_000)
    assert read(source, None) == SourceLaunch((60, 1, 1), (256, 1, 1), 0)
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(source, None)), 2.0) < 2.0


def test_a_name_is_looked_up_where_it_stands_not_at_every_character() -> None:
    """Of each name, the patterns of its changes (`_CHANGED`), dim3 and other declarations were scanned for at
    every character of the text (none starts with letters to look for): 32 launchers reading 60 names, each
    declared 60 times, before 70,000 small functions (0.9 MB) took 5.9 s. They are tried where the name stands
    (`_Occurrences`): 0.7 s, most of it reading the host functions."""
    source = _many_names(small_functions=70_000)
    assert read(source, None) == SourceLaunch((60, 1, 1), (256, 1, 1), 0)
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(source, None)), 3.0) < 3.0


def test_whitespace_before_a_name_is_the_regex_s() -> None:
    """`_Occurrences` finds where a pattern may start by str.rstrip's whitespace: that must be exactly the regex
    `\\s`, and hold no word character."""
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    spaces = set(re.findall(r"\s", every))
    assert spaces == {c for c in every if not c.rstrip()}
    assert not spaces & set(re.findall(r"\w", every))


@pytest.mark.parametrize(
    ("host", "workload", "grid"),
    [
        # a later name of a declaration's comma list has the statement's type: an int cannot hold 3e9
        (FORWARD.format(n="int a = 0, n = x.numel();"), BIG, None),
        (FORWARD.format(n="const int a = 0, n = x.numel();"), BIG, None),
        (FORWARD.format(n="int* p = nullptr, n = x.numel();"), BIG, None),
        (FORWARD.format(n="int a = std::max(1, 2), n = x.numel();"), BIG, None),
        (FORWARD.format(n="int a = 0, b = 1, n = x.numel();"), BIG, None),
        (FORWARD.format(n="int m = x.size(0), n = x.size(1);"), inputs(x=[1, 3_000_000_000]), None),
        (
            "void f(torch::Tensor x) { for (int i = 0, n = x.numel(); i < 1; i++) k<<<(n + 255) / 256, 256>>>(0, 0, n); }",
            BIG,
            None,
        ),
        # a list in braces declares nothing
        (
            FORWARD.format(n="int64_t n = x.numel(); auto y = torch::empty({4, n, 4}, x.options());"),
            BIG,
            11718750,
        ),
        # a type the evaluator does not read, a pointer: unknown, not 64 bits
        (FORWARD.format(n="int64_t a = 0, *n = nullptr;"), BIG, None),
        (FORWARD.format(n="std::pair<int, int> p = {}, n = x.numel();"), BIG, None),
        (FORWARD.format(n="float a = 0, n = x.numel();"), BIG, None),
        # 64-bit ones hold it; the first name's value stops at the list's comma
        (FORWARD.format(n="int64_t a = 0, n = x.numel();"), BIG, 11718750),
        (FORWARD.format(n="long a = f(1, 2), n = x.numel();"), BIG, 11718750),
        (FORWARD.format(n="int n = x.size(0), m = 2;"), inputs(x=[1 << 24]), 65536),
        ("void f() { int M = 1 << 20, N = 2; k<<<M / 256, 256>>>(0, 0, 0); }", None, 4096),
        ("void f() { int a = 1, M = 1 << 20; k<<<M / 256, 256>>>(0, 0, 0); }", None, 4096),
    ],
)
def test_every_name_of_a_declaration_s_comma_list_has_its_type(
    host: str, workload: Workload | None, grid: int | None
) -> None:
    """`int a = 0, n = x.numel();` declares `n` an int too: only the first name was given the type, a later one
    kept its value's 64 bits (grid 11718750 of a 3e9-element tensor, which that int cannot hold)."""
    expected = (grid, 1, 1) if grid is not None else None
    assert read(host, workload) == SourceLaunch(expected, (256, 1, 1), 0)


@pytest.mark.parametrize(
    ("decl", "grid"),
    [("int n;", None), ("int m, n;", None), ("int32_t n;", None), ("int64_t n;", 11718750), ("", 11718750)],
)
def test_a_name_declared_without_a_value_keeps_its_type_for_the_workload_s_size(
    decl: str, grid: int | None
) -> None:
    """`int n;` set through a reference (`get_size(x, n)`) is the workload's n, in its declared type: 3e9 is past
    an int's range (it read as 3e9)."""
    host = f"void f() {{ {decl} get_size(x, n); k<<<(n + 255) / 256, 256>>>(0, 0, n); }}"
    expected = (grid, 1, 1) if grid is not None else None
    assert read(host, sized(n=3_000_000_000)) == SourceLaunch(expected, (256, 1, 1), 0)


@pytest.mark.parametrize(
    ("declaration", "default", "threads"),
    [
        # another overload's declaration (another parameter count): its default is not this one's
        ("void launch(const half* x, half* y, int n, int threads = 64, cudaStream_t s = 0);\n", "", None),
        (
            "void launch(const half* x, half* y, int n, int threads = 64, cudaStream_t s = 0);\n",
            " = 256",
            256,
        ),
        # the same function's: its default, its parameters named or not
        ("void launch(const float*, float*, int, int threads = 128);\n", "", 128),
        ("void launch(const float* in, float* out, int count, int t = 128);\n", "", 128),
        # one of the same count but other types: another overload's
        ("void launch(const half*, half*, int, int threads = 64);\n", "", None),
        # a default on both (illegal, agents write it): unknown where they differ
        ("void launch(const float* x, float* y, int n, int threads = 64);\n", " = 256", None),
    ],
)
def test_a_default_is_read_from_the_function_s_own_declarations_alone(
    declaration: str, default: str, threads: int | None
) -> None:
    """A declaration's defaults were merged by position whatever its parameters (another overload's), and one
    on both the declaration and the definition was read from the definition."""
    definition = f"void launch(const float* x, float* y, int n, int threads{default}) {{ k<<<8, threads>>>(x, y, n); }}\n"
    host = declaration + "int main() { launch(0, 0, 1 << 24); }\n" + definition
    block = (threads, 1, 1) if threads is not None else None
    assert read(host) == SourceLaunch((8, 1, 1), block, 0)


def test_a_brace_in_a_default_string_of_a_launching_function_is_no_error() -> None:
    # The definition's parameters were read up to the first `{` of the raw text (inside the string here) and its
    # declarations' up to the blanked text's: three defaults were matched against no parameters, an IndexError
    # out of source_launch, and the pair went unforecast by the local model.
    host = (
        'void launch(int n, const char* s = "{", int t = 256) { k<<<(n + t - 1) / t, t>>>(0, 0, n); }\n'
        'void launch(int n, const char* s = "{", int t = 256);\n'
        "void run() { launch(1 << 20); }\n"
    )
    assert read(host) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize("string", ['"{"', '"}"', '","', '"("', "'{'"])
@pytest.mark.parametrize("declared", [False, True])
def test_a_default_string_s_brackets_and_commas_are_no_structure(string: str, declared: bool) -> None:
    # The definition's header was read up to the raw text's first `{` (the one in the string), its parameters
    # cut short and its defaults given up: `t = 256`, which every caller leaves out, was not read.
    header = f"void launch(int n, const char* s = {string}, int t = 256)"
    host = header + " { k<<<(n + t - 1) / t, t>>>(0, 0, n); }\n" + (header + ";\n" if declared else "")
    assert read(host + "void run() { launch(1 << 20); }\n") == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # A caller passing it: the caller's, here the constant 128 (n stays the workload's).
    assert read(host + 'void run() { launch(1 << 20, "", 128); }\n') == SourceLaunch(
        (131072, 1, 1), (128, 1, 1), 0
    )
    assert read(host + 'void run() { launch(1 << 20, "", 128); launch(1 << 20); }\n') is None


@pytest.mark.parametrize(
    "body",
    [
        "n = 5000; k<<<(n + 255) / 256, 256>>>(0, 0, n);",
        "n /= 2; k<<<(n + 255) / 256, 256>>>(0, 0, n);",
        "if (n > 1024) n = 1024; k<<<(n + 255) / 256, 256>>>(0, 0, n);",
        "int n = 4096; k<<<(n + 255) / 256, 256>>>(0, 0, n);",  # shadowed (an inner block's in real code)
    ],
)
def test_a_parameter_its_own_function_changes_is_not_its_callers_value(body: str) -> None:
    # A parameter's value is its callers' (the workload's here, n = 2^24): read as such though the function set it
    # before the launch, the grid was 65536 where the kernel runs (5000 + 255) / 256 = 20 blocks, or half as many.
    assert read(f"void f(int n) {{ {body} }}") == SourceLaunch(None, (256, 1, 1), 0)
    # Unchanged, it is the callers' still.
    assert read("void f(int n) { k<<<(n + 255) / 256, 256>>>(0, 0, n); }").grid == (65536, 1, 1)
    # Another parameter changed changes nothing of this one's.
    assert read("void f(int n, int m) { m = 3; k<<<(n + 255) / 256, 256>>>(0, 0, n); }").grid == (65536, 1, 1)


# A launching function whose block is a parameter, and callers passing it (`{call}`).
PASSED = (
    "void launch(const float* x, float* y, int n, int block) {"
    " k<<<(n + block - 1) / block, block>>>(x, y, n); }\n"
)
PASSED_MAIN = "int main() {{ float *x, *y; int n = 1 << 20; {call} }}\n"


@pytest.mark.parametrize(
    ("head", "call"),
    [
        # a literal, an expression of literals, a name bound once to a constant, a #define
        ("", "launch(x, y, n, 256);"),
        ("", "launch(x, y, n, 2 * 128);"),
        ("constexpr int kBlock = 256;\n", "launch(x, y, n, kBlock);"),
        ("static const int THREADS = 128;\n", "launch(x, y, n, THREADS * 2);"),
        ("#define BLOCK 256\n", "launch(x, y, n, BLOCK);"),
        ("", "const int threads = 256; launch(x, y, n, threads);"),
        # every call agreeing, through an object too
        ("", "launch(x, y, n, 256); launch(y, x, n, 256);"),
    ],
)
def test_a_parameter_every_caller_passes_as_one_constant_is_that_constant(head: str, call: str) -> None:
    """`launch(x, y, n, 256)` from main: the block is 256 (it was unknown, a parameter being only what the
    workload says); n, main's own test size, stays the workload's (2^24)."""
    host = head + PASSED + PASSED_MAIN.format(call=call)
    assert read(host) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def test_a_load_inline_helper_s_parameter_is_the_constant_its_wrapper_passes() -> None:
    """The exported forward calls a helper with the block as a literal: the helper's block is it."""
    cuda = (
        TORCH_HEAD + "__global__ void k(const float* x, float* y, int n) {}\n"
        "void launch(const float* x, float* y, int n, int block) {\n"
        "  k<<<(n + block - 1) / block, block>>>(x, y, n);\n}\n"
        "torch::Tensor forward(torch::Tensor x) {\n  auto y = torch::empty_like(x);\n  int n = x.numel();\n"
        "  launch(x.data_ptr<float>(), y.data_ptr<float>(), n, 256);\n  return y;\n}\n"
    )
    wl = inputs(x=[1 << 24])
    source = _load_inline(cuda)
    assert source_launch(Kernel(source=source, entry="ModelNew", language="python"), wl) == SourceLaunch(
        None, (256, 1, 1), 0
    )
    # Python binding the helper too calls it with any block.
    bound = source.replace('functions=["forward"]', 'functions=["forward", "launch"]')
    assert source_launch(Kernel(source=bound, entry="ModelNew", language="python"), wl) is None


@pytest.mark.parametrize(
    ("unknown", "why"),
    [
        (PASSED + PASSED_MAIN.format(call="launch(x, y, n, 256); launch(x, y, n, 128);"), "callers disagree"),
        (PASSED + PASSED_MAIN.format(call="int b = 256; launch(x, y, n, b);"), "a variable, not a constant"),
        (PASSED + PASSED_MAIN.format(call='launch(x, y, n, atoi("256"));'), "a call"),
        (
            PASSED
            + "void run(float* x, float* y, int n, int b) { launch(x, y, n, b); }\n"
            + PASSED_MAIN.format(call="run(x, y, n, 256);"),
            "the caller's own parameter",
        ),
        (PASSED, "no call"),
        (
            PASSED
            + PASSED_MAIN.format(call="launch(x, y, n, 256);")
            + 'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("launch", &launch); }\n',
            "bound to Python",
        ),
        (
            PASSED
            + PASSED_MAIN.format(call="launch(x, y, n, 256);")
            + 'TORCH_LIBRARY(ext, m) { m.impl("launch", launch); }\n',
            "registered with torch",
        ),
        ('extern "C" ' + PASSED + PASSED_MAIN.format(call="launch(x, y, n, 256);"), "extern C: ctypes"),
        (
            'extern "C" {\n' + PASSED + "}\n" + PASSED_MAIN.format(call="launch(x, y, n, 256);"),
            "in an extern C block",
        ),
        (
            PASSED + PASSED_MAIN.format(call="launch(x, y, n, 256); auto f = &launch; f(x, y, n, 64);"),
            "its address taken",
        ),
        (
            PASSED + PASSED_MAIN.format(call="launch(x, y, n, 256); std::thread t(launch, x, y, n, 64);"),
            "passed as a value",
        ),
        (
            PASSED.replace("int block)", "int block, ...)")
            + PASSED_MAIN.format(call="launch(x, y, n, 256, 1);"),
            "variadic",
        ),
        (
            PASSED.replace("{ k<<<", "{ if (n < 4096) block = 64; k<<<")
            + PASSED_MAIN.format(call="launch(x, y, n, 256);"),
            "changed in its own function",
        ),
        (
            PASSED.replace("{ k<<<", "{ if (n > 4096) { launch(x, y, n / 2, 256); return; } k<<<")
            + PASSED_MAIN.format(call="launch(x, y, n, 256);"),
            "recursive",
        ),
        (
            "void launch(const half* x, half* y, int n, int block);\n"
            + PASSED
            + PASSED_MAIN.format(call="launch(x, y, n, 256);"),
            "another overload declared: a call may be its",
        ),
        (
            PASSED + PASSED_MAIN.format(call="launch(x, y, Traits<int, 4>::n, 256);"),
            "template arguments' commas: the arguments' places not known",
        ),
    ],
)
def test_a_parameter_whose_callers_do_not_agree_on_a_constant_is_unknown(unknown: str, why: str) -> None:
    """Each is unknown; the same launcher with main's `launch(x, y, n, 256)` alone is 256."""
    assert read(PASSED + PASSED_MAIN.format(call="launch(x, y, n, 256);")).block == (256, 1, 1)
    found = read(unknown)
    assert found is None or found.block is None, why


def test_a_default_counts_for_the_callers_that_leave_it_out() -> None:
    defaulted = PASSED.replace("int block)", "int block = 256)")
    both = PASSED_MAIN.format(call="launch(x, y, n); launch(x, y, n, 256);")
    assert read(defaulted + both) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    other = PASSED_MAIN.format(call="launch(x, y, n); launch(x, y, n, 128);")
    assert read(defaulted + other) is None


def test_a_constant_passed_for_a_size_the_workload_names_is_a_test_size() -> None:
    """`launch(x, y, 1 << 20, 256)`: n is the workload's (2^24) where it names n; else the caller's constant."""
    host = PASSED + PASSED_MAIN.format(call="launch(x, y, 1 << 20, 256);")
    assert read(host) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    assert read(host, None) == SourceLaunch((4096, 1, 1), (256, 1, 1), 0)


def test_callers_passing_constants_are_read_cheaply() -> None:
    """2,000 callers of one launcher are past what is read (MAX_ASSIGNMENTS calls): unknown, at once; 64 `constexpr`
    names each passed by a caller and named 900 times elsewhere (0.9 MB) are each checked once."""
    many = PASSED + "".join(
        f"void c{i}(float* x, float* y, int n) {{ launch(x, y, n, 256); }}\n" for i in range(2000)
    )
    assert read(many) is None
    names = [f"kB{i}" for i in range(64)]
    launcher = (
        "void launch(int n, int "
        + ", int ".join(f"p{i}" for i in range(64))
        + ") { k<<<"
        + " + ".join(f"p{i}" for i in range(64))
        + ", 256>>>(0, 0, n); }\n"
    )
    uses = "void w() {" + "".join(f"return {n} + 0;" for _ in range(900) for n in names) + "}\n"
    host = "".join(f"constexpr int {n} = 1;\n" for n in names) + uses + launcher
    host += "int main() { launch(1, " + ", ".join(names) + "); }\n"
    assert read(host, None) == SourceLaunch((64, 1, 1), (256, 1, 1), 0)
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(many), read(host, None)), 5.0) < 5.0


def test_a_define_a_template_replaces_with_a_value_known_at_run_time_is_not_read() -> None:
    """`.replace("#define BLOCK 128", f"#define BLOCK {block}")`: the template's text was read as written, its
    `#define BLOCK 128` the launch's block, where the kernel runs with the block the caller chooses."""
    template = _UNBRACED.replace("{BLOCK}", "BLOCK")
    make = (
        'TEMPLATE = """#define BLOCK 128\n' + template + '"""\n'
        "def make(block):\n"
        '    return TEMPLATE.replace("#define BLOCK 128", "#define BLOCK " + str(block))\n'
        "cuda_src = make(BLOCK)\n"
    )
    head = "import os\nBLOCK = int(os.environ.get('BLOCK', 256))\n"
    python = Kernel(source=_templated(make, head), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) is None
    # Replaced by a constant, it is that constant's.
    known = make.replace("str(block)", "str(256)")
    python = Kernel(source=_templated(known, head), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


OTHER_BLOCK = "void other() { const int BLOCK = 128; g(BLOCK); }\n"


@pytest.mark.parametrize(
    ("host", "block"),
    [
        # Another function's local is not this one's name: the BLOCK here is a header's, a template's, a loop's or
        # a lambda's (each read 128, the other function's).
        (OTHER_BLOCK + "void f(int n) { k<<<1, BLOCK>>>(0, 0, n); }", None),
        (OTHER_BLOCK + "void f(int n) { for (int BLOCK : {64, 256}) k<<<1, BLOCK>>>(0, 0, n); }", None),
        (OTHER_BLOCK + "template <int BLOCK> void f(int n) { k<<<1, BLOCK>>>(0, 0, n); }", None),
        (
            OTHER_BLOCK
            + "void f(int n) { auto run = [&](int BLOCK) { k<<<1, BLOCK>>>(0, 0, n); }; run(256); }",
            None,
        ),
        (
            "namespace a { const int BLOCK = 128; }\nnamespace b { void f(int n) { k<<<1, BLOCK>>>(0, 0, n); } }",
            None,
        ),
        ("void f(int n) { if (n) { const int BLOCK = 128; g(BLOCK); } k<<<1, BLOCK>>>(0, 0, n); }", None),
        # A lambda's parameter shadows the launching function's (read as the 256 f's caller passes; the lambda
        # passes 128).
        (
            "void f(int BLOCK) { auto run = [](int BLOCK) { k<<<1, BLOCK>>>(0, 0, 0); }; run(128); }\n"
            "int main() { f(256); }",
            None,
        ),
        # A global shadowed by a template's parameter is the template's: its instantiation's, not read.
        ("const int BLOCK = 128;\ntemplate <int BLOCK> void f(int n) { k<<<1, BLOCK>>>(0, 0, n); }", None),
        # A global's initialiser means the globals it names, not the launching function's parameter of that name
        # (read 32 * 4, f's caller's T).
        (
            "const int T = 64;\nconst int BLOCK = T * 4;\nvoid f(int n, int T) { k<<<1, BLOCK>>>(0, 0, n); }\n"
            "int main() { f(1, 32); }",
            256,
        ),
        # Each function's own BLOCK, and the global where a local shadows it only elsewhere (all unknown before:
        # two values of one name).
        (OTHER_BLOCK + "void f(int n) { const int BLOCK = 256; k<<<1, BLOCK>>>(0, 0, n); }", 256),
        ("const int BLOCK = 256;\n" + OTHER_BLOCK + "void f(int n) { k<<<1, BLOCK>>>(0, 0, n); }", 256),
        (
            "const int BLOCK = 256;\nvoid f(int n) { k<<<1, BLOCK>>>(0, 0, n); const int BLOCK = 128; g(BLOCK); }",
            256,
        ),
        ("const int BLOCK = 128;\nvoid f(int n) { const int BLOCK = 256; k<<<1, BLOCK>>>(0, 0, n); }", 256),
        # A global another function assigns is one variable of two values, still.
        (
            "int BLOCK = 256;\nvoid other() { BLOCK = 128; }\nvoid f(int n) { k<<<1, BLOCK>>>(0, 0, n); }",
            None,
        ),
    ],
)
def test_a_name_is_the_declaration_its_scope_gives(host: str, block: int | None) -> None:
    """Names were looked up in the whole text, whatever function or namespace declared them: another function's
    `const int BLOCK = 128;` gave the launch of `f` block 128 where its BLOCK is a template's, a loop's, a
    lambda's parameter or a header's."""
    assert read(host) == SourceLaunch((1, 1, 1), (block, 1, 1) if block is not None else None, 0)


@pytest.mark.parametrize(
    "declared",
    [
        "namespace a { constexpr int T = 128; }\n",
        "void other() { constexpr int T = 128; g(T); }\n",
    ],
)
def test_a_constant_a_caller_passes_is_the_one_its_scope_gives(declared: str) -> None:
    """`launch(n, T)`, where the T in scope is a header's, read as another scope's `constexpr int T = 128`."""
    host = declared + "void launch(int n, int t) { k<<<1, t>>>(0, 0, n); }\nvoid f(int n) { launch(n, T); }\n"
    assert read(host) == SourceLaunch((1, 1, 1), None, 0)
    inside = host.replace("void f(int n) {", "void f(int n) { constexpr int T = 256;")
    assert read(inside) == SourceLaunch((1, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    ("host", "block"),
    [
        # A namespace's or class's BLOCK reaches a function outside its braces: a reopened namespace, a member or
        # namespace function defined out of line, a derived class, a using-declaration (each read 256, the
        # global's, where C++ takes the 128).
        (
            "const int BLOCK = 256;\nnamespace a { const int BLOCK = 128; }\n"
            "namespace a { void f(int n) { k<<<1, BLOCK>>>(0, 0, n); } }",
            None,
        ),
        (
            "const int BLOCK = 256;\nnamespace a { const int BLOCK = 128; void f(int n); }\n"
            "void a::f(int n) { k<<<1, BLOCK>>>(0, 0, n); }",
            None,
        ),
        (
            "const int BLOCK = 256;\nstruct S { static const int BLOCK = 128; void f(int n); };\n"
            "void S::f(int n) { k<<<1, BLOCK>>>(0, 0, n); }",
            None,
        ),
        (
            "const int BLOCK = 256;\nstruct Base { static const int BLOCK = 128; };\n"
            "struct D : Base { void f(int n) { k<<<1, BLOCK>>>(0, 0, n); } };",
            None,
        ),
        (
            "const int BLOCK = 256;\nnamespace a { const int BLOCK = 128; }\n"
            "void f(int n) { using a::BLOCK; k<<<1, BLOCK>>>(0, 0, n); }",
            None,
        ),
        # A for's or if's own BLOCK ends with its statement (read 128 after it).
        (
            "const int BLOCK = 256;\nvoid f(int n) { for (int BLOCK = 128; n; ) { g(BLOCK); } k<<<1, BLOCK>>>(0, 0, n); }",
            256,
        ),
        (
            "const int BLOCK = 256;\nvoid f(int n) { if (const int BLOCK = 128; n) { g(BLOCK); } k<<<1, BLOCK>>>(0, 0, n); }",
            256,
        ),
        ("void f(int n) { for (int BLOCK = 128; n; ) { k<<<1, BLOCK>>>(0, 0, n); } }", 128),
        # A statement whose end is not seen (a loop of a loop): its own name not read (the 128 after it before).
        (
            "const int BLOCK = 256;\nvoid f(int n) { for (int BLOCK = 128; n; ) for (int j = 0; j < n; ++j) g(BLOCK);"
            " k<<<1, BLOCK>>>(0, 0, n); }",
            None,
        ),
        # A struct's field, or another namespace's constant, is no free function's name; an anonymous namespace's
        # and an extern "C" block's are the file's (unknown since scopes were read).
        (
            "struct P { int BLOCK; };\nconst int BLOCK = 256;\nvoid f(int n) { k<<<1, BLOCK>>>(0, 0, n); }",
            256,
        ),
        (
            "struct P { int BLOCK; };\nnamespace a { const int BLOCK = 256; void f(int n) { k<<<1, BLOCK>>>(0, 0, n); } }",
            256,
        ),
        ("namespace { const int BLOCK = 256; }\nvoid f(int n) { k<<<1, BLOCK>>>(0, 0, n); }", 256),
        ('extern "C" { const int BLOCK = 256; }\nvoid f(int n) { k<<<1, BLOCK>>>(0, 0, n); }', 256),
    ],
)
def test_a_name_another_scope_reaches_is_not_the_global(host: str, block: int | None) -> None:
    """C++ lets a namespace's or class's name reach past its braces (a namespace reopened, `void S::f()`, a base
    class, `using a::BLOCK`), and ends a for's or if's own name with its statement: read by braces alone, the
    global BLOCK (or the loop's) was given as the launch's block where C++ gives another."""
    assert read(host) == SourceLaunch((1, 1, 1), (block, 1, 1) if block is not None else None, 0)


def test_a_define_a_template_replaces_a_counted_number_of_times_is_the_replaced_one() -> None:
    """`.replace("#define BLOCK 128", "#define BLOCK 256", 1)`, with a count, was not read as a fill: the
    template's own `#define BLOCK 128` was the launch's block where the kernel runs with 256."""
    template = _UNBRACED.replace("{BLOCK}", "BLOCK")
    make = (
        'TEMPLATE = """#define BLOCK 128\n' + template + '"""\n'
        'cuda_src = TEMPLATE.replace("#define BLOCK 128", "#define BLOCK 256", 1)\n'
    )
    python = Kernel(source=_templated(make, ""), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # None replaced (a count of 0): the template's own.
    none = make.replace(", 1)", ", 0)")
    python = Kernel(source=_templated(none, ""), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) == SourceLaunch((131072, 1, 1), (128, 1, 1), 0)
    # A count not known here: which are replaced is not known.
    unknown = "import os\nCOUNT = int(os.environ['COUNT'])\n" + make.replace(", 1)", ", COUNT)")
    python = Kernel(source=_templated(unknown, ""), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) is None


_DEFINED = 'SRC = """#define BLOCK 128\n' + _UNBRACED.replace("{BLOCK}", "BLOCK") + '"""\n'


@pytest.mark.parametrize(
    "make",
    [
        # rebound, then replaced through the new name
        "def make(b):\n    src = SRC\n    src = src.replace('#define BLOCK 128', f'#define BLOCK {b}')\n    return src\n"
        "cuda_src = make(BLOCK)\n",
        "cuda_src = SRC\ncuda_src = cuda_src.replace('#define BLOCK 128', '#define BLOCK ' + str(BLOCK))\n",
        # passed, or held by an attribute, and replaced there
        "def make(src, b):\n    return src.replace('#define BLOCK 128', f'#define BLOCK {b}')\n"
        "cuda_src = make(SRC, BLOCK)\n",
        "class Maker:\n    def __init__(self, b):\n        self.src = SRC\n"
        "        self.src = self.src.replace('#define BLOCK 128', f'#define BLOCK {b}')\n"
        "cuda_src = Maker(BLOCK).src\n",
        # replaced in a loop: what is replaced is not known here
        "def make(subs):\n    src = SRC\n    for k, v in subs.items():\n        src = src.replace(k, v)\n"
        "    return src\ncuda_src = make({'#define BLOCK 128': '#define BLOCK 256'})\n",
        "SUBS = {'#define BLOCK 128': '#define BLOCK 256'}\ncuda_src = SRC\nfor k, v in SUBS.items():\n"
        "    cuda_src = cuda_src.replace(k, v)\n",
        "cuda_src = SRC.replace(OLD, '#define BLOCK 256')\n",
    ],
    ids=["function", "module", "parameter", "attribute", "loop", "module loop", "unknown old"],
)
def test_a_template_replaced_through_another_name_is_not_read_as_written(make: str) -> None:
    """`src = SRC; src = src.replace("#define BLOCK 128", f"#define BLOCK {b}")`, or a loop of `.replace(k, v)`:
    the template's text as written was read, its `#define BLOCK 128` the launch's block (a grid of 131,072) where
    the kernel runs with the block the caller chooses."""
    head = "import os\nBLOCK = int(os.environ.get('BLOCK', 256))\nOLD = os.environ['OLD']\n"
    python = Kernel(source=_templated(_DEFINED + make, head), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) is None
    # The template used as written, its `.replace` of another string's text: its own 128.
    plain = _DEFINED + "cuda_src = SRC\nname = os.environ['NAME'].replace('-', '_')\n"
    python = Kernel(source=_templated(plain, head), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) == SourceLaunch((131072, 1, 1), (128, 1, 1), 0)


def test_a_replace_of_one_template_leaves_another_s_define_its_own() -> None:
    """A replace not followed to the string it edits is put in for the text it replaces in every string, each
    place a value of its own: another string's `#define BLOCK 128` is not the edited one's BLOCK."""
    other = 'OTHER = """#define BLOCK 128\n__device__ int unused() { return BLOCK; }\n"""\n'
    template = 'SRC = """' + _UNBRACED.replace("{BLOCK}", "BLOCK") + '"""\n'
    make = (
        other
        + template
        + "def make(b):\n    src = SRC\n    return src.replace('BLOCK', str(b))\n"
        + "cuda_src = [OTHER, make(BLOCK)]\n"
    )
    head = "import os\nBLOCK = int(os.environ.get('BLOCK', 256))\n"
    python = Kernel(source=_templated(make, head), entry="ModelNew", language="python")
    assert source_launch(python, inputs(x=[1 << 24])) is None


def test_replaces_not_followed_stay_cheap() -> None:
    """Each text a `.replace` not followed replaces is put in for in every string read, up to 32 texts and 4,096
    places (past those the text is taken as edited: no launch read): 200 KB of strings and 32 texts are one pass."""
    from forecaster_mcp.forecast.features import embedded_cuda

    filled = 'src = f"__global__ void k() {{}}' + "{A}" * 8 + '"\n'
    olds = "".join(f"def f{i}(s):\n    return s.replace('Q{i:02}', 'y')\n" for i in range(32))
    few = 'A = "' + "Q05 xyz " * 400 + '"\n' + filled + olds  # 3,200 places
    many = 'A = "' + "Q05 " * 6_000 + '"\n' + filled + olds  # 48,000
    assert len(few) < 64 * 1024 and len(many) < 64 * 1024
    found = embedded_cuda(few, "k")
    assert found is not None and not found.edited and "Q05" not in found.text
    found = embedded_cuda(many, "k")
    assert found is not None and found.edited
    assert fastest_s(lambda: (embedded_cuda(few, "k"), embedded_cuda(many, "k")), 2.0) < 2.0  # 0.03 s
