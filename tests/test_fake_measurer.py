"""The scripted fake measurer other tests build on."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from forecaster_mcp.errors import NotMeasurable, WorkerCrashed
from forecaster_mcp.forecast.local import VERSION as LOCAL_VERSION
from forecaster_mcp.measure.base import Measurer, MeasureRequest
from forecaster_mcp.measure.fake import FakeMeasurer
from forecaster_mcp.models import Kernel, Workload

pytestmark = pytest.mark.anyio


def kernel(entry: str = "k", kid: str | None = None, **defines: Any) -> Kernel:
    return Kernel(id=kid, source="__global__ void k() {}", entry=entry, defines=defines)


def request(k: Kernel, device: str = "FAKE-GPU", **kw: Any) -> MeasureRequest:
    return MeasureRequest(kernel=k, workload=Workload(), device=device, **kw)


async def test_scripted_runtimes_by_entry_and_defines() -> None:
    fake = FakeMeasurer(gpu_seconds=0.25)
    seam: Measurer = fake  # type-checks against the protocol
    assert seam.name == "fake" and seam.devices() == ["FAKE-GPU"]
    fake.script("k", runtime_ms=2.0)
    fake.script("k", defines={"BLOCK": 64}, runtime_ms=lambda kern: 10.0 / int(kern.defines["BLOCK"]))
    plain = await fake.measure(request(kernel(kid="a")))
    tuned = await fake.measure(request(kernel(kid="b", BLOCK="64")))  # defines match forgivingly
    other = await fake.measure(request(kernel("unscripted")))
    assert (plain.status, plain.runtime_ms.median, plain.kernel_id) == ("ok", 2.0, "a")
    assert tuned.runtime_ms.median == pytest.approx(10.0 / 64)
    assert other.runtime_ms.median == 1.0  # the default
    assert plain.cost.gpu_seconds == 0.25 and plain.device.backend == "fake"
    assert fake.reservation_seconds(request(kernel())) == 0.25
    assert [r.kernel.id for r in fake.history] == ["a", "b", None]
    assert fake.device_fingerprint("FAKE-GPU") == "fake:FAKE-GPU"


async def test_noise_is_seeded_and_runs_follow_the_cap() -> None:
    fake = FakeMeasurer(runs=20, noise=0.05)
    a = await fake.measure(request(kernel(), seed=1))
    b = await fake.measure(request(kernel(), seed=1))
    c = await fake.measure(request(kernel(), seed=2, max_runs=5))
    assert a.runtime_ms == b.runtime_ms and a.runtime_ms.std > 0
    assert c.runtime_ms.runs == 5 and c.runtime_ms != a.runtime_ms


async def test_timeout_charges_the_cap() -> None:
    fake = FakeMeasurer(gpu_seconds=0.1)
    fake.script("hang", timeout=True)
    req = request(kernel("hang"), max_seconds=3.0)
    assert fake.reservation_seconds(req) == 3.0
    result = await fake.measure(req)
    assert result.status == "timeout" and result.cost.gpu_seconds == 3.0 and result.runtime_ms is None


async def test_status_crash_and_refusal() -> None:
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.2, measure_unscripted=False)
    fake.script("bad", status="compile_error", message="error: expected ';'", gpu_seconds=0.0)
    fake.script("dies", crash=True)
    fake.script("nope", not_measurable="not in the recording")
    bad = await fake.measure(request(kernel("bad"), "A100-PCIE-40GB"))
    assert (bad.status, bad.message, bad.cost.gpu_seconds) == ("compile_error", "error: expected ';'", 0.0)
    with pytest.raises(WorkerCrashed):
        await fake.measure(request(kernel("dies"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="not in the recording"):
        await fake.measure(request(kernel("nope"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="no script"):
        await fake.measure(request(kernel("unscripted"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="no device 'H100'"):
        await fake.measure(request(kernel("bad"), "H100"))
    assert fake.in_flight == 0


async def test_blocks_until_released_for_concurrency_tests() -> None:
    fake = FakeMeasurer()
    gate = anyio.Event()
    fake.script("held", block_until=gate)
    done: list[str] = []

    async def one(kid: str) -> None:
        result = await fake.measure(request(kernel("held", kid=kid)))
        done.append(result.kernel_id)

    async with anyio.create_task_group() as tg:
        for kid in ("x", "y", "z"):
            tg.start_soon(one, kid)
        await fake.wait_for_calls(3)
        assert fake.in_flight == 3 and done == []
        gate.set()
    assert sorted(done) == ["x", "y", "z"] and fake.max_in_flight == 3 and fake.in_flight == 0
    assert len(fake.completed) == 3


async def test_wait_for_calls_is_bounded() -> None:
    with pytest.raises(TimeoutError):
        await FakeMeasurer().wait_for_calls(1, within_seconds=0.05)


async def test_progress_is_reported() -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    await FakeMeasurer().measure(request(kernel()), progress)
    assert [s[0] for s in seen] == [0.0, 1.0]


# ---------------------------------------------------------------- compare_kernels around failed measurements

SRC = "__global__ void %s(float* x) { x[threadIdx.x] += 1.0f; }"


async def _service(tmp_path: Any, fake: FakeMeasurer) -> Any:
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store

    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="team", max_measure_seconds=5)
    store = await Store.open(settings.db_path)
    await store.create_ledger("team", 100.0)
    return Service(settings, store, build_forecasters(settings, store), [fake])


def _kernels(*entries: str) -> list[Kernel]:
    return [Kernel(id=e, source=SRC % e, entry=e) for e in entries]


async def _compare(svc: Any, kernels: list[Kernel], **kw: Any) -> Any:
    args: dict[str, Any] = {"measure_if_unsure": True, "max_measurements": 8, **kw}
    return await svc.compare(
        ledger="team", candidates=kernels, workload=Workload(), baseline=None, hardware="A100",
        target_error=None, **args,
    )  # fmt: skip


async def test_a_baseline_that_fails_stops_the_measurements_and_says_why(tmp_path: Any) -> None:
    """Once the baseline is measured as failing, no candidate's pair can be settled: measuring them was paid
    for nothing, and measure_next kept naming the failed baseline."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("base", status="compile_error", message="error: expected ';'")
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "c1", "c2"))
        assert [m.kernel_id for m in res.measurements] == ["base"] and res.gpu_seconds_charged == 0.5
        assert "base" not in res.measure_next
        # The call that found the failure says so (it used to say nothing, and the next call also said that no
        # candidate was unsure).
        assert any("the baseline base was measured compile_error and never ran" in n for n in res.notes)
        again = await _compare(svc, _kernels("base", "c1", "c2"))  # stored failure: nothing is measured
        assert (
            again.measurements == [] and again.gpu_seconds_charged == 0.0 and "base" not in again.measure_next
        )
        assert any("the baseline base was measured compile_error and never ran" in n for n in again.notes)
        assert not any("no candidate's forecast is unsure" in n for n in res.notes + again.notes)
        status = await svc.budget_status("team")
        assert status.forecasts.count == 0  # forecasts against it could never be verified: not kept
        # A candidate that runs is the faster one, by measurement, not a forecast.
        await svc.measure(ledger="team", kernel=_kernels("c1")[0], workload=Workload(), hardware="A100")
        third = {c.id: c for c in (await _compare(svc, _kernels("base", "c1", "c2"))).candidates}
        assert (third["c1"].verdict, third["c1"].decided_by, third["c1"].p_faster) == ("faster", "cache", 1.0)
        assert sum(third["c1"].speedup_bins[4:]) == 1.0 and third["c1"].expected_speedup > 1  # consistent
        assert "the baseline failed (compile_error) and this candidate ran" in third["c1"].rationale
    finally:
        await svc.close()


