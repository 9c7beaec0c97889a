"""The one SQLite database (aiosqlite, WAL): ledgers, events, tokens, measurements, forecasts.

This module owns every SQL string in the package.

INTERFACE CONTRACT (signatures fixed; bodies are the store work). All methods are coroutines and safe to call
from many coroutines at once (one connection, an asyncio.Lock around each transaction) and from several
processes on one database file (BEGIN IMMEDIATE for every write transaction, busy_timeout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from forecaster_mcp.models import MeasureResult


@dataclass(frozen=True)
class LedgerView:
    name: str
    limit_gpu_seconds: float
    spent_gpu_seconds: float
    reserved_gpu_seconds: float

    @property
    def remaining_gpu_seconds(self) -> float:
        return self.limit_gpu_seconds - self.spent_gpu_seconds - self.reserved_gpu_seconds


@dataclass(frozen=True)
class Reservation:
    id: int
    ledger: str
    gpu_seconds: float


@dataclass(frozen=True)
class FamilyPoint:
    """One stored measurement of a kernel family member (for the online model)."""

    defines: dict[str, Any]
    launch: dict[str, Any] | None
    status: str
    runtime_ms: float | None  # median, None when status != ok
    content_key: str


@dataclass(frozen=True)
class VerifiedPair:
    """A stored forecast later checked by measurements of both kernels."""

    forecaster: str
    hardware: str
    probs: list[float]
    p_faster: float
    actual_speedup: float
    verdict: str
    created_at: float


@dataclass(frozen=True)
class ForecastRow:
    ledger: str | None
    forecaster: str
    hardware: str
    workload_key: str
    baseline_key: str  # Kernel.content_key()
    candidate_key: str
    probs: list[float]
    p_faster: float
    verdict: Literal["faster", "slower", "unsure"]
    decided_by: Literal["forecast", "measurement", "cache"]


class Store:
    """Async facade over the database file. Open with `await Store.open(path)`; close with `await store.close()`."""

    @classmethod
    async def open(cls, path: Path) -> Store:
        """Create the folder and file if needed, enable WAL, apply pending migrations, release orphan
        reservations (owner process dead on this host, or expired)."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ---- ledgers (operator actions and reads)
    async def create_ledger(self, name: str, gpu_seconds: float) -> LedgerView:
        """OperatorError if it exists or the amount is not a finite number >= 0."""
        raise NotImplementedError

    async def topup_ledger(self, name: str, gpu_seconds: float) -> LedgerView:
        raise NotImplementedError

    async def get_ledger(self, name: str) -> LedgerView | None:
        raise NotImplementedError

    async def list_ledgers(self) -> list[LedgerView]:
        raise NotImplementedError

    # ---- budget: reserve -> run -> commit actual / release rest
    async def reserve(self, ledger: str, gpu_seconds: float, purpose: str) -> Reservation:
        """Atomically hold `gpu_seconds`. UnknownLedger / BudgetExhausted (message names what is left and
        that forecasts are free). The reservation records this process (pid, host, start time) and an
        expiry so a crashed owner's hold is released on the next open."""
        raise NotImplementedError

    async def commit(self, reservation: Reservation, actual_gpu_seconds: float) -> float:
        """Charge min(actual, reserved), release the rest, append an event. Returns the charge."""
        raise NotImplementedError

    async def release(self, reservation: Reservation) -> None:
        """Release the whole hold, charging nothing (the measurement did not happen)."""
        raise NotImplementedError

    # ---- tokens (HTTP): stored hashed
    async def issue_token(self, ledger: str, label: str | None = None) -> str:
        raise NotImplementedError

    async def revoke_token(self, token: str) -> bool:
        raise NotImplementedError

    async def ledger_for_token(self, token: str) -> str | None:
        raise NotImplementedError

    async def list_tokens(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    # ---- measurements
    async def find_measurement(self, cache_key: str) -> MeasureResult | None:
        """A stored result for this exact (kernel, workload, device fingerprint), if any."""
        raise NotImplementedError

    async def find_idempotent(self, ledger: str, idempotency_key: str) -> MeasureResult | None:
        raise NotImplementedError

    async def save_measurement(
        self,
        *,
        cache_key: str,
        ledger: str | None,
        idempotency_key: str | None,
        kernel_json: str,
        workload_key: str,
        family_key: str,
        content_key: str,
        hardware: str,
        result: MeasureResult,
        charged_gpu_seconds: float,
        cached: bool,
    ) -> int:
        """Store a measurement with full provenance (result JSON holds device provenance) and verify every
        stored forecast whose two kernels are now both measured on this hardware and workload. Returns its id."""
        raise NotImplementedError

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        """Every stored measurement of this family on this hardware and workload (latest per content_key)."""
        raise NotImplementedError

    async def measured_runtime(self, content_key: str, hardware: str, workload_key: str) -> float | None:
        """Median runtime (ms) of an ok measurement of this exact kernel, if stored."""
        raise NotImplementedError

    # ---- forecasts
    async def save_forecasts(self, rows: list[ForecastRow]) -> list[int]:
        """Store forecasts; any whose two kernels are already measured are verified at once."""
        raise NotImplementedError

    async def verified_pairs(self, forecaster: str | None = None, hardware: str | None = None) -> list[VerifiedPair]:
        raise NotImplementedError

    # ---- Claude usage
    async def record_llm_usage(
        self,
        *,
        ledger: str | None,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cache_read_tokens: int,
        cache_write_tokens: int,
        cost_usd: float,
    ) -> None:
        raise NotImplementedError

    # ---- calibration state (opaque JSON per forecaster and hardware)
    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None:
        raise NotImplementedError

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None:
        raise NotImplementedError

    # ---- reports
    async def ledger_report(self, ledger: str) -> dict[str, Any]:
        """Everything budget_status shows: limit/spent/reserved/remaining; measurements (count, cache_hits,
        failures); forecasts (count, decided, deferred, verified, verified_correct); gpu_seconds_saved
        (cache hits' recorded cost + estimated cost of measurements decided forecasts avoided);
        llm usage (calls, tokens, cost_usd). UnknownLedger if missing."""
        raise NotImplementedError
