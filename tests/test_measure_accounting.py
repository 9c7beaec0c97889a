"""Measurement accounting: device time of a cancelled run is charged, transient out-of-memory failures are
not cached or learned, and a cached result answers only requests it is precise enough for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_pycuda_measurer import SRC, WORKLOAD

from forecaster_mcp.measure.base import MeasureRequest, ProgressCallback
from forecaster_mcp.measure.pycuda_measurer import PycudaMeasurer
from forecaster_mcp.measure.replay import runtime_stats
from forecaster_mcp.models import (
    DeviceProvenance,
    Kernel,
    Launch,
    MeasureCost,
    MeasureResult,
)
from forecaster_mcp.service import Service, build_forecasters
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import Store

pytestmark = pytest.mark.anyio

FAKE = str(Path(__file__).with_name("fake_gpu_worker.py"))
FAKE_NVCC = [sys.executable, FAKE, "nvcc"]
DEVICE = "NVIDIA H100 80GB HBM3"


def kernel(**defines: Any) -> Kernel:
    return Kernel(
        source=SRC,
        entry="vadd",
        launch=Launch.model_validate({"grid": [4], "block": [256]}),
        defines={"FAKE_MODE": "ok", **defines},
    )


async def make_service(tmp_path: Path, measurer: Any) -> Service:
    settings = Settings(home=tmp_path, measurer="none")
    store = await Store.open(settings.db_path)
    await store.ensure_ledger("L", 1000.0)
    return Service(settings, store, build_forecasters(settings, store), [measurer])


def fake_gpu(tmp_path: Path) -> PycudaMeasurer:
    return PycudaMeasurer(
        tmp_path / "cache",
        worker_cmd=[sys.executable, FAKE],
        device_names=[DEVICE],
        nvcc=FAKE_NVCC,
        kill_slack_s=0.3,
        startup_grace_s=20.0,
    )


class ScriptedMeasurer:
    """Returns the given statuses in turn (one device), so the service's cache and ledger can be checked."""

    name = "fake"

    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.calls = 0

    def devices(self) -> list[str]:
        return ["X"]

    def device_fingerprint(self, device: str) -> str:
        return "scripted|X"

    def reservation_seconds(self, request: MeasureRequest) -> float:
        return request.max_seconds

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        status = self.statuses[min(self.calls, len(self.statuses) - 1)]
        self.calls += 1
        runs = min(request.max_runs, 20)
        stats = runtime_stats([1.0] * runs) if status == "ok" else None
        return MeasureResult(
            kernel_id=request.kernel.id or "k0",
            status=status,  # type: ignore[arg-type]
            runtime_ms=stats,
            device=DeviceProvenance(name="X", backend="fake"),
            cost=MeasureCost(gpu_seconds=0.25),
            flags=["runs_capped_by_max_runs"] if status == "ok" and runs < 20 else [],
        )


