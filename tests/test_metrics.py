"""Metrics on hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from forecaster_mcp import bins
from forecaster_mcp.forecast import metrics as M

# Four pairs: candidate 2x faster, 2x slower, a 1% tie, 1.5x faster.
SPEEDUPS = [2.0, 0.5, 1.01, 1.5]
P_FASTER = [0.82, 0.28, 0.9, 0.38]  # right, right, (tie), wrong


def test_ties_are_within_three_percent() -> None:
    assert M.tie_mask([1.0, 1.029, 1 / 1.029, 1.031, 0.9]).tolist() == [True, True, True, False, False]


def test_pairwise_accuracy_excludes_ties_and_half_credits_coin_flips() -> None:
    assert M.pairwise_accuracy(P_FASTER, SPEEDUPS) == pytest.approx(2 / 3)
    assert M.pairwise_accuracy([0.5, 0.9], [2.0, 2.0]) == pytest.approx(0.75)
    assert math.isnan(M.pairwise_accuracy([0.9], [1.0]))


def test_brier_and_log_loss_on_non_ties() -> None:
    # (0.82 - 1)^2, (0.28 - 0)^2, (0.38 - 1)^2
    assert M.brier(P_FASTER, SPEEDUPS) == pytest.approx((0.18**2 + 0.28**2 + 0.62**2) / 3)
    assert M.log_loss(P_FASTER, SPEEDUPS) == pytest.approx(
        -(math.log(0.82) + math.log(0.72) + math.log(0.38)) / 3
    )


def test_ece_one_pair_per_bin() -> None:
    # Confidences 0.82 (right), 0.72 (right), 0.62 (wrong) fall in separate 0.05-wide bins.
    assert M.ece(P_FASTER, SPEEDUPS) == pytest.approx((0.18 + 0.28 + 0.62) / 3)


def test_ece_shares_a_bin_and_reliability_table() -> None:
    # 0.91 right and 0.93 wrong share the bin [0.9, 0.95): accuracy 0.5 vs confidence 0.92.
    # 0.3 (confidence 0.7, right) sits alone in [0.7, 0.75).
    p = [0.91, 0.93, 0.3]
    s = [2.0, 0.5, 0.5]
    assert M.ece(p, s) == pytest.approx((2 * 0.42 + 1 * 0.3) / 3)
    table = M.reliability(p, s)
    assert len(table) == 10
    assert table[0].low == pytest.approx(0.5) and table[-1].high == pytest.approx(1.0)
    full = [b for b in table if b.count]
    assert [(b.count, round(b.accuracy, 6)) for b in full] == [(1, 1.0), (2, 0.5)]
    assert full[1].mean_confidence == pytest.approx(0.92)


def test_confidence_one_falls_in_the_last_bin() -> None:
    table = M.reliability([1.0, 0.0], [2.0, 2.0])
    assert table[-1].count == 2 and table[-1].accuracy == pytest.approx(0.5)


def test_a_confidence_on_an_edge_falls_in_the_bin_above_it() -> None:
    # Every edge, 0.85 included (linspace's edge there is 0.8500000000000001): [low, high).
    for k, edge in enumerate([0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95], start=1):
        table = M.reliability([edge, 1.0 - edge], [2.0, 0.5])
        assert table[k].count == 2, edge
        assert table[k].low == edge


def test_bin_accuracy_and_multiclass_brier() -> None:
    half = [0.0] * 8
    half[5] = half[6] = 0.5  # bins 5 and 6 tied for the most likely: half the credit for a bin-6 truth
    sure = bins.one_hot(3.0)  # bin 6
    probs = [half, sure]
    s = [3.0, 3.0]  # log2 3 = 1.58: bin 6
    assert M.bin_accuracy(probs, s) == pytest.approx(0.75)
    # A forecast symmetric about S = 1 (bins 3 and 4 equal to the last bit or not) is a coin flip between
    # them, whichever side the truth is on: it was credited fully below 1 and not at all above.
    flip = bins.from_normal(0.0, 1.0)
    assert M.bin_accuracy([flip], [0.8]) == M.bin_accuracy([flip], [1.25]) == pytest.approx(0.5)
    # Row 1: 0.5^2 + 0.5^2; row 2: perfect.
    assert M.multiclass_brier(probs, s) == pytest.approx(0.25)


def test_risk_coverage_and_aurc_with_tied_confidence() -> None:
    conf = [0.9, 0.8, 0.8, 0.6]
    correct = [1, 0, 1, 0]
    rc = M.risk_coverage(conf, correct)
    # The two 0.8s are one group with error rate 0.5, whatever their input order.
    assert rc.risk.tolist() == pytest.approx([0.0, 0.25, 1 / 3, 0.5])
    assert rc.coverage.tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rc.aurc == pytest.approx((0 + 0.25 + 1 / 3 + 0.5) / 4)
    assert rc.risk_at(0.5) == pytest.approx(0.25)
    assert rc.risk_at(0.6) == pytest.approx(1 / 3)
    assert rc.risk_at(1.0) == pytest.approx(0.5)
    swapped = M.risk_coverage([0.9, 0.8, 0.8, 0.6], [1, 1, 0, 0])
    assert swapped.risk.tolist() == pytest.approx(rc.risk.tolist())
    with pytest.raises(ValueError):
        rc.risk_at(0.0)


def test_a_perfect_ranker_has_lower_aurc_than_a_reversed_one() -> None:
    correct = [1, 1, 0, 0]
    good = M.risk_coverage([0.9, 0.8, 0.7, 0.6], correct).aurc
    bad = M.risk_coverage([0.6, 0.7, 0.8, 0.9], correct).aurc
    assert good < bad


def test_decided_summary_counts_coverage_over_all_and_accuracy_over_decided_non_ties() -> None:
    d = M.decided_summary(["faster", "unsure", "slower", "faster"], [2.0, 0.5, 1.01, 0.5])
    assert (d.n_pairs, d.n_decided, d.n_decided_scored) == (4, 3, 2)
    assert d.coverage == pytest.approx(0.75)
    assert d.accuracy == pytest.approx(0.5) and d.error == pytest.approx(0.5)


def test_verdicts_at_threshold() -> None:
    assert M.verdicts_at([0.97, 0.03, 0.9, 0.5], 0.95) == ["faster", "slower", "unsure", "unsure"]
    assert M.verdicts_at([0.97], 1.0) == ["unsure"]


def test_summarize_is_json_ready() -> None:
    probs = np.array([bins.from_normal(m, 0.5) for m in (1.0, -1.0, 0.0, -0.2)])
    out = M.summarize(probs, SPEEDUPS, threshold=0.9)
    assert out["n_pairs"] == 4 and out["n_ties"] == 1
    p = M.p_faster_of(probs)
    assert out["pairwise_accuracy"] == pytest.approx(M.pairwise_accuracy(p, SPEEDUPS))
    assert out["coverage"] == pytest.approx(0.5)  # 1.0 and -1.0 with sd 0.5 clear 0.9
    assert set(out) >= {
        "ece",
        "ece_if_calibrated",
        "ece_if_calibrated_p90",
        "aurc",
        "risk_at_50",
        "risk_at_80",
        "brier",
        "multiclass_brier",
        "bin_accuracy",
    }
    only_ties = M.summarize([bins.from_normal(0.0, 1.0)], [1.0])
    assert only_ties["pairwise_accuracy"] is None and only_ties["ece"] is None


def _outcomes(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Speedups whose direction is drawn from p_faster itself (2x faster or 2x slower: never a tie)."""
    return np.where(rng.random(p.size) < p, 2.0, 0.5)


