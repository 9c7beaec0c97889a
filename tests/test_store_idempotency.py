"""An idempotency key is honoured across server processes sharing one database."""

from __future__ import annotations

from pathlib import Path

import pytest

from forecaster_mcp.errors import (
    AlreadyMeasured,
    InvalidRequest,
    MeasurementInProgress,
    SameMeasurementRunning,
)
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


def _result(kernel_id: str, cost: float = 0.5) -> MeasureResult:
    return MeasureResult(
        kernel_id=kernel_id,
        status="ok",
        device=DeviceProvenance(name="X", backend="fake"),
        cost=MeasureCost(gpu_seconds=cost),
    )


async def _save(store: Store, key: str | None, content_key: str, cached: bool) -> int:
    return await store.save_measurement(
        cache_key=f"c-{content_key}",
        ledger="run",
        idempotency_key=key,
        kernel_json="{}",
        workload_key="w",
        family_key="f",
        content_key=content_key,
        hardware="X",
        result=_result(content_key, 0.0 if cached else 0.5),
        charged_gpu_seconds=0.0 if cached else 0.5,
        cached=cached,
    )


async def test_a_free_answer_cannot_take_a_key_another_process_is_paying_for(tmp_path: Path) -> None:
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)
    try:
        await a.create_ledger("run", 10)
        hold = await a.reserve("run", 1.0, "measure x", "K")  # a measures x under K
        # b would answer y from its cache under the same key: refused while a's hold is open ...
        with pytest.raises(MeasurementInProgress, match="'K'"):
            await _save(b, "K", "y", cached=True)
        first = await _save(a, "K", "x", cached=False)  # ... so a's paid result keeps the key
        assert await a.commit(hold, 0.5) == pytest.approx(0.5)
        assert await _save(a, "K", "x", cached=False) == first  # the same measurement again: its row
        with pytest.raises(InvalidRequest, match="another measurement"):
            await _save(b, "K", "y", cached=True)  # another kernel under a used key: never that row's id
    finally:
        await a.close()
        await b.close()


async def test_a_hold_names_the_measurement_it_pays_for(tmp_path: Path) -> None:
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)
    try:
        await a.create_ledger("run", 10)
        await a.create_ledger("other", 10)
        hold = await a.reserve("run", 1.0, "measure x", cache_key="cx")
        for ledger in ("run", "other"):  # the cache serves every ledger: so does the wait
            with pytest.raises(SameMeasurementRunning):
                await b.reserve(ledger, 1.0, "measure x", cache_key="cx")
        late = await b.reserve("run", 1.0, "measure x", cache_key="cx", exclusive=False)  # waited long enough
        await b.release(late)
        other = await b.reserve("run", 1.0, "measure z", cache_key="cz")
        await b.release(other)
        await a.commit(hold, 0.5)
        again = await b.reserve("run", 1.0, "measure x", cache_key="cx")  # settled: free to hold
        await b.release(again)
    finally:
        await a.close()
        await b.close()
