"""Calibration: identity without data, lower ECE when miscalibrated, per-GPU fallback; combination."""

from __future__ import annotations

import numpy as np
import pytest

from forecaster_mcp import bins
from forecaster_mcp.forecast import metrics as M
from forecaster_mcp.forecast.calibration import Calibrator, Platt, fit_platt, sigmoid, with_p_faster
from forecaster_mcp.forecast.combine import Combiner


def _synthetic(
    rng: np.random.Generator, n: int, slope: float, bias: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """True log-odds z; the forecaster reports sigmoid(slope * z + bias).

    Returns (p_reported, faster, speedups)."""
    z = rng.normal(0.0, 1.5, n)
    faster = rng.random(n) < sigmoid(z)
    magnitude = rng.uniform(0.1, 2.0, n)  # never a tie
    speedups = np.where(faster, 2.0**magnitude, 2.0**-magnitude)
    return sigmoid(slope * z + bias), faster, speedups


def test_no_data_is_the_identity() -> None:
    cal = Calibrator.fit([], [], [])
    probs = bins.from_normal(0.4, 0.8)
    assert cal.p(0.83, "H100") == pytest.approx(0.83, abs=1e-9)
    assert cal.probs(probs, "H100") == pytest.approx(probs, abs=1e-9)
    assert Calibrator.identity().n_pairs == 0


def test_with_p_faster_keeps_each_half_shape() -> None:
    probs = [0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1]  # p_faster 0.6
    out = with_p_faster(probs, 0.8)
    assert bins.p_faster(out) == pytest.approx(0.8)
    assert out[4] / out[6] == pytest.approx(2.0)
    assert out[0] == pytest.approx(0.05)
    # An empty half receives its mass next to S = 1.
    only_faster = [0, 0, 0, 0, 0.5, 0.5, 0, 0]
    out = with_p_faster(only_faster, 0.9)
    assert out[3] == pytest.approx(0.1) and sum(out[:3]) == 0.0


def test_calibration_lowers_ece_of_an_overconfident_forecaster() -> None:
    rng = np.random.default_rng(7)
    p_fit, faster_fit, _ = _synthetic(rng, 3000, slope=3.0, bias=0.4)
    cal = Calibrator.fit(p_fit, faster_fit, ["A100"] * len(p_fit))
    p_test, _, s_test = _synthetic(rng, 3000, slope=3.0, bias=0.4)
    raw_ece = M.ece(p_test, s_test)
    cal_ece = M.ece([cal.p(float(p), "A100") for p in p_test], s_test)
    assert raw_ece > 0.12
    assert cal_ece < 0.04 and cal_ece < raw_ece / 3
    assert cal.pooled.a == pytest.approx(1 / 3, abs=0.08)  # undoes the slope of 3
    # The 8 bins follow p_faster.
    probs = bins.from_normal(1.0, 0.5)
    assert bins.p_faster(cal.probs(probs, "A100")) == pytest.approx(cal.p(bins.p_faster(probs), "A100"))


def test_calibration_lowers_ece_of_an_underconfident_forecaster() -> None:
    rng = np.random.default_rng(8)
    p_fit, faster_fit, _ = _synthetic(rng, 2000, slope=0.4)
    cal = Calibrator.fit(p_fit, faster_fit, ["H100"] * len(p_fit))
    p_test, _, s_test = _synthetic(rng, 2000, slope=0.4)
    assert M.ece([cal.p(float(p), "H100") for p in p_test], s_test) < M.ece(p_test, s_test) / 2


def test_a_calibrated_forecaster_stays_near_identity() -> None:
    rng = np.random.default_rng(9)
    p, faster, _ = _synthetic(rng, 2000, slope=1.0)
    fit = fit_platt(p, faster)
    assert fit.a == pytest.approx(1.0, abs=0.12) and fit.b == pytest.approx(0.0, abs=0.12)


def test_few_pairs_move_the_fit_only_a_little() -> None:
    # Five 0.9 forecasts, three right: the data alone would say 0.6, the prior keeps it near 0.9.
    fit = fit_platt([0.9] * 5, [True, False, True, True, False])
    assert 0.65 < fit.p(0.9) < 0.9
    assert fit.a >= 0.0


def test_anti_informative_history_flattens_never_flips() -> None:
    rng = np.random.default_rng(10)
    p, faster, _ = _synthetic(rng, 2000, slope=-1.0)
    fit = fit_platt(p, faster)
    assert fit.a == pytest.approx(0.0, abs=1e-6)


def test_unseen_hardware_falls_back_to_pooled_and_each_gpu_gets_its_bias() -> None:
    rng = np.random.default_rng(11)
    p_a, f_a, _ = _synthetic(rng, 1500, slope=1.0, bias=1.0)  # says "faster" too often on A
    p_b, f_b, _ = _synthetic(rng, 1500, slope=1.0, bias=-1.0)  # says "slower" too often on B
    cal = Calibrator.fit(np.r_[p_a, p_b], np.r_[f_a, f_b], ["A"] * 1500 + ["B"] * 1500)
    assert cal.for_hardware("A").b < -0.6 < 0.6 < cal.for_hardware("B").b
    assert cal.for_hardware("never-seen") == cal.pooled
    assert cal.p(0.7, "never-seen") == pytest.approx(cal.pooled.p(0.7))


def test_state_round_trips_through_json_and_garbage_is_refused() -> None:
    cal = Calibrator(Platt(0.5, -0.1, 40), {"A100": Platt(0.4, 0.2, 10)})
    assert Calibrator.from_json(cal.to_json()) == cal
    for bad in ("not json", '{"kind": "other"}', '{"kind": "platt", "version": 1}'):
        with pytest.raises(ValueError):
            Calibrator.from_json(bad)


def test_combiner_learns_to_trust_the_informative_forecaster() -> None:
    rng = np.random.default_rng(12)
    n = 2000
    z = rng.normal(0.0, 2.0, n)
    faster = rng.random(n) < sigmoid(z)
    good = sigmoid(z)  # calibrated and informative
    noise = sigmoid(rng.normal(0.0, 1.0, n))  # calibrated-looking noise
    comb = Combiner.fit(["good", "noise"], np.column_stack([good, noise]), faster)
    assert comb.weights[0] > 0.8 and comb.weights[1] < 0.15
    # Equal weights when there is no history; one component passes through unchanged.
    eq = Combiner.equal(["a", "b"])
    assert eq.weights == (0.5, 0.5)
    p = bins.from_normal(0.5, 0.5)
    assert eq.combine({"a": p}) == pytest.approx(p)
    both = eq.combine({"a": bins.from_normal(1.0, 0.5), "b": bins.from_normal(-1.0, 0.5)})
    assert bins.p_faster(both) == pytest.approx(0.5, abs=1e-9)
    assert Combiner.from_json(comb.to_json()) == comb
    with pytest.raises(ValueError):
        eq.combine({"c": p})


def test_the_combiner_waits_for_history_and_a_worthless_record_pools_to_no_evidence() -> None:
    """One verified miss that both components called at 0.97 pulled both weights to 0.026 (two components each
    at 0.995 then pooled to 0.57); a worse miss drove them to exactly 0, which pooled as equal weights (0.995)."""
    base = bins.from_normal(0.0, 1.0)
    sure = {"a": with_p_faster(base, 0.995), "b": with_p_faster(base, 0.995)}
    for p_said in (0.97, 0.9999):
        one_miss = Combiner.fit(["a", "b"], [[p_said, p_said]], [False])
        assert one_miss == Combiner.equal(["a", "b"])
        assert bins.p_faster(one_miss.combine(sure)) == pytest.approx(0.995, abs=1e-6)
    worthless = Combiner(("a", "b"), (0.0, 0.0), 50)
    assert bins.p_faster(worthless.combine(sure)) == pytest.approx(0.5, abs=1e-9)
    assert bins.p_faster(Combiner(("a", "b", "c"), (0.0, 0.0, 1.0), 50).combine(sure)) == pytest.approx(0.5)


def test_combined_log_loss_beats_either_component_when_errors_are_independent() -> None:
    rng = np.random.default_rng(13)
    n = 4000
    z = rng.normal(0.0, 1.0, n)
    faster = rng.random(n) < sigmoid(2 * z)
    # Two forecasters each see z through independent noise.
    za, zb = z + rng.normal(0, 0.8, n), z + rng.normal(0, 0.8, n)
    pa = fit_platt(sigmoid(za), faster).p_array(sigmoid(za))
    pb = fit_platt(sigmoid(zb), faster).p_array(sigmoid(zb))
    comb = Combiner.fit(["a", "b"], np.column_stack([pa, pb]), faster)
    s = np.where(faster, 2.0, 0.5)
    base = bins.from_normal(0.0, 1.0)
    pooled = [
        bins.p_faster(comb.combine({"a": with_p_faster(base, float(x)), "b": with_p_faster(base, float(y))}))
        for x, y in zip(pa, pb, strict=True)
    ]
    assert M.log_loss(pooled, s) < min(M.log_loss(pa, s), M.log_loss(pb, s)) - 0.02
    assert sum(comb.weights) > 1.0  # independent evidence adds up


def test_one_confident_miss_does_not_flatten_every_forecast() -> None:
    # A forecaster that said 0.9999 and was wrong once: on its own, that pair outweighs the slope's prior and
    # would map every forecast to one number (the ranking lost). Below MIN_FIT_PAIRS nothing is fitted.
    cal = Calibrator.fit([0.9999], [False], ["H100"])
    assert cal.p(0.02, "H100") < 0.05 < 0.95 < cal.p(0.98, "H100")
    assert cal.p(0.98, "A100") == pytest.approx(0.98)
    assert cal.n_pairs == 1


def test_a_gpu_s_own_pairs_count_once() -> None:
    # The per-GPU fit's prior is the fit on the other GPUs' pairs, never one that already holds its own
    # pairs: with one GPU, its fit is the pooled fit, not a second pass over the same data.
    rng = np.random.default_rng(12)
    p, faster, _ = _synthetic(rng, 40, slope=3.0)
    cal = Calibrator.fit(p, faster, ["A100"] * 40)
    assert cal.for_hardware("A100").a == pytest.approx(cal.pooled.a)
    assert cal.for_hardware("A100").b == pytest.approx(cal.pooled.b)


@pytest.mark.parametrize("n", [10, 57, 3000])
def test_a_single_gpus_fit_is_that_of_its_own_pairs(n: int) -> None:
    """With every pair on one GPU, its fit is taken from the pooled one (the same rows, the same prior) instead
    of fitting the rows twice: it equals a fit on that GPU's pairs with the prior, number for number."""
    rng = np.random.default_rng(n)
    p = rng.random(n)
    y = rng.random(n) < p**2
    prior = Platt(a=0.8)
    cal = Calibrator.fit(p, y, ["H100"] * n, prior=prior)
    assert cal.hardware["H100"] == fit_platt(p, y, prior=prior)
