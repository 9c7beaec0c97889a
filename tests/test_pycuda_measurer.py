"""The pycuda supervisor on the CPU: a stand-in worker (tests/fake_gpu_worker.py) speaks the real protocol
through the real `serve` loop, so isolation, time caps, crash handling and gas accounting run for real.
Compiler tests use the real nvcc when it is installed (nvcc -cubin needs no GPU)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from forecaster_mcp.errors import InvalidRequest, NotMeasurable
from forecaster_mcp.examples import load_examples
from forecaster_mcp.measure import pycuda_measurer
from forecaster_mcp.measure.base import MeasureRequest
from forecaster_mcp.measure.pycuda_measurer import (
    CompiledKernel,
    CompileFailure,
    NvccCompiler,
    PycudaMeasurer,
    _visible_indices,
    detect_reason,
    parse_ptx_params,
    parse_ptxas,
    resolve_symbol,
    trim_compiler_message,
)
from forecaster_mcp.measure.worker_protocol import (
    HEADER,
    MAGIC,
    DeviceInfo,
    JobResult,
    KernelImage,
    MeasureJob,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    decode_supervisor_message,
    decode_worker_message,
    encode_frame,
    parse_header,
    read_frame_sync,
    write_frame_sync,
)
from forecaster_mcp.models import COMPILE_INTERRUPTED, Kernel, Launch, Workload

FAKE = str(Path(__file__).with_name("fake_gpu_worker.py"))
FAKE_NVCC = [sys.executable, FAKE, "nvcc"]
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")

SRC = (
    "__global__ void vadd(const float* a, const float* b, float* c, int n) {\n"
    "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) c[i] = a[i] + b[i];\n}\n"
)
WORKLOAD = Workload.model_validate(
    {
        "args": [
            {"name": "a", "dtype": "float32", "shape": [1024]},
            {"name": "b", "dtype": "float32", "shape": [1024]},
            {"name": "c", "dtype": "float32", "shape": [1024], "intent": "out"},
            {"name": "n", "dtype": "int32", "value": 1024},
        ]
    }
)


def launch(grid: int, block: int) -> Launch:
    return Launch.model_validate({"grid": [grid], "block": [block]})


def kernel(mode: str = "ok", **defines: str | int | float) -> Kernel:
    return Kernel(source=SRC, entry="vadd", launch=launch(4, 256), defines={"FAKE_MODE": mode, **defines})


REFERENCE = kernel()


def make(tmp_path: Path, *worker_args: str, **kwargs: Any) -> PycudaMeasurer:
    kwargs.setdefault("nvcc", FAKE_NVCC)
    kwargs.setdefault("kill_slack_s", 0.3)
    kwargs.setdefault("startup_grace_s", 20.0)
    return PycudaMeasurer(
        tmp_path / "cache",
        worker_cmd=[sys.executable, FAKE, *worker_args],
        device_names=["NVIDIA H100 80GB HBM3"],
        **kwargs,
    )


@pytest.fixture
async def gpu(tmp_path: Path) -> AsyncIterator[PycudaMeasurer]:
    async with make(tmp_path) as m:
        yield m


def request(m: PycudaMeasurer, k: Kernel, **kw: Any) -> MeasureRequest:
    kw.setdefault("reference", REFERENCE)
    kw.setdefault("max_seconds", 5.0)
    return MeasureRequest(kernel=k, workload=kw.pop("workload", WORKLOAD), device=m.devices()[0], **kw)


def exited_within(pid: int, seconds: float) -> bool:
    """True once the process has exited (a zombie counts), waiting at most `seconds` on its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], seconds)
        return bool(ready)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- protocol


def _device_info() -> DeviceInfo:
    return DeviceInfo(
        index=0, name="NVIDIA H200", compute_capability="9.0", sm_count=132, l2_bytes=50 * 2**20,
        max_threads_per_sm=2048, max_blocks_per_sm=32, registers_per_sm=65536, shared_mem_per_sm_bytes=233472,
        max_shared_mem_per_block_bytes=232448, total_mem_bytes=141 * 2**30, pid=1, pgid=1,
    )  # fmt: skip


def test_protocol_round_trip_over_a_stream() -> None:
    job = MeasureJob(
        job_id=7,
        kernel=KernelImage(
            cubin_path="/x.cubin",
            symbol="_Z4vaddPKfS0_Pfi",
            entry="vadd",
            launch=launch(4, 256),
        ),
        workload=WORKLOAD,
        atol=1e-5,
        rtol=1e-3,
        max_seconds=2.0,
        max_runs=50,
        seed=3,
    )
    stream = io.BytesIO()
    write_frame_sync(stream, job)
    write_frame_sync(stream, Shutdown())
    stream.seek(0)
    first = read_frame_sync(stream)
    second = read_frame_sync(stream)
    assert first is not None and second is not None
    assert decode_supervisor_message(first) == job
    assert isinstance(decode_supervisor_message(second), Shutdown)
    assert read_frame_sync(stream) is None  # clean end between frames

    ready = Ready(device=_device_info())
    assert ready.device.arch == "sm_90"
    for message in (
        ready,
        Progress(job_id=7, done=3, total=50),
        JobResult(job_id=7, status="ok", samples_ms=[1.0]),
    ):
        frame = encode_frame(message)
        assert parse_header(frame[: HEADER.size]) == len(frame) - HEADER.size
        assert decode_worker_message(frame[HEADER.size :]) == message


def test_protocol_rejects_garbage_truncation_and_huge_lengths() -> None:
    with pytest.raises(ProtocolError, match="not a protocol frame"):
        parse_header(b"Segmenta")
    with pytest.raises(ProtocolError, match="over the"):
        parse_header(HEADER.pack(MAGIC, 2**31))
    with pytest.raises(ProtocolError, match="truncated"):
        parse_header(b"FMW")
    truncated = io.BytesIO(encode_frame(Shutdown())[:-2])
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        read_frame_sync(truncated)
    with pytest.raises(ProtocolError, match="invalid worker message"):
        decode_worker_message(b'{"type": "result", "job_id": "x"}')
    with pytest.raises(ProtocolError):
        decode_worker_message(b"not json")
    # A validator's own message, without pydantic's "Value error, " before it.
    image = {"cubin_path": "k.cubin", "symbol": "k", "entry": "k", "launch": {"grid": [0], "block": [1]}}
    with pytest.raises(ProtocolError) as bad_launch:
        decode_supervisor_message(json.dumps({"type": "measure", "job_id": 1, "kernel": image}).encode())
    assert str(bad_launch.value) == (
        "invalid supervisor message: measure.kernel.launch.grid: launch.grid dimensions must be positive "
        "(at least 1), got [0]"
    )


# ---------------------------------------------------------------- measuring through the stand-in worker


@pytest.mark.anyio
async def test_ok_measurement_reports_stats_correctness_resources_and_costs(gpu: PycudaMeasurer) -> None:
    assert gpu.name == "pycuda"
    device = gpu.devices()[0]
    assert device == "H100-SXM5-80GB"  # canonical name from the spec table
    result = await gpu.measure(request(gpu, kernel(FAKE_MS=0.5)))
    assert result.status == "ok", result.message
    assert result.kernel_id == "k0"
    stats = result.runtime_ms
    assert stats is not None and stats.runs >= 10
    assert abs(stats.median - 0.5) < 0.01
    assert stats.ci95_low <= stats.median <= stats.ci95_high
    assert stats.relative_noise <= 0.01
    assert result.correctness.checked and result.correctness.passed
    assert result.correctness.input_sets == 2
    assert result.resources.registers == 32
    assert result.resources.occupancy is not None and 0 < result.resources.occupancy <= 1
    assert result.resources.local_bytes == 0
    assert result.device.backend == "pycuda" and result.device.compute_capability == "9.0"
    assert result.device.sm_clock_mhz == 1980.0
    assert 0 < result.cost.gpu_seconds < 5.0
    assert result.cost.compile_seconds > 0
    assert result.flags == []
    assert gpu.reservation_seconds(request(gpu, kernel(), max_seconds=7.5)) == 7.5
    assert gpu.device_fingerprint(device).startswith("pycuda|H100-SXM5-80GB|driver=")


