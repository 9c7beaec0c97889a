"""The forecast engine with scripted forecasters and an in-memory calibration store."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import pytest

from forecaster_mcp import bins
from forecaster_mcp.forecast.base import MAX_CONFIDENCE, BinForecast, PairQuery, ScriptedForecaster
from forecaster_mcp.forecast.calibration import logit, sigmoid, with_p_faster
from forecaster_mcp.forecast.engine import EngineForecast, ForecastEngine, Outcome, raw_name
from forecaster_mcp.forecast.selective import ThresholdChoice
from forecaster_mcp.models import Kernel, Workload
from forecaster_mcp.store.db import FAILED_CANDIDATE_SPEEDUP, Store, VerifiedPair

SRC = "__global__ void k(float* x) { x[threadIdx.x] = 0; }"


def _query(i: int = 0, hardware: str = "A100") -> PairQuery:
    base = Kernel(id="base", source=SRC, entry="k", defines={"V": 0})
    cand = Kernel(id=f"c{i}", source=SRC, entry="k", defines={"V": i + 1})
    return PairQuery(base, cand, Workload(), hardware, None)


def _scripted(name: str, default: Sequence[float] | None = None) -> ScriptedForecaster:
    f = ScriptedForecaster(default)
    f.name = name
    return f


class FakeStore:
    """In-memory CalibrationStore; counts calls so tests can see what the hot path touches."""

    def __init__(self) -> None:
        self.pairs: list[VerifiedPair] = []
        self.states: dict[tuple[str, str], str] = {}
        self.reads = 0
        self.saves: list[tuple[str, str]] = []
        self.fail = False

    def add(
        self,
        forecaster: str,
        hardware: str,
        probs: Sequence[float],
        speedup: float,
        family: str | None = None,
        failure: str | None = None,
        verified_by: int | None = None,
    ) -> None:
        p = list(bins.normalize(probs))
        self.pairs.append(
            VerifiedPair(
                forecaster,
                hardware,
                p,
                bins.p_faster(p),
                speedup,
                "unsure",
                float(len(self.pairs)),
                family,
                failure=failure,
                verified_by=verified_by,
            )
        )

    async def verified_pairs(
        self, forecaster: str | None = None, hardware: str | None = None
    ) -> list[VerifiedPair]:
        self.reads += 1
        if self.fail:
            raise OSError("database is locked")
        return [
            v
            for v in self.pairs
            if (forecaster is None or v.forecaster == forecaster)
            and (hardware is None or v.hardware == hardware)
        ]

    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None:
        self.saves.append((forecaster, hardware))
        self.states[(forecaster, hardware)] = state_json

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None:
        return self.states.get((forecaster, hardware))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _bins_with(p: float) -> list[float]:
    return with_p_faster(bins.from_normal(0.0, 1.0), p)


def test_info_names_the_combination() -> None:
    engine = ForecastEngine([_scripted("local"), _scripted("claude")])
    info = engine.info()
    assert info.name == "local+claude"
    assert info.components == ["local@0", "claude@0"]
    assert engine.row_names() == [
        "local@0+claude@0",
        "local@0+claude@0:unmeasured",
        "local@0+claude@0:prior",
        "raw:local@0",
        "raw:local@0:unmeasured",
        "raw:local@0:prior",
        "raw:claude@0",
        "raw:claude@0:unmeasured",
        "raw:claude@0:prior",
    ]
    assert ForecastEngine([_scripted("local")]).info().name == "local"
    with pytest.raises(ValueError):
        ForecastEngine([_scripted("x"), _scripted("x")])


@pytest.mark.anyio
async def test_two_forecasters_are_pooled_without_history() -> None:
    a, b = _scripted("a"), _scripted("b")
    a.enqueue(BinForecast(_bins_with(0.8), "a thinks faster", {"mu_log2": 0.4, "sd_log2": 0.3}))
    b.enqueue(BinForecast(_bins_with(0.6), "b leans faster"))
    engine = ForecastEngine([a, b], None)
    [f] = await engine.forecast([_query()])
    assert isinstance(f, EngineForecast)
    # Equal log-odds weights: logit p = (logit 0.8 + logit 0.6) / 2.
    expected = float(sigmoid((logit(0.8) + logit(0.6)) / 2))
    assert f.p_faster == pytest.approx(expected)
    assert f.confidence == pytest.approx(max(expected, 1 - expected))
    assert sum(f.probs) == pytest.approx(1.0) and len(f.probs) == 8
    assert f.expected_speedup == pytest.approx(bins.expected_speedup(f.probs))
    assert set(f.per_forecaster) == {"raw:a@0", "raw:b@0"}
    assert bins.p_faster(f.per_forecaster["raw:a@0"]) == pytest.approx(0.8)
    # Per component only: a's own mu/sd would rank measure_next on a alone (the final bins stand instead).
    assert "mu_log2" not in f.extras and f.extras["a.mu_log2"] == 0.4 and f.extras["a.sd_log2"] == 0.3
    assert "a: a thinks faster" in f.rationale and "b: b leans faster" in f.rationale
    assert f.notes == []
    assert a.history[0].candidate.id == "c0" and len(b.history) == 1


@pytest.mark.anyio
async def test_expected_speedup_uses_each_forecasters_bin_means() -> None:
    a, b = _scripted("a"), _scripted("b")
    probs, centers = bins.normal_bins(0.05, 0.05)
    a.enqueue(*[BinForecast(probs, "a: 3.5% faster", {"mu_log2": 0.05}, centers)] * 2)
    b.enqueue(BinForecast(probs, "b: the same bins, no distribution behind them"))
    [f] = await ForecastEngine([a], None).forecast([_query()])
    assert f.expected_speedup == pytest.approx(2**0.05)
    # Pooled with a forecaster that has only bins: each bin's value is the mass-weighted mix of the two.
    [g] = await ForecastEngine([a, b], None).forecast([_query()])
    mixed = [(c + d) / 2 for c, d in zip(centers, bins.CENTERS_LOG2, strict=True)]
    assert g.expected_speedup == pytest.approx(bins.expected_speedup(g.probs, mixed))
    # Neither has one: the fixed bin centres.
    [h] = await ForecastEngine([_scripted("c", probs)], None).forecast([_query()])
    assert h.expected_speedup == pytest.approx(bins.expected_speedup(h.probs))


class Broken:
    name = "broken"
    version = "1"

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        raise RuntimeError("model server unreachable")


class Short:
    name = "short"
    version = "1"

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        return []


class Hangs:
    name = "hangs"
    version = "1"
    remote = True  # a network API: the engine's timeout applies

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        await anyio.Event().wait()  # never set: only the engine's timeout ends this
        return []


@pytest.mark.anyio
async def test_a_failing_forecaster_is_skipped_with_a_note() -> None:
    good = _scripted("local", _bins_with(0.9))
    engine = ForecastEngine([good, Broken(), Short()], None)
    out = await engine.forecast([_query(0), _query(1)])
    assert len(out) == 2
    for f in out:
        assert f.p_faster == pytest.approx(0.9)  # the one answer, passed through
        assert set(f.per_forecaster) == {"raw:local@0"}
        assert any("broken skipped: RuntimeError: model server unreachable" in n for n in f.notes)
        assert any("short skipped" in n for n in f.notes)


@pytest.mark.anyio
async def test_all_forecasters_failing_gives_an_undecidable_forecast() -> None:
    engine = ForecastEngine([Broken()], None)
    [f] = await engine.forecast([_query()])
    assert f.p_faster == 0.5 and f.confidence == 0.5
    assert f.per_forecaster == {} and "no forecaster answered" in f.rationale
    assert await engine.forecast([]) == []


@pytest.mark.anyio
async def test_a_hanging_forecaster_times_out() -> None:
    engine = ForecastEngine([_scripted("local", _bins_with(0.7)), Hangs()], None, timeout_s=0.2)
    with anyio.fail_after(10):
        [f] = await engine.forecast([_query()])
    assert f.p_faster == pytest.approx(0.7)
    assert any("hangs skipped: TimeoutError" in n for n in f.notes)


def _overconfident_history(
    store: FakeStore, name: str, n: int, rng: np.random.Generator, hw: str = "A100"
) -> None:
    """`name` says 0.95 or 0.05 but is right only 70% of the time."""
    for _ in range(n):
        faster = bool(rng.random() < 0.5)
        says_faster = faster if rng.random() < 0.7 else not faster
        store.add(raw_name(name), hw, _bins_with(0.95 if says_faster else 0.05), 2.0 if faster else 0.5)


@pytest.mark.anyio
async def test_calibration_is_fitted_from_the_store_and_persisted() -> None:
    store = FakeStore()
    _overconfident_history(store, "local@0", 400, np.random.default_rng(0))
    engine = ForecastEngine([_scripted("local", _bins_with(0.95))], store)
    [f] = await engine.forecast([_query()])
    assert 0.6 < f.p_faster < 0.8  # pulled from 0.95 towards the observed 70%
    assert bins.p_faster(f.raw["local"]) == pytest.approx(0.95)
    assert ("local@0", "*") in store.saves
    state = json.loads(store.states[("local@0", "*")])
    assert state["rows"].startswith("400:") and state["calibrator"]["kind"] == "platt"

    # A fresh engine (server restart) starts from the saved state and does not refit: counts unchanged.
    store.saves.clear()
    again = ForecastEngine([_scripted("local", _bins_with(0.95))], store)
    [g] = await again.forecast([_query()])
    assert g.p_faster == pytest.approx(f.p_faster)
    assert store.saves == []


@pytest.mark.anyio
async def test_another_claude_model_starts_from_the_defaults_not_the_last_models_calibration() -> None:
    """Calibration, combination and threshold history are learned per component name *and version* (for
    Claude, the model): switching the model in the settings must not apply what one model's verified forecasts
    taught to another's answers, nor let one model's record certify a threshold for the next."""
    store = FakeStore()
    rng = np.random.default_rng(7)
    _overconfident_history(store, "claude@model-a", 400, rng)  # claims 0.95, right 70% of the time
    for i in range(300):  # final forecasts at 0.9 right 99%: certify a threshold below the default
        store.add("claude@model-a", "A100", _bins_with(0.9), 0.5 if i % 100 == 0 else 2.0)

    def claude(model: str) -> ScriptedForecaster:
        f = _scripted("claude", _bins_with(0.95))
        f.version = model
        return f

    old = ForecastEngine([claude("model-a")], store)
    [f] = await old.forecast([_query()])
    assert 0.6 < f.p_faster < 0.8  # its own history pulls it towards the observed 70%
    assert (await old.threshold("A100", 0.1)).source == "history"
    assert old.final_name(f) == "claude@model-a" and list(f.per_forecaster) == ["raw:claude@model-a"]

    new = ForecastEngine([claude("model-b")], store)
    [g] = await new.forecast([_query()])
    assert g.p_faster == pytest.approx(0.95)  # no verified pair of model-b yet: its answer as it is
    assert (await new.threshold("A100", 0.1)).source == "default"
    assert new.final_name(g) == "claude@model-b" and list(g.per_forecaster) == ["raw:claude@model-b"]
    assert ("claude@model-a", "*") in store.states and ("claude@model-b", "*") in store.states
    assert new.info().name == old.info().name == "claude"  # what the agent sees names the component


@pytest.mark.anyio
async def test_static_prior_answers_are_calibrated_and_decided_apart_from_model_answers() -> None:
    """A family model's verified history says nothing about the static prior's answers (two different
    kernels): it must neither recalibrate them nor lower the threshold they are decided at."""
    store = FakeStore()
    rng = np.random.default_rng(3)
    _overconfident_history(store, "local@0", 400, rng)  # model answers: 0.95 claimed, 70% right
    for i in range(300):  # final forecasts at 0.9, right 99%: certifies 0.9
        store.add("local@0", "A100", _bins_with(0.9), 0.5 if i % 100 == 0 else 2.0)
    local = _scripted("local")
    local.enqueue(
        BinForecast(_bins_with(0.95), "family model"),
        BinForecast(_bins_with(0.95), "static prior", {"prior": 1.0}),
    )
    engine = ForecastEngine([local], store)
    model, prior = await engine.forecast([_query(0), _query(1)])
    assert 0.6 < model.p_faster < 0.8  # recalibrated on the model's verified answers
    assert prior.p_faster == pytest.approx(0.95)  # its own slot has no history: left as it is
    assert prior.regime == "prior" and model.regime == "model"
    assert list(model.per_forecaster) == ["raw:local@0"]
    assert list(prior.per_forecaster) == ["raw:local@0:prior"]
    choice = await engine.threshold("A100", 0.1)
    assert choice.source == "history" and choice.threshold == pytest.approx(0.9)
    prior_choice = await engine.threshold("A100", 0.1, "prior")
    assert prior_choice.source == "default" and prior_choice.threshold == pytest.approx(0.95)
    assert "static prior" in prior_choice.reason
    assert engine.final_name(model) == "local@0" and engine.final_name(prior) == "local@0:prior"

    # The prior's own verified answers calibrate its slot (persisted apart).
    _overconfident_history(store, "local@0:prior", 400, rng)
    engine.mark_stale()
    local.enqueue(BinForecast(_bins_with(0.95), "static prior", {"prior": 1.0}))
    [again] = await engine.forecast([_query(2)])
    assert 0.6 < again.p_faster < 0.8
    assert json.loads(store.states[("local@0:prior", "*")])["rows"].startswith("400:")
    assert json.loads(store.states[("local@0", "*")])["rows"].startswith("400:")
    # ... and the prior's own verified final forecasts certify its threshold.
    for i in range(300):
        store.add("local@0:prior", "A100", _bins_with(0.85), 0.5 if i % 100 == 0 else 2.0)
    engine.mark_stale()
    assert (await engine.threshold("A100", 0.1, "prior")).threshold == pytest.approx(0.85)
    assert (await engine.threshold("A100", 0.1)).threshold == pytest.approx(0.9)

    # With a second forecaster the pair is still outside any family model: its threshold is the prior's.
    other = _scripted("claude", _bins_with(0.9))
    local.enqueue(BinForecast(_bins_with(0.95), "static prior", {"prior": 1.0}))
    both = ForecastEngine([local, other])
    [mixed] = await both.forecast([_query(3)])
    assert mixed.regime == "prior" and both.final_name(mixed) == "local@0+claude@0:prior"
    assert set(mixed.per_forecaster) == {"raw:local@0:prior", "raw:claude@0"}

    # Evaluation: in-memory fits route each outcome to its answer's slot.
    fresh = ForecastEngine([_scripted("local")])
    fresh.fit([prior.outcome("A100", 2.0 if i % 10 else 0.5) for i in range(200)])
    assert bins.p_faster(fresh.combine_raw(prior.raw, "A100", prior.slots)) > 0.9  # 90% right: kept sharp
    assert bins.p_faster(fresh.combine_raw(model.raw, "A100", model.slots)) == pytest.approx(0.95)


@pytest.mark.anyio
async def test_an_answer_capped_by_its_forecaster_stays_capped_and_decides_nothing_alone() -> None:
    """The local model caps its estimate from a young family's 1-3 configurations at 85% and says it decides no
    verdict alone (base.MAX_CONFIDENCE). Calibrated on the static prior's verified answers (underconfident: they
    say 70% and are right 99% of the time), it came out 0.99 sure; and the threshold the prior's history
    certified (0.8) decided it even where it stayed at 0.85."""
    store = FakeStore()
    rng = np.random.default_rng(11)
    for i in range(400):
        faster = bool(rng.random() < 0.5)
        says = faster if i % 100 else not faster
        store.add("raw:local@0:prior", "A100", _bins_with(0.7 if says else 0.3), 2.0 if faster else 0.5)
    for i in range(300):
        store.add("local@0:prior", "A100", _bins_with(0.8), 0.5 if i % 100 == 0 else 2.0)
    capped = {"prior": 1.0, MAX_CONFIDENCE: 0.85}
    local = _scripted("local")
    local.enqueue(
        BinForecast(_bins_with(0.85), "static prior", {"prior": 1.0}),
        BinForecast(_bins_with(0.85), "estimated from 2 configurations", capped),
        BinForecast(_bins_with(0.15), "estimated from 2 configurations", capped),
    )
    engine = ForecastEngine([local], store)
    plain, sure, unsure_slower = await engine.forecast([_query(0), _query(1), _query(2)])
    assert plain.p_faster > 0.97  # the prior's calibration sharpens its own answers
    assert sure.p_faster == pytest.approx(0.85) and unsure_slower.p_faster == pytest.approx(0.15)
    assert sure.capped and not plain.capped and sure.caps == {"local": 0.85}
    certified = await engine.threshold("A100", 0.1, "prior")
    assert certified.source == "history" and certified.threshold == pytest.approx(0.8)
    assert plain.verdict(engine.threshold_for(plain, certified).threshold) == "faster"
    held = engine.threshold_for(sure, certified)
    assert held.threshold == pytest.approx(0.95) and "capped" in held.reason
    assert sure.verdict(held.threshold) == "unsure"
    # A caller who accepts 30% wrong gets the regime's default for that target (0.85): decided.
    loose = engine.threshold_for(sure, await engine.threshold("A100", 0.3, "prior"))
    assert sure.verdict(loose.threshold) == "faster"
    # Evaluation scores a capped history forecast as the server issued it.
    assert bins.p_faster(engine.combine_raw(sure.raw, "A100", sure.slots, sure.caps)) == pytest.approx(0.85)
    assert bins.p_faster(engine.combine_raw(sure.raw, "A100", sure.slots)) > 0.97

    # Another component that answers uncapped is the combination's to weigh: the forecast is not capped.
    local.enqueue(BinForecast(_bins_with(0.85), "estimated from 2 configurations", capped))
    both = ForecastEngine([local, _scripted("claude", _bins_with(0.95))], store)
    [mixed] = await both.forecast([_query(3)])
    assert not mixed.capped and bins.p_faster(mixed.calibrated["local"]) == pytest.approx(0.85)


def test_a_cap_below_one_half_never_flips_an_answer() -> None:
    """A forecaster's cap of 0.3 read as [0.7, 0.3] turned a 0.9 "faster" into 0.3 "slower"."""
    from forecaster_mcp.forecast.engine import _capped

    assert bins.p_faster(_capped(_bins_with(0.9), 0.3)) == pytest.approx(0.5)
    assert bins.p_faster(_capped(_bins_with(0.9), None)) == pytest.approx(0.9)