async def test_cancelled_measurement_charges_the_device_time_it_used(tmp_path: Path) -> None:
    svc = await make_service(tmp_path, fake_gpu(tmp_path))
    try:
        finished: list[MeasureResult] = []

        async def client() -> None:
            finished.append(
                await svc.measure(
                    ledger="L", kernel=kernel(FAKE_BUSY_S=30), workload=WORKLOAD, max_seconds=10
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(client)
            # The client goes away a second after the job got the device (its lock file is made as it takes
            # it). Not a fixed 2.5 s from the call: on a loaded machine the worker's start and the compile
            # could take that, and nothing had used the device yet.
            for _ in range(1500):  # 30 s at most
                if list((tmp_path / "cache" / "locks").glob("gpu-*.lock")):
                    break
                await anyio.sleep(0.02)
            assert list((tmp_path / "cache" / "locks").glob("gpu-*.lock")), "the job never got the device"
            await anyio.sleep(1.0)  # the occupancy charged below
            tg.cancel_scope.cancel()
        assert not finished  # cancelled, not answered
        view = await svc.store.get_ledger("L")
        assert view is not None
        assert view.reserved_gpu_seconds == 0
        # Device occupancy up to the cancellation (well under the 10 s cap, more than nothing).
        assert 0.2 < view.spent_gpu_seconds <= 10.0
        states = [r["state"] for r in await svc.store.reservations("L")]
        assert states == ["committed"]
        # The report says where that spending went: no measurement row, so it is the cancelled part.
        status = await svc.budget_status("L")
        assert status.measurements.count == 0 and status.measurements.gpu_seconds == 0
        assert status.measurements.cancelled_gpu_seconds == pytest.approx(view.spent_gpu_seconds)
    finally:
        await svc.close()


def _reporting_then_hanging_gpu(tmp_path: Path) -> PycudaMeasurer:
    """The stand-in GPU whose FAKE_MODE=hang kernels report progress N times, then hang (or crash after
    CRASH_AFTER_S)."""
    return PycudaMeasurer(
        tmp_path / "cache",
        worker_cmd=[sys.executable, str(Path(__file__).with_name("progress_then_hang_worker.py"))],
        device_names=[DEVICE],
        nvcc=FAKE_NVCC,
        kill_slack_s=0.3,
        startup_grace_s=20.0,
    )


async def _slow_reader(done: float, total: float | None, message: str | None) -> None:
    """A client that takes 3 s to read a progress report (an SSE stream read slowly, a busy client)."""
    await anyio.sleep(3.0)


async def test_a_client_reading_progress_slowly_then_leaving_is_charged_all_the_device_time(
    tmp_path: Path,
) -> None:
    """The worker goes on running while the server waits on a slow client's progress stream; that wait was
    taken off the charge of a cancelled run. A client that read its first report for 3 s and then hung up
    after 4.5 s on the device was charged about 1.5 GPU-seconds for 4.5 (up to PROGRESS_WAIT_S, 5 s, free per
    measurement)."""
    svc = await make_service(tmp_path, _reporting_then_hanging_gpu(tmp_path))
    try:
        hung = kernel(FAKE_MODE="hang", N=1)

        async def client() -> None:
            await svc.measure(
                ledger="L", kernel=hung, workload=WORKLOAD, max_seconds=20, progress=_slow_reader
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(client)
            for _ in range(1500):  # 30 s at most
                if list((tmp_path / "cache" / "locks").glob("gpu-*.lock")):
                    break
                await anyio.sleep(0.02)
            assert list((tmp_path / "cache" / "locks").glob("gpu-*.lock")), "the job never got the device"
            await anyio.sleep(4.5)  # the device is held all along: 3 s of it while the client read a report
            tg.cancel_scope.cancel()
        view = await svc.store.get_ledger("L")
        assert view is not None and view.reserved_gpu_seconds == 0
        assert 3.5 < view.spent_gpu_seconds <= 20.0
    finally:
        await svc.close()


async def test_a_crash_after_a_slow_clients_progress_wait_is_charged_all_the_device_time(
    tmp_path: Path,
) -> None:
    """As above for a kernel that faults 4 s into its run: the 3 s the client spent reading a report were
    taken off, and the crash was charged about 1 GPU-second."""
    gpu = _reporting_then_hanging_gpu(tmp_path)
    svc = await make_service(tmp_path, gpu)
    try:
        crashing = kernel(FAKE_MODE="hang", N=1, CRASH_AFTER_S=4)
        r = await svc.measure(
            ledger="L", kernel=crashing, workload=WORKLOAD, max_seconds=20, progress=_slow_reader
        )
        assert r.status == "worker_crashed", r.message
        assert 3.5 < r.cost.gpu_seconds <= 20.0
        view = await svc.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == pytest.approx(r.cost.gpu_seconds)
    finally:
        await gpu.aclose()
        await svc.close()


async def test_failure_before_the_device_still_releases_the_hold(tmp_path: Path) -> None:
    svc = await make_service(tmp_path, fake_gpu(tmp_path))
    try:
        # A compile error never reaches the device: nothing is charged.
        broken = kernel().model_copy(update={"source": "#error broken\n" + SRC})
        bad = await svc.measure(ledger="L", kernel=broken, workload=WORKLOAD, max_seconds=5)
        assert bad.status == "compile_error", bad.message
        view = await svc.store.get_ledger("L")
        assert view is not None and view.reserved_gpu_seconds == 0 and view.spent_gpu_seconds == 0
        assert [r["state"] for r in await svc.store.reservations("L")] == ["committed"]  # at 0 GPU-seconds
    finally:
        await svc.close()


@pytest.mark.parametrize("status", ["out_of_memory", "worker_crashed"])
async def test_infrastructure_failures_are_not_cached_and_not_learned(tmp_path: Path, status: str) -> None:
    """Out of memory depends on what else held the GPU, a crashed worker on the worker: neither says the
    configuration fails (learned as one, the family model answered it "slower, decided by cache" and never
    proposed it again, while the cache would measure it afresh)."""
    m = ScriptedMeasurer([status, "ok"])
    svc = await make_service(tmp_path, m)
    try:
        k = kernel()
        first = await svc.measure(ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_seconds=5)
        assert first.status == status
        points = await svc.store.family_points(k.family_key(), "X", WORKLOAD.key())
        assert points == []
        second = await svc.measure(ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_seconds=5)
        assert second.status == "ok" and not second.cost.cached
        assert m.calls == 2
    finally:
        await svc.close()


async def test_cached_result_must_be_as_precise_as_the_request(tmp_path: Path) -> None:
    m = ScriptedMeasurer(["ok"])
    svc = await make_service(tmp_path, m)
    try:
        k = kernel()
        few = await svc.measure(
            ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_runs=1, max_seconds=5
        )
        assert few.runtime_ms is not None and few.runtime_ms.runs == 1
        again = await svc.measure(
            ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_runs=1, max_seconds=5
        )
        assert again.cost.cached and m.calls == 1  # same limits: nothing more to gain, served free
        more = await svc.measure(
            ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_runs=1000, max_seconds=5
        )
        assert not more.cost.cached and m.calls == 2
        assert more.runtime_ms is not None and more.runtime_ms.runs == 20
        # The complete result now answers both kinds of request from cache.
        for runs in (1, 1000):
            hit = await svc.measure(
                ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_runs=runs, max_seconds=5
            )
            assert hit.cost.cached and hit.runtime_ms is not None and hit.runtime_ms.runs == 20
        assert m.calls == 2
        row = await svc.store.get_ledger("L")
        assert row is not None and row.spent_gpu_seconds == pytest.approx(0.5)
    finally:
        await svc.close()


async def test_concurrent_identical_measurements_run_once_and_the_rest_are_free(tmp_path: Path) -> None:
    # Parallel search clients sharing an unmeasured baseline: one device run, one charge.
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    gate = anyio.Event()
    fake.script("vadd", block_until=gate)
    svc = await make_service(tmp_path, fake)
    try:
        results: list[MeasureResult] = []

        async def one() -> None:
            results.append(await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
            await fake.wait_for_calls(1)
            await anyio.sleep(0.2)  # the other four are waiting for the first, not at the device
            assert len(fake.history) == 1
            gate.set()
        assert len(fake.history) == 1
        assert sorted(r.cost.gpu_seconds for r in results) == [0.0, 0.0, 0.0, 0.0, 0.5]
        assert sorted(r.cost.cached for r in results) == [False, True, True, True, True]
        view = await svc.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == pytest.approx(0.5)
    finally:
        await svc.close()


@pytest.mark.parametrize("idempotency_key", [None, "retry-1"])
async def test_a_result_another_process_saves_between_lookup_and_hold_is_served_free(
    tmp_path: Path, idempotency_key: str | None
) -> None:
    """Two server processes on one database: the second looked in the cache while the first's save was still
    committing, then got its hold once that save had closed the first's hold. It must look again before it
    pays for the same measurement (both measured and both were charged: the CI failure of stop 28), and,
    under an idempotency key, not read its own open hold as that request still running."""
    from forecaster_mcp.measure.fake import FakeMeasurer

    first_fake, second_fake = FakeMeasurer([DEVICE], gpu_seconds=0.5), FakeMeasurer([DEVICE], gpu_seconds=0.5)
    gate = anyio.Event()
    first_fake.script("vadd", block_until=gate)
    first, second = await make_service(tmp_path, first_fake), await make_service(tmp_path, second_fake)
    first_done = anyio.Event()
    reserve = second.store.reserve

    async def reserve_once_the_first_has_saved(*args: Any, **kwargs: Any) -> Any:
        if not gate.is_set():  # the second's lookup found nothing: now the first finishes and saves
            gate.set()
            await first_done.wait()
        return await reserve(*args, **kwargs)

    second.store.reserve = reserve_once_the_first_has_saved  # type: ignore[method-assign]
    try:
        results: list[MeasureResult] = []

        async def run_first() -> None:
            results.append(await first.measure(ledger="L", kernel=kernel(), workload=WORKLOAD))
            first_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            await first_fake.wait_for_calls(1)  # the first holds the device
            results.append(
                await second.measure(
                    ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key=idempotency_key
                )
            )
        assert second_fake.history == []
        assert [r.cost.cached for r in results] == [False, True]
        view = await second.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == pytest.approx(0.5)
        assert view.reserved_gpu_seconds == 0  # the second's hold was released, free
    finally:
        await first.close()
        await second.close()


async def test_a_time_cap_below_the_minimum_is_refused_uncharged(tmp_path: Path) -> None:
    from forecaster_mcp.errors import InvalidRequest
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE])
    svc = await make_service(tmp_path, fake)
    try:
        for tiny in (1e-9, 0.05):
            with pytest.raises(InvalidRequest, match=r"max_seconds must be a number of at least 0\.1"):
                await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, max_seconds=tiny)
        assert fake.history == []
        view = await svc.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 0 and view.reserved_gpu_seconds == 0
    finally:
        await svc.close()


async def test_the_default_cap_is_held_to_what_the_ledger_has_left(tmp_path: Path) -> None:
    # A measurement holds its cap up front: with 20 of 1000 GPU-seconds left, the 30 s default would be refused.
    from forecaster_mcp.errors import BudgetExhausted
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    fake.script("vadd", timeout=True)  # holds (and charges) its whole cap, as a hung kernel does
    svc = await make_service(tmp_path, fake)
    try:
        hold = await svc.store.reserve("L", 980.0, "other work")
        await svc.store.commit(hold, 980.0)
        result = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD)
        assert fake.history[0].max_seconds == pytest.approx(20.0)
        assert result.cost.gpu_seconds == pytest.approx(20.0)
        # The result says why its cap was not the default, and a timeout under the lowered cap is not learned
        # as the kernel's failure: on another ledger it was still forecast, not answered "slower" from the store.
        assert {"max_seconds_lowered_to_budget", "timeout_under_lowered_cap"} <= set(result.flags)
        points = await svc.store.family_points(kernel().family_key(), DEVICE, WORKLOAD.key())
        assert points == []
        # A result measured under a lowered cap is served to others without the flag (their cap was not).
        fake.script("vadd", gpu_seconds=0.5)
        await svc.store.topup_ledger("L", 20.0)
        lowered = await svc.measure(ledger="L", kernel=kernel(N=3), workload=WORKLOAD)
        assert lowered.status == "ok" and "max_seconds_lowered_to_budget" in lowered.flags
        await svc.store.ensure_ledger("big", 1000.0)
        copy = await svc.measure(ledger="big", kernel=kernel(N=3), workload=WORKLOAD)
        assert copy.cost.cached and "max_seconds_lowered_to_budget" not in copy.flags
        fake.script("vadd", timeout=True)
        # Under the server's own cap a timeout is the kernel's: learned.
        full = await svc.measure(ledger="big", kernel=kernel(N=2), workload=WORKLOAD)
        assert full.status == "timeout" and full.flags == []
        points = await svc.store.family_points(kernel().family_key(), DEVICE, WORKLOAD.key())
        assert sorted(p.status for p in points) == ["ok", "timeout"]  # N=3 measured ok, N=2 timed out
        # An explicit cap over what is left is the caller's choice: refused, with the cap that would fit.
        await svc.store.ensure_ledger("M", 5.0)
        with pytest.raises(BudgetExhausted, match="pass max_seconds at most 5"):
            await svc.measure(ledger="M", kernel=kernel(N=1), workload=WORKLOAD, max_seconds=10)
    finally:
        await svc.close()


