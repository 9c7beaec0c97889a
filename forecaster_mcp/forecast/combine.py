"""Combine several forecasters' calibrated distributions of the same pair into one.

p_faster: a logarithmic opinion pool, logit(p) = sum_i w_i * logit(p_i), with weights w_i >= 0 fitted by
maximum a posteriori log loss on verified pairs that every component forecast, under a Gaussian prior at
equal weights 1/m, once MIN_FIT_PAIRS such pairs are verified (as calibration). With little history the pool is the geometric mean of the components' odds; with more
it learns to trust the better forecaster and, when the components err independently, to sum their
evidence (weights adding up to more than 1).

The 8 bins: a linear pool of the components' bins (weights normalised to sum 1) rescaled so the faster
half holds the pooled p_faster, as calibration does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from forecaster_mcp import bins
from forecaster_mcp.forecast.calibration import MIN_FIT_PAIRS, logit, map_logistic, sigmoid, with_p_faster

FloatArray = npt.NDArray[np.float64]

STATE_VERSION = 1
PRIOR_SD_WEIGHT = 0.5


@dataclass(frozen=True)
class Combiner:
    """Log-odds weights of named components."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    n_pairs: int = 0

    def __post_init__(self) -> None:
        if len(self.names) != len(self.weights) or not self.names:
            raise ValueError("a combiner needs one weight per component and at least one component")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"component names must be unique: {self.names}")

    @classmethod
    def equal(cls, names: Sequence[str]) -> Combiner:
        m = len(names)
        return cls(tuple(names), tuple([1.0 / m] * m), 0)

    @classmethod
    def fit(
        cls,
        names: Sequence[str],
        p_calibrated: Sequence[Sequence[float]] | FloatArray,
        faster: Sequence[bool] | npt.NDArray[np.bool_],
        prior_sd: float = PRIOR_SD_WEIGHT,
    ) -> Combiner:
        """Fit weights from an (n, m) array of calibrated p_faster (columns in `names` order) and outcomes."""
        m = len(names)
        p = np.asarray(p_calibrated, dtype=np.float64).reshape(-1, m)
        y = np.asarray(faster, dtype=np.float64)
        if p.shape[0] != y.size:
            raise ValueError("p_calibrated and faster must have the same number of pairs")
        if y.size < MIN_FIT_PAIRS:
            # As calibration: one verified miss at 0.97 pulled both weights to 0.026, and two components each
            # at 0.995 then pooled to 0.57 (the next verdicts unsure) until several more pairs came in.
            return cls.equal(names)
        w = map_logistic(
            logit(p),
            y,
            prior_mean=np.full(m, 1.0 / m),
            prior_precision=np.full(m, prior_sd**-2),
            lower=np.zeros(m),
        )
        return cls(tuple(names), tuple(float(v) for v in w), int(y.size))

    def combine(self, probs_by_name: Mapping[str, Sequence[float]]) -> list[float]:
        """The pooled 8-bin distribution of the components present (at least one).

        With every component present the fitted weights apply; with a subset they are rescaled to sum 1
        (a plain weighted average of log-odds), and a single component passes through unchanged.
        """
        present = [n for n in self.names if n in probs_by_name]
        unknown = set(probs_by_name) - set(self.names)
        if unknown:
            raise ValueError(f"unknown components {sorted(unknown)}; this combiner pools {list(self.names)}")
        if not present:
            raise ValueError("nothing to combine: no component answered")
        if len(present) == 1:
            return bins.normalize(probs_by_name[present[0]])
        weight = dict(zip(self.names, self.weights, strict=True))
        w = np.array([weight[n] for n in present])
        total = float(w.sum())
        if total <= 0:
            # History taught that none of these components is worth its word: no evidence, p_faster 0.5 (equal
            # weights here made a worse record, all weights 0, pool as confidently as a clean one).
            mean = np.array([bins.normalize(probs_by_name[n]) for n in present]).mean(axis=0)
            return with_p_faster([float(v) for v in mean], 0.5)
        if len(present) < len(self.names):
            w = w / total
            total = 1.0
        rows = np.array([bins.normalize(probs_by_name[n]) for n in present])
        linear = [float(v) for v in (w / total) @ rows]
        pf = np.array([bins.p_faster(r) for r in rows])
        p_pool = float(sigmoid(float(w @ logit(pf))))
        return with_p_faster(linear, p_pool)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "logpool",
            "version": STATE_VERSION,
            "names": list(self.names),
            "weights": list(self.weights),
            "n_pairs": self.n_pairs,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Combiner:
        """Parse a saved state; ValueError when it is not one this version wrote."""
        try:
            if d.get("kind") != "logpool" or d.get("version") != STATE_VERSION:
                raise ValueError(f"unknown combiner state kind/version: {d.get('kind')}/{d.get('version')}")
            weights = tuple(float(w) for w in d["weights"])
            if any(not np.isfinite(w) or w < 0 for w in weights):
                raise ValueError(f"bad combiner weights {weights}")
            return cls(tuple(str(n) for n in d["names"]), weights, int(d.get("n_pairs", 0)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"unreadable combiner state: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Combiner:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"unreadable combiner state: {exc}") from exc