UNMEASURED = {"measured": 0.0, "baseline_measured": 0.0}


@pytest.mark.anyio
async def test_pairs_of_two_unmeasured_kernels_are_calibrated_and_decided_apart() -> None:
    """Verified history is mostly forecasts against a measured baseline (the search case); a threshold it
    certifies does not hold for pairs whose runtimes are both predictions, which err more."""
    store = FakeStore()
    for i in range(300):  # final forecasts against a measured kernel at 0.9, right 99%: certifies 0.9
        store.add("local@0", "A100", _bins_with(0.9), 0.5 if i % 100 == 0 else 2.0)
    local = _scripted("local")
    local.enqueue(
        BinForecast(_bins_with(0.92), "vs measured", {"measured": 0.0, "baseline_measured": 1.0}),
        BinForecast(_bins_with(0.92), "both predicted", UNMEASURED),
        BinForecast(_bins_with(0.92), "both measured", {"measured": 1.0, "baseline_measured": 1.0}),
    )
    engine = ForecastEngine([local], store)
    vs, both, measured = await engine.forecast([_query(0), _query(1), _query(2)])
    assert (vs.regime, both.regime, measured.regime) == ("model", "unmeasured", "model")
    assert list(both.per_forecaster) == ["raw:local@0:unmeasured"]
    assert engine.final_name(both) == "local@0:unmeasured"
    assert "local@0:unmeasured" in engine.row_names() and "raw:local@0:unmeasured" in engine.row_names()
    assert (await engine.threshold("A100", 0.1)).threshold == pytest.approx(0.9)
    unmeasured = await engine.threshold("A100", 0.1, "unmeasured")
    assert unmeasured.source == "default" and unmeasured.threshold == pytest.approx(0.975)  # 1 - target / 4
    assert "neither kernel measured" in unmeasured.reason
    # Its own verified final forecasts certify its own threshold; its raw rows calibrate its own slot.
    for i in range(300):
        store.add("local@0:unmeasured", "A100", _bins_with(0.97), 0.5 if i % 100 == 0 else 2.0)
    _overconfident_history(store, "local@0:unmeasured", 400, np.random.default_rng(5))
    engine.mark_stale()
    assert (await engine.threshold("A100", 0.1, "unmeasured")).threshold == pytest.approx(0.97)
    assert (await engine.threshold("A100", 0.1)).threshold == pytest.approx(0.9)
    local.enqueue(
        BinForecast(_bins_with(0.95), "both predicted", UNMEASURED), BinForecast(_bins_with(0.95), "vs")
    )
    again, model = await engine.forecast([_query(3), _query(4)])
    assert 0.6 < again.p_faster < 0.8 and model.p_faster == pytest.approx(0.95)
    # A static-prior answer beside an unmeasured one: the pair is as uncertain as its least modelled part.
    other = _scripted("claude", _bins_with(0.9))
    local.enqueue(BinForecast(_bins_with(0.6), "static prior", {"prior": 1.0, **UNMEASURED}))
    [mixed] = await ForecastEngine([local, other]).forecast([_query(5)])
    assert mixed.regime == "prior" and set(mixed.per_forecaster) == {"raw:local@0:prior", "raw:claude@0"}
    local.enqueue(BinForecast(_bins_with(0.6), "both predicted", UNMEASURED))
    [pair] = await ForecastEngine([local, other]).forecast([_query(6)])
    assert pair.regime == "unmeasured"
    assert set(pair.per_forecaster) == {"raw:local@0:unmeasured", "raw:claude@0"}


