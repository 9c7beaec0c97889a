"""An idempotency key is honoured across server processes sharing one database."""

from __future__ import annotations

from pathlib import Path

import pytest

from forecaster_mcp.errors import AlreadyMeasured, MeasurementInProgress
from forecaster_mcp.models import DeviceProvenance, MeasureCost, MeasureResult
from forecaster_mcp.store.db import Store

pytestmark = pytest.mark.anyio


async def test_second_process_sees_in_progress_then_done(tmp_path: Path) -> None:
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)  # two connections, as two server processes
    try:
        await a.create_ledger("run", 10)
        hold = await a.reserve("run", 1.0, "measure k", "step-1")
        with pytest.raises(MeasurementInProgress, match="step-1"):
            await b.reserve("run", 1.0, "measure k", "step-1")
        result = MeasureResult(
            kernel_id="k",
            status="ok",
            device=DeviceProvenance(name="X", backend="fake"),
            cost=MeasureCost(gpu_seconds=0.5),
        )
        await a.save_measurement(
            cache_key="c",
            ledger="run",
            idempotency_key="step-1",
            kernel_json="{}",
            workload_key="w",
            family_key="f",
            content_key="k",
            hardware="X",
            result=result,
            charged_gpu_seconds=0.5,
            cached=False,
        )
        with pytest.raises(AlreadyMeasured):
            await b.reserve("run", 1.0, "measure k", "step-1")
        assert await a.commit(hold, 0.5) == pytest.approx(0.5)
        view = await b.get_ledger("run")
        assert view is not None
        assert view.spent_gpu_seconds == pytest.approx(0.5) and view.reserved_gpu_seconds == 0
        other = await b.reserve("run", 1.0, "measure k", "step-2")  # other keys are unaffected
        await b.release(other)
    finally:
        await a.close()
        await b.close()
