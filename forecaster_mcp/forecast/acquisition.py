"""Which candidates are most worth a measurement: `rank_for_measurement`.

The value of measuring a candidate against the baseline (in a search, the best kernel measured so far) is
its expected improvement in log2 speedup, discounted by its chance of failing to compile or run:

    value = (1 - p_fail) * E[max(0, log2 S - xi)]        S = t(baseline) / t(candidate), xi = XI_LOG2

This rewards both the chance and the size of beating the baseline, and nothing else: a candidate that is
very uncertain but almost surely slower is worth little, one that is probably a little faster is worth
more, and one that might be much faster is worth the most. When the forecast carries the local model's
numbers (`extras["mu_log2"]`, `extras["sd_log2"]`, and the tail shape) the expectation is exact for its
predictive distribution (a two-component normal scale mixture); otherwise (several forecasters combined)
it is taken over the 8 bins, each represented by the conditional mean of a standard shape inside it. Candidates already measured
(`extras["measured"] >= 1`) are left out: measuring them again teaches nothing. Ties (for instance a cold
start where every value is equal) are broken by p_faster, then by the input order. The reference is the best
kernel measured so far, not whichever baseline a client named (`against_best`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from forecaster_mcp import bins

# Mean log2 speedup inside each faster bin, used when only the bins are known: the lower half-bin near 0
# is where most of the mass of a forecast centred near a tie lies, so its representative is below 0.25.
_FASTER_BIN_VALUE = {4: 0.2, 5: 0.72, 6: 1.4, 7: 2.5}


@dataclass(frozen=True)
class AcqItem:
    """One candidate's forecast against the baseline."""

    id: str
    probs: Sequence[float]  # 8 bins of log2 S against the baseline
    extras: Mapping[str, float] = field(default_factory=dict)
    p_faster: float = 0.5
    # The candidate's content key when it is a configuration of the baseline's own kernel family (a tuning
    # loop); None otherwise. What a young family's exploration orders by (rank_for_measurement).
    explore_key: str | None = None


