"""The GPU worker process: owns one device's CUDA context, on its main thread, and runs measurement jobs.

Started by the supervisor (`pycuda_measurer`) as `python -m forecaster_mcp.measure.gpu_worker --device N` in
its own process group; speaks `worker_protocol` frames over stdin/stdout. The only module of the package that
imports pycuda (lazily, so importing this module without pycuda works and the worker can report why).

A job: load the compiled kernel (and reference) into fresh modules; inputs from the workload and seed in
buffers with guard regions; one run checked against the reference; warm-up; timed samples, each after an L2
flush (a memset of exactly the L2 size), bracketed by CUDA events and followed by a device-wide synchronize,
until the median's 95% interval is narrow or a cap is hit; a few host wall-clock samples; then a check on a
fresh input set (new random seed) so a kernel cannot replay a cached answer. Guard regions are checked after
every phase. A CUDA error ends the job with `restart` set: the context may be damaged, so the worker exits
and the supervisor starts a fresh one.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np

from forecaster_mcp.measure.inputs import (
    STORAGE,
    Comparison,
    HostArg,
    compare_outputs,
    correctness_of,
    generate_inputs,
    output_names,
    param_format,
)
from forecaster_mcp.measure.timing import AdaptiveStopper, StoppingRule
from forecaster_mcp.measure.worker_protocol import (
    PHASE_INPUTS,
    PHASE_KERNEL,
    PHASE_REFERENCE,
    REFERENCE_FAILURE_PREFIX,
    DeviceInfo,
    Fatal,
    JobResult,
    KernelImage,
    MeasureJob,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    StopReason,
    decode_supervisor_message,
    read_frame_sync,
    write_frame_sync,
)
from forecaster_mcp.models import BufferArg, MeasureStatus, Workload

GUARD_BYTES = 64 * 1024
GUARD_PATTERN = 0xA5
# Fraction of max_seconds the worker plans to use; the rest is headroom before the supervisor's kill.
BUDGET_FRACTION = 0.9
WARMUP_MIN_RUNS = 2
WARMUP_MAX_RUNS = 100
WARMUP_SECONDS = 0.05
WALL_SAMPLES = 3
_THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
_SLOWDOWNS = {
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
}

Send = Callable[[Progress], None]


class SetupError(Exception):
    """The worker cannot serve this device (no pycuda, no such device)."""


class JobFailure(Exception):
    """A job ends early with a status (a failing kernel is a result, not an error)."""

    def __init__(self, status: MeasureStatus, message: str, restart: bool = False) -> None:
        super().__init__(message)
        self.status: MeasureStatus = status
        self.message = message
        self.restart = restart


# ---------------------------------------------------------------- device buffers with guard regions


class GuardedBuffers:
    """One device allocation per buffer argument: guard | data | guard, guards filled with a byte pattern.

    A write a little past either end lands in a guard and is found by `check()`, instead of silently
    corrupting whatever the allocator placed next (the next run's inputs, the reference's outputs).
    """

    def __init__(self, cuda: Any, workload: Workload, host: Sequence[HostArg]) -> None:
        self.cuda = cuda
        self.workload = workload
        self.allocs: list[Any] = []
        self.params: list[int | float | bool] = []
        self.pristine: list[Any] = []  # device copies of every buffer for `restore` (keep_pristine)
        self._pristine_host: Sequence[HostArg] | None = None  # or the host inputs, where those did not fit
        try:
            for arg, value in zip(workload.args, host, strict=True):
                if isinstance(arg, BufferArg):
                    alloc = cuda.mem_alloc(GUARD_BYTES + arg.nbytes + GUARD_BYTES)
                    self.allocs.append(alloc)
                    self.params.append(int(alloc) + GUARD_BYTES)
                else:
                    self.allocs.append(None)
                    assert not isinstance(value, np.ndarray)
                    self.params.append(value)
            self.fill_guards()
            self.upload(host)
        except BaseException:
            self.free()
            raise

    def _buffers(self) -> list[tuple[BufferArg, Any]]:
        return [
            (a, m) for a, m in zip(self.workload.args, self.allocs, strict=True) if isinstance(a, BufferArg)
        ]

    def fill_guards(self) -> None:
        for arg, alloc in self._buffers():
            self.cuda.memset_d8(int(alloc), GUARD_PATTERN, GUARD_BYTES)
            self.cuda.memset_d8(int(alloc) + GUARD_BYTES + arg.nbytes, GUARD_PATTERN, GUARD_BYTES)

    def upload(self, host: Sequence[HostArg]) -> None:
        for arg, alloc, value in zip(self.workload.args, self.allocs, host, strict=True):
            if isinstance(arg, BufferArg):
                assert isinstance(value, np.ndarray)
                self.cuda.memcpy_htod(int(alloc) + GUARD_BYTES, np.ascontiguousarray(value))

    def download(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for arg, alloc in self._buffers():
            if arg.name in names:
                host = np.empty(tuple(arg.shape), dtype=STORAGE[arg.dtype])
                self.cuda.memcpy_dtoh(host, int(alloc) + GUARD_BYTES)
                out[arg.name] = host
        return out

    def check(self) -> str | None:
        """A description of the first damaged guard, or None when all are intact."""
        guard = np.empty(GUARD_BYTES, dtype=np.uint8)
        for arg, alloc in self._buffers():
            for side, offset in (("before", 0), ("after", GUARD_BYTES + arg.nbytes)):
                self.cuda.memcpy_dtoh(guard, int(alloc) + offset)
                bad = np.flatnonzero(guard != GUARD_PATTERN)
                if bad.size:
                    if side == "before":
                        where = f"{GUARD_BYTES - int(bad[0])} bytes before its start"
                    else:
                        where = f"{int(bad[-1]) + 1} bytes past its end"
                    return (
                        f"the kernel wrote outside buffer {arg.name!r}: {bad.size} guard bytes changed, "
                        f"up to {where}"
                    )
        return None

    def keep_pristine(self, host: Sequence[HostArg]) -> None:
        """Keep the buffers as they are now (the job's inputs, just uploaded from `host`) for `restore`: a
        device copy of each, or where the device cannot hold a second copy, the host inputs themselves."""
        try:
            for arg, alloc in self._buffers():
                copy = self.cuda.mem_alloc(max(arg.nbytes, 1))
                self.pristine.append(copy)
                self.cuda.memcpy_dtod(int(copy), int(alloc) + GUARD_BYTES, arg.nbytes)
        except self.cuda.MemoryError:
            self._free_pristine()
            self._pristine_host = host

    def restore(self, stream: Any) -> None:
        """Put every buffer back as `keep_pristine` found it, queued on `stream` (before a timed run's events).

        Each timed run then starts from the job's inputs, not from what the previous run left: an in-place
        kernel (x *= 2, a sort) is not timed on its own output, and one that skips its work when the output
        already holds the answer is timed doing the work (it passed both checks, which start from fresh
        buffers, and was timed at its early exit)."""
        if self._pristine_host is not None:
            self.upload(self._pristine_host)
            return
        for (arg, alloc), copy in zip(self._buffers(), self.pristine, strict=True):
            self.cuda.memcpy_dtod_async(int(alloc) + GUARD_BYTES, int(copy), arg.nbytes, stream)

    def _free_pristine(self) -> None:
        for copy in self.pristine:
            copy.free()
        self.pristine = []

    def free(self) -> None:
        for alloc in self.allocs:
            if alloc is not None:
                alloc.free()
        self.allocs = [None] * len(self.allocs)
        self._free_pristine()
        self._pristine_host = None


# ---------------------------------------------------------------- the session


@dataclass
class Loaded:
    image: KernelImage
    module: Any
    function: Any
    fmt: str


class GpuSession:
    """The CUDA context of one device and everything a job needs (stream, events, L2 flush buffer)."""

    def __init__(self, index: int) -> None:
        try:
            import pycuda.driver as cuda
        except ImportError as exc:
            raise SetupError(
                f"pycuda is not importable in {sys.executable} ({exc}): pip install 'forecaster-mcp[gpu]'"
            ) from exc
        self.cuda = cuda
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as exc:
            raise SetupError(f"CUDA driver initialisation failed: {exc}") from exc
        if not 0 <= index < count:
            raise SetupError(f"no CUDA device {index}: this machine has {count}")
        self.index = index
        self.device = cuda.Device(index)
        # The primary context is the one the runtime API and other libraries (torch, triton) share.
        self.context = self.device.retain_primary_context()
        self.context.push()
        self.stream = cuda.Stream()
        self.start = cuda.Event()
        self.end = cuda.Event()
        attr = cuda.device_attribute
        get = self.device.get_attribute
        self.l2_bytes = int(get(attr.L2_CACHE_SIZE))
        self.flush_buffer = cuda.mem_alloc(max(self.l2_bytes, 1))
        self._flush_value = 0
        self._syncs = 0
        self.pci_bus_id = str(self.device.pci_bus_id())
        self.libcuda = _load_libcuda()
        self.telemetry = Telemetry(self.pci_bus_id)
        self.info = DeviceInfo(
            index=index,
            name=str(self.device.name()),
            compute_capability="{}.{}".format(*self.device.compute_capability()),
            pci_bus_id=self.pci_bus_id,
            driver=self.telemetry.driver_version() or _driver_api_version(cuda),
            sm_count=int(get(attr.MULTIPROCESSOR_COUNT)),
            l2_bytes=self.l2_bytes,
            max_threads_per_sm=int(get(attr.MAX_THREADS_PER_MULTIPROCESSOR)),
            max_blocks_per_sm=int(get(attr.MAX_BLOCKS_PER_MULTIPROCESSOR)),
            registers_per_sm=int(get(attr.MAX_REGISTERS_PER_MULTIPROCESSOR)),
            shared_mem_per_sm_bytes=int(get(attr.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)),
            max_shared_mem_per_block_bytes=int(get(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)),
            total_mem_bytes=int(self.device.total_memory()),
            mem_bandwidth_gbs=_bandwidth_gbs(cuda, self.device),
            pid=os.getpid(),
            pgid=os.getpgid(0),
        )

    def close(self) -> None:
        try:
            self.flush_buffer.free()
            self.context.pop()
        except Exception:  # best effort at exit; the process is ending anyway
            pass

    # ---------------------------------------------------------------- primitives

    def sync(self) -> None:
        # Device-wide, not just our stream: work the kernel put elsewhere must finish inside the sample too.
        self.cuda.Context.synchronize()
        # A synchronize is where device printf reaches the log: keep that file bounded (one fstat in 8 syncs).
        self._syncs += 1
        if self._syncs % 8 == 0:
            empty_if_over(2, _LOG_LIMIT)

    def flush_l2(self) -> None:
        self._flush_value = (self._flush_value + 1) & 0xFF
        self.cuda.memset_d8_async(self.flush_buffer, self._flush_value, self.l2_bytes, self.stream)

    def reset_persisting_l2(self) -> None:
        fn = getattr(self.libcuda, "cuCtxResetPersistingL2Cache", None) if self.libcuda else None
        if fn is not None:
            fn()  # a failure (unsupported device) leaves nothing persisting to reset; ignore its status

    def load(self, image: KernelImage, workload: Workload) -> Loaded:
        cuda = self.cuda
        try:
            module = cuda.module_from_file(image.cubin_path)
        except cuda.MemoryError:
            raise  # the device's memory at this moment (what others hold), not the kernel: out_of_memory
        except cuda.Error as exc:
            raise JobFailure(
                "launch_error", f"could not load the compiled kernel {image.entry}: {exc}"
            ) from exc
        try:
            function = module.get_function(image.symbol)
        except cuda.Error as exc:
            raise JobFailure(
                "launch_error", f"entry {image.entry} not found in the compiled module: {exc}"
            ) from exc
        # The driver's own limit for this compiled kernel: registers per thread times threads, and
        # __launch_bounds__, can allow fewer threads than the device's 1024. Refused before the workload is
        # generated and uploaded (seconds for a large one, charged), not by a launch that cannot succeed.
        limit = int(getattr(function, "max_threads_per_block", 0) or 0)
        threads = image.launch.threads_per_block
        if 0 < limit < threads:
            raise JobFailure(
                "launch_error",
                f"{image.entry} cannot launch blocks of {threads} threads: compiled, it allows at most {limit} "
                f"per block ({getattr(function, 'num_regs', '?')} registers per thread, or its "
                "__launch_bounds__); launch smaller blocks, or cap registers with -maxrregcount or "
                "__launch_bounds__",
            )
        fmt = param_format(workload)
        function.prepare(fmt)
        shared = image.launch.shared_mem_bytes
        if shared + int(function.shared_size_bytes) > 48 * 1024:
            # Without an opt-in a block gets 48 KiB of shared memory, static __shared__ arrays included: above
            # that, the dynamic part must be allowed before launch.
            function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
        return Loaded(image, module, function, fmt)

    def launch(self, kernel: Loaded, buffers: GuardedBuffers) -> None:
        launch = kernel.image.launch
        kernel.function.prepared_async_call(
            tuple(launch.grid),
            tuple(launch.block),
            self.stream,
            *buffers.params,
            shared_size=launch.shared_mem_bytes,
        )

    def timed_sample(
        self, kernel: Loaded, buffers: GuardedBuffers, while_running: Callable[[], None] | None = None
    ) -> float:
        """One sample in ms: the buffers restored to the job's inputs, L2 flush, start event, launch, end event,
        device-wide synchronize. `while_running` is called between the end event and the synchronize, with the
        sample queued or running on the device (the events do not see the host's time)."""
        buffers.restore(self.stream)
        self.flush_l2()
        self.start.record(self.stream)
        self.launch(kernel, buffers)
        self.end.record(self.stream)
        if while_running is not None:
            while_running()
        self.sync()
        return float(self.end.time_since(self.start))

    def wall_sample(self, kernel: Loaded, buffers: GuardedBuffers) -> float:
        """Host wall clock (ms) around one launch and a device-wide synchronize, the buffers restored and the
        L2 flushed beforehand."""
        buffers.restore(self.stream)
        self.flush_l2()
        self.sync()
        t0 = time.perf_counter()
        self.launch(kernel, buffers)
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    # ---------------------------------------------------------------- a job

    def run(self, job: MeasureJob, send: Send) -> JobResult:
        t0 = time.perf_counter()
        try:
            result = self._run(job, send, t0)
        except JobFailure as failure:
            result = JobResult(
                job_id=job.job_id, status=failure.status, message=failure.message, restart=failure.restart
            )
        except self.cuda.MemoryError as exc:
            # Depends on what else holds device memory right now: a transient state, never cached.
            result = JobResult(
                job_id=job.job_id,
                status="out_of_memory",
                restart=True,
                message=f"out of device memory for this workload: {exc}",
            )
        except self.cuda.Error as exc:
            result = JobResult(
                job_id=job.job_id, status="launch_error", restart=True, message=f"CUDA error: {exc}"
            )
        result.worker_seconds = time.perf_counter() - t0
        return result

    def _run(self, job: MeasureJob, send: Send, t0: float) -> JobResult:
        workload = job.workload
        deadline = t0 + job.max_seconds * BUDGET_FRACTION
        outputs = output_names(workload)

        def progress(done: float, message: str) -> None:
            send(Progress(job_id=job.job_id, done=done, total=float(job.max_runs), message=message))

        kernel = self.load(job.kernel, workload)
        reference = None
        if job.reference is not None:
            try:
                reference = self.load(job.reference, workload)
            except JobFailure as failure:  # the caller's check cannot run: say whose the failure is
                raise JobFailure(
                    failure.status, f"{REFERENCE_FAILURE_PREFIX} {failure.message}", restart=failure.restart
                ) from failure
        self.reset_persisting_l2()

        comparisons: list[Comparison] = []
        t_inputs = time.perf_counter()
        progress(0.0, PHASE_INPUTS)
        inputs = generate_inputs(workload, job.seed)
        buffers = GuardedBuffers(self.cuda, workload, inputs)
        input_seconds = time.perf_counter() - t_inputs
        try:
            # First input set: one run, guards, reference.
            t_check = time.perf_counter()
            progress(0.0, PHASE_KERNEL)
            self.launch(kernel, buffers)
            self.sync()
            first_run_s = time.perf_counter() - t_check  # what one run takes, before any warm-up is tried
            self._guards(buffers, "on its first run")
            if reference is not None:
                got = buffers.download(outputs)
                progress(0.0, PHASE_REFERENCE)
                want = self._reference(reference, buffers, inputs, outputs)
                progress(0.0, PHASE_KERNEL)
                comparisons.append(compare_outputs(workload, got, want, job.atol, job.rtol))
                del got, want  # the fresh check below holds two more host copies (HOST_COPIES)
                if not comparisons[0].passed:
                    # Already wrong: timing it would only spend the caller's budget.
                    correctness = correctness_of(comparisons, seeds=[job.seed])
                    return JobResult(
                        job_id=job.job_id,
                        status="wrong_output",
                        message=correctness.detail,
                        correctness=correctness,
                    )
            check_seconds = time.perf_counter() - t_check
            # Every timed run starts from the job's inputs, not from what the check (or the run before) left.
            buffers.upload(inputs)
            buffers.keep_pristine(inputs)
            # The fresh-input check after timing generates and uploads a new input set and checks it again:
            # about what the first set cost, input generation included. Keep that (with a margin) in reserve,
            # or a large workload runs past max_seconds there and loses every sample.
            reserve = 1.2 * input_seconds + 1.5 * check_seconds + 0.01
            progress(0, "first input set checked; warming up")

            samples, warmups, stop, (sm_mhz, mem_mhz, reasons) = self._sample(
                job, kernel, buffers, deadline, reserve, progress, first_run_s
            )
            self._guards(buffers, "during timing")
            # Before the wall-clock runs: with no sample their time check had nothing to go on.
            if not samples:
                raise JobFailure(
                    "timeout",
                    f"one checked run takes {check_seconds:.3g} s and generating and uploading an input set "
                    f"{input_seconds:.3g} s (a second set is checked after timing), which leaves no time for "
                    f"timed runs within max_seconds={job.max_seconds:g}: raise max_seconds",
                )
            wall: list[float] = []
            for _ in range(max(1, min(WALL_SAMPLES, job.max_runs))):
                if time.perf_counter() + reserve + 2 * (sum(samples[-1:]) / 1e3) > deadline:
                    break
                wall.append(self.wall_sample(kernel, buffers))

            # Fresh input set, new random seed: a kernel that replays an earlier answer fails here.
            fresh_seed = secrets.randbits(62)
            runs = float(len(samples))
            progress(runs, PHASE_INPUTS)
            fresh = generate_inputs(workload, fresh_seed)
            buffers.upload(fresh)
            progress(runs, PHASE_KERNEL)
            self.launch(kernel, buffers)
            self.sync()
            self._guards(buffers, f"on the fresh input set (seed {fresh_seed})")
            if reference is not None:
                got = buffers.download(outputs)
                progress(runs, PHASE_REFERENCE)
                want = self._reference(reference, buffers, fresh, outputs)
                comparisons.append(compare_outputs(workload, got, want, job.atol, job.rtol))
        finally:
            buffers.free()

        note = None if reference is not None else "no reference kernel given: outputs were not checked"
        correctness = correctness_of(comparisons, note, [job.seed, fresh_seed][: len(comparisons)])
        if correctness.checked and len(comparisons) == 2:
            correctness.detail = (
                correctness.detail or f"input sets: seed {job.seed} and fresh seed {fresh_seed}"
            )
        function = kernel.function
        flags = ["clock_throttled"] if _SLOWDOWNS.intersection(reasons) else []
        status: MeasureStatus = "wrong_output" if correctness.passed is False else "ok"
        return JobResult(
            job_id=job.job_id,
            status=status,
            message=correctness.detail if status == "wrong_output" else None,
            samples_ms=samples,
            warmup_runs=warmups,
            stop_reason=stop,
            wall_ms=wall,
            correctness=correctness,
            registers=int(function.num_regs),
            static_shared_bytes=int(function.shared_size_bytes),
            local_bytes=int(function.local_size_bytes),
            sm_clock_mhz=sm_mhz,
            mem_clock_mhz=mem_mhz,
            throttle_reasons=reasons,
            flags=flags,
        )

    def _guards(self, buffers: GuardedBuffers, when: str) -> None:
        damage = buffers.check()
        if damage is not None:
            # What lies beyond a guard may be damaged too: start clean.
            raise JobFailure("out_of_bounds_write", f"{damage} ({when})", restart=True)

    def _reference(
        self, reference: Loaded, buffers: GuardedBuffers, inputs: Sequence[HostArg], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """The reference's outputs on the same host inputs (uploading never changes them: no second draw).

        Runs in the candidate's buffers, once the caller has downloaded the candidate's outputs and checked
        its guards: every buffer is re-uploaded first (the candidate may have written its inputs), so the
        reference sees exactly the job's inputs and the device never holds the workload twice. Guard damage
        found now is the reference's doing.
        """
        try:
            buffers.upload(inputs)
            self.launch(reference, buffers)
            self.sync()
            damage = buffers.check()
            if damage is not None:
                raise JobFailure("out_of_bounds_write", f"{REFERENCE_FAILURE_PREFIX} {damage}", restart=True)
            return buffers.download(outputs)
        except self.cuda.MemoryError:
            raise
        except self.cuda.Error as exc:
            # The context may be damaged: restart, but say whose fault it was.
            raise JobFailure(
                "launch_error", f"{REFERENCE_FAILURE_PREFIX} CUDA error: {exc}", restart=True
            ) from exc

    def _sample(
        self,
        job: MeasureJob,
        kernel: Loaded,
        buffers: GuardedBuffers,
        deadline: float,
        reserve: float,
        progress: Callable[[float, str], None],
        first_run_s: float = 0.0,
    ) -> tuple[list[float], int, StopReason, tuple[float | None, float | None, list[str]]]:
        """Warm-up then adaptive timed sampling; returns (samples ms, warm-up runs, why it stopped, clocks).

        `first_run_s`, the checked first run's time, seeds the per-run estimate: a warm-up that cannot leave
        time for a timed run is not started (a 3 s kernel under a 10 s cap spent 3 s, charged, on one).

        The clocks are read between warm-up and timing, while the GPU is at its working clocks (after the
        timed runs it may already be idling), in at most a quarter of the time left: nvidia-smi may take
        seconds, and the device is held (and charged) meanwhile. Through NVML they are polled again during the
        timed runs, each poll with a run on the device: the lowest SM clock and every reason seen are returned."""
        per_sample = first_run_s  # host seconds per sample, a running maximum-biased estimate
        warm = 0
        warm_end = time.perf_counter() + WARMUP_SECONDS
        # No more warm-up runs than timed ones asked for: max_runs=1 ran up to 100 (all charged).
        warm_max = max(1, min(WARMUP_MAX_RUNS, job.max_runs))
        while warm < warm_max:
            now = time.perf_counter()
            if now + per_sample + reserve > deadline:
                break
            if warm >= min(WARMUP_MIN_RUNS, warm_max) and now >= warm_end:
                break
            self.timed_sample(kernel, buffers)
            per_sample = max(per_sample * 0.5, time.perf_counter() - now)
            warm += 1
        self.reset_persisting_l2()
        clocks = self.telemetry.clocks(0.25 * (deadline - reserve - time.perf_counter()))

        rule = StoppingRule(
            target_relative_noise=job.target_relative_noise,
            min_runs=min(job.min_runs, job.max_runs),
            max_runs=job.max_runs,
        )
        stopper = AdaptiveStopper(rule)
        next_progress = time.perf_counter() + 0.5
        # Throttling that starts during the timed runs (heat, power over a sustained load) is what the single read
        # above cannot see: the clocks are polled again with a timed run on the device, at the first run and every
        # POLL_SECONDS after (NVML only: microseconds; nvidia-smi would take longer than most samples).
        seen = TimedClocks()
        next_poll = time.perf_counter()
        while True:
            now = time.perf_counter()
            reason = stopper.reason(deadline - reserve - now, per_sample)
            if reason is not None:
                return stopper.samples, warm, reason, seen.merged(clocks)
            poll = None
            if now >= next_poll:
                next_poll = now + POLL_SECONDS
                poll = lambda: seen.add(self.telemetry.poll())  # noqa: E731
            stopper.add(self.timed_sample(kernel, buffers, poll))
            took = time.perf_counter() - now
            # Decays slowly, jumps up at once: the deadline check must not underestimate a sample.
            per_sample = max(took, 0.9 * per_sample)
            if time.perf_counter() >= next_progress:
                next_progress += 0.5
                progress(len(stopper.samples), f"{len(stopper.samples)} timed runs")


# ---------------------------------------------------------------- clocks, throttling, driver

# How often the clocks are polled during the timed runs (`GpuSession._sample`).
POLL_SECONDS = 0.25


@dataclass
class TimedClocks:
    """What the polls during the timed runs saw: the lowest SM clock and every throttle reason."""

    sm_mhz: float | None = None
    reasons: tuple[str, ...] = ()

    def add(self, polled: tuple[float | None, list[str]] | None) -> None:
        if polled is None:
            return
        sm, reasons = polled
        if sm is not None:
            self.sm_mhz = sm if self.sm_mhz is None else min(self.sm_mhz, sm)
        # A poll comes after the sample's launch: a short kernel has finished by then (the device idles until
        # the next one), and gpu_idle says so, not what the timed runs ran at (as the read before timing).
        self.reasons += tuple(r for r in reasons if r not in self.reasons and r != "gpu_idle")

    def merged(
        self, before: tuple[float | None, float | None, list[str]]
    ) -> tuple[float | None, float | None, list[str]]:
        """The read before timing with the polls: the lowest SM clock seen with a run on the device, and the
        reasons of either (a slowdown at any point is one the samples may carry)."""
        sm, mem, reasons = before
        if self.sm_mhz is None and not self.reasons:
            return before
        if self.sm_mhz is not None:
            sm = self.sm_mhz
        # The read before timing came just after a synchronize: its gpu_idle is that instant's, not the runs'.
        kept = [r for r in reasons if r != "gpu_idle"]
        return sm, mem, [*kept, *(r for r in self.reasons if r not in kept)]


class Telemetry:
    """Clocks and throttle reasons through NVML when pynvml imports, else nvidia-smi; absent is fine."""

    def __init__(self, pci_bus_id: str) -> None:
        self.pci_bus_id = pci_bus_id
        self.nvml: Any = None
        self.handle: Any = None
        try:
            import pynvml  # type: ignore[import-not-found,unused-ignore]

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            self.nvml = pynvml
        except Exception:  # NVML is optional: missing module, library or permission
            self.nvml = None
        self.smi = shutil.which("nvidia-smi")

    def driver_version(self) -> str | None:
        if self.nvml is not None:
            try:
                version = self.nvml.nvmlSystemGetDriverVersion()
                return version.decode() if isinstance(version, bytes) else str(version)
            except Exception:
                pass
        row = self._smi(["driver_version"])
        return row[0] if row else None

    def clocks(self, within_s: float = 5.0) -> tuple[float | None, float | None, list[str]]:
        """(SM MHz, memory MHz, active throttle reasons) right now; through nvidia-smi only when it can answer
        within `within_s` (otherwise nothing: clocks are provenance, never worth a measurement)."""
        if self.nvml is not None:
            try:
                nv = self.nvml
                sm = float(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM))
                mem = float(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_MEM))
                getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                getter = getter or nv.nvmlDeviceGetCurrentClocksThrottleReasons
                return sm, mem, throttle_names(int(getter(self.handle)))
            except Exception:
                pass
        until = time.perf_counter() + min(within_s, 5.0)
        for reasons_field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            left = until - time.perf_counter()
            if left < 0.05:
                break
            row = self._smi(["clocks.sm", "clocks.mem", reasons_field], timeout_s=left)
            if row and len(row) == 3:
                try:
                    return float(row[0]), float(row[1]), throttle_names(int(row[2], 16))
                except ValueError:
                    continue
        return None, None, []

    def poll(self) -> tuple[float | None, list[str]] | None:
        """(SM MHz, active throttle reasons) through NVML, cheap enough to call during the timed runs; None
        without NVML."""
        if self.nvml is None:
            return None
        try:
            nv = self.nvml
            sm = float(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM))
            getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            getter = getter or nv.nvmlDeviceGetCurrentClocksThrottleReasons
            return sm, throttle_names(int(getter(self.handle)))
        except Exception:  # provenance, never worth a measurement
            return None

    def _smi(self, fields: list[str], timeout_s: float = 5.0) -> list[str] | None:
        if self.smi is None:
            return None
        try:
            out = subprocess.run(
                [
                    self.smi,
                    f"--query-gpu={','.join(fields)}",
                    "--format=csv,noheader,nounits",
                    "-i",
                    self.pci_bus_id,
                ],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        line = out.strip().splitlines()[0] if out.strip() else ""
        return [part.strip() for part in line.split(",")] if line else None


def throttle_names(mask: int) -> list[str]:
    """NVML clock event (throttle) reason bits as names."""
    return [name for bit, name in _THROTTLE_BITS.items() if mask & bit]


def _load_libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        name = ctypes.util.find_library("cuda")
        return ctypes.CDLL(name) if name else None


def _driver_api_version(cuda: Any) -> str:
    v = int(cuda.get_driver_version())
    return f"CUDA driver API {v // 1000}.{(v % 1000) // 10}"


def _bandwidth_gbs(cuda: Any, device: Any) -> float | None:
    """Peak DRAM bandwidth from memory clock (kHz) and bus width (bits), double data rate."""
    try:
        khz = int(device.get_attribute(cuda.device_attribute.MEMORY_CLOCK_RATE))
        bits = int(device.get_attribute(cuda.device_attribute.GLOBAL_MEMORY_BUS_WIDTH))
    except Exception:  # newer drivers may drop the attribute
        return None
    if khz <= 0 or bits <= 0:
        return None
    return 2.0 * khz * 1e3 * bits / 8 / 1e9


# ---------------------------------------------------------------- process plumbing


def _claim_stdout() -> BinaryIO:
    """A private handle on the protocol pipe; fd 1 then points at stderr, so device printf and stray
    prints from libraries cannot corrupt the frames."""
    proto = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(proto, "wb")


# Device printf reaches fd 2 (the supervisor's log file, also fd 1 here) at every synchronize, up to the
# driver's 1 MiB FIFO each time: a printing kernel timed 100,000 times would fill the disk within one job.
_LOG_LIMIT = 64 * 2**20


def empty_if_over(fd: int, limit: int) -> None:
    """Empty the file behind `fd`, and rewind it, once it holds more than `limit` bytes (the worker's log: the
    worker bounds it while a job runs, the supervisor between jobs, each through its own descriptor of it)."""
    try:
        if os.fstat(fd).st_size > limit:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        pass


def _die_with_parent() -> None:
    """Exit when the supervisor dies, even in the middle of a hung kernel."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Session(Protocol):
    """What `serve` needs: the device description and a job runner (the stand-in worker in the tests
    provides its own)."""

    info: DeviceInfo

    def run(self, job: MeasureJob, send: Send) -> JobResult: ...


def serve(session: Session, stdin: BinaryIO, stdout: BinaryIO) -> int:
    """Answer jobs until shutdown or end of input. Returns the exit status."""
    write_frame_sync(stdout, Ready(device=session.info))
    while True:
        try:
            payload = read_frame_sync(stdin)
        except ProtocolError as exc:
            print(f"gpu_worker: {exc}", file=sys.stderr)
            return 3
        if payload is None:
            return 0
        try:
            message = decode_supervisor_message(payload)
        except ProtocolError as exc:
            print(f"gpu_worker: {exc}", file=sys.stderr)
            return 3
        if isinstance(message, Shutdown):
            return 0
        result = session.run(message, lambda p: write_frame_sync(stdout, p))
        write_frame_sync(stdout, result)
        if result.restart:
            # The context may be unusable; the supervisor starts a fresh worker for the next job.
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="forecaster-mcp GPU measurement worker (speaks frames on stdio)"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    args = parser.parse_args(argv)
    stdout = _claim_stdout()
    stdin = sys.stdin.buffer
    _die_with_parent()
    try:
        session = GpuSession(args.device)
    except SetupError as exc:
        write_frame_sync(stdout, Fatal(message=str(exc)))
        return 2
    code = serve(session, stdin, stdout)
    stdout.flush()
    # Skip interpreter teardown: pycuda's exit hooks can block on a context a faulted kernel left behind.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
