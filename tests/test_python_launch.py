"""The launch a CuPy, PyCUDA or Triton source gives its kernel from Python (forecast/python_launch.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from mcp import Client
from timing import fastest_s
from tool_calls import call

from forecaster_mcp.forecast import host_launch
from forecaster_mcp.forecast.features import kernel_features
from forecaster_mcp.forecast.host_launch import SourceLaunch, source_launch
from forecaster_mcp.hardware.specs import lookup
from forecaster_mcp.models import Kernel, Language, Workload
from forecaster_mcp.server.app import build_server
from forecaster_mcp.service import Service
from forecaster_mcp.settings import Settings

N = 1 << 24
WL = Workload.model_validate(
    {
        "problem": {"N": N},
        "args": [
            {"name": "x", "dtype": "float32", "shape": [N], "init": "random_uniform", "intent": "in"},
            {
                "name": "img",
                "dtype": "float32",
                "shape": [2048, 4096],
                "init": "random_uniform",
                "intent": "in",
            },
        ],
    }
)
RELU = (
    'r"""extern "C" __global__ void relu(float* x, int n) {\n'
    '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = fmaxf(x[i], 0.f); }"""'
)


def read(source: str, entry: str = "run", workload: Workload | None = WL) -> SourceLaunch | None:
    return source_launch(Kernel(source=source, entry=entry, language="python"), workload)


def cupy(body: str, head: str = "") -> str:
    return f'import cupy as cp\nimport math\n{head}k = cp.RawKernel({RELU}, "relu")\n\ndef run(x):\n{body}\n'


@pytest.mark.parametrize(
    ("body", "head", "expected"),
    [
        ("    k((N // 256,), (256,), (x, N))", "", ((65536, 1, 1), (256, 1, 1))),
        (
            "    n = x.size\n    k(((n + T - 1) // T,), (T,), (x, n))",
            "T = 128\n",
            ((131072, 1, 1), (128, 1, 1)),
        ),
        ("    k((math.ceil(x.shape[0] / 512),), (512,), (x,))", "", ((32768, 1, 1), (512, 1, 1))),
        ("    k((len(x) // 1024,), 1024, (x,))", "", ((16384, 1, 1), (1024, 1, 1))),  # an int is x
        (
            "    g = (img.shape[1] // 32, img.shape[0] // 8)\n    k(g, (32, 8), (img,))",
            "",
            ((128, 256, 1), (32, 8, 1)),
        ),
        ("    k((min(x.size // 256, 4096),), (256,), (x,))", "", ((4096, 1, 1), (256, 1, 1))),
        (
            "    k(grid=(N >> 8,), block=(256,), args=(x,))",
            "",
            None,
        ),  # CuPy's keywords: PyCUDA's block= read below
    ],
)
def test_reads_a_cupy_launch(body: str, head: str, expected: tuple[object, object] | None) -> None:
    found = read(cupy(body, head))
    if expected is None:
        assert found is None or found.block is None or found == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    else:
        assert found == SourceLaunch(*expected, 0)  # type: ignore[arg-type]
    # Asked about by its kernel's name, the same.
    assert read(cupy(body, head), "relu") == found


def test_reads_a_pycuda_launch_and_its_handle_on_self() -> None:
    source = (
        "import math\nimport numpy as np\nfrom pycuda.compiler import SourceModule\n"
        f"mod = SourceModule({RELU})\n"
        "class Op:\n    def __init__(self):\n        self.fn = mod.get_function('relu')\n"
        "    def __call__(self, x, N):\n"
        "        self.fn(x, np.int32(N), block=(128, 1, 1), grid=(math.ceil(N / 128), 1), shared=512)\n"
    )
    assert read(source, "Op") == SourceLaunch((131072, 1, 1), (128, 1, 1), 512)
    # PyCUDA's grid defaults to one block.
    assert read(source.replace(", grid=(math.ceil(N / 128), 1)", ""), "Op") == SourceLaunch(
        (1, 1, 1), (128, 1, 1), 512
    )
    f = kernel_features(Kernel(source=source, entry="Op", language="python"), WL, lookup("H100"), None)
    assert (f.threads_per_block, f.blocks) == (128, 131072)
    assert f.launch_from_source == "grid [131072, 1, 1], block [128, 1, 1]"
    assert host_launch.launches_itself(Kernel(source=source, entry="Op", language="python"))


@pytest.mark.parametrize(
    "body",
    [
        "    t = 128\n    t = 256\n    k((N // t,), (t,), (x,))",  # assigned twice
        "    for t in (128, 256):\n        k((N // t,), (t,), (x,))",  # a loop variable
        "    t = 256\n    t += 1\n    k((N // t,), (t,), (x,))",  # changed in place
        "    k((int(N / 256.0),), (256,), (x,))",  # a float
        "    k((m // 256,), (256,), (x,))",  # not said anywhere
        "    k((N // 256,), (256,), (x,))\n    k((N // 128,), (128,), (x,))",  # two that disagree
    ],
)
def test_what_a_cupy_source_does_not_say_plainly_is_unknown(body: str) -> None:
    found = read(cupy(body))
    assert found is None or found.grid is None


def test_a_parameter_is_the_callers_and_a_test_size_is_not_the_workloads() -> None:
    # `def run(x, m)`: m is whatever the caller passes; the workload names no `m`.
    assert read(
        cupy("    m = 4096\n    k((m // 256,), (256,), (x,))").replace("def run(x)", "def run(x, m)")
    ) == SourceLaunch(None, (256, 1, 1), 0)
    # The module's own N (a test size) is not the workload's N.
    assert read(cupy("    k((N // 256,), (256,), (x,))", "N = 1 << 20\n")) == SourceLaunch(
        None, (256, 1, 1), 0
    )
    assert read(cupy("    k((N // 256,), (256,), (x,))", f"N = {N}\n")) == SourceLaunch(
        (65536, 1, 1), (256, 1, 1), 0
    )


def test_a_workload_buffer_is_read_after_many_other_names() -> None:
    # 64 defaults that read an array the workload does not have (each default is unknown, the workload's size of
    # the parameter is taken instead), then x: x's shape is still the workload's, however many names came first.
    params = ", ".join(f"n{i}=a{i}.size" for i in range(64))
    total = " + ".join(f"n{i}" for i in range(64))
    body = f"    t = {total}\n    k(((t + x.size) // 256,), (256,), (x,))"
    source = cupy(body).replace("def run(x)", f"def run(x, {params})")
    workload = WL.model_copy(update={"problem": {f"n{i}": 0 for i in range(64)}})
    assert read(source, workload=workload) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    "change",
    [
        "    N = 4096\n",
        "    N //= 2\n",
        "    if N > 4096:\n        N = 4096\n",
        "    for N in (4096,):\n        pass\n",
        "    N, t = 4096, 1\n",
    ],
)
@pytest.mark.parametrize("parameter", ["N", "N=1024"])
def test_a_parameter_its_own_function_changes_is_not_its_callers_value(change: str, parameter: str) -> None:
    # A parameter's value is its callers' (the workload's here, N = 2^24): read as such though the function set it
    # before the launch, the grid was 65536 where the kernel runs 16 blocks (host_launch reads C++ so too).
    launch = "    k((N // 256,), (256,), (x, N))"
    source = cupy(change + launch).replace("def run(x)", f"def run(x, {parameter})")
    assert read(source) == SourceLaunch(None, (256, 1, 1), 0)
    # Unchanged, it is the callers' still; another parameter changed changes nothing of this one's.
    unchanged = cupy("    m = 3\n" + launch).replace("def run(x)", "def run(x, N, m)")
    assert read(unchanged) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    ("parameter", "launch", "expected"),
    [
        ("N", "    k((N // 256,), (256,), (x, N))", (65536, 1, 1)),  # the workload's N
        ("N", "    k((x.size // 256,), (256,), (x, N))", (65536, 1, 1)),  # the workload's x
        ("N, block=128", "    k((N // block,), (block,), (x, N))", (131072, 1, 1)),  # its default
    ],
)
def test_a_global_elsewhere_is_not_a_parameter_set_in_its_function(
    parameter: str, launch: str, expected: tuple[int, int, int]
) -> None:
    # `global N` (x, block) in another function names the module's N, never run's parameter (Python refuses it in
    # run itself): since de9a773 the parameter read as one its own function sets, its grid unknown.
    block = (128 if "block" in launch else 256, 1, 1)
    for name in ("N", "x", "block"):
        head = f"def setup():\n    global {name}\n    {name} = 7\n"
        source = cupy(launch, head).replace("def run(x)", f"def run(x, {parameter})")
        assert read(source) == SourceLaunch(expected, block, 0)
    # `global N` in run itself (a source Python refuses, though ast parses it), or a function in it saying
    # `nonlocal N`, may set N: a grid of N unknown.
    for change in ("    global N\n", "    def shrink():\n        nonlocal N\n        N = 7\n    shrink()\n"):
        source = cupy(change + launch).replace("def run(x)", f"def run(x, {parameter})")
        assert read(source) == SourceLaunch(None if "N //" in launch else expected, block, 0)


def test_a_global_elsewhere_leaves_a_function_s_own_names_its_own() -> None:
    # Every function's scope took each name any function declares `global` as set from elsewhere: a function's own
    # `t = 256` was unknown beside `def setup(): global t`, though setup's t is the module's.
    head = "def setup():\n    global t\n    t = 7\n"
    assert read(cupy("    t = 256\n    k((N // t,), (t,), (x, N))", head)) == SourceLaunch(
        (65536, 1, 1), (256, 1, 1), 0
    )
    # The module's t is set from setup: unknown where read; and so is one a function's `nonlocal t` may set.
    assert read(cupy("    k((N // 256,), (t,), (x, N))", "t = 256\n" + head)) == SourceLaunch(
        (65536, 1, 1), None, 0
    )
    nested = "    def shrink():\n        nonlocal t\n        t = 7\n"
    assert read(cupy("    t = 256\n" + nested + "    k((N // 256,), (t,), (x, N))")) == SourceLaunch(
        (65536, 1, 1), None, 0
    )
    # A buffer parameter a function inside sets (`nonlocal x`): not the workload's x.
    shrunk = "    def shrink():\n        nonlocal x\n        x = x[:256]\n    shrink()\n"
    assert read(cupy(shrunk + "    k((x.size // 256,), (256,), (x,))")) == SourceLaunch(None, (256, 1, 1), 0)
    # Thousands of functions each declaring a global: each scope took them all (5 s for 63 KB).
    many = "".join(f"def g{i}():global v{i}\n" for i in range(2_600))
    assert len(cupy("", many)) < 64 * 1024
    assert read(cupy("    k((N // 256,), (256,), (x, N))", many)) == SourceLaunch(
        (65536, 1, 1), (256, 1, 1), 0
    )
    timed = cupy("    k((N // 256,), (256,), (x, N))", many)
    assert fastest_s(lambda: (host_launch._CACHE.clear(), read(timed)), 2.0) < 2.0  # 0.1 s


def test_a_grid_function_s_parameter_it_changes_is_not_its_default() -> None:
    # `def grid(meta, total=n)` read total as n (the default, where the grid function is made) though its body
    # sets it.
    launch = (
        "    def grid(meta, total=n):\n        total = 4096\n"
        "        return (triton.cdiv(total, meta['BLOCK_SIZE']),)\n"
        "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1024)\n"
    )
    assert read_triton(triton(launch)) == programs(None)
    assert read_triton(triton(launch.replace("        total = 4096\n", ""))) == programs((16384,))