async def test_a_candidate_that_fails_in_the_call_is_slower_at_once(tmp_path: Any) -> None:
    """Measured in this call and failed: answered "slower, decided by measurement" now, not left as an
    unsure forecast at the head of measure_next until the next call."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("bad", status="launch_error", message="invalid configuration")
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "bad", "good"))
        by_id = {c.id: c for c in res.candidates}
        assert by_id["bad"].verdict == "slower" and by_id["bad"].decided_by == "measurement"
        assert "failed (launch_error)" in by_id["bad"].rationale and "bad" not in res.measure_next
        assert by_id["bad"].p_faster == 0.0 == sum(by_id["bad"].speedup_bins[4:])
    finally:
        await svc.close()


async def test_a_candidate_that_times_out_in_the_call_is_slower_at_once(tmp_path: Any) -> None:
    # A timeout under the server's cap is learned as a failure (the next call says slower): this call says so
    # too, instead of listing the candidate first in measure_next for another full cap.
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("hang", timeout=True)
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "hang", "good"))
        by_id = {c.id: c for c in res.candidates}
        assert (by_id["hang"].verdict, by_id["hang"].decided_by) == ("slower", "measurement")
        assert "hang" not in res.measure_next
        again = {c.id: c for c in (await _compare(svc, _kernels("base", "hang", "good"))).candidates}
        assert again["hang"].verdict == "slower"
    finally:
        await svc.close()


async def test_measurements_cut_short_by_max_measurements_say_what_is_left(tmp_path: Any) -> None:
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "c1", "c2", "c3"), max_measurements=2)
        assert len(res.measurements) == 2
        assert any("measure_if_unsure measured 2 (max_measurements 2); still unsure:" in n for n in res.notes)
    finally:
        await svc.close()


async def test_a_timed_out_or_crashed_baseline_is_not_a_baseline_that_never_runs(tmp_path: Any) -> None:
    """A timeout depends on the cap asked for and a crash on the worker: neither is a final failure. After a
    timed-out probe the baseline is still worth measuring; a crash of the baseline in the call stops the
    measurements with a note, and a crashed candidate stays a forecast (no "slower" verdict from a crash)."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("base", timeout=True)
    svc = await _service(tmp_path, fake)
    try:
        probe = await svc.measure(
            ledger="team", kernel=_kernels("base")[0], workload=Workload(), hardware="A100", max_seconds=0.5
        )
        assert probe.status == "timeout"
        after = await _compare(svc, _kernels("base", "c1"))
        assert after.measure_next[:1] == ["base"] and not any("never ran" in n for n in after.notes)
        fake.script("other", status="worker_crashed", message="the worker was killed by signal SIGSEGV")
        crashed = await _compare(svc, _kernels("other", "c3", "c4"))
        assert [m.kernel_id for m in crashed.measurements] == ["other"]
        assert any("stopped after 1 measurements: other could not be measured" in n for n in crashed.notes)
        fake.script("c5", status="worker_crashed", message="the worker was killed by signal SIGSEGV")
        res = await _compare(svc, _kernels("b2", "c5", "c6"))
        assert "c5" in [m.kernel_id for m in res.measurements]
        assert {c.id: c for c in res.candidates}["c5"].decided_by == "forecast"
    finally:
        await svc.close()


