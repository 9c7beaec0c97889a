"""Forecaster metrics, defined once (DESIGN.md "Metrics"). Pure numpy.

Conventions shared by every function here:
- speedup S = t(baseline) / t(candidate); the candidate is faster when S > 1.
- Pairs with |log2 S| <= bins.TIE_LOG2 (within 3%) are ties within measurement noise: they are left out of
  everything that scores a direction (pairwise accuracy, binary Brier, log loss, ECE, risk-coverage,
  decided accuracy) and kept in the 8-bin scores (bin accuracy, multi-class Brier).
- The predicted direction is "faster" when p_faster > 0.5; p_faster == 0.5 is a coin flip and scores 0.5.
- Confidence is the probability of the predicted direction, max(p, 1 - p), in [0.5, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from forecaster_mcp import bins
from forecaster_mcp.forecast.selective import decide

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
ArrayLike = Sequence[float] | FloatArray

_EPS = 1e-6


def _vec(values: ArrayLike | Sequence[Sequence[float]], name: str) -> FloatArray:
    arr = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds a non-finite value")
    return arr


def as_probs(probs: Sequence[Sequence[float]] | FloatArray) -> FloatArray:
    """An (n, 8) array of bin probabilities; rows are renormalised."""
    arr = _vec(probs, "probs")
    if arr.size == 0:
        return np.zeros((0, bins.N_BINS))
    if arr.ndim != 2 or arr.shape[1] != bins.N_BINS:
        raise ValueError(f"probs must have shape (n, {bins.N_BINS}), got {arr.shape}")
    arr = np.clip(arr, 0.0, None)
    totals = arr.sum(axis=1, keepdims=True)
    uniform = np.full_like(arr, 1.0 / bins.N_BINS)
    return np.where(totals > 0, arr / np.where(totals > 0, totals, 1.0), uniform)


def log2_speedups(speedups: ArrayLike) -> FloatArray:
    s = _vec(speedups, "speedups")
    if np.any(s <= 0):
        raise ValueError("speedups must be positive (S = t_baseline / t_candidate)")
    return np.log2(s)


def tie_mask(speedups: ArrayLike) -> BoolArray:
    """True where the pair is a tie within noise (|log2 S| <= bins.TIE_LOG2)."""
    return np.abs(log2_speedups(speedups)) <= bins.TIE_LOG2


def p_faster_of(probs: Sequence[Sequence[float]] | FloatArray) -> FloatArray:
    """Mass on S > 1 for each row of an (n, 8) array."""
    out: FloatArray = as_probs(probs)[:, list(bins.FASTER_BINS)].sum(axis=1)
    return out


def confidence(p_faster: ArrayLike) -> FloatArray:
    """Probability of the predicted direction, max(p, 1 - p)."""
    p = _vec(p_faster, "p_faster")
    return np.maximum(p, 1.0 - p)


def direction_scores(p_faster: ArrayLike, speedups: ArrayLike) -> FloatArray:
    """Per pair: 1 if the predicted direction is right, 0 if wrong, 0.5 for p == 0.5 (ties included)."""
    p = _vec(p_faster, "p_faster")
    faster = log2_speedups(speedups) > 0
    right = np.where(p > 0.5, faster, ~faster).astype(np.float64)
    return np.where(p == 0.5, 0.5, right)


def _mean_or_nan(values: FloatArray) -> float:
    return float(values.mean()) if values.size else math.nan


def pairwise_accuracy(p_faster: ArrayLike, speedups: ArrayLike) -> float:
    """Fraction of non-tie pairs whose direction is predicted right (nan when all are ties)."""
    keep = ~tie_mask(speedups)
    return _mean_or_nan(direction_scores(p_faster, speedups)[keep])


def bin_accuracy(probs: Sequence[Sequence[float]] | FloatArray, speedups: ArrayLike) -> float:
    """Fraction of pairs whose most likely bin holds the true speedup (ties included). Bins tied for the most
    likely (within rounding) share the credit, as a coin flip scores 0.5 on direction: a forecast symmetric
    about S = 1 was credited with its slower bin alone (argmax takes the first of equals)."""
    p = as_probs(probs)
    if not p.size:
        return math.nan
    truth = np.array([bins.bin_index(float(s)) for s in _vec(speedups, "speedups")], dtype=np.int64)
    top = np.isclose(p, p.max(axis=1, keepdims=True), rtol=1e-9, atol=1e-12)
    hit = top[np.arange(len(truth)), truth]
    return _mean_or_nan(hit / top.sum(axis=1))


def brier(p_faster: ArrayLike, speedups: ArrayLike) -> float:
    """Binary Brier score of p_faster against "candidate faster", non-tie pairs."""
    keep = ~tie_mask(speedups)
    y = (log2_speedups(speedups) > 0).astype(np.float64)
    return _mean_or_nan(((_vec(p_faster, "p_faster") - y) ** 2)[keep])


def multiclass_brier(probs: Sequence[Sequence[float]] | FloatArray, speedups: ArrayLike) -> float:
    """Sum over the 8 bins of the squared error against the one-hot true bin, averaged over pairs."""
    p = as_probs(probs)
    if not p.size:
        return math.nan
    onehot = np.array([bins.one_hot(float(s)) for s in _vec(speedups, "speedups")], dtype=np.float64)
    return float(((p - onehot) ** 2).sum(axis=1).mean())


def log_loss(p_faster: ArrayLike, speedups: ArrayLike) -> float:
    """Binary log loss (nats) on non-tie pairs, probabilities clipped to [1e-6, 1 - 1e-6]."""
    keep = ~tie_mask(speedups)
    y = log2_speedups(speedups) > 0
    p = np.clip(_vec(p_faster, "p_faster"), _EPS, 1 - _EPS)
    return _mean_or_nan(-np.log(np.where(y, p, 1 - p))[keep])


@dataclass(frozen=True)
class ReliabilityBin:
    """One confidence bin of a reliability diagram."""

    low: float
    high: float
    count: int
    mean_confidence: float  # nan when empty
    accuracy: float  # nan when empty


def _confidence_edges(n_bins: int) -> FloatArray:
    """Edges of `n_bins` equal bins over [0.5, 1], each the float nearest its decimal value: linspace's
    0.8500000000000001 would put a confidence of exactly 0.85 in the bin below it."""
    return np.round(np.linspace(0.5, 1.0, n_bins + 1), 12)


def _confidence_bin(conf: FloatArray, n_bins: int) -> tuple[FloatArray, npt.NDArray[np.intp]]:
    """The bin edges and each confidence's bin, [low, high) and the last closed. Confidences are compared to 12
    decimals, as risk_coverage groups them: max(p, 1 - p) of a forecast written in decimals lands a bit under the
    decimal it means (0.05 + 0.1 + 0.15 + 0.05 = 0.35000000000000003, so 1 - p = 0.6499999999999999), which put
    "0.35 faster" in the bin below "0.65 faster" and split two equally sure forecasts across bins."""
    edges = _confidence_edges(n_bins)
    index = np.clip(np.searchsorted(edges, np.round(conf, 12), side="right") - 1, 0, n_bins - 1)
    return edges, index


def reliability(p_faster: ArrayLike, speedups: ArrayLike, n_bins: int = 10) -> list[ReliabilityBin]:
    """Non-tie pairs grouped into `n_bins` equal-width bins of confidence over [0.5, 1].

    The confidence of a binary forecast never falls below 0.5, so the bins span [0.5, 1] (width 0.05 for 10);
    the last bin is closed on the right.
    """
    keep = ~tie_mask(speedups)
    conf = confidence(p_faster)[keep]
    score = direction_scores(p_faster, speedups)[keep]
    edges, index = _confidence_bin(conf, n_bins)
    out = []
    for b in range(n_bins):
        sel = index == b
        count = int(sel.sum())
        out.append(
            ReliabilityBin(
                low=float(edges[b]),
                high=float(edges[b + 1]),
                count=count,
                mean_confidence=float(conf[sel].mean()) if count else math.nan,
                accuracy=float(score[sel].mean()) if count else math.nan,
            )
        )
    return out


def ece(p_faster: ArrayLike, speedups: ArrayLike, n_bins: int = 10) -> float:
    """Expected calibration error: count-weighted |accuracy - mean confidence| over the reliability bins."""
    table = reliability(p_faster, speedups, n_bins)
    total = sum(b.count for b in table)
    if total == 0:
        return math.nan
    return float(sum(b.count * abs(b.accuracy - b.mean_confidence) for b in table if b.count) / total)


def ece_if_calibrated(
    p_faster: ArrayLike, speedups: ArrayLike, n_bins: int = 10, draws: int = 400, seed: int = 0
) -> tuple[float, float]:
    """The ECE a perfectly calibrated forecaster with these probabilities would show on these pairs.

    ECE is never 0 on a finite set: each reliability bin's accuracy is a sample mean. On a few hundred pairs
    a forecaster whose confidences are exactly right scores about 0.05, so an observed ECE means little
    without this reference. Each of `draws` simulated sets keeps the non-tie pairs and their confidences and
    draws whether the predicted direction is right with probability equal to the confidence; returns the
    mean ECE over the sets and its 90th percentile (nan, nan when every pair is a tie). Seeded: the same
    inputs give the same figures.
    """
    keep = ~tie_mask(speedups)
    conf = confidence(p_faster)[keep]
    if conf.size == 0:
        return math.nan, math.nan
    _, index = _confidence_bin(conf, n_bins)
    onehot = np.zeros((conf.size, n_bins))
    onehot[np.arange(conf.size), index] = 1.0
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // conf.size)  # draws per block: memory stays ~16 MB on any number of pairs
    values = []
    for start in range(0, draws, chunk):
        right = (rng.random((min(chunk, draws - start), conf.size)) < conf).astype(np.float64)
        # A coin flip (confidence 0.5) scores 0.5 in `direction_scores`, never 0 or 1.
        scores = np.where(conf == 0.5, 0.5, right)
        # Per draw and bin: count * |accuracy - mean confidence| = |sum of scores - sum of confidences|.
        values.append(np.abs(scores @ onehot - conf @ onehot).sum(axis=1) / conf.size)
    ece_values = np.concatenate(values)
    return float(ece_values.mean()), float(np.quantile(ece_values, 0.9))


@dataclass(frozen=True)
class RiskCoverage:
    """The risk-coverage curve: point k keeps the k most confident pairs."""

    coverage: FloatArray  # k / n, k = 1..n
    risk: FloatArray  # error rate among the k most confident
    confidence: FloatArray  # confidence of the k-th most confident pair

    @property
    def aurc(self) -> float:
        """Area under the curve: the mean of risk over k = 1..n (nan when empty)."""
        return _mean_or_nan(self.risk)

    def risk_at(self, coverage: float) -> float:
        """Risk among the ceil(coverage * n) most confident pairs (at least one)."""
        n = self.risk.size
        if n == 0:
            return math.nan
        if not 0.0 < coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        k = min(n, max(1, math.ceil(coverage * n - 1e-9)))
        return float(self.risk[k - 1])


def risk_coverage(confidences: ArrayLike, correct: ArrayLike) -> RiskCoverage:
    """Risk-coverage curve of scored predictions (correct in [0, 1]), most confident first.

    Pairs with equal confidence cannot be ordered by the forecaster, so inside a group of equal confidence
    the curve uses the expected error of a random order (the group's mean error), not the input order. Equal
    to 12 decimals: max(p, 1 - p) of two mirrored forecasts (p and 1 - p reached by different sums) can differ
    in the last bit, which ordered them by rounding noise, the one a bit higher counted as surer.
    """
    conf = _vec(confidences, "confidences")
    err = 1.0 - _vec(correct, "correct")
    if conf.shape != err.shape:
        raise ValueError("confidences and correct must have the same length")
    n = conf.size
    if n == 0:
        empty = np.zeros(0)
        return RiskCoverage(empty, empty, empty)
    level = np.round(conf, 12)
    order = np.argsort(-level, kind="stable")
    conf_sorted = conf[order]
    err_sorted = err[order]
    # Group boundaries of equal confidence.
    starts = np.flatnonzero(np.r_[True, level[order][1:] != level[order][:-1]])
    ends = np.r_[starts[1:], n]
    cum = np.r_[0.0, np.cumsum(err_sorted)]
    expected = np.empty(n)
    for s, e in zip(starts, ends, strict=True):
        rate = (cum[e] - cum[s]) / (e - s)
        expected[s:e] = cum[s] + rate * np.arange(1, e - s + 1)
    k = np.arange(1, n + 1, dtype=np.float64)
    return RiskCoverage(coverage=k / n, risk=expected / k, confidence=conf_sorted)


def direction_history(p_faster: ArrayLike, speedups: ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Confidence and direction score of each non-tie pair: what risk_coverage and selective.choose_threshold
    take."""
    keep = ~tie_mask(speedups)
    return confidence(p_faster)[keep], direction_scores(p_faster, speedups)[keep]


def direction_risk_coverage(p_faster: ArrayLike, speedups: ArrayLike) -> RiskCoverage:
    """Risk-coverage of the direction verdict on non-tie pairs."""
    return risk_coverage(*direction_history(p_faster, speedups))


@dataclass(frozen=True)
class DecidedSummary:
    """How decided verdicts fared: coverage over all pairs, accuracy over decided non-tie pairs."""

    n_pairs: int
    n_decided: int
    n_decided_scored: int  # decided and not a tie
    coverage: float  # n_decided / n_pairs
    coverage_non_tie: float  # decided non-tie pairs / non-tie pairs (the denominator AURC and risk@ use)
    accuracy: float  # among decided non-tie pairs; nan when none
    error: float  # 1 - accuracy


def decided_summary(verdicts: Sequence[str], speedups: ArrayLike) -> DecidedSummary:
    """Accuracy and coverage of verdicts in {"faster", "slower", "unsure"}."""
    v = np.asarray(list(verdicts), dtype=object)
    log2s = log2_speedups(speedups)
    if v.shape != log2s.shape:
        raise ValueError("verdicts and speedups must have the same length")
    decided = (v == "faster") | (v == "slower")
    scored = decided & (np.abs(log2s) > bins.TIE_LOG2)
    right = np.where(v == "faster", log2s > 0, log2s < 0)
    n = int(v.size)
    n_scored = int(scored.sum())
    n_non_tie = int((np.abs(log2s) > bins.TIE_LOG2).sum())
    acc = float(right[scored].mean()) if n_scored else math.nan
    return DecidedSummary(
        n_pairs=n,
        n_decided=int(decided.sum()),
        n_decided_scored=n_scored,
        coverage=float(decided.sum() / n) if n else math.nan,
        coverage_non_tie=n_scored / n_non_tie if n_non_tie else math.nan,
        accuracy=acc,
        error=1.0 - acc if n_scored else math.nan,
    )


def verdicts_at(p_faster: ArrayLike, threshold: float) -> list[str]:
    """The verdict of each forecast under a confidence threshold (selective.decide)."""
    return [decide(float(x), threshold) for x in _vec(p_faster, "p_faster")]


def summarize(
    probs: Sequence[Sequence[float]] | FloatArray,
    speedups: ArrayLike,
    *,
    threshold: float | None = None,
    coverages: Sequence[float] = (0.5, 0.8),
) -> dict[str, Any]:
    """Every metric of one forecaster on one set of pairs, as a JSON-ready dict (nan becomes None)."""
    p = as_probs(probs)
    s = _vec(speedups, "speedups")
    if p.shape[0] != s.size:
        raise ValueError("probs and speedups must have the same number of pairs")
    pf = p_faster_of(p) if p.size else np.zeros(0)
    rc = direction_risk_coverage(pf, s)
    ties = tie_mask(s)
    calibrated_ece, calibrated_ece_p90 = ece_if_calibrated(pf, s)
    out: dict[str, Any] = {
        "n_pairs": int(s.size),
        "n_ties": int(ties.sum()),
        "pairwise_accuracy": pairwise_accuracy(pf, s),
        "bin_accuracy": bin_accuracy(p, s),
        "brier": brier(pf, s),
        "multiclass_brier": multiclass_brier(p, s),
        "log_loss": log_loss(pf, s),
        "ece": ece(pf, s),
        "ece_if_calibrated": calibrated_ece,
        "ece_if_calibrated_p90": calibrated_ece_p90,
        "aurc": rc.aurc,
        "mean_confidence": _mean_or_nan(confidence(pf)[~ties]),
    }
    for c in coverages:
        out[f"risk_at_{round(c * 100)}"] = rc.risk_at(c)
    if threshold is not None:
        d = decided_summary(verdicts_at(pf, threshold), s)
        out["threshold"] = threshold
        out["coverage"] = d.coverage
        out["coverage_non_tie"] = d.coverage_non_tie
        out["n_decided"] = d.n_decided
        out["decided_accuracy"] = d.accuracy
        out["decided_error"] = d.error
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}