@pytest.mark.parametrize(
    ("default", "change", "returned", "unchanged"),
    [
        ("g=(64,)", "g = (128,)", "g", 64),  # a grid tuple: read as the default's 64 programs
        # A buffer: read as x's 2^24 elements, 16384 programs.
        ("a=x", "a = y[:4096]", "(triton.cdiv(a.numel(), meta['BLOCK_SIZE']),)", 16384),
    ],
)
def test_a_grid_function_s_tuple_or_buffer_parameter_it_changes_is_not_its_default(
    default: str, change: str, returned: str, unchanged: int
) -> None:
    # The value check covered a number only: a tuple the grid is named by, or a buffer sized in it, was still
    # read from the default where the grid function is made, though its body sets it.
    launch = (
        f"    def grid(meta, {default}):\n        {change}\n        return {returned}\n"
        "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1024)\n"
    )
    assert read_triton(triton(launch)) == programs(None)
    assert read_triton(triton(launch.replace(f"        {change}\n", ""))) == programs((unchanged,))


def test_only_the_kernel_that_runs_is_read() -> None:
    # A naive twin kept beside it, launched with other sizes, is not the entry's launch.
    source = cupy("    k((N // 256,), (256,), (x,))") + (
        "\nnaive = cp.RawKernel(r'''extern \"C\" __global__ void naive(float* x) { x[0] = 0.f; }''', 'naive')\n"
        "def slow(x):\n    naive((1,), (32,), (x,))\n"
    )
    assert read(source, "run") == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    assert read(source, "slow") == SourceLaunch((1, 1, 1), (32, 1, 1), 0)
    # Launched through the naming call itself.
    direct = f"import cupy as cp\ndef run(x):\n    cp.RawKernel({RELU}, 'relu')((N // 256,), (256,), (x,))\n"
    assert read(direct) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def test_hostile_python_launches_stay_cheap() -> None:
    deep = "    t = " + "(" * 90 + "1" + ")" * 90 + "\n    k((N // t,), (t,), (x,))"
    chain = "".join(f"a{i} = a{i - 1} + a{i - 1}\n" for i in range(1, 60))
    # Just under the 64 KB a Python source is parsed up to (features._MAX_EMBEDDING_SOURCE): all of it read.
    many = "".join("    k((N // 256,), (256,), (x,))\n" for _ in range(1_900))
    assert len(cupy(many)) < 64 * 1024
    for body, head in ((deep, ""), ("    k((a59,), (256,), (x,))", "a0 = 1\n" + chain), (many, "")):
        source = cupy(body, head)
        assert fastest_s(lambda source=source: (host_launch._CACHE.clear(), read(source)), 2.0) < 2.0
    assert read(cupy(many)) is None  # past MAX_SITES calls, none is read
    # 59 doublings: beyond any launch, so unknown rather than a huge grid.
    assert read(cupy("    k((a59,), (256,), (x,))", "a0 = 1\n" + chain)) == SourceLaunch(None, (256, 1, 1), 0)


LOAD_INLINE = (
    "import torch\nfrom torch.utils.cpp_extension import load_inline\n"
    'kernels = r"""\nKERNELS\n"""\nwrapper = r"""\nWRAPPER\n"""\n'
    'module = load_inline(name="ext", cpp_sources="torch::Tensor forward(torch::Tensor x);", '
    "cuda_sources=CUDA_SOURCES, functions=['forward'])\n"
    "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return module.forward(x)\n"
)
FAST = "__global__ void fast(const float4* x, float4* y, int n4) { int i = blockIdx.x * blockDim.x + threadIdx.x; }"
NAIVE = "__global__ void naive(const float* x, float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; }"
WRAPPER = (
    "torch::Tensor forward(torch::Tensor x) {\n  auto y = torch::empty_like(x);\n  int n = x.numel();\n"
    "  fast<<<(n / 4 + 255) / 256, 256>>>(0, 0, n / 4);\n  return y;\n}"
)


def test_a_handle_rebound_before_each_of_its_calls_stays_cheap() -> None:
    # Each call of `h` read every one of its thousands of bindings: 3,300 of them in 54 KB took 10 s to read,
    # and 7.5 s to say whether the source launches its kernel at all.
    rebound = " h=R(c,'o')\n h()\n" * 3_300
    source = cupy(rebound)
    assert len(source) < 64 * 1024  # all of it parsed (features._MAX_EMBEDDING_SOURCE)
    kernel = Kernel(source=source, entry="relu", language="python")
    assert read(source, "relu") is None  # no launch of relu
    assert not host_launch.launches_itself(kernel)

    # 0.9 s on an idle machine, both together
    def read_both() -> None:
        host_launch._CACHE.clear()
        read(source, "relu")
        host_launch.launches_itself(kernel)

    assert fastest_s(read_both, 6.0) < 6.0


def test_a_load_inline_wrapper_chooses_the_kernel_it_launches() -> None:
    """With a naive kernel kept beside the one the wrapper launches, no entry was chosen (neither is named in
    Python), so no launch was read; a wrapper in a string of its own (no __global__ in it) was not read at all."""
    from forecaster_mcp.forecast.features import embedded_cuda

    one_string = LOAD_INLINE.replace("KERNELS", f"{NAIVE}\n{FAST}\n{WRAPPER}").replace(
        "CUDA_SOURCES", "kernels"
    )
    two_strings = LOAD_INLINE.replace("KERNELS", f"{NAIVE}\n{FAST}").replace("WRAPPER", WRAPPER)
    two_strings = two_strings.replace("CUDA_SOURCES", "[kernels, wrapper]")
    for source in (one_string, two_strings):
        embedded = embedded_cuda(source, "ModelNew")
        assert embedded is not None and embedded.entry == "fast"
        assert read(source, "ModelNew") == SourceLaunch((16384, 1, 1), (256, 1, 1), 0)
    # A wrapper launching both kernels runs both: no one entry, no launch.
    both = one_string.replace("  return y;", "  naive<<<n / 256, 256>>>(0, 0, n);\n  return y;")
    embedded = embedded_cuda(both, "ModelNew")
    assert embedded is not None and embedded.entry is None and read(both, "ModelNew") is None


def test_deeply_nested_expressions_are_unknown_not_an_error() -> None:
    # `1 + 1 + ...` nests to the left: 600 terms (1.2 KB) went past Python's recursion limit in the evaluator,
    # and the RecursionError reached the forecast. Nested through names, each expression short, the same.
    sums = "1" + "+1" * 600
    chain = "a0 = 1\n" + "".join(f"a{i} = a{i - 1}" + "+1" * 150 + "\n" for i in range(1, 8))
    for body, head in (
        (f"    k((N // 256,), ({sums},), (x,))", ""),
        ("    k((N // 256,), (a7,), (x,))", chain),
    ):
        source = cupy(body, head)
        assert read(source) == SourceLaunch((65536, 1, 1), None, 0)
        assert fastest_s(lambda source=source: (host_launch._CACHE.clear(), read(source)), 2.0) < 2.0


def test_a_launch_tuple_named_in_the_module_is_read_in_the_module() -> None:
    # `BLOCK = (T,)` is the module's T, whatever the calling function calls T: read in the function, 128.
    assert read(
        cupy("    T = 128\n    k((N // 256,), BLOCK, (x,))", "T = 256\nBLOCK = (T,)\n")
    ) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # CuPy's keywords: its shared_mem, not PyCUDA's shared (read as none).
        (
            "    k(grid=(N >> 8,), block=(256,), args=(x,), shared_mem=4096)",
            ((65536, 1, 1), (256, 1, 1), 4096),
        ),
        # CuPy's grid given first, its block by keyword: not PyCUDA's default grid of one block.
        ("    k((N >> 8,), block=(256,), args=(x,))", ((65536, 1, 1), (256, 1, 1), 0)),
        # Its configuration in a `**` (PyCUDA's grid in it, or CuPy's all): not said, so not one block.
        ("    k(x, block=(256, 1, 1), **cfg)", None),
        ("    k((N >> 8,), (256,), (x,))\n    k(**cfg)", None),
    ],
)
def test_a_cupy_call_by_keywords_is_cupys(body: str, expected: tuple[object, object, object] | None) -> None:
    found = read(cupy(body))
    if expected is None:
        assert found is None or found.grid is None
    else:
        assert found == SourceLaunch(*expected)  # type: ignore[arg-type]


LAUNCH_T = "    k((N // 256,), (T,), (x,))"


@pytest.mark.parametrize(
    ("body", "head"),
    [
        (f"    from cfg import T\n{LAUNCH_T}", "T = 256\n"),  # an import
        (LAUNCH_T, "T = 256\nfrom cfg import T\n"),
        (f"    def T():\n        pass\n{LAUNCH_T}", "T = 256\n"),  # a def or class
        (f"    class T:\n        pass\n{LAUNCH_T}", "T = 256\n"),
        (f"    try:\n        pass\n    except ValueError as T:\n        pass\n{LAUNCH_T}", "T = 256\n"),
        (f"    *T, u = 512, 1\n{LAUNCH_T}", "T = 256\n"),  # T is [512]
        (f"    match x.ndim:\n        case T:\n            pass\n{LAUNCH_T}", "T = 256\n"),
        (LAUNCH_T, "T = 256\ndel T\n"),
        (LAUNCH_T, "T = 256\ndef setup():\n    global T\n    T = 512\n"),  # set elsewhere
        (
            f"    T = 256\n    def bump():\n        nonlocal T\n        T = 512\n    bump()\n{LAUNCH_T}",
            "",
        ),
        ("    [k((N // 256,), (T,), (x,)) for T in (128, 512)]", "T = 256\n"),  # the comprehension's own T
    ],
)
def test_a_name_bound_other_than_by_assignment_is_unknown(body: str, head: str) -> None:
    found = read(cupy(body, head))
    assert found is None or found.block is None


@pytest.mark.parametrize("size", ["x.shape[0]", "len(x)", "x.size", "x.numel()", "x.size(0)"])
def test_a_buffer_the_source_rebinds_is_not_the_workloads(size: str) -> None:
    # x reshaped to N / 4 rows: its shape is no longer the workload's [N].
    found = read(cupy(f"    x = x.reshape(-1, 4)\n    k(({size} // 256,), (256,), (x,))"))
    assert found == SourceLaunch(None, (256, 1, 1), 0)
    # A module's own buffer (a test's) is not the workload's either.
    found = read(
        cupy(f"    k(({size} // 256,), (256,), (x,))", "x = cp.zeros(1 << 20)\n").replace(
            "def run(x)", "def run()"
        )
    )
    assert found == SourceLaunch(None, (256, 1, 1), 0)
    # The function's parameter is, and an array made like it has its shape; not one made like it of another shape.
    assert read(cupy(f"    k(({size} // 256,), (256,), (x,))")) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    made = f"    y = cp.empty_like(x)\n    k(({size.replace('x', 'y')} // 256,), (256,), (y,))"
    assert read(cupy(made)) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    other = made.replace("cp.empty_like(x)", "cp.zeros_like(x, shape=(4,))")
    assert read(cupy(other)) == SourceLaunch(None, (256, 1, 1), 0)


NAIVE_CODE = "r'''extern \"C\" __global__ void naive(float* x) { x[0] = 0.f; }'''"


