"""Device memory and reference faults in the real gpu_worker, driven on the fake pycuda driver
(tests/fake_gpu_worker.py --fake-pycuda), instrumented by small wrapper scripts written per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from forecaster_mcp.measure.base import MeasureRequest
from forecaster_mcp.measure.gpu_worker import GUARD_BYTES
from forecaster_mcp.measure.pycuda_measurer import PycudaMeasurer
from forecaster_mcp.models import INPUTS_UNFINISHED, BufferArg, Kernel, Launch, Workload

TESTS = Path(__file__).resolve().parent
FAKE = str(TESTS / "fake_gpu_worker.py")
FAKE_NVCC = [sys.executable, FAKE, "nvcc"]
FAKE_L2 = 4 * 2**20  # the fake device's L2 size: the worker's flush buffer

SRC = (
    "__global__ void vadd(const float* a, const float* b, float* c, int n) {\n"
    "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) c[i] = a[i] + b[i];\n}\n"
)


def vadd_workload(n: int) -> Workload:
    return Workload.model_validate(
        {
            "args": [
                {"name": "a", "dtype": "float32", "shape": [n]},
                {"name": "b", "dtype": "float32", "shape": [n]},
                {"name": "c", "dtype": "float32", "shape": [n], "intent": "out"},
                {"name": "n", "dtype": "int32", "value": n},
            ]
        }
    )


def op(name: str, **defines: int | str) -> Kernel:
    launch = Launch.model_validate({"grid": [4], "block": [256]})
    return Kernel(source=SRC, entry="vadd", launch=launch, defines={"FAKE_OP": name, **defines})


def wrapper(tmp_path: Path, body: str) -> list[str]:
    """A worker command: the real worker on the fake driver, with `body` patching `f.FakeDriver` first."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import fake_gpu_worker as f\n"
        f"{body}\n"
        "sys.exit(f.run_real_worker_with_fake_pycuda(sys.argv[1:]))\n"
    )
    return [sys.executable, str(script)]


def recording_calls(target: str, record: str, path: Path) -> str:
    """Worker-script lines (for `wrapper`) that make each call of `target` first append `record`, an expression
    of the call's arguments `a`, to the file `path`."""
    return (
        f"orig = {target}\n"
        "def recorded(*a, **k):\n"
        f"    open({str(path)!r}, 'a').write({record})\n"
        "    return orig(*a, **k)\n"
        f"{target} = recorded\n"
    )


def measurer(tmp_path: Path, worker_cmd: list[str]) -> PycudaMeasurer:
    return PycudaMeasurer(
        tmp_path / "cache",
        worker_cmd=worker_cmd,
        device_names=["NVIDIA H100 80GB HBM3"],
        nvcc=FAKE_NVCC,
        kill_slack_s=0.3,
        startup_grace_s=20.0,
    )


def request(m: PycudaMeasurer, k: Kernel, workload: Workload, **kw: Any) -> MeasureRequest:
    kw.setdefault("max_seconds", 10.0)
    return MeasureRequest(kernel=k, workload=workload, device=m.devices()[0], **kw)


PEAK = """
orig_alloc = f.FakeDriver.mem_alloc
def mem_alloc(self, nbytes):
    alloc = orig_alloc(self, nbytes)
    live = sum(b.size for b in self.allocations.values())
    peak = max(live, int(open(PEAK_FILE).read() or 0))
    open(PEAK_FILE, "w").write(str(peak))
    return alloc
f.FakeDriver.mem_alloc = mem_alloc
"""


