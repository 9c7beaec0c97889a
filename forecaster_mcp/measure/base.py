"""The measurement seam. Backends know nothing of MCP or of the ledger."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from forecaster_mcp.models import Kernel, MeasureResult, Workload

# progress(done, total, message) -> awaitable; the server forwards it as MCP progress.
ProgressCallback = Callable[[float, float | None, str | None], Awaitable[None]]

# An exception leaving `Measurer.measure` after the job reached the device carries, under this attribute, the
# GPU-seconds the device was occupied: the service commits that (capped at the hold) instead of releasing the
# hold. Without it the hold is released (the failure came before any device time: compile error, refusal,
# worker start-up).
OCCUPIED_ATTR = "occupied_gpu_seconds"


@dataclass(frozen=True)
class MeasureRequest:
    kernel: Kernel
    workload: Workload
    device: str  # canonical device name the caller asked for (a name `devices()` returned)
    reference: Kernel | None = None
    atol: float = 1e-5
    rtol: float = 1e-3
    max_seconds: float = 10.0  # hard cap on GPU occupancy for this measurement
    max_runs: int = 1000
    seed: int = 0


class Measurer(Protocol):
    """One backend. `devices()` is cheap; `measure` may take seconds."""

    name: str

    def devices(self) -> list[str]:
        """Canonical names of the devices this backend can measure on."""
        ...

    def device_fingerprint(self, device: str) -> str:
        """Identity of the device for the measurement cache: name plus driver/recording, whatever changes results."""
        ...

    def reservation_seconds(self, request: MeasureRequest) -> float:
        """The most GPU-seconds `measure` may charge for this request (reserved before it runs)."""
        ...

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        """Run (or look up) the measurement. `result.cost.gpu_seconds` is what the ledger commits.

        Raises NotMeasurable when this backend cannot measure the kernel (nothing is charged).
        """
        ...


def history_device(measurer: Measurer | None, device: str) -> str:
    """What the store files `device`'s measurements, forecasts and calibration under (compare answers from them,
    the family models learn them): the GPU's name where kernels run on it, so that real measurements of one GPU
    model pool across restarts, drivers and clocks; a measurer whose times are some other machine's (a replay)
    names its own (`history_device(device)`), kept apart from the GPU's."""
    own = getattr(measurer, "history_device", None)
    return device if own is None else str(own(device))