def _phi(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


# Only the part of an improvement beyond this margin (log2; 0.08 is about 6%) counts. Plain expected
# improvement keeps polishing the incumbent's basin with near-certain tiny gains; with the margin, a
# candidate must have a real chance of a clear win, which moves a stuck search to other basins. Tuned on
# the TUNE spaces of benchmarks/tune_local.py: it removed most of the stuck runs and cost under 0.3% on
# flat spaces where every improvement is small.
XI_LOG2 = 0.08
# Once a family has XI_LATE_POINTS measurements the basins have been explored and what is left is
# polish: the margin drops to XI_LATE_LOG2 so near-certain small wins count again. Measured with a plain
# random-pool client (10 seeds, 90 steps) it turned 7 of 150 held-out runs below 0.9 of the space's best
# into 3 (sum of per-space means 14.62 -> 14.69 over 15 spaces) and was no worse on the TUNE spaces
# (12 -> 11 runs below 0.9, sum of means 7.72 -> 7.75).
XI_LATE_LOG2 = 0.0
XI_LATE_POINTS = 50


def margin(extras: Mapping[str, float]) -> float:
    """The margin an improvement must clear for this candidate's family (see XI_LOG2)."""
    return XI_LATE_LOG2 if float(extras.get("n_family_points", 0.0)) >= XI_LATE_POINTS else XI_LOG2


def normal_ei(mean: float, sd: float, xi: float = XI_LOG2) -> float:
    """E[max(0, X - xi)] for X ~ Normal(mean, sd^2)."""
    mean = mean - xi
    if sd <= 1e-12:
        return max(0.0, mean)
    z = mean / sd
    return sd * _phi(z) + mean * _cdf(z)


def expected_improvement(item: AcqItem) -> float:
    """E[max(0, log2 S - margin)] of one candidate (before the failure discount)."""
    ex = item.extras
    xi = margin(ex)
    mu, sd = ex.get("mu_log2"), ex.get("sd_log2")
    if mu is not None and sd is not None and math.isfinite(mu) and math.isfinite(sd):
        w = float(ex.get("tail_weight", 0.0))
        if w > 0:
            scale = float(ex.get("tail_scale", 1.0))
            # sd_log2 is the mixture's overall sd; recover the core component's sd from it.
            core = sd / math.sqrt((1.0 - w) + w * scale * scale)
            return (1.0 - w) * normal_ei(mu, core, xi) + w * normal_ei(mu, core * scale, xi)
        return normal_ei(mu, sd, xi)
    probs = bins.normalize(list(item.probs))
    # Bins are against the baseline; `against_best` records how much faster than it the best measured is.
    gain = max(0.0, float(ex.get("best_gain_log2", 0.0)))
    return sum(probs[i] * max(0.0, v - gain - xi) for i, v in _FASTER_BIN_VALUE.items())


# Tuning switch (benchmarks): weigh the failure discount fully (1.0) or not at all (0.0).
FAIL_DISCOUNT = 1.0


def measurement_value(item: AcqItem) -> float:
    """Expected log2 improvement over the baseline, discounted by the chance the candidate fails."""
    if item.extras.get("measured", 0.0) >= 1.0:
        return 0.0
    p_fail = FAIL_DISCOUNT * min(1.0, max(0.0, float(item.extras.get("p_fail", 0.0))))
    return (1.0 - p_fail) * expected_improvement(item)


# A candidate whose forecast says "slower" is still worth a measurement when its expected gain over the
# baseline is at least this (log2; 0.002 is about a 0.14% speedup): a wide forecast that is probably slower
# but might be much faster (an untried corner of a tuning space) is what keeps a search from polishing one
# basin, and with "slower" left out entirely a screening call over a flat region lists nothing at all.
# A confident, narrow "slower" has an expected gain far below it and stays out. Chosen on the TUNE spaces of
# benchmarks/tune_local.py (plain client, 10 seeds): pnpoly 0.973 -> 0.994 mean best-fraction when slower
# candidates were never listed vs this floor; 0.005 emptied the list on flat regions again.
MIN_VALUE_LOG2 = 0.002


def worth_measuring(item: AcqItem, verdict: str) -> bool:
    """Unsure and faster candidates always are; slower ones only while their expected gain is real."""
    return verdict != "slower" or measurement_value(item) >= MIN_VALUE_LOG2


def against_best(item: AcqItem, t_base_ms: float | None, t_best_ms: float | None) -> AcqItem:
    """The item valued against the best kernel measured so far (`t_best_ms`) instead of its baseline.

    Forecasts are made against the baseline a client names, which need not be the best it has measured (a
    client may keep comparing against its first or reference kernel); a measurement is worth only what it
    may gain over the best. Exact for forecasts that carry the local model's numbers against a measured
    baseline (`t_base_ms`, then a constant); others, and a best no faster than the baseline, are left as
    they are. A forecast of bins only (several forecasters combined) keeps its bins and carries the gain
    (`extras["best_gain_log2"]`), which `expected_improvement` takes off each faster bin's value.

    A baseline without a measured runtime (`t_base_ms` None: not measured yet, or measured failing, against
    which every forecast is the extreme bin) says nothing about the best: a forecast that carries the
    candidate's own predicted runtime (`extras["cand_log2_ms"]`, with its spread) is valued against the best
    directly, as it would be against a measured baseline that is the best. The server passes the fastest
    kernel measured of any family in the call then, not the candidate's own family's best alone.
    """
    mu = item.extras.get("mu_log2")
    if t_base_ms is None and t_best_ms is not None and t_best_ms > 0.0:
        return _against_best_directly(item, t_best_ms)
    if t_base_ms is None or t_best_ms is None or not 0.0 < t_best_ms < t_base_ms:
        return item
    if item.extras.get("baseline_measured", 0.0) < 1.0:
        return item
    gain = math.log2(t_base_ms / t_best_ms)
    if mu is None or not math.isfinite(mu):
        return dataclasses.replace(item, extras={**item.extras, "best_gain_log2": gain})
    return dataclasses.replace(item, extras={**item.extras, "mu_log2": mu - gain})


def _against_best_directly(item: AcqItem, t_best_ms: float) -> AcqItem:
    """The item valued against a measured best from the candidate's own predicted runtime (`against_best`);
    as it is where the forecast carries none."""
    ex = item.extras
    own, sd = ex.get("cand_log2_ms"), ex.get("cand_sd_log2")
    if own is None or sd is None or not (math.isfinite(own) and math.isfinite(sd)):
        return item
    extras = {k: v for k, v in ex.items() if k not in ("tail_weight", "tail_scale")}
    extras.update(mu_log2=math.log2(t_best_ms) - own, sd_log2=sd)
    if (w := float(ex.get("cand_tail_weight", 0.0))) > 0.0:
        extras.update(tail_weight=w, tail_scale=float(ex.get("cand_tail_scale", 1.0)))
    return dataclasses.replace(item, extras=extras)


# While the baseline's family has fewer measurements than this, a call of configurations of that family only
# is ranked in an order drawn at random (from the candidates' content keys) instead of by value. Too few
# points make a family model that ranks confidently and wrongly, and so does the static prior within a
# tuning family: following either from the first measurements settles a search in whatever basin they
# favour. A client that measures the head of measure_next from its first measurement on gets a random start
# as long as the one the project's own search client makes (search.N_INIT) before the model steers. Measured
# with the plain random-pool client starting from 1 random measurement (held-out spaces, 6 seeds, 100
# measurements): sum of per-space mean best-fractions 14.48 -> 14.56 (a variant salted with the ids gave
# 14.62, and 14.50 -> 14.57 from 3 random measurements); a client making 10 random measurements itself is
# not affected (14.68). Seed noise on these sums is about 0.05.
EXPLORE_POINTS = 10


def _explore_order(items: Sequence[AcqItem]) -> list[AcqItem] | None:
    """`items` in a random order that depends on which candidates they are (the same call gets the same
    order, the next call of other candidates a fresh one), when exploration applies (EXPLORE_POINTS)."""
    keys = [it.explore_key for it in items]
    if not items or EXPLORE_POINTS <= 0 or any(k is None for k in keys):
        return None
    if any(float(it.extras.get("n_family_points", 0.0)) >= EXPLORE_POINTS for it in items):
        return None
    salt = "|".join(sorted(str(k) for k in keys))
    return sorted(items, key=lambda it: hashlib.sha256(f"{salt}#{it.explore_key}".encode()).digest())


def rank_for_measurement(items: Sequence[AcqItem]) -> list[str]:
    """Ids of the not-yet-measured candidates, most valuable to measure first (see module doc); in a random
    order while the baseline's family is young (EXPLORE_POINTS)."""
    unmeasured = [it for it in items if it.extras.get("measured", 0.0) < 1.0]
    explored = _explore_order(unmeasured)
    if explored is not None:
        return [it.id for it in explored]
    scored = [(measurement_value(it), it.p_faster, -i, it.id) for i, it in enumerate(unmeasured)]
    scored.sort(reverse=True)
    return [s[3] for s in scored]