def test_a_handle_is_the_kernel_its_scope_binds() -> None:
    # Each function binds `kernel` to its own: each launch is its own kernel's, not two that disagree.
    pycuda = (
        f"from pycuda.compiler import SourceModule\nmod = SourceModule({RELU} + {NAIVE_CODE})\n"
        "def run(x):\n    kernel = mod.get_function('relu')\n"
        "    kernel(x, block=(256, 1, 1), grid=(N // 256, 1))\n"
        "def slow(x):\n    kernel = mod.get_function('naive')\n    kernel(x, block=(32, 1, 1), grid=(1, 1))\n"
    )
    # The same, by methods of two classes binding self.fn.
    classes = (
        f"from pycuda.compiler import SourceModule\nmod = SourceModule({RELU} + {NAIVE_CODE})\n"
        "class Fast:\n    def __init__(self):\n        self.fn = mod.get_function('relu')\n"
        "    def __call__(self, x):\n        self.fn(x, block=(256, 1, 1), grid=(N // 256, 1))\n"
        "class Slow:\n    def __init__(self):\n        self.fn = mod.get_function('naive')\n"
        "    def __call__(self, x):\n        self.fn(x, block=(32, 1, 1), grid=(1, 1))\n"
    )
    for source, fast, slow in ((pycuda, "run", "slow"), (classes, "Fast", "Slow")):
        assert read(source, fast) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
        assert read(source, slow) == SourceLaunch((1, 1, 1), (32, 1, 1), 0)
    # relu's handle passed to a launcher (not read), and another function's `k` naive's: naive's launch is not
    # relu's.
    passed = (
        f"import cupy as cp\nk = cp.RawKernel({RELU}, 'relu')\n"
        "def launch(kern, x):\n    kern((N // 256,), (256,), (x,))\n"
        "def run(x):\n    launch(k, x)\n"
        f"def other(x):\n    k = cp.RawKernel({NAIVE_CODE}, 'naive')\n    k((1,), (32,), (x,))\n"
    )
    assert read(passed) is None
    # One name bound to either kernel: its launches may be either's.
    either = (
        cupy("    k((N // 256,), (256,), (x,))") + f"if SLOW:\n    k = cp.RawKernel({NAIVE_CODE}, 'naive')\n"
    )
    assert read(either) is None


def lazy(setup: str, launch: str = "    k((x.size // 256,), (256,), (x, x.size))\n", head: str = "") -> str:
    """A CuPy handle made in a function through `global k` (`setup`), launched in `run`."""
    return f"import cupy as cp\nsrc = {RELU}\n{head}{setup}def run(x):\n{launch}"


def launches(source: str, entry: str = "run") -> bool:
    return host_launch.launches_itself(Kernel(source=source, entry=entry, language="python"))


def test_a_handle_a_function_binds_through_global_is_the_modules() -> None:
    # setup's `global k; k = cp.RawKernel(...)` was read as setup's own k: run's k bound to nothing the module
    # says, so the source was taken to launch nothing, asked by the wrapper's name or the kernel's.
    made = "def setup():\n    global k\n    k = cp.RawKernel(src, 'relu')\n"
    for entry in ("run", "relu"):
        assert launches(lazy(made), entry)
        assert read(lazy(made), entry) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # A class's method, or a function inside another, binds the module's k alike.
    method = "class Ops:\n    def setup(self):\n        global k\n        k = cp.RawKernel(src, 'relu')\n"
    nested = (
        "def setup():\n    def make():\n        global k\n        k = cp.RawKernel(src, 'relu')\n    make()\n"
    )
    for setup in (method, nested):
        assert read(lazy(setup), "relu") == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # Bound to relu in the module and to another kernel in a function (or to something else, or in a loop): a
    # name bound more than once, its launch either's (launched, not read).
    naive = f"naive_src = {NAIVE_CODE}\nk = cp.RawKernel(src, 'relu')\n"
    for setup, head in (
        ("def setup():\n    global k\n    k = cp.RawKernel(naive_src, 'naive')\n", naive),
        ("def setup():\n    global k\n    k = make_kernel()\n", "k = cp.RawKernel(src, 'relu')\n"),
        ("def setup(ks):\n    global k\n    for k in ks:\n        pass\n", "k = cp.RawKernel(src, 'relu')\n"),
    ):
        assert launches(lazy(setup, head=head), "relu")
        assert read(lazy(setup, head=head), "relu") is None
    # A number set through `global` is still unknown where read: set at run time, from another scope.
    block = "def setup(t):\n    global T\n    T = t\n"
    launch = "    k((x.size // 256,), (T,), (x, x.size))\n"
    assert read(lazy(made + block, launch), "relu") == SourceLaunch((65536, 1, 1), None, 0)
    assert read(lazy(made + block, launch, "T = 256\n"), "relu") == SourceLaunch((65536, 1, 1), None, 0)


def test_a_handle_first_bound_to_none_is_the_kernel_it_is_later_bound_to() -> None:
    # `k = None` until set up: a name bound twice, so its launch was taken as maybe another's and not read. None
    # is never launched (calling it raises), so a launch that runs is the kernel's.
    made = "def setup():\n    global k\n    k = cp.RawKernel(src, 'relu')\n"
    lazily = (
        "    global k\n    if k is None:\n        k = cp.RawKernel(src, 'relu')\n"
        "    k((x.size // 256,), (256,), (x, x.size))\n"
    )
    for setup, launch, head in (
        (made, "    k((x.size // 256,), (256,), (x, x.size))\n", "k = None\n"),
        (made, "    k((x.size // 256,), (256,), (x, x.size))\n", "k: cp.RawKernel | None = None\n"),
        ("", lazily, "k = None\n"),  # made where it is launched
    ):
        for entry in ("run", "relu"):
            assert read(lazy(setup, launch, head), entry) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # `self.k = None` in __init__, made on first use.
    method = (
        f"import cupy as cp\nsrc = {RELU}\nclass Op:\n    def __init__(self):\n        self.k = None\n"
        "    def __call__(self, x):\n        if self.k is None:\n            self.k = cp.RawKernel(src, 'relu')\n"
        "        self.k((x.size // 256,), (256,), (x, x.size))\n"
    )
    assert read(method, "Op") == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    # Bound to None and to two kernels, or to None and something else: either's, not read.
    other = "def other():\n    global k\n    k = cp.RawKernel(naive_src, 'naive')\n"
    two = lazy(made + other, head=f"naive_src = {NAIVE_CODE}\nk = None\n")
    assert launches(two, "relu") and read(two, "relu") is None
    assert read(lazy(made, head="k = None\nif FALLBACK:\n    k = make_kernel()\n"), "relu") is None
    # Bound to None alone: no launch.
    assert not launches(lazy("", head="k = None\n"), "relu")


GETTER_LAUNCH = "    get()((x.size // 256,), (256,), (x, x.size))\n"


@pytest.mark.parametrize(
    ("getter", "head"),
    [
        (
            "_k = None\ndef get():\n    global _k\n    if _k is None:\n        _k = cp.RawKernel(src, 'relu')\n"
            "    return _k\n",
            "",
        ),
        ("@functools.lru_cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n", "import functools\n"),
        (
            "@functools.lru_cache(maxsize=None)\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
            "import functools\n",
        ),
        ("@functools.cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n", "import functools\n"),
        (
            "@cache\ndef get():\n    k = cp.RawKernel(src, 'relu')\n    return k\n",
            "from functools import cache\n",
        ),
        ("def get():\n    return cp.RawKernel(src, 'relu')\n", ""),  # made anew at each call
        # functools by another name, or its cache imported as one.
        ("@ft.lru_cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n", "import functools as ft\n"),
        (
            "@lru(maxsize=None)\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
            "from functools import lru_cache as lru\n",
        ),
    ],
)
def test_a_kernel_a_getter_returns_is_launched_through_its_call(getter: str, head: str) -> None:
    # `get()(grid, block, args)` named no handle: the source was taken to launch nothing.
    for launch in (GETTER_LAUNCH, "    k = get()\n    k((x.size // 256,), (256,), (x, x.size))\n"):
        for entry in ("run", "relu"):
            assert launches(lazy(getter, launch, head), entry)
            assert read(lazy(getter, launch, head), entry) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize(
    "getter",
    [
        # Another decorator may return anything.
        "@torch.compile\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
        "import fasttools as ft\n@ft.lru_cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
        # Named as functools' caches, but not them: another function imported as `cache`, another module as
        # `functools`, or the name bound otherwise too.
        "from functools import wraps as cache\n@cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
        "import fasttools as functools\n@functools.cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
        "from functools import cache\ncache = make_decorator()\n@cache\ndef get():\n"
        "    return cp.RawKernel(src, 'relu')\n",
        "@cache\ndef get():\n    return cp.RawKernel(src, 'relu')\n",
        # A generator, a coroutine: nothing launchable.
        "def get():\n    yield cp.RawKernel(src, 'relu')\n",
        "async def get():\n    return cp.RawKernel(src, 'relu')\n",
        # `get` bound otherwise too.
        "def get():\n    return cp.RawKernel(src, 'relu')\nget = make_getter()\n",
        # What it returns is not said: a table's, a parameter's.
        "KERNELS = {'relu': cp.RawKernel(src, 'relu')}\ndef get(name):\n    return KERNELS[name]\n",
        "def get(k):\n    return k\n",
    ],
)
def test_a_getter_the_source_does_not_say_is_no_launch(getter: str) -> None:
    assert launches(lazy("def get():\n    return cp.RawKernel(src, 'relu')\n", GETTER_LAUNCH), "relu")
    assert read(lazy(getter, GETTER_LAUNCH), "relu") is None
    assert not launches(lazy(getter, GETTER_LAUNCH), "relu")


def test_a_getter_of_either_kernel_may_launch_either() -> None:
    getter = (
        f"naive_src = {NAIVE_CODE}\n@functools.cache\ndef get(slow):\n"
        "    if slow:\n        return cp.RawKernel(naive_src, 'naive')\n    return cp.RawKernel(src, 'relu')\n"
    )
    source = lazy(getter, "    get(False)((x.size // 256,), (256,), (x, x.size))\n", "import functools\n")
    assert launches(source, "relu") and read(source, "relu") is None
    # One returning itself, or a chain of getters past what is read: no launch, and no recursion error.
    selfish = "def get():\n    return get()\n"
    chain = "def g0():\n    return cp.RawKernel(src, 'relu')\n" + "".join(
        f"def g{i}():\n    return g{i - 1}()\n" for i in range(1, 2_000)
    )
    assert read(lazy(selfish, GETTER_LAUNCH), "relu") is None and not launches(lazy(selfish, GETTER_LAUNCH))
    deep = lazy(chain, "    g1999()((x.size // 256,), (256,), (x,))\n")
    assert launches(deep, "relu") and read(deep, "relu") is None  # may be relu's: not read
    assert read(lazy(chain, "    g3()((x.size // 256,), (256,), (x,))\n"), "relu") == SourceLaunch(
        (65536, 1, 1), (256, 1, 1), 0
    )
    assert (
        fastest_s(lambda: (host_launch._CACHE.clear(), launches(deep, "relu"), read(deep, "relu")), 4.0) < 4.0
    )