@pytest.mark.anyio
async def test_wrong_output_and_cached_answers_are_caught(gpu: PycudaMeasurer) -> None:
    wrong = await gpu.measure(request(gpu, kernel(FAKE_OP="wrong")))
    assert wrong.status == "wrong_output"
    assert wrong.correctness.passed is False
    assert wrong.message is not None and wrong.message.startswith("c[0]: got")
    # Right on the first input set, stale on the fresh one: only the second set catches it.
    cached = await gpu.measure(request(gpu, kernel(FAKE_OP="cache")))
    assert cached.status == "wrong_output"
    assert cached.correctness.input_sets == 2
    # The fake worker's fresh set is the job's seed (0 here) + 7919: the failure names the set and its seed.
    assert cached.message is not None and cached.message.endswith("(input set 2 of 2, seed 7919)")
    nan = await gpu.measure(request(gpu, kernel(FAKE_OP="nan")))
    assert nan.status == "wrong_output"
    assert "NaN positions differ" in (nan.message or "")


@pytest.mark.anyio
async def test_without_reference_outputs_are_not_checked(gpu: PycudaMeasurer) -> None:
    result = await gpu.measure(request(gpu, kernel(), reference=None))
    assert result.status == "ok"
    assert result.correctness.checked is False and result.correctness.passed is None


@pytest.mark.anyio
async def test_hang_is_killed_at_the_cap_with_its_process_group(gpu: PycudaMeasurer) -> None:
    grandchildren: list[int] = []
    pidfds: list[int] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        if message and message.startswith("grandchild "):
            pid = int(message.split()[1])
            grandchildren.append(pid)
            pidfds.append(os.pidfd_open(pid))  # while it is certainly alive

    warm = await gpu.measure(request(gpu, kernel()))
    assert warm.status == "ok"
    first_worker = gpu.worker_pid(gpu.devices()[0])
    assert first_worker is not None
    with anyio.fail_after(30):
        result = await gpu.measure(request(gpu, kernel("hang"), max_seconds=0.5), progress)
    assert result.status == "timeout"
    assert result.cost.gpu_seconds == 0.5  # a hang is charged its whole cap
    assert "killed" in (result.message or "")
    assert grandchildren, "the stand-in never reported its grandchild"
    for fd in pidfds:
        ready, _, _ = select.select([fd], [], [], 5.0)
        os.close(fd)
        assert ready, "a process in the worker's group survived the kill"
    assert exited_within(first_worker, 5.0)
    assert gpu.worker_pid(gpu.devices()[0]) is None
    after = await gpu.measure(request(gpu, kernel()))
    assert after.status == "ok"
    assert gpu.worker_pid(gpu.devices()[0]) not in (None, first_worker)


@pytest.mark.anyio
async def test_crash_is_a_result_with_stderr_and_no_host_paths(gpu: PycudaMeasurer) -> None:
    with anyio.fail_after(30):
        result = await gpu.measure(request(gpu, kernel("crash"), max_seconds=5.0))
    assert result.status == "worker_crashed"
    message = result.message or ""
    assert "SIGSEGV" in message
    assert "illegal address in kernel.cu" in message
    assert "/home/someone" not in message
    assert 0 < result.cost.gpu_seconds < 5.0  # charged the time it held the device, not the cap
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "says"),
    [("garbage", "not a protocol frame"), ("bad_length", "over the"), ("wrong_job", "unexpected JobResult")],
)
async def test_garbage_on_the_pipe_is_a_crash_and_the_worker_is_replaced(
    gpu: PycudaMeasurer, mode: str, says: str
) -> None:
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"
    before = gpu.worker_pid(gpu.devices()[0])
    assert before is not None
    with anyio.fail_after(30):
        result = await gpu.measure(request(gpu, kernel(mode)))
    assert result.status == "worker_crashed"
    assert says in (result.message or "")
    assert exited_within(before, 5.0)
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"
    assert gpu.worker_pid(gpu.devices()[0]) != before


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "status"), [("launch_error", "launch_error"), ("oob", "out_of_bounds_write")]
)
async def test_faults_discard_the_context(gpu: PycudaMeasurer, mode: str, status: str) -> None:
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"
    before = gpu.worker_pid(gpu.devices()[0])
    assert before is not None
    result = await gpu.measure(request(gpu, kernel(mode)))
    assert result.status == status
    assert result.runtime_ms is None
    assert exited_within(before, 5.0)
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"


@pytest.mark.anyio
async def test_requests_to_one_device_are_serialised_and_waiting_is_not_charged(gpu: PycudaMeasurer) -> None:
    results = []

    async def one(i: int) -> None:
        results.append(await gpu.measure(request(gpu, kernel(FAKE_BUSY_S=0.2, FAKE_MS=1.0 + i))))

    started = time.perf_counter()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
    took = time.perf_counter() - started
    assert [r.status for r in results] == ["ok"] * 3
    assert sorted(round(r.runtime_ms.median) for r in results if r.runtime_ms) == [1, 2, 3]
    # Each held the device at least its 0.2 s; the ~0.2 s and ~0.4 s the others waited for the lock are not
    # charged. Charged spans are the device's, one at a time, so together they fit in the wall time of the
    # three (waiting charged would overlap them by 0.6 s). Not `< 0.38` each: on a loaded machine a job's own
    # overhead can come near that.
    assert all(r.cost.gpu_seconds >= 0.2 for r in results), [r.cost for r in results]
    assert sum(r.cost.gpu_seconds for r in results) <= took, ([r.cost for r in results], took)


async def _side_by_side(folders: tuple[Path, Path], busy_s: float) -> tuple[float, dict[str, float]]:
    """Two measurers (two server processes' worth, on `folders`) each started, then one job of `busy_s` on the
    device from each at once: the wall time both took, and what each was charged."""
    spans: dict[str, tuple[float, float]] = {}
    charged: dict[str, float] = {}

    async def one(m: PycudaMeasurer, who: str) -> None:
        started = time.monotonic()
        r = await m.measure(request(m, kernel(FAKE_BUSY_S=busy_s)))
        spans[who] = (started, time.monotonic())
        assert r.status == "ok" and r.cost.gpu_seconds >= busy_s, (r.status, r.message, r.cost)
        charged[who] = r.cost.gpu_seconds

    async with make(folders[0]) as a, make(folders[1]) as b:
        for m in (a, b):  # started and compiled first: the turns below are the jobs alone
            await m.measure(request(m, kernel()))
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, a, "a")
                tg.start_soon(one, b, "b")
    return max(end for _, end in spans.values()) - min(start for start, _ in spans.values()), charged


@pytest.mark.anyio
async def test_two_servers_on_one_gpu_take_turns(tmp_path: Path) -> None:
    """Two server processes (two IDE sessions) on one workstation share its GPU: their jobs run one at a time
    (each one's events would otherwise time the other's kernels), and the waiting is not charged."""
    took, charged = await _side_by_side((tmp_path, tmp_path), 0.4)
    # One after the other, not side by side: together they took both jobs' time.
    assert took >= 0.8
    # The one that waited is not charged its wait: the charged spans, one at a time, fit in the time both
    # took (a charged wait would overlap them by ~0.4 s). Not `< 0.6` each: a loaded machine adds to a job.
    assert sum(charged.values()) <= took, (charged, took)