@pytest.mark.anyio
async def test_a_family_with_enough_history_of_its_own_is_thresholded_on_it() -> None:
    """History pooled over kernel families certifies a threshold that a rougher family errs above."""
    store = FakeStore()
    for i in range(600):  # a smooth family: right 99% at 0.7
        store.add("local@0", "A100", _bins_with(0.7), 0.5 if i % 100 == 0 else 2.0, "smooth")
    for i in range(100):  # a rough one: right 80% at 0.7, 99% at 0.95
        store.add("local@0", "A100", _bins_with(0.7), 0.5 if i % 5 == 0 else 2.0, "rough")
        store.add("local@0", "A100", _bins_with(0.95), 0.5 if i % 100 == 0 else 2.0, "rough")
    engine = ForecastEngine([_scripted("local")], store)
    gpu = await engine.threshold("A100", 0.1)
    assert gpu.threshold == pytest.approx(0.7)  # 800 pairs at 0.7, 26 wrong
    rough = await engine.threshold("A100", 0.1, "model", "rough")
    assert rough.threshold == pytest.approx(0.95) and "this kernel family" in rough.reason
    assert (await engine.threshold("A100", 0.1, "model", "smooth")).threshold == pytest.approx(0.7)
    # A family with too little history of its own, or none known, gets the GPU's.
    store.add("local@0", "A100", _bins_with(0.7), 0.5, "new")
    engine.mark_stale()
    assert (await engine.threshold("A100", 0.1, "model", "new")).threshold == pytest.approx(0.7)
    assert (await engine.threshold("A100", 0.1, "model", None)).threshold == pytest.approx(0.7)
    # The same in memory (evaluation).
    fresh = ForecastEngine([_scripted("local")])
    fresh.set_history(
        ["A100"] * len(store.pairs),
        [v.p_faster for v in store.pairs],
        [v.actual_speedup for v in store.pairs],
        families=[v.family_key for v in store.pairs],
    )
    assert (await fresh.threshold("A100", 0.1, "model", "rough")).threshold == pytest.approx(0.95)
    with pytest.raises(ValueError):
        fresh.set_history(["A100"], [0.7], [2.0], families=[])


