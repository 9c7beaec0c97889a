"""An idempotency key is honoured across server processes sharing one database."""

from __future__ import annotations

import functools
import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Awaitable
from pathlib import Path

import anyio
import pytest

from forecaster_mcp.errors import (
    AgentError,
    AlreadyMeasured,
    InvalidRequest,
    MeasurementInProgress,
    SameMeasurementRunning,
)
from forecaster_mcp.measure.fake import FakeMeasurer
from forecaster_mcp.models import DeviceProvenance, Kernel, Launch, MeasureCost, MeasureResult, Workload
from forecaster_mcp.service import Service, build_forecasters
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import MICRO, KeyClaim, KeyTaken, Store

REPO = Path(__file__).resolve().parents[1]

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


async def _save(
    store: Store, key: str | None, content_key: str, cached: bool, check_key: str | None = None
) -> int:
    return await store.save_measurement(
        check_key=check_key,
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


async def test_a_used_key_is_never_the_id_of_a_result_checked_otherwise(tmp_path: Path) -> None:
    # A save under a used key outside a claim (one taken over from an owner another host could not vouch for,
    # or a server of an earlier version on the same database) must not pass the key's row off as its own.
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)
    try:
        await a.create_ledger("run", 10)
        first = await _save(a, "K", "x", cached=False, check_key="against ref, atol 1e-5")
        assert await _save(b, "K", "x", cached=True, check_key="against ref, atol 1e-5") == first
        with pytest.raises(InvalidRequest, match="another measurement"):
            await _save(b, "K", "x", cached=True, check_key="unchecked")
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


async def test_a_key_is_claimed_once_until_answered(tmp_path: Path) -> None:
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)
    try:
        await a.create_ledger("run", 10)
        claim = await a.claim_key("run", "K", {"kernel": "x"}, 1.0)
        assert isinstance(claim, KeyClaim)
        assert await b.claim_key("run", "K", {"kernel": "y"}, 1.0) == KeyTaken({"kernel": "x"})
        assert isinstance(
            await b.claim_key("run", "K2", {"kernel": "y"}, 1.0), KeyClaim
        )  # other keys are free
        hold = await a.reserve("run", 1.0, "measure x", "K")
        with sqlite3.connect(db) as conn:  # its owner measures on: an expired claim is not taken over ...
            conn.execute("UPDATE idempotency_claims SET expires_at = 0 WHERE idempotency_key = 'K'")
        assert isinstance(await b.claim_key("run", "K", {"kernel": "y"}, 1.0), KeyTaken)
        assert await a.extend_hold(hold)  # ... and the hold, kept alive, keeps the claim alive with it
        with sqlite3.connect(db) as conn:
            assert (
                conn.execute(
                    "SELECT expires_at FROM idempotency_claims WHERE idempotency_key = 'K'"
                ).fetchone()[0]
                > 0
            )
        await _save(a, "K", "x", cached=False)
        await a.commit(hold, 0.5)
        with pytest.raises(
            AlreadyMeasured
        ):  # answered: the claim is gone, the measurement speaks for the key
            await b.claim_key("run", "K", {"kernel": "x"}, 1.0)
        await a.release_claim(claim)  # after the save: nothing left to give up
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT idempotency_key FROM idempotency_claims").fetchall() == [("K2",)]
    finally:
        await a.close()
        await b.close()


