"""A scripted measurer for tests: no GPU, no files, behaviour chosen per kernel.

    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("slow_kernel", runtime_ms=3.0)
    fake.script("k", defines={"BLOCK": 64}, runtime_ms=lambda kernel: 1.0)
    fake.script("hangs", timeout=True)               # status timeout, charges request.max_seconds
    fake.script("dies", crash=True)                  # raises WorkerCrashed
    fake.script("bad", status="compile_error")       # a result with that status
    fake.script("held", block_until=event)           # waits for an anyio.Event (concurrency tests)

`history` records every request in arrival order; `await fake.wait_for_calls(n)` waits (bounded) until n
measurements have started.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from forecaster_mcp.errors import NotMeasurable, WorkerCrashed
from forecaster_mcp.measure.base import MeasureRequest, ProgressCallback
from forecaster_mcp.measure.replay import normalize_value, runtime_stats
from forecaster_mcp.models import (
    Correctness,
    DeviceProvenance,
    Kernel,
    MeasureCost,
    MeasureResult,
    MeasureStatus,
)

RuntimeSpec = float | Callable[[Kernel], float]


@dataclass
class FakeBehaviour:
    """What one scripted kernel does when measured."""

    runtime_ms: RuntimeSpec | None = None  # None: the measurer's default_runtime_ms
    status: MeasureStatus = "ok"
    message: str | None = None
    timeout: bool = False
    crash: bool = False
    not_measurable: str | None = None  # raise NotMeasurable with this message
    block_until: anyio.Event | None = None
    gpu_seconds: float | None = None  # None: the measurer's gpu_seconds
    noise: float | None = None  # relative std of the generated runs; None: the measurer's
    flags: tuple[str, ...] = ()  # result flags of an ok run (below_physical_floor, ...)


def _defines_key(defines: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, normalize_value(v)) for k, v in defines.items()))


class FakeMeasurer:
    """Implements the Measurer protocol from a script; records what it was asked."""

    name = "fake"

    def __init__(
        self,
        devices: list[str] | None = None,
        *,
        default_runtime_ms: RuntimeSpec = 1.0,
        gpu_seconds: float = 0.1,
        runs: int = 10,
        noise: float = 0.0,
        compile_seconds: float = 0.0,
        measure_unscripted: bool = True,
    ) -> None:
        self._devices = list(devices or ["FAKE-GPU"])
        self.default_runtime_ms = default_runtime_ms
        self.gpu_seconds = gpu_seconds
        self.runs = runs
        self.noise = noise
        self.compile_seconds = compile_seconds
        self.measure_unscripted = measure_unscripted
        self._by_entry: dict[str, FakeBehaviour] = {}
        self._by_defines: dict[tuple[str, tuple[tuple[str, Any], ...]], FakeBehaviour] = {}
        self.history: list[MeasureRequest] = []
        self.completed: list[MeasureResult] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._waiters: list[tuple[int, anyio.Event]] = []

    # ---- scripting

    def script(
        self,
        entry: str,
        *,
        defines: dict[str, Any] | None = None,
        runtime_ms: RuntimeSpec | None = None,
        status: MeasureStatus = "ok",
        message: str | None = None,
        timeout: bool = False,
        crash: bool = False,
        not_measurable: str | None = None,
        block_until: anyio.Event | None = None,
        gpu_seconds: float | None = None,
        noise: float | None = None,
        flags: tuple[str, ...] = (),
    ) -> FakeBehaviour:
        """Script the kernel with this entry (and, when given, exactly these defines). Later scripts win."""
        behaviour = FakeBehaviour(
            runtime_ms,
            status,
            message,
            timeout,
            crash,
            not_measurable,
            block_until,
            gpu_seconds,
            noise,
            flags,
        )
        if defines is None:
            self._by_entry[entry] = behaviour
        else:
            self._by_defines[(entry, _defines_key(defines))] = behaviour
        return behaviour

    def behaviour(self, kernel: Kernel) -> FakeBehaviour | None:
        """The scripted behaviour for a kernel: exact defines first, then the entry; None if unscripted."""
        exact = self._by_defines.get((kernel.entry, _defines_key(dict(kernel.defines))))
        return exact if exact is not None else self._by_entry.get(kernel.entry)

    async def wait_for_calls(self, n: int, within_seconds: float = 5.0) -> None:
        """Wait until at least n measurements have started (TimeoutError after `within_seconds`)."""
        if len(self.history) >= n:
            return
        event = anyio.Event()
        self._waiters.append((n, event))
        with anyio.fail_after(within_seconds):
            await event.wait()

    # ---- the Measurer protocol

    def devices(self) -> list[str]:
        return list(self._devices)

    def device_fingerprint(self, device: str) -> str:
        return f"fake:{device}"

    def reservation_seconds(self, request: MeasureRequest) -> float:
        b = self.behaviour(request.kernel)
        if b is not None and b.timeout:
            return request.max_seconds
        charge = b.gpu_seconds if b is not None and b.gpu_seconds is not None else self.gpu_seconds
        return max(min(charge, request.max_seconds), 0.001)

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        if request.device not in self._devices:
            raise NotMeasurable(
                f"fake measurer has no device {request.device!r}; it has {', '.join(self._devices)}"
            )
        b = self.behaviour(request.kernel)
        if b is None and not self.measure_unscripted:
            raise NotMeasurable(f"fake measurer has no script for kernel {request.kernel.entry!r}")
        b = b or FakeBehaviour()
        self.history.append(request)
        for n, event in list(self._waiters):
            if len(self.history) >= n:
                event.set()
                self._waiters.remove((n, event))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if progress is not None:
                await progress(0.0, 1.0, "fake measurement started")
            if b.block_until is not None:
                await b.block_until.wait()
            if b.not_measurable is not None:
                raise NotMeasurable(b.not_measurable)
            if b.crash:
                raise WorkerCrashed(b.message or "fake worker crashed")
            result = self._result(request, b)
            if progress is not None:
                await progress(1.0, 1.0, "fake measurement done")
            self.completed.append(result)
            return result
        finally:
            self.in_flight -= 1

    def _result(self, request: MeasureRequest, b: FakeBehaviour) -> MeasureResult:
        device = DeviceProvenance(name=request.device, backend="fake")
        kernel_id = request.kernel.id or "k0"
        if b.timeout:
            return MeasureResult(
                kernel_id=kernel_id,
                status="timeout",
                message=b.message or f"fake kernel ran past max_seconds={request.max_seconds:g}",
                device=device,
                cost=MeasureCost(gpu_seconds=request.max_seconds, compile_seconds=self.compile_seconds),
            )
        charge = b.gpu_seconds if b.gpu_seconds is not None else self.gpu_seconds
        charge = min(charge, request.max_seconds)
        cost = MeasureCost(gpu_seconds=charge, compile_seconds=self.compile_seconds)
        if b.status != "ok":
            return MeasureResult(
                kernel_id=kernel_id, status=b.status, message=b.message, device=device, cost=cost
            )
        spec = b.runtime_ms if b.runtime_ms is not None else self.default_runtime_ms
        runtime = spec(request.kernel) if callable(spec) else float(spec)
        noise = b.noise if b.noise is not None else self.noise
        runs = max(1, min(self.runs, request.max_runs))
        rng = random.Random(f"{request.seed}:{request.kernel.content_key()}")
        times = [
            max(runtime * (1.0 + rng.gauss(0.0, noise)), 1e-9) if noise else runtime for _ in range(runs)
        ]
        return MeasureResult(
            kernel_id=kernel_id,
            status="ok",
            message=b.message,
            runtime_ms=runtime_stats(times),
            correctness=Correctness(
                checked=request.reference is not None, passed=True if request.reference else None
            ),
            device=device,
            cost=cost,
            flags=list(b.flags),
        )