def test_a_kernel_python_names_is_not_passed_over_for_one_the_cuda_launches() -> None:
    # Python names two kernels it runs (no one entry); the parent's device-side launch of its child (dynamic
    # parallelism) is no host wrapper choosing the child.
    from forecaster_mcp.forecast.features import embedded_cuda

    code = (
        "r'''__global__ void child(float* x) { x[threadIdx.x] = 0.f; }\n"
        'extern "C" __global__ void parent(float* x) { child<<<1, 32>>>(x); }\n'
        "extern \"C\" __global__ void init(float* x) { x[0] = 1.f; }'''"
    )
    source = (
        f"import cupy as cp\ncode = {code}\n"
        "def run(x):\n    cp.RawKernel(code, 'init')((1,), (1,), (x,))\n"
        "    cp.RawKernel(code, 'parent')((1,), (1,), (x,))\n"
    )
    embedded = embedded_cuda(source, "run")
    assert embedded is not None and embedded.entry is None


def test_reads_a_pycuda_prepared_call() -> None:
    source = (
        "from pycuda.compiler import SourceModule\n"
        f"mod = SourceModule({RELU})\nf = mod.get_function('relu')\nf.prepare('Pi')\n"
        "def run(x, stream):\n    f.prepared_async_call((N // 256, 1), (256, 1, 1), stream, x, N, shared_size=1024)\n"
    )
    assert read(source) == SourceLaunch((65536, 1, 1), (256, 1, 1), 1024)
    assert host_launch.launches_itself(Kernel(source=source, entry="run", language="python"))
    # f.prepare(...) is no launch.
    assert read(source.replace("f.prepared_async_call", "f.prepare")) is None


# ---------------------------------------------------------------- Triton: `kernel[grid](...)`

TRITON_HEAD = "import torch\nimport triton\nimport triton.language as tl\n"
ADD_KERNEL = (
    "def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):\n"
    "    pid = tl.program_id(axis=0)\n"
    "    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)\n"
    "    mask = offs < n_elements\n"
    "    x = tl.load(x_ptr + offs, mask=mask)\n"
    "    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)\n\n"
)


def triton(launch: str, head: str = "", decorators: str = "@triton.jit\n") -> str:
    """Triton's tutorial add: `launch` in the wrapper, after `out` and `n` are made."""
    return (
        f"{TRITON_HEAD}{head}\n{decorators}{ADD_KERNEL}"
        f"def add(x, y):\n    out = torch.empty_like(x)\n    n = out.numel()\n{launch}    return out\n"
    )


def read_triton(
    source: str, language: Language = "triton", workload: Workload | None = WL
) -> SourceLaunch | None:
    return source_launch(Kernel(source=source, entry="add_kernel", language=language), workload)


def programs(grid: tuple[int, ...] | None, warps: int | None = 4) -> SourceLaunch:
    """What a Triton launch reads as: its programs the grid, num_warps warps of 32 threads a block, its shared
    memory the compiler's (unknown)."""
    full = (*grid, 1, 1, 1)[:3] if grid is not None else None
    block = (warps * 32, 1, 1) if warps is not None else None
    return SourceLaunch(full, block, None, warps)  # type: ignore[arg-type]


TUTORIAL = (
    '    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)\n'
    "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1024)\n"
)


@pytest.mark.parametrize(
    ("launch", "head", "expected"),
    [
        (TUTORIAL, "", programs((16384,))),
        (TUTORIAL.replace("=1024)", "=1024, num_warps=8, num_stages=3)"), "", programs((16384,), 8)),
        ("    add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK_SIZE=1024)\n", "", programs((16384,))),
        # The module's constants; a 2-D and a 3-D grid.
        (
            "    grid = (img.shape[0] // BM, img.shape[1] // BN)\n"
            "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=BM * BN, num_warps=WARPS)\n",
            "BM, BN = 32, 64\nWARPS = 2\n",
            programs((64, 64), 2),
        ),
        ("    add_kernel[(4, 8, 2)](x, y, out, n, BLOCK_SIZE=1024)\n", "", programs((4, 8, 2))),
        # META as well as meta; a lambda's default is read where the lambda is made.
        (
            "    grid = lambda META, total=n: (triton.cdiv(total, META['BLOCK_SIZE']),)\n"
            "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=256)\n",
            "",
            programs((65536,)),
        ),
        # meta holds the kernel's arguments by parameter name, positional ones too; the lambda given inline.
        (
            "    add_kernel[lambda m: (triton.cdiv(m['n_elements'], m['BLOCK_SIZE']),)](x, y, out, n, BLOCK_SIZE=512)\n",
            "",
            programs((32768,)),
        ),
        # A def returning the grid.
        (
            "    def grid(meta):\n        block = meta['BLOCK_SIZE']\n        return (triton.cdiv(n, block),)\n"
            "    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1024)\n",
            "",
            programs((16384,)),
        ),
    ],
)
def test_reads_a_triton_launch(launch: str, head: str, expected: SourceLaunch) -> None:
    assert read_triton(triton(launch, head)) == expected
    # A Python source whose entry is a Triton kernel, the same.
    assert read_triton(triton(launch, head), "python") == expected


CONFIGS = (
    "@triton.autotune(configs=[triton.Config({'BLOCK_SIZE': 1024}, num_warps=W1), "
    "triton.Config({'BLOCK_SIZE': B2}, num_warps=8)], key=['n_elements'])\n@triton.jit\n"
)
AUTOTUNED = "    add_kernel[lambda meta: (triton.cdiv(n, meta['BLOCK_SIZE']),)](x, y, out, n)\n"


@pytest.mark.parametrize(
    ("w1", "b2", "expected"),
    [
        ("8", "1024", programs((16384,), 8)),  # every config agrees: what the autotuner picks is known
        ("8", "2048", programs(None, 8)),  # BLOCK_SIZE chosen at run time: the grid unknown
        ("4", "1024", programs((16384,), None)),  # the warps chosen at run time
        ("4", "2048", None),
    ],
)
def test_an_autotuned_kernel_is_read_where_its_configs_agree(
    w1: str, b2: str, expected: SourceLaunch | None
) -> None:
    assert read_triton(triton(AUTOTUNED, decorators=CONFIGS.replace("W1", w1).replace("B2", b2))) == expected
    # A Config's num_warps defaults to 4, as a launch's does.
    default = "@triton.autotune(configs=[triton.Config({'BLOCK_SIZE': 1024})], key=[])\n@triton.jit\n"
    assert read_triton(triton(AUTOTUNED, decorators=default)) == programs((16384,))


@pytest.mark.parametrize(
    ("launch", "decorators", "head"),
    [
        # BLOCK_SIZE set by a heuristic at run time.
        (
            AUTOTUNED,
            "@triton.heuristics({'BLOCK_SIZE': lambda args: triton.next_power_of_2(args['n_elements'])})\n"
            "@triton.jit\n",
            "",
        ),
        # Configs made at run time.
        (AUTOTUNED, "@triton.autotune(configs=make_configs(), key=[])\n@triton.jit\n", ""),
        (
            "    add_kernel[lambda meta: (triton.cdiv(n, meta['B']),)](x, y, out, n, **cfg)\n",
            "@triton.jit\n",
            "",
        ),
        # A size the workload does not say; a name given two values.
        ("    add_kernel[(triton.cdiv(m, 1024),)](x, y, out, n, BLOCK_SIZE=1024)\n", "@triton.jit\n", ""),
        (
            "    b = 1024\n    b = 512\n    add_kernel[(triton.cdiv(n, b),)](x, y, out, n, BLOCK_SIZE=b)\n",
            "@triton.jit\n",
            "",
        ),
        # Clusters of CTAs (num_ctas=2): more blocks than programs.
        (TUTORIAL.replace("=1024)", "=1024, num_ctas=2)"), "@triton.jit\n", ""),
        # A grid that is no tuple; a grid lambda Triton could not call with meta.
        ("    add_kernel[n // 1024](x, y, out, n, BLOCK_SIZE=1024)\n", "@triton.jit\n", ""),
        ("    add_kernel[lambda: (n // 1024,)](x, y, out, n, BLOCK_SIZE=1024)\n", "@triton.jit\n", ""),
        # Two launches that disagree.
        (
            TUTORIAL + "    add_kernel[(1,)](x, y, out, n, BLOCK_SIZE=1024)\n",
            "@triton.jit\n",
            "",
        ),
    ],
)
def test_what_a_triton_source_does_not_say_plainly_is_unknown(
    launch: str, decorators: str, head: str
) -> None:
    found = read_triton(triton(launch, head, decorators))
    assert found is None or found.grid is None


@pytest.mark.parametrize(
    "decorators",
    [
        "@numba.cuda.jit\n",  # numba's `kernel[blocks, threads](...)`: its block is no num_warps
        "@cuda.jit\n",
        "@jit\n",  # a `jit` not imported from triton
        "@triton.jit\n@my_wrapper\n",  # a decorator that may launch it otherwise
        "",  # no kernel at all
    ],
)
def test_only_a_triton_kernel_launch_is_read_as_one(decorators: str) -> None:
    source = triton("    add_kernel[(n // 1024,), (256,)](x, y, out, n)\n" + TUTORIAL, decorators=decorators)
    assert read_triton(source, "python") is None
    assert not host_launch.launches_itself(Kernel(source=source, entry="add_kernel", language="python"))


def test_a_triton_jit_imported_by_another_name_is_read() -> None:
    source = triton(TUTORIAL, decorators="@tr.jit\n").replace("import triton\n", "import triton as tr\n")
    assert read_triton(source) == programs((16384,))
    source = triton(TUTORIAL, decorators="@jit\n").replace(
        "import triton\n", "import triton\nfrom triton import jit\n"
    )
    assert read_triton(source) == programs((16384,))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Config(kwargs, num_warps=4, num_stages=3, num_ctas=1): num_warps is its second positional parameter.
        ("triton.Config({'BLOCK_SIZE': 1024}, 8)", programs((16384,), 8)),
        ("triton.Config({'BLOCK_SIZE': 1024}, 8, 3, 2)", programs(None, 8)),
        ("triton.Config({'BLOCK_SIZE': 1024}, *OPTIONS)", None),
        # A `num_warps` in its kwargs is a meta-parameter: the Config's own num_warps (4) is the launch's.
        ("triton.Config({'BLOCK_SIZE': 1024, 'num_warps': 8})", programs((16384,), 4)),
    ],
)
def test_an_autotune_config_s_options_are_read_as_triton_reads_them(
    config: str, expected: SourceLaunch | None
) -> None:
    """`triton.Config({...}, 8)` was read as 4 warps (its positional num_warps passed over), and a `num_warps` in
    its kwargs as the launch's."""
    decorators = f"@triton.autotune(configs=[{config}], key=[])\n@triton.jit\n"
    assert read_triton(triton(AUTOTUNED, head="OPTIONS = (8,)\n", decorators=decorators)) == expected


@pytest.mark.parametrize(
    "change",
    [
        "CONFIGS.append(triton.Config({'BLOCK_SIZE': 256}, num_warps=2))",
        "CONFIGS.extend(more)",
        "CONFIGS[0] = triton.Config({'BLOCK_SIZE': 256}, num_warps=2)",
        "CONFIGS += [triton.Config({'BLOCK_SIZE': 256}, num_warps=2)]",
        "prune(CONFIGS)",
    ],
)
def test_autotune_configs_changed_after_they_are_made_are_unknown(change: str) -> None:
    """`CONFIGS = [...]` then `CONFIGS.append(...)`: the autotuner picks among every config, but the list was read
    as written (a launch of 8 warps and BLOCK_SIZE 1024 where one of 2 warps and 256 may run)."""
    head = f"CONFIGS = [triton.Config({{'BLOCK_SIZE': 1024}}, num_warps=8)]\n{change}\n"
    decorators = "@triton.autotune(configs=CONFIGS, key=['n_elements'])\n@triton.jit\n"
    assert read_triton(triton(AUTOTUNED, head=head, decorators=decorators)) is None
    # Shared by two kernels' autotune, and not changed: read.
    other = "@triton.autotune(configs=CONFIGS, key=[])\n@triton.jit\ndef other_kernel(x_ptr):\n    pass\n"
    head = "CONFIGS = [triton.Config({'BLOCK_SIZE': 1024}, num_warps=8)]\n" + other
    assert read_triton(triton(AUTOTUNED, head=head, decorators=decorators)) == programs((16384,), 8)


