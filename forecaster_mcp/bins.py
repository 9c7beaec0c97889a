"""The 8 speedup bins: one definition shared by prompt, schema, labels and metrics.

Speedup S = t(baseline) / t(candidate). Bins are symmetric in log2 S with edges
-2, -1, -0.5, 0, 0.5, 1, 2: (-inf,-2) [-2,-1) [-1,-0.5) [-0.5,0) [0,0.5) [0.5,1) [1,2) [2,inf).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

EDGES_LOG2: tuple[float, ...] = (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)
N_BINS = len(EDGES_LOG2) + 1
# Everything else about the bins is derived from EDGES_LOG2, so prompt, schema, labels and metrics cannot
# disagree (the paper's code labelled data with other edges than its prompt described).
_BOUNDS: tuple[float, ...] = (-math.inf, *EDGES_LOG2, math.inf)


def _edge_text(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"


LABELS: tuple[str, ...] = tuple(
    f"{'(' if lo == -math.inf else '['}{_edge_text(lo)},{_edge_text(hi)})"
    for lo, hi in itertools.pairwise(_BOUNDS)
)
# Representative log2 speedup of each bin: its midpoint; the open ends half a unit past the outer edges.
CENTERS_LOG2: tuple[float, ...] = tuple(
    lo + 0.5 if hi == math.inf else hi - 0.5 if lo == -math.inf else (lo + hi) / 2
    for lo, hi in itertools.pairwise(_BOUNDS)
)
FASTER_BINS = range(EDGES_LOG2.index(0.0) + 1, N_BINS)  # log2 S >= 0
TIE_LOG2 = math.log2(1.03)


def is_tie(speedup: float) -> bool:
    """A pair within measurement noise (|log2 S| <= TIE_LOG2): the metrics score no direction on it."""
    return abs(math.log2(speedup)) <= TIE_LOG2


def describe() -> str:
    """Human text of the bins, for prompts and docs."""
    parts = []
    for i, label in enumerate(LABELS):
        lo, hi = 2.0 ** _BOUNDS[i], 2.0 ** _BOUNDS[i + 1]  # 2**-inf = 0, 2**inf = inf
        parts.append(f"bin {i}: log2 S in {label} (S in [{lo:.3g}, {hi:.3g}))")
    return "\n".join(parts)


def bin_index(speedup: float) -> int:
    """The bin holding a speedup S > 0."""
    if not speedup > 0 or math.isnan(speedup):
        raise ValueError(f"speedup must be positive, got {speedup}")
    x = math.log2(speedup)
    for i, edge in enumerate(EDGES_LOG2):
        if x < edge:
            return i
    return N_BINS - 1


def normalize(probs: Sequence[float]) -> list[float]:
    """Clip to non-negative and renormalise 8 probabilities; uniform if all zero."""
    if len(probs) != N_BINS:
        raise ValueError(f"expected {N_BINS} probabilities, got {len(probs)}")
    clipped = [max(0.0, float(p)) if math.isfinite(p) else 0.0 for p in probs]
    total = sum(clipped)
    if total <= 0:
        return [1.0 / N_BINS] * N_BINS
    return [p / total for p in clipped]


def p_faster(probs: Sequence[float]) -> float:
    """Mass on S > 1 (log2 S >= 0)."""
    return float(sum(probs[i] for i in FASTER_BINS))


def expected_log2(probs: Sequence[float], centers: Sequence[float] | None = None) -> float:
    """Expected log2 S of the bin distribution: each bin's probability times its representative value.

    `centers` are a forecast's own values per bin (its mean within each bin, `normal_bins`); without them the
    fixed CENTERS_LOG2 stand in, which rounds a confident forecast of S = 1.03 to about 1.15."""
    values = CENTERS_LOG2 if centers is None else centers
    return float(sum(p * c for p, c in zip(probs, values, strict=True)))


def expected_speedup(probs: Sequence[float], centers: Sequence[float] | None = None) -> float:
    """Geometric expectation of S from the bin distribution (see `expected_log2`)."""
    return float(2.0 ** expected_log2(probs, centers))


def speedup_text(speedup: float, decimals: int = 2) -> str:
    """A speedup as a rationale writes it: `decimals` decimals from 0.01 to 1000 ("1.37"), 3 significant digits
    outside them, as the expected_speedup field reads ("3e-08" and "1e+10", not "0.00" and "9999818868.72")."""
    if 0.01 <= abs(speedup) <= 1000.0 or speedup == 0.0 or not math.isfinite(speedup):
        return f"{speedup:.{decimals}f}"
    return f"{speedup:.3g}"


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def from_normal(mean_log2: float, std_log2: float) -> list[float]:
    """Bin probabilities of a normal distribution over log2 S."""
    return normal_bins(mean_log2, std_log2)[0]


def normal_bins(mean_log2: float, std_log2: float) -> tuple[list[float], list[float]]:
    """Bin probabilities of a normal distribution over log2 S, and its mean within each bin.

    The within-bin means (truncated-normal means) make `expected_log2` return `mean_log2` itself; a bin the
    normal leaves empty gets the point of the bin nearest the mean. A mean or spread that is not a finite
    number is refused: NaN would otherwise put all the mass in the fastest bin (a confident "faster")."""
    if not (math.isfinite(mean_log2) and math.isfinite(std_log2)):
        raise ValueError(f"a forecast needs a finite mean and spread, got {mean_log2!r}, {std_log2!r}")
    std = max(std_log2, 1e-6)
    z = [-math.inf, *((e - mean_log2) / std for e in EDGES_LOG2), math.inf]
    cdf = [_phi(v) if math.isfinite(v) else float(v > 0) for v in z]
    dens = [math.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi) if math.isfinite(v) else 0.0 for v in z]
    edges = [-math.inf, *EDGES_LOG2, math.inf]
    mass, centers = [], []
    for i in range(N_BINS):
        m = cdf[i + 1] - cdf[i]
        mass.append(m)
        nearest = min(max(mean_log2, edges[i]), edges[i + 1])
        # Far in a tail the difference of densities loses its digits: keep the mean inside its bin.
        c = mean_log2 + std * (dens[i] - dens[i + 1]) / m if m > 1e-12 else nearest
        centers.append(min(max(c, edges[i]), edges[i + 1]) if math.isfinite(c) else nearest)
    return normalize(mass), centers


def mix_centers(
    parts: Sequence[tuple[Sequence[float], Sequence[float]]], fallback: Sequence[float]
) -> list[float]:
    """Each bin's mean log2 S across distributions given as (mass per bin, mean within each bin), weighted by
    their mass in that bin; `fallback` where none puts mass there."""
    out = []
    for i in range(N_BINS):
        mass = sum(m[i] for m, _ in parts)
        value = sum(m[i] * c[i] for m, c in parts)
        out.append(value / mass if mass > 1e-15 else fallback[i])
    return out


def from_samples(log2_samples: Sequence[float]) -> list[float]:
    """Bin histogram of samples of log2 S."""
    counts = [0.0] * N_BINS
    for x in log2_samples:
        counts[bin_index(2.0**x)] += 1.0
    return normalize(counts)


def one_hot(speedup: float) -> list[float]:
    out = [0.0] * N_BINS
    out[bin_index(speedup)] = 1.0
    return out
