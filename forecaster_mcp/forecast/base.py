"""The forecaster seam: (baseline, candidate, workload, hardware) -> 8-bin distribution."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from forecaster_mcp import bins
from forecaster_mcp.errors import ForecasterMcpError
from forecaster_mcp.hardware.specs import GpuSpec
from forecaster_mcp.models import Kernel, Workload

log = logging.getLogger(__name__)

# The ledger a forecast is made for (set by the service around each compare): a forecaster that pays per
# call (Claude) records its usage there. A context variable, not an argument, so the Forecaster protocol
# stays the same for forecasters that cost nothing.
USAGE_LEDGER: ContextVar[str | None] = ContextVar("forecaster_mcp_usage_ledger", default=None)

# BinForecast.extras key: the most sure of the direction this answer may be after calibration, and a promise that
# it decides no verdict on its own (the local model's estimate from a young family's 1-3 configurations: a space
# 64x wide looks narrow through two alike configurations). A calibration fitted on the slot's other answers must not
# stretch it past this, nor may a threshold certified on their history decide it (ForecastEngine.threshold_for).
MAX_CONFIDENCE = "max_confidence"


class PartialForecast(ForecasterMcpError):
    """A forecaster failed on some pairs of a call.

    `partial` holds the forecasts it did make, in query order (None where a pair failed): the engine keeps
    those, and only the failed pairs go without this forecaster.
    """

    def __init__(self, message: str, partial: list[BinForecast | None] | None = None) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class PairQuery:
    """One question: is `candidate` faster than `baseline` on `hardware` for `workload`?"""

    baseline: Kernel
    candidate: Kernel
    workload: Workload
    # Canonical name when known, else what the caller passed; for a replayed device, what its history is stored
    # under ("A100-PCIE-40GB (replay 1a2b...)", measure.base.history_device; models.history_gpu names the GPU).
    hardware_name: str
    hardware: GpuSpec | None  # None: no specification known, hardware-specific features unused


@dataclass
class BinForecast:
    """A forecaster's answer to one PairQuery."""

    probs: list[float]  # 8 probabilities over bins.LABELS
    rationale: str = ""
    # Extra numbers a combiner or calibrator may use (e.g. the local model's predicted mean/std).
    extras: dict[str, float] = field(default_factory=dict)
    # The forecast's mean log2 speedup within each bin, when it has a continuous distribution behind the bins
    # (bins.normal_bins); expected speedups then use these instead of the fixed bin centres.
    centers: list[float] | None = None

    def __post_init__(self) -> None:
        self.probs = bins.normalize(self.probs)
        if self.centers is not None and len(self.centers) != bins.N_BINS:
            raise ValueError(f"expected {bins.N_BINS} bin centres, got {len(self.centers)}")

    @property
    def p_faster(self) -> float:
        return bins.p_faster(self.probs)


class Forecaster(Protocol):
    """Anything that forecasts pairs. `name` and `version` are shown to the agent.

    Optional attributes the engine reads: `remote = True` (answers over a network: the engine's timeout
    applies), `paid = True` (bills per request: a server refuses a compare for a ledger that does not exist,
    where its usage would be recorded), `forecast_batch(queries)` (a cheaper bulk path, used by evaluations), and an exception's
    `partial` list (the pairs it did answer before failing)."""

    name: str
    version: str

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        """One BinForecast per query, in order."""
        ...


async def close_forecasters(forecasters: Sequence[object]) -> None:
    """Close each forecaster that has `aclose` (Claude waits there for its requests still running, so that what
    they cost is recorded and their answers kept); one failing to close is logged, the others still closed."""
    for f in forecasters:
        closer = getattr(f, "aclose", None)
        if closer is not None:
            try:
                await closer()
            except Exception:
                log.warning("closing forecaster %s failed", getattr(f, "name", f), exc_info=True)


class ScriptedForecaster:
    """A fake for tests: answers from a queue of scripted forecasts, records every query."""

    name = "scripted"
    version = "0"

    def __init__(self, default: Sequence[float] | None = None) -> None:
        self._queue: list[BinForecast] = []
        self._default = list(default) if default is not None else [1.0 / bins.N_BINS] * bins.N_BINS
        self.history: list[PairQuery] = []

    def enqueue(self, *forecasts: Sequence[float] | BinForecast) -> None:
        for f in forecasts:
            self._queue.append(f if isinstance(f, BinForecast) else BinForecast(list(f), "scripted"))

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        out = []
        for q in queries:
            self.history.append(q)
            out.append(self._queue.pop(0) if self._queue else BinForecast(list(self._default), "scripted"))
        return out