def test_a_grid_function_reading_a_launch_argument_many_times_stays_cheap() -> None:
    """A grid function's `meta['a']` is the launch's argument, read again at each: 2,048 of them of an argument of
    2,048 terms took 5 s in a 27 KB source (20 s near 64 KB)."""

    def balanced(leaf: str, count: int) -> str:
        items = [leaf] * count
        while len(items) > 1:
            items = [f"({a}+{b})" for a, b in zip(items[::2], items[1::2], strict=True)]
        return items[0]

    grid, argument = balanced("m['a']", 2048), balanced("1", 2048)
    source = (
        f"{TRITON_HEAD}@triton.jit\ndef k(a, B: tl.constexpr):\n    pass\n\n"
        f"def run(x):\n    k[lambda m: ({grid},)]({argument}, 4)\n"
    )
    kernel = Kernel(source=source, entry="k", language="triton")
    assert fastest_s(lambda: (host_launch._CACHE.clear(), source_launch(kernel, WL)), 2.0) < 2.0
    assert source_launch(kernel, WL) == programs((2048 * 2048,))


def test_hostile_triton_launches_are_unknown_and_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    deep = "min(" * 150 + "n" + ", n)" * 150
    sums = "1" + "+1" * 600
    for launch in (
        # Calls of anything: nothing is run or imported.
        f"    add_kernel[lambda meta: (open({str(marker)!r}, 'w').write('x'),)](x, y, out, n, BLOCK_SIZE=1)\n",
        "    add_kernel[lambda meta: (__import__('os').system('true'),)](x, y, out, n, BLOCK_SIZE=1)\n",
        "    add_kernel[lambda meta: (meta['g'](),)](x, y, out, n, BLOCK_SIZE=1, g=print)\n",
        # Deep nesting; huge numbers.
        f"    add_kernel[({deep} // 1024,)](x, y, out, n, BLOCK_SIZE=1024, num_warps={sums})\n",
        "    add_kernel[(10 ** 30,)](x, y, out, n, BLOCK_SIZE=1, num_warps=2 ** 70)\n",
        "    add_kernel[(1 << 62,)](x, y, out, n, BLOCK_SIZE=1, num_warps=1 << 40)\n",
        # A grid defined by itself.
        "    def grid(meta):\n        return grid(meta)\n    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1)\n",
        "    grid = lambda meta, g=grid: g\n    add_kernel[grid](x, y, out, n, BLOCK_SIZE=1)\n",
    ):
        source = triton(launch)
        assert fastest_s(lambda source=source: (host_launch._CACHE.clear(), read_triton(source)), 2.0) < 2.0
        found = read_triton(source)
        # The block is the default 4 warps where num_warps is not given.
        assert found is None or (found.grid is None and found == programs(None)), launch
    assert not marker.exists()
    # Just under the 64 KB a source is parsed up to: 1,000 configs; 500 launches, none read past MAX_SITES.
    configs = "".join(
        f"    triton.Config({{'BLOCK_SIZE': {1 << (i % 10)}}}, num_warps=4),\n" for i in range(1000)
    )
    tuned = triton(AUTOTUNED, decorators=f"@triton.autotune(configs=[\n{configs}], key=[])\n@triton.jit\n")
    launched = triton(TUTORIAL * 500)
    for source in (tuned, launched):
        assert len(source) < 64 * 1024
        assert fastest_s(lambda source=source: (host_launch._CACHE.clear(), read_triton(source)), 2.0) < 2.0
        found = read_triton(source)
        assert found is None or found.grid is None
    assert read_triton(launched) is None


def test_a_triton_kernels_features_take_the_launch_its_source_gives() -> None:
    kernel = Kernel(source=triton(TUTORIAL), entry="add_kernel", language="triton")
    f = kernel_features(kernel, WL, lookup("H100"), None)
    assert (f.threads_per_block, f.blocks) == (128, 16384)
    assert f.launch_from_source == "grid [16384, 1, 1], num_warps 4"
    assert f.occupancy is not None and f.waves is not None
    # On AMD a warp is a wavefront of 64 threads: four are 256.
    assert kernel_features(kernel, WL, lookup("MI300X"), None).threads_per_block == 256
    assert host_launch.launches_itself(kernel)


@pytest.mark.anyio
async def test_compare_kernels_forecasts_a_triton_pair_from_the_launches_its_sources_give(
    tmp_path: Path,
) -> None:
    """Two Triton kernels sent without launches: the prior's work-per-thread term reads the programs and warps
    their wrappers launch (16,384 programs of 4 warps against 65,536 of 8: eight times the threads), and the
    rationale says where that came from. Before, neither launch was read: no informative static difference."""
    wide = TUTORIAL.replace("=1024)", "=256, num_warps=8)")
    workload = WL.model_dump(mode="json")
    candidates = [
        {"id": "base", "source": triton(TUTORIAL), "entry": "add_kernel", "language": "triton"},
        {"id": "wide", "source": triton(wide), "entry": "add_kernel", "language": "triton"},
    ]
    service = await Service.open(Settings.from_env(home=tmp_path, measurer="none"))
    try:
        async with Client(build_server(service)) as client:
            out = await call(
                client,
                "compare_kernels",
                {"candidates": candidates, "hardware": "H100", "workload": workload},
            )
    finally:
        await service.close()
    (result,) = [r for r in out["candidates"] if r["id"] == "wide"]
    rationale = result["rationale"]
    assert "more work per thread" in rationale, rationale
    assert (
        "launch read from the source's host code: baseline's grid [16384, 1, 1], num_warps 4; "
        "candidate's grid [65536, 1, 1], num_warps 8"
    ) in rationale
    assert result["p_faster"] < 0.5  # eight times the threads for the same work: the baseline is favoured


DEFAULTED = cupy("    n = x.size\n    k(((n + block - 1) // block,), (block,), (x, n))").replace(
    "def run(x)", "def run(x, block=256)"
)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # called from outside only (a harness passes the workload's inputs): the default
        (DEFAULTED, SourceLaunch((65536, 1, 1), (256, 1, 1), 0)),
        (
            DEFAULTED.replace("run(x, block=256)", "run(x, *, block=256)"),
            SourceLaunch((65536, 1, 1), (256, 1, 1), 0),
        ),
        # every call in the module leaves it out
        (DEFAULTED + "\nrun(cp.zeros(16))\n", SourceLaunch((65536, 1, 1), (256, 1, 1), 0)),
        # a call passing it, by position, keyword or unpacking: the caller's
        (DEFAULTED + "\nrun(cp.zeros(16), 128)\n", None),
        (DEFAULTED + "\nrun(cp.zeros(16), block=128)\n", None),
        (DEFAULTED + "\nrun(*args)\n", None),
        # changed in the function: not the default
        (DEFAULTED.replace("    n = x.size\n", "    n = x.size\n    block = 128\n"), None),
    ],
)
def test_a_default_no_call_in_the_module_passes_is_the_parameter_s_value(
    source: str, expected: SourceLaunch | None
) -> None:
    assert read(source) == expected


# A CuPy launch in a method with a defaulted block, called through self.
METHOD = (
    f'import cupy as cp\nk = cp.RawKernel({RELU}, "relu")\n\nclass Op:\n'
    "    def launch(self, x, block=512):\n        k((x.size // block,), (block,), (x, x.size))\n"
    "    def run(self, x):\n        self.launch(x)\n"
)


