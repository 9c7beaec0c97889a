"""budget_status reads a ledger's verified forecasts through the suspect-kernel set and the report indexes
(migration 11) and reports what the straightforward read reports: each forecast row checked for its own two
latest measurements' flags, the pairs grouped without an index, the charges' median over every row."""

from __future__ import annotations

import random
import sqlite3
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_store import forecast, kernel, save

from forecaster_mcp import bins
from forecaster_mcp.store.db import _LATEST_OK, _PAIR, _SUSPECT, _SUSPECT_KERNELS, Store

pytestmark = pytest.mark.anyio

# The per-row check, the straightforward reference: a verified row rests on no suspect runtime when neither of its
# two kernels' latest ok measurements is flagged (or it was verified by a kernel failing for good).
_ON_TRUSTED_RUNTIMES = (
    "(verified_failure IS NOT NULL OR NOT EXISTS (SELECT 1 FROM measurements AS s WHERE s.id IN "
    f"(({_LATEST_OK.format(col='m.id', key='baseline_key')}), "
    f"({_LATEST_OK.format(col='m.id', key='candidate_key')})) AND {_SUSPECT.format(row='s')}))"
)


def _straightforward(db: Path, ledger: str) -> dict[str, Any]:
    """The report's forecast and calibration figures as budget_status computed them before migration 11."""
    conn = sqlite3.connect(db)
    try:
        verified = conn.execute(
            "SELECT verdict, decided_by, p_faster, actual_speedup FROM forecasts NOT INDEXED WHERE id IN "
            "(SELECT MAX(id) FROM forecasts NOT INDEXED WHERE ledger = ? AND actual_speedup IS NOT NULL "
            f"AND decided_by != 'cache' AND {_ON_TRUSTED_RUNTIMES} GROUP BY {_PAIR}) ORDER BY id",
            (ledger,),
        ).fetchall()
        spared = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM forecasts NOT INDEXED WHERE ledger = ? AND decided_by = 'forecast' "
            f"AND verdict != 'unsure' AND actual_speedup IS NULL GROUP BY {_PAIR})",
            (ledger,),
        ).fetchone()[0]
        costs = [
            c
            for (c,) in conn.execute(
                "SELECT charged_micro FROM measurements NOT INDEXED WHERE ledger = ? AND cached = 0",
                (ledger,),
            )
        ]
    finally:
        conn.close()
    scored = [(v, by, p, float(s)) for v, by, p, s in verified if not bins.is_tie(float(s))]
    checked = [(v, s) for v, by, _, s in scored if by == "forecast" and v != "unsure"]
    correct = sum((v == "faster") == (s > 1.0) for v, s in checked)
    outcomes = [(float(p), 1.0 if s > 1.0 else 0.0) for _, _, p, s in scored]
    typical = statistics.median(costs) if costs else 0
    return {
        "verified": len(checked),
        "verified_correct": correct,
        "verified_pairs": len(outcomes),
        "brier": sum((p - y) ** 2 for p, y in outcomes) / len(outcomes) if outcomes else None,
        "spared_gpu_seconds": spared * typical / 1e6,
    }


async def _scenario(store: Store, check: Callable[[], Awaitable[None]]) -> None:
    """Pairs verified, re-verified, forecast both ways round, resting on a flagged measurement (left out until a
    clean one), verified by a failure, decided by cache, on two ledgers and two GPUs; `check` after each step."""
    rng = random.Random(11)
    for name in ("x", "y"):
        await store.create_ledger(name, 1e6)
    ks = [kernel(BS=i) for i in range(24)]
    rows = []
    for _ in range(150):
        b, c = rng.sample(range(24), 2)
        p = rng.random()
        verdict = "faster" if p > 0.8 else "slower" if p < 0.2 else "unsure"
        rows.append(
            forecast(
                ks[b],
                ks[c],
                p,
                verdict,
                ledger=rng.choice(["x", "y"]),
                hardware=rng.choice(["A100", "H100"]),
                decided_by=rng.choice(["forecast"] * 8 + ["cache", "measurement"]),
                forecaster=rng.choice(["local", "local:unmeasured"]),
            )
        )
    await store.save_forecasts(rows)
    await check()
    for i in range(20):
        for hw in ("A100", "H100"):
            await save(
                store, ks[i], rng.uniform(0.5, 4.0), hardware=hw, ledger=rng.choice(["x", "y"]),
                charged=rng.choice([0.5, 1.0, 2.0]),
            )  # fmt: skip
    await check()
    await save(store, ks[3], 0.001, flags=("below_physical_floor",))  # its A100 pairs left out
    await save(store, ks[5], 0.01, hardware="H100", flags=("events_disagree_with_wall_clock",))
    await check()
    await save(store, ks[20], status="compile_error")  # verified by the failure, also beside ks[3]
    await save(store, ks[21], 1.3, cached=True)
    await store.save_forecasts([forecast(ks[4], ks[3], 0.7, "faster"), forecast(ks[1], ks[2], 0.1, "slower")])
    await check()
    await save(store, ks[3], 1.9)  # measured clean again: its pairs count again
    await check()