def test_ece_if_calibrated_matches_simulated_calibrated_forecasters() -> None:
    rng = np.random.default_rng(7)
    p = rng.uniform(0.0, 1.0, 246)
    mean, p90 = M.ece_if_calibrated(p, _outcomes(p, rng))
    observed = [M.ece(p, _outcomes(p, rng)) for _ in range(300)]
    assert mean == pytest.approx(float(np.mean(observed)), abs=0.006)
    assert p90 == pytest.approx(float(np.quantile(observed, 0.9)), abs=0.01)
    # Far from zero on a few hundred pairs, shrinking like 1/sqrt(n) with more.
    assert 0.04 < mean < p90
    big = rng.uniform(0.0, 1.0, 4 * p.size)
    assert M.ece_if_calibrated(big, _outcomes(big, rng))[0] < 0.6 * mean
    assert M.ece_if_calibrated(p, _outcomes(p, rng)) == M.ece_if_calibrated(p, _outcomes(p, rng))


def test_ece_if_calibrated_separates_an_overconfident_forecaster() -> None:
    rng = np.random.default_rng(3)
    truth = rng.uniform(0.2, 0.8, 400)  # the real chances: rarely sure
    speedups = _outcomes(truth, rng)
    claimed = np.where(truth > 0.5, 0.97, 0.03)  # a forecaster that is always sure of the likelier side
    assert M.ece(claimed, speedups) > 3 * M.ece_if_calibrated(claimed, speedups)[1]