def test_a_method_s_default_counts_its_calls_through_self() -> None:
    method = METHOD
    assert read(method, "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)
    # passed 128 by its one call: 128
    assert read(method.replace("self.launch(x)", "self.launch(x, 128)"), "Op") == SourceLaunch(
        (131072, 1, 1), (128, 1, 1), 0
    )
    assert read(method.replace("self.launch(x)", "self.launch(x)\n        self.launch(x, 128)"), "Op") is None
    # torch's `model(x, 128)` calls `forward(self, x, block)`: passed.
    module = method.replace("def launch(", "def forward(").replace("self.launch(x)", "pass")
    assert read(module + "\nm = Op()\nm(cp.zeros(16))\n", "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)
    assert read(module + "\nm = Op()\nm(cp.zeros(16), 128)\n", "Op") is None
    assert read(module + "\nOp()(cp.zeros(16), 128)\n", "Op") is None


def test_a_triton_wrapper_s_default_is_its_value() -> None:
    wrapper = triton(
        "    add_kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK_SIZE=BLOCK, num_warps=W)\n"
    )
    wrapper = wrapper.replace("def add(x, y):", "def add(x, y, BLOCK=512, W=8):")
    assert read_triton(wrapper) == programs((32768,), 8)
    # the wrapper's one call passes 256: its BLOCK, where the wrapper is not the entry the harness calls itself
    assert read_triton(wrapper + "\nadd(a, b, 256)\n") == programs((65536,), 8)
    as_entry = Kernel(source=wrapper + "\nadd(a, b, 256)\n", entry="add", language="triton")
    assert source_launch(as_entry, WL) == programs(None, 8)
    assert read_triton(wrapper + "\nadd(a, b, 256)\nadd(a, b, 128)\n") == programs(None, 8)


@pytest.mark.parametrize(
    ("default", "head", "launch", "decorators", "expected"),
    [
        # Not passed: Triton binds the parameter's default into meta.
        ("1024", "", AUTOTUNED, "@triton.jit\n", programs((16384,))),
        ("BLOCK", "BLOCK = 2048\n", AUTOTUNED, "@triton.jit\n", programs((8192,))),
        # Passed by the launch, or set by autotune's configs: theirs.
        (
            "1024",
            "",
            AUTOTUNED.replace("out, n)", "out, n, BLOCK_SIZE=256)"),
            "@triton.jit\n",
            programs((65536,)),
        ),
        ("1024", "", AUTOTUNED.replace("out, n)", "out, n, 512)"), "@triton.jit\n", programs((32768,))),
        (
            "1024",
            "",
            AUTOTUNED,
            "@triton.autotune(configs=[triton.Config({'BLOCK_SIZE': 512})], key=[])\n@triton.jit\n",
            programs((32768,)),
        ),
        # Neither a literal nor a module constant: unknown.
        ("make_block()", "", AUTOTUNED, "@triton.jit\n", programs(None)),
        ("BLOCK", "BLOCK = 2048\nBLOCK = 512\n", AUTOTUNED, "@triton.jit\n", programs(None)),
        ("BLOCK", "from cfg import BLOCK\n", AUTOTUNED, "@triton.jit\n", programs(None)),
    ],
)
def test_a_triton_kernel_s_parameter_default_is_in_meta(
    default: str, head: str, launch: str, decorators: str, expected: SourceLaunch
) -> None:
    """`def add_kernel(..., BLOCK_SIZE: tl.constexpr = 1024)` launched without BLOCK_SIZE: Triton's meta holds
    the default, and the grid `cdiv(n, meta['BLOCK_SIZE'])` was read as unknown."""
    source = triton(launch, head, decorators).replace(
        "BLOCK_SIZE: tl.constexpr):", f"BLOCK_SIZE: tl.constexpr = {default}):"
    )
    assert read_triton(source) == expected


MATMUL = (
    f"{TRITON_HEAD}\n@triton.jit\n"
    "def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,\n"
    "                  BLOCK_K: tl.constexpr):\n"
    "    pid_m = tl.program_id(0)\n    pid_n = tl.program_id(1)\n"
    "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)\n"
    "    for k in range(0, K, BLOCK_K):\n"
    "        a = tl.load(a_ptr + tl.arange(0, BLOCK_M)[:, None] * K + tl.arange(0, BLOCK_K)[None, :] + k)\n"
    "        b = tl.load(b_ptr + tl.arange(0, BLOCK_K)[:, None] * N + tl.arange(0, BLOCK_N)[None, :] + k * N)\n"
    "        acc += DOT\n"
    "    tl.store(c_ptr + tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :], acc)\n\n"
    "def matmul(a, b, c):\n"
    "    matmul_kernel[(2048 // 128, 4096 // 128)](a, b, c, 2048, 4096, 4096, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32,\n"
    "                                              num_warps=8, num_stages=4)\n"
)


@pytest.mark.parametrize("dot", ["tl.dot(a, b)", "tl.dot(a, b, input_precision='ieee')"])
def test_a_triton_kernel_staging_tl_dot_tiles_has_no_occupancy_counted(dot: str) -> None:
    """Triton stages a tl.dot's tiles in shared memory (num_stages of BLOCK_M x BLOCK_K and BLOCK_K x BLOCK_N: 64
    KiB here in fp16), the compiler's choice and not read: the occupancy of a kernel using none (a block of 256
    threads, 8 a SM on H100) overstated it, and its waves with it."""
    kernel = Kernel(source=MATMUL.replace("DOT", dot), entry="matmul_kernel", language="triton")
    f = kernel_features(kernel, WL, lookup("H100"), None)
    assert (f.threads_per_block, f.blocks) == (256, 16 * 32)  # the launch is read
    assert f.occupancy is None and f.waves is None and f.sm_utilisation is None
    # A kernel without tl.dot (the tutorial's add) keeps its occupancy: Triton gives it no shared memory to stage.
    add = Kernel(source=triton(TUTORIAL), entry="add_kernel", language="triton")
    assert kernel_features(add, WL, lookup("H100"), None).occupancy is not None
    # Nor does another kernel's tl.dot in the same file count.
    both = Kernel(source=triton(TUTORIAL) + MATMUL.replace("DOT", dot), entry="add_kernel", language="triton")
    assert kernel_features(both, WL, lookup("H100"), None).occupancy is not None


def test_a_triton_wrapper_sent_as_the_entry_is_read_by_the_kernel_it_launches() -> None:
    """`entry="add"`, the Python wrapper launching `add_kernel[grid](...)`, had no launch read (no `add[`), though
    the harness runs it and it launches one Triton kernel."""
    wrapper = Kernel(source=triton(TUTORIAL), entry="add", language="triton")
    assert source_launch(wrapper, WL) == programs((16384,))
    assert source_launch(wrapper.model_copy(update={"language": "python"}), WL) == programs((16384,))
    assert host_launch.launches_itself(wrapper)
    # The kernel's body is read with it: its tl.dot, and the shared memory that stages it (no occupancy).
    matmul = Kernel(source=MATMUL.replace("DOT", "tl.dot(a, b)"), entry="matmul", language="triton")
    f = kernel_features(matmul, WL, lookup("H100"), None)
    assert (f.threads_per_block, f.blocks, f.source.tensor_core) == (256, 512, 1)
    assert f.occupancy is None


@pytest.mark.parametrize(
    "body",
    [
        # Two kernels, or one launched many times: not one launch.
        TUTORIAL + "    other_kernel[(1,)](x)\n",
        "    for i in range(4):\n" + TUTORIAL.replace("    ", "        "),
        "    [add_kernel[(16384,)](x, y, out, n, BLOCK_SIZE=1024) for _ in range(4)]\n",
        # A subscript call of anything else; a launch in a function of its own.
        TUTORIAL + "    ops[0](x)\n",
        "    def go():\n" + TUTORIAL.replace("    ", "        ") + "    go()\n",
        # A kernel of its own named so; no launch at all.
        "    add_kernel = make()\n" + TUTORIAL,
        "    pass\n",
    ],
)
def test_a_triton_wrapper_not_launching_one_kernel_once_is_not_read(body: str) -> None:
    other = "@triton.jit\ndef other_kernel(x_ptr):\n    pass\n"
    source = triton(body, head=other)
    assert source_launch(Kernel(source=source, entry="add", language="triton"), WL) is None


@pytest.mark.parametrize(
    ("launch", "expected"),
    [
        # JITFunction.run(*args, grid=..., warmup=False, **kwargs): what `kernel[grid](...)` calls.
        (
            "    add_kernel.run(x, y, out, n, grid=lambda meta: (triton.cdiv(n, meta['BLOCK_SIZE']),), warmup=False,\n"
            "                   BLOCK_SIZE=1024, num_warps=8)\n",
            programs((16384,), 8),
        ),
        (
            "    add_kernel.run(x, y, out, n, BLOCK_SIZE=256, grid=(n // 256,), warmup=False)\n",
            programs((65536,)),
        ),
        # A warmup compiles and launches nothing; a warmup not known may be either.
        (
            "    add_kernel.run(x, y, out, n, BLOCK_SIZE=256, grid=(1,), warmup=True)\n" + TUTORIAL,
            programs((16384,)),
        ),
        ("    add_kernel.run(x, y, out, n, BLOCK_SIZE=256, grid=(1,), warmup=w)\n" + TUTORIAL, None),
    ],
)
def test_a_triton_kernel_s_run_is_a_launch(launch: str, expected: SourceLaunch | None) -> None:
    """`add_kernel.run(..., grid=..., warmup=False)` launched it unread."""
    assert read_triton(triton(launch)) == expected


def test_a_triton_kernel_only_warmed_up_is_not_launched_by_its_source() -> None:
    """`add_kernel.run(..., warmup=True)` compiles it and launches nothing, yet the prompt said the source's host
    code launches it."""
    warmed = triton("    add_kernel.run(x, y, out, n, BLOCK_SIZE=256, grid=(1,), warmup=True)\n")
    assert not host_launch.launches_itself(Kernel(source=warmed, entry="add_kernel", language="triton"))
    unknown = triton("    add_kernel.run(x, y, out, n, BLOCK_SIZE=256, grid=(1,), warmup=w)\n")
    assert host_launch.launches_itself(Kernel(source=unknown, entry="add_kernel", language="triton"))


@pytest.mark.parametrize(
    "use",
    [
        "import functools\nrun128 = functools.partial(run, block=128)\n",
        "results = list(map(run, [cp.zeros(16)]))\n",
        "import torch\nfast = torch.compile(run)\n",
        "callbacks = [run]\n",
        "class Holder:\n    def __init__(self):\n        self.fn = run\n",
        "fn = run\nfn(cp.zeros(16), 128)\n",
    ],
)
def test_a_function_passed_as_a_value_has_callers_not_seen(use: str) -> None:
    """`functools.partial(run, block=128)`, `map(run, xs)`, `self.fn = run`: its callers are not the calls of its
    name, so its defaults are not its values (`block` read as its default 256 where `partial` passes 128)."""
    assert read(DEFAULTED + use) is None
    # its own calls alone, or none in the module (an entry called from outside): the default
    assert read(DEFAULTED + "\nrun(cp.zeros(16))\n") == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def test_a_method_or_instance_passed_as_a_value_has_callers_not_seen() -> None:
    method = METHOD
    assert read(method, "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)
    assert read(method + "    def hook(self):\n        self.cb = self.launch\n", "Op") is None
    module = method.replace("def launch(", "def forward(").replace("self.launch(x)", "pass")
    assert read(module + "\nm = Op()\nm(cp.zeros(16))\n", "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)
    assert read(module + "\nm = Op()\nimport torch\nfast = torch.compile(m)\n", "Op") is None


# A helper launching the kernel with the block it is passed, called from the entry's forward (CALL).
HELPER = (
    f'import cupy as cp\nk = cp.RawKernel({RELU}, "relu")\nHEAD\n'
    "def _launch(x, out, block):\n    k(((x.size + block - 1) // block,), (block,), (x, out, x.size))\n\n"
    "class ModelNew:\n    def forward(self, x):\n        out = cp.empty_like(x)\n        CALL\n"
    "        return out\n"
)
# The helper a method of the entry's class, called through self.
METHOD_HELPER = (
    f'import cupy as cp\nk = cp.RawKernel({RELU}, "relu")\n\n'
    "class ModelNew:\n    def forward(self, x):\n        out = cp.empty_like(x)\n        CALL\n"
    "        return out\n\n    def _launch(self, x, out, block):\n"
    "        k(((x.size + block - 1) // block,), (block,), (x, out, x.size))\n"
)
PASSED = SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def helper(call: str = "_launch(x, out, 256)", head: str = "") -> str:
    return HELPER.replace("CALL", call).replace("HEAD", head)


@pytest.mark.parametrize(
    "source",
    [
        helper(),
        helper("_launch(x, out, block=256)"),
        helper("_launch(x, out, 2 * 128)"),
        helper("_launch(x, out, BLOCK)", "BLOCK = 256\n"),
        helper("_launch(x, out, BLOCK * 2)", "WARP = 32\nBLOCK = WARP * 4\n"),
        # a default counts for the calls that leave it out, the same value as the rest pass
        helper("_launch(x, out)\n        _launch(x, out, 256)").replace(
            "def _launch(x, out, block):", "def _launch(x, out, block=256):"
        ),
        # a method called through self
        METHOD_HELPER.replace("CALL", "self._launch(x, out, 256)"),
        METHOD_HELPER.replace("CALL", "self._launch(x, out, block=256)"),
    ],
)
def test_a_parameter_every_caller_passes_as_one_constant_is_that_constant(source: str) -> None:
    """`_launch(x, out, 256)` from the entry's forward: the block is 256 (it was unknown: a parameter with no
    default is only what the workload says)."""
    assert read(source, "ModelNew") == PASSED


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (helper("_launch(x, out, 256)\n        _launch(x, out, 128)"), "callers disagree"),
        (helper("b = x.size // 4\n        _launch(x, out, b)"), "a value known at run time"),
        (helper("BLOCK = 128\n        _launch(x, out, BLOCK)", "BLOCK = 256\n"), "the caller's own BLOCK"),
        (
            helper("_launch(x, out, block)").replace("def forward(self, x)", "def forward(self, x, block)"),
            "the caller's parameter",
        ),
        (helper("k(((x.size + 255) // 256,), (256,), (x, out, x.size))"), "no call of the helper"),
        (helper() + "\nfn = _launch\n", "used as a value"),
        (helper() + "\nimport functools\nfast = functools.partial(_launch, block=128)\n", "passed"),
        (helper() + '\nlaunch = getattr(__import__(__name__), "_launch")\n', "looked up by name"),
        (helper().replace("def _launch(", "@cp.fuse()\ndef _launch("), "decorated"),
        (helper().replace("def _launch(x, out, block):", "def _launch(x, out, block, *rest):"), "*args"),
        (helper().replace("def _launch(x, out, block):", "def _launch(x, out, block, **opts):"), "**kwargs"),
        (helper("_launch(*(x, out, 256))"), "an unpacked call"),
        (helper("_launch(x, out, **{'block': 256})"), "a ** call"),
        (
            helper().replace(
                "def _launch(x, out, block):\n", "def _launch(x, out, block):\n    block = min(block, 128)\n"
            ),
            "changed in its own function",
        ),
        (
            helper().replace(
                "def _launch(x, out, block):\n",
                "def _launch(x, out, block):\n    if x.size > 4096:\n        return _launch(x[:4096], out, 256)\n",
            ),
            "recursive",
        ),
    ],
)
def test_a_parameter_whose_callers_do_not_agree_on_a_constant_is_unknown(source: str, why: str) -> None:
    """Each is unknown; the same helper with the entry's `_launch(x, out, 256)` alone is 256."""
    assert read(helper(), "ModelNew") == PASSED
    found = read(source, "ModelNew")
    assert found is None or found.block is None, why


def test_the_entry_s_parameter_is_not_its_self_test_s_constant() -> None:
    """A module's self-test calling the entry (`run(x, 128)` under `__main__`) is not how the harness calls it;
    a helper it calls keeps its callers' constant."""
    entry = cupy("    n = x.size\n    k(((n + block - 1) // block,), (block,), (x, n))").replace(
        "def run(x)", "def run(x, block)"
    )
    main = '\nif __name__ == "__main__":\n    run(cp.zeros(16), 256)\n'
    assert read(entry + main) is None
    wrapped = entry.replace("def run(x, block)", "def _run(x, block)") + "\ndef run(x):\n    _run(x, 256)\n"
    assert read(wrapped + main.replace("run(cp.zeros(16), 256)", "run(cp.zeros(16))")) == PASSED
    # the entry class's forward, called with a block from outside: the caller's
    method = helper("_launch(x, out, block)").replace("def forward(self, x)", "def forward(self, x, block)")
    assert read(method + "\nm = ModelNew()\nm(cp.zeros(16), 256)\n", "ModelNew") is None


def test_callers_passing_constants_are_read_cheaply() -> None:
    """Past 64 calls of one name nothing is read of them (unknown); 60 callers after 1,500 functions (55 KB, near
    the 64 KB parse bound) are read once each."""
    launcher = helper("c0(x, out)", "BLOCK = 256\n")
    many = launcher + "".join(f"def c{i}(x, o):\n    _launch(x, o, BLOCK)\n" for i in range(1400))
    wide = (
        launcher
        + "".join(f"def f{i}(a, b=1):\n    g(a, b, 2)\n" for i in range(1500))
        + "".join(f"def c{i}(x, o):\n    _launch(x, o, BLOCK)\n" for i in range(60))
    )
    assert read(many, "ModelNew") is None
    assert read(wide, "ModelNew") == PASSED

    def both() -> None:
        for source in (many, wide):
            host_launch._CACHE.clear()
            read(source, "ModelNew")

    assert fastest_s(both, 5.0) < 5.0  # 0.5 s


# ---------------------------------------------------------------- launches the walk did not see


def test_a_launch_in_a_lambda_is_one_of_the_kernel_s_launches() -> None:
    """`triton.testing.do_bench(lambda: add_kernel[(1,)](...))`, an agent's benchmark of a smaller launch, was
    not seen (calls in a lambda were not walked): the wrapper's grid read as the kernel's only one."""
    bench = "def bench(x, y, out):\n    triton.testing.do_bench(lambda: add_kernel[(1,)](x, y, out, 16, BLOCK_SIZE=16))\n"
    assert read_triton(triton(TUTORIAL) + bench) == programs(None)
    at_top = "x = y = out = None\nms = triton.testing.do_bench(lambda: add_kernel[(1,)](x, y, out, 16))\n"
    assert read_triton(triton(TUTORIAL) + at_top) == programs(None)
    # One that agrees, read in the wrapper's scope around it: the same launch.
    agreeing = (
        TUTORIAL + "    triton.testing.do_bench(lambda: add_kernel[grid](x, y, out, n, BLOCK_SIZE=1024))\n"
    )
    assert read_triton(triton(agreeing)) == programs((16384,))
    # A CuPy launch alike.
    timed = "def bench(x):\n    timeit(lambda: k((1,), (32,), (x, 32)))\n"
    assert read(cupy("    k((N // 256,), (256,), (x, N))") + timed) is None
    inline = "    f = lambda: k((N // 256,), (256,), (x, N))\n    f()"
    assert read(cupy(inline)) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    assert launches(cupy(inline), "relu")


@pytest.mark.parametrize(
    "body",
    [
        "    f = lambda n: k(((n + 255) // 256,), (256,), (x, n))\n    f(1024)",
        "    f = lambda x: k(((x.size + 255) // 256,), (256,), (x, x.size))\n    f(cp.zeros(1024))",
        "    timeit(lambda n: k(((n + 255) // 256,), (256,), (x, n)), 1024)",
    ],
)
def test_a_lambda_s_parameter_is_not_the_workload_s(body: str) -> None:
    """A lambda's parameters are what its callers pass, not seen: one named as a workload size or buffer (`n`,
    `x`) was read as the workload's, a benchmark's `f(1024)` launch given the workload's grid (65536)."""
    assert read(cupy(body)) == SourceLaunch(None, (256, 1, 1), 0)


SMALL_LAUNCH = "[(1,)](x, y, out, 16, BLOCK_SIZE=16)\n"


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        # An alias in another function: its launch read, and it disagrees.
        ("def small(x, y, out):\n    k = add_kernel\n    k" + SMALL_LAUNCH, programs(None)),
        ("K = add_kernel\ndef small(x, y, out):\n    K" + SMALL_LAUNCH, programs(None)),
        # Held by an attribute, passed to a launcher, kept in a table: launches not read, any launch.
        (
            "class Small:\n    def __init__(self):\n        self.kernel = add_kernel\n"
            "    def __call__(self, x, y, out):\n        self.kernel" + SMALL_LAUNCH,
            None,
        ),
        (
            "def launch(kern, x, y, out):\n    kern"
            + SMALL_LAUNCH
            + "def small(x, y, out):\n    launch(add_kernel, x, y, out)\n",
            None,
        ),
        ("KERNELS = {'add': add_kernel}\ndef small(x, y, out):\n    KERNELS['add']" + SMALL_LAUNCH, None),
        # A launcher held or passed (`add_kernel[(1,)]` kept, wrapped in a partial): its launch not read, any.
        (
            "def small(x, y, out):\n    launch = add_kernel[(1,)]\n    launch(x, y, out, 16, BLOCK_SIZE=16)\n",
            None,
        ),
        (
            "import functools\ndef small(x, y, out):\n"
            "    functools.partial(add_kernel[(1,)], x, y)(out, 16, BLOCK_SIZE=16)\n",
            None,
        ),
    ],
)
def test_a_triton_kernel_launched_through_another_name_is_one_of_its_launches(
    other: str, expected: SourceLaunch | None
) -> None:
    """`k = add_kernel; k[(1,)](...)`, `self.kernel[(1,)]`, `launch(add_kernel, ...)`: a launch by another name
    was not seen, and the wrapper's grid read as the kernel's only one."""
    assert read_triton(triton(TUTORIAL) + other) == expected