@pytest.mark.anyio
async def test_combination_weights_follow_the_better_forecaster() -> None:
    store = FakeStore()
    rng = np.random.default_rng(1)
    for i in range(600):
        faster = bool(rng.random() < 0.5)
        speedup = (2.0 + i * 1e-4) if faster else 1 / (2.0 + i * 1e-4)  # distinct: rows join on it
        good = 0.9 if faster else 0.1  # always right
        noise = 0.9 if rng.random() < 0.5 else 0.1  # a coin
        store.add("raw:good@0", "A100", _bins_with(good), speedup)
        store.add("raw:noise@0", "A100", _bins_with(noise), speedup)
    good_f, noise_f = _scripted("good", _bins_with(0.9)), _scripted("noise", _bins_with(0.1))
    engine = ForecastEngine([good_f, noise_f], store)
    [f] = await engine.forecast([_query()])
    assert f.p_faster > 0.9  # the good one wins the disagreement
    state = json.loads(store.states[("good@0+noise@0", "*")])
    w_good, w_noise = state["combiner"]["weights"]
    # The coin calibrates to p ~ 0.5 (log-odds ~ 0), so only the good one's weight is identifiable.
    assert w_good > 0.8 and w_noise >= 0.0
    assert {k: v.split(":")[0] for k, v in state["rows"].items()} == {"good": "600", "noise": "600"}


@pytest.mark.anyio
async def test_threshold_default_then_certified_then_cached() -> None:
    store = FakeStore()
    clock = Clock()
    engine = ForecastEngine([_scripted("local")], store, clock=clock, refresh_interval_s=5.0)
    first = await engine.threshold("A100", 0.1)
    assert first.source == "default" and first.threshold == pytest.approx(0.95)
    assert "local on A100" in first.reason

    # 300 verified final forecasts at confidence 0.9, right 99% of the time.
    for i in range(300):
        store.add("local@0", "A100", _bins_with(0.9), 0.5 if i % 100 == 0 else 2.0)
    assert (await engine.threshold("A100", 0.1)).source == "default"  # cached until stale or expired
    engine.mark_stale()
    second = await engine.threshold("A100", 0.1)
    assert second.source == "history"
    assert second.threshold == pytest.approx(0.9, abs=1e-9)
    assert second.error_ucb is not None and second.error_ucb <= 0.1

    # Hot path: no store read while fresh, and cheap.
    reads = store.reads
    start = time.perf_counter()
    for _ in range(1000):
        await engine.threshold("A100", 0.1)
    per_call_ms = (time.perf_counter() - start) * 1000 / 1000
    assert store.reads == reads
    assert per_call_ms < 1.0

    # After the interval a refresh re-reads the counts; nothing changed, nothing refitted or saved.
    saves = len(store.saves)
    clock.now += 6.0
    await engine.threshold("A100", 0.1)
    assert store.reads > reads and len(store.saves) == saves


@pytest.mark.anyio
async def test_pairs_one_measurement_settled_certify_a_threshold_as_one_trial() -> None:
    """A search forecasts one candidate against each best-so-far, and its measurement then settles every such
    pair at once. 40 measurements, each settling 5 right pairs at 0.96, are 40 trials, not 200: too few to
    test a threshold at target 0.05 (118 are needed); counted as 200 they certified 0.96."""
    store = FakeStore()
    for m in range(40):
        for _ in range(5):
            store.add("local@0", "A100", _bins_with(0.96), 2.0, verified_by=m)
    engine = ForecastEngine([_scripted("local")], store)
    choice = await engine.threshold("A100", 0.05)
    assert choice.source == "default" and choice.n_history == 40, choice.reason
    for m in range(40, 140):
        store.add("local@0", "A100", _bins_with(0.96), 2.0, verified_by=m)
    engine.mark_stale()
    choice = await engine.threshold("A100", 0.05)
    assert choice.source == "history" and choice.n_history == 140, choice.reason
    assert choice.threshold < 0.975  # below the default: certified on the 140 trials


@pytest.mark.anyio
async def test_pairs_verified_by_a_failure_score_verdicts_but_calibrate_nothing() -> None:
    """ "faster" said of candidates that then failed to compile were wrong verdicts: they count against the
    threshold. They say nothing of the forecaster's chance of being faster when both run: no calibration."""
    store = FakeStore()
    for _ in range(300):
        store.add("raw:local@0", "A100", _bins_with(0.95), FAILED_CANDIDATE_SPEEDUP, failure="candidate")
        store.add("local@0", "A100", _bins_with(0.97), FAILED_CANDIDATE_SPEEDUP, failure="candidate")
    engine = ForecastEngine([_scripted("local", _bins_with(0.95))], store)
    [f] = await engine.forecast([_query()])
    assert f.p_faster == pytest.approx(0.95)  # uncalibrated: no pair of both running was verified
    choice = await engine.threshold("A100", 0.1)
    assert choice.source == "never", choice.reason  # every decided verdict of its history was wrong