@pytest.mark.anyio
async def test_reference_check_does_not_hold_the_workload_twice(tmp_path: Path) -> None:
    n = 1 << 20  # 4 MiB per buffer, 12 MiB of workload
    workload = vadd_workload(n)
    buffers = [a for a in workload.args if isinstance(a, BufferArg)]
    data = sum(a.nbytes for a in buffers)
    guards = 2 * GUARD_BYTES * len(buffers)
    peaks = {}
    for with_reference in (False, True):
        peak_file = tmp_path / f"peak-{with_reference}"
        peak_file.write_text("0")
        cmd = wrapper(tmp_path, f"PEAK_FILE = {str(peak_file)!r}\n{PEAK}")
        async with measurer(tmp_path, cmd) as m:
            reference = op("add") if with_reference else None
            result = await m.measure(request(m, op("add"), workload, reference=reference, max_runs=10))
        assert result.status == "ok", result.message
        assert result.correctness.passed is (True if with_reference else None)
        if with_reference:
            assert result.correctness.input_sets == 2 and result.correctness.max_abs_error == 0.0
        peaks[with_reference] = int(peak_file.read_text())
    # The workload, its guards, and one pristine copy of it that every timed run is restored from.
    assert peaks[False] == FAKE_L2 + 2 * data + guards
    # Before the fix the reference got a second full set of buffers: 12 MiB more at the peak.
    assert peaks[True] == peaks[False]


OOM = """
orig_alloc = f.FakeDriver.mem_alloc
def mem_alloc(self, nbytes):
    if nbytes != 4 * 2**20:  # the session's L2 flush buffer fits; the workload's buffers do not
        raise f.FakeMemoryError("cuMemAlloc failed: out of memory")
    return orig_alloc(self, nbytes)
f.FakeDriver.mem_alloc = mem_alloc
"""


@pytest.mark.anyio
async def test_out_of_device_memory_is_its_own_status(tmp_path: Path) -> None:
    async with measurer(tmp_path, wrapper(tmp_path, OOM)) as m:
        result = await m.measure(request(m, op("add"), vadd_workload(1024), reference=op("add")))
    # Not launch_error: out of memory depends on what else holds the device, so it must not be cached
    # as a property of the kernel.
    assert result.status == "out_of_memory", result.message
    assert result.message is not None
    assert "out of device memory for this workload" in result.message
    assert "cuMemAlloc failed: out of memory" in result.message


@pytest.mark.anyio
async def test_a_faulting_reference_is_named_as_such(tmp_path: Path) -> None:
    workload = vadd_workload(1024)
    async with measurer(tmp_path, [sys.executable, FAKE, "--fake-pycuda"]) as m:
        ref_faults = await m.measure(request(m, op("add"), workload, reference=op("wild")))
        cand_faults = await m.measure(request(m, op("wild"), workload, reference=op("add")))
        # The worker restarted after each fault: a good job afterwards still runs.
        fine = await m.measure(request(m, op("add"), workload, reference=op("add")))
    assert ref_faults.status == "launch_error"
    assert ref_faults.message is not None and ref_faults.message.startswith("reference kernel: ")
    assert "illegal memory access" in ref_faults.message
    assert cand_faults.status == "launch_error"
    assert cand_faults.message is not None and not cand_faults.message.startswith("reference kernel")
    assert "illegal memory access" in cand_faults.message
    assert fine.status == "ok", fine.message
    assert fine.correctness.passed


@pytest.mark.anyio
async def test_reference_out_of_bounds_write_is_still_caught_in_shared_buffers(tmp_path: Path) -> None:
    workload = vadd_workload(1024)
    async with measurer(tmp_path, [sys.executable, FAKE, "--fake-pycuda"]) as m:
        result = await m.measure(request(m, op("add"), workload, reference=op("oob")))
        wrong = await m.measure(request(m, op("wrong"), workload, reference=op("add")))
    assert result.status == "out_of_bounds_write"
    assert result.message is not None and result.message.startswith("reference kernel: ")
    assert "'c'" in result.message
    # The comparison is unchanged: a wrong candidate is still caught against the reference.
    assert wrong.status == "wrong_output"
    assert wrong.correctness.passed is False


@pytest.mark.anyio
async def test_a_slow_nvidia_smi_cannot_push_a_finished_job_past_its_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clocks are provenance: read (through nvidia-smi when NVML is absent) in a bounded share of the time left,
    between warm-up and timing. A 1.5 s nvidia-smi after the timed runs turned a 1 s job into a timeout that
    lost every sample and was charged the whole cap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\nsleep 1.5\necho "1980, 2619, 0x0000000000000001"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    workload = vadd_workload(1024)
    async with measurer(tmp_path, [sys.executable, FAKE, "--fake-pycuda"]) as m:
        result = await m.measure(request(m, op("add"), workload, reference=op("add"), max_seconds=1.0))
    assert result.status == "ok", result.message
    assert result.cost.gpu_seconds < 1.0