# Another server process: claims its key K2, says the claim's id, and holds it until its stdin closes.
CLAIM_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from forecaster_mcp.store.db import Store

    async def main(db):
        store = await Store.open(Path(db))
        claim = await store.claim_key("run", "K2", {"kernel": "z"}, 60.0)
        print(claim.id, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await store.close()

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_giving_up_an_answered_claim_leaves_another_servers_claim_alone(tmp_path: Path) -> None:
    # A claim's row is deleted when its measurement is saved; a claim taken next (here by another server
    # process) may get the same row id (SQLite reuses the largest rowid), and the late give-up of the first
    # request (service: after its save) must not delete it: the key it guards would be free while measured.
    db = tmp_path / "shared.sqlite3"
    a, b = await Store.open(db), await Store.open(db)
    proc: subprocess.Popen[str] | None = None
    try:
        await a.create_ledger("run", 10)
        claim = await a.claim_key("run", "K", {"kernel": "x"}, 1.0)
        assert isinstance(claim, KeyClaim)
        await _save(a, "K", "x", cached=False)  # answered: the save drops the claim
        proc = _start(CLAIM_HOLDER, str(db))
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, proc.stderr and proc.stderr.read()
        assert int(proc.stdout.readline()) == claim.id  # the row id is reused (what makes the case)
        await a.release_claim(claim)  # the first request gives its claim up after its save
        assert await b.claim_key("run", "K2", {"kernel": "y"}, 1.0) == KeyTaken({"kernel": "z"})
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT idempotency_key FROM idempotency_claims").fetchall() == [("K2",)]
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.communicate(timeout=30)
        await a.close()
        await b.close()


# ---------------------------------------------------------------- measure_kernel under one key, two servers

SRC = "__global__ void vadd(const float* a, const float* b, float* c, int n) { c[0] = a[0] + b[0]; }\n"
KERNEL = Kernel(source=SRC, entry="vadd", launch=Launch.model_validate({"grid": [4], "block": [256]}))
REF = Kernel(source=SRC.replace("vadd", "vref"), entry="vref", id="ref")
WORKLOAD = Workload.model_validate(
    {
        "args": [
            {"name": "a", "dtype": "float32", "shape": [1024]},
            {"name": "b", "dtype": "float32", "shape": [1024]},
            {"name": "c", "dtype": "float32", "shape": [1024], "intent": "out"},
            {"name": "n", "dtype": "int32", "value": 1024},
        ]
    }
)


class PausingStore(Store):
    """A server's store that stops at its next cache lookup until told to go on: the point at which a request
    has looked its idempotency key up (and, now, claimed it) and is about to be served or measured."""

    paused: anyio.Event | None = None
    go_on: anyio.Event | None = None

    async def find_measurement(self, cache_key: str) -> MeasureResult | None:
        if self.paused is not None and self.go_on is not None:
            self.paused.set()
            await self.go_on.wait()
        return await super().find_measurement(cache_key)


async def _server(home: Path, measurer: FakeMeasurer, store_type: type[Store] = Store) -> Service:
    """One server process's service, with its own connection to the database under `home`."""
    settings = Settings(home=home, measurer="none")
    store = await store_type.open(settings.db_path)
    await store.ensure_ledger("L", 100.0)
    return Service(settings, store, build_forecasters(settings, store), [measurer])


async def _outcome(call: Awaitable[MeasureResult], into: list[MeasureResult | Exception]) -> None:
    try:
        into.append(await call)
    except (AgentError, InvalidRequest) as exc:
        into.append(exc)


def _spent(db: Path) -> float:
    with sqlite3.connect(db) as conn:
        spent, reserved = conn.execute(
            "SELECT spent_micro, reserved_micro FROM ledgers WHERE name = 'L'"
        ).fetchone()
    assert reserved == 0, "a hold was left open"
    return spent / MICRO


async def test_one_key_is_never_answered_with_two_differently_checked_results(tmp_path: Path) -> None:
    home = tmp_path / "home"
    a = await _server(home, FakeMeasurer(gpu_seconds=0.5))
    b = await _server(home, FakeMeasurer(gpu_seconds=0.5), PausingStore)
    assert isinstance(b.store, PausingStore)
    try:
        # An unchecked measurement of the kernel is in the cache: b can answer the unchecked request free.
        await a.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD)
        b.store.paused, b.store.go_on = anyio.Event(), anyio.Event()
        unchecked: list[MeasureResult | Exception] = []
        checked: list[MeasureResult | Exception] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, b.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD,
                                                  idempotency_key="step-1"), unchecked)  # fmt: skip
                await b.store.paused.wait()  # b has looked the key up and is about to answer from its cache
                # Meanwhile a measures the same kernel under the same key, checked against a reference.
                await _outcome(
                    a.measure(
                        ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF, idempotency_key="step-1"
                    ),
                    checked,
                )
                b.store.go_on.set()
        outcomes = unchecked + checked
        answers = [o for o in outcomes if isinstance(o, MeasureResult)]
        refused = [o for o in outcomes if not isinstance(o, MeasureResult)]
        # Before, both were answered: the key meant a result checked against the reference to one caller and an
        # unchecked one to the other (b's free answer took the id of a's paid row).
        assert len(answers) == 1 and len(refused) == 1, outcomes
        assert isinstance(refused[0], InvalidRequest) and "a new key" in str(refused[0])
        # Every later retry of the key gets that one answer, or the same refusal.
        again = await a.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, idempotency_key="step-1")
        assert again.correctness.checked == answers[0].correctness.checked is False
        assert again.measurement_id == answers[0].measurement_id
        with pytest.raises(InvalidRequest, match="reference"):
            await b.measure(
                ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF, idempotency_key="step-1"
            )
        assert _spent(a.settings.db_path) == pytest.approx(0.5)  # the first, unkeyed measurement only
    finally:
        await a.close()
        await b.close()