async def test_a_reference_with_no_output_buffer_to_compare_is_refused_uncharged(tmp_path: Path) -> None:
    # Buffers are inputs by default: with none marked out/inout, the check compared nothing and said "passed".
    from forecaster_mcp.errors import InvalidRequest
    from forecaster_mcp.measure.fake import FakeMeasurer
    from forecaster_mcp.models import BufferArg

    inputs_only = WORKLOAD.model_copy(
        update={
            "args": [
                a.model_copy(update={"intent": "in"}) if isinstance(a, BufferArg) else a
                for a in WORKLOAD.args
            ]
        }
    )
    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    svc = await make_service(tmp_path, fake)
    try:
        with pytest.raises(InvalidRequest, match="intent 'out' or 'inout'"):
            await svc.measure(ledger="L", kernel=kernel(), workload=inputs_only, reference=kernel(REF=1))
        assert fake.history == [] and (await svc.budget_status("L")).spent_gpu_seconds == 0.0
        checked = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, reference=kernel(REF=1))
        assert checked.status == "ok"
    finally:
        await svc.close()


async def test_an_idempotency_key_retried_with_a_reference_it_was_first_used_without_is_refused(
    tmp_path: Path,
) -> None:
    from forecaster_mcp.errors import InvalidRequest
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    svc = await make_service(tmp_path, fake)
    try:
        first = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key="step-1")
        assert not first.correctness.checked
        # The same key now asking for a checked run: answering with the unchecked result would pass it off.
        with pytest.raises(InvalidRequest, match="different reference"):
            await svc.measure(
                ledger="L", kernel=kernel(), workload=WORKLOAD, reference=kernel(), idempotency_key="step-1"
            )
        again = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key="step-1")
        assert again.cost.gpu_seconds == 0.0 and len(fake.history) == 1  # a true retry stays free
    finally:
        await svc.close()