async def test_a_budget_that_cannot_pay_for_the_first_measurement_still_returns_the_forecasts(
    tmp_path: Any,
) -> None:
    """measure_if_unsure on a nearly spent ledger: the compare is answered, free, with a note, instead of a
    tool error that lost the forecasts (the error itself says forecasts are free)."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    svc = await _service(tmp_path, fake)
    await svc.store.create_ledger("tiny", 0.05)
    try:
        res = await svc.compare(
            ledger="tiny", candidates=_kernels("base", "c1", "c2"), workload=Workload(), baseline=None,
            hardware="A100", target_error=None, measure_if_unsure=True, max_measurements=4,
        )  # fmt: skip
        assert res.measurements == [] and res.gpu_seconds_charged == 0.0 and len(res.candidates) == 2
        assert any(n.startswith("measure_if_unsure measured nothing: ledger 'tiny' has") for n in res.notes)
        assert any("Nothing was charged; the forecasts stand" in n for n in res.notes)
    finally:
        await svc.close()


async def test_a_candidate_this_server_cannot_measure_is_left_out_of_measure_next(tmp_path: Any) -> None:
    # measure_if_unsure skips it with a note; listing it in measure_next sent the caller to an error.
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("nope", not_measurable="not in the recording")
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "nope", "good"))
        assert "nope" not in res.measure_next
        assert {m.kernel_id for m in res.measurements} == {"base", "good"}
        assert any("skipped what this server cannot measure as sent: nope" in n for n in res.notes)
    finally:
        await svc.close()


@pytest.mark.parametrize("isolate", [False, True])
async def test_isolated_ledgers_see_only_their_own_measurements(tmp_path: Any, isolate: bool) -> None:
    # An evaluation of several agents on one server: with isolate_ledgers, one agent's measurements neither
    # answer another's for free (cache), nor decide its pairs, nor teach its family model.
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store

    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="a", isolate_ledgers=isolate)
    store = await Store.open(settings.db_path)
    for name in ("a", "b"):
        await store.create_ledger(name, 100.0)
    svc = Service(settings, store, build_forecasters(settings, store), [fake])
    try:
        ks = _kernels("base", "c1")
        for k in ks:
            await svc.measure(ledger="a", kernel=k, workload=Workload(), hardware="A100")
        res = await svc.compare(
            ledger="b", candidates=ks, workload=Workload(), baseline=None, hardware="A100",
            target_error=None, measure_if_unsure=False, max_measurements=0,
        )  # fmt: skip
        again = await svc.measure(ledger="b", kernel=ks[0], workload=Workload(), hardware="A100")
        assert res.candidates[0].decided_by == ("forecast" if isolate else "cache")
        assert again.cost.cached is not isolate and len(fake.history) == (3 if isolate else 2)
        spent = {n: (await svc.budget_status(n)).spent_gpu_seconds for n in ("a", "b")}
        assert spent == {"a": 1.0, "b": 0.5 if isolate else 0.0}
        # Ledger a's own view is unchanged: its measurements answer its pairs.
        own = await svc.compare(
            ledger="a", candidates=ks, workload=Workload(), baseline=None, hardware="A100",
            target_error=None, measure_if_unsure=False, max_measurements=0,
        )  # fmt: skip
        assert own.candidates[0].decided_by == "cache"
    finally:
        await svc.close()


async def test_a_verdict_a_likely_failure_decided_is_stored_in_the_direction_it_took(tmp_path: Any) -> None:
    # A family that mostly fails: against an unmeasured (likely failing) baseline, measured candidates are
    # "faster" though their runtime forecast says slower. Thresholds are certified on stored forecasts: one
    # stored with that p_faster counted as right when the baseline then ran and was faster.
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.01)
    src = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }\n"
    ok = {(16, 1): 8.0, (32, 1): 4.0, (64, 1): 2.0, (128, 1): 1.0}
    svc = await _service(tmp_path, fake)
    try:
        for bs in (16, 32, 64, 128, 256, 512, 1024, 2048):
            for u in (1, 2, 4, 8, 16, 32, 64, 128):
                d = {"BS": bs, "U": u}
                if (bs, u) in ok:
                    fake.script("k", defines=d, runtime_ms=ok[(bs, u)])
                else:
                    fake.script("k", defines=d, status="launch_error", message="too many resources")
                k = Kernel(source=src, entry="k", defines=d)
                await svc.measure(ledger="team", kernel=k, workload=Workload(), hardware="A100")
        base = Kernel(id="base", source=src, entry="k", defines={"BS": 512, "U": 48})
        cands = [
            base,
            *(Kernel(id=f"m{b}", source=src, entry="k", defines={"BS": b, "U": 1}) for b in (16, 32)),
        ]
        res = await _compare(svc, cands, measure_if_unsure=False, max_measurements=0)
        against_runtime = [c for c in res.candidates if c.verdict == "faster" and c.p_faster < 0.5]
        assert against_runtime, [(c.id, c.verdict, c.p_faster) for c in res.candidates]
        fake.script("k", defines={"BS": 512, "U": 48}, runtime_ms=0.5)  # the baseline runs, and is fastest
        await svc.measure(ledger="team", kernel=base, workload=Workload(), hardware="A100")
        stored = [v for v in await svc.store.verified_pairs() if v.forecaster == f"local@{LOCAL_VERSION}"]
        assert stored and all(
            v.verdict == "faster" and v.p_faster > 0.5 and v.actual_speedup < 1 for v in stored
        )
        assert (await svc.budget_status("team")).forecasts.verified_correct == 0
    finally:
        await svc.close()


def _refusing(fake: FakeMeasurer, entry: str) -> None:
    """The backend refuses `entry` as sent, as pycuda does a kernel without a launch (InvalidRequest)."""
    from forecaster_mcp.errors import InvalidRequest

    real = fake.measure

    async def measure(req: Any, *args: Any, **kw: Any) -> Any:
        if req.kernel.entry == entry:
            raise InvalidRequest("kernel.launch is required to run it: give grid and block")
        return await real(req, *args, **kw)

    fake.measure = measure  # type: ignore[method-assign]


async def test_a_candidate_the_backend_refuses_is_skipped_and_the_rest_are_measured(tmp_path: Any) -> None:
    """A kernel sent without a launch (optional for forecasting) that pycuda refuses: it ended the call's
    measurements (the candidates after it never measured), or, refused first, failed the whole call and lost
    its free forecasts. Like a kernel the recordings lack, it is now skipped with a note."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    _refusing(fake, "nolaunch")
    svc = await _service(tmp_path, fake)
    try:
        res = await _compare(svc, _kernels("base", "nolaunch", "c1", "c2"))
        assert sorted(m.kernel_id for m in res.measurements) == ["base", "c1", "c2"]
        assert res.gpu_seconds_charged == pytest.approx(1.5) and "nolaunch" not in res.measure_next
        assert any("nolaunch (kernel.launch is required" in n for n in res.notes), res.notes
        # Refused as the baseline, first: the forecasts stand, with a note; nothing is charged.
        first = await _compare(svc, _kernels("nolaunch", "c3"))
        assert first.measurements == [] and first.gpu_seconds_charged == 0.0 and len(first.candidates) == 1
        assert any("measured nothing: kernel.launch is required" in n for n in first.notes), first.notes
    finally:
        await svc.close()