@pytest.mark.anyio
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the machine-wide lock is Linux's (abstract sockets)"
)
async def test_two_servers_with_their_own_state_folders_on_one_gpu_take_turns(tmp_path: Path) -> None:
    """The turns were kept by a lock file in the state folder: two users' servers (or two FORECASTER_MCP_HOMEs)
    on one workstation ran their jobs on its GPU side by side, each one's events timing the other's kernels."""
    took, _ = await _side_by_side((tmp_path / "alice", tmp_path / "bob"), 1.0)
    assert took >= 2.0  # one after the other (side by side: about 1 s)


@pytest.mark.anyio
async def test_a_machine_that_refuses_unix_sockets_still_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine-wide lock is a courtesy: where no AF_UNIX socket can be made (a sandbox, no descriptor
    left), the job runs without it. The socket was made outside the fallback, so the OSError failed the job."""
    import socket as real

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    fake = type(
        "socket", (), {"socket": staticmethod(refused), "gethostname": staticmethod(real.gethostname)}
    )
    fake.AF_UNIX, fake.SOCK_STREAM = real.AF_UNIX, real.SOCK_STREAM  # type: ignore[attr-defined]
    async with make(tmp_path) as m:
        await m.measure(request(m, kernel()))  # started before: only the job's lock meets the refusal
        monkeypatch.setattr(pycuda_measurer, "socket", fake)
        r = await m.measure(request(m, kernel(FAKE_MS=2.0)))
    assert r.status == "ok", (r.status, r.message)


def test_the_machine_lock_of_a_device_without_a_bus_id_is_named_by_its_slot(tmp_path: Path) -> None:
    """A worker that reports no PCI bus id: the state folder's lock falls back to the slot, the machine-wide
    one was named "...-gpu-None", one name for every such device of the machine (two GPUs took turns)."""
    m = make(tmp_path)
    slots = [
        pycuda_measurer._Slot(i, "H200", anyio.Lock(), info=_device_info().model_copy(update={"index": i}))
        for i in (0, 1)
    ]
    names = [m._machine_lock_name(s) for s in slots]
    assert names[0] != names[1] and all("None" not in n for n in names), names
    # A long (or non-ASCII) scope is hashed to fit the 107 bytes of an abstract name, counted in bytes.
    m._lock_scope = "é" * 60
    assert len(m._machine_lock_name(slots[0]).encode()) <= 107


@pytest.mark.anyio
async def test_a_worker_that_died_while_idle_is_replaced_not_blamed_on_the_next_kernel(
    gpu: PycudaMeasurer,
) -> None:
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"
    pid = gpu.worker_pid(gpu.devices()[0])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):  # until it is dead: a zombie (its return code not collected yet), or reaped already
        try:
            with open(f"/proc/{pid}/stat") as f:  # noqa: ASYNC230 - a tiny procfs read
                stat = f.read()
        except FileNotFoundError:
            break
        if stat[stat.rfind(")") + 1 :].split()[0] == "Z":
            break
        await anyio.sleep(0.02)
    after = await gpu.measure(request(gpu, kernel(FAKE_MS=2.0)))
    assert after.status == "ok", after.message
    assert gpu.worker_pid(gpu.devices()[0]) not in (None, pid)


@pytest.mark.anyio
async def test_a_state_folder_without_file_locks_still_measures(
    gpu: PycudaMeasurer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS without lockd answers flock with ENOLCK: the job runs unlocked (with a warning), not failed."""
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"


@pytest.mark.anyio
async def test_compile_time_is_not_gpu_time(gpu: PycudaMeasurer) -> None:
    result = await gpu.measure(request(gpu, kernel(FAKE_COMPILE_SLEEP=0.4), reference=None))
    assert result.status == "ok"
    assert result.cost.compile_seconds >= 0.4
    # Charged, the compile's 0.4 s sleep would be in it; what a loaded machine adds to a job is not.
    assert result.cost.gpu_seconds < 0.4
    again = await gpu.measure(request(gpu, kernel(FAKE_COMPILE_SLEEP=0.4), reference=None))
    assert again.cost.compile_seconds < 0.4  # the compile cache answered (a compile sleeps 0.4 s)


@pytest.mark.anyio
async def test_compile_errors_are_results_and_cached(gpu: PycudaMeasurer, tmp_path: Path) -> None:
    broken = Kernel(source="// line 1\n#error this kernel is broken\n", entry="vadd", launch=launch(1, 32))
    result = await gpu.measure(request(gpu, broken, reference=None))
    assert result.status == "compile_error"
    assert result.cost.gpu_seconds == 0.0
    message = result.message or ""
    assert message.startswith('kernel.cu(2): error: #error directive: "this kernel is broken"')
    assert str(tmp_path) not in message and "nvcc-" not in message
    cached = list((tmp_path / "cache" / "kernels").glob("*/meta.json"))
    assert any("error" in json.loads(p.read_text()) for p in cached)
    again = await gpu.measure(request(gpu, broken, reference=None))
    assert again.message == result.message
    bad_reference = await gpu.measure(request(gpu, kernel(), reference=broken))
    assert bad_reference.status == "compile_error"
    assert (bad_reference.message or "").startswith("reference kernel: ")


@pytest.mark.anyio
async def test_compile_timeout_is_reported_and_not_cached(tmp_path: Path) -> None:
    async with make(tmp_path, compile_timeout_s=1.0) as m:
        with anyio.fail_after(30):
            result = await m.measure(request(m, kernel(FAKE_COMPILE_HANG=1), reference=None))
        # "timeout", not "compile_error": the store never caches a timeout, so a retry (a longer compile
        # timeout, a quieter machine) compiles again instead of being answered this result for ever.
        assert result.status == "timeout" and result.cost.gpu_seconds == 0.0
        assert "did not finish within 1 s" in (result.message or "") and "retry" in (result.message or "")
        assert not list((tmp_path / "cache" / "kernels").glob("*/meta.json"))
        # Flagged: the store neither learns it as the kernel's failure nor answers from it (test_store).
        assert COMPILE_INTERRUPTED in result.flags


@pytest.mark.anyio
async def test_parameter_list_mismatch_is_caught_before_running(gpu: PycudaMeasurer) -> None:
    three = Workload.model_validate({"args": [a.model_dump() for a in WORKLOAD.args[:3]]})
    result = await gpu.measure(request(gpu, kernel(), workload=three, reference=None))
    assert result.status == "launch_error"
    assert result.cost.gpu_seconds == 0.0
    assert "vadd takes 4 parameters" in (result.message or "")
    wide = Workload.model_validate(
        {
            "args": [
                *(a.model_dump() for a in WORKLOAD.args[:3]),
                {"name": "n", "dtype": "int64", "value": 1024},
            ]
        }
    )
    result = await gpu.measure(request(gpu, kernel(), workload=wide, reference=None))
    assert result.status == "launch_error"
    assert "parameter 3 is 4 bytes" in (result.message or "")


@pytest.mark.anyio
async def test_plausibility_flags(gpu: PycudaMeasurer) -> None:
    big = Workload.model_validate(
        {
            "args": [
                {"name": "a", "dtype": "float32", "shape": [1 << 24]},
                {"name": "b", "dtype": "float32", "shape": [1 << 24]},
                {"name": "c", "dtype": "float32", "shape": [1 << 10], "intent": "out"},
                {"name": "n", "dtype": "int32", "value": 1024},
            ]
        }
    )
    # 128 MiB read in 1 microsecond is far beyond any HBM (the floor is about 0.03 ms at 4.8 TB/s).
    fast = await gpu.measure(request(gpu, kernel(FAKE_MS=0.001), workload=big, reference=None))
    assert "below_physical_floor" in fast.flags
    assert "below_physical_floor" in (fast.message or "")
    honest = await gpu.measure(request(gpu, kernel(FAKE_MS=1.0), workload=big, reference=None))
    assert "below_physical_floor" not in honest.flags
    side = await gpu.measure(request(gpu, kernel(FAKE_MS=0.1, FAKE_WALL_MS=20.0), reference=None))
    assert "events_disagree_with_wall_clock" in side.flags
    noisy = await gpu.measure(request(gpu, kernel(FAKE_NOISE=0.5), reference=None, max_runs=12))
    assert noisy.runtime_ms is not None and noisy.runtime_ms.runs == 12
    assert "noise_target_not_reached" in noisy.flags


