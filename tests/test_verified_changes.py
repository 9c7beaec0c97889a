"""The engine reads only the verified pairs that changed since its last refresh, and ends up where a full re-read
of the store would have put it: the same pairs, calibrations, combination weights and threshold histories."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from test_engine import _scripted
from test_store import forecast, kernel, save

from forecaster_mcp import bins
from forecaster_mcp.forecast.calibration import with_p_faster
from forecaster_mcp.forecast.engine import OOF_FOLDS, ForecastEngine
from forecaster_mcp.forecast.selective import decision_p
from forecaster_mcp.forecast.verified_rows import spread_id
from forecaster_mcp.models import Kernel
from forecaster_mcp.store.db import ForecastRow, Store, VerifiedPair

pytestmark = pytest.mark.anyio

NAMES = ("local@0", "local@0:unmeasured")


class FullRead:
    """The store as the engine read it before `verified_changes`: every verified pair on every refresh, and no
    persisted state (the reference engine fits from the pairs alone)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def verified_pairs(self, forecaster: str | None = None, hardware: str | None = None) -> list[Any]:
        return await self.store.verified_pairs(forecaster, hardware)

    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None:
        return None

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None:
        return None


class Counting:
    """The store, counting what the engine reads."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.full_reads = 0
        self.changed_pairs: list[int] = []

    async def verified_pairs(self, forecaster: str | None = None, hardware: str | None = None) -> list[Any]:
        self.full_reads += 1
        return await self.store.verified_pairs(forecaster, hardware)

    async def verified_changes(self, since: int | None = None) -> Any:
        changes = await self.store.verified_changes(since)
        if changes.full:
            self.full_reads += 1
        else:
            self.changed_pairs.append(len(changes.pairs))
        return changes

    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None:
        await self.store.save_calibration(forecaster, hardware, state_json)

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None:
        return await self.store.load_calibration(forecaster, hardware)


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    s = await Store.open(tmp_path / "state" / "forecaster.sqlite3")
    await s.create_ledger("x", 1e6)
    yield s
    await s.close()


def rows(base: Kernel, cand: Kernel, p: float, rng: random.Random) -> list[ForecastRow]:
    """A compare's rows of one pair: the engine's final forecast and its component's raw one."""
    name = rng.choice(NAMES)
    final = forecast(
        base, cand, p, "faster" if p > 0.9 else "slower" if p < 0.1 else "unsure", forecaster=name
    )
    raw = forecast(base, cand, min(1.0, max(0.0, p + rng.gauss(0, 0.05))), "unsure", forecaster="raw:" + name)
    # Most with the chances of failing the verdict weighed (the history is scored again out of fold), some
    # without (rows stored before they were kept keep their issued scores).
    fails = {"p_fail": rng.choice([0.0, 0.02, 0.3]), "p_fail_baseline": 0.02} if rng.random() < 0.8 else {}
    return [ForecastRow(**{**final.__dict__, **fails}), ForecastRow(**{**raw.__dict__, "ledger": None})]


def state(engine: ForecastEngine) -> dict[str, Any]:
    return {
        "calibrators": {s: c.to_dict() for s, c in engine._calibrators.items()},
        "fits": engine._fit_signatures,
        "histories": engine._history_signatures,
        "history": {
            r: {k: (c.tolist(), ok.tolist()) for k, (c, ok) in h.items()} for r, h in engine._history.items()
        },
    }


def by_name(pairs: list[VerifiedPair]) -> dict[str, list[VerifiedPair]]:
    out: dict[str, list[VerifiedPair]] = {}
    for v in pairs:
        out.setdefault(v.forecaster, []).append(v)
    return out


