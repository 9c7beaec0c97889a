"""Replay in real time: a recorded measurement occupies the (simulated) device for its recorded duration, and a
request cancelled meanwhile is charged what it occupied, as on a GPU.

Agent evaluations that care about wall-clock behaviour, and crash tests that must kill a server in the middle
of a measurement, need replayed measurements to take time like real ones.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio

from forecaster_mcp.measure.base import OCCUPIED_ATTR, Measurer, MeasureRequest, ProgressCallback
from forecaster_mcp.models import MeasureResult


class RealtimeReplay:
    """Wraps a measurer; sleeps `scale` wall-clock seconds per GPU-second the result charges."""

    def __init__(self, inner: Measurer, scale: float) -> None:
        self.inner = inner
        self.scale = scale
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        """What the wrapped replay offers beyond the Measurer seam, as it offers it (cannot_measure,
        unnamed_devices, runs_references, preload...): the service asks for those by name, and found none here,
        so measure_next listed configurations the recording lacks and a reference was charged as a new
        measurement, only because the replay ran in real time."""
        if name == "inner":  # not set yet (during unpickling or a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def devices(self) -> list[str]:
        return self.inner.devices()

    def device_fingerprint(self, device: str) -> str:
        return self.inner.device_fingerprint(device)

    def reservation_seconds(self, request: MeasureRequest) -> float:
        return self.inner.reservation_seconds(request)

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        done: list[tuple[float, float | None, str | None]] = []

        async def held_back(current: float, total: float | None, message: str | None) -> None:
            # The replay says it is done before the paced wait: that report waits for the wait's end, and the
            # wait reports where it is (a client was told 1.0/1.0 while the whole wait was still to come).
            if total is not None and current >= total:
                done.append((current, total, message))
            elif progress is not None:
                await progress(current, total, message)

        result = await self.inner.measure(request, held_back)
        started = anyio.current_time()
        wait_s = result.cost.gpu_seconds * self.scale
        try:
            if progress is not None and wait_s > 0:
                await progress(0.0, 1.0, f"occupying the device for {result.cost.gpu_seconds:.3g} GPU-s")
            await anyio.sleep(wait_s)
        except BaseException as exc:
            # Cancelled while the recording occupies the simulated device: charged the occupancy so far, as a
            # run cancelled on a GPU is (OCCUPIED_ATTR), and never more than the whole run charges.
            if self.scale > 0:
                used = min((anyio.current_time() - started) / self.scale, result.cost.gpu_seconds)
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, OCCUPIED_ATTR, max(used, 0.0))
            raise
        if progress is not None:
            for report in done:
                await progress(*report)
        return result