@pytest.mark.anyio
async def test_a_run_ended_by_its_run_cap_says_so(gpu: PycudaMeasurer) -> None:
    """The result schema lists runs_capped_by_max_runs / runs_capped_by_max_seconds and replay sets them, but
    a GPU measurement stopped by max_runs never said so: a client could not tell a cap from the noise target."""
    capped = await gpu.measure(request(gpu, kernel(FAKE_NOISE=0.5), reference=None, max_runs=12))
    assert "runs_capped_by_max_runs" in capped.flags
    assert "runs_capped_by_max_seconds" not in capped.flags
    quiet = await gpu.measure(request(gpu, kernel(FAKE_NOISE=0.0001), reference=None, max_runs=500))
    assert quiet.runtime_ms is not None and quiet.runtime_ms.runs < 500
    assert not {"runs_capped_by_max_runs", "runs_capped_by_max_seconds"} & set(quiet.flags)


# ---------------------------------------------------------------- start-up, routing, detection


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("startup", "says"),
    [
        ("fatal", "pycuda is not importable"),
        ("hang", "did not become ready within 1 s"),
        ("crash", "worker start-up crashed"),
        ("garbage", "broke the protocol"),
    ],
)
async def test_a_worker_that_cannot_start_is_not_measurable(tmp_path: Path, startup: str, says: str) -> None:
    # The 1 s grace is for the hang alone: the others must say why in their own words, however long a loaded
    # machine takes to start them (a stand-in's imports can take over 1 s there: "did not become ready").
    grace = 1.0 if startup == "hang" else 20.0
    async with make(tmp_path, "--startup", startup, startup_grace_s=grace) as m:
        with anyio.fail_after(30), pytest.raises(NotMeasurable, match=says):
            await m.measure(request(m, kernel()))


@pytest.mark.anyio
async def test_a_worker_holding_another_gpu_than_listed_is_not_measured_on(tmp_path: Path) -> None:
    """Device 0 listed as an H100 (nvidia-smi's order, or the server's own cuInit under its CUDA_DEVICE_ORDER)
    while CUDA gave the worker an A100: the supervisor only logged it, and the A100's times were returned,
    cached and learned as the H100's (result.device.name H100-SXM5-80GB). Nothing is measured or charged."""
    async with make(tmp_path, "--name", "NVIDIA A100-PCIE-40GB") as m:
        with anyio.fail_after(30), pytest.raises(NotMeasurable) as info:
            await m.measure(request(m, kernel()))
        message = str(info.value)
        assert "'NVIDIA A100-PCIE-40GB', not the H100-SXM5-80GB" in message
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in message
        assert m.worker_pid("H100-SXM5-80GB") is None


@pytest.mark.anyio
async def test_the_real_worker_says_why_it_cannot_start(tmp_path: Path) -> None:
    """Here pycuda is missing, or installed without a driver to load: either way the real worker says so."""
    import ctypes.util

    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver")
    async with PycudaMeasurer(tmp_path / "cache", device_names=["NVIDIA H200"], nvcc=FAKE_NVCC) as m:
        with anyio.fail_after(60), pytest.raises(NotMeasurable, match="pycuda is not importable") as info:
            await m.measure(request(m, kernel()))
        assert "forecaster-mcp[gpu]" in str(info.value)


@pytest.mark.anyio
async def test_requests_that_cannot_run_here(gpu: PycudaMeasurer) -> None:
    with pytest.raises(NotMeasurable, match="no local GPU named 'A100'"):
        await gpu.measure(MeasureRequest(kernel=kernel(), workload=WORKLOAD, device="A100"))
    triton = Kernel(
        source="@triton.jit\ndef k(): pass\n",
        entry="k",
        language="triton",
        launch=launch(1, 1),
    )
    with pytest.raises(NotMeasurable, match="CUDA C"):
        await gpu.measure(request(gpu, triton))
    with pytest.raises(InvalidRequest, match="launch") as refused:
        await gpu.measure(request(gpu, Kernel(source=SRC, entry="vadd")))
    assert '{"grid": [4096, 1, 1], "block": [256, 1, 1]}' in str(refused.value)  # the shape of one
    # A source that launches its kernel itself is told the launch its host code gives it, to pass (never used
    # in its place: a launch read wrongly would be charged).
    hosted = Kernel(
        source=SRC + "\nvoid run(float* a, float* b, float* c) { vadd<<<64, 128>>>(a, b, c); }\n",
        entry="vadd",
    )
    with pytest.raises(InvalidRequest, match="launch") as refused:
        await gpu.measure(request(gpu, hosted))
    assert 'launches it with {"grid": [64, 1, 1], "block": [128, 1, 1], "shared_mem_bytes": 0}' in str(
        refused.value
    )
    with pytest.raises(InvalidRequest, match=r"workload\.args"):
        await gpu.measure(request(gpu, kernel(), workload=Workload()))


@pytest.mark.anyio
async def test_launch_advice_that_cannot_be_read_is_the_general_kind(
    gpu: PycudaMeasurer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forecaster_mcp.forecast import host_launch

    def broken(kernel: Kernel, workload: Workload | None) -> None:
        raise RecursionError("a source it cannot read")

    monkeypatch.setattr(host_launch, "source_launch", broken)
    hosted = Kernel(source=SRC + "\nvoid run() { vadd<<<64, 128>>>(0, 0, 0); }\n", entry="vadd")
    with pytest.raises(InvalidRequest, match=r'give grid and block, e\.g\. \{"grid": \[4096, 1, 1\]'):
        await gpu.measure(request(gpu, hosted))


@pytest.mark.anyio
async def test_aclose_stops_the_workers(tmp_path: Path) -> None:
    m = make(tmp_path)
    assert (await m.measure(request(m, kernel()))).status == "ok"
    pid = m.worker_pid(m.devices()[0])
    assert pid is not None
    await m.aclose()
    assert exited_within(pid, 5.0)
    with pytest.raises(NotMeasurable, match="shut down"):
        await m.measure(request(m, kernel()))


def _our_workers(flag: str) -> list[int]:
    """Pids of this test process's live children whose command line has `flag`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat_fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if int(stat_fields[1]) == os.getpid() and stat_fields[0] != "Z" and flag in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.anyio
async def test_a_request_cancelled_while_its_worker_starts_leaves_no_worker(tmp_path: Path) -> None:
    """A client that hangs up during a worker's start-up: the half-started worker (a CUDA context on a real
    GPU) was not the slot's yet, so nothing, not even aclose(), would ever stop it."""
    async with make(tmp_path, "--startup", "hang", startup_grace_s=20.0) as m:
        async with anyio.create_task_group() as tg:
            tg.start_soon(m.measure, request(m, kernel()))
            # Hung up once the worker runs (polled: on a loaded machine it may not have started within the 1 s
            # once waited, and the test then checked nothing).
            started: list[int] = []
            with anyio.fail_after(30):
                while not started:
                    await anyio.sleep(0.02)
                    started = _our_workers("--startup hang")
            tg.cancel_scope.cancel()
        assert all(exited_within(pid, 5.0) for pid in started)
        assert not _our_workers("--startup hang")


