"""Selective policy: decided error stays under target with the promised probability, and it still decides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from forecaster_mcp.forecast.selective import (
    NEVER,
    binom_cdf,
    choose_threshold,
    clopper_pearson_upper,
    decide,
    decision_p,
    default_min_history,
    default_threshold,
    min_count_zero_errors,
    proof_count,
)

TARGET = 0.1
DELTA = 0.05


def test_binomial_helpers_match_brute_force() -> None:
    for k, n, p in [(0, 10, 0.1), (3, 10, 0.3), (7, 40, 0.2), (12, 12, 0.5)]:
        brute = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(brute, rel=1e-9)
    # With zero errors in n the bound is 1 - delta^(1/n).
    assert clopper_pearson_upper(0, 29, 0.05) == pytest.approx(1 - 0.05 ** (1 / 29), rel=1e-6)
    # The bound is where P(X <= k) equals delta.
    u = clopper_pearson_upper(5, 100, 0.05)
    assert binom_cdf(5, 100, u) == pytest.approx(0.05, rel=1e-4)
    assert clopper_pearson_upper(3, 3, 0.05) == 1.0
    assert min_count_zero_errors(0.1, 0.05) == 29


def test_short_history_uses_the_default() -> None:
    choice = choose_threshold([0.99] * 10, [1] * 10, TARGET)
    assert choice.threshold == pytest.approx(default_threshold(TARGET)) == pytest.approx(0.95)
    assert choice.source == "default" and choice.n_history == 10 and choice.error_ucb is None
    assert "fewer than" in choice.reason
    # A stricter default where the caller knows its forecasts to be less reliably calibrated.
    stricter = choose_threshold([0.99] * 10, [1] * 10, TARGET, default=0.975)
    assert stricter.threshold == pytest.approx(0.975) and stricter.source == "default"
    with pytest.raises(ValueError):
        choose_threshold([0.99], [1], TARGET, default=0.4)


def test_a_default_close_to_1_is_written_with_its_digits() -> None:
    # target_error 1e-4 has the default 0.99995: the reason said "default 1.000", which reads as "never".
    choice = choose_threshold([], [], 1e-4)
    assert "default 0.99995 " in choice.reason and "1.000" not in choice.reason
    assert "default 0.95 " in choose_threshold([], [], 0.1).reason


def test_short_history_that_refutes_the_default_decides_nothing() -> None:
    # Too few pairs to certify anything, yet all ten at confidence 0.97 were wrong: the default's premise
    # (a calibrated forecaster) is refuted, so nothing is decided. One error in five is not evidence.
    refuted = choose_threshold([0.7] * 47 + [0.97] * 10, [1] * 47 + [0] * 10, TARGET)
    assert refuted.source == "never" and refuted.threshold == 1.0 and "10 of 10" in refuted.reason
    unlucky = choose_threshold([0.97] * 5, [1, 1, 0, 1, 1], TARGET)
    assert unlucky.source == "default" and unlucky.threshold == pytest.approx(0.95)


def test_a_clean_history_certifies_a_low_threshold() -> None:
    conf = np.linspace(0.6, 1.0, 400)
    choice = choose_threshold(conf, np.ones_like(conf), TARGET)
    assert choice.source == "history"
    assert choice.threshold == pytest.approx(0.6)  # the least confident pair, not a grid point below it
    assert choice.error_ucb is not None and choice.error_ucb <= TARGET
    assert choice.n_above == 400


def _true_error_uniform(t: float, slope: float) -> float:
    """Error among decided pairs when confidence c ~ U(0.5, 1) and P(right | c) = 0.5 + slope * (c - 0.5)."""
    mean_c = (t + 1.0) / 2.0
    return 1.0 - (0.5 + slope * (mean_c - 0.5))


@pytest.mark.parametrize(("n_history", "slope"), [(400, 1.0), (1500, 1.0), (1500, 0.5)])
def test_decided_error_stays_under_target_across_draws(n_history: int, slope: float) -> None:
    """slope 1: calibrated; slope 0.5: overconfident (right 75% of the time at confidence 1)."""
    rng = np.random.default_rng(n_history + int(slope * 10))
    draws = 200
    violations = 0
    thresholds = []
    for _ in range(draws):
        conf = rng.uniform(0.5, 1.0, n_history)
        correct = (rng.random(n_history) < 0.5 + slope * (conf - 0.5)).astype(float)
        choice = choose_threshold(conf, correct, TARGET, DELTA)
        thresholds.append(choice.threshold)
        if choice.source == "history" and _true_error_uniform(choice.threshold, slope) > TARGET:
            violations += 1
    # At most delta of the draws may certify a threshold whose true error exceeds the target
    # (binomial slack of about three standard deviations on top).
    assert violations <= DELTA * draws + 3 * math.sqrt(draws * DELTA * (1 - DELTA))
    if slope == 1.0:
        # And it decides: the median threshold leaves a useful share of pairs decided.
        coverage = [(1.0 - t) / 0.5 for t in thresholds]
        assert float(np.median(coverage)) >= (0.1 if n_history == 400 else 0.2)
    else:
        # An overconfident forecaster errs 26% of the time even above 0.95: it is told to stop deciding.
        assert sum(t >= NEVER for t in thresholds) >= 0.9 * draws


def test_certified_thresholds_hold_on_a_forecaster_only_sharp_at_the_top() -> None:
    rng = np.random.default_rng(3)
    n = 2000
    sharp = rng.random(n) < 0.3
    conf = np.where(sharp, rng.uniform(0.97, 1.0, n), rng.uniform(0.5, 0.7, n))
    correct = (rng.random(n) < conf).astype(float)
    choice = choose_threshold(conf, correct, TARGET)
    assert choice.source == "history"
    assert 0.66 <= choice.threshold <= 0.97
    assert choice.n_above >= 0.3 * n


def test_with_history_but_nothing_certified_the_default_needs_its_own_record_within_target() -> None:
    # 270 pairs at confidence 0.7 (30% wrong) certify nothing, so the default 0.95 is all that is left.
    low_conf, low_right = np.full(270, 0.7), np.r_[np.zeros(81), np.ones(189)]
    # 30 pairs above it with 6 errors (20%): too few to prove it errs above target, but no grounds to keep it.
    erring = choose_threshold(
        np.r_[low_conf, np.full(30, 0.97)], np.r_[low_right, np.zeros(6), np.ones(24)], TARGET, DELTA
    )
    assert erring.source == "never" and erring.threshold == NEVER
    assert "6 of 30" in erring.reason
    # 30 pairs above it with 2 errors (6.7%): not enough to certify 0.1, and nothing against it either.
    fine = choose_threshold(
        np.r_[low_conf, np.full(30, 0.97)], np.r_[low_right, np.zeros(2), np.ones(28)], TARGET, DELTA
    )
    assert fine.source == "default" and fine.threshold == pytest.approx(0.95)
    assert fine.n_above == 30 and "2 of 30" in fine.reason


def test_a_default_with_enough_history_to_prove_it_must_prove_it() -> None:
    """The default was kept on its point estimate however long its record: 300 pairs at 0.96 erring 9% of the
    time (bound 0.12, above target 0.1) kept deciding. A forecaster calibrated there errs at most 5% and with
    this many pairs would certify it nearly always, so a record this long that does not is evidence enough."""
    erring = choose_threshold(np.full(300, 0.96), np.r_[np.zeros(27), np.ones(273)], TARGET, DELTA)
    assert erring.source == "never" and erring.threshold == NEVER
    assert "27 of 300" in erring.reason
    # Fewer pairs at the default: its point estimate still decides, as before.
    short = choose_threshold(
        np.r_[np.full(270, 0.7), np.full(60, 0.96)],
        np.r_[np.zeros(81), np.ones(189), np.zeros(5), np.ones(55)],
        TARGET,
        DELTA,
    )
    assert short.source == "default" and short.n_above == 60


@pytest.mark.parametrize("default", [0.95, 0.975])
def test_a_calibrated_forecaster_at_the_default_keeps_deciding_on_a_long_record(default: float) -> None:
    """The rule above must not stop a calibrated forecaster: at its error 1 - default, the record long enough to
    demand proof certifies the default in at least 1 - delta of draws."""
    rng = np.random.default_rng(3)
    n, draws = int(proof_count(TARGET, DELTA, default)), 1000
    assert n < 400
    kept = 0
    for _ in range(draws):
        right = (rng.random(n) >= 1.0 - default).astype(float)
        choice = choose_threshold(np.full(n, default), right, TARGET, DELTA, default=default)
        kept += choice.threshold < NEVER
    # At exactly the count, the chance is 1 - delta or a little more; three standard errors of slack for the draws.
    assert kept / draws >= 1.0 - DELTA - 3 * math.sqrt(DELTA * (1 - DELTA) / draws)


def test_min_history_knob_and_validation() -> None:
    assert default_min_history(TARGET, DELTA) == 58
    conf = np.full(40, 0.99)
    assert choose_threshold(conf, np.ones(40), TARGET, min_history=30).source == "history"
    with pytest.raises(ValueError):
        choose_threshold([0.9], [1], 0.6)
    with pytest.raises(ValueError):
        choose_threshold([0.9, 0.8], [1], 0.1)


def test_decide() -> None:
    assert decide(0.97, 0.95) == "faster"
    assert decide(0.03, 0.95) == "slower"
    assert decide(0.94, 0.95) == "unsure"
    assert decide(0.95, 0.95) == "faster"
    assert decide(0.999999, NEVER) == "unsure"
    assert decide(float("nan"), 0.9) == "unsure"
    # A kernel that may fail to run is faster only if it runs: "faster" needs (1 - p_fail) * p_faster.
    assert decide(0.99, 0.95, p_fail=0.03) == "faster"
    assert decide(0.99, 0.95, p_fail=0.06) == "unsure"
    assert decide(0.01, 0.95, p_fail=0.5) == "slower"  # failing is no better either
    assert decide(0.99, 0.95, p_fail=float("nan")) == "unsure"
    # ... and slower only if the baseline runs: a candidate that runs beats a baseline that fails.
    assert decide(0.01, 0.95, p_fail_baseline=0.03) == "slower"
    assert decide(0.01, 0.95, p_fail_baseline=0.06) == "unsure"
    assert decide(0.99, 0.95, p_fail_baseline=0.5) == "faster"
    # A candidate that surely runs is the better choice against a baseline that almost surely fails, even one
    # that would be faster if it ran (the mirror of "a candidate that fails is slower").
    assert decide(0.1, 0.95, p_fail=0.0, p_fail_baseline=0.97) == "faster"
    assert decide(0.9, 0.95, p_fail=0.97, p_fail_baseline=0.0) == "slower"
    assert decide(0.99, 0.95, p_fail_baseline=float("nan")) == "unsure"
    # A candidate that (surely) fails is never the better choice, even against a failing baseline.
    assert decide(0.0, 0.95, p_fail=1.0, p_fail_baseline=1.0) == "slower"
    assert decide(0.5, 0.95, p_fail=0.97, p_fail_baseline=0.2) == "slower"
    # Both failing at or past the threshold: "slower" in both orders (the docstring said the other order was
    # then "unsure"); the orders differ only when the other kernel's chance of failing is below it.
    for p, fc, fb in [(0.5, 0.97, 0.96), (0.9, 1.0, 0.95), (0.0, 0.95, 1.0)]:
        assert decide(p, 0.95, fc, fb) == decide(1 - p, 0.95, fb, fc) == "slower", (p, fc, fb)
    assert decide(0.5, 0.95, p_fail=0.2, p_fail_baseline=0.97) == "unsure"
    # The two orders of one pair agree: (p, fail cand, fail base) against (1 - p, fail base, fail cand).
    for p, fc, fb in [
        (0.97, 0.01, 0.3),
        (0.02, 0.2, 0.04),
        (0.999, 0.0, 0.0),
        (0.6, 0.5, 0.5),
        (0.4, 0.2, 0.3),
        (0.1, 0.0, 0.97),
        (0.7, 0.03, 0.9),
    ]:
        forward, backward = decide(p, 0.95, fc, fb), decide(1 - p, 0.95, fb, fc)
        flipped = {"faster": "slower", "slower": "faster", "unsure": "unsure"}
        assert backward == flipped[forward], (p, fc, fb)


@pytest.mark.parametrize(
    ("p", "pf", "pfb"),
    [
        (0.07, 0.0, 0.96),
        (0.93, 0.9, 0.0),
        (0.6, 0.02, 0.02),
        (0.99, 0.0, 0.0),
        (0.5, 0.3, 0.3),
        (0.2, 0.5, 0.1),
        (0.5, 0.99, 0.99),
        (0.5, 0.96, 0.3),
    ],
)
def test_decision_p_is_what_decide_weighs(p: float, pf: float, pfb: float) -> None:
    # Thresholds are certified on verified forecasts: their confidence and direction must be the ones the
    # verdict was decided by. A "faster" decided at p_faster 0.07 because the baseline likely failed was scored
    # by p_faster's direction (right, when the baseline then ran and was faster).
    q = decision_p(p, pf, pfb)
    assert 0.0 <= q <= 1.0
    for t in (0.55, 0.7, 0.9, 0.95, 0.99):
        verdict = decide(p, t, pf, pfb)
        if verdict == "faster":
            assert q >= t
        elif verdict == "slower":
            assert 1.0 - q >= t
        else:
            assert verdict == "slower" or max(q, 1.0 - q) < t
    assert decision_p(0.8) == 0.8 and decision_p(math.nan) == 0.5