def test_ece_if_calibrated_ignores_ties_and_coin_flips() -> None:
    assert all(math.isnan(v) for v in M.ece_if_calibrated([0.9, 0.1], [1.0, 1.01]))
    # A coin flip scores 0.5 against its confidence 0.5 in every draw: no noise to add.
    assert M.ece_if_calibrated([0.5, 0.5, 0.5], [2.0, 0.5, 2.0]) == (0.0, 0.0)


@pytest.mark.parametrize("mean", [-6.0, -2.0, -0.3, 0.0, 0.05, 0.7, 1.5, 3.0, 9.0])
@pytest.mark.parametrize("sd", [1e-7, 0.05, 0.4, 1.3, 4.0])
def test_normal_bins_carry_the_mean_within_each_bin(mean: float, sd: float) -> None:
    probs, centers = bins.normal_bins(mean, sd)
    assert probs == pytest.approx(bins.from_normal(mean, sd))
    edges = [-math.inf, *bins.EDGES_LOG2, math.inf]
    assert all(lo <= c <= hi for c, lo, hi in zip(centers, edges, edges[1:], strict=False))
    assert bins.expected_log2(probs, centers) == pytest.approx(mean, abs=1e-6)
    # The fixed centres only agree for a wide distribution inside the open bins' reach.
    if sd == 0.05 and mean == 0.05:
        assert bins.expected_log2(probs) > 0.15


@pytest.mark.parametrize("mean, sd", [(math.nan, 1.0), (0.3, math.nan), (math.inf, 1.0), (0.0, math.inf)])
def test_normal_bins_refuse_a_mean_or_spread_that_is_not_a_number(mean: float, sd: float) -> None:
    # NaN compared false everywhere and put all the mass in the fastest bin: a confident "faster".
    with pytest.raises(ValueError, match="finite"):
        bins.normal_bins(mean, sd)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        M.pairwise_accuracy([0.5], [0.0])
    with pytest.raises(ValueError):
        M.as_probs([[0.5, 0.5]])
    with pytest.raises(ValueError):
        M.brier([math.nan], [2.0])


def test_risk_coverage_groups_confidences_equal_but_for_the_last_bit() -> None:
    # Two mirrored forecasts: 1 - 0.3722 and 0.6278 are one confidence, reached by two roundings.
    high = 0.6276970180349811
    low = np.nextafter(high, 0.0)
    assert low != high
    first = M.risk_coverage([0.9, high, low, 0.55], [1, 1, 0, 0])
    second = M.risk_coverage([0.9, high, low, 0.55], [1, 0, 1, 0])
    # One group with error rate 0.5, whichever of the two is right (the old order put the last-bit higher first).
    assert first.risk.tolist() == pytest.approx([0.0, 0.25, 1 / 3, 0.5])
    assert second.risk.tolist() == pytest.approx(first.risk.tolist())
    assert second.risk_at(0.5) == pytest.approx(0.25)


def test_mirrored_forecasts_share_their_ece_bin() -> None:
    # Bins as a forecaster writes them: p_faster = 0.05 + 0.1 + 0.15 + 0.05 sums to 0.35000000000000003, so its
    # confidence max(p, 1 - p) is 0.6499999999999999, one bit under the edge 0.65 that "0.65 faster" sits on.
    slower = [0.1, 0.25, 0.05, 0.25, 0.05, 0.1, 0.15, 0.05]
    faster = [0.05, 0.15, 0.1, 0.05, 0.25, 0.05, 0.25, 0.1]
    p = M.p_faster_of([faster, slower])
    assert 1.0 - p[1] < 0.65  # the rounding this guards against
    # Both are 65% sure; the first is right, the second wrong: one bin [0.65, 0.7), accuracy 0.5.
    s = [2.0, 2.0]
    table = M.reliability(p, s)
    assert [(b.low, b.count) for b in table if b.count] == [(0.65, 2)]
    assert M.ece(p, s) == pytest.approx(0.15)
    assert M.summarize([faster, slower], s)["ece"] == pytest.approx(0.15)
    # The calibrated reference bins them the same way: two pairs in one bin, not each alone in its own.
    assert M.ece_if_calibrated(p, s) == pytest.approx(M.ece_if_calibrated([0.65, 0.35], s))