async def test_a_measurement_charged_but_not_stored_counts_in_the_calls_charge(tmp_path: Any) -> None:
    """The store could not keep a measurement's result (disk full): its device time is charged, and the call's
    gpu_seconds_charged left it out (review: 0.018 said, 1.049 spent)."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    svc = await _service(tmp_path, fake)
    real = svc.store.save_and_commit
    calls = {"n": 0}

    async def flaky(hold: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return await real(hold, **kw)

    svc.store.save_and_commit = flaky
    try:
        res = await _compare(svc, _kernels("base", "c1", "c2"))
        spent = (await svc.budget_status("team")).spent_gpu_seconds
        assert res.gpu_seconds_charged == pytest.approx(spent) == pytest.approx(1.0)
        assert any("ran and was charged" in n for n in res.notes), res.notes
    finally:
        await svc.close()


async def test_an_unsure_copy_of_an_unmeasured_baseline_is_settled_by_measuring_the_baseline(
    tmp_path: Any,
) -> None:
    """The copy was dropped from measure_next as the baseline's duplicate, so the baseline was never listed
    either: the copy stayed unsure, and the note said no candidate's forecast was."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    svc = await _service(tmp_path, fake)
    try:
        base = _kernels("base")[0]
        copy = base.model_copy(update={"id": "copy"})
        res = await _compare(svc, [base, copy])
        # The baseline's measurement answers its copy, which is not measured again (not even as a free hit).
        assert [m.kernel_id for m in res.measurements] == ["base"]
        assert res.gpu_seconds_charged == pytest.approx(0.5)
        assert res.candidates[0].decided_by == "measurement" and res.measure_next == []
        assert not any("no candidate's forecast is unsure" in n for n in res.notes)
    finally:
        await svc.close()