PRINTS = """
import os
import forecaster_mcp.measure.gpu_worker as g
g._LOG_LIMIT = 4 << 20
orig_call = f._FakeFunction.prepared_async_call
def call(self, grid, block, stream, *args, shared_size=0):
    os.write(1, b"x" * (1 << 20))  # what a full 1 MiB printf FIFO flushed at a synchronize looks like
    peak = max(os.fstat(2).st_size, int(open(PEAK_FILE).read() or 0))
    open(PEAK_FILE, "w").write(str(peak))
    return orig_call(self, grid, block, stream, *args, shared_size=shared_size)
f._FakeFunction.prepared_async_call = call
"""


@pytest.mark.anyio
async def test_a_printing_kernel_cannot_fill_the_disk_within_one_job(tmp_path: Path) -> None:
    """Device printf lands in the worker's log file at every synchronize; timed thousands of times it grew
    to hundreds of megabytes in one job (the supervisor trims only between jobs)."""
    peak = tmp_path / "peak"
    peak.write_text("0")
    cmd = wrapper(tmp_path, f"PEAK_FILE = {str(peak)!r}\n{PRINTS}")
    async with measurer(tmp_path, cmd) as m:
        result = await m.measure(
            request(m, op("add"), vadd_workload(1024), max_seconds=1.0, max_runs=100_000)
        )
    assert result.status == "ok", result.message
    assert int(peak.read_text()) <= (4 + 9) << 20  # the limit, plus at most 8 runs' output before a check


def test_out_of_memory_loading_the_module_is_not_the_kernels_launch_error() -> None:
    # What the device holds at that moment, not the kernel: run() answers it as out_of_memory (never cached);
    # load() turned it into launch_error, cached and learned as the kernel's own failure.
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_gpu_worker import FakeDriver, FakeMemoryError

    from forecaster_mcp.measure.gpu_worker import GpuSession
    from forecaster_mcp.measure.worker_protocol import KernelImage
    from forecaster_mcp.models import Launch, Workload

    driver = FakeDriver()

    def oom(path: str) -> None:
        raise FakeMemoryError("cuModuleLoad failed: out of memory")

    driver.module_from_file = oom  # type: ignore[method-assign]
    session = object.__new__(GpuSession)
    session.cuda = driver
    image = KernelImage(
        cubin_path="/nonexistent",
        symbol="k",
        entry="k",
        launch=Launch.model_validate({"grid": [1], "block": [1]}),
    )
    with pytest.raises(FakeMemoryError):
        session.load(image, Workload.model_validate({"args": []}))


SKIPS = """
import numpy as np
orig_call = f._FakeFunction.prepared_async_call
def call(self, grid, block, stream, *args, shared_size=0):
    d = self.module.driver
    if self.module.image["defines"].get("FAKE_OP") != "skip":
        return orig_call(self, grid, block, stream, *args, shared_size=shared_size)
    n = int(args[3])
    a, b, c = (d.view(int(p), 4 * n).view(np.float32) for p in args[:3])
    if c[0] == a[0] + b[0]:  # the output already holds the answer: skip the work
        (stream or d.default_stream).clock_ms += 0.001
        return
    c[:] = a + b
    (stream or d.default_stream).clock_ms += 1.0
f._FakeFunction.prepared_async_call = call
"""

# The pristine copies (a buffer's size without its guards) do not fit: every run is restored from the host.
NO_ROOM_FOR_COPIES = """
orig_alloc = f.FakeDriver.mem_alloc
def mem_alloc(self, nbytes):
    if nbytes == 4 * 1024:
        raise f.FakeMemoryError("cuMemAlloc failed: out of memory")
    return orig_alloc(self, nbytes)
f.FakeDriver.mem_alloc = mem_alloc
"""


