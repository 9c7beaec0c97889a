"""The selective policy: decide faster/slower only when calibrated confidence clears a certified threshold.

A threshold t is certified when the Clopper-Pearson upper confidence bound (level 1 - delta) on the error
rate of history pairs with confidence >= t is at most `target_error`. Candidate thresholds are tested in a
fixed sequence from high to low and testing stops at the first failure, which controls the chance that
*any* accepted threshold has a true error above target at delta without splitting delta across the
thresholds (fixed-sequence testing, as in Learn-then-Test). We return the lowest accepted threshold.

While history is short we use a default threshold of 1 - target_error / 2: a calibrated forecaster errs with
probability at most 1 - confidence on each decided pair, so its decided error stays below target_error / 2.
Even then, the pairs already verified at or above it can refute it: when their errors are significantly above
target (a one-sided binomial test at delta), nothing is decided.
Once history is long enough to test but certifies nothing, the default stays only while the verified pairs
at or above it err at most target_error of the time; otherwise nothing is decided. And once those pairs are as
many as would certify the default for a forecaster calibrated there in 1 - delta of draws (proof_count: 299 at
target 0.1, default 0.95), it stays only where they do certify it.
A caller that knows its forecasts to be less reliably calibrated passes a stricter default (the engine does
for pairs of two unmeasured kernels).

Limits, known and kept: the default kept on history shorter than proof_count rests on the point estimate, not
on a bound (an overconfident forecaster whose error at the default is a little above target keeps deciding
until its record there reaches that count: uninformative confidences erring 12%, target 0.1, 1,000 verified
pairs, of which about 100 at the default: decided error above target in 30% of draws); and the
engine re-chooses the threshold as history grows, each choice valid at delta but not all of them together
(a threshold whose true error sits just above target is certified at some look more often than delta).
A verdict on a kernel that then fails for good while the other runs is verified as the one that ran being the
better choice (store: verified_failure), so "faster" said of a kernel that never ran counts as an error.
The verified history is what got measured, not a random sample of the verdicts: measure_next lists unsure and
faster candidates and leaves confident "slower" ones out, so errors among "slower" verdicts are seen less
often than they happen. The engine certifies on its newest verified forecasts only (engine.HISTORY_WINDOW,
or as many as the target error needs), scored as today's calibration, fitted without them, would issue them
(ForecastEngine._rescored: out of fold), not at the confidence they were issued at: an underconfident
forecaster's early forecasts were issued too low and are right more often than today's at that confidence
(logit slope 0.33, 1,000 verified pairs, target 0.1: decided error above target in 11.2% of 600 histories
scored as issued, 3.0% out of fold; benchmarks/bench_selective.py --slope 0.33 --history issued|oof). Scored
in sample instead, on the fit made from them, a calibrated forecaster's history looks better than it is (5.8%
of 600 against 4.7%). Forecasts stored before their chances of failing were kept (store migration 14) still
count as issued.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from forecaster_mcp.models import Verdict

# Thresholds tested, high to low: a fixed grid, so the sequence never depends on the outcomes.
GRID: tuple[float, ...] = tuple(round(0.995 - 0.005 * i, 3) for i in range(99))
NEVER = 1.0  # a threshold of 1.0 decides nothing (calibrated confidences stay below 1)

ChoiceSource = Literal["history", "default", "never"]

# The target_error range every entry point accepts (compare_kernels, eval, the settings default). Below the
# minimum no history could ever certify a threshold (it takes about 3 / target_error verified pairs without
# one error), so every verdict would stay unsure.
MIN_TARGET_ERROR = 1e-4
MAX_TARGET_ERROR = 0.5


@dataclass(frozen=True)
class ThresholdChoice:
    """A confidence threshold and why it was chosen."""

    threshold: float
    n_history: int  # scored (non-tie) history pairs considered
    error_ucb: float | None  # upper bound on the decided error at this threshold; None when not certified
    reason: str
    source: ChoiceSource = "default"
    n_above: int = 0  # history pairs with confidence >= threshold
    target_error: float = 0.1
    delta: float = 0.05

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _level(p: float) -> str:
    """A confidence level as text with the digits it needs: 0.95 as 0.95, 0.99995 as 0.99995 (not 1.000)."""
    return f"{p:.6g}"


def default_threshold(target_error: float) -> float:
    """The threshold used while history is short: safe for a calibrated forecaster."""
    return 1.0 - target_error / 2.0


def min_count_zero_errors(target_error: float, delta: float) -> int:
    """Fewest pairs for which zero errors certify `target_error` (1 - delta**(1/n) <= target)."""
    if not 0.0 < target_error < 0.5:
        raise ValueError(f"target_error must be in (0, 0.5), got {target_error}")
    # log1p: 1.0 - target_error rounds to 1.0 (a zero division) for a target below about 1e-16.
    count = math.log(delta) / math.log1p(-target_error)
    if not math.isfinite(count):
        raise ValueError(f"target_error {target_error!r} is too small to certify with any history")
    return math.ceil(count)


@functools.lru_cache(maxsize=256)
def proof_count(target_error: float, delta: float, default: float) -> int | float:
    """Pairs at or above the `default` threshold from which it is kept only where they certify it: the fewest
    with which a forecaster calibrated there (erring on 1 - default of them, or less) certifies `target_error`
    in at least 1 - delta of draws. Below that count a record short of a proof is no evidence against the
    default; from it on, failing to certify is. Infinite where a calibrated forecaster could never certify
    (1 - default >= target_error)."""
    p = 1.0 - default
    if not 0.0 <= p < target_error:
        return math.inf
    if p == 0.0:
        return min_count_zero_errors(target_error, delta)
    z = statistics.NormalDist().inv_cdf(1.0 - delta)
    # The normal approximation's count, then up until the exact binomial agrees (discreteness).
    n = max(1, math.ceil((z * (math.sqrt(target_error * (1 - target_error)) + math.sqrt(p * (1 - p)))
                          / (target_error - p)) ** 2))  # fmt: skip
    while True:
        k = math.floor(n * target_error)  # the most errors with which n pairs certify
        while k >= 0 and not _certifies(k, n, target_error, delta):
            k -= 1
        if k >= 0 and binom_cdf(k, n, p) >= 1.0 - delta:
            return n
        n += max(1, n // 100)


def default_min_history(target_error: float, delta: float) -> int:
    """History needed before a threshold is tested: twice the zero-error minimum, so one unlucky
    error at the top of the sequence does not end it."""
    return 2 * min_count_zero_errors(target_error, delta)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    j = np.arange(1, k + 1, dtype=np.float64)
    log_comb = np.r_[0.0, np.cumsum(np.log(n - j + 1.0) - np.log(j))]
    jj = np.arange(0, k + 1, dtype=np.float64)
    log_pmf = log_comb + jj * math.log(p) + (n - jj) * math.log1p(-p)
    top = float(log_pmf.max())
    return float(min(1.0, math.exp(top) * np.exp(log_pmf - top).sum()))


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided upper confidence bound (level 1 - delta) on a binomial proportion with k of n."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if binom_cdf(k, n, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _certifies(k: int, n: int, target_error: float, delta: float) -> bool:
    # UCB <= target  <=>  P(X <= k; n, target) <= delta (the CDF falls as p grows).
    return n > 0 and binom_cdf(k, n, target_error) <= delta


def _refutes(k: int, n: int, target_error: float, delta: float) -> bool:
    """k errors in n pairs are evidence at level delta that the error rate is above target (one-sided
    binomial test: P(X >= k; n, target) <= delta)."""
    return n > 0 and k > 0 and 1.0 - binom_cdf(k - 1, n, target_error) <= delta


def choose_threshold(
    confidences: Sequence[float] | np.ndarray[Any, Any],
    correct: Sequence[float] | np.ndarray[Any, Any],
    target_error: float,
    delta: float = 0.05,
    *,
    min_history: int | None = None,
    default: float | None = None,
) -> ThresholdChoice:
    """The lowest confidence threshold certified on history (see the module docstring).

    `confidences`: calibrated confidence (max(p, 1 - p)) of each verified non-tie forecast, as it was
    issued; `correct`: 1 if its direction was right, 0 if wrong (fractions are rounded up as errors).
    `default`: the threshold while history is short (default_threshold(target_error) unless given).
    """
    if not 0.0 < target_error < 0.5:
        raise ValueError(f"target_error must be in (0, 0.5), got {target_error}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    conf = np.asarray(confidences, dtype=np.float64)
    err = 1.0 - np.asarray(correct, dtype=np.float64)
    if conf.shape != err.shape:
        raise ValueError("confidences and correct must have the same length")
    n = int(conf.size)
    default = default_threshold(target_error) if default is None else default
    if not 0.5 <= default <= 1.0:
        raise ValueError(f"default threshold must be in [0.5, 1], got {default}")
    need = default_min_history(target_error, delta) if min_history is None else max(1, min_history)

    def choice(
        threshold: float, ucb: float | None, reason: str, source: ChoiceSource, n_above: int
    ) -> ThresholdChoice:
        return ThresholdChoice(threshold, n, ucb, reason, source, n_above, target_error, delta)

    if n < need:
        n_d, k_d = _decided_at(conf, err, default)
        if _refutes(k_d, n_d, target_error, delta):
            return choice(
                NEVER,
                None,
                f"{n} verified pairs, too few to certify a threshold, but at confidence >= {_level(default)} the "
                f"forecaster erred on {k_d} of {n_d}: far above target {target_error:g} (binomial test at "
                f"delta {delta:g}), so no forecast is decided until it is recalibrated",
                "never",
                0,
            )
        return choice(
            default,
            None,
            f"{n} verified pairs, fewer than the {need} needed to certify a threshold: "
            f"default {_level(default)} (safe if the forecaster is calibrated)",
            "default",
            n_d,
        )

    accepted: tuple[float, int, int] | None = None
    for t in GRID:
        n_t, k_t = _decided_at(conf, err, t)
        if n_t < need:
            continue  # too few pairs this high to be worth a test; skipping depends on confidences only
        if not _certifies(k_t, n_t, target_error, delta):
            break
        accepted = (t, n_t, k_t)
    if accepted is not None:
        t, n_t, k_t = accepted
        # Tighten to the least confident history pair it admits: the same pairs, the same bound, and no
        # decisions extrapolated to confidences history never saw.
        t = float(conf[conf >= t].min())
        ucb = clopper_pearson_upper(k_t, n_t, delta)
        return choice(
            t,
            ucb,
            f"certified on {n_t} of {n} verified pairs: {k_t} errors, "
            f"error bound {ucb:.3f} <= target {target_error:g} at delta {delta:g}",
            "history",
            n_t,
        )

    # Nothing certified. The default stays only while the history at it is no evidence against it: no pair
    # that confident yet, or an observed error there within target (too few pairs to certify, not enough
    # to refute). Its burden is the point estimate, not a test proving it errs: an overconfident forecaster
    # whose error at the default sits a little above target would otherwise keep deciding for ever.
    n_d, k_d = _decided_at(conf, err, default)
    proof = proof_count(target_error, delta, default)
    if n_d >= proof and not _certifies(k_d, n_d, target_error, delta):
        return choice(
            NEVER,
            None,
            f"at confidence >= {_level(default)} the forecaster erred on {k_d} of {n_d} verified pairs: a record "
            f"this long (at least {proof}) certifies the default for a forecaster calibrated there, and this one "
            f"does not (target {target_error:g}, delta {delta:g}): no forecast is decided until it is recalibrated",
            "never",
            0,
        )
    if n_d > 0 and k_d > target_error * n_d:
        return choice(
            NEVER,
            None,
            f"at confidence >= {_level(default)} the forecaster erred on {k_d} of {n_d} verified pairs, "
            f"above target {target_error:g}, and no threshold is certified: no forecast is decided until "
            "it is recalibrated",
            "never",
            0,
        )
    return choice(
        default,
        None,
        f"no threshold certified on {n} verified pairs; at the default {_level(default)} the forecaster erred on "
        f"{k_d} of {n_d}, within target: default kept",
        "default",
        n_d,
    )


def _decided_at(conf: np.ndarray[Any, Any], err: np.ndarray[Any, Any], threshold: float) -> tuple[int, int]:
    """(pairs, errors) of the history at confidence >= `threshold`. Half-credit coin flips count as errors:
    the bound must stay conservative."""
    sel = conf >= threshold
    return int(sel.sum()), math.ceil(float(err[sel].sum()) - 1e-9)


def refuted_below(
    choice: ThresholdChoice,
    confidences: Sequence[float] | np.ndarray[Any, Any],
    correct: Sequence[float] | np.ndarray[Any, Any],
    what: str,
) -> ThresholdChoice:
    """`choice` (made on a wider history: pooled over GPUs, or a GPU's for one kernel family), or NEVER when
    the narrower history `confidences`/`correct` (too short to choose on) refutes it: at the chosen threshold
    its error is far above target (the binomial test of `choose_threshold`). A GPU whose own 50 pairs erred on
    25 must not decide on a threshold other GPUs' 1000 right pairs certified."""
    if choice.threshold >= NEVER:
        return choice
    err = 1.0 - np.asarray(correct, dtype=np.float64)
    n, k = _decided_at(np.asarray(confidences, dtype=np.float64), err, choice.threshold)
    if not _refutes(k, n, choice.target_error, choice.delta):
        return choice
    return replace(
        choice,
        threshold=NEVER,
        error_ucb=None,
        source="never",
        n_above=0,
        reason=f"{choice.reason}; but {what} erred on {k} of {n} verified pairs at confidence >= "
        f"{choice.threshold:.3f}, far above target {choice.target_error:g} (binomial test at delta "
        f"{choice.delta:g}): no forecast is decided until it is recalibrated",
    )


def p_fail_of(extras: Mapping[str, float]) -> float:
    """The chance a forecast's candidate fails to compile or run, from its extras (the local model says;
    0 where no forecaster does)."""
    return float(extras.get("p_fail", 0.0))


def p_fail_baseline_of(extras: Mapping[str, float]) -> float:
    """The same for the forecast's baseline."""
    return float(extras.get("p_fail_baseline", 0.0))


def _runs(p_fail: float) -> float:
    return 1.0 - min(1.0, max(0.0, p_fail))


def decision_p(p_faster: float, p_fail: float = 0.0, p_fail_baseline: float = 0.0) -> float:
    """The forecast as `decide` weighs it, written as a p_faster: max(p, 1 - p) is the chance `decide` compares
    with the threshold and p > 0.5 its direction (the candidate's chance of being the better choice, or 1 - the
    baseline's). With no chance of failing it is p_faster. Verified forecasts certify thresholds on this: a
    verdict a likely failure decided against its runtime forecast ("faster" at p_faster 0.07, the baseline
    likely failing) is scored by the direction it took, not by p_faster's (which counted it right when the
    baseline then ran and was faster)."""
    if not all(math.isfinite(x) for x in (p_faster, p_fail, p_fail_baseline)):
        return 0.5
    runs, baseline_runs, p = _runs(p_fail), _runs(p_fail_baseline), min(1.0, max(0.0, p_faster))
    if p_fail <= 0.0 and p_fail_baseline <= 0.0:
        return p
    better = runs * (1.0 - baseline_runs + baseline_runs * p)
    # "slower" also for a candidate that fails with probability at least the threshold, whatever the baseline.
    worse = max(baseline_runs * (1.0 - runs + runs * (1.0 - p)), min(1.0, p_fail))
    if max(better, worse) < 0.5:
        return 0.5  # neither direction would be decided at any threshold
    return better if better >= worse else 1.0 - worse


def decision_p_array(p_faster: Any, p_fail: Any, p_fail_baseline: Any) -> np.ndarray[Any, Any]:
    """`decision_p` of arrays, element by element (the engine scores verified forecasts again with it)."""
    pf, fail, fail_b = (np.asarray(x, dtype=np.float64) for x in (p_faster, p_fail, p_fail_baseline))
    runs, baseline_runs = 1.0 - np.clip(fail, 0.0, 1.0), 1.0 - np.clip(fail_b, 0.0, 1.0)
    p = np.clip(pf, 0.0, 1.0)
    better = runs * (1.0 - baseline_runs + baseline_runs * p)
    worse = np.maximum(baseline_runs * (1.0 - runs + runs * (1.0 - p)), np.minimum(1.0, fail))
    out = np.where(better >= worse, better, 1.0 - worse)
    out = np.where(np.maximum(better, worse) < 0.5, 0.5, out)
    out = np.where((fail <= 0.0) & (fail_b <= 0.0), p, out)
    finite = np.isfinite(pf) & np.isfinite(fail) & np.isfinite(fail_b)
    return np.asarray(np.where(finite, out, 0.5), dtype=np.float64)


def decide(p_faster: float, threshold: float, p_fail: float = 0.0, p_fail_baseline: float = 0.0) -> Verdict:
    """ "faster" / "slower" when that direction's probability clears the threshold, else "unsure".

    `p_faster` is the chance the candidate is faster if both run; `p_fail` the chance the candidate fails to
    compile or run, `p_fail_baseline` the baseline's. A kernel is the better choice when it runs and the other
    fails or is slower: "faster" needs the candidate's chance of that, (1 - p_fail) * (p_fail_baseline +
    (1 - p_fail_baseline) * p_faster), to clear the threshold, "slower" the baseline's. compare(A, B) and
    compare(B, A) then agree: a candidate that runs beats a baseline that (surely) fails, in either order.
    Also "slower": a candidate that fails with probability at least the threshold (one measured as failing),
    whatever the baseline; a failing kernel is never the better choice, even against a baseline that fails
    too. When both kernels fail with probability at least the threshold, both orders are therefore "slower"
    (neither is the better choice). The two orders differ only when the other kernel's chance of failing is
    below the threshold yet too high for it to be decided "faster" (0.97 against 0.2 at threshold 0.95): that
    order is then "unsure". A non-finite input is "unsure"."""
    if threshold >= NEVER or not all(math.isfinite(x) for x in (p_faster, p_fail, p_fail_baseline)):
        return "unsure"
    runs, baseline_runs, p = _runs(p_fail), _runs(p_fail_baseline), min(1.0, max(0.0, p_faster))
    if runs * (1.0 - baseline_runs + baseline_runs * p) >= threshold:
        return "faster"
    if baseline_runs * (1.0 - runs + runs * (1.0 - p)) >= threshold or p_fail >= threshold:
        return "slower"
    return "unsure"
