"""A stand-in GPU worker (and a stand-in nvcc) for testing the supervisor without a GPU.

Worker: `python fake_gpu_worker.py [--startup ok|fatal|hang|crash|garbage] [--name NAME] --device N`.
It runs the real worker's `serve` loop and framing (`gpu_worker.serve`) with a fake session whose behaviour a
test picks through the kernel's defines (FAKE_MODE and friends), which the fake nvcc writes into the "cubin":
  ok (default)  numpy stand-in for the kernel (FAKE_OP: add | wrong | cache | nan), lognormal timing
                samples around FAKE_MS with spread FAKE_NOISE, stopped by the real AdaptiveStopper;
                FAKE_BUSY_S holds the "device" that long; FAKE_WALL_MS sets the wall-clock samples;
                FAKE_REGS / FAKE_LOCAL_BYTES set the registers and local memory per thread reported
  hang          starts a grandchild in its process group, reports its pid as progress, then hangs
  crash         prints a path to stderr and dies of SIGSEGV mid-job
  garbage       writes bytes that are not a frame to the protocol pipe
  bad_length    writes a frame header announcing an absurd length
  launch_error / oob   returns that status with restart set (and then exits, as the real worker does)
  wrong_job     answers with a result for another job id

Real worker, fake driver: `python fake_gpu_worker.py --fake-pycuda --device N` runs the real `gpu_worker.main`
(GpuSession, guard regions, sampling, correctness) on `FakeDriver`, a numpy stand-in for pycuda.driver.

nvcc: `python fake_gpu_worker.py nvcc [nvcc args]` writes a JSON "cubin" (source, entry, defines), a PTX file
with the parameter list of every `__global__` function in the keep dir, and ptxas-style resource lines. Source
containing `#error` fails like nvcc, with the absolute path of the file in the message. FAKE_COMPILE_HANG
hangs the compiler; FAKE_COMPILE_SLEEP makes it take that many seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _hang_forever() -> None:
    threading.Event().wait()


# ---------------------------------------------------------------- fake nvcc

_C_PARAM_SIZES = [
    (re.compile(r"\*"), ".u64"),
    (re.compile(r"\b(double)\b"), ".f64"),
    (re.compile(r"\b(long long|size_t|int64_t|uint64_t)\b"), ".u64"),
    (re.compile(r"\b(float)\b"), ".f32"),
    (re.compile(r"\b(short|int16_t|uint16_t)\b"), ".u16"),
    (re.compile(r"\b(char|bool|int8_t|uint8_t)\b"), ".u8"),
    (re.compile(r"\b(__half|half)\b"), ".align 2 .b8"),
    (re.compile(r"\b(int|unsigned|int32_t|uint32_t)\b"), ".u32"),
]


def fake_nvcc(argv: list[str]) -> int:
    if "--version" in argv:
        print("Cuda compilation tools, release 0.0, fake nvcc for tests")
        return 0
    out = argv[argv.index("-o") + 1]
    keep = argv[argv.index("--keep-dir") + 1] if "--keep-dir" in argv else "."
    source_path = next(a for a in argv if a.endswith(".cu"))
    source = Path(source_path).read_text()
    # As a preprocessor sees them: the measurer writes defines as #define lines ahead of the source; -D flags
    # still come from compile options.
    defines = dict(m.groups() for m in re.finditer(r"^#define (\w+) (.*)$", source, re.MULTILINE))
    defines.update(a[2:].split("=", 1) for a in argv if a.startswith("-D"))
    if "FAKE_COMPILE_HANG" in defines:
        _hang_forever()
    if "FAKE_COMPILE_SLEEP" in defines:
        time.sleep(float(defines["FAKE_COMPILE_SLEEP"]))
    for lineno, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("#error"):
            where = os.path.abspath(source_path)
            print(
                f'{where}({lineno}): error: #error directive: "{line.strip()[6:].strip()}"', file=sys.stderr
            )
            print(f'1 error detected in the compilation of "{where}".', file=sys.stderr)
            return 1
    entries = re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", source)
    ptx = []
    for name, params in entries:
        decls = []
        for i, param in enumerate(p for p in params.split(",") if p.strip()):
            kind = next(k for pattern, k in _C_PARAM_SIZES if pattern.search(param))
            suffix = "[2]" if kind.endswith(".b8") else ""
            decls.append(f"\t.param {kind} {name}_param_{i}{suffix}")
        ptx.append(f".visible .entry {name}(\n" + ",\n".join(decls) + "\n)\n{\n}\n")
        print(f"ptxas info    : Compiling entry function '{name}' for 'sm_90'", file=sys.stderr)
        print(f"ptxas info    : Function properties for {name}", file=sys.stderr)
        print("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", file=sys.stderr)
        print("ptxas info    : Used 16 registers, used 0 barriers, 1024 bytes smem", file=sys.stderr)
    Path(keep).mkdir(parents=True, exist_ok=True)
    Path(keep, "kernel.ptx").write_text("".join(ptx))
    # What cicc read, which the compilers check for directives gcc did not write: the source less its own.
    code = [ln for ln in source.splitlines() if not ln.lstrip().startswith("#")]
    Path(keep, "kernel.cpp1.ii").write_text("\n".join(code) + "\n")
    Path(out).write_text(
        json.dumps({"source": source, "defines": defines, "entries": [e[0] for e in entries]})
    )
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["nvcc"]:
    # As nvcc, stay light: no numpy or package imports.
    sys.exit(fake_nvcc(sys.argv[2:]))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forecaster_mcp.measure.gpu_worker import Send, _claim_stdout, serve  # noqa: E402
from forecaster_mcp.measure.inputs import (  # noqa: E402
    compare_outputs,
    correctness_of,
    generate_inputs,
    output_names,
)
from forecaster_mcp.measure.timing import AdaptiveStopper, StoppingRule  # noqa: E402
from forecaster_mcp.measure.worker_protocol import (  # noqa: E402
    HEADER,
    MAGIC,
    DeviceInfo,
    Fatal,
    JobResult,
    MeasureJob,
    Progress,
    write_frame_sync,
)
from forecaster_mcp.models import BufferArg, Workload  # noqa: E402

H100_L2 = 50 * 2**20


class FakeSession:
    def __init__(self, device: int, name: str, stdout: Any) -> None:
        self.stdout = stdout
        self.info = DeviceInfo(
            index=device,
            name=name,
            compute_capability="9.0",
            pci_bus_id="00000000:00:00.0",
            driver="fake-550.00",
            sm_count=132,
            l2_bytes=H100_L2,
            max_threads_per_sm=2048,
            max_blocks_per_sm=32,
            registers_per_sm=65536,
            shared_mem_per_sm_bytes=228 * 1024,
            max_shared_mem_per_block_bytes=227 * 1024,
            total_mem_bytes=int(float(os.environ.get("FAKE_GPU_TOTAL_GIB", "80")) * 2**30),
            mem_bandwidth_gbs=3352.0,
            pid=os.getpid(),
            pgid=os.getpgid(0),
        )
        self.rng = np.random.default_rng(1)

    def run(self, job: MeasureJob, send: Send) -> JobResult:
        image = json.loads(Path(job.kernel.cubin_path).read_text())
        defines: dict[str, str] = image["defines"]
        mode = defines.get("FAKE_MODE", "ok")
        if mode == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
            send(Progress(job_id=job.job_id, done=0, message=f"grandchild {child.pid}"))
            _hang_forever()
        if mode == "crash":
            print(
                "fatal: illegal address in /home/someone/private/kernel_dir/kernel.cu",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGSEGV)
            _hang_forever()
        if mode == "garbage":
            self.stdout.write(b"Segmentation fault (core dumped)\n" + os.urandom(64))
            self.stdout.flush()
            _hang_forever()
        if mode == "bad_length":
            self.stdout.write(HEADER.pack(MAGIC, 2**31))
            self.stdout.flush()
            _hang_forever()
        if mode == "launch_error":
            return JobResult(
                job_id=job.job_id,
                status="launch_error",
                restart=True,
                message="CUDA error: cuCtxSynchronize failed: an illegal memory access was encountered",
            )
        if mode == "oob":
            return JobResult(
                job_id=job.job_id,
                status="out_of_bounds_write",
                restart=True,
                message="the kernel wrote outside buffer 'c': 16 guard bytes changed, up to 16 bytes "
                "past its end",
            )
        if mode == "wrong_job":
            return JobResult(job_id=job.job_id + 1000, status="ok")
        return self._emulate(job, defines)

    def _emulate(self, job: MeasureJob, defines: dict[str, str]) -> JobResult:
        started = time.monotonic()
        busy = float(defines.get("FAKE_BUSY_S", "0"))
        op = defines.get("FAKE_OP", "add")
        comparisons = []
        stale: dict[str, np.ndarray] | None = None
        seeds = (job.seed, job.seed + 7919)
        for seed in seeds:
            if seed == job.seed:
                # The "timing" phase sits between the two input sets, as in the real worker.
                samples, stop = self._samples(job, defines)
            if job.reference is None:
                continue
            want = _add(job.workload, generate_inputs(job.workload, seed))
            if op == "wrong":
                got = {k: v + 1 for k, v in want.items()}
            elif op == "cache":
                got = stale if stale is not None else want
                stale = want
            elif op == "nan":
                got = {
                    k: np.where(np.arange(v.size).reshape(v.shape) == 3, np.nan, v) for k, v in want.items()
                }
            else:
                got = want
            comparisons.append(compare_outputs(job.workload, got, want, job.atol, job.rtol))
        median_ms = float(defines.get("FAKE_MS", "1.0"))
        wall = float(defines.get("FAKE_WALL_MS", str(median_ms + 0.01)))
        left = busy - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
        correctness = correctness_of(
            comparisons, None if job.reference else "no reference kernel given", seeds[: len(comparisons)]
        )
        return JobResult(
            job_id=job.job_id,
            status="wrong_output" if correctness.passed is False else "ok",
            message=correctness.detail if correctness.passed is False else None,
            samples_ms=samples,
            stop_reason=stop,
            wall_ms=[wall, wall * 1.1, wall * 1.2],
            correctness=correctness,
            registers=int(defines.get("FAKE_REGS", "32")),
            static_shared_bytes=0,
            local_bytes=int(defines.get("FAKE_LOCAL_BYTES", "0")),
            sm_clock_mhz=1980.0,
            mem_clock_mhz=2619.0,
        )

    def _samples(self, job: MeasureJob, defines: dict[str, str]) -> tuple[list[float], Any]:
        median_ms = float(defines.get("FAKE_MS", "1.0"))
        noise = float(defines.get("FAKE_NOISE", "0.002"))
        stopper = AdaptiveStopper(
            StoppingRule(job.target_relative_noise, min(job.min_runs, job.max_runs), job.max_runs)
        )
        while True:
            reason = stopper.reason()
            if reason is not None:
                return stopper.samples, reason
            stopper.add(median_ms * float(np.exp(self.rng.normal(0.0, noise))))


def _add(workload: Workload, host: list[Any]) -> dict[str, np.ndarray]:
    """The emulated kernel: every output buffer becomes the sum of the input buffers."""
    inputs = [
        v for a, v in zip(workload.args, host, strict=True) if isinstance(a, BufferArg) and a.intent == "in"
    ]
    total = sum(inputs[1:], inputs[0].copy()) if inputs else None
    out: dict[str, np.ndarray] = {}
    for name in output_names(workload):
        arg = next(a for a in workload.args if a.name == name)
        assert isinstance(arg, BufferArg)
        out[name] = np.zeros(arg.shape, dtype=np.float32) if total is None else total.reshape(arg.shape)
    return out


# ---------------------------------------------------------------- fake pycuda (the real worker on the CPU)


class FakeCudaError(Exception):
    pass


class FakeLaunchError(FakeCudaError):
    pass


class FakeLogicError(FakeCudaError):
    pass


class FakeMemoryError(FakeCudaError):
    pass


class _Attrs:
    L2_CACHE_SIZE = 1
    MULTIPROCESSOR_COUNT = 2
    MAX_THREADS_PER_MULTIPROCESSOR = 3
    MAX_BLOCKS_PER_MULTIPROCESSOR = 4
    MAX_REGISTERS_PER_MULTIPROCESSOR = 5
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 6
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 7
    MEMORY_CLOCK_RATE = 8
    GLOBAL_MEMORY_BUS_WIDTH = 9


class _FuncAttrs:
    MAX_DYNAMIC_SHARED_SIZE_BYTES = 1


_DEVICE_ATTRS = {1: 4 * 2**20, 2: 132, 3: 2048, 4: 32, 5: 65536, 6: 233472, 7: 232448, 8: 2619000, 9: 5120}


class FakeDriver:
    """Just enough of pycuda.driver for gpu_worker: device memory is numpy, a stream has a virtual clock that
    kernels advance by FAKE_MS, and kernels are numpy stand-ins chosen by the FAKE_OP define:
    add (c = a + b), noop, wrong, oob (16 floats past c), wild (an unmapped address: a deferred fault),
    hang (synchronize never returns), cache (computes on the first launch of a module only),
    printf (writes to fd 1 like device printf), side (the work is invisible to events; wall clock sees it)."""

    Error = FakeCudaError
    LaunchError = FakeLaunchError
    LogicError = FakeLogicError
    MemoryError = FakeMemoryError
    device_attribute = _Attrs
    function_attribute = _FuncAttrs

    def __init__(self) -> None:
        self.allocations: dict[int, np.ndarray] = {}
        self.next_base = 1 << 32
        self.pending: Exception | None = None
        self.poisoned = False
        self.hang = False
        self.sleep_s = 0.0
        driver = self

        class DeviceAllocation:
            def __init__(self, base: int) -> None:
                self.base = base

            def __int__(self) -> int:
                return self.base

            def free(self) -> None:
                driver.allocations.pop(self.base, None)

        class Stream:
            def __init__(self) -> None:
                self.clock_ms = 0.0

        class Event:
            def __init__(self) -> None:
                self.t = 0.0

            def record(self, stream: Any = None) -> None:
                driver.check()
                self.t = (stream or driver.default_stream).clock_ms

            def time_since(self, other: Any) -> float:
                return float(self.t - other.t)

            def synchronize(self) -> None:
                driver.sync()

        class Context:
            def push(self) -> None:
                pass

            def pop(self) -> None:
                pass

            @staticmethod
            def synchronize() -> None:
                driver.sync()

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            @staticmethod
            def count() -> int:
                return 1

            def name(self) -> str:
                return "NVIDIA H100 80GB HBM3"

            def compute_capability(self) -> tuple[int, int]:
                return (9, 0)

            def total_memory(self) -> int:
                return 80 * 2**30

            def pci_bus_id(self) -> str:
                return "0000:00:00.0"

            def get_attribute(self, attr: int) -> int:
                return _DEVICE_ATTRS[attr]

            def retain_primary_context(self) -> Context:
                return Context()

        self.DeviceAllocation = DeviceAllocation
        self.Stream = Stream
        self.Event = Event
        self.Context = Context
        self.Device = Device
        self.default_stream = Stream()

    # -- plumbing
    def check(self) -> None:
        if self.poisoned:
            raise FakeLaunchError("cuCtxSynchronize failed: an illegal memory access was encountered")

    def sync(self) -> None:
        self.check()
        if self.hang:
            _hang_forever()
        if self.sleep_s:
            time.sleep(self.sleep_s)
            self.sleep_s = 0.0
        if self.pending is not None:
            self.poisoned = True
            error, self.pending = self.pending, None
            raise error

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        for base, buf in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + buf.size:
                return buf[ptr - base : ptr - base + nbytes]
        raise FakeLogicError(f"address {ptr:#x} (+{nbytes}) is not in any allocation")

    # -- API
    def init(self) -> None:
        pass

    def get_driver_version(self) -> int:
        return 12080

    def mem_alloc(self, nbytes: int) -> Any:
        base = self.next_base
        self.next_base += nbytes + (1 << 20)  # unmapped gaps: a wild write faults
        self.allocations[base] = np.zeros(nbytes, dtype=np.uint8)
        return self.DeviceAllocation(base)

    def memset_d8(self, ptr: Any, value: int, nbytes: int) -> None:
        self.check()
        self.view(int(ptr), nbytes)[:] = value

    def memset_d8_async(self, ptr: Any, value: int, nbytes: int, stream: Any = None) -> None:
        self.memset_d8(ptr, value, nbytes)
        (stream or self.default_stream).clock_ms += 0.001

    def memcpy_htod(self, ptr: Any, array: np.ndarray) -> None:
        self.check()
        self.view(int(ptr), array.nbytes)[:] = np.ascontiguousarray(array).view(np.uint8).ravel()

    def memcpy_dtoh(self, array: np.ndarray, ptr: Any) -> None:
        self.check()
        array.view(np.uint8).ravel()[:] = self.view(int(ptr), array.nbytes)

    def memcpy_dtod(self, dest: Any, src: Any, nbytes: int) -> None:
        self.check()
        self.view(int(dest), nbytes)[:] = self.view(int(src), nbytes)

    def memcpy_dtod_async(self, dest: Any, src: Any, nbytes: int, stream: Any = None) -> None:
        self.memcpy_dtod(dest, src, nbytes)
        (stream or self.default_stream).clock_ms += 0.001

    def module_from_file(self, path: str) -> Any:
        image = json.loads(Path(path).read_text())
        return _FakeModule(self, image)


class _FakeModule:
    def __init__(self, driver: FakeDriver, image: dict[str, Any]) -> None:
        self.driver = driver
        self.image = image
        self.launches = 0

    def get_function(self, symbol: str) -> Any:
        if symbol not in self.image["entries"]:
            raise FakeLogicError(f"cuModuleGetFunction failed: named symbol not found ({symbol})")
        return _FakeFunction(self)


class _FakeFunction:
    num_regs = 24
    shared_size_bytes = 0

    def __init__(self, module: _FakeModule) -> None:
        self.module = module
        self.fmt = ""
        self.rng = np.random.default_rng(0)

    @property
    def local_size_bytes(self) -> int:
        """CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: FAKE_LOCAL_BYTES (default 0), e.g. a local array's stack frame."""
        return int(self.module.image["defines"].get("FAKE_LOCAL_BYTES", "0"))

    @property
    def max_threads_per_block(self) -> int:
        """As the driver computes it from registers and __launch_bounds__: FAKE_MAX_THREADS (default 1024)."""
        return int(self.module.image["defines"].get("FAKE_MAX_THREADS", "1024"))

    def prepare(self, fmt: str) -> None:
        self.fmt = fmt

    def set_attribute(self, attr: int, value: int) -> None:
        pass

    def prepared_async_call(
        self, grid: Any, block: Any, stream: Any, *args: Any, shared_size: int = 0
    ) -> None:
        import struct

        driver = self.module.driver
        driver.check()
        if int(np.prod(block)) > self.max_threads_per_block:
            raise FakeLaunchError("cuLaunchKernel failed: too many resources requested for launch")
        struct.pack("@" + self.fmt, *args)  # the real pycuda packs the same way: wrong types fail here
        defines = self.module.image["defines"]
        op = defines.get("FAKE_OP", "add")
        launch_ms = float(defines.get("FAKE_MS", "1.0")) * float(np.exp(self.rng.normal(0.0, 0.002)))
        self.module.launches += 1
        if op == "hang":
            driver.hang = True
            return
        if op == "wild":
            driver.pending = FakeLaunchError(
                "cuCtxSynchronize failed: an illegal memory access was encountered"
            )
            return
        if op == "noop":
            (stream or driver.default_stream).clock_ms += launch_ms
            return
        if op == "printf":
            os.write(1, b"device printf from the kernel, straight to fd 1\n")
        a, b, c, n = args[0], args[1], args[2], int(args[3])
        if not (op == "cache" and self.module.launches > 1):
            x = driver.view(a, 4 * n).view(np.float32)
            y = driver.view(b, 4 * n).view(np.float32)
            out = driver.view(c, 4 * n).view(np.float32)
            out[:] = x + y + (1.0 if op == "wrong" else 0.0)
        if op == "oob":
            driver.view(c + 4 * n, 64).view(np.float32)[:] = 1.0
        if op == "side":
            driver.sleep_s = float(defines.get("FAKE_WALL_MS", "50")) / 1e3
            launch_ms = 0.001
        (stream or driver.default_stream).clock_ms += launch_ms


