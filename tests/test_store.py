"""The store: ledgers balance exactly, measurements are idempotent, forecasts get verified, tokens hashed."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forecaster_mcp.errors import BudgetExhausted, InvalidRequest, OperatorError, UnknownLedger
from forecaster_mcp.models import (
    COMPILE_INTERRUPTED,
    INPUTS_UNFINISHED,
    DeviceProvenance,
    Kernel,
    Launch,
    MeasureCost,
    MeasureResult,
    RuntimeStats,
)
from forecaster_mcp.store import migrations
from forecaster_mcp.store.db import (
    FAILED_BASELINE_SPEEDUP,
    FAILED_CANDIDATE_SPEEDUP,
    MICRO,
    REFERENCE_FAILED,
    TIMEOUT_UNDER_LOWERED_CAP,
    ForecastRow,
    Store,
)

pytestmark = pytest.mark.anyio

SOURCE = "__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }"


def kernel(block: int = 32, **defines: int) -> Kernel:
    launch = Launch(grid=(4, 1, 1), block=(block, 1, 1))
    return Kernel(source=SOURCE, entry="k", defines=dict(defines), launch=launch)


def result(
    status: str = "ok", median: float = 1.0, gpu_seconds: float = 0.5, flags: tuple[str, ...] = ()
) -> MeasureResult:
    stats = None
    if status == "ok":
        stats = RuntimeStats(
            median=median, mean=median, min=median, p10=median, p90=median, std=0.0,
            ci95_low=median, ci95_high=median, runs=10,
        )  # fmt: skip
    return MeasureResult(
        kernel_id="k0",
        status=status,  # type: ignore[arg-type]
        runtime_ms=stats,
        device=DeviceProvenance(name="A100", backend="fake", driver="550.1"),
        cost=MeasureCost(gpu_seconds=gpu_seconds),
        flags=list(flags),
    )


async def save(
    store: Store,
    k: Kernel,
    median: float = 1.0,
    *,
    ledger: str | None = "x",
    status: str = "ok",
    charged: float = 1.0,
    cached: bool = False,
    idem: str | None = None,
    hardware: str = "A100",
    workload_key: str = "w",
    cache_key: str | None = None,
    flags: tuple[str, ...] = (),
) -> int:
    return await store.save_measurement(
        cache_key=cache_key or f"{k.content_key()}/{hardware}/{workload_key}",
        ledger=ledger,
        idempotency_key=idem,
        kernel_json=k.model_dump_json(),
        workload_key=workload_key,
        family_key=k.family_key(),
        content_key=k.content_key(),
        hardware=hardware,
        result=result(status, median, charged, flags),
        charged_gpu_seconds=0.0 if cached else charged,
        cached=cached,
    )


def forecast(
    base: Kernel,
    cand: Kernel,
    p_faster: float,
    verdict: str,
    *,
    decided_by: str = "forecast",
    ledger: str | None = "x",
    hardware: str = "A100",
    forecaster: str = "local",
) -> ForecastRow:
    probs = [(1 - p_faster) / 4] * 4 + [p_faster / 4] * 4
    return ForecastRow(
        ledger=ledger,
        forecaster=forecaster,
        hardware=hardware,
        workload_key="w",
        baseline_key=base.content_key(),
        candidate_key=cand.content_key(),
        probs=probs,
        p_faster=p_faster,
        verdict=verdict,  # type: ignore[arg-type]
        decided_by=decided_by,  # type: ignore[arg-type]
    )


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    s = await Store.open(tmp_path / "state" / "forecaster.sqlite3")
    await s.create_ledger("x", 10.0)
    yield s
    await s.close()


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path)


async def event_sums(store: Store, name: str) -> tuple[int, int, int]:
    events = await store.ledger_events(name)
    return (
        sum(round(e["limit_delta_gpu_seconds"] * MICRO) for e in events),
        sum(round(e["spent_delta_gpu_seconds"] * MICRO) for e in events),
        sum(round(e["reserved_delta_gpu_seconds"] * MICRO) for e in events),
    )


# ------------------------------------------------------------------------------------------- ledgers


async def test_create_topup_list_and_operator_mistakes(store: Store) -> None:
    assert (await store.topup_ledger("x", 2.5)).limit_gpu_seconds == 12.5
    await store.create_ledger("agent-7", 0)
    assert [v.name for v in await store.list_ledgers()] == ["agent-7", "x"]
    assert await store.get_ledger("nope") is None
    with pytest.raises(OperatorError, match=r"already exists.*ledger topup x"):
        await store.create_ledger("x", 1)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(OperatorError, match="finite number"):
            await store.create_ledger("y", bad)
    with pytest.raises(OperatorError, match="> 0"):
        await store.topup_ledger("x", 0)
    with pytest.raises(OperatorError, match=r"ledger 'ghost' does not exist.*ledger create ghost"):
        await store.topup_ledger("ghost", 1)
    with pytest.raises(OperatorError, match="not allowed"):
        await store.create_ledger("two words", 1)
    assert (await store.ensure_ledger("x", 99)).limit_gpu_seconds == 12.5
    assert (await store.ensure_ledger("fresh", 3)).limit_gpu_seconds == 3


async def test_commit_charges_at_most_the_hold_and_settles_once(store: Store) -> None:
    hold = await store.reserve("x", 5.0, "measure k")
    view = await store.get_ledger("x")
    assert view is not None and view.reserved_gpu_seconds == 5.0 and view.remaining_gpu_seconds == 5.0
    assert await store.commit(hold, 7.5) == 5.0  # clamped to the hold
    assert await store.commit(hold, 1.0) == 0.0  # already settled: no double charge
    await store.release(hold)  # no-op too
    view = await store.get_ledger("x")
    assert view is not None and (view.spent_gpu_seconds, view.reserved_gpu_seconds) == (5.0, 0.0)

    h2 = await store.reserve("x", 2.0, "m")
    assert await store.commit(h2, -3.0) == 0.0  # negative actual charges nothing
    h3 = await store.reserve("x", 2.0, "m")
    assert await store.commit(h3, math.nan) == 2.0  # unknown actual charges the whole hold
    h4 = await store.reserve("x", 1.0, "m")
    await store.release(h4)
    assert await store.commit(h4, 1.0) == 0.0
    view = await store.get_ledger("x")
    assert view is not None and (view.spent_gpu_seconds, view.reserved_gpu_seconds) == (7.0, 0.0)
    kinds = [e["kind"] for e in await store.ledger_events("x")]
    assert kinds == [
        "create",
        "reserve",
        "commit",
        "reserve",
        "commit",
        "reserve",
        "commit",
        "reserve",
        "release",
    ]
    assert await event_sums(store, "x") == (10 * MICRO, 7 * MICRO, 0)


async def test_budget_exhausted_names_what_is_left_and_charges_nothing(store: Store) -> None:
    hold = await store.reserve("x", 6.8, "m")
    await store.commit(hold, 6.8)
    with pytest.raises(BudgetExhausted) as err:
        await store.reserve("x", 5.0, "m")
    text = str(err.value)
    assert "ledger 'x' has 3.2 GPU-seconds left (limit 10, spent 6.8)" in text
    assert "needs up to 5." in text and "compare_kernels are free" in text
    assert "forecaster-mcp ledger topup x --gpu-seconds N" in text
    view = await store.get_ledger("x")
    assert view is not None and view.reserved_gpu_seconds == 0.0
    assert len(await store.reservations("x")) == 1
    # Exactly the remainder can still be reserved: the comparison is exact, in micro-GPU-seconds.
    assert (await store.reserve("x", 3.2, "m")).gpu_seconds == 3.2


async def test_device_time_however_short_is_never_charged_as_nothing(store: Store) -> None:
    hold = await store.reserve("x", 1.0, "measure k")
    assert await store.commit(hold, 1e-9) == 1e-6  # one micro-GPU-second, the ledger's unit
    view = await store.get_ledger("x")
    assert view is not None and view.spent_gpu_seconds == 1e-6
    exact = await store.reserve("x", 1.0, "measure k")
    assert await store.commit(exact, 0.1) == 0.1  # no rounding up of amounts that are already whole units


async def test_reserve_rejects_unknown_ledgers_and_bad_amounts(store: Store) -> None:
    with pytest.raises(UnknownLedger, match=r"'ghost' does not exist.*ledger create ghost --gpu-seconds"):
        await store.reserve("ghost", 1.0, "m")
    for bad in (0.0, -1.0, math.nan, math.inf, 1e13):
        with pytest.raises(InvalidRequest):
            await store.reserve("x", bad, "m")
    with pytest.raises(UnknownLedger):
        await store.ledger_report("ghost")


async def test_ledger_events_are_append_only(store: Store) -> None:
    await store.reserve("x", 1.0, "m")
    with raw(store.path) as conn, pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("UPDATE ledger_events SET amount_micro = 0")
    with raw(store.path) as conn, pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("DELETE FROM ledger_events")


# ------------------------------------------------------------------------------------------- property test

amounts = st.floats(min_value=1e-7, max_value=40.0, allow_nan=False, allow_infinity=False)
# An operator's amounts (limit, top-up) are refused below a micro-GPU-second (to_micro).
operator_amounts = st.floats(min_value=1e-6, max_value=40.0, allow_nan=False, allow_infinity=False)
actuals = st.one_of(st.floats(min_value=-5.0, max_value=60.0), st.just(math.nan))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), amounts),
        st.tuples(st.just("commit"), st.integers(0, 30), actuals),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("topup"), operator_amounts),
    ),
    max_size=25,
)


def micro_of(x: float) -> int:
    return max(round(x * MICRO), 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=60)), steps=ops)
def test_ledger_invariants_under_random_operations(limit: float, steps: list[tuple[Any, ...]]) -> None:
    async def scenario(path: Path) -> None:
        store = await Store.open(path)
        try:
            await store.create_ledger("p", limit)
            m_limit, m_spent, m_reserved = round(limit * MICRO), 0, 0
            holds: list[Any] = []
            open_holds: dict[int, int] = {}
            for step in steps:
                if step[0] == "reserve":
                    need = micro_of(step[1])
                    if m_limit - m_spent - m_reserved >= need:
                        hold = await store.reserve("p", step[1], "prop")
                        holds.append(hold)
                        open_holds[hold.id] = need
                        m_reserved += need
                    else:
                        with pytest.raises(BudgetExhausted):
                            await store.reserve("p", step[1], "prop")
                elif step[0] == "topup":
                    await store.topup_ledger("p", step[1])
                    m_limit += micro_of(step[1])
                elif holds:
                    hold = holds[step[1] % len(holds)]
                    held = open_holds.pop(hold.id, None)
                    if step[0] == "release":
                        await store.release(hold)
                        expected = 0
                    else:
                        actual = step[2]
                        charged = await store.commit(hold, actual)
                        if held is None:
                            expected = 0
                        elif math.isnan(actual):
                            expected = held
                        else:
                            # Positive device time is at least one micro-unit (never charged as nothing).
                            micro = round(max(actual, 0.0) * MICRO)
                            expected = min(1 if actual > 0 and micro == 0 else micro, held)
                        assert round(charged * MICRO) == expected
                    if held is not None:
                        m_reserved -= held
                        m_spent += expected
                view = await store.get_ledger("p")
                assert view is not None
                got = (
                    round(view.limit_gpu_seconds * MICRO),
                    round(view.spent_gpu_seconds * MICRO),
                    round(view.reserved_gpu_seconds * MICRO),
                )
                assert got == (m_limit, m_spent, m_reserved)
                assert 0 <= m_spent and 0 <= m_reserved and m_spent + m_reserved <= m_limit
                assert view.remaining_gpu_seconds >= -1e-9
                assert await event_sums(store, "p") == got
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "db.sqlite3"))


# ------------------------------------------------------------------------------------------- measurements


async def test_idempotency_key_stores_one_measurement_per_ledger(store: Store) -> None:
    await store.create_ledger("y", 1)
    k = kernel()
    first = await save(store, k, 2.0, idem="run-1")
    again = await save(store, k, 9.0, idem="run-1")
    other_ledger = await save(store, k, 3.0, idem="run-1", ledger="y")
    assert again == first and other_ledger != first
    request = await store.idempotent_request("x", "run-1")
    assert request is not None
    found = request.result
    assert found.measurement_id == first
    assert found.runtime_ms is not None and found.runtime_ms.median == 2.0
    assert await store.idempotent_request("x", "run-2") is None
    report = await store.ledger_report("x")
    assert report["measurements"]["count"] == 1


async def test_cache_lookup_prefers_originals_and_skips_infrastructure_failures(store: Store) -> None:
    k = kernel()
    assert await store.find_measurement("ck") is None
    ok_id = await save(store, k, 4.0, cache_key="ck", charged=2.5)
    await save(store, k, status="worker_crashed", cache_key="ck")
    hit = await store.find_measurement("ck")
    assert hit is not None and hit.measurement_id == ok_id and hit.status == "ok"
    assert hit.device.driver == "550.1"  # provenance round-trips
    await save(store, k, 4.0, cache_key="ck", cached=True)
    again = await store.find_measurement("ck")
    assert again is not None and again.measurement_id == ok_id
    report = await store.ledger_report("x")
    assert report["measurements"]["cache_hits"] == 1
    assert report["gpu_seconds_saved"]["cache"] == 2.5
    # A compile error is a property of the kernel, so it is served from cache like a runtime.
    bad = await save(store, kernel(block=64), status="compile_error", cache_key="bad")
    found = await store.find_measurement("bad")
    assert found is not None and found.measurement_id == bad and found.status == "compile_error"


async def test_unknown_ledger_in_saves_is_reported(store: Store) -> None:
    with pytest.raises(UnknownLedger):
        await save(store, kernel(), ledger="ghost")
    with pytest.raises(UnknownLedger):
        await store.save_forecasts([forecast(kernel(), kernel(64), 0.5, "unsure", ledger="ghost")])
    assert await save(store, kernel(), ledger=None) > 0


async def test_family_points_latest_per_kernel_preferring_ok(store: Store) -> None:
    a, b, c = kernel(BS=1), kernel(BS=2), kernel(BS=3)
    await save(store, a, 3.0)
    await save(store, a, 2.0)
    await save(store, b, 1.5)
    await save(store, b, status="worker_crashed")
    await save(store, c, status="compile_error")
    await save(store, kernel(BS=4), 1.0, hardware="H100")
    points = {p.defines["BS"]: p for p in await store.family_points(a.family_key(), "A100", "w")}
    assert set(points) == {1, 2, 3}
    assert points[1].runtime_ms == 2.0 and points[2].runtime_ms == 1.5 and points[2].status == "ok"
    assert points[3].status == "compile_error" and points[3].runtime_ms is None
    assert points[1].launch == {"grid": [4, 1, 1], "block": [32, 1, 1], "shared_mem_bytes": 0}
    assert points[1].content_key == a.content_key()
    measured = await store.measured_interval(a.content_key(), "A100", "w")
    assert measured is not None and measured[0] == 2.0
    assert await store.measured_interval(c.content_key(), "A100", "w") is None
    assert await store.measured_interval(a.content_key(), "H100", "w") is None
    # The family's best is the fastest of those same points: the H100 one and failures do not count.
    assert await store.best_runtime(a.family_key(), "A100", "w") == 1.5
    assert await store.best_runtime(a.family_key(), "H100", "w") == 1.0
    assert await store.best_runtime(a.family_key(), "A100", "other") is None
    await save(store, a, 1.2)
    await save(store, a, 1.8)  # re-measured slower: the latest measurement of a kernel is its runtime
    assert await store.best_runtime(a.family_key(), "A100", "w") == 1.5


async def test_a_suspect_measurement_is_no_point_of_its_family(store: Store) -> None:
    """A measurement flagged below_physical_floor or events_disagree_with_wall_clock (its runtime may not be the
    kernel's work) was a family point like any other: a kernel that skipped its work at 0.001 ms taught the
    model that configuration 1000x faster, and was the family's best. As compare answers from a kernel's latest
    ok measurement (Store.measured_runtime), that one counts: flagged, the kernel is no point, also when an
    earlier measurement of it was clean, until a later clean one. It stays stored, with its flags."""
    a, b, c = kernel(BS=1), kernel(BS=2), kernel(BS=3)
    await save(store, a, 1.0)
    await save(store, b, 0.001, flags=("below_physical_floor",))
    await save(store, c, 2.0)
    await save(store, c, 0.002, flags=("events_disagree_with_wall_clock", "too_few_runs_for_interval"))

    async def points() -> dict[int, float | None]:
        return {p.defines["BS"]: p.runtime_ms for p in await store.family_points(a.family_key(), "A100", "w")}

    assert await points() == {1: 1.0}
    assert await store.best_runtime(a.family_key(), "A100", "w") == 1.0
    found = await store.measured_runtime(b.content_key(), "A100", "w")
    assert found is not None and found[0][0] == 0.001 and found[1] == ["below_physical_floor"]
    # A flag that says nothing of the runtime leaves the point as it was.
    await save(store, b, 1.5, flags=("too_few_runs_for_interval",))
    assert await points() == {1: 1.0, 2: 1.5}
    # The latest ok measurement counts, not a failure after it (the kernel ran), and not an earlier clean one.
    await save(store, a, 0.001, flags=("below_physical_floor",))
    await save(store, a, status="compile_error")
    assert await points() == {2: 1.5}
    assert await store.best_runtime(a.family_key(), "A100", "w") == 1.5


@pytest.mark.anyio
async def test_compile_options_reach_the_family_model_and_it_learns_them(store: Store) -> None:
    """Members that differ only in nvcc flags are different binaries of one family: the stored points carry
    the flags and the local model learns their effect (here -use_fast_math halves every runtime)."""
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.local import LocalForecaster
    from forecaster_mcp.hardware.specs import lookup
    from forecaster_mcp.models import Workload

    def member(bs: int, fast: bool) -> Kernel:
        flags = ["-use_fast_math"] if fast else []
        return Kernel(id=f"b{bs}{fast}", source=SOURCE, entry="k", defines={"BS": bs}, compile_options=flags)

    def runtime(bs: int, fast: bool) -> float:
        return (1.0 + abs(math.log2(bs) - 7.0)) * (0.5 if fast else 1.0)

    for bs in (16, 32, 64, 128, 256, 512, 1024):
        for fast in (False, True):
            if (bs, fast) != (256, True):
                await save(store, member(bs, fast), runtime(bs, fast), hardware="A100-PCIE-40GB")
    points = await store.family_points(member(16, False).family_key(), "A100-PCIE-40GB", "w")
    assert sorted(p.compile_options for p in points)[-1] == ("-use_fast_math",)

    class History:
        async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[Any]:
            return await store.family_points(family_key, hardware, "w")

    f = LocalForecaster(History(), ptxas_wait_s=0.0)
    hw = lookup("A100-PCIE-40GB")
    [out] = await f.forecast(
        [PairQuery(member(256, False), member(256, True), Workload(), "A100-PCIE-40GB", hw)]
    )
    assert out.extras["measured"] == 0.0  # the flagged binary was never measured
    assert out.p_faster > 0.9 and out.extras["mu_log2"] == pytest.approx(1.0, abs=0.3)


# ------------------------------------------------------------------------------------------- forecasts


async def test_forecasts_are_verified_when_both_kernels_get_measured(store: Store) -> None:
    base, cand = kernel(BS=1), kernel(BS=2)
    [fid] = await store.save_forecasts([forecast(base, cand, 0.9, "faster")])
    await store.save_forecasts([forecast(base, cand, 0.9, "faster", hardware="H100")])
    assert await store.verified_pairs() == []
    await save(store, base, 3.0)
    assert await store.verified_pairs() == []  # only one side measured
    fail_id = await save(store, cand, status="compile_error")
    # The candidate failed for good while the baseline ran: the "faster" verdict was wrong.
    [pair] = await store.verified_pairs()
    assert (pair.failure, pair.actual_speedup, pair.verdict) == (
        "candidate",
        FAILED_CANDIDATE_SPEEDUP,
        "faster",
    )
    with raw(store.path) as conn:
        assert conn.execute(
            "SELECT verified_by_measurement FROM forecasts WHERE id = ?", (fid,)
        ).fetchone() == (fail_id,)
    cand_id = await save(store, cand, 1.5)  # measured ok after all: the runtimes are the truth
    [pair] = await store.verified_pairs()
    assert pair.failure is None
    assert (pair.forecaster, pair.hardware, pair.actual_speedup, pair.verdict) == (
        "local",
        "A100",
        2.0,
        "faster",
    )
    assert pair.p_faster == 0.9 and len(pair.probs) == 8 and pair.verified_by == cand_id
    with raw(store.path) as conn:
        assert conn.execute(
            "SELECT verified_by_measurement FROM forecasts WHERE id = ?", (fid,)
        ).fetchone() == (cand_id,)
    # The latest ok measurement of each kernel defines the truth.
    await save(store, cand, 6.0)
    [pair] = await store.verified_pairs()
    assert pair.actual_speedup == 0.5


async def test_a_suspect_measurement_verifies_no_forecast(store: Store) -> None:
    """A pair whose measurement is flagged below_physical_floor / events_disagree_with_wall_clock was a verified
    pair (calibration, certified thresholds, combination weights, budget_status) scored against a speedup that
    is not the kernels': a candidate that skipped its work at 0.001 ms beside a 2 ms baseline made a "faster"
    forecast right (S = 2000). It is left out while the latest ok measurement of either kernel is flagged."""
    base, cand, other = kernel(BS=1), kernel(BS=2), kernel(BS=3)
    await store.save_forecasts([forecast(base, cand, 0.9, "faster"), forecast(base, other, 0.2, "slower")])
    await save(store, base, 2.0)
    await save(store, cand, 0.001, flags=("below_physical_floor",))
    assert await store.verified_pairs() == []
    report = await store.ledger_report("x")
    assert report["forecasts"]["verified"] == 0 and report["calibration"]["verified_pairs"] == 0
    assert report["forecasts"]["verified_correct"] == 0
    # Measured, if not in a way that stands: charged, not a measurement the forecast spared (only the pair of
    # the never measured `other` is, at the median charge, 1.0).
    assert report["gpu_seconds_saved"]["forecasts"] == 1.0
    # Measured again without the flag: verified, against the clean runtime.
    await save(store, cand, 4.0)
    [pair] = await store.verified_pairs()
    assert pair.actual_speedup == 0.5 and pair.verdict == "faster"
    assert (await store.ledger_report("x"))["forecasts"]["verified"] == 1
    # The baseline's latest measurement flagged: out again (as compare answers the pair), the earlier clean
    # one notwithstanding.
    await save(store, base, 0.01, flags=("events_disagree_with_wall_clock",))
    assert await store.verified_pairs() == []
    assert (await store.ledger_report("x"))["forecasts"]["verified"] == 0
    await save(store, base, 2.0)
    assert [p.actual_speedup for p in await store.verified_pairs()] == [0.5]
    # A pair verified by a kernel failing for good rests on the failure, not on the other kernel's runtime.
    await save(store, base, 0.01, flags=("below_physical_floor",))
    await save(store, other, status="compile_error")
    [pair] = await store.verified_pairs()
    assert (pair.failure, pair.actual_speedup) == ("candidate", FAILED_CANDIDATE_SPEEDUP)


async def test_a_kernel_failing_for_good_while_the_other_runs_verifies_the_forecast(store: Store) -> None:
    """A verdict on a kernel that then fails to compile, gives wrong output or runs past the server's cap is
    checked like any other (the one that ran is the better choice); what says nothing final of the kernel
    verifies nothing."""
    base = kernel(BS=1)
    cands = {status: kernel(BS=i + 2) for i, status in enumerate(("out_of_memory", "worker_crashed"))}
    both, base_fails, later = kernel(BS=11), kernel(BS=12), kernel(BS=13)
    flagged_cands = {
        flag: kernel(BS=30 + i) for i, flag in enumerate((REFERENCE_FAILED, TIMEOUT_UNDER_LOWERED_CAP))
    }
    slow = kernel(BS=40)
    await save(store, base, 2.0)
    await store.save_forecasts(
        [forecast(base, k, 0.9, "faster") for k in (*cands.values(), *flagged_cands.values(), slow)]
    )
    for status, k in cands.items():
        await save(store, k, status=status)
    for flag, k in flagged_cands.items():
        status = "wrong_output" if flag == REFERENCE_FAILED else "timeout"
        await store.save_measurement(
            cache_key=f"flagged/{flag}", ledger="x", idempotency_key=None, kernel_json=k.model_dump_json(),
            workload_key="w", family_key=k.family_key(), content_key=k.content_key(), hardware="A100",
            result=result(status).model_copy(update={"flags": [flag]}), charged_gpu_seconds=1.0, cached=False,
        )  # fmt: skip
    assert await store.verified_pairs() == []  # a crash, no memory, the reference's failure, a lowered cap

    # Past the server's own cap: the kernel's failure (as compare_kernels and the family model take it).
    await save(store, slow, status="timeout")
    [pair] = await store.verified_pairs()
    assert (pair.failure, pair.actual_speedup, pair.verdict) == (
        "candidate",
        FAILED_CANDIDATE_SPEEDUP,
        "faster",
    )

    # Both kernels failed: nothing says which is faster.
    failing = kernel(BS=20)
    await save(store, failing, status="compile_error")
    await store.save_forecasts([forecast(failing, both, 0.5, "unsure")])
    await save(store, both, status="launch_error")
    assert len(await store.verified_pairs()) == 1

    # The baseline failed and the candidate ran, measured before the forecast was saved: verified at once.
    await save(store, base_fails, status="wrong_output")
    await save(store, later, 4.0)
    await store.save_forecasts([forecast(base_fails, later, 0.2, "slower")])
    [pair] = [p for p in await store.verified_pairs() if p.failure == "baseline"]
    assert (pair.failure, pair.actual_speedup, pair.verdict) == (
        "baseline",
        FAILED_BASELINE_SPEEDUP,
        "slower",
    )


@pytest.mark.parametrize("flag", [COMPILE_INTERRUPTED, INPUTS_UNFINISHED])
async def test_an_interrupted_compile_is_not_the_kernels_failure(store: Store, flag: str) -> None:
    """nvcc past its time limit or killed (a loaded machine, the OOM killer), or a cap that ran out while the
    workload's inputs were made, gives a "timeout" that says nothing of the kernel: it was learned as one
    (family models, compare_kernels' failed map) like a kernel that ran past its cap."""
    k = kernel(BS=3)
    interrupted = result("timeout").model_copy(update={"flags": [flag]})
    await store.save_measurement(
        cache_key="c", ledger="x", idempotency_key=None, kernel_json=k.model_dump_json(), workload_key="w",
        family_key=k.family_key(), content_key=k.content_key(), hardware="A100", result=interrupted,
        charged_gpu_seconds=0.0, cached=False,
    )  # fmt: skip
    assert await store.family_points(k.family_key(), "A100", "w") == []
    await save(store, kernel(BS=4), status="timeout")  # a kernel that ran past its cap is learned
    assert [p.status for p in await store.family_points(k.family_key(), "A100", "w")] == ["timeout"]


async def test_save_forecasts_verifies_at_once_and_filters(store: Store) -> None:
    base, cand = kernel(BS=1), kernel(BS=2)
    await save(store, base, 2.0)
    await save(store, cand, 4.0)
    ids = await store.save_forecasts(
        [
            forecast(base, cand, 0.2, "slower"),
            forecast(base, cand, 0.6, "unsure", forecaster="claude"),
            forecast(base, cand, 0.0, "slower", decided_by="cache"),
        ]
    )
    assert len(ids) == 3 and ids == sorted(ids)
    pairs = await store.verified_pairs()
    assert [(p.forecaster, p.actual_speedup) for p in pairs] == [("local", 0.5), ("claude", 0.5)]
    assert [p.forecaster for p in await store.verified_pairs(forecaster="claude")] == ["claude"]
    assert await store.verified_pairs(hardware="H100") == []
    assert await store.save_forecasts([]) == []


async def test_a_pair_asked_about_again_and_again_is_one_verified_pair(store: Store) -> None:
    base, cand, other = kernel(BS=1), kernel(BS=2), kernel(BS=3)
    # A search loop re-sends an untried candidate: five forecasts of one pair, one with the roles swapped,
    # and a pair with a third kernel.
    for p in (0.6, 0.7, 0.8, 0.9):
        await store.save_forecasts([forecast(base, cand, p, "unsure")])
    await store.save_forecasts([forecast(cand, base, 0.05, "slower")])
    await store.save_forecasts([forecast(base, other, 0.3, "unsure")])
    await store.save_forecasts([forecast(base, cand, 0.7, "unsure", forecaster="claude")])
    await save(store, base, 3.0)
    await save(store, cand, 1.5)
    await save(store, other, 1.0)
    pairs = await store.verified_pairs()
    # One row per forecaster and pair, the last one asked; each outcome counts once.
    assert [(p.forecaster, p.p_faster, p.actual_speedup) for p in pairs] == [
        ("local", 0.05, 0.5),
        ("local", 0.3, 3.0),
        ("claude", 0.7, 2.0),
    ]
    assert [p.p_faster for p in await store.verified_pairs(forecaster="local", hardware="A100")] == [
        0.05,
        0.3,
    ]


async def test_ledger_report_counts_everything(store: Store) -> None:
    a, b, c, d, e = kernel(BS=1), kernel(BS=2), kernel(BS=3), kernel(BS=4), kernel(BS=5)
    await save(store, a, 2.0, charged=1.0, cache_key="a")
    await save(store, b, 1.0, charged=3.0)
    await save(store, c, status="compile_error", charged=2.0)
    await save(store, a, 2.0, cached=True, cache_key="a")
    await save(store, e, 4.0, charged=2.0)
    await store.save_forecasts(
        [
            forecast(
                b, a, 0.2, "slower"
            ),  # the same pair asked earlier, the other way round: only the last counts
            forecast(a, b, 0.9, "faster"),  # verified, right (S = 2)
            forecast(a, e, 0.8, "faster"),  # verified, wrong (S = 0.5)
            forecast(a, d, 0.7, "faster"),  # decided, not verified
            forecast(a, d, 0.75, "faster"),  # asked again: still one measurement spared
            forecast(b, e, 0.55, "unsure"),  # deferred, verified (counts for calibration only; S = 0.25)
            forecast(a, b, 1.0, "faster", decided_by="cache"),
            forecast(a, d, 0.5, "unsure", ledger=None),  # another ledger's row
        ]
    )
    await store.record_llm_usage(
        ledger="x", model="claude", input_tokens=100, output_tokens=20, cache_read_tokens=5,
        cache_write_tokens=0, cost_usd=0.25,
    )  # fmt: skip
    await store.record_llm_usage(
        ledger=None, model="claude", input_tokens=7, output_tokens=7, cache_read_tokens=0,
        cache_write_tokens=0, cost_usd=1.0,
    )  # fmt: skip
    hold = await store.reserve("x", 1.5, "m")
    await store.commit(hold, 1.25)
    await store.reserve("x", 2.0, "m")
    report = await store.ledger_report("x")
    assert report == {
        "limit_gpu_seconds": 10.0,
        "spent_gpu_seconds": 1.25,
        "reserved_gpu_seconds": 2.0,
        "remaining_gpu_seconds": 6.75,
        "measurements": {
            "count": 5,
            "cache_hits": 1,
            "failures": 1,
            "gpu_seconds": 8.0,
            "cancelled_gpu_seconds": 0.0,
            "not_saved_gpu_seconds": 0.0,
        },
        "forecasts": {
            "count": 7,
            "decided": 5,
            "deferred": 1,
            "verified": 2,
            "verified_correct": 1,
            "accuracy": 0.5,
        },
        # 1 pair decided and never measured x the median (2.0) of this ledger's charged measurements (1, 3, 2, 2).
        "gpu_seconds_saved": {"cache": 1.0, "forecasts": 2.0},
        "llm": {
            "calls": 1,
            "input_tokens": 100,
            "output_tokens": 20,
            "cache_read_tokens": 5,
            "cache_write_tokens": 0,
            "cost_usd": 0.25,
            "unpriced_tokens": 0,
        },
        "calibration": {
            "verified_pairs": 3,
            "brier": pytest.approx(((0.9 - 1) ** 2 + (0.8 - 0) ** 2 + (0.55 - 0) ** 2) / 3),
        },
    }


async def test_calibration_state_upserts(store: Store) -> None:
    assert await store.load_calibration("local", "A100") is None
    await store.save_calibration("local", "A100", '{"a": 1}')
    await store.save_calibration("local", "A100", '{"a": 2}')
    await store.save_calibration("local", "H100", '{"a": 3}')
    assert await store.load_calibration("local", "A100") == '{"a": 2}'
    assert await store.load_calibration("local", "H100") == '{"a": 3}'


# ------------------------------------------------------------------------------------------- tokens


async def test_tokens_are_stored_hashed_and_can_be_revoked(store: Store) -> None:
    token = await store.issue_token("x", label="agent run 1")
    second = await store.issue_token("x")
    assert token.startswith("fmcp_") and len(token) > 40 and token != second
    assert await store.ledger_for_token(token) == "x"
    assert await store.ledger_for_token("fmcp_wrong") is None
    listed = await store.list_tokens()
    assert [t["label"] for t in listed] == ["agent run 1", None]
    assert all(token not in str(t) for t in listed)
    for path in (p for p in store.path.parent.rglob("*") if p.is_file()):  # the database, WAL, owner locks...
        data = path.read_bytes()
        assert token.encode() not in data and token[5:].encode() not in data, path
    assert await store.revoke_token(token) is True
    assert await store.revoke_token(token) is False
    assert await store.ledger_for_token(token) is None
    assert await store.revoke_token(listed[1]["fingerprint"]) is True
    assert await store.ledger_for_token(second) is None
    assert await store.revoke_token("not-a-token") is False
    with pytest.raises(OperatorError, match="does not exist"):
        await store.issue_token("ghost")


# ------------------------------------------------------------------------------------------- migrations


async def test_reopen_is_idempotent_and_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    for _ in range(3):
        s = await Store.open(path)
        await s.ensure_ledger("x", 5)
        await s.close()
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (migrations.latest_version(),)
        versions = conn.execute("SELECT version FROM schema_version").fetchall()
        assert versions == [(m.version,) for m in migrations.MIGRATIONS]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT count(*) FROM ledgers").fetchone() == (1,)


async def test_a_new_database_another_process_is_creating_is_waited_for(tmp_path: Path) -> None:
    """Servers started at once on an empty state folder: one of them holds the new file's write lock before
    its switch to WAL. The others' switch got "database is locked" at once, with no busy wait (one start in
    about twelve failed with three processes), and now waits for it as every other statement does."""
    path = tmp_path / "db.sqlite3"
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # a new file, not yet WAL: what the first process holds for a moment
        opening = asyncio.ensure_future(Store.open(path))
        with pytest.raises(TimeoutError):  # the old code failed here, at its first try
            await asyncio.wait_for(asyncio.shield(opening), 1.0)
        other.execute("COMMIT")
    finally:
        other.close()
    s = await asyncio.wait_for(opening, 60)
    try:
        await s.create_ledger("x", 5)
    finally:
        await s.close()
    with raw(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone() == (len(migrations.MIGRATIONS),)


async def _database_at_version(path: Path, version: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A database file as a forecaster-mcp that knew only the first `version` migrations left it."""
    with monkeypatch.context() as m:
        m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:version])
        await (await Store.open(path)).close()
    return path


async def test_forecasts_stored_before_families_were_kept_migrate_and_still_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _database_at_version(tmp_path / "db.sqlite3", 2, monkeypatch)
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
        conn.execute(
            "INSERT INTO forecasts (forecaster, hardware, workload_key, baseline_key, candidate_key, probs_json, "
            "p_faster, verdict, decided_by, actual_speedup, created_at) "
            "VALUES ('local', 'A100', 'w', 'a', 'b', '[0,0,0,0.5,0.5,0,0,0]', 0.5, 'unsure', 'forecast', 2.0, 1)"
        )
    s = await Store.open(path)
    try:
        [old] = await s.verified_pairs()
        assert old.family_key is None and old.actual_speedup == 2.0
        probs = [0.0, 0.0, 0.0, 0.2, 0.8, 0.0, 0.0, 0.0]
        await s.save_forecasts(
            [ForecastRow(None, "local", "A100", "w", "a", "c", probs, 0.8, "faster", "forecast", "fam")]
        )
        rows = await s.verified_pairs()
        assert [v.family_key for v in rows] == [None] and len(rows) == 1  # c is not measured: unverified
    finally:
        await s.close()
    with raw(path) as conn:
        assert conn.execute("SELECT family_key FROM forecasts ORDER BY id").fetchall() == [(None,), ("fam",)]


async def test_holds_taken_before_they_named_their_measurement_migrate_and_block_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _database_at_version(tmp_path / "db.sqlite3", 4, monkeypatch)
    s = await Store.open(path)
    try:
        await s.create_ledger("x", 5)
        # An open hold as a server of the previous version writes it (its insert names no cache key).
        with raw(path) as conn:
            conn.execute(
                "INSERT INTO reservations (ledger, amount_micro, purpose, owner_pid, owner_host, owner_start, "
                "created_at, expires_at) VALUES ('x', 1000000, 'measure k', ?, 'h', NULL, 1, 1e12)",
                (os.getpid(),),
            )
        hold = await s.reserve("x", 1.0, "measure k", cache_key="ck")  # NULL cache key: nothing to wait for
        await s.commit(hold, 0.5)
    finally:
        await s.close()
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (migrations.latest_version(),)
        assert conn.execute("SELECT cache_key FROM reservations ORDER BY id").fetchall() == [(None,), ("ck",)]


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    await (await Store.open(path)).close()
    with raw(path) as conn:
        conn.execute(f"PRAGMA user_version = {migrations.latest_version() + 1}")
    with pytest.raises(OperatorError, match="newer than this forecaster-mcp"):
        await Store.open(path)


async def test_a_newer_schema_is_refused_leaving_the_file_as_it_was(tmp_path: Path) -> None:
    """The refusal came after the switch to WAL: a database of a newer version in another journal mode (one
    copied, or written by a version that left WAL) was rewritten (header, -wal and -shm files) before this
    forecaster-mcp said it would not touch it."""
    path = tmp_path / "db.sqlite3"
    await (await Store.open(path)).close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.execute(f"PRAGMA user_version = {migrations.latest_version() + 1}")
    finally:
        conn.close()
    before = path.read_bytes()
    with pytest.raises(OperatorError, match="newer than this forecaster-mcp"):
        await Store.open(path)
    assert path.read_bytes() == before
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("db.")) == ["db.sqlite3"]


async def test_a_newer_schema_is_refused_at_once_while_a_newer_server_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal waited for the write lock: with a server of the newer version writing, this one waited out
    the 30 s busy timeout and then said 'database is locked' (the CLI: 'busy ... try again when it is free')."""
    path = tmp_path / "db.sqlite3"
    await (await Store.open(path)).close()
    with raw(path) as conn:
        conn.execute(f"PRAGMA user_version = {migrations.latest_version() + 1}")
    newer = sqlite3.connect(path, isolation_level=None)
    try:
        newer.execute("BEGIN IMMEDIATE")
        newer.execute("INSERT INTO ledgers VALUES ('n', 1, 0, 0, 1, 1)")
        with pytest.raises(OperatorError, match="newer than this forecaster-mcp"):
            await asyncio.wait_for(Store.open(path), 10)  # the busy timeout is 30 s
        newer.execute("COMMIT")
    finally:
        newer.close()


# ------------------------------------------------------------------------------------------- orphans


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


async def test_orphans_of_dead_or_reused_pids_are_released_on_open(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    s = await Store.open(path)
    await s.create_ledger("x", 10)
    dead = await s.reserve("x", 1.0, "dead owner")
    reused = await s.reserve("x", 2.0, "pid reused")
    mine = await s.reserve("x", 3.0, "live owner, expired")
    await s.close()
    with raw(path) as conn:
        conn.execute("UPDATE reservations SET owner_pid = ? WHERE id = ?", (_dead_pid(), dead.id))
        conn.execute("UPDATE reservations SET owner_start = '?:1' WHERE id = ?", (reused.id,))
        conn.execute("UPDATE reservations SET expires_at = 0 WHERE id = ?", (mine.id,))
    s = await Store.open(path)
    try:
        states = {r["id"]: r["state"] for r in await s.reservations("x")}
        if (Path("/proc") / "self" / "stat").exists():
            assert states[reused.id] == "orphan_released"
        assert states[dead.id] == "orphan_released"
        # This process is alive: a queued measurement may outlive the expiry, so its hold stays.
        assert states[mine.id] == "open"
        view = await s.get_ledger("x")
        assert view is not None and view.reserved_gpu_seconds == (3.0 if states[reused.id] != "open" else 5.0)
        assert [e["kind"] for e in await s.ledger_events("x")].count("orphan_release") == 2
        assert await s.commit(dead, 1.0) == 0.0  # a released orphan is never charged later
    finally:
        await s.close()


async def test_expired_holds_of_unverifiable_owners_are_released_at_reserve(store: Store) -> None:
    far = await store.reserve("x", 4.0, "other host, expired")
    near = await store.reserve("x", 4.0, "other host, not expired")
    with raw(store.path) as conn:
        conn.execute(
            "UPDATE reservations SET owner_host = 'elsewhere', expires_at = 0 WHERE id = ?", (far.id,)
        )
        conn.execute("UPDATE reservations SET owner_host = 'far' WHERE id = ?", (near.id,))
    # 2 GPU-seconds left until the expired hold is released inside this reserve's transaction.
    await store.reserve("x", 6.0, "needs the expired hold")
    states = {r["id"]: r["state"] for r in await store.reservations("x")}
    assert states[far.id] == "orphan_released" and states[near.id] == "open"
    events = await store.ledger_events("x")
    assert next(e["detail"] for e in events if e["kind"] == "orphan_release").startswith("expired")


async def test_budget_reads_answer_while_another_process_holds_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report releases orphan holds first, but only takes the write lock when there are some to release,
    and a lock it cannot get does not fail the read."""
    from forecaster_mcp.store import db

    monkeypatch.setattr(db, "BUSY_TIMEOUT_S", 0.2)
    store = await Store.open(tmp_path / "s.sqlite3")
    await store.ensure_ledger("L", 10.0)
    other = sqlite3.connect(tmp_path / "s.sqlite3", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        report = await store.ledger_report("L")
        assert report is not None and report["limit_gpu_seconds"] == 10.0
        other.execute("ROLLBACK")
        # Another owner's hold is open (it looks dead from here): releasing it needs the lock, still no failure.
        other.execute(
            "INSERT INTO reservations (ledger, amount_micro, purpose, owner_pid, owner_host, state, created_at, "
            "expires_at) VALUES ('L', 1, 'x', 999999999, 'elsewhere', 'open', 0, 0)"
        )
        other.execute("BEGIN IMMEDIATE")
        assert (await store.ledger_report("L")) is not None
        assert await store.release_orphans(best_effort=True) == 0
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            await store.release_orphans()
    finally:
        other.execute("ROLLBACK")
        other.close()
        await store.close()


async def test_a_pair_asked_again_keeps_one_unverified_row_and_every_forecast_counts(tmp_path: Path) -> None:
    """A search loop asks about the same pairs call after call: only the last forecast of a pair is ever read,
    so the new row replaces the unverified ones (the table grew ~110 KB per 64-candidate call), while
    budget_status still counts every forecast made."""
    s = await Store.open(tmp_path / "db.sqlite3")
    try:
        await s.create_ledger("x", 100)
        base, cand, other = kernel(BS=1), kernel(BS=2), kernel(BS=3)
        for p, verdict in [(0.6, "unsure"), (0.97, "faster"), (0.7, "unsure")]:
            await s.save_forecasts([forecast(base, cand, p, verdict), forecast(base, other, p, verdict)])
        with raw(tmp_path / "db.sqlite3") as conn:
            assert conn.execute("SELECT count(*) FROM forecasts").fetchone() == (2,)
        status = await s.ledger_report("x")
        assert status["forecasts"]["count"] == 6
        assert (status["forecasts"]["decided"], status["forecasts"]["deferred"]) == (2, 4)
        # Verified rows stay: the pair's outcome is history the calibration and thresholds learn from.
        await save(s, base, 2.0)
        await save(s, cand, 1.0)
        await s.save_forecasts([forecast(base, cand, 0.9, "unsure", decided_by="cache")])
        [verified] = await s.verified_pairs()
        assert verified.p_faster == 0.7 and verified.actual_speedup == 2.0
        assert (await s.ledger_report("x"))["forecasts"]["count"] == 7
    finally:
        await s.close()


async def test_forecast_totals_migrate_from_the_rows_stored_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "db.sqlite3"
    with monkeypatch.context() as m:  # a ledger and forecasts as the previous version stored them
        m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:5])
        s = await Store.open(path)
        await s.create_ledger("x", 100)
        await s.close()
    with raw(path) as conn:
        for verdict in ("unsure", "faster", "faster"):
            conn.execute(
                "INSERT INTO forecasts (ledger, forecaster, hardware, workload_key, baseline_key, candidate_key, "
                "probs_json, p_faster, verdict, decided_by, created_at) VALUES ('x', 'local', 'A100', 'w', 'a', "
                "'b', '[0,0,0,0.5,0.5,0,0,0]', 0.5, ?, 'forecast', 1)",
                (verdict,),
            )
        assert conn.execute("PRAGMA user_version").fetchone() == (5,)
    s = await Store.open(path)
    try:
        f = (await s.ledger_report("x"))["forecasts"]
        assert (f["count"], f["decided"], f["deferred"]) == (3, 2, 1)
    finally:
        await s.close()


async def test_forecasts_stored_before_caps_were_kept_migrate_with_no_cap_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A component's raw row keeps the cap its answer set on its own confidence (forecasts.max_confidence,
    migration 15); rows a server of version 14 stored read as capped by nothing (the engine scores them as it
    did), and new rows keep theirs."""
    path = await _database_at_version(tmp_path / "db.sqlite3", 14, monkeypatch)
    with raw(path) as conn:
        conn.execute(
            "INSERT INTO forecasts (forecaster, hardware, workload_key, baseline_key, candidate_key, probs_json, "
            "p_faster, verdict, decided_by, actual_speedup, created_at, p_fail, p_fail_baseline) VALUES "
            "('raw:local@0', 'A100', 'w', 'a', 'b', '[0,0,0,0.1,0.9,0,0,0]', 0.9, 'unsure', 'forecast', 2.0, 1, "
            "NULL, NULL)"
        )
    s = await Store.open(path)
    try:
        [old] = await s.verified_pairs()
        assert old.max_confidence is None and old.p_faster == 0.9
        probs = [0.0, 0.0, 0.0, 0.2, 0.8, 0.0, 0.0, 0.0]
        row = ForecastRow(None, "raw:local@0", "A100", "w", "a", "c", probs, 0.8, "unsure", "forecast")
        await s.save_forecasts([dataclasses.replace(row, max_confidence=0.85)])
        with pytest.raises(ValueError, match="max_confidence"):
            await s.save_forecasts([dataclasses.replace(row, candidate_key="d", max_confidence=math.nan)])
    finally:
        await s.close()
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (migrations.latest_version(),)
        rows = conn.execute("SELECT candidate_key, max_confidence FROM forecasts ORDER BY id").fetchall()
        assert rows == [("b", None), ("c", 0.85)]


async def test_family_states_are_kept_per_family_gpu_and_workload(tmp_path: Path) -> None:
    s = await Store.open(tmp_path / "db.sqlite3")
    try:
        assert await s.load_family_state("fam", "A100", "w") is None
        await s.save_family_state("fam", "A100", "w", '{"version": 1}')
        await s.save_family_state("fam", "A100", "w", '{"version": 1, "n_ok": 5}')
        await s.save_family_state("fam", "H100", "w", "{}")
    finally:
        await s.close()
    s = await Store.open(tmp_path / "db.sqlite3")  # a restarted server reads what the last one saved
    try:
        assert await s.load_family_state("fam", "A100", "w") == '{"version": 1, "n_ok": 5}'
        assert await s.load_family_state("fam", "H100", "w") == "{}"
        assert await s.load_family_state("fam", "A100", "other") is None
    finally:
        await s.close()


@pytest.mark.anyio
async def test_a_kernel_stored_under_two_spellings_answers_from_the_newer(store: Store) -> None:
    """0x20 and 32u are one configuration (#define BX 32 either way) with two content keys: a third spelling
    is answered from the newer of their measurements, whichever order their content keys sort in."""
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.local import LocalForecaster
    from forecaster_mcp.hardware.specs import lookup
    from forecaster_mcp.models import Workload

    def member(bx: object) -> Kernel:
        return Kernel(id=f"m{bx}", source=SOURCE, entry="k", defines={"BX": bx})

    class History:
        async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[Any]:
            return await store.family_points(family_key, hardware, "w")

    for hardware, (older, newer) in (("A100-PCIE-40GB", ("0x20", "32u")), ("H100-SXM", ("32u", "0x20"))):
        for bx in (8, 16, 64, 128):
            await save(store, member(bx), 2.0, hardware=hardware)
        await save(store, member(older), 1.0, hardware=hardware)
        await save(store, member(newer), 4.0, hardware=hardware)  # re-measured under the other spelling
        f = LocalForecaster(History(), ptxas_wait_s=0.0)
        [out] = await f.forecast([PairQuery(member(8), member(32), Workload(), hardware, lookup(hardware))])
        assert out.extras["measured"] == 1.0, out.rationale
        assert out.extras["mu_log2"] == pytest.approx(-1.0, abs=1e-9), (hardware, out.rationale)


def test_an_owner_is_dead_only_on_positive_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc hides other users' processes (hidepid) or the boot id is masked, a live server's hold was
    called an orphan by any operator command (`ledger show`) and released: the ledger was then overspent."""
    from forecaster_mcp.store import db

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host, pidns = db._Owner.current().host, db._read_pidns()
        start = db._proc_start(child.pid, db._read_boot_id())
        assert start is not None
        assert db._owner_state(db._Owner.current(), child.pid, host, pidns, start) == "alive"
        # The checker's view: its own /proc entry and namespace, no boot id, the owner's entry hidden.
        hidden = tmp_path / "proc"
        (hidden / "self" / "ns").mkdir(parents=True)
        assert pidns is not None
        os.symlink(pidns, hidden / "self" / "ns" / "pid")
        (hidden / str(os.getpid())).mkdir()
        (hidden / str(os.getpid()) / "stat").write_text(Path(f"/proc/{os.getpid()}/stat").read_text())
        monkeypatch.setattr(db, "_PROC", hidden)
        me = db._Owner.current()
        assert me.start is not None and me.start.startswith("?:") and me.pidns == pidns
        assert db._owner_state(me, child.pid, host, pidns, start) == "unknown"  # alive, unverifiable
        child.kill()
        child.wait()
        assert db._owner_state(me, child.pid, host, pidns, start) == "dead"  # the kernel says so
    finally:
        child.kill()
        child.wait()


def test_remaining_is_exact_and_a_name_with_a_final_newline_is_refused() -> None:
    from forecaster_mcp.store.db import LedgerView, check_ledger_name

    assert LedgerView("x", 0.3, 0.1, 0.2).remaining_gpu_seconds == 0.0  # was -2.8e-17 in floats
    assert LedgerView("x", 1.0, 0.25, 0.000001).remaining_gpu_seconds == 0.749999
    check_ledger_name("run-42")
    with pytest.raises(OperatorError, match="not allowed"):
        check_ledger_name("run-42\n")  # `$` matched before a final newline: a second, look-alike ledger


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def _hold_lock(path: Path) -> subprocess.Popen[str]:
    """A process holding an exclusive flock on `path` (as a server holds its owner lock) until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def _end(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()


async def test_a_dead_owner_in_another_pid_namespace_is_found_by_its_lock(tmp_path: Path) -> None:
    """A server restarted in a fresh container (a new PID namespace) could not tell its predecessor's holds
    from a live server's: pids say nothing across namespaces, so they waited for expiry (2 x cap + 300 s)
    and the ledger looked spent meanwhile. The owner's flock, which the kernel drops at its death, tells."""
    from forecaster_mcp.store import db

    path = tmp_path / "state" / "forecaster.sqlite3"
    server = await Store.open(path)
    await server.create_ledger("run", 60.0)
    me = db._Owner.current()
    if me.start is None or me.start.startswith("?"):
        pytest.skip("no /proc boot id here: owners are told apart by pids and expiry only")
    # The predecessor: same machine and kernel, another PID namespace (its pid is meaningless here).
    other = db._Owner(pid=1, host=me.host, pidns="pid:[4026999999]", start=f"{me.start.split(':')[0]}:12345")
    lock = path.parent / "owners" / db._owner_lock_name(other.pid, other.host, other.pidns, other.start)
    holder = _hold_lock(lock)
    try:
        server._owner = other  # its reservation records the predecessor as owner
        await server.reserve("run", 60.0, "measure k")
        server._owner = me
        checker = await Store.open(path)
        try:
            assert (await checker.get_ledger("run")).reserved_gpu_seconds == 60.0  # alive: kept
            _end(holder)
            assert await checker.release_orphans() == 1  # its lock is free: it died
            assert (await checker.get_ledger("run")).remaining_gpu_seconds == 60.0
        finally:
            await checker.close()
    finally:
        _end(holder)
        await server.close()


async def test_a_closed_store_leaves_no_lock_file_unless_it_left_a_hold(tmp_path: Path) -> None:
    """Each process that opened the store left a file in owners/ for good: every CLI command and stdio
    session added one (11 after a ledger create, a few top-ups, a token issue and revokes), and an evaluation
    running thousands of them filled the folder. Only an owner that left an open hold needs its file."""
    path = tmp_path / "state" / "forecaster.sqlite3"
    owners = path.parent / "owners"
    store = await Store.open(path)
    await store.create_ledger("run", 10.0)
    other = await Store.open(path)  # a second store of this process shares the lock
    await store.commit(await store.reserve("run", 5.0, "measure k"), 1.0)
    await store.close()
    assert len(list(owners.iterdir())) == 1  # still held by the other store
    await other.close()
    assert list(owners.iterdir()) == []

    left = await Store.open(path)
    await left.reserve("run", 2.0, "measure k")  # a charge that failed at close: released at the next start
    await left.close()
    assert len(list(owners.iterdir())) == 1


async def test_a_pair_forecast_before_and_after_its_baseline_was_measured_is_one_verified_pair(
    store: Store,
) -> None:
    """A search asks about a candidate before its baseline is measured (stored under the regime's name,
    `local@1.0:unmeasured`) and again after (`local@1.0`). budget_status counted the pair once per name: one
    decided pair spared two measurements, and once measured it was two verified forecasts, both correct."""
    base, cand, paid = kernel(BS=1), kernel(BS=2), kernel(BS=3)
    await save(store, paid, 5.0, charged=2.0)  # this ledger's typical paid measurement: 2 GPU-seconds
    await store.save_forecasts([forecast(base, cand, 0.96, "faster", forecaster="local@1.0:unmeasured")])
    await store.save_forecasts([forecast(base, cand, 0.97, "faster", forecaster="local@1.0")])
    report = await store.ledger_report("x")
    assert report["forecasts"]["decided"] == 2  # two forecasts were made ...
    assert report["gpu_seconds_saved"]["forecasts"] == 2.0  # ... of one pair: one measurement spared
    await save(store, base, 3.0)
    await save(store, cand, 1.5)
    report = await store.ledger_report("x")
    assert (report["forecasts"]["verified"], report["forecasts"]["verified_correct"]) == (1, 1)
    assert report["calibration"]["verified_pairs"] == 1


async def test_the_wal_switch_retries_busy_in_its_extended_codes() -> None:
    """Python reports SQLite's extended result code: a WAL being recovered by another process is
    SQLITE_BUSY_RECOVERY (261), not SQLITE_BUSY (5). The switch compared the plain codes, so it failed at once
    on 261 instead of waiting for the other process as it does on 5; a damaged-file error still fails at once."""
    from forecaster_mcp.store import db

    def error(code: int) -> sqlite3.OperationalError:
        exc = sqlite3.OperationalError("database is locked")
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
        return exc

    class Conn:
        def __init__(self, codes: list[int]) -> None:
            self.codes, self.calls = codes, 0

        async def execute(self, sql: str) -> None:
            self.calls += 1
            if self.codes:
                raise error(self.codes.pop(0))

    busy = Conn([5, 261, 517, 6])  # BUSY, BUSY_RECOVERY, BUSY_SNAPSHOT, LOCKED
    await db._wal_mode(busy)
    assert busy.calls == 5
    with pytest.raises(sqlite3.OperationalError):
        await db._wal_mode(Conn([11]))  # SQLITE_CORRUPT
