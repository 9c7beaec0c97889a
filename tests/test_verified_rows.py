"""VerifiedRows, the columns the engine keeps per forecaster name and updates by the pairs that changed, gives
what a straightforward recomputation from the name's rows gives: the rows, their signatures, the calibration
(ForecastEngine._fit_calibrator on the rows) and the threshold history (_set_regime_history of
one_per_measurement), after every step of a random sequence of pairs verified, re-verified, replaced and
dropped."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from test_engine import _scripted

from forecaster_mcp.forecast.calibration import Calibrator
from forecaster_mcp.forecast.engine import POOLED, ForecastEngine, Outcome, _family_slot
from forecaster_mcp.forecast.verified_rows import VerifiedRows, rows_signature
from forecaster_mcp.store.db import PairGroup, VerifiedPair


def one_per_measurement(rows: list[VerifiedPair]) -> list[VerifiedPair]:
    """The straightforward reference: the newest pair each measurement settled, in the rows' order (oldest
    first); rows with no measurement id kept as they are."""
    newest: dict[int, int] = {}
    for i, v in enumerate(rows):
        if v.verified_by is not None:
            newest[v.verified_by] = i
    return [v for i, v in enumerate(rows) if v.verified_by is None or newest[v.verified_by] == i]


def _pair(rng: random.Random, row_id: int, measurements: int = 8) -> VerifiedPair:
    w = [rng.random() for _ in range(8)]
    probs = [x / sum(w) for x in w]
    p = rng.choice([0.5, sum(probs[4:]), rng.random()])
    return VerifiedPair(
        forecaster="raw:local@0",
        hardware=rng.choice(["A100", "H100"]),
        probs=probs,
        p_faster=p,
        actual_speedup=rng.choice([1.0, 1.01, 0.3, rng.lognormvariate(0, 1)]),  # ties among them
        verdict="unsure",
        created_at=0.0,
        family_key=rng.choice([None, "", "fa", "fb", "fc"]),
        pair=f"w|{row_id}",
        failure=rng.choice([None, None, None, "compile_error"]),
        verified_by=rng.choice([None, *range(measurements)]),  # several rows settled by one measurement
        row_id=row_id,
        max_confidence=rng.choice([None, None, 0.85, 0.3]),
    )


def _history(h: dict[str, Any]) -> dict[str, Any]:
    return {k: (c.tolist(), r.tolist()) for k, (c, r) in h.items()}


@pytest.mark.parametrize("seed", range(12))
def test_columns_match_a_recomputation_from_the_rows(seed: int) -> None:
    rng = random.Random(seed)
    engine = ForecastEngine([_scripted("local")])
    slot = engine._slots[0]
    keep = rng.choice([3, 7, None])  # short windows, so that the newest-rows cut is exercised
    engine._history_keep = lambda: keep  # type: ignore[method-assign]
    table = VerifiedRows(_family_slot)
    current: dict[PairGroup, VerifiedPair] = {}
    ids = iter(rng.sample(range(1, 10_000), 2_000))  # new rows land anywhere in id order, not only at the end
    groups: list[PairGroup] = [("raw:local@0", "A100", "w", f"a{i}", f"b{i}") for i in range(400)]
    measurements = rng.choice([8, 150])
    for step in range(30):
        # The first read brings every pair (and many measurements at once); each later one a few.
        touched = rng.sample(groups, 300 if step == 0 else rng.randrange(1, 12))
        pairs = []
        for g in touched:
            r = rng.random()
            if r < 0.2:
                continue  # no verified pair now (its kernel's latest measurement is flagged)
            same = current.get(g) if r < 0.4 else None  # the same row re-verified, or a newer row
            pairs.append((g, _pair(rng, same.row_id if same and same.row_id else next(ids), measurements)))
        for g in touched:
            current.pop(g, None)
        current.update(pairs)
        table.apply(touched, pairs)

        rows = sorted(current.values(), key=lambda v: v.row_id or 0)
        assert table.rows() == rows
        row_ids, _, _, caps = table.raw_p()
        assert row_ids.tolist() == [v.row_id for v in rows]
        assert caps.tolist() == pytest.approx(
            [math.nan if v.max_confidence is None else v.max_confidence for v in rows], nan_ok=True
        )
        calibration_rows = [v for v in rows if v.failure is None]
        assert table.calibration_signature() == rows_signature(calibration_rows)
        expected = engine._fit_calibrator(
            slot,
            [("local", Outcome(v.hardware, v.actual_speedup, {"local": v.probs})) for v in calibration_rows],
        )
        p_raw, faster, hardware = table.calibration_inputs()
        got = Calibrator.fit(p_raw, faster, hardware, prior=engine._prior[slot])
        assert got.to_dict() == expected.to_dict()

        final = one_per_measurement(rows)
        assert table.history_signature() == rows_signature(final)
        engine._set_regime_history(
            "model", [(v.hardware, v.p_faster, v.actual_speedup, v.family_key) for v in final]
        )
        assert _history(table.history(keep, POOLED)) == _history(engine._history["model"])


def test_a_changed_row_changes_the_signature() -> None:
    """Equal signatures must mean equal fits: a row whose speedup, place or forecast differs signs otherwise."""
    rng = random.Random(1)
    rows = [_pair(rng, i) for i in range(1, 20)]
    base = rows_signature(rows)
    changed = [
        [
            *rows[:5],
            VerifiedPair(**{**rows[5].__dict__, "actual_speedup": rows[5].actual_speedup * 1.0001}),
            *rows[6:],
        ],
        [*rows[:5], VerifiedPair(**{**rows[5].__dict__, "row_id": 99}), *rows[6:]],
        [*rows[:5], VerifiedPair(**{**rows[5].__dict__, "p_faster": 0.123}), *rows[6:]],
        [*rows[:5], VerifiedPair(**{**rows[5].__dict__, "max_confidence": 0.501}), *rows[6:]],
        rows[1:],
    ]
    assert all(rows_signature(c) != base for c in changed)


@pytest.mark.parametrize("seed", range(6))
def test_the_combination_join_of_the_columns_is_the_join_of_the_rows(seed: int) -> None:
    """engine._joined on the columns pairs the rows a straightforward join of the rows pairs: rows of every
    component for the same question (GPU and pair; without a pair, GPU and exact speedup, the k-th row of each
    component with the k-th of the others), in the first component's row order."""
    from forecaster_mcp.forecast.engine import _joined

    rng = random.Random(seed)
    names = ["a", "b", "c"][: rng.choice([2, 3])]
    tables, rows = {}, {}
    for n in names:
        table = VerifiedRows(_family_slot)
        pairs = []
        for row_id in sorted(rng.sample(range(1, 5_000), rng.randrange(0, 300))):
            v = _pair(rng, row_id)
            v = VerifiedPair(
                **{
                    **v.__dict__,
                    "forecaster": n,
                    "failure": None,
                    "pair": rng.choice([None, f"w|{rng.randrange(60)}"]),
                    "actual_speedup": rng.choice([0.5, 2.0, 3.0]),
                }
            )
            if v.pair is not None and any(u.pair == v.pair and u.hardware == v.hardware for u in pairs):
                continue  # a store keeps one row per question and component
            pairs.append(v)
        table.apply([], [((n, str(v.row_id), "", "", ""), v) for v in pairs])
        tables[n], rows[n] = table, pairs
    # The reference: group each component's rows by question, the k-th of each joined.
    groups: dict[tuple[str, Any], dict[str, list[int]]] = {}
    for n in names:
        for v in rows[n]:
            key = (v.hardware, v.pair if v.pair is not None else v.actual_speedup)
            groups.setdefault(key, {}).setdefault(n, []).append(v.row_id or 0)
    expected = sorted(
        tuple(g[n][k] for n in names)
        for g in groups.values()
        if len(g) == len(names)
        for k in range(min(len(ids) for ids in g.values()))
    )
    at = _joined([tables[n].combination_inputs()[0] for n in names])
    ids = [np.array([v.row_id for v in rows[n]], np.int64) for n in names]
    got = [tuple(int(ids[j][at[j][k]]) for j in range(len(names))) for k in range(at[0].size)]
    assert got == expected  # in the first component's row order, which is its row ids'
    assert len(got) >= 2  # and several questions with more than one row of each component, k > 0
