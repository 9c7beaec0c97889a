"""Timing statistics, pure: summaries, a distribution-free interval of the median, adaptive stopping and
plausibility checks (physical floor, events against wall clock).

Kernel timings are skewed (clock ramps, interference), so the centre is the median and its 95% interval
comes from order statistics (binomial), which needs no distribution assumption. Sampling stops when that
interval is narrow relative to the median (NVBench's stopping criterion, on the median rather than the mean)
or when a hard run or time cap is reached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from forecaster_mcp.measure.worker_protocol import StopReason
from forecaster_mcp.models import BufferArg, RuntimeStats, Workload

# Up to this many samples the ranks are exact (the log-space sum is fast); above it, the normal approximation.
_EXACT_RANKS_UP_TO = 2000


def _largest_tail_rank(n: int, tail: float) -> int:
    """Largest j with P(X <= j-1) <= tail for X ~ Binomial(n, 1/2), at most (n+1)//2 (log-space pmf)."""
    log_half_n = n * math.log(0.5)
    lg_n = math.lgamma(n + 1)
    cdf = 0.0
    j = 0
    while j + 1 <= (n + 1) // 2:
        cdf += math.exp(lg_n - math.lgamma(j + 1) - math.lgamma(n - j + 1) + log_half_n)  # adds P(X = j)
        if cdf > tail:
            break
        j += 1
    return j


def median_ci_ranks(n: int, confidence: float = 0.95) -> tuple[int, int]:
    """0-based indices (lo, hi) into the sorted sample whose values bound the median at `confidence`.

    The interval [x_(j), x_(n-j+1)] (1-based) covers the median with probability 1 - 2 P(X <= j-1). We take
    the largest j with P(X <= j-1) <= (1-confidence)/2; below 6 samples no j qualifies and the range is
    returned (coverage then under the nominal level).
    """
    if n <= 0:
        raise ValueError("no samples")
    tail = (1.0 - confidence) / 2.0
    if n <= _EXACT_RANKS_UP_TO:
        j = max(_largest_tail_rank(n, tail), 1)
    else:
        z = _normal_quantile(1.0 - tail)
        j = max(1, math.floor(n / 2.0 - z * math.sqrt(n) / 2.0))
    return j - 1, n - j


def median_ci_covers(n: int, confidence: float = 0.95) -> bool:
    """Whether n samples give an order-statistic interval of the median with at least `confidence` (from 6
    samples at 95%). Below that, `median_ci_ranks` returns the whole range, which covers less: 0% at one
    sample, 50% at two, 75% at three; a result says so with the flag `too_few_runs_for_interval`."""
    if n <= 0:
        return False
    return n > _EXACT_RANKS_UP_TO or _largest_tail_rank(n, (1.0 - confidence) / 2.0) >= 1