async def test_a_retry_at_another_server_waits_for_the_first_and_is_not_charged(tmp_path: Path) -> None:
    home = tmp_path / "home"
    fa, fb = FakeMeasurer(gpu_seconds=0.5), FakeMeasurer(gpu_seconds=0.5)
    running = anyio.Event()
    fa.script("vadd", block_until=running)
    a, b = await _server(home, fa), await _server(home, fb)
    try:
        first: list[MeasureResult | Exception] = []
        retry: list[MeasureResult | Exception] = []
        waiting = anyio.Event()

        async def told(done: float, total: float | None, message: str | None) -> None:
            waiting.set()

        async def retry_at_b() -> None:
            await _outcome(b.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF,
                                     idempotency_key="step-1", progress=told), retry)  # fmt: skip
            waiting.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, a.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF,
                                                  idempotency_key="step-1"), first)  # fmt: skip
                await fa.wait_for_calls(1)  # a holds the device for the key
                tg.start_soon(retry_at_b)  # the client's retry reaches the other server
                await waiting.wait()
                running.set()
        (mine,) = first
        (theirs,) = retry
        # Before, the retry was refused ("still running; call again") instead of waiting for the answer.
        assert isinstance(mine, MeasureResult) and isinstance(theirs, MeasureResult), (mine, theirs)
        assert theirs.measurement_id == mine.measurement_id and theirs.runtime_ms == mine.runtime_ms
        assert theirs.correctness.checked and theirs.cost.cached and theirs.cost.gpu_seconds == 0
        assert not fb.history  # b measured nothing
        assert _spent(a.settings.db_path) == pytest.approx(0.5) == mine.cost.gpu_seconds
    finally:
        await a.close()
        await b.close()


async def test_a_key_in_use_for_another_check_is_refused_at_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    fa, fb = FakeMeasurer(gpu_seconds=0.5), FakeMeasurer(gpu_seconds=0.5)
    running = anyio.Event()
    fa.script("vadd", block_until=running)
    a, b = await _server(home, fa), await _server(home, fb)
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(a.measure, ledger="L", kernel=KERNEL, workload=WORKLOAD,
                                                reference=REF, idempotency_key="step-1"))  # fmt: skip
                await fa.wait_for_calls(1)
                # Before: "still running; call again with the same key", and the call again was then refused.
                with pytest.raises(InvalidRequest, match=r"atol/rtol.*a new key"):
                    await b.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF, atol=0.1,
                                    idempotency_key="step-1")  # fmt: skip
                running.set()
        assert not fb.history and _spent(a.settings.db_path) == pytest.approx(0.5)
    finally:
        await a.close()
        await b.close()


# A server process measuring under a key until it is killed.
CLAIMANT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    import anyio
    from forecaster_mcp.measure.fake import FakeMeasurer
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store
    from test_store_idempotency import KERNEL, REF, WORKLOAD

    async def main(home):
        settings = Settings(home=Path(home), measurer="none")
        store = await Store.open(settings.db_path)
        fake = FakeMeasurer(gpu_seconds=0.5)
        fake.script("vadd", block_until=anyio.Event())  # never set
        svc = Service(settings, store, build_forecasters(settings, store), [fake])
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: svc.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF,
                                              idempotency_key="step-1"))
            await fake.wait_for_calls(1)
            print("measuring", flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(REPO), str(REPO / "tests"))))
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and select on pipes are POSIX")
async def test_a_key_claimed_by_a_killed_server_is_measured_by_the_next(tmp_path: Path) -> None:
    home = tmp_path / "home"
    fb = FakeMeasurer(gpu_seconds=0.5)
    b = await _server(home, fb)
    proc = _start(CLAIMANT, str(home))
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "measuring", proc.stderr and proc.stderr.read()
        # The other process is alive and measuring: another request under its key is refused at once ...
        with pytest.raises(InvalidRequest, match=r"reference.*a new key"):
            await b.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, idempotency_key="step-1")
        # ... and the same one waits for it; when that process dies mid-measurement, the key is not blocked:
        # the waiting request measures it itself, and is the only one charged.
        waiting = anyio.Event()

        async def told(done: float, total: float | None, message: str | None) -> None:
            waiting.set()

        result: list[MeasureResult | Exception] = []
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, b.measure(ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF,
                                                  idempotency_key="step-1", progress=told), result)  # fmt: skip
                await waiting.wait()
                proc.send_signal(signal.SIGKILL)
                await anyio.to_thread.run_sync(functools.partial(proc.wait, timeout=30))
        (measured,) = result
        assert isinstance(measured, MeasureResult), measured
        assert measured.correctness.checked and not measured.cost.cached and len(fb.history) == 1
        assert _spent(b.settings.db_path) == pytest.approx(0.5)
        again = await b.measure(
            ledger="L", kernel=KERNEL, workload=WORKLOAD, reference=REF, idempotency_key="step-1"
        )
        assert again.measurement_id == measured.measurement_id and again.cost.gpu_seconds == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        await b.close()