async def test_an_idempotency_key_retried_with_another_reference_or_tolerances_is_refused(
    tmp_path: Path,
) -> None:
    from forecaster_mcp.errors import InvalidRequest
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    svc = await make_service(tmp_path, fake)
    try:
        ref = kernel(REF=1)
        first = await svc.measure(
            ledger="L", kernel=kernel(), workload=WORKLOAD, reference=ref, rtol=1e-3, idempotency_key="s"
        )
        assert first.correctness.checked
        # Checked either way, but not against what the retry asks for: the first answer would pass it off.
        for other in (
            {"reference": kernel(REF=2)},
            {"reference": ref, "rtol": 0.5},
            {"reference": ref, "atol": 1.0},
        ):
            with pytest.raises(InvalidRequest, match="different reference or atol/rtol"):
                await svc.measure(
                    ledger="L",
                    kernel=kernel(),
                    workload=WORKLOAD,
                    idempotency_key="s",
                    **other,  # type: ignore[arg-type]
                )
        again = await svc.measure(
            ledger="L", kernel=kernel(), workload=WORKLOAD, reference=ref, rtol=1e-3, idempotency_key="s"
        )
        assert again.cost.gpu_seconds == 0.0 and len(fake.history) == 1
        # One tolerance however it is spelt: 0, 0.0 and -0.0 are the same request.
        await svc.measure(
            ledger="L", kernel=kernel(), workload=WORKLOAD, reference=ref, atol=0, idempotency_key="z"
        )
        for atol in (0.0, -0.0):
            await svc.measure(
                ledger="L", kernel=kernel(), workload=WORKLOAD, reference=ref, atol=atol, idempotency_key="z"
            )
        assert len(fake.history) == 2
        # A row saved before check keys were kept (NULL) is still compared on whether it was checked at all.
        with contextlib.closing(sqlite3.connect(svc.settings.db_path)) as db, db:
            db.execute("UPDATE measurements SET check_key = NULL")
        await svc.measure(
            ledger="L", kernel=kernel(), workload=WORKLOAD, reference=kernel(REF=2), idempotency_key="s"
        )
        with pytest.raises(InvalidRequest, match="different reference"):
            await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key="s")
        assert len(fake.history) == 2
    finally:
        await svc.close()


async def test_cache_hits_ignore_tolerance_spelling_and_unchecked_tolerances(tmp_path: Path) -> None:
    m = ScriptedMeasurer(["ok"])
    svc = await make_service(tmp_path, m)
    try:
        k = kernel()
        ref = kernel(REF="1")

        async def measure(**kw: Any) -> MeasureResult:
            return await svc.measure(
                ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_seconds=5, **kw
            )

        assert not (await measure(atol=1e-5)).cost.cached
        # Without a reference the tolerances check nothing: another atol is the same measurement.
        assert (await measure(atol=0.5, rtol=0.25)).cost.cached and m.calls == 1
        assert not (await measure(reference=ref, atol=0)).cost.cached and m.calls == 2
        for atol in (0.0, -0.0):  # one request, however a Python caller spells zero
            assert (await measure(reference=ref, atol=atol)).cost.cached
        assert not (await measure(reference=ref, atol=0.0, rtol=0.5)).cost.cached and m.calls == 3
    finally:
        await svc.close()


