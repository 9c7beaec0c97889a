"""Recalibrate a forecaster's p_faster (and consistently its 8 bins) from verified pairs.

Model: Platt scaling on the log-odds, p' = sigmoid(a * logit(p) + b), fitted by maximum a posteriori with a
Gaussian prior. The pooled fit (all hardware) has its prior at the identity (a = 1, b = 0); each hardware's
fit has its prior at the fit on the *other* GPUs' pairs (its own pairs must not count twice, once in the
prior and once in the data), so a GPU with little history leans on what the rest say. Nothing is fitted on
fewer than MIN_FIT_PAIRS pairs: the identity (pooled) or the pooled fit (a GPU) stays. `a` is kept >= 0: a
forecaster that looks anti-informative is flattened towards 0.5, never flipped.

The 8 bins are recalibrated by rescaling the faster half (log2 S >= 0) and the slower half so that their
masses become p' and 1 - p', which keeps each half's shape (the forecaster's view of how much faster).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from forecaster_mcp import bins

FloatArray = npt.NDArray[np.float64]

STATE_VERSION = 1
# Raw probabilities are clipped before taking logits so one "p = 1.0" cannot dominate a fit.
P_CLIP = 1e-4
# Calibrated probabilities never reach 0 or 1: a verdict must stay overturnable by evidence.
OUT_CLIP = 1e-6
PRIOR_SD_SLOPE = 0.5
PRIOR_SD_BIAS = 0.5
# Fewest verified pairs a fit is made on. One confidently wrong pair (raw p = 0.9999, logit 9.2) outweighs the
# slope's prior on its own and would flatten every forecast to one number (a = 0): the ranking lost on one
# unlucky pair. From ten on, a miss among them is evidence of overconfidence and tempers `a` honestly.
MIN_FIT_PAIRS = 10


def logit(p: float | FloatArray, clip: float = P_CLIP) -> Any:
    q = np.clip(p, clip, 1.0 - clip)
    return np.log(q) - np.log1p(-q)


def sigmoid(z: float | FloatArray) -> Any:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))


def with_p_faster(probs: Sequence[float], p_new: float) -> list[float]:
    """The 8 bins rescaled so the faster half holds `p_new`, each half keeping its shape.

    An empty half that must receive mass gets it in its bin nearest to S = 1.
    """
    p = bins.normalize(probs)
    p_new = min(1.0 - OUT_CLIP, max(OUT_CLIP, float(p_new)))
    faster_idx = list(bins.FASTER_BINS)
    slower_idx = [i for i in range(bins.N_BINS) if i not in bins.FASTER_BINS]
    out = list(p)
    for idx, target, nearest in (
        (faster_idx, p_new, faster_idx[0]),
        (slower_idx, 1.0 - p_new, slower_idx[-1]),
    ):
        mass = sum(p[i] for i in idx)
        if mass > 1e-12:
            for i in idx:
                out[i] = p[i] * target / mass
        else:
            for i in idx:
                out[i] = 0.0
            out[nearest] = target
    return bins.normalize(out)


def map_logistic(
    x: FloatArray,
    y: FloatArray,
    prior_mean: FloatArray,
    prior_precision: FloatArray,
    lower: FloatArray | None = None,
    max_iter: int = 100,
    start: FloatArray | None = None,
) -> FloatArray:
    """MAP weights of a logistic model without implicit intercept: minimise
    sum(log(1 + e^z) - y z) + 0.5 * sum(precision * (w - mean)^2), z = x @ w, subject to w >= lower.

    Newton steps on the free coordinates with backtracking; a coordinate at its bound stays fixed while
    its gradient pushes it further out. The objective is strictly convex (positive prior precision).
    `start`: where the steps start (the prior mean unless given; the optimum is the same).
    """
    d = prior_mean.size
    lo = np.full(d, -np.inf) if lower is None else lower
    w = np.maximum((prior_mean if start is None else start).astype(np.float64).copy(), lo)

    def objective(v: FloatArray) -> float:
        z = x @ v
        return float(
            np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(prior_precision * (v - prior_mean) ** 2)
        )

    f = objective(w)
    for _ in range(max_iter):
        z = x @ w
        q = sigmoid(z)
        g = x.T @ (q - y) + prior_precision * (w - prior_mean)
        h = x.T @ (x * (q * (1.0 - q))[:, None]) + np.diag(prior_precision)
        free = ~((w <= lo + 1e-12) & (g > 0))
        if not free.any():
            break
        step = np.zeros(d)
        step[free] = np.linalg.solve(h[np.ix_(free, free)], g[free])
        t = 1.0
        while True:
            cand = np.maximum(w - t * step, lo)
            f_cand = objective(cand)
            if f_cand <= f + 1e-4 * float(g @ (cand - w)) or t < 1e-8:
                break
            t *= 0.5
        moved = float(np.max(np.abs(cand - w)))
        if f_cand <= f:
            w, f = cand, f_cand
        if moved < 1e-9:
            break
    return w


@dataclass(frozen=True)
class Platt:
    """p' = sigmoid(a * logit(p) + b); the identity is a = 1, b = 0."""

    a: float = 1.0
    b: float = 0.0
    n_pairs: int = 0

    def p(self, p_raw: float) -> float:
        z = self.a * float(logit(p_raw)) + self.b
        return float(min(1.0 - OUT_CLIP, max(OUT_CLIP, float(sigmoid(z)))))

    def p_array(self, p_raw: FloatArray) -> FloatArray:
        out: FloatArray = np.clip(sigmoid(self.a * logit(p_raw) + self.b), OUT_CLIP, 1.0 - OUT_CLIP)
        return out

    def probs(self, probs: Sequence[float]) -> list[float]:
        return with_p_faster(probs, self.p(bins.p_faster(probs)))

    def to_dict(self) -> dict[str, float | int]:
        return {"a": self.a, "b": self.b, "n_pairs": self.n_pairs}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Platt:
        a, b, n = float(d["a"]), float(d["b"]), int(d.get("n_pairs", 0))
        if not (math.isfinite(a) and math.isfinite(b)) or a < 0:
            raise ValueError(f"bad Platt parameters a={a}, b={b}")
        return cls(a, b, n)