async def test_the_report_matches_a_straightforward_read(tmp_path: Path) -> None:
    """After each step of the scenario, budget_status's figures equal the straightforward read's, number for
    number, on both ledgers."""
    db = tmp_path / "state" / "forecaster.sqlite3"
    store = await Store.open(db)

    async def check() -> None:
        for ledger in ("x", "y"):
            report = await store.ledger_report(ledger)
            got = {
                "verified": report["forecasts"]["verified"],
                "verified_correct": report["forecasts"]["verified_correct"],
                "verified_pairs": report["calibration"]["verified_pairs"],
                "brier": report["calibration"]["brier"],
                "spared_gpu_seconds": report["gpu_seconds_saved"]["forecasts"],
            }
            assert got == _straightforward(db, ledger)

    try:
        await _scenario(store, check)
    finally:
        await store.close()


async def test_verified_pairs_match_a_per_row_check(tmp_path: Path) -> None:
    """The verified pairs a first refresh reads (verified_pairs, verified_changes(None)) through the suspect
    kernels are those of the per-row check (_ON_TRUSTED_RUNTIMES), row for row, after each step."""
    db = tmp_path / "state" / "forecaster.sqlite3"
    store = await Store.open(db)

    async def check() -> None:
        conn = sqlite3.connect(db)
        try:
            ids = [
                i
                for (i,) in conn.execute(
                    "SELECT id FROM forecasts WHERE id IN (SELECT MAX(id) FROM forecasts NOT INDEXED WHERE "
                    f"actual_speedup IS NOT NULL AND decided_by != 'cache' AND {_ON_TRUSTED_RUNTIMES} "
                    f"GROUP BY forecaster, {_PAIR}) ORDER BY id"
                )
            ]
        finally:
            conn.close()
        assert [v.row_id for v in await store.verified_pairs()] == ids
        assert [v.row_id for _, v in (await store.verified_changes(None)).pairs] == ids
        assert [v.row_id for v in await store.verified_pairs("local", "A100")] == [
            i
            for i, v in zip(ids, await store.verified_pairs(), strict=True)
            if (v.forecaster, v.hardware) == ("local", "A100")
        ]

    try:
        await _scenario(store, check)
    finally:
        await store.close()


async def test_the_report_reads_its_forecasts_from_the_indexes(tmp_path: Path) -> None:
    """budget_status at 200,000 forecast rows spent most of its 0.47 s finding each row's latest measurements
    and grouping the ledger's rows; now the verified pairs come from one index in pair order (no sort, no row
    looked up) and the suspect kernels from the flagged measurements' index (no result_json read past them)."""
    db = tmp_path / "state" / "forecaster.sqlite3"
    store = await Store.open(db)
    await store.close()
    conn = sqlite3.connect(db)

    def plan(sql: str) -> str:
        return " | ".join(str(r[3]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, ("x",)))

    try:
        pairs = plan(
            "SELECT MAX(id), verdict, decided_by, p_faster, actual_speedup FROM forecasts WHERE ledger = ? "
            f"AND actual_speedup IS NOT NULL AND decided_by != 'cache' GROUP BY {_PAIR}"
        )
        suspect = plan(f"WITH {_SUSPECT_KERNELS} SELECT count(*) FROM suspect WHERE ? IS NOT NULL")
    finally:
        conn.close()
    assert "COVERING INDEX forecasts_ledger_verified" in pairs and "TEMP B-TREE" not in pairs
    assert "measurements_suspect" in suspect
