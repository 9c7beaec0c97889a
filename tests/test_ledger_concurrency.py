"""Concurrent callers, several processes and crashed owners never overspend a ledger or leak a hold."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forecaster_mcp.errors import BudgetExhausted
from forecaster_mcp.store.db import MICRO, Reservation, Store

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


async def _create_ledger(path: Path, name: str, gpu_seconds: float) -> None:
    store = await Store.open(path)
    try:
        await store.create_ledger(name, gpu_seconds)
    finally:
        await store.close()


async def _open_and_read(path: Path, name: str) -> tuple[int, int, int]:
    """Open the store (which releases orphans), close it, return the ledger (limit, spent, reserved)."""
    await (await Store.open(path)).close()
    return _ledger_state(path, name)


def _ledger_state(path: Path, name: str) -> tuple[int, int, int]:
    with sqlite3.connect(path) as conn:
        row = conn.execute(
            "SELECT limit_micro, spent_micro, reserved_micro FROM ledgers WHERE name = ?", (name,)
        ).fetchone()
        sums = conn.execute(
            "SELECT sum(limit_delta_micro), sum(spent_delta_micro), sum(reserved_delta_micro) "
            "FROM ledger_events WHERE ledger = ?",
            (name,),
        ).fetchone()
    assert tuple(row) == tuple(sums), "the event log must sum to the ledger row"
    return int(row[0]), int(row[1]), int(row[2])


async def test_300_coroutines_cannot_overspend(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "db.sqlite3")
    await store.create_ledger("small", 50.0)
    try:

        async def grab() -> Reservation | None:
            try:
                return await store.reserve("small", 1.0, "race")
            except BudgetExhausted:
                return None

        holds = await asyncio.gather(*(grab() for _ in range(300)))
        won = [h for h in holds if h is not None]
        assert len(won) == 50
        view = await store.get_ledger("small")
        assert view is not None and view.remaining_gpu_seconds == 0.0

        rng = random.Random(7)
        charges = await asyncio.gather(*(store.commit(h, rng.uniform(-0.2, 1.5)) for h in won))
        assert all(0.0 <= c <= 1.0 for c in charges)
        limit, spent, reserved = _ledger_state(store.path, "small")
        assert (limit, reserved) == (50 * MICRO, 0)
        assert spent == sum(round(c * MICRO) for c in charges)
    finally:
        await store.close()


async def test_a_refusal_for_budget_held_by_measurements_in_progress_says_to_call_again(
    tmp_path: Path,
) -> None:
    # Parallel measurements near the end of a ledger each hold their whole cap: the one refused was told only to
    # lower max_seconds or have the ledger topped up ("0 GPU-seconds left", with 20 merely held), and a search
    # loop that reads a budget refusal as the end stopped with most of those 20 about to come back unused.
    store = await Store.open(tmp_path / "db.sqlite3")
    await store.create_ledger("L", 20.0)
    try:
        held = await store.reserve("L", 20.0, "first")
        with pytest.raises(BudgetExhausted) as refused:
            await store.reserve("L", 20.0, "second")
        assert "20 held by measurements in progress" in str(refused.value)
        assert "call again then" in str(refused.value)
        # A cap above what is unspent is refused again once the hold comes back: not told to call again.
        with pytest.raises(BudgetExhausted) as too_big:
            await store.reserve("L", 25.0, "larger")
        assert "20 held" in str(too_big.value) and "call again" not in str(too_big.value)
        await store.commit(held, 19.5)
        with pytest.raises(BudgetExhausted) as spent:
            await store.reserve("L", 1.0, "third")
        assert "call again" not in str(spent.value)  # nothing held: nothing comes back
    finally:
        await store.close()


async def test_300_coroutines_reserving_and_committing_balance_exactly(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "db.sqlite3")
    await store.create_ledger("small", 20.0)
    rng = random.Random(11)
    plans = [(rng.uniform(0.1, 2.0), rng.uniform(-0.5, 2.5)) for _ in range(300)]
    peak = 0
    try:

        async def cycle(need: float, actual: float) -> tuple[float, bool]:
            nonlocal peak
            try:
                hold = await store.reserve("small", need, "cycle")
            except BudgetExhausted:
                return 0.0, False
            view = await store.get_ledger("small")
            assert view is not None
            peak = max(peak, round((view.spent_gpu_seconds + view.reserved_gpu_seconds) * MICRO))
            if actual < 0:
                await store.release(hold)  # the measurement never ran
                return 0.0, True
            return await store.commit(hold, actual), True

        outcomes = await asyncio.gather(*(cycle(n, a) for n, a in plans))
        limit, spent, reserved = _ledger_state(store.path, "small")
        assert reserved == 0 and spent <= limit and peak <= limit
        assert spent == sum(round(c * MICRO) for c, _ in outcomes)
        assert any(not ok for _, ok in outcomes), "the ledger should have run dry at some point"
    finally:
        await store.close()


async def test_cancelled_callers_leave_no_hold_behind(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    store = await Store.open(path)
    await store.create_ledger("x", 1000.0)
    cancelled_mid_flight = 0
    for yields in range(0, 24, 2):
        tasks = [asyncio.ensure_future(store.reserve("x", 1.0, "cancel me")) for _ in range(5)]
        for _ in range(yields):
            await asyncio.sleep(0)  # a scheduling point, not a wait: lets the reservations get under way
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                cancelled_mid_flight += 1
    await store.close()  # finishes the transactions of cancelled callers and their releases
    assert cancelled_mid_flight > 0
    _, spent, reserved = _ledger_state(path, "x")
    assert (spent, reserved) == (0, 0)
    with sqlite3.connect(path) as conn:
        held = conn.execute("SELECT count(*) FROM reservations WHERE state = 'open'").fetchone()[0]
        released = conn.execute("SELECT count(*) FROM reservations WHERE state = 'released'").fetchone()[0]
    assert held == 0
    assert released > 0, "some cancellations should have landed after a reservation committed"


WORKER = textwrap.dedent(
    """
    import asyncio, json, random, sys
    from pathlib import Path
    from forecaster_mcp.errors import BudgetExhausted
    from forecaster_mcp.store.db import MICRO, Store

    async def main(path, seed, cycles):
        rng = random.Random(seed)
        store = await Store.open(Path(path))
        print("ready", flush=True)
        sys.stdin.readline()  # start together with the other processes
        charged = exhausted = 0
        try:
            for _ in range(cycles):
                try:
                    hold = await store.reserve("shared", rng.uniform(0.2, 2.0), "proc")
                except BudgetExhausted:
                    exhausted += 1
                    continue
                await asyncio.sleep(rng.uniform(0.0, 0.002))  # the measurement runs while the hold is held
                charged += round(await store.commit(hold, rng.uniform(0.0, 2.5)) * MICRO)
        finally:
            await store.close()
        print(json.dumps({"charged": charged, "exhausted": exhausted}))

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="select on pipes is POSIX")
def test_several_processes_on_one_file_never_overspend(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    asyncio.run(_create_ledger(path, "shared", 150.0))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), str(seed), "100"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for seed in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdin is not None
            ready, _, _ = select.select([p.stdout], [], [], 60)
            assert ready and p.stdout.readline().strip() == "ready", "a worker did not start"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            reports.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    limit, spent, reserved = _ledger_state(path, "shared")
    assert reserved == 0 and spent <= limit
    assert spent == sum(r["charged"] for r in reports)  # to the micro-GPU-second
    assert sum(r["exhausted"] for r in reports) > 0, "the processes should have competed for the last seconds"
    with sqlite3.connect(path) as conn:
        owners = [r[0] for r in conn.execute("SELECT owner_pid FROM reservations ORDER BY id")]
    switches = sum(a != b for a, b in itertools.pairwise(owners))
    assert switches >= 10, f"the processes barely interleaved ({switches} owner switches)"


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from forecaster_mcp.store.db import Store

    async def main(path):
        store = await Store.open(Path(path))
        hold = await store.reserve("x", 5.0, "about to crash")
        print(hold.id, flush=True)
        sys.stdin.read()  # block until the test kills us

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and select on pipes are POSIX")
def test_a_killed_owner_leaves_a_hold_the_next_open_releases(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    asyncio.run(_create_ledger(path, "x", 10.0))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the holder process did not reserve in time"
        rid = int(proc.stdout.readline())
        if Path("/proc/self/stat").exists():  # liveness is checkable: an expired hold of a live owner stays
            with sqlite3.connect(path) as conn:
                conn.execute("UPDATE reservations SET expires_at = 0 WHERE id = ?", (rid,))
        _, _, reserved = asyncio.run(_open_and_read(path, "x"))
        assert reserved == 5 * MICRO
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert asyncio.run(_open_and_read(path, "x")) == (10 * MICRO, 0, 0)  # opening released the orphan
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT id, state FROM reservations").fetchall() == [(rid, "orphan_released")]
        kind, detail = conn.execute(
            "SELECT kind, detail FROM ledger_events ORDER BY id DESC LIMIT 1"
        ).fetchone()
    assert kind == "orphan_release" and "is gone" in detail