@pytest.mark.anyio
async def test_a_request_queued_while_the_measurer_closes_starts_no_worker(tmp_path: Path) -> None:
    m = make(tmp_path)
    outcomes: list[str] = []

    async def queued() -> None:
        try:
            outcomes.append((await m.measure(request(m, kernel()))).status)
        except NotMeasurable as exc:
            outcomes.append(str(exc))

    on_device = anyio.Event()

    async def reported(done: float, total: float | None, message: str | None) -> None:
        if message and message.startswith("grandchild "):  # the stand-in says so once it runs the job
            on_device.set()

    async def hanging() -> None:
        with contextlib.suppress(NotMeasurable):  # what the hang itself gets on shut-down is not the point
            await m.measure(request(m, kernel("hang"), max_seconds=30.0), reported)

    async with anyio.create_task_group() as tg:
        tg.start_soon(hanging)
        # Waited for, not slept: on a loaded machine a worker's start took over the 1 s once waited, and the
        # hang's compile (between its worker's start and its job, the slot free) is no faster there.
        with anyio.fail_after(30):
            await on_device.wait()  # the hang holds the device
        tg.start_soon(queued)
        for _ in range(1500):  # 30 s at most, until the next request queues for the device behind the hang
            if outcomes or m._slots[0].lock.statistics().tasks_waiting:
                break
            await anyio.sleep(0.02)
        assert outcomes or m._slots[0].lock.statistics().tasks_waiting, "the next request never queued"
        await m.aclose()
    assert outcomes == ["the GPU measurer is shut down"]
    assert m.worker_pid(m.devices()[0]) is None and not _our_workers(FAKE)


@pytest.mark.anyio
async def test_a_cancelled_request_does_not_leave_a_busy_worker(gpu: PycudaMeasurer) -> None:
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"
    pid = gpu.worker_pid(gpu.devices()[0])
    assert pid is not None
    on_device = anyio.Event()

    async def reported(done: float, total: float | None, message: str | None) -> None:
        if message and message.startswith("grandchild "):  # the stand-in says so once it runs the job
            on_device.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(gpu.measure, request(gpu, kernel("hang"), max_seconds=30.0), reported)
        # The client goes away while its job holds the worker: waited for, not a fixed 0.5 s, which a loaded
        # machine could spend compiling (the worker then never got the job and was rightly kept).
        with anyio.fail_after(30):
            await on_device.wait()
        tg.cancel_scope.cancel()
    assert exited_within(pid, 5.0)
    assert (await gpu.measure(request(gpu, kernel()))).status == "ok"


def test_detect_without_pycuda_says_why(tmp_path: Path) -> None:
    if __import__("importlib").util.find_spec("pycuda") is not None:
        pytest.skip("pycuda is installed here")
    assert PycudaMeasurer.detect(tmp_path) is None
    assert "pycuda is not installed" in detect_reason()
    assert "pycuda" not in sys.modules


def test_detect_with_pycuda_but_no_driver_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes
    import ctypes.util

    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver")
    fake_pkg = tmp_path / "site" / "pycuda"
    fake_pkg.mkdir(parents=True)
    (fake_pkg / "__init__.py").write_text("raise ImportError('detect must not import pycuda')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda is loadable here")
    except OSError:
        pass
    assert PycudaMeasurer.detect(tmp_path) is None
    assert "libcuda" in detect_reason()