@pytest.mark.anyio
async def test_a_small_target_error_is_certified_on_as_much_history_as_it_needs() -> None:
    """target_error 0.001 needs 5,990 verified pairs before a threshold is tested; certified on the newest
    2,000 only, it could never be, and its verdicts stayed at the uncertified default for good."""
    from forecaster_mcp.forecast.engine import HISTORY_WINDOW
    from forecaster_mcp.forecast.selective import default_min_history

    need = default_min_history(0.001, 0.05)
    assert need > HISTORY_WINDOW
    store = FakeStore()
    for _ in range(need + 10):  # confident and never wrong
        store.add("local@0", "A100", _bins_with(0.999), 2.0)
    engine = ForecastEngine([_scripted("local")], store)
    choice = await engine.threshold("A100", 0.001)
    assert choice.source == "history" and choice.n_history == need, choice.reason  # the newest `need`
    assert choice.error_ucb is not None and choice.error_ucb <= 0.001
    assert (await engine.threshold("A100", 0.1)).n_history == HISTORY_WINDOW  # the usual window otherwise


@pytest.mark.anyio
async def test_a_measurement_landing_during_a_refresh_is_read_on_the_next_call() -> None:
    """mark_stale() while a refresh is reading the store: that read may have missed the new pairs, so the
    engine stays stale. It was cleared at the end of the refresh, and the new pairs waited for the interval."""

    class SlowStore(FakeStore):
        gate: anyio.Event | None = None

        async def verified_pairs(
            self, forecaster: str | None = None, hardware: str | None = None
        ) -> list[VerifiedPair]:
            rows = await super().verified_pairs(forecaster, hardware)
            if self.gate is not None:
                await self.gate.wait()
            return rows

    store = SlowStore()
    clock = Clock()  # frozen: only mark_stale can trigger a re-read
    engine = ForecastEngine([_scripted("local")], store, clock=clock, refresh_interval_s=5.0)
    assert (await engine.threshold("A100", 0.1)).source == "default"
    store.gate = anyio.Event()
    engine.mark_stale()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.refresh)
        await anyio.wait_all_tasks_blocked()  # the refresh has read (no pairs yet) and waits on the gate
        for _ in range(200):  # confidently wrong, verified by a measurement that lands now
            store.add("local@0", "A100", _bins_with(0.99), 0.5)
        engine.mark_stale()
        store.gate.set()
    store.gate = None
    choice = await engine.threshold("A100", 0.1)
    assert choice.source == "never" and choice.n_history == 200, choice.reason


@pytest.mark.anyio
async def test_threshold_falls_back_to_history_pooled_over_gpus() -> None:
    store = FakeStore()
    for i in range(300):
        store.add("local@0", "A100", _bins_with(0.1), 2.0 if i % 100 == 0 else 0.5)
    engine = ForecastEngine([_scripted("local")], store)
    choice = await engine.threshold("H100", 0.1)
    assert choice.source == "history" and "pooled over GPUs" in choice.reason
    assert choice.threshold == pytest.approx(0.9, abs=1e-9)


@pytest.mark.anyio
async def test_a_store_failure_never_breaks_a_forecast() -> None:
    store = FakeStore()
    store.fail = True
    engine = ForecastEngine([_scripted("local", _bins_with(0.8))], store)
    [f] = await engine.forecast([_query()])
    assert f.p_faster == pytest.approx(0.8)
    assert (await engine.threshold("A100", 0.1)).source == "default"
    with pytest.raises(OSError):
        await engine.refresh(force=True)


@pytest.mark.anyio
async def test_unreadable_saved_state_is_refitted() -> None:
    store = FakeStore()
    store.states[("local@0", "*")] = "{not json"
    _overconfident_history(store, "local@0", 200, np.random.default_rng(2))
    engine = ForecastEngine([_scripted("local", _bins_with(0.95))], store)
    [f] = await engine.forecast([_query()])
    assert f.p_faster < 0.85
    assert json.loads(store.states[("local@0", "*")])["rows"].startswith("200:")


@pytest.mark.anyio
async def test_in_memory_fit_and_history_for_evaluation() -> None:
    rng = np.random.default_rng(3)
    outcomes = []
    for _ in range(500):
        faster = bool(rng.random() < 0.5)
        right = rng.random() < 0.7
        p = 0.95 if faster == right else 0.05
        outcomes.append(Outcome("A100", 2.0 if faster else 0.5, {"local": _bins_with(p)}))
    engine = ForecastEngine([_scripted("local", _bins_with(0.95))], None)
    engine.fit(outcomes)
    final = engine.combine_raw({"local": _bins_with(0.95)}, "A100")
    assert 0.6 < bins.p_faster(final) < 0.8
    engine.set_history(["A100"] * 100, [0.99] * 100, [2.0] * 100)
    choice = await engine.threshold("A100", 0.1)
    assert choice.source == "history" and choice.threshold == pytest.approx(0.99)
    assert math.isclose(choice.n_history, 100)


@pytest.mark.anyio
async def test_a_compare_does_not_wait_on_a_hanging_forecaster(tmp_path: Path) -> None:
    """The service's engine has the forecast_timeout_s setting: a hanging Claude API is skipped with a note
    in the answer and the local forecaster's forecast is used."""
    from forecaster_mcp.models import Kernel, Workload
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store

    settings = Settings.from_env(home=tmp_path, measurer="none", forecast_timeout_s=0.3)
    store = await Store.open(settings.db_path)
    service = Service(settings, store, [*build_forecasters(settings, store), Hangs()], [])
    src = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }\n"
    kernels = [Kernel(id=f"b{b}", source=src, entry="k", defines={"B": b}) for b in (64, 256)]
    try:
        with anyio.fail_after(20):
            res = await service.compare(
                ledger=None, candidates=kernels, workload=Workload(), baseline=None, hardware="A100",
                target_error=None, measure_if_unsure=False, max_measurements=0,
            )  # fmt: skip
        assert any(
            "hangs skipped: TimeoutError: no answer within 0.3 s (forecast_timeout_s)" in n for n in res.notes
        )
        assert res.candidates[0].rationale.startswith("local:")
        # Who forecasts (both) and who answered this call (the local forecaster alone).
        assert res.forecaster.name == "local+hangs" and len(res.forecaster.components) == 2
        assert res.forecaster.answered == [res.forecaster.components[0]]
    finally:
        await service.close()


def test_combination_rows_are_joined_by_the_question_they_answered() -> None:
    from forecaster_mcp.forecast.engine import _family_slot, _joined
    from forecaster_mcp.forecast.verified_rows import VerifiedRows

    def table(*rows: tuple[str | None, float, float]) -> VerifiedRows:
        """A component's verified rows, each (its question or None, p_faster, measured speedup)."""
        t = VerifiedRows(_family_slot)
        pairs = [
            VerifiedPair("raw:x@0", "A100", _bins_with(p), p, s, "unsure", 0.0, None, pair, row_id=i)
            for i, (pair, p, s) in enumerate(rows)
        ]
        t.apply([], [(("raw:x@0", str(v.row_id), "", "", ""), v) for v in pairs])
        return t

    def joined(*tables: VerifiedRows) -> list[list[float]]:
        inputs = [t.combination_inputs() for t in tables]
        at = _joined([q for q, *_ in inputs])
        return [
            [round(float(inp[1][a[k]]), 6) for inp, a in zip(inputs, at, strict=True)]
            for k in range(at[0].size)
        ]

    # Two pairs with the same measured speedup (quantised replay runtimes): only the one both answered joins,
    # with its own answers, never the local model's answer to the other pair.
    local = table(("w|a|b", 0.7, 2.0), ("w|c|d", 0.2, 2.0))
    claude = table(("w|c|d", 0.4, 2.0))
    assert joined(local, claude) == [[0.2, 0.4]]
    # Rows without the question (an evaluation's) join by the measured speedup, the k-th of each with the k-th.
    local = table((None, 0.1, 2.0), (None, 0.2, 3.0), (None, 0.3, 2.0), (None, 0.35, 2.0))
    claude = table((None, 0.6, 2.0), (None, 0.7, 2.0), (None, 0.8, 5.0))
    assert joined(local, claude) == [[0.1, 0.6], [0.3, 0.7]]