@pytest.mark.parametrize(
    "launch",
    [
        "    k = add_kernel\n    k[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK_SIZE=1024)\n",
        "    K[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK_SIZE=1024)\n",
    ],
)
def test_a_triton_kernel_launched_by_an_alias_alone_is_read(launch: str) -> None:
    source = triton(launch).replace("def add(", "K = add_kernel\n\ndef add(")
    assert read_triton(source) == programs((16384,))
    assert host_launch.launches_itself(Kernel(source=source, entry="add_kernel", language="triton"))
    # An alias bound to the kernel and to another: either's launch.
    either = source.replace("def add(", "if SLOW:\n    K = other_kernel\n\ndef add(").replace(
        "    k = add_kernel\n", "    k = add_kernel if FAST else other_kernel\n"
    )
    assert read_triton(either) in (None, programs(None, None), programs(None))


def test_a_triton_kernel_s_many_aliases_are_read_cheaply() -> None:
    aliases = "".join(
        f"def f{i}(x, y, out):\n    k{i} = add_kernel\n    k{i}[(1,)](x, y, out, 16)\n" for i in range(750)
    )
    source = triton(TUTORIAL) + aliases
    assert len(source) < 64 * 1024  # all of it parsed
    assert read_triton(source) is None  # more launches than are read

    def both() -> None:
        host_launch._CACHE.clear()
        read_triton(source)
        host_launch.launches_itself(Kernel(source=source, entry="add_kernel", language="triton"))

    assert fastest_s(both, 3.0) < 3.0  # 0.3 s


MODULE = METHOD.replace("def launch(", "def forward(").replace("self.launch(x)", "pass")