def _pretend_a_gpu_is_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """pycuda importable, a driver present and one H100 listed: what detect checks before the compiler."""
    import importlib.machinery
    import importlib.util

    from forecaster_mcp.measure import pycuda_measurer as pm

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return (
            importlib.machinery.ModuleSpec("pycuda", None)
            if name == "pycuda"
            else real_find_spec(name, *args)
        )

    monkeypatch.setattr(pm.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(pm, "_libcuda_present", lambda: True)
    monkeypatch.setattr(
        pm, "_list_with_nvidia_smi", lambda: pm.GpuListing(["NVIDIA H100 80GB HBM3"], "550.54")
    )


def test_detect_on_a_gpu_machine_without_nvcc_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every measurement compiles with nvcc: a GPU without the toolkit cannot measure, and says so at start-up
    # instead of failing the agent's first measurement. A configured path that is no executable is no nvcc.
    _pretend_a_gpu_is_here(monkeypatch)
    assert PycudaMeasurer.detect(tmp_path, nvcc=str(tmp_path / "no-such-nvcc")) is None
    assert "nvcc (the CUDA toolkit) is not installed" in detect_reason()
    assert "FORECASTER_MCP_NVCC" in detect_reason()
    fake_nvcc = tmp_path / "bin" / "nvcc"
    fake_nvcc.parent.mkdir()
    fake_nvcc.write_text("#!/bin/sh\nexit 0\n")
    fake_nvcc.chmod(0o755)
    found = PycudaMeasurer.detect(tmp_path, nvcc=str(fake_nvcc))
    assert (
        found is not None
        and found.devices() == ["H100-SXM5-80GB"]
        and found.compiler.command == [str(fake_nvcc)]
    )
    assert detect_reason() == ""


def test_cuda_visible_devices_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _visible_indices() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert _visible_indices() == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,3")
    assert _visible_indices() == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d2c0f5e-aaaa")
    assert _visible_indices() == []


# ---------------------------------------------------------------- compiler output parsing


def test_trim_compiler_message_drops_host_paths_and_chatter() -> None:
    work = "/root/.local/share/forecaster-mcp/cache/tmp/nvcc-abc123"
    raw = (
        f'{work}/kernel.cu(3): error: identifier "undefined_thing" is undefined\n'
        "  x[0] = undefined_thing;\n"
        "ptxas info    : Used 8 registers\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "/usr/local/cuda/include/cuda_fp16.h(12): note: declared here\n"
        f'1 error detected in the compilation of "{work}/kernel.cu".\n'
    )
    out = trim_compiler_message(raw, work)
    assert out.splitlines()[0] == 'kernel.cu(3): error: identifier "undefined_thing" is undefined'
    assert "cuda_fp16.h(12): note" in out
    assert "/usr/local" not in out and "/root" not in out and "ptxas info" not in out
    long = trim_compiler_message("\n".join(f"error line {i}" for i in range(2000)), limit=500)
    assert len(long) <= 520 and long.endswith("more lines)")
    assert trim_compiler_message("/usr//local/cuda/include/x.h(1): note") == "x.h(1): note"


def test_trim_compiler_message_is_linear_in_a_line_of_slashes() -> None:
    # nvcc echoes the offending source line: `"/a////...//"` made the path pattern backtrack exponentially (40
    # slashes held the server's event loop for over a minute). Bounded by a generous wall time, not timed.
    import time

    for text in ('kernel.cu(2): error: "/a' + "/" * 44 + '";', "/a" + "/" * 200_000 + '"', "/a/" * 50_000):
        start = time.perf_counter()
        trim_compiler_message(text)
        assert time.perf_counter() - start < 5.0


def test_symbol_resolution() -> None:
    assert resolve_symbol("vadd", ["vadd"]) == "vadd"
    assert resolve_symbol("foo", ["_Z3fooILi32EEvPKfPfid6__half", "bar"]) == "_Z3fooILi32EEvPKfPfid6__half"
    assert resolve_symbol("add", ["_ZN2ns3addEPf"]) == "_ZN2ns3addEPf"
    both = resolve_symbol("foo", ["_Z3fooPf", "_Z3fooPd"])
    assert isinstance(both, CompileFailure) and 'extern "C"' in both.message
    none = resolve_symbol("missing", ["_Z3fooPf"])
    assert isinstance(none, CompileFailure) and "no __global__ function named 'missing'" in none.message
    assert isinstance(resolve_symbol("fo", ["_Z3fooPf"]), CompileFailure)


def test_ptx_and_ptxas_parsing() -> None:
    ptx = (
        ".visible .entry _Z3fooILi32EEvPKfPfid6__half(\n"
        "\t.param .u64 .ptr .align 1 _Z3foo_param_0,\n\t.param .u64 _Z3foo_param_1,\n"
        "\t.param .u32 _Z3foo_param_2,\n\t.param .f64 _Z3foo_param_3,\n"
        "\t.param .align 2 .b8 _Z3foo_param_4[2]\n)\n{\n}\n"
        ".visible .entry empty()\n{\n}\n"
    )
    assert parse_ptx_params(ptx, "_Z3fooILi32EEvPKfPfid6__half") == [8, 8, 4, 8, 2]
    assert parse_ptx_params(ptx, "empty") == []
    assert parse_ptx_params(ptx, "absent") is None
    info = parse_ptxas(
        "ptxas info    : Compiling entry function 'bar' for 'sm_90'\n"
        "ptxas info    : Function properties for bar\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 368 bytes cmem[0]\n"
    )
    assert info == {
        "bar": {"registers": 40, "shared": 4096, "stack": 16, "spill_stores": 8, "spill_loads": 4}
    }
    # A __noinline__ helper's properties come after the kernel's: they are the helper's own.
    heavy = parse_ptxas(
        "ptxas info    : Compiling entry function 'heavy' for 'sm_90'\n"
        "ptxas info    : Function properties for heavy\n"
        "    1656 bytes stack frame, 1644 bytes spill stores, 3184 bytes spill loads\n"
        "ptxas info    : Used 24 registers, used 0 barriers, 1656 bytes cumulative stack size\n"
        "ptxas info    : Function properties for _Z6helperPKfi\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    )
    assert heavy == {
        "heavy": {"registers": 24, "shared": 0, "stack": 1656, "spill_stores": 1644, "spill_loads": 3184}
    }


# ---------------------------------------------------------------- real nvcc (no GPU needed)


@needs_nvcc
@pytest.mark.anyio
async def test_real_nvcc_error_message_is_trimmed(tmp_path: Path) -> None:
    compiler = NvccCompiler(tmp_path / "cache", NVCC)
    broken = Kernel(
        source="#include <cuda_fp16.h>\n__global__ void f(float* x) {\n  x[0] = undefined_thing;\n}\n",
        entry="f",
    )
    outcome = await compiler.compile(broken, "sm_90")
    assert isinstance(outcome, CompileFailure)
    first = outcome.message.splitlines()[0]
    assert first == 'kernel.cu(3): error: identifier "undefined_thing" is undefined'
    assert str(tmp_path) not in outcome.message and "/tmp" not in outcome.message
    assert '1 error detected in the compilation of "kernel.cu".' in outcome.message


@needs_nvcc
@pytest.mark.anyio
async def test_a_huge_cubin_is_a_compile_error_and_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compiles are free: an initialised __device__ array of 64 MB filled the disk 64 MB per request.
    from forecaster_mcp.measure import pycuda_measurer as pm

    monkeypatch.setattr(pm, "MAX_CUBIN_BYTES", 1 << 20)
    compiler = NvccCompiler(tmp_path / "cache", NVCC)
    big = Kernel(
        source="__device__ char big[1 << 22] = {1};\n__global__ void f(char* x) { x[0] = big[3]; }\n",
        entry="f",
    )
    outcome = await compiler.compile(big, "sm_90")
    assert isinstance(outcome, CompileFailure) and "over the 1 MiB this server keeps" in outcome.message
    assert not list((tmp_path / "cache").rglob("*.cubin"))


@needs_nvcc
@pytest.mark.anyio
async def test_real_nvcc_compiles_templates_and_reports_resources(tmp_path: Path) -> None:
    compiler = NvccCompiler(tmp_path / "cache", NVCC)
    source = (
        "#include <cuda_fp16.h>\n"
        "template <int T> __global__ void scale(const float* a, float* b, int n, double d, __half h) {\n"
        "  __shared__ float s[T]; int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  s[threadIdx.x % T] = i < n ? a[i] : 0.f; __syncthreads();\n"
        "  if (i < n) b[i] = s[(threadIdx.x + 1) % T] * d + __half2float(h);\n}\n"
        "template __global__ void scale<SIZE>(const float*, float*, int, double, __half);\n"
    )
    k = Kernel(source=source, entry="scale", defines={"SIZE": 64}, launch=launch(1, 64))
    compiled = await compiler.compile(k, "sm_90")
    assert isinstance(compiled, CompiledKernel), compiled
    assert compiled.symbol.startswith("_Z5scaleILi64EE")
    assert compiled.param_sizes == [8, 8, 4, 8, 2]
    assert compiled.registers is not None and compiled.registers > 0
    assert compiled.static_shared_bytes == 64 * 4
    with open(compiled.cubin_path, "rb") as cubin:  # noqa: ASYNC230 - a 4-byte read in a test
        assert cubin.read(4) == b"\x7fELF"
    again = await compiler.compile(k, "sm_90")
    assert again == compiled  # served from the cache


@needs_nvcc
def test_examples_validate_and_compile_for_sm_90(tmp_path: Path) -> None:
    from forecaster_mcp.measure.pycuda_measurer import _parameter_mismatch

    suites = load_examples()
    assert {s.name for s in suites} == {"vector_add", "matmul", "reduction", "bad_kernels"}
    expected = {k.kernel.id: k.expect_status for s in suites for k in s.kernels}
    assert expected["infinite_loop"] == "timeout"
    assert expected["fault"] == "launch_error"
    assert expected["oob_write"] == "out_of_bounds_write"
    assert expected["cached_answer"] == "wrong_output"
    compiler = NvccCompiler(tmp_path / "cache", NVCC)

    async def build_all() -> None:
        for suite in suites:
            assert suite.reference.id == suite.reference_id
            for example in suite.kernels:
                compiled = await compiler.compile(example.kernel, "sm_90")
                assert isinstance(compiled, CompiledKernel), f"{example.file}: {compiled}"
                assert _parameter_mismatch("kernel", example.kernel, compiled, suite.workload) is None

    anyio.run(build_all)


@pytest.mark.anyio
async def test_gpu_check_recordings_replay(tmp_path: Path) -> None:
    """The Kernel Tuner recording benchmarks/gpu_check.py writes from GPU results replays through --replay."""
    import importlib.util

    from forecaster_mcp.models import DeviceProvenance, MeasureCost, MeasureResult

    replay_module = pytest.importorskip("forecaster_mcp.measure.replay")
    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    )
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def row(
        entry: str, defines: dict[str, int | float | str], samples: list[float], status: str = "ok"
    ) -> dict[str, Any]:
        k = Kernel(source=SRC, entry=entry, defines=defines, launch=launch(4, 256))
        result = MeasureResult(
            kernel_id="k",
            status=status,  # type: ignore[arg-type]
            device=DeviceProvenance(name="H200-SXM-141GB", backend="pycuda"),
            cost=MeasureCost(gpu_seconds=0.5, compile_seconds=1.5),
        )
        kernel_json = k.model_dump(exclude={"source"})
        return {
            "kernel": kernel_json,
            "problem": {"M": 2048},
            "result": result.model_dump(),
            "samples_ms": samples,
        }

    rows = [
        row("matmul_tiled", {"TILE": 16}, [2.0, 2.2, 1.8]),
        row("matmul_tiled", {"TILE": 32}, [1.0, 1.1, 0.9]),
        row("matmul_naive", {}, [3.0, 3.0, 3.0]),
        row("vector_add_oob", {}, [], status="out_of_bounds_write"),
    ]
    paths = gpu_check.write_recordings(rows, "NVIDIA H200", tmp_path / "rec")
    assert sorted(p.name for p in paths) == ["matmul_naive.json", "matmul_tiled.json"]
    doc = json.loads((tmp_path / "rec" / "matmul_tiled.json").read_text())
    assert list(doc)[-1] == "cache" and doc["tune_params"] == {"TILE": [16, 32]}
    assert doc["cache"]["32"]["time"] == pytest.approx(1.0) and doc["cache"]["32"]["times"] == [1.0, 1.1, 0.9]
    replay = replay_module.ReplayMeasurer(paths)
    device = replay.devices()[0]
    assert device == "H200-SXM-141GB"
    tiled = Kernel(source=SRC, entry="matmul_tiled", defines={"TILE": 32}, launch=launch(4, 256))
    result = await replay.measure(MeasureRequest(kernel=tiled, workload=WORKLOAD, device=device))
    assert result.status == "ok" and result.runtime_ms is not None
    assert result.runtime_ms.median == pytest.approx(1.0)
    assert result.resources.local_bytes is None  # a recording does not say
    naive = Kernel(source=SRC, entry="matmul_naive", launch=launch(4, 256))
    assert (
        await replay.measure(MeasureRequest(kernel=naive, workload=WORKLOAD, device=device))
    ).status == "ok"


# ---------------------------------------------------------------- the real worker on a fake driver


def real_worker(tmp_path: Path, **kwargs: Any) -> PycudaMeasurer:
    """The real gpu_worker (GpuSession, guard regions, sampling, correctness) with a numpy stand-in for
    pycuda.driver: only the driver is fake."""
    return make(tmp_path, "--fake-pycuda", **kwargs)


def op(name: str, **defines: str | int | float) -> Kernel:
    return Kernel(source=SRC, entry="vadd", launch=launch(4, 256), defines={"FAKE_OP": name, **defines})


@pytest.mark.anyio
async def test_real_worker_reports_local_memory_per_thread(tmp_path: Path) -> None:
    """A kernel with a 2 KiB local array (ptxas: "2048 bytes stack frame") has no spills, but its local memory
    (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) is in the result's resources: it was read and dropped."""
    async with real_worker(tmp_path) as m:
        result = await m.measure(request(m, op("add", FAKE_MS=0.05, FAKE_LOCAL_BYTES=2048), max_runs=10))
    assert result.status == "ok", result.message
    assert result.resources.local_bytes == 2048
    assert result.resources.spill_bytes == 0


@pytest.mark.anyio
async def test_real_worker_measures_and_checks(tmp_path: Path) -> None:
    async with real_worker(tmp_path) as m:
        result = await m.measure(request(m, op("add", FAKE_MS=0.05), reference=op("add")))
        assert result.status == "ok", result.message
        stats = result.runtime_ms
        assert stats is not None and stats.runs >= 10 and stats.median == pytest.approx(0.05, rel=0.01)
        assert result.correctness.passed and result.correctness.input_sets == 2
        assert result.correctness.max_abs_error == 0.0
        assert result.resources.registers == 24  # the function's own attribute wins over ptxas's figure
        assert result.resources.local_bytes == 0
        assert result.device.driver == "CUDA driver API 12.8"
        info = m.device_info(m.devices()[0])
        assert info is not None and info.l2_bytes == 4 * 2**20
        assert info.mem_bandwidth_gbs == pytest.approx(2 * 2619e6 * 640 / 1e9)
        capped = await m.measure(request(m, op("add"), reference=None, max_runs=5))
        assert capped.runtime_ms is not None and capped.runtime_ms.runs == 5


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "status", "says"),
    [
        ("wrong", "wrong_output", "c[0]: got"),
        ("cache", "wrong_output", "outside atol"),  # right on the first input set only
        ("oob", "out_of_bounds_write", "64 bytes past its end (on its first run)"),
        ("wild", "launch_error", "illegal memory access"),
        ("hang", "timeout", "did not finish within max_seconds=0.5"),
        ("printf", "ok", None),  # device printf goes to fd 1, which the worker keeps off the protocol pipe
    ],
)
async def test_real_worker_catches_bad_kernels(
    tmp_path: Path, name: str, status: str, says: str | None
) -> None:
    # The hang's cap is short to keep the test quick; the others get the default cap, which they must finish
    # within (on a loaded machine 0.5 s, with 0.3 s of slack, was not far from a job's own time).
    cap = 0.5 if name == "hang" else 5.0
    async with real_worker(tmp_path) as m:
        with anyio.fail_after(30):
            result = await m.measure(request(m, op(name), reference=op("add"), max_seconds=cap))
        assert result.status == status, result.message
        if says is not None:
            assert says in (result.message or "")
        assert (await m.measure(request(m, op("add")))).status == "ok"