def run_real_worker_with_fake_pycuda(argv: list[str]) -> int:
    """The real `gpu_worker.main` with the fake driver in place of pycuda."""
    import types

    from forecaster_mcp.measure import gpu_worker

    package = types.ModuleType("pycuda")
    driver = FakeDriver()
    package.driver = driver  # type: ignore[attr-defined]
    sys.modules["pycuda"] = package
    sys.modules["pycuda.driver"] = driver  # type: ignore[assignment]
    return gpu_worker.main(argv)


# ---------------------------------------------------------------- entry


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--fake-pycuda":
        return run_real_worker_with_fake_pycuda(argv[1:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--startup", default="ok", choices=["ok", "fatal", "hang", "crash", "garbage"])
    parser.add_argument("--name", default="NVIDIA H100 80GB HBM3")
    args = parser.parse_args(argv)
    stdout = _claim_stdout()
    if args.startup == "fatal":
        write_frame_sync(stdout, Fatal(message="pycuda is not importable (fake start-up failure)"))
        return 2
    if args.startup == "hang":
        _hang_forever()
    if args.startup == "crash":
        print("worker start-up crashed", file=sys.stderr, flush=True)
        os._exit(1)
    if args.startup == "garbage":
        stdout.write(b"hello, I am not a frame\n")
        stdout.flush()
        _hang_forever()
    return serve(FakeSession(args.device, args.name, stdout), sys.stdin.buffer, stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