def test_a_remeasured_baseline_refits_the_calibration_now_and_after_a_restart(tmp_path: Path) -> None:
    """Re-measuring a kernel re-verifies every stored forecast on it with the new runtime: the outcomes change
    while their number stays. The fit must follow the rows, not their count, in the engine and in its saved
    state (a restarted server trusted a saved fit of the same count)."""
    import dataclasses

    from test_store import forecast, kernel, save

    from forecaster_mcp.store.db import Store

    def engine(store: Store) -> ForecastEngine:
        return ForecastEngine([_scripted("local", _bins_with(0.8))], store, refresh_interval_s=0)

    async def scenario() -> tuple[float, float, float]:
        store = await Store.open(tmp_path / "db.sqlite3")
        try:
            await store.create_ledger("x", 1e6)  # test_store.save charges ledger "x"
            base = kernel(BS=0)
            rows = []
            for i in range(1, 41):
                c = kernel(BS=i)
                r = forecast(base, c, 0.8, "unsure", forecaster="raw:local@0")
                rows += [r, dataclasses.replace(r, forecaster="local@0")]
                await save(store, c, 1.0)
            await store.save_forecasts(rows)
            await save(store, base, 2.0)  # every candidate 2x faster
            running = engine(store)
            (before,) = await running.forecast([_query()])
            await save(store, base, 0.5)  # the baseline re-measured: every candidate 2x slower
            running.mark_stale()
            (after,) = await running.forecast([_query()])
        finally:
            await store.close()
        store = await Store.open(tmp_path / "db.sqlite3")
        try:
            (restarted,) = await engine(store).forecast([_query()])
        finally:
            await store.close()
        return before.p_faster, after.p_faster, restarted.p_faster

    before, after, restarted = anyio.run(scenario)
    assert before > 0.8 and after < 0.5
    assert restarted == pytest.approx(after)


def test_an_uncalibrated_claude_answer_of_surely_faster_cannot_decide_alone() -> None:
    """Before any verified pair, Claude's stated confidence counts with its calibration_slope: one answer of
    "surely faster" (which a kernel's comments can talk it into) beside a local forecaster at 50/50 stayed
    above the 0.95 threshold and decided a verdict. Local confidence still decides with Claude agreeing."""
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    def combined(local_p: float, claude_p: float, slope: float) -> EngineForecast:
        claude = _scripted("claude", _bins_with(claude_p))
        claude.calibration_slope = slope  # type: ignore[attr-defined]
        engine = ForecastEngine([_scripted("local", _bins_with(local_p)), claude])
        (out,) = anyio.run(engine.forecast, [_query()])
        return out

    slope = ClaudeForecaster.calibration_slope
    assert 0 < slope < 1
    assert combined(0.5, 0.9999, 1.0).verdict(0.95) == "faster"  # the identity: Claude alone decides
    tempered = combined(0.5, 0.9999, slope)
    assert tempered.verdict(0.95) == "unsure" and 0.5 < tempered.p_faster < 0.95
    assert combined(0.995, 0.9999, slope).verdict(0.95) == "faster"
    assert combined(0.995, 0.0001, slope).verdict(0.95) == "unsure"  # a disagreeing Claude still vetoes


def test_measure_next_ranks_on_the_combined_forecast_when_several_components_answer() -> None:
    """The local model's mu/sd stand for the forecast only when it answered alone: beside Claude, ranking on
    them ignored Claude and the combination (acquisition.expected_improvement reads them first)."""
    from forecaster_mcp.forecast.acquisition import AcqItem, expected_improvement

    def answer(*names: str) -> EngineForecast:
        local = _scripted("local")
        local.enqueue(BinForecast(_bins_with(0.3), "local", {"mu_log2": -0.5, "sd_log2": 1.0, "p_fail": 0.1}))
        others = [_scripted(n, _bins_with(0.95)) for n in names]
        (out,) = anyio.run(ForecastEngine([local, *others]).forecast, [_query()])
        return out

    alone, both = answer(), answer("claude")
    assert alone.extras["mu_log2"] == -0.5 and alone.extras["p_fail"] == 0.1
    assert "mu_log2" not in both.extras and both.extras["p_fail"] == 0.1
    assert both.extras["local.mu_log2"] == -0.5  # still shown per component
    combined = expected_improvement(AcqItem("c0", both.probs, both.extras, both.p_faster))
    assert combined > expected_improvement(AcqItem("c0", alone.probs, alone.extras, alone.p_faster))


def test_forecasts_issued_under_an_early_overconfident_calibration_do_not_lock_verdicts_out() -> None:
    """80 final forecasts at 0.999 that were right 70% of the time (issued before calibration had data)
    failed the first threshold of the fixed sequence for good: nothing was ever decided again, however many
    well-calibrated forecasts followed. Thresholds are certified on the newest HISTORY_WINDOW ones."""
    from forecaster_mcp.forecast.engine import HISTORY_WINDOW

    rng = np.random.default_rng(0)
    store = FakeStore()
    for _ in range(80):
        store.add("local@0", "H100", _bins_with(0.999), 1.5 if rng.random() < 0.7 else 0.6)

    async def threshold() -> tuple[float, str]:
        choice = await ForecastEngine([_scripted("local")], store).threshold("H100", 0.1)
        return choice.threshold, choice.source

    assert anyio.run(threshold) == (1.0, "never")  # refuted, rightly, while those are all there is
    for _ in range(HISTORY_WINDOW):  # then calibrated ones: right with probability equal to their confidence
        c = rng.uniform(0.6, 0.95)
        store.add("local@0", "H100", _bins_with(c), 1.5 if rng.random() < c else 0.6)
    value, source = anyio.run(threshold)
    assert source in ("history", "default") and value <= 0.95  # deciding again


@pytest.mark.anyio
async def test_an_answer_from_two_measurements_is_not_calibrated_or_combined() -> None:
    """When the local model answers from both kernels' stored measurements, a calibration fitted on its
    forecasts (here: overconfident ones, pulled to 70%) does not soften it, and another component's guess is
    not mixed in."""
    store = FakeStore()
    _overconfident_history(store, "local@0", 400, np.random.default_rng(0))
    local, claude = _scripted("local", _bins_with(0.95)), _scripted("claude", _bins_with(0.1))
    measured = {"measured": 1.0, "baseline_measured": 1.0, "mu_log2": 1.0, "sd_log2": 0.05}
    local.enqueue(BinForecast(_bins_with(0.999), "both measured: 1 ms vs baseline 2 ms", measured))
    engine = ForecastEngine([local, claude], store)
    [m, f] = await engine.forecast([_query(0), _query(1)])
    assert m.p_faster == pytest.approx(0.999) and m.extras["mu_log2"] == 1.0
    assert list(m.calibrated) == ["local"]
    assert f.p_faster < 0.8  # a forecast is still calibrated and combined