@pytest.mark.anyio
async def test_real_worker_stops_early_when_the_first_check_fails(tmp_path: Path) -> None:
    async with real_worker(tmp_path) as m:
        wrong = await m.measure(request(m, op("wrong"), reference=op("add")))
        assert wrong.status == "wrong_output"
        assert wrong.correctness.input_sets == 1 and wrong.runtime_ms is None  # no budget spent on timing it
        cached = await m.measure(request(m, op("cache"), reference=op("add")))
        assert cached.status == "wrong_output"
        assert cached.correctness.input_sets == 2 and cached.runtime_ms is not None  # caught by the fresh set


@pytest.mark.anyio
async def test_real_worker_flags_work_the_events_miss(tmp_path: Path) -> None:
    async with real_worker(tmp_path) as m:
        result = await m.measure(request(m, op("side", FAKE_WALL_MS=20), reference=op("add")))
        assert result.status == "ok"
        assert "events_disagree_with_wall_clock" in result.flags


@pytest.mark.anyio
async def test_real_worker_packs_every_argument_kind(tmp_path: Path) -> None:
    source = (
        "__global__ void mixed(__nv_bfloat16* x, unsigned char* bytes, __half h, bool flag, long long big,\n"
        "                      double d, short s) {}\n"
    )
    mixed = Workload.model_validate(
        {
            "args": [
                {"name": "x", "dtype": "bfloat16", "shape": [3, 5], "intent": "inout"},
                {"name": "bytes", "dtype": "uint8", "shape": [7], "init": "arange", "intent": "out"},
                {"name": "h", "dtype": "float16", "value": 0.5},
                {"name": "flag", "dtype": "bool", "value": 1},
                {"name": "big", "dtype": "int64", "value": 2**40},
                {"name": "d", "dtype": "float64", "value": 0.25},
                {"name": "s", "dtype": "int16", "value": -3},
            ]
        }
    )
    k = Kernel(source=source, entry="mixed", launch=launch(1, 32), defines={"FAKE_OP": "noop"})
    async with real_worker(tmp_path) as m:
        result = await m.measure(request(m, k, workload=mixed, reference=k))
        assert result.status == "ok", result.message
        assert result.correctness.passed and result.correctness.input_sets == 2


@pytest.mark.anyio
async def test_a_long_lived_worker_s_stderr_file_is_emptied_between_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Device printf lands in the worker's (unlinked) stderr file, which lives as long as the worker: emptied
    # between jobs once over _STDERR_KEEP, or it grows by every launch's output, unseen by `du`.
    from forecaster_mcp.measure import pycuda_measurer as pm

    monkeypatch.setattr(pm, "_STDERR_KEEP", 1000)
    async with real_worker(tmp_path) as m:
        sizes, pids = [], set()
        for _ in range(3):
            with anyio.fail_after(30):
                result = await m.measure(
                    request(m, op("printf", FAKE_MS=0.001), max_runs=2000, max_seconds=2)
                )
            assert result.status == "ok"
            worker = m._slots[0].worker
            assert worker is not None
            pids.add(worker.process.pid)
            sizes.append(os.fstat(worker.stderr.fileno()).st_size)
        assert len(pids) == 1 and max(sizes) <= 1000  # one worker throughout, its file emptied after each job
        assert (await m.measure(request(m, op("add")))).status == "ok"