async def test_measure_without_hardware_uses_the_device_compare_forecasts_for(tmp_path: Any) -> None:
    """A server with two devices and --hardware naming the second: compare_kernels forecast (and listed
    measure_next) for the second, and measure_kernel without hardware measured on the first, charged, so the
    listed candidates' pairs stayed unsure. Both now default to the configured device where it is measurable."""
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store

    fake = FakeMeasurer(["A100-PCIE-40GB", "RTX A6000"])
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="team", hardware="A6000")
    store = await Store.open(settings.db_path)
    await store.create_ledger("team", 100.0)
    svc = Service(settings, store, build_forecasters(settings, store), [fake])
    try:
        base, cand = _kernels("base", "cand")
        await svc.measure(ledger="team", kernel=base, workload=Workload())
        await svc.measure(ledger="team", kernel=cand, workload=Workload())
        assert [r.device for r in fake.history] == ["RTX A6000", "RTX A6000"]
        out = await svc.compare(
            ledger="team", candidates=[base, cand], workload=Workload(), baseline=None, hardware=None,
            target_error=None, measure_if_unsure=False, max_measurements=0,
        )  # fmt: skip
        assert out.hardware == "RTX A6000"
        assert out.candidates[0].decided_by == "cache"
    finally:
        await svc.close()