def _normal_quantile(p: float) -> float:
    # Acklam's rational approximation (|error| < 1.2e-9): keeps scipy off the server's import path.
    a = (
        -3.969683028665376e01,
        2.209460984245205e02,
        -2.759285104469687e02,
        1.383577518672690e02,
        -3.066479806614716e01,
        2.506628277459239e00,
    )
    b = (
        -5.447609879822406e01,
        1.615858368580409e02,
        -1.556989798598866e02,
        6.680131188771972e01,
        -1.328068155288572e01,
    )
    c = (
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e00,
        -2.549732539343734e00,
        4.374664141464968e00,
        2.938163982698783e00,
    )
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
        )
    if p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    q = p - 0.5
    r = q * q
    return (
        (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
        * q
        / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    )


def median_ci95(samples: Sequence[float]) -> tuple[float, float]:
    """95% interval of the median (order statistics)."""
    ordered = np.sort(np.asarray(samples, dtype=np.float64))
    lo, hi = median_ci_ranks(len(ordered))
    return float(ordered[lo]), float(ordered[hi])


def relative_noise(samples: Sequence[float]) -> float:
    """Half-width of the median's 95% interval over the median; inf when undefined."""
    if len(samples) == 0:
        return math.inf
    median = float(np.median(np.asarray(samples, dtype=np.float64)))
    if median <= 0 or not math.isfinite(median):
        return math.inf
    lo, hi = median_ci95(samples)
    return (hi - lo) / 2.0 / median


def summarize(samples_ms: Sequence[float]) -> RuntimeStats:
    """RuntimeStats (milliseconds) of a non-empty sample."""
    values = np.asarray(samples_ms, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no samples to summarize")
    lo, hi = median_ci95(values.tolist())
    median = float(np.median(values))
    return RuntimeStats(
        median=median,
        mean=float(values.mean()),
        min=float(values.min()),
        p10=float(np.percentile(values, 10)),
        p90=float(np.percentile(values, 90)),
        std=float(values.std(ddof=1)) if values.size > 1 else 0.0,
        ci95_low=lo,
        ci95_high=hi,
        runs=int(values.size),
        relative_noise=(hi - lo) / 2.0 / median if median > 0 else math.inf,
    )


@dataclass(frozen=True)
class StoppingRule:
    """When to stop sampling: the noise target once `min_runs` are in, else the run cap (the time cap is
    checked by the caller, who knows the clock)."""

    target_relative_noise: float = 0.01
    min_runs: int = 10
    max_runs: int = 1000


@dataclass
class AdaptiveStopper:
    """Collects samples and says when to stop. Re-checks the noise geometrically (every ~6% more samples)
    so a long run costs O(n log n) in total rather than a sort per sample."""

    rule: StoppingRule
    samples: list[float] = field(default_factory=list)
    _next_check: int = 0

    def __post_init__(self) -> None:
        self._next_check = max(1, min(self.rule.min_runs, self.rule.max_runs))

    def add(self, sample_ms: float) -> None:
        self.samples.append(float(sample_ms))

    def reason(self, seconds_left: float = math.inf, seconds_per_sample: float = 0.0) -> StopReason | None:
        """Why to stop now, or None to take another sample."""
        n = len(self.samples)
        if n >= self.rule.max_runs:
            return "max_runs"
        if n >= self._next_check:
            self._next_check = n + max(1, n // 16)
            if relative_noise(self.samples) <= self.rule.target_relative_noise:
                return "noise_target"
        if seconds_left < seconds_per_sample:
            return "time_cap"
        return None


# ---------------------------------------------------------------- plausibility


def floor_bytes(workload: Workload, l2_bytes: int = 0) -> int:
    """Bytes that must cross DRAM during one run: Workload.bytes_moved_floor(), less the output bytes that
    can stay in L2 as dirty lines after the kernel ends (a write-back cache need not write them in time)."""
    writes = sum(a.nbytes for a in workload.args if isinstance(a, BufferArg) and a.intent in ("out", "inout"))
    return max(0, workload.bytes_moved_floor() - min(writes, max(0, l2_bytes)))


def physical_floor_ms(bytes_moved: int, peak_bandwidth_gbs: float) -> float:
    """The fastest the bytes can move at peak DRAM bandwidth, in ms."""
    if peak_bandwidth_gbs <= 0:
        raise ValueError("peak bandwidth must be positive")
    return bytes_moved / (peak_bandwidth_gbs * 1e9) * 1e3


def below_physical_floor(
    median_ms: float, bytes_moved: int, peak_bandwidth_gbs: float, tolerance: float = 0.9
) -> bool:
    """True when the median beats peak bandwidth by more than the tolerance allows (a kernel that skipped
    work, read stale caches, or was not really timed)."""
    if bytes_moved <= 0 or peak_bandwidth_gbs <= 0:
        return False
    return median_ms < tolerance * physical_floor_ms(bytes_moved, peak_bandwidth_gbs)


def events_disagree(event_median_ms: float, wall_ms: Sequence[float], slack_ms: float = 0.25) -> bool:
    """True when host wall-clock around a device-wide sync is far above the CUDA-event time: work the events
    did not see (another stream) ran. Uses the fastest wall sample plus slack for launch and sync overhead."""
    if not wall_ms:
        return False
    return min(wall_ms) > 1.5 * event_median_ms + slack_ms