async def test_results_under_the_earlier_cache_key_still_answer(tmp_path: Path) -> None:
    from forecaster_mcp.service import _legacy_cache_key

    m = ScriptedMeasurer(["ok"])
    svc = await make_service(tmp_path, m)
    try:
        # A define given as a string: its content key then was the string's, not the number's.
        k = kernel(BLOCK="16").model_copy(update={"id": "k0"})
        earlier = k.earlier_content_key()
        assert earlier is not None and earlier != k.content_key()
        request = MeasureRequest(kernel=k, workload=WORKLOAD, device="X", atol=1e-5, rtol=1e-3)
        first = await m.measure(request)
        # A row as stores written before the normalised keys hold it.
        await svc.store.save_measurement(
            cache_key=_legacy_cache_key(request, m.device_fingerprint("X")),
            ledger="L",
            idempotency_key="K1",
            kernel_json=k.model_dump_json(),
            workload_key=WORKLOAD.key(),
            family_key=k.family_key(),
            content_key=earlier,
            hardware="X",
            result=first,
            charged_gpu_seconds=0.25,
            cached=False,
        )
        hit = await svc.measure(ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_seconds=5)
        assert hit.cost.cached and m.calls == 1
        status = await svc.budget_status("L")
        assert status.gpu_seconds_saved.cache == pytest.approx(0.25)  # read from the original's row
        retry = await svc.measure(  # a retry of that request under its key: the same kernel, free
            ledger="L", kernel=k, workload=WORKLOAD, hardware="X", max_seconds=5, idempotency_key="K1"
        )
        assert retry.cost.cached and m.calls == 1
        # ... and a compare finds its measurement: against a measured baseline it is answered from both.
        await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, hardware="X", max_seconds=5)
        out = await svc.compare(
            ledger="L",
            candidates=[kernel().model_copy(update={"id": "b"}), k],
            workload=WORKLOAD,
            baseline="b",
            hardware="X",
            target_error=None,
            measure_if_unsure=False,
            max_measurements=0,
        )
        assert out.candidates[0].decided_by == "cache"
    finally:
        await svc.close()


class SlowMeasurer(ScriptedMeasurer):
    """ok after `seconds` of (event-loop) waiting, as a measurement queued behind others would be."""

    def __init__(self, seconds: float) -> None:
        super().__init__(["ok"])
        self.seconds = seconds

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        await anyio.sleep(self.seconds)
        return await super().measure(request, progress)


async def test_a_long_measurement_keeps_its_hold_from_expiring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import forecaster_mcp.service as service_module

    monkeypatch.setattr(service_module, "HOLD_KEEPALIVE_S", 0.05)
    svc = await make_service(tmp_path, SlowMeasurer(0.6))
    try:
        await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, hardware="X", max_seconds=5)
        with sqlite3.connect(svc.settings.db_path) as conn:
            created, expires, amount = conn.execute(
                "SELECT created_at, expires_at, amount_micro FROM reservations"
            ).fetchone()
        first = created + 2.0 * amount / 1e6 + 300.0  # the expiry set at reservation (store.EXPIRY_*)
        assert expires > first + 0.3  # pushed out while the measurement ran
    finally:
        await svc.close()


async def test_budget_status_does_not_show_a_dead_owners_hold_as_reserved(tmp_path: Path) -> None:
    svc = await make_service(tmp_path, ScriptedMeasurer(["ok"]))
    try:
        hold = await svc.store.reserve("L", 5.0, "measure k")
        with sqlite3.connect(svc.settings.db_path) as conn:  # as a server on another host that went away
            conn.execute(
                "UPDATE reservations SET owner_host = 'elsewhere', expires_at = 0 WHERE id = ?", (hold.id,)
            )
        status = await svc.budget_status("L")
        assert status.reserved_gpu_seconds == 0 and status.remaining_gpu_seconds == pytest.approx(1000.0)
    finally:
        await svc.close()


class _CostsNaN(ScriptedMeasurer):
    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        result = await super().measure(request, progress)
        return result.model_copy(update={"cost": MeasureCost(gpu_seconds=float("nan"))})


async def test_a_run_whose_cost_is_not_a_number_is_charged_its_whole_hold(tmp_path: Path) -> None:
    """A measurer that cannot say how long it used the device (NaN) is charged the hold, never 0."""
    svc = await make_service(tmp_path, _CostsNaN(["ok"]))
    try:
        res = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, max_seconds=3)
        view = await svc.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == pytest.approx(3.0) == res.cost.gpu_seconds
    finally:
        await svc.close()


class _FillsTheDisk(ScriptedMeasurer):
    """Measures, and meanwhile the database's disk fills up: the result can no longer be stored."""

    store: Store

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        conn = self.store._conn
        assert conn is not None
        pages = (await conn.execute_fetchall("PRAGMA page_count"))[0][0]
        await conn.execute(f"PRAGMA max_page_count = {pages}")
        result = await super().measure(request, progress)
        return result.model_copy(update={"message": "a long log " * 2000})  # more than the free pages hold


async def test_a_result_the_store_cannot_keep_is_still_charged_and_the_caller_told(tmp_path: Path) -> None:
    """The run used the device: a failed save (disk full) charges it, says so, and leaves no hold open;
    before, the hold was released and the device time was free."""
    from forecaster_mcp.errors import ResultNotSaved

    m = _FillsTheDisk(["ok"])
    svc = await make_service(tmp_path, m)
    m.store = svc.store
    try:
        with pytest.raises(ResultNotSaved, match=r"ran and was charged 0\.25 GPU-seconds.*could not store"):
            await svc.measure(ledger="L", kernel=kernel(SIZE=1 << 20), workload=WORKLOAD, max_seconds=3)
        assert svc.store._conn is not None
        await svc.store._conn.execute("PRAGMA max_page_count = 1073741823")
        view = await svc.store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 0.25 and view.reserved_gpu_seconds == 0
        assert [r["state"] for r in await svc.store.reservations("L")] == ["committed"]
        # budget_status names that charge for what it was, not a cancelled measurement.
        status = await svc.budget_status("L")
        assert status.measurements.count == 0 and status.measurements.gpu_seconds == 0
        assert status.measurements.cancelled_gpu_seconds == 0
        assert status.measurements.not_saved_gpu_seconds == 0.25
    finally:
        await svc.close()