async def test_incremental_refresh_reaches_the_state_of_a_full_re_read(store: Store) -> None:
    """After every kind of change a measurement or a forecast makes to the verified pairs (newly verified,
    re-verified at another speedup, left out for a flagged measurement and back, verified by a failure, a pair
    forecast again the other way round), the engine that read only the changes holds the pairs, calibration and
    threshold histories of one that re-read everything, and its threshold is the same."""
    rng = random.Random(3)
    counting = Counting(store)
    engine = ForecastEngine([_scripted("local")], counting, refresh_interval_s=1e9)  # type: ignore[arg-type]
    ks = [kernel(BS=i) for i in range(40)]
    speed = {i: rng.uniform(0.5, 4.0) for i in range(40)}

    async def check() -> None:
        engine.mark_stale()
        await engine.refresh()
        reference = ForecastEngine([_scripted("local")], FullRead(store))  # type: ignore[arg-type]
        await reference.refresh(force=True)
        assert engine._tables is not None
        kept = {n: t.rows() for n, t in engine._tables.items() if len(t)}
        assert kept == by_name(await store.verified_pairs())
        assert state(engine) == state(reference)
        for regime in ("model", "unmeasured"):
            mine = await engine.threshold("A100", 0.1, regime)  # type: ignore[arg-type]
            theirs = await reference.threshold("A100", 0.1, regime)  # type: ignore[arg-type]
            assert (mine.threshold, mine.reason) == (theirs.threshold, theirs.reason)

    await check()  # an empty store
    pairs = [(rng.randrange(40), rng.randrange(40)) for _ in range(120)]
    await store.save_forecasts([r for b, c in pairs if b != c for r in rows(ks[b], ks[c], rng.random(), rng)])
    await check()
    for i in range(30):  # a search measuring its candidates one by one
        await save(store, ks[i], speed[i])
        await check()
    await save(store, ks[3], speed[3] * 1.7)  # re-measured: its pairs re-verified at another speedup
    await check()
    await save(store, ks[4], 0.001, flags=("below_physical_floor",))  # its pairs left out
    await check()
    # Forecast again the other way round once both are measured: the newer row is the pair's.
    await store.save_forecasts(rows(ks[2], ks[1], 0.7, rng) + rows(ks[6], ks[5], 0.2, rng))
    await check()
    await save(store, ks[4], speed[4])  # measured clean again: back
    await check()
    await save(store, ks[30], status="compile_error")  # verified by the failure
    await save(store, ks[31], speed[31], cached=True)  # a cache-hit copy: the pairs' measurement id changes
    await check()
    await save(store, ks[0], 0.01, flags=("events_disagree_with_wall_clock",))
    await check()
    for i in range(32, 40):
        await save(store, ks[i], speed[i])
    await store.save_forecasts([r for i in range(10) for r in rows(ks[i], ks[39 - i], rng.random(), rng)])
    await check()
    assert counting.full_reads == 1  # the first refresh read everything, the rest only what changed
    assert any(not s.startswith("0:") for s in engine._fit_signatures.values())  # something was fitted


async def test_a_refresh_after_one_measurement_reads_only_that_kernels_pairs(store: Store) -> None:
    """A search loop measures once per compare: a refresh after one measurement used to re-read every verified
    pair in the store (0.7 s at 16,000 verified rows, 7 s at 160,000); now it reads the pairs of that kernel."""
    rng = random.Random(5)
    counting = Counting(store)
    engine = ForecastEngine([_scripted("local")], counting, refresh_interval_s=1e9)  # type: ignore[arg-type]
    ks = [kernel(BS=i) for i in range(60)]
    # 59 pairs verified with the baseline, then one pair of a new kernel.
    await store.save_forecasts([r for i in range(1, 60) for r in rows(ks[0], ks[i], rng.random(), rng)])
    for k in ks:
        await save(store, k, rng.uniform(0.5, 2.0))
    await engine.refresh(force=True)
    assert engine._tables is not None
    raw = [engine._tables.get("raw:" + n) for n in NAMES]
    assert counting.full_reads == 1 and sum(len(t) for t in raw if t is not None) == 59
    new = kernel(BS=99)
    await store.save_forecasts(rows(ks[1], new, 0.8, rng))
    await save(store, new, 0.5)
    engine.mark_stale()
    await engine.refresh()
    assert counting.full_reads == 1
    assert counting.changed_pairs == [2]  # the pair's final row and its raw row, nothing else


async def test_thresholds_are_certified_on_the_history_calibrated_out_of_fold(store: Store) -> None:
    """An underconfident forecaster: its raw 0.6 / 0.4 were right 95% of the time, so today's calibration says
    about 0.8 for them. Its verified forecasts were issued at 0.6 (before any calibration), and certifying on
    those confidences chose threshold 0.6, at which today's calibrated forecasts would be decided as confident
    as 0.6, forecasts whose raw answer is nearer a coin flip than any verified. Scored out of fold, the history
    certifies about 0.8, what today's calibration says of it."""
    base = kernel(BS=0)
    await save(store, base, 1.0)
    for i in range(1, 201):
        cand = kernel(BS=i)
        faster = i % 2 == 0
        says_faster = faster != (i % 20 == 1)  # wrong on 10 of 200
        p = 0.6 if says_faster else 0.4
        final = forecast(base, cand, p, "unsure", forecaster="local@0")
        raw = forecast(base, cand, p, "unsure", forecaster="raw:local@0", ledger=None)
        await store.save_forecasts(
            [ForecastRow(**{**final.__dict__, "p_fail": 0.0, "p_fail_baseline": 0.0}), raw]
        )
        await save(store, cand, 0.5 if faster else 2.0)  # settles this pair alone
    engine = ForecastEngine([_scripted("local")], store, refresh_interval_s=1e9)
    choice = await engine.threshold("A100", 0.1)
    today = engine._calibrators["local"].p(0.6, "A100")
    assert today > 0.75
    assert choice.source == "history"
    assert choice.threshold > 0.7, choice  # was 0.6
    assert choice.threshold <= today  # today's 0.6 is still decided
    assert engine._calibrators["local"].p(0.55, "A100") < choice.threshold