@pytest.mark.anyio
@pytest.mark.parametrize("patch", ["", NO_ROOM_FOR_COPIES], ids=["device copies", "host copies"])
async def test_every_timed_run_starts_from_the_jobs_inputs(tmp_path: Path, patch: str) -> None:
    """A kernel that skips its work when its output already holds the answer passed both checks (each starts
    from fresh buffers) and was timed at its early exit: every timed run saw the previous run's output."""
    async with measurer(tmp_path, wrapper(tmp_path, SKIPS + patch)) as m:
        results = {
            name: await m.measure(request(m, op(name), vadd_workload(1024), reference=op("add"), max_runs=50))
            for name in ("add", "skip")
        }
    for r in results.values():
        assert r.status == "ok" and r.correctness.passed and r.runtime_ms is not None, r.message
    assert results["skip"].runtime_ms.median == pytest.approx(1.0, rel=1e-6)  # (was 0.001 ms)


COUNTS = """
from forecaster_mcp.measure import gpu_worker as g
orig_launch = g.GpuSession.launch
launches = [0]
def launch(self, kernel, buffers):
    launches[0] += 1
    open(COUNT_FILE, "w").write(str(launches[0]))
    return orig_launch(self, kernel, buffers)
g.GpuSession.launch = launch
"""


@pytest.mark.anyio
async def test_max_runs_bounds_the_warm_up_and_wall_clock_runs_too(tmp_path: Path) -> None:
    """max_runs=1 launched the kernel 108 times (up to 100 warm-up runs, 3 wall-clock samples), all charged."""
    count = tmp_path / "count"
    count.write_text("0")
    async with measurer(tmp_path, wrapper(tmp_path, f"COUNT_FILE = {str(count)!r}\n{COUNTS}")) as m:
        result = await m.measure(request(m, op("add"), vadd_workload(1024), reference=op("add"), max_runs=1))
    assert result.status == "ok" and result.runtime_ms is not None and result.runtime_ms.runs == 1
    # Each input set's check and its reference run (4), one warm-up, one timed and one wall-clock run.
    assert int(count.read_text()) == 7


@pytest.mark.anyio
async def test_a_block_the_compiled_kernel_cannot_launch_is_refused_before_its_inputs(tmp_path: Path) -> None:
    """Registers per thread (or __launch_bounds__) allow fewer threads per block than the launch asks: the
    worker generated and uploaded the whole workload (seconds, charged) before a launch that cannot succeed."""
    marker = tmp_path / "inputs-generated"
    body = "import forecaster_mcp.measure.gpu_worker as g\n" + recording_calls(
        "g.generate_inputs", "'x'", marker
    )
    heavy = op("add", FAKE_MAX_THREADS=128)
    async with measurer(tmp_path, wrapper(tmp_path, body)) as m:
        refused = await m.measure(request(m, heavy, vadd_workload(1024)))
        generated_for_refused = marker.exists()
        fits = await m.measure(request(m, op("add"), vadd_workload(1024)))
    assert refused.status == "launch_error" and refused.message is not None
    assert "cannot launch blocks of 256 threads" in refused.message and "at most 128" in refused.message
    assert not generated_for_refused and marker.exists()  # only the kernel that fits had inputs made
    assert fits.status == "ok", fits.message


@pytest.mark.anyio
async def test_a_job_killed_at_its_cap_is_reported_as_what_it_was_doing(tmp_path: Path) -> None:
    """A hanging reference was reported (and learned) as the measured kernel's own timeout, and so was a cap
    that ran out while the workload's inputs were still being made, before the kernel ever ran."""
    slow_inputs = (
        "import time\n"
        "import forecaster_mcp.measure.gpu_worker as g\n"
        "orig = g.generate_inputs\n"
        "def generate(*a, **k):\n"
        "    time.sleep(30)\n"
        "    return orig(*a, **k)\n"
        "g.generate_inputs = generate\n"
    )
    workload = vadd_workload(1024)
    async with measurer(tmp_path, [sys.executable, FAKE, "--fake-pycuda"]) as m:
        ref_hangs = await m.measure(request(m, op("add"), workload, reference=op("hang"), max_seconds=1.0))
        kernel_hangs = await m.measure(request(m, op("hang"), workload, reference=op("add"), max_seconds=1.0))
    async with measurer(tmp_path / "slow", wrapper(tmp_path, slow_inputs)) as m:
        inputs_slow = await m.measure(request(m, op("add"), workload, max_seconds=1.0))
    assert ref_hangs.status == kernel_hangs.status == inputs_slow.status == "timeout"
    assert (ref_hangs.message or "").startswith("reference kernel: ")
    assert not (kernel_hangs.message or "").startswith("reference kernel")
    assert "the kernel did not finish" in (kernel_hangs.message or "")
    assert "inputs were being generated" in (inputs_slow.message or "")
    assert INPUTS_UNFINISHED in inputs_slow.flags and INPUTS_UNFINISHED not in kernel_hangs.flags