async def test_a_pair_resting_on_a_suspect_measurement_is_not_decided(tmp_path: Any) -> None:
    """A measurement faster than the kernel's memory traffic allows (below_physical_floor: work skipped or
    inputs never read) stays 'ok' with a flag, and compare decided 'faster' on it, in the call that measured it
    and from the store after. Now unsure, saying why and what to do; a clean pair is still decided."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("base", runtime_ms=2.0)
    fake.script("skips", runtime_ms=0.001, flags=("below_physical_floor",))
    fake.script("good", runtime_ms=1.0)
    svc = await _service(tmp_path, fake)
    try:
        for res in (
            await _compare(svc, _kernels("base", "skips", "good")),
            await _compare(svc, _kernels("base", "skips", "good"), measure_if_unsure=False),
        ):
            by_id = {c.id: c for c in res.candidates}
            assert by_id["skips"].decided_by in ("measurement", "cache")
            assert by_id["skips"].verdict == "unsure"
            assert "candidate's measurement is flagged below_physical_floor" in by_id["skips"].rationale
            assert "reference kernel" in by_id["skips"].rationale
            assert by_id["good"].verdict == "faster"
        # The suspect kernel as the baseline: every pair against it is unsure.
        flipped = await _compare(svc, _kernels("skips", "base", "good"), measure_if_unsure=False)
        assert {c.verdict for c in flipped.candidates} == {"unsure"}
        assert all("baseline's measurement is flagged" in c.rationale for c in flipped.candidates)
    finally:
        await svc.close()


async def test_a_suspect_measurement_teaches_the_family_model_nothing(tmp_path: Any) -> None:
    """A tuning configuration that skipped its work measured 0.001 ms, flagged below_physical_floor, where its
    family runs at about 1 ms. The family model learned it as measured, and predicted the unmeasured member
    beside it at 0.004 ms ('candidate measured 0.001 ms; baseline predicted 0.00418 ms', expected speedup 4.2x);
    once that member was measured, the forecast counted as a verified pair (S = 2000). Now the model predicts
    both from the clean members, the rationale says why the measurement is not used, and no forecast is verified
    by it; it is still stored, returned with its flag and charged."""
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    src = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }\n"

    def member(bs: int, kid: str | None = None) -> Kernel:
        return Kernel(id=kid, source=src, entry="k", defines={"BS": bs})

    svc = await _service(tmp_path, fake)
    try:
        for bs in (16, 32, 64, 128, 256):
            fake.script("k", defines={"BS": bs}, runtime_ms=1.0 + bs / 1024)
            await svc.measure(ledger="team", kernel=member(bs), workload=Workload(), hardware="A100")
        fake.script("k", defines={"BS": 512}, runtime_ms=0.001, flags=("below_physical_floor",))
        skipped = await svc.measure(ledger="team", kernel=member(512), workload=Workload(), hardware="A100")
        assert skipped.status == "ok" and "below_physical_floor" in skipped.flags
        assert skipped.cost.gpu_seconds == 0.5 and not skipped.cost.cached
        spent = (await svc.budget_status("team")).spent_gpu_seconds

        res = await _compare(
            svc, [member(1024, "base"), member(512, "skips")], measure_if_unsure=False, max_measurements=0
        )
        [c] = res.candidates
        # Its neighbours run in about 1.1 ms, so does the baseline: the fake point made it 0.004 ms, 4x slower.
        assert 0.7 < c.expected_speedup < 1.4, (c.expected_speedup, c.rationale)
        assert c.verdict == "unsure"
        assert "candidate measured" not in c.rationale and "candidate predicted" in c.rationale
        assert "candidate's measurement is flagged below_physical_floor" in c.rationale
        assert "not learned from" in c.rationale
        assert "skips" not in res.measure_next  # measured already: measuring it again answers the same

        fake.script("k", defines={"BS": 1024}, runtime_ms=2.0)
        await svc.measure(ledger="team", kernel=member(1024), workload=Workload(), hardware="A100")
        status = await svc.budget_status("team")
        assert status.forecasts.verified == 0 and status.calibration.verified_pairs == 0
        assert [v for v in await svc.store.verified_pairs() if v.failure is None] == []
        assert status.spent_gpu_seconds == pytest.approx(spent + 0.5)
    finally:
        await svc.close()


async def test_preload_reads_the_verified_pairs_before_the_first_compare(tmp_path: Any) -> None:
    """A restarted server's first compare_kernels made the engine's full read of every verified pair (6 s on a
    store of 200,000 forecasts); preload, which serve starts in the background, now does it, so the first
    compare reads nothing of them."""
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.store.db import Store

    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.5)
    fake.script("a", runtime_ms=1.0)
    fake.script("b", runtime_ms=2.0)
    svc = await _service(tmp_path, fake)
    try:  # a verified pair: forecast, then both kernels measured
        await _compare(svc, _kernels("a", "b"), measure_if_unsure=False, max_measurements=0)
        for k in _kernels("a", "b"):
            await svc.measure(ledger="team", kernel=k, workload=Workload(), hardware="A100")
        assert await svc.store.verified_pairs()
    finally:
        await svc.close()

    store = await Store.open(svc.settings.db_path)
    again = Service(svc.settings, store, build_forecasters(svc.settings, store), [fake])
    reads: list[str] = []
    for name in ("verified_pairs", "verified_changes"):
        real = getattr(store, name)

        async def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            reads.append(_name)
            return await _real(*args, **kw)

        setattr(store, name, counted)
    try:
        await again.preload()
        assert reads, "preload read no verified pairs"
        reads.clear()
        await _compare(again, _kernels("a", "b"), measure_if_unsure=False, max_measurements=0)
        assert reads == []  # the first compare of this process found them read
    finally:
        await again.close()