@pytest.mark.anyio
async def test_a_gpus_own_record_refutes_a_threshold_pooled_over_gpus() -> None:
    """H100 has too few pairs to choose its own threshold, and half of them wrong (its "faster" verdicts on
    candidates that then failed, which calibration rightly leaves out): the threshold other GPUs' history
    certified was used anyway, and H100 kept deciding "faster" at 0.988."""
    store = FakeStore()
    for i in range(1000):
        for name in ("raw:local@0", "local@0"):
            store.add(name, "A100", _bins_with(0.97), 2.0 if i % 33 else 0.5)
    for i in range(50):
        for name in ("raw:local@0", "local@0"):
            if i % 2:
                store.add(name, "H100", _bins_with(0.97), 2.0)
            else:
                store.add(name, "H100", _bins_with(0.97), FAILED_CANDIDATE_SPEEDUP, failure="candidate")
    engine = ForecastEngine([_scripted("local", _bins_with(0.97))], store)
    h100 = await engine.threshold("H100", 0.1)
    assert h100.source == "never" and "on H100 erred on 25 of 50" in h100.reason
    [f] = await engine.forecast([_query(hardware="H100")])
    assert f.verdict(h100.threshold) == "unsure"
    a100 = await engine.threshold("A100", 0.1)
    assert a100.source == "history" and a100.threshold < 1.0  # its own record certifies its own


@pytest.mark.anyio
async def test_a_forecast_a_component_did_not_answer_is_not_the_combinations() -> None:
    """With Claude down, the local-only forecast was stored (and thresholded) as the combination's: its
    outcome then certified the combination's threshold, and the combination's history decided it."""

    class Down:
        name, version, remote = "claude", "m1", True

        async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast | None]:
            raise ConnectionError("API unreachable")

    engine = ForecastEngine([_scripted("local", _bins_with(0.97)), Down()], None)  # type: ignore[list-item]
    [partial] = await engine.forecast([_query()])
    assert partial.partial and list(partial.raw) == ["local"]
    assert engine.final_name(partial) == "local@0"  # not "local@0+claude@m1"
    certified = ThresholdChoice(0.9, 500, 0.05, "certified", "history", 400, 0.1, 0.05)
    assert engine.threshold_for(partial, certified).threshold == pytest.approx(0.95)  # its regime's default
    whole = ForecastEngine(
        [_scripted("local", _bins_with(0.97)), _scripted("claude", _bins_with(0.97))], None
    )
    [both] = await whole.forecast([_query()])
    assert not both.partial and whole.final_name(both) == "local@0+claude@0"
    assert whole.threshold_for(both, certified) == certified


@pytest.mark.anyio
async def test_a_stricter_target_never_decides_what_a_looser_one_leaves_unsure() -> None:
    """100 verified pairs: at 0.96 wrong 12 of 60, at 0.99 right 40 of 40. target_error 0.1 (58 pairs to test)
    finds its default 0.95 erring 12% and decides nothing; 0.05 (118 needed) kept its default 0.975 and said
    'faster' of a forecast at 0.98."""
    engine = ForecastEngine([_scripted("local")])
    p = [0.96] * 60 + [0.99] * 40
    speedups = [0.5] * 12 + [2.0] * 88
    engine.set_history(["A100"] * 100, p, speedups)
    forecast = EngineForecast(
        probs=_bins_with(0.98), p_faster=0.98, confidence=0.98, expected_speedup=1.5, rationale=""
    )
    loose = await engine.threshold("A100", 0.1)
    assert loose.source == "never" and forecast.verdict(loose.threshold) == "unsure"
    for target in (0.05, 0.02, 0.001):
        strict = await engine.threshold("A100", target)
        assert strict.threshold >= loose.threshold and forecast.verdict(strict.threshold) == "unsure", target
        assert strict.target_error == target and "a stricter target decides no more" in strict.reason
    # Where the looser target decides lower, the stricter one keeps its own choice (here its default).
    engine.set_history(["A100"] * 100, list(np.linspace(0.9, 0.99, 100)), [2.0] * 100)
    assert (await engine.threshold("A100", 0.1)).threshold == pytest.approx(0.9)
    kept = await engine.threshold("A100", 0.05)
    assert kept.threshold == pytest.approx(0.975) and "stricter" not in kept.reason
    assert forecast.verdict(kept.threshold) == "faster"


@pytest.mark.anyio
async def test_the_thresholds_of_many_families_are_chosen_on_the_gpus_history_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compare of kernels of 100 families asks a threshold for each; fecf24f chose each looser target's too,
    and chose on the GPU's history again for every family without enough history of its own: 7 choices per
    family, 1 s of the event loop for 100 families at target 0.05 (0.1 s before). A family's own short
    history still refutes the GPU's choice for that family alone."""
    from forecaster_mcp.forecast import engine as engine_module

    rng = np.random.default_rng(0)
    p = list(rng.uniform(0.9, 1.0, 1500))
    families: list[str | None] = [None] * 1500
    # One rough family: 10 verified pairs, all wrong at 0.92 (too few to choose on, enough to refute).
    p += [0.92] * 10
    families += ["rough"] * 10
    speedups = [2.0] * 1500 + [0.5] * 10
    engine = ForecastEngine([_scripted("local")])
    engine.set_history(["A100"] * 1510, p, speedups, families=families)
    calls = 0
    choose = engine_module.choose_threshold

    def counted(*args: object, **kwargs: object) -> ThresholdChoice:
        nonlocal calls
        calls += 1
        return choose(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "choose_threshold", counted)
    gpu = await engine.threshold("A100", 0.05)
    assert gpu.source == "history"
    for i in range(100):
        assert await engine.threshold("A100", 0.05, family=f"family{i}") == gpu
    rough = await engine.threshold("A100", 0.05, family="rough")
    assert rough.source == "never" and "this kernel family erred on 10 of 10" in rough.reason
    assert calls == 4  # 0.05, then the looser 0.1, 0.2 and 0.3: once each