@pytest.mark.anyio
async def test_a_kernel_too_slow_for_any_timed_run_is_not_run_again(tmp_path: Path) -> None:
    """One run takes 3 s, the reference's check too, under max_seconds=10: after the check no timed run can fit,
    yet the worker ran the kernel once more (a warm-up, or with no timed sample a wall-clock run), charged."""
    launches = tmp_path / "launches"
    op_name = "a[0].module.image['defines'].get('FAKE_OP', '') + '\\n'"  # a[0]: the function called
    body = recording_calls("f._FakeFunction.prepared_async_call", op_name, launches)
    slow = op("side", FAKE_WALL_MS=3000)
    async with measurer(tmp_path, wrapper(tmp_path, body)) as m:
        result = await m.measure(request(m, slow, vadd_workload(1024), reference=op("add"), max_seconds=10.0))
    assert result.status == "timeout" and "leaves no time for timed runs" in (result.message or "")
    assert launches.read_text().split() == ["side", "add"]  # the checked run and the reference, no more
    assert result.cost.gpu_seconds < 4.5


THROTTLES_WHILE_TIMED = """
import forecaster_mcp.measure.gpu_worker as g
g.Telemetry.clocks = lambda self, within_s=5.0: (1980.0, 2619.0, ["gpu_idle"])  # idle, just synchronized
def poll(self):
    open(POLL_FILE, "a").write("x")
    return 1410.0, ["sw_power_cap", "hw_thermal_slowdown"]  # what NVML says with a timed run on the device
g.Telemetry.poll = poll
g.POLL_SECONDS = 1e9  # polled at the first timed run only, however slow the machine
"""


@pytest.mark.anyio
async def test_throttling_during_the_timed_runs_is_reported(tmp_path: Path) -> None:
    """The clocks were read once, between warm-up and timing, just after a synchronize: a thermal or power
    slowdown that set in while the runs were timed (a sustained load) left no flag, and the provenance gave the
    boost clock read before it."""
    polls = tmp_path / "polls"
    polls.write_text("")
    cmd = wrapper(tmp_path, f"POLL_FILE = {str(polls)!r}\n{THROTTLES_WHILE_TIMED}")
    async with measurer(tmp_path, cmd) as m:
        result = await m.measure(request(m, op("add"), vadd_workload(1024), max_runs=50))
    assert result.status == "ok", result.message
    assert "clock_throttled" in result.flags
    assert result.device.sm_clock_mhz == 1410.0
    assert result.device.throttle_reasons == ["sw_power_cap", "hw_thermal_slowdown"]
    # Polled at the first timed run, not at every one (POLL_SECONDS apart).
    assert len(polls.read_text()) == 1


@pytest.mark.anyio
async def test_a_poll_after_a_short_run_has_ended_reports_no_gpu_idle(tmp_path: Path) -> None:
    """A poll follows the sample's launch: a run of microseconds has ended by then and NVML says gpu_idle,
    which the read before timing's gpu_idle was dropped for (it is no reason the timed runs ran slower)."""
    idle = THROTTLES_WHILE_TIMED.replace(
        '1410.0, ["sw_power_cap", "hw_thermal_slowdown"]', '1965.0, ["gpu_idle"]'
    )
    cmd = wrapper(tmp_path, f"POLL_FILE = {str(tmp_path / 'polls')!r}\n{idle}")
    async with measurer(tmp_path, cmd) as m:
        result = await m.measure(request(m, op("add"), vadd_workload(1024), max_runs=50))
    assert result.status == "ok", result.message
    assert "clock_throttled" not in result.flags
    assert result.device.sm_clock_mhz == 1965.0
    assert result.device.throttle_reasons == []