def fit_platt(
    p_raw: Sequence[float] | FloatArray,
    faster: Sequence[bool] | npt.NDArray[np.bool_],
    prior: Platt = Platt(),
    prior_sd_slope: float = PRIOR_SD_SLOPE,
    prior_sd_bias: float = PRIOR_SD_BIAS,
    start: Platt | None = None,
) -> Platt:
    """MAP Platt scaling of raw p_faster against outcomes (True: the candidate was faster). `start`: a fit
    near the optimum (of most of the same pairs) to start Newton's steps from."""
    p = np.asarray(p_raw, dtype=np.float64)
    y = np.asarray(faster, dtype=np.float64)
    if p.shape != y.shape:
        raise ValueError("p_raw and faster must have the same length")
    if p.size == 0:
        return Platt(prior.a, prior.b, 0)
    x = np.column_stack([logit(p), np.ones_like(p)])
    w = map_logistic(
        x,
        y,
        prior_mean=np.array([prior.a, prior.b]),
        prior_precision=np.array([prior_sd_slope**-2, prior_sd_bias**-2]),
        lower=np.array([0.0, -np.inf]),
        start=None if start is None else np.array([start.a, start.b]),
    )
    return Platt(float(w[0]), float(w[1]), int(p.size))


@dataclass(frozen=True)
class Calibrator:
    """One forecaster's calibration: pooled over hardware, and per hardware with the pooled fit as prior."""

    pooled: Platt = Platt()
    hardware: dict[str, Platt] = field(default_factory=dict)

    @property
    def n_pairs(self) -> int:
        return self.pooled.n_pairs

    @classmethod
    def identity(cls) -> Calibrator:
        return cls()

    @classmethod
    def fit(
        cls,
        p_raw: Sequence[float] | FloatArray,
        faster: Sequence[bool] | npt.NDArray[np.bool_],
        hardware: Sequence[str] | npt.NDArray[np.object_],
        prior: Platt = Platt(),
        start: Calibrator | None = None,
    ) -> Calibrator:
        """Fit from verified non-tie pairs: raw p_faster, whether the candidate was faster, the GPU. `prior`
        is where the pooled fit starts from, and what stays on fewer than MIN_FIT_PAIRS pairs. `start`: a fit
        on most of the same pairs, whose numbers the optimisation starts from (fewer steps, the same fit)."""
        hw = [str(h) for h in hardware]
        names = sorted(set(hw))
        index = {h: i for i, h in enumerate(names)}
        codes = np.fromiter((index[h] for h in hw), np.int64, len(hw))
        return cls.fit_codes(p_raw, faster, codes, names, prior, start)

    @classmethod
    def fit_codes(
        cls,
        p_raw: Sequence[float] | FloatArray,
        faster: Sequence[bool] | npt.NDArray[np.bool_],
        codes: npt.NDArray[np.int64],
        names: Sequence[str],
        prior: Platt = Platt(),
        start: Calibrator | None = None,
    ) -> Calibrator:
        """`fit` with each pair's GPU given as an index into `names` (the engine keeps them so: comparing tens
        of thousands of GPU names, once per GPU and fit, took longer than the fits)."""
        p = np.asarray(p_raw, dtype=np.float64)
        y = np.asarray(faster, dtype=bool)
        hw = np.asarray(codes, dtype=np.int64)
        if not (p.shape == y.shape == hw.shape):
            raise ValueError("p_raw, faster and hardware must have the same length")
        if p.size >= MIN_FIT_PAIRS:
            pooled = fit_platt(p, y, prior=prior, start=None if start is None else start.pooled)
        else:
            pooled = Platt(prior.a, prior.b, n_pairs=int(p.size))
        per_hw = {}
        for code in np.unique(hw):
            h = str(names[int(code)])
            mine, others = hw == code, hw != code
            if int(mine.sum()) < MIN_FIT_PAIRS:
                continue  # for_hardware falls back to the pooled fit
            if not others.any():
                # Every pair is this GPU's, and its prior is `prior`: the pooled fit, on the same numbers (a
                # second fit of every row cost 40 ms at 160,000 verified pairs).
                per_hw[h] = pooled
                continue
            near = None if start is None else start.pooled
            rest = (
                fit_platt(p[others], y[others], prior=prior, start=near)
                if int(others.sum()) >= MIN_FIT_PAIRS
                else prior
            )
            per_hw[h] = fit_platt(
                p[mine], y[mine], prior=rest, start=None if start is None else start.for_hardware(h)
            )
        return cls(pooled, dict(sorted(per_hw.items())))

    def for_hardware(self, hardware: str) -> Platt:
        return self.hardware.get(hardware, self.pooled)

    def p(self, p_raw: float, hardware: str) -> float:
        return self.for_hardware(hardware).p(p_raw)

    def probs(self, probs: Sequence[float], hardware: str) -> list[float]:
        return self.for_hardware(hardware).probs(probs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "platt",
            "version": STATE_VERSION,
            "pooled": self.pooled.to_dict(),
            "hardware": {h: c.to_dict() for h, c in sorted(self.hardware.items())},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibrator:
        """Parse a saved state; ValueError when it is not one this version wrote."""
        try:
            if d.get("kind") != "platt" or d.get("version") != STATE_VERSION:
                raise ValueError(
                    f"unknown calibration state kind/version: {d.get('kind')}/{d.get('version')}"
                )
            return cls(
                Platt.from_dict(d["pooled"]), {str(h): Platt.from_dict(v) for h, v in d["hardware"].items()}
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"unreadable calibration state: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Calibrator:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"unreadable calibration state: {exc}") from exc