async def test_a_charge_committed_later_for_a_result_not_saved_is_reported_as_not_saved(
    tmp_path: Path,
) -> None:
    """On a locked database the charge of a result not saved is committed in the background: it is still
    told from a cancelled measurement's, which budget_status counts beside it."""
    import asyncio
    import dataclasses

    store = await Store.open(tmp_path / "s.sqlite3")
    try:
        await store.ensure_ledger("L", 10.0)
        lost = await store.reserve("L", 2.0, "measure k")
        cancelled = await store.reserve("L", 2.0, "measure k2")
        store.commit_later(dataclasses.replace(lost, result_not_saved=True), 0.5, interval_s=0.0)
        await store.commit(cancelled, 0.25)
        await asyncio.wait(list(store._retrying))  # the background commit, done
        m = (await store.ledger_report("L"))["measurements"]
        assert (m["not_saved_gpu_seconds"], m["cancelled_gpu_seconds"]) == (0.5, 0.25)
    finally:
        await store.close()


async def test_a_saved_result_and_its_charge_are_one_transaction(tmp_path: Path) -> None:
    """A crash can no longer leave a stored (cached, served free) result whose hold was never committed:
    the row and the charge are written together, or neither is."""
    store = await Store.open(tmp_path / "s.sqlite3")
    await store.ensure_ledger("L", 10.0)
    hold = await store.reserve("L", 2.0, "measure k")
    result = MeasureResult(
        kernel_id="k",
        status="ok",
        runtime_ms=runtime_stats([1.0] * 5),
        device=DeviceProvenance(name="X", backend="fake"),
        cost=MeasureCost(gpu_seconds=0.5),
    )
    save: dict[str, Any] = {
        "cache_key": "c", "ledger": "L", "idempotency_key": None, "kernel_json": kernel().model_dump_json(),
        "workload_key": "w", "family_key": "f", "content_key": "k", "hardware": "X", "result": result,
        "charged_gpu_seconds": 0.5, "cached": False,
    }  # fmt: skip
    try:
        real = store._settle_in

        async def dies(*args: Any) -> int:
            raise sqlite3.OperationalError("the process dies here")

        store._settle_in = dies  # type: ignore[method-assign]
        with pytest.raises(sqlite3.OperationalError):
            await store.save_and_commit(hold, **save)
        assert await store.find_measurement("c") is None  # rolled back with the charge
        store._settle_in = real  # type: ignore[method-assign]
        _, charged = await store.save_and_commit(hold, **save)
        assert charged == 0.5 and (await store.find_measurement("c")) is not None
        view = await store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 0.5 and view.reserved_gpu_seconds == 0
    finally:
        await store.close()


@pytest.mark.parametrize("failures", [2, 80])
async def test_a_commit_that_fails_is_retried_in_the_background_until_the_database_takes_it(
    tmp_path: Path, failures: int
) -> None:
    """However long the database refuses: it gave up after 60 tries (about 10 minutes locked), the device time
    was never charged, and the hold stayed open, blocking that budget, until the next start released it free."""
    store = await Store.open(tmp_path / "s.sqlite3")
    await store.ensure_ledger("L", 10.0)
    hold = await store.reserve("L", 2.0, "measure k")
    real, left = store.commit, [sqlite3.OperationalError("database is locked")] * failures

    async def flaky(reservation: Any, seconds: float) -> float:
        if left:
            raise left.pop()
        return await real(reservation, seconds)

    store.commit = flaky  # type: ignore[method-assign]
    try:
        store.commit_later(hold, 1.5, interval_s=0.001, max_interval_s=0.002)
        with anyio.fail_after(10):
            await asyncio.gather(*store._retrying)
        view = await store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 1.5 and view.reserved_gpu_seconds == 0
        assert not left and [r["state"] for r in await store.reservations("L")] == ["committed"]
    finally:
        await store.close()


async def _fill_the_disk(store: Store) -> None:
    """Make the store's database refuse its money writes as a full disk does (SQLITE_FULL, "database or disk is
    full"): it may not grow (max_page_count), and every ledger event written needs more pages than it has."""
    conn = store._conn
    assert conn is not None
    await conn.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
    pages = (await conn.execute_fetchall("PRAGMA page_count"))[0][0]
    page_size = (await conn.execute_fetchall("PRAGMA page_size"))[0][0]
    await conn.execute(f"PRAGMA max_page_count = {pages}")
    await conn.execute(
        "CREATE TEMP TRIGGER IF NOT EXISTS disk_full BEFORE INSERT ON main.ledger_events BEGIN "
        f"INSERT INTO filler VALUES (zeroblob({(pages + 1) * page_size})); END"
    )


async def _free_the_disk(store: Store) -> None:
    assert store._conn is not None
    await store._conn.execute("DROP TRIGGER IF EXISTS temp.disk_full")
    await store._conn.execute("PRAGMA max_page_count = 1073741823")