class SparseNoisyClaude:
    """Verified history of two components on four GPUs: "local", informative and verified on 120 pairs per GPU,
    and "claude", whose answers carry little information, biased differently on each GPU, verified on 12 of
    them (asked about some of a search's pairs). Deterministic."""

    GPUS = ("A100", "H100", "L4", "V100")
    PAIRS, ASKED = 120, 12

    def __init__(self, seed: int = 7, local_cap: float | None = None) -> None:
        self.local_cap = local_cap  # the cap local's answers set (base.MAX_CONFIDENCE), if any
        self.rng = np.random.default_rng(seed)
        self.scale = dict(zip(self.GPUS, self.rng.uniform(0.7, 1.3, len(self.GPUS)), strict=True))
        self.bias = dict(zip(self.GPUS, self.rng.normal(0.0, 0.7, len(self.GPUS)), strict=True))

    def draw(self, gpu: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """n pairs: whether the candidate was faster, local's and claude's raw p_faster."""
        z = self.rng.normal(0.0, 1.5, n)
        faster = self.rng.random(n) < sigmoid(z)
        p_local = sigmoid(self.scale[gpu] * (z + self.rng.normal(0.0, 1.0, n)))
        p_claude = sigmoid(2.5 * (0.15 * z + self.rng.normal(0.0, 1.0, n)) + self.bias[gpu])
        return faster, p_local, p_claude

    async def store_history(self, path: Path) -> None:
        """The history in a store at `path`: each component's raw forecasts, verified by measurements."""
        from test_store import forecast, kernel, save

        from forecaster_mcp.store.db import Store

        store = await Store.open(path)
        try:
            await store.create_ledger("x", 1e6)  # test_store.save charges ledger "x"
            base = kernel(BS=0)
            for gpu in self.GPUS:
                faster, p_local, p_claude = self.draw(gpu, self.PAIRS)
                rows = []
                for i in range(self.PAIRS):
                    cand = kernel(BS=i + 1)
                    for name, p in (("local", p_local[i]), ("claude", p_claude[i]))[
                        : 2 if i < self.ASKED else 1
                    ]:
                        row = forecast(
                            base, cand, p, "unsure", forecaster=f"raw:{name}@0", hardware=gpu, ledger=None
                        )
                        cap = self.local_cap if name == "local" else None
                        rows.append(dataclasses.replace(row, max_confidence=cap))
                await store.save_forecasts(rows)
                await save(store, base, 1.0, hardware=gpu)
                for i in range(self.PAIRS):
                    await save(store, kernel(BS=i + 1), 0.5 if faster[i] else 2.0, hardware=gpu)
        finally:
            await store.close()

    def outcomes(self) -> list[Outcome]:
        """The same kind of history as evaluation outcomes (`ForecastEngine.fit`)."""
        out = []
        for gpu in self.GPUS:
            faster, p_local, p_claude = self.draw(gpu, self.PAIRS)
            for i in range(self.PAIRS):
                raw = {"local": _bins_with(float(p_local[i])), "claude": _bins_with(float(p_claude[i]))}
                caps = {} if self.local_cap is None else {"local": self.local_cap}
                out.append(
                    Outcome(
                        gpu,
                        2.0 if faster[i] else 0.5,
                        raw if i < self.ASKED else {"local": raw["local"]},
                        caps=caps,
                    )
                )
        return out

    def held_out_log_loss(self, engine: ForecastEngine) -> tuple[float, float]:
        """The log loss of the engine's pooled forecasts of new pairs, and of local's calibrated ones alone."""
        pooled, alone, outcomes = [], [], []
        for gpu in self.GPUS:
            faster, p_local, p_claude = self.draw(gpu, 2000)
            for y, a, b in zip(faster, p_local, p_claude, strict=True):
                raw = {"local": _bins_with(float(a)), "claude": _bins_with(float(b))}
                pooled.append(bins.p_faster(engine.combine_raw(raw, gpu)))
                alone.append(engine._calibrators["local"].p(float(a), gpu))
                outcomes.append(bool(y))
        y = np.array(outcomes)

        def log_loss(p: list[float]) -> float:
            return float(-np.mean(np.where(y, np.log(p), np.log1p(-np.array(p)))))

        return log_loss(pooled), log_loss(alone)


@pytest.mark.anyio
async def test_combination_weights_are_fitted_on_answers_calibrated_out_of_fold(tmp_path: Path) -> None:
    """Calibrated by fits made on the very pairs the weights are fitted on (in sample: each GPU's own fit on its
    12), the weakly informative component's answers looked informative: the combination gave it weight 0.67
    beside the informative one's 0.74, and the pooled forecasts of new pairs were worse than the informative
    component's alone (held-out log loss 0.607 against 0.592). Calibrated out of fold, by fits that did not see
    the pair, it gets 0.42 and pooling costs little (0.595)."""
    history = SparseNoisyClaude()
    await history.store_history(tmp_path / "db.sqlite3")
    store = await Store.open(tmp_path / "db.sqlite3")
    try:
        engine = ForecastEngine([_scripted("local"), _scripted("claude")], store, refresh_interval_s=1e9)
        await engine.refresh(force=True)
    finally:
        await store.close()
    w_local, w_claude = engine._combiner.weights
    assert engine._combiner.n_pairs == 48
    assert w_claude < 0.5, (w_local, w_claude)  # 0.42 (in sample: 0.67)
    pooled, alone = history.held_out_log_loss(engine)
    assert pooled < alone + 0.008, (pooled, alone)  # 0.595 against 0.592 (in sample: 0.607)


def test_evaluation_fits_the_combination_weights_out_of_fold() -> None:
    """`forecaster-mcp eval` fits the engine on its calibration pairs (`ForecastEngine.fit`): the weights are
    fitted there as the server fits them, on answers calibrated out of fold: 0.22 for the weakly informative
    component (in sample 0.67), and a held-out log loss of 0.591 (in sample 0.607; the informative component's
    alone 0.592)."""
    history = SparseNoisyClaude()
    engine = ForecastEngine([_scripted("local"), _scripted("claude")])
    engine.fit(history.outcomes())
    w_local, w_claude = engine._combiner.weights
    assert engine._combiner.n_pairs == 48
    assert w_claude < 0.5, (w_local, w_claude)
    pooled, alone = history.held_out_log_loss(engine)
    assert pooled < alone + 0.008, (pooled, alone)


async def _served_weights(path: Path) -> tuple[float, ...]:
    """The combination weights a local+claude server fits on the verified history in the store at `path`."""
    store = await Store.open(path)
    try:
        engine = ForecastEngine([_scripted("local"), _scripted("claude")], store, refresh_interval_s=1e9)
        await engine.refresh(force=True)
        return engine._combiner.weights
    finally:
        await store.close()


@pytest.mark.anyio
async def test_combination_weights_are_fitted_on_answers_held_to_their_caps(tmp_path: Path) -> None:
    """A live forecast combines each component's calibrated answer held to its own cap (`_capped`), but the weights
    were fitted on the uncapped answers, in the server (`_fit_combiner`) and in `eval` (`ForecastEngine.fit`)
    alike: a component capped at 0.6 on every answer was weighed as if it said what it may not. Held to the cap
    its answers carry little, and the weights follow."""

    async def served(history: SparseNoisyClaude, path: Path) -> tuple[float, ...]:
        await history.store_history(path)
        return await _served_weights(path)

    def evaluated(history: SparseNoisyClaude) -> tuple[float, ...]:
        engine = ForecastEngine([_scripted("local"), _scripted("claude")])
        engine.fit(history.outcomes())
        return engine._combiner.weights

    free_served = await served(SparseNoisyClaude(), tmp_path / "free.sqlite3")
    capped_served = await served(SparseNoisyClaude(local_cap=0.6), tmp_path / "capped.sqlite3")
    free_eval, capped_eval = evaluated(SparseNoisyClaude()), evaluated(SparseNoisyClaude(local_cap=0.6))
    for free, capped in ((free_served, capped_served), (free_eval, capped_eval)):
        assert capped != pytest.approx(free), (free, capped)


@pytest.mark.anyio
async def test_combination_weights_fitted_in_sample_are_refitted_after_an_upgrade(tmp_path: Path) -> None:
    """A combiner state saved before the weights were fitted out of fold (version 1), for the same verified rows,
    is refitted on the next start, not reused."""
    await SparseNoisyClaude().store_history(tmp_path / "db.sqlite3")

    async def weights() -> tuple[float, ...]:
        return await _served_weights(tmp_path / "db.sqlite3")

    fitted = await weights()
    store = await Store.open(tmp_path / "db.sqlite3")
    try:
        state = json.loads(await store.load_calibration("local@0+claude@0", "*") or "{}")
        old = {**state, "version": 1, "combiner": {**state["combiner"], "weights": [0.0, 2.0]}}
        await store.save_calibration("local@0+claude@0", "*", json.dumps(old))
    finally:
        await store.close()
    assert await weights() == pytest.approx(fitted)