@pytest.mark.anyio
async def test_a_slow_progress_callback_neither_charges_nor_kills_the_job(tmp_path: Path) -> None:
    # A slow client (an SSE stream with no buffer) stalled the supervisor's progress forwarding: the stall was
    # charged as device time (a 0.04 s job charged its whole 1 s cap) and, past the cap, killed the job.
    async with real_worker(tmp_path, kill_slack_s=0.3) as m:

        async def slow(done: float, total: float | None, message: str | None) -> None:
            await anyio.sleep(1.5)

        r = await m.measure(request(m, op("add", FAKE_MS=0.05), reference=op("add"), max_seconds=1.0), slow)
        # A charged stall (1.5 s) is charged the whole 1 s cap; the job's own time (about 0.06 s here, several
        # times that on a loaded machine) is all that may be.
        assert r.status == "ok" and r.cost.gpu_seconds < 0.9


@pytest.mark.anyio
async def test_a_slow_client_cannot_keep_a_hung_kernel_past_its_cap_for_long(tmp_path: Path) -> None:
    # Each stalled progress report moved the kill deadline: 8 reports queued before a hang, at 2 s each, held
    # the device 16.6 s past a 1 s cap. The stalls are bounded per job (PROGRESS_WAIT_S in all).
    from forecaster_mcp.measure.pycuda_measurer import PROGRESS_WAIT_S

    worker = str(Path(__file__).with_name("progress_then_hang_worker.py"))
    m = PycudaMeasurer(
        tmp_path / "cache", worker_cmd=[sys.executable, worker], device_names=["NVIDIA H100 80GB HBM3"],
        nvcc=FAKE_NVCC, kill_slack_s=0.3, startup_grace_s=20.0,
    )  # fmt: skip

    first_report: list[float] = []

    async def slow(done: float, total: float | None, message: str | None) -> None:
        first_report[:] = first_report or [time.perf_counter()]
        await anyio.sleep(2.0)

    async with m:
        k = Kernel(source=SRC, entry="vadd", launch=launch(4, 256), defines={"FAKE_MODE": "hang", "N": 8})
        r = await m.measure(request(m, k, max_seconds=1.0), slow)
        assert r.status == "timeout" and r.cost.gpu_seconds == pytest.approx(1.0)
        # Counted from the job's first report, when it holds the device: the worker's start and the compile
        # before it are no part of the bound, and on a loaded machine they can take its 1.5 s of margin.
        assert first_report and time.perf_counter() - first_report[0] < 1.0 + 0.3 + PROGRESS_WAIT_S + 1.5


@pytest.mark.anyio
async def test_the_compile_cache_is_bounded_least_recently_used_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiles are free and were all kept: a client cycling a define over a kernel with a large initialised
    __device__ array grew the cache 30 MiB a request until the disk was full."""
    monkeypatch.setattr(pycuda_measurer, "KERNEL_CACHE_MIN_AGE_S", 0.0)
    compiler = NvccCompiler(tmp_path / "cache", FAKE_NVCC)
    kernels_dir = tmp_path / "cache" / "kernels"

    def entries() -> set[str]:
        return {p.name for p in kernels_dir.iterdir()}

    first = [kernel(N=i) for i in range(3)]
    for k in first:
        assert isinstance(await compiler.compile(k, "sm_90"), CompiledKernel)
    size = sum(f.stat().st_size for f in kernels_dir.rglob("*") if f.is_file())
    keys = [compiler.key(k, "sm_90") for k in first]
    assert entries() == set(keys)
    await compiler.compile(first[1], "sm_90")  # a hit: marks it used now
    for f in (kernels_dir / keys[2]).iterdir():
        os.utime(f, (2, 2))
    for f in (kernels_dir / keys[0]).iterdir():
        os.utime(f, (1, 1))  # the oldest use
    monkeypatch.setattr(pycuda_measurer, "KERNEL_CACHE_BYTES", size)  # one more entry is over the bound
    fourth = kernel(N=3)
    assert isinstance(await compiler.compile(fourth, "sm_90"), CompiledKernel)
    left = entries()
    assert compiler.key(fourth, "sm_90") in left and keys[1] in left  # the new one and the one just used
    assert keys[0] not in left  # least recently used went first
    again = await compiler.compile(first[0], "sm_90")  # an evicted kernel is simply compiled again
    assert isinstance(again, CompiledKernel) and await anyio.Path(again.cubin_path).exists()
    monkeypatch.setattr(pycuda_measurer, "KERNEL_CACHE_MIN_AGE_S", 3600.0)
    before = entries()
    await compiler.compile(kernel(N=4), "sm_90")
    assert before <= entries()  # nothing used within the last hour is removed


@pytest.mark.anyio
async def test_a_python_module_holding_cuda_is_told_how_to_have_its_kernel_measured(
    gpu: PycudaMeasurer,
) -> None:
    """A torch load_inline module (KernelBench's form) is not run here: the refusal names the CUDA kernel it holds,
    how to send it, and the launch its wrapper gives it; a Python source holding no CUDA gets the plain refusal."""
    module = (
        "from torch.utils.cpp_extension import load_inline\n"
        'cuda = r"""\n#include <torch/extension.h>\n' + SRC + "\n"
        "torch::Tensor run(torch::Tensor a, torch::Tensor b, torch::Tensor c) {\n"
        "  vadd<<<64, 128>>>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>());\n  return c;\n}\n"
        '"""\nmodule = load_inline(name="v", cpp_sources="", cuda_sources=cuda, functions=["run"])\n'
        "def forward(a, b, c):\n    return module.run(a, b, c)\n"
    )
    python = Kernel(source=module, entry="forward", language="python", launch=launch(64, 128))
    with pytest.raises(NotMeasurable, match="CUDA C") as refused:
        await gpu.measure(request(gpu, python))
    said = str(refused.value)
    assert "Its CUDA kernel 'vadd' can be measured as a kernel of its own" in said
    assert 'launches it with {"grid": [64, 1, 1], "block": [128, 1, 1], "shared_mem_bytes": 0}' in said
    triton = Kernel(source="@triton.jit\ndef k(): pass\n", entry="k", language="triton", launch=launch(1, 1))
    with pytest.raises(NotMeasurable, match="CUDA C") as refused:
        await gpu.measure(request(gpu, triton))
    assert str(refused.value).endswith(
        "(other languages can be forecast, or measured through a replay recording)"
    )


@needs_nvcc
@pytest.mark.anyio
async def test_a_device_this_nvcc_cannot_target_is_not_measurable_not_the_kernels_compile_error(
    tmp_path: Path,
) -> None:
    # nvcc 13 dropped sm_70 (V100) and older; an older toolkit lacks the newest GPUs. "Unsupported gpu
    # architecture" is the server's toolkit, not the kernel: it was cached and stored as the kernel's compile_error.
    assert NVCC is not None
    from forecaster_mcp.forecast import ptxas

    supported = ptxas.supported_archs(NVCC)
    unsupported = next(a for a in ("sm_35", "sm_50", "sm_70", "sm_72") if supported and a not in supported)
    compiler = NvccCompiler(tmp_path / "cache", NVCC)
    plain = Kernel(source=SRC, entry="vadd", launch=launch(4, 256))
    with pytest.raises(NotMeasurable, match=f"cannot compile for {unsupported}"):
        await compiler.compile(plain, unsupported)
    assert not list((tmp_path / "cache").rglob("meta.json"))  # nothing kept: a new toolkit may compile it
    # An architecture the caller names in its own options is the caller's choice: its failure is a result.
    own = plain.model_copy(update={"compile_options": [f"-arch={unsupported}"]})
    outcome = await compiler.compile(own, "sm_90")
    assert isinstance(outcome, CompileFailure) and "Unsupported gpu architecture" in outcome.message