@pytest.mark.parametrize(
    "made",
    [
        "m = Op().cuda()\n",  # torch's Module.cuda(), .to(...), .eval() return the instance itself
        "m = Op().eval().to('cuda')\n",
        "import torch\nm = torch.compile(Op())\n",  # an instance passed: called with anything
        "import torch\nmodels = [Op()]\nm = models[0]\n",
        # Moved, then passed on: called with anything.
        "import torch\nm = torch.compile(Op().cuda())\n",
        "import torch\nmodels = [Op().to('cuda')]\nm = models[0]\n",
    ],
)
def test_an_instance_made_and_then_wrapped_or_moved_counts_its_calls(made: str) -> None:
    """`m = Op().cuda(); m(x, 128)`: m was taken as no instance of Op, so the call passing forward's block went
    uncounted and its default 512 was read, where plain `m = Op()` leaves it unknown."""
    assert read(MODULE + "\nm = Op()\nm(cp.zeros(16), 128)\n", "Op") is None
    assert read(MODULE + "\n" + made + "m(cp.zeros(16), 128)\n", "Op") is None
    # Moved but called with no block: the default.
    moved = MODULE + "\nm = Op().cuda()\nm(cp.zeros(16))\n"
    assert read(moved, "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)
    # An instance of a class none of whose instances is called, passed on: no call of forward.
    settings = "class Settings:\n    pass\n\ndef configure(s):\n    pass\n\nconfigure(Settings())\n"
    assert read(MODULE + settings, "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0)


@pytest.mark.parametrize(
    "made",
    [
        "M = Op\nM()(cp.zeros(16), 128)\n",
        "M = Op\nm = M()\nm(cp.zeros(16), 128)\n",
        "def make(cls):\n    return cls()\n\nmake(Op)(cp.zeros(16), 128)\n",
        "OPS = {'op': Op}\nOPS['op']()(cp.zeros(16), 128)\n",
    ],
)
def test_a_class_held_by_another_name_counts_its_instances_calls(made: str) -> None:
    """`M = Op; M()(x, 128)`: the instance made through another name was no instance of Op, so its call passing
    forward's block went uncounted and forward's default 512 was read where the call passes 128."""
    assert read(MODULE + "\n" + made, "Op") is None
    # Named only to make, check or initialise an instance of it: forward's default.
    for named in (
        "m = Op()\nm(cp.zeros(16))\n",
        "def check(m: Op) -> Op:\n    assert isinstance(m, Op)\n    return m\n",
        "class Sub(Op):\n    def __init__(self):\n        super(Sub, self).__init__()\n",
    ):
        assert read(MODULE + "\n" + named, "Op") == SourceLaunch((32768, 1, 1), (512, 1, 1), 0), named


HELPER_F = "def f(x):\n    k(((x.size + 255) // 256,), (256,), (x,))\n\n"


@pytest.mark.parametrize(
    "body",
    [
        "    f(cp.zeros(32))",
        "    y = cp.zeros(32)\n    f(y)",
        "    x = cp.zeros(32)\n    f(x)",
        "    f(x)\n    f(x[:32])",
        "    g(x)\n\ndef g(x):\n    f(x)\n\ng(cp.zeros(32))",  # passed on by a function called with another
        "    f(x=cp.zeros(32))",
        "    f(*[cp.zeros(32)])",
    ],
)
def test_a_helper_s_buffer_parameter_is_what_its_callers_pass(body: str) -> None:
    """`def f(x): k(((x.size + 255) // 256,), ...)` called as `f(cp.zeros(32))`: f's x was read as the workload's
    x (a grid of 65,536 blocks) where the call passes an array of 32."""
    assert read(cupy(body, HELPER_F)) == SourceLaunch(None, (256, 1, 1), 0)
    # Passed the entry's own x (through a helper too): the workload's.
    assert read(cupy("    f(x)", HELPER_F)) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)
    passed_on = cupy("    g(x)\n\ndef g(x):\n    f(x)\n", HELPER_F)
    assert read(passed_on) == SourceLaunch((65536, 1, 1), (256, 1, 1), 0)


def test_helpers_passing_buffers_on_are_read_cheaply() -> None:
    """Whether a helper's x is the workload's is read once a function and parameter: 1,400 helpers each passing
    x to the next (past 8 deep: not followed, unknown) and 1,400 called from the entry (55 KB)."""
    chain = "".join(f"def h{i}(x, y):\n    h{i + 1}(x, y)\n" for i in range(1400))
    chained = cupy("    h0(x, x)", HELPER_F + chain + "def h1400(x, y):\n    f(x)\n")
    fanned = cupy("".join(f"    g{i}(x, x)\n" for i in range(1400)), HELPER_F) + "".join(
        f"def g{i}(x, y):\n    f(x)\n" for i in range(1400)
    )
    assert len(chained) < 64 * 1024 and len(fanned) < 64 * 1024
    assert read(chained) == SourceLaunch(None, (256, 1, 1), 0)
    assert read(fanned) == SourceLaunch(None, (256, 1, 1), 0)  # f called past 64 times: its callers not read

    def both() -> None:
        for source in (chained, fanned):
            host_launch._CACHE.clear()
            read(source)

    assert fastest_s(both, 5.0) < 5.0


def test_a_triton_launch_through_getitem_is_one_of_its_launches() -> None:
    """`add_kernel.__getitem__((1,))(...)` is `add_kernel[(1,)](...)`: it was not seen, and the wrapper's grid
    read as the kernel's only one."""
    small = "def small(x, y, out):\n    add_kernel.__getitem__((1,))(x, y, out, 16, BLOCK_SIZE=16)\n"
    assert read_triton(triton(TUTORIAL) + small) == programs(None)
    held = "def small(x, y, out):\n    launch = add_kernel.__getitem__((1,))\n    launch(x, y, out, 16)\n"
    assert read_triton(triton(TUTORIAL) + held) is None  # a launcher held: any launch
    alone = triton("    add_kernel.__getitem__((triton.cdiv(n, 1024),))(x, y, out, n, BLOCK_SIZE=1024)\n")
    assert read_triton(alone) == programs((16384,))
    assert host_launch.launches_itself(Kernel(source=alone, entry="add_kernel", language="triton"))


# A helper launching for a buffer its caller makes like the workload's (`out = cp.empty_like(x)`; `_launch(x, out)`).
MADE_LIKE = "def _launch(x, out):\n    n = out.size\n    k(((n + 255) // 256,), (256,), (x, out, n))\n\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("    out = cp.empty_like(x)\n    _launch(x, out)\n    return out", (65536, 1, 1)),
        ("    y = x\n    out = y.copy()\n    _launch(x, out=out)", (65536, 1, 1)),
        # Passed on through another helper making it: x's too.
        (
            "    return _outer(x)\n\ndef _outer(a):\n    b = cp.zeros_like(a)\n    _launch(a, b)",
            (65536, 1, 1),
        ),
        ("    out = cp.empty(32)\n    _launch(x, out)", None),
        ("    out = cp.empty_like(x[:32])\n    _launch(x, out)", None),
        ("    out = cp.zeros_like(x, shape=(32,))\n    _launch(x, out)", None),
        ("    out = cp.empty_like(x)\n    out = out[:32]\n    _launch(x, out)", None),
        ("    out = cp.empty_like(x)\n    x = x[:32]\n    _launch(x, out)", None),  # made like what x became
        (
            "    out = cp.empty_like(x)\n    _launch(x, out)\n    small = cp.empty(32)\n    _launch(small, small)",
            None,
        ),
        ("    out = cp.empty_like(x)\n    _launch(x, out)\n\nout = cp.empty(32)\n_launch(out, out)", None),
    ],
)
def test_a_helper_s_buffer_made_like_the_workload_s_has_its_shape(
    body: str, expected: tuple[int, int, int] | None
) -> None:
    """`out = cp.empty_like(x); _launch(x, out)`, the helper's grid from `out.size`: unknown, where out is x's
    shape (65,536 blocks of 256). One made otherwise, or passed something else by another call: unknown."""
    found = read(cupy(body, MADE_LIKE))
    assert found == SourceLaunch(expected, (256, 1, 1), 0), body


# Triton's vector-add tutorial as published: a self-test and a benchmark at the module's top level, unguarded.
VECTOR_ADD_TUTORIAL = """import torch
import triton
import triton.language as tl

DEVICE = triton.runtime.driver.active.get_active_torch_device()


@triton.jit
def add_kernel(x_ptr, y_ptr, output_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    block_start = pid * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    output = x + y
    tl.store(output_ptr + offsets, output, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor):
    output = torch.empty_like(x)
    assert x.device == DEVICE and y.device == DEVICE and output.device == DEVICE
    n_elements = output.numel()
    grid = lambda meta: (triton.cdiv(n_elements, meta['BLOCK_SIZE']), )
    add_kernel[grid](x, y, output, n_elements, BLOCK_SIZE=1024)
    return output


torch.manual_seed(0)
size = 98432
x = torch.rand(size, device=DEVICE)
y = torch.rand(size, device=DEVICE)
output_torch = x + y
output_triton = add(x, y)
print(output_torch)
print(output_triton)
print(f'The maximum difference between torch and triton is '
      f'{torch.max(torch.abs(output_torch - output_triton))}')


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=['size'],
        x_vals=[2**i for i in range(12, 28, 1)],
        x_log=True,
        line_arg='provider',
        line_vals=['triton', 'torch'],
        line_names=['Triton', 'Torch'],
        styles=[('blue', '-'), ('green', '-')],
        ylabel='GB/s',
        plot_name='vector-add-performance',
        args={},
    ))
def benchmark(size, provider):
    x = torch.rand(size, device=DEVICE, dtype=torch.float32)
    y = torch.rand(size, device=DEVICE, dtype=torch.float32)
    quantiles = [0.5, 0.2, 0.8]
    if provider == 'torch':
        ms, min_ms, max_ms = triton.testing.do_bench(lambda: x + y, quantiles=quantiles)
    if provider == 'triton':
        ms, min_ms, max_ms = triton.testing.do_bench(lambda: add(x, y), quantiles=quantiles)
    gbps = lambda ms: 3 * x.numel() * x.element_size() * 1e-9 / (ms * 1e-3)
    return gbps(ms), gbps(max_ms), gbps(min_ms)


benchmark.run(print_data=True, show_plots=True)
"""


@pytest.mark.parametrize("language", ["triton", "python"])
def test_the_triton_tutorial_s_kernel_is_read_at_the_workload_s_size(language: Language) -> None:
    """The kernel sent as the entry, its wrapper `add(x, y)` called by the tutorial's own self-test and benchmark
    with tensors they make: the harness runs the kernel, at the workload's sizes, so those calls are not its; read
    as with the wrapper sent as the entry (2^24 elements, 16,384 programs), not unknown."""
    unguarded = VECTOR_ADD_TUTORIAL
    head, test = unguarded.split("torch.manual_seed(0)\n")
    test, bench = test.split("\n\n\n@triton.testing")
    indented = "".join(f"    {line}\n" for line in ["torch.manual_seed(0)", *test.splitlines()])
    guarded = f"{head}if __name__ == '__main__':\n{indented}\n\n@triton.testing{bench}"
    for source in (unguarded, guarded):
        assert read_triton(source, language) == programs((16384,))
        assert source_launch(Kernel(source=source, entry="add", language=language), WL) == programs((16384,))


LAUNCHING_ADD = (
    "def _add(x, y):\n    out = torch.empty_like(x)\n    n = out.numel()\n"
    "    add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK_SIZE=1024)\n    return out\n"
)


@pytest.mark.parametrize(
    "wrapper",
    [
        # Launched by a helper the wrapper passes a slice, or a tensor of its own: 32 elements, not the workload's.
        f"def add(x, y):\n    return _add(x[:32], y)\n\n{LAUNCHING_ADD}",
        f"def add(x, y):\n    return _add(torch.rand(32), y)\n\n{LAUNCHING_ADD}",
    ],
)
def test_a_triton_kernel_s_launcher_passed_another_tensor_by_its_wrapper_is_unknown(
    wrapper: str,
) -> None:
    """A Triton kernel entry's launcher is read at the workload's sizes where only the module's test code calls
    it; a wrapper passing it something else is part of the launch."""
    source = f"{TRITON_HEAD}\n@triton.jit\n{ADD_KERNEL}{wrapper}\nx = torch.rand(98432)\nadd(x, x)\n"
    assert read_triton(source) == programs(None)


@pytest.mark.parametrize(
    ("source", "reader", "expected"),
    [
        (
            cupy(
                "    k((x.size // 256,), (256,), (x, N))\n"
                "    f = lambda x: k(((x.size + 255) // 256,), (256,), (x, x.size))"
            ),
            read,
            SourceLaunch((65536, 1, 1), (256, 1, 1), 0),
        ),
        (
            triton(TUTORIAL + "    warm = lambda: add_kernel[(1,)](x, y, out, 16, BLOCK_SIZE=16)\n"),
            read_triton,
            programs((16384,)),
        ),
    ],
)
def test_a_lambda_never_used_launches_nothing(
    source: str, reader: Callable[[str], SourceLaunch | None], expected: SourceLaunch
) -> None:
    """A launch in a lambda bound to a name nothing uses never runs: it was read as one of the kernel's launches,
    unknown, and left the whole grid unknown. One called, passed on, or named elsewhere still counts."""
    assert reader(source) == expected
    name = "f" if "f = lambda" in source else "warm"
    indent = "    "
    for use in (f"{name}()", f"{name}(x)", f"timeit({name})", f"eval('{name}(x)')"):
        used = (
            source.replace("    return out\n", f"{indent}{use}\n    return out\n")
            if reader is read_triton
            else (source + f"{indent}{use}\n")
        )
        assert reader(used) != expected, use