async def test_a_charge_pending_on_a_full_disk_lands_with_the_next_write_once_space_is_back(
    tmp_path: Path,
) -> None:
    """A charge whose commit failed on a full disk waited out its backoff (10 s, 20 s, ... up to 300 s) after the
    disk was freed, while other measurements were saved and charged meanwhile: a real HTTP server on a 3 MB tmpfs
    held it open 42 s after space was back, and a SIGKILL then released it free at the next start."""
    store = await Store.open(tmp_path / "s.sqlite3")
    try:
        await store.ensure_ledger("L", 10.0)
        await store.ensure_ledger("M", 10.0)
        hold = await store.reserve("L", 2.0, "measure k")
        await _fill_the_disk(store)
        with pytest.raises(sqlite3.OperationalError, match="full"):
            await store.commit(hold, 1.5)
        store.commit_later(hold, 1.5)  # as the service does, with its default backoff
        await _free_the_disk(store)
        other = await store.reserve("M", 1.0, "measure j")  # the database takes writes again
        with anyio.fail_after(5):  # the next retry was due 10 s later
            await asyncio.gather(*store._retrying)
        view = await store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 1.5 and view.reserved_gpu_seconds == 0
        assert [r["state"] for r in await store.reservations("L")] == ["committed"]
        await store.release(other)
    finally:
        await store.close()


class _DiskFullWhileMeasuring(ScriptedMeasurer):
    """Measures, and meanwhile the database's disk fills up: neither the result nor its charge can be written."""

    store: Store

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        await _fill_the_disk(self.store)
        return await super().measure(request, progress)


async def test_a_charge_that_cannot_be_written_yet_is_not_told_as_charged_and_lands_once_space_is_back(
    tmp_path: Path,
) -> None:
    """The caller was told "ran and was charged" for a charge only pending in the server's memory (the budget
    still showed it reserved, and a SIGKILL released it free); it is now told the charge lands once the server
    can write again, and it does, with the next write after space is back."""
    from forecaster_mcp.errors import ResultNotSaved

    m = _DiskFullWhileMeasuring(["ok"])
    svc = await make_service(tmp_path, m)
    m.store = svc.store
    try:
        with pytest.raises(ResultNotSaved) as failed:
            await svc.measure(ledger="L", kernel=kernel(SIZE=1 << 20), workload=WORKLOAD, max_seconds=3)
        text = str(failed.value)
        assert "was charged" not in text
        assert "is charged 0.25 GPU-seconds once the server can write its database again" in text
        await _free_the_disk(svc.store)
        await svc.store.ensure_ledger("M", 1.0)  # the database takes writes again
        with anyio.fail_after(5):
            await asyncio.gather(*svc.store._retrying)
        status = await svc.budget_status("L")
        assert status.spent_gpu_seconds == 0.25 and status.reserved_gpu_seconds == 0
        assert status.measurements.not_saved_gpu_seconds == 0.25
    finally:
        await svc.close()


async def test_a_commit_still_failing_at_close_gets_a_last_attempt(tmp_path: Path) -> None:
    """The caller was told the run was charged: closing the store does not drop the pending charge."""
    store = await Store.open(tmp_path / "s.sqlite3")
    await store.ensure_ledger("L", 10.0)
    hold = await store.reserve("L", 2.0, "measure k")
    real = store.commit

    async def locked(reservation: Any, seconds: float) -> float:
        raise sqlite3.OperationalError("database is locked")

    store.commit = locked  # type: ignore[method-assign]
    store.commit_later(hold, 1.25, interval_s=3600)
    store.commit = real  # type: ignore[method-assign]
    await store.close()
    again = await Store.open(tmp_path / "s.sqlite3")
    try:
        view = await again.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 1.25 and view.reserved_gpu_seconds == 0
    finally:
        await again.close()


async def test_a_transient_failure_recorded_under_an_idempotency_key_says_a_new_key_measures_again(
    tmp_path: Path,
) -> None:
    # A retry under the key is answered with what it recorded, never charged twice; a timeout (or a crashed
    # worker) says nothing final of the kernel, and the answer tells how to measure again.
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    fake.script("vadd", timeout=True)
    svc = await make_service(tmp_path, fake)
    try:
        first = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key="k1")
        again = await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, idempotency_key="k1")
        assert first.status == again.status == "timeout" and len(fake.history) == 1
        assert again.cost.gpu_seconds == 0.0 and "use a new key" in (again.message or "")
        assert "use a new key" not in (first.message or "")
    finally:
        await svc.close()


async def test_a_hold_whose_release_fails_is_released_in_the_background(tmp_path: Path) -> None:
    # A locked database at release time left the hold open (its budget reserved) for the life of the server,
    # and the release's error replaced the caller's.
    from forecaster_mcp.errors import NotMeasurable
    from forecaster_mcp.measure.fake import FakeMeasurer

    fake = FakeMeasurer([DEVICE], gpu_seconds=0.5)
    fake.script("vadd", not_measurable="not in the recording")
    svc = await make_service(tmp_path, fake)
    store = svc.store
    real, failures = store.release, [sqlite3.OperationalError("database is locked")]

    async def flaky(reservation: Any) -> None:
        if failures:
            raise failures.pop()
        await real(reservation)

    store.release = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(NotMeasurable, match="not in the recording"):
            await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD)
        assert len(store._retrying) == 1 and not failures
        [(hold, seconds)] = store._retrying.values()
        assert seconds is None
        await store._settle_now(hold, None)  # what the retry does, without its 10 s wait
        view = await store.get_ledger("L")
        assert view is not None and view.reserved_gpu_seconds == 0 and view.spent_gpu_seconds == 0
    finally:
        await svc.close()