async def test_history_scored_out_of_fold_is_each_forecast_as_its_fold_calibration_would_issue_it(
    store: Store,
) -> None:
    """Two components: each verified final forecast is found with its components' raw rows (stored right after
    it), each answer calibrated by its slot's fit without the forecast's fold, pooled by the combination weights,
    its chances of failing weighed as its verdict weighed them, each answer held to the cap it set on its own
    confidence (a cap below 0.5 holds it at 0.5): what the engine's own combine_raw (given the caps, as eval gives
    them) and decision_p give with those fits. A final row stored before its chances of failing were kept keeps
    its issued score."""
    rng = random.Random(11)
    name = "local@0+claude@0"
    base = kernel(BS=0)
    await save(store, base, 1.0)
    made: list[tuple[float, float, float, float, float | None, dict[str, float]]] = []
    for i in range(1, 81):
        cand = kernel(BS=i)
        faster = rng.random() < 0.5
        p_local = min(0.99, max(0.01, (0.6 if faster else 0.4) + rng.gauss(0, 0.15)))
        p_claude = min(0.99, max(0.01, (0.8 if faster else 0.2) + rng.gauss(0, 0.2)))
        p_fail = rng.choice([0.0, 0.02, 0.4]) if i % 10 else None
        issued = rng.random()
        final = forecast(base, cand, issued, "unsure", forecaster=name)
        fails = {} if p_fail is None else {"p_fail": p_fail, "p_fail_baseline": 0.05}
        caps = {
            **({"local": 0.3 if i % 12 == 0 else 0.6} if i % 3 == 0 else {}),
            **({"claude": 0.75} if i % 4 == 0 else {}),
        }
        components = [
            forecast(base, cand, p, "unsure", forecaster=f"raw:{n}@0", ledger=None)
            for n, p in (("local", p_local), ("claude", p_claude))
        ]
        await store.save_forecasts(
            [
                ForecastRow(**{**final.__dict__, **fails}),
                *(
                    dataclasses.replace(row, max_confidence=caps.get(n))
                    for n, row in zip(("local", "claude"), components, strict=True)
                ),
            ]
        )
        measurement = await save(store, cand, 0.5 if faster else 2.0)
        made.append((p_local, p_claude, issued, measurement, p_fail, caps))
    engine = ForecastEngine([_scripted("local"), _scripted("claude")], store, refresh_interval_s=1e9)
    await engine.refresh(force=True)
    expected = []
    held = 0
    for p_local, p_claude, issued, measurement, p_fail, caps in made:
        if p_fail is None:
            d = issued
        else:
            fold = spread_id(int(measurement)) % OOF_FOLDS
            raw = {n: with_p_faster([1 / 8] * 8, p) for n, p in (("local", p_local), ("claude", p_claude))}
            engine_fits = dict(engine._calibrators)
            engine._calibrators.update({n: engine._oof[n][fold] for n in ("local", "claude")})
            p = bins.p_faster(engine.combine_raw(raw, "A100", caps=caps))
            held += p != pytest.approx(bins.p_faster(engine.combine_raw(raw, "A100")), abs=1e-6)
            engine._calibrators = engine_fits
            d = decision_p(p, p_fail, 0.05)
        expected.append(max(d, 1 - d))
    conf, _ = engine._history["model"]["A100"]
    assert len({round(c, 6) for c in conf}) > 40  # scored, not one number
    assert held > 10  # the caps bind
    assert conf == pytest.approx(expected, abs=1e-6)


async def test_forecasts_capped_by_their_forecaster_are_scored_again_no_surer_than_their_cap(
    store: Store,
) -> None:
    """A young family's estimate is capped at 0.85 by the local model (base.MAX_CONFIDENCE), and the engine holds
    its calibrated answer to that cap when it issues it. Scored again under a calibration that sharpens (raw
    0.7 / 0.3, right 99% of the time), the capped forecasts entered the threshold history at about 0.94, a
    confidence they could never be issued at. Their component rows keep the cap (forecasts.max_confidence) and
    the history scores them at it, as eval's combine_raw(..., caps) does; rows without one are scored uncapped."""
    base = kernel(BS=0)
    await save(store, base, 1.0)
    capped: list[bool] = []
    for i in range(1, 201):
        cand = kernel(BS=i)
        faster = i % 2 == 0
        says_faster = faster != (i % 100 == 1)  # wrong on 2 of 200
        p = 0.7 if says_faster else 0.3
        cap = 0.85 if i % 3 == 0 else None
        final = forecast(base, cand, p, "unsure", forecaster="local@0")
        raw = forecast(base, cand, p, "unsure", forecaster="raw:local@0", ledger=None)
        await store.save_forecasts(
            [
                ForecastRow(**{**final.__dict__, "p_fail": 0.0, "p_fail_baseline": 0.0}),
                dataclasses.replace(raw, max_confidence=cap),
            ]
        )
        await save(store, cand, 0.5 if faster else 2.0)  # settles this pair alone
        capped.append(cap is not None)
    engine = ForecastEngine([_scripted("local")], store, refresh_interval_s=1e9)
    await engine.refresh(force=True)
    assert engine._calibrators["local"].p(0.7, "A100") > 0.9  # the calibration sharpens
    conf, _ = engine._history["model"]["A100"]
    held = [c for c, was in zip(conf, capped, strict=True) if was]
    free = [c for c, was in zip(conf, capped, strict=True) if not was]
    assert len(held) == 66
    assert max(held) <= 0.85 + 1e-9, max(held)  # was 0.94
    assert held == pytest.approx([0.85] * len(held))
    assert min(free) > 0.9