async def test_a_reference_that_faults_is_not_the_measured_kernels_failure(tmp_path: Path) -> None:
    # The reference's fault was saved as the kernel's launch_error: compare_kernels then called a kernel twice
    # as slow "faster, by cache" against it, whatever reference (or none) later checks it.
    def op(name: str, **defines: Any) -> Kernel:
        return Kernel(source=SRC, entry="vadd", launch=Launch.model_validate({"grid": [4], "block": [256]}),
                      defines={"FAKE_OP": name, **defines})  # fmt: skip

    # The real gpu_worker on the fake driver (FAKE_OP="wild": an illegal address in the reference).
    gpu = PycudaMeasurer(
        tmp_path / "cache",
        worker_cmd=[sys.executable, FAKE, "--fake-pycuda"],
        device_names=[DEVICE],
        nvcc=FAKE_NVCC,
        kill_slack_s=0.3,
        startup_grace_s=20.0,
    )
    svc = await make_service(tmp_path, gpu)
    try:
        good = op("add", FAKE_MS=1.0)
        faulted = await svc.measure(ledger="L", kernel=good, workload=WORKLOAD, reference=op("wild"))
        assert faulted.status == "launch_error" and "reference_failed" in faulted.flags
        await svc.measure(ledger="L", kernel=op("add", FAKE_MS=2.0), workload=WORKLOAD)
        res = await svc.compare(
            ledger="L", candidates=[good, op("add", FAKE_MS=2.0)], workload=WORKLOAD, baseline=None,
            hardware=None, target_error=None, measure_if_unsure=False, max_measurements=0,
        )  # fmt: skip
        assert res.candidates[0].decided_by == "forecast"
        stored_as = res.hardware  # the canonical name measurements are filed under
        assert await svc.store.failed_status(good.content_key(), stored_as, WORKLOAD.key()) is None
        assert all(
            p.status == "ok"
            for p in await svc.store.family_points(good.family_key(), stored_as, WORKLOAD.key())
        )
        # A reference whose signature does not fit the workload is the caller's check failing too.
        other = op("add", FAKE_MS=3.0)
        assert (await svc.measure(ledger="L", kernel=other, workload=WORKLOAD)).status == "ok"
        bad_ref = Kernel.model_validate(
            {**op("add").model_dump(), "source": SRC.replace("int n)", "int n, int extra)")}
        )
        refused = await svc.measure(ledger="L", kernel=other, workload=WORKLOAD, reference=bad_ref)
        assert refused.status == "launch_error" and "reference_failed" in refused.flags
        assert await svc.store.failed_status(other.content_key(), stored_as, WORKLOAD.key()) is None
        # An export keeps the kernel's ok result, not the later failure of its reference.
        rows = await svc.store.export_rows()
        exported = {Kernel.model_validate_json(k).content_key(): json.loads(r) for _, _, k, r in rows}
        assert exported[other.content_key()]["status"] == "ok"
    finally:
        await gpu.aclose()
        await svc.close()


async def test_a_cancelled_replay_at_a_pace_charges_the_time_it_occupied(tmp_path: Path) -> None:
    """serve --replay-realtime makes a replayed measurement hold the simulated device for its recorded time. A
    request cancelled meanwhile was charged nothing (the hold released), where a GPU charges a cancelled run
    the device time it used; agents under evaluation could start and drop measurements for free."""
    from forecaster_mcp.measure.fake import FakeMeasurer
    from forecaster_mcp.measure.realtime import RealtimeReplay

    recording = FakeMeasurer(["X"], gpu_seconds=1.0)
    paced = RealtimeReplay(recording, scale=20.0)  # 20 s of wall clock
    svc = await make_service(tmp_path, paced)
    try:
        finished: list[MeasureResult] = []

        async def client() -> None:
            finished.append(await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD, max_seconds=10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(client)
            # The client goes away 0.5 s into the recording's play (counted from the replay's answer, which
            # the pace then holds back; not from the call, whose store work a loaded machine can make slow).
            await recording.wait_for_calls(1, within_seconds=30)
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
        assert not finished  # cancelled, not answered
        view = await svc.store.get_ledger("L")
        assert view is not None and view.reserved_gpu_seconds == 0
        # About 0.5 s of the 20 s the recorded 1 GPU-second takes at this pace: 0.025 GPU-seconds.
        assert 0.01 < view.spent_gpu_seconds < 0.5
        status = await svc.budget_status("L")
        assert status.measurements.count == 0
        assert status.measurements.cancelled_gpu_seconds == pytest.approx(view.spent_gpu_seconds)
    finally:
        await svc.close()


async def test_a_replay_at_a_pace_says_it_is_done_only_when_its_wait_is_over() -> None:
    """The paced replay passed on the recording's '1.0/1.0 replayed' before waiting out the recorded time: a
    client watching progress was told the measurement was done with the whole wait still to come."""
    from forecaster_mcp.measure.base import MeasureRequest
    from forecaster_mcp.measure.fake import FakeMeasurer
    from forecaster_mcp.measure.realtime import RealtimeReplay

    seen: list[tuple[float, float | None, str | None, float]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message, anyio.current_time()))

    paced = RealtimeReplay(FakeMeasurer(["X"], gpu_seconds=0.1), scale=1.0)  # 0.1 s of wall clock
    started = anyio.current_time()
    await paced.measure(MeasureRequest(kernel=kernel(), workload=WORKLOAD, device="X"), progress)
    assert [(s[0], s[2]) for s in seen] == [
        (0.0, "fake measurement started"),
        (0.0, "occupying the device for 0.1 GPU-s"),
        (1.0, "fake measurement done"),
    ]
    assert seen[-1][3] - started >= 0.1  # done once the wait is over
