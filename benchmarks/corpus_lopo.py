"""Leave-one-problem-out estimate of the static prior on measured pairs of different kernels (not in CI).

    python benchmarks/corpus_lopo.py benchmarks/corpus/measured/h200_2026-11-29.jsonl [--lam 3]

For each problem of the corpus in turn, the weights of `features.FITTED_TERMS` are refitted (ridge on log2
speedup minus the hand-set part of `prior_shift`) on the other problems' pairs, and the held-out problem's pairs
are forecast as `prior_shift` would with those weights, its spread the training residuals' rms. This is the
honest figure for kernels of problems the fit never saw; `forecaster-mcp eval` on the same pairs is in-sample.
Registers and shared memory come from the measured lines (what ptxas reported on the GPU machine), so the
figures do not depend on the nvcc of the machine running this. Also prints the weights fitted on all pairs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from corpus_pairs import build_pairs, read_measured  # noqa: E402

from forecaster_mcp.forecast import features, metrics  # noqa: E402
from forecaster_mcp.forecast.ptxas import PtxasEntry  # noqa: E402
from forecaster_mcp.hardware.specs import lookup  # noqa: E402
from forecaster_mcp.models import Kernel  # noqa: E402

NAMES = [name for name, _, _ in features.FITTED_TERMS]


def _features(kernel: Kernel, resources: dict[str, Any] | None, hardware: str) -> features.StaticFeatures:
    ptxas = None
    if resources:
        ptxas = PtxasEntry(
            name=kernel.entry,
            registers=int(resources["registers"]),
            shared_bytes=int(resources["shared_mem_bytes"]),
            spill_stores_bytes=0,
            spill_loads_bytes=0,
            stack_frame_bytes=0,
        )
    return features.kernel_features(kernel, None, lookup(hardware), ptxas)


def design(rows: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> tuple[np.ndarray, ...]:
    """Values of the fitted terms (X), the hand-set shift (rest), log2 speedups and problems."""
    resources = {r["id"]: r["result"].get("resources") for r in rows}
    cache: dict[str, features.StaticFeatures] = {}
    x, rest, y, groups = [], [], [], []
    for p in pairs:
        fs = []
        for side in ("baseline", "candidate"):
            k = Kernel.model_validate(p[side])
            if k.id not in cache:
                cache[k.id] = _features(k, resources.get(k.id), p["hardware"])
            fs.append(cache[k.id])
        rest.append(features.prior_shift(fs[0], fs[1], fitted=False).mean_log2)
        x.append(features.fitted_values(fs[0], fs[1]))
        y.append(math.log2(p["speedup"]))
        groups.append(p["source"])
    return np.array(x, float), np.array(rest), np.array(y), np.array(groups)


def _ridge(a: np.ndarray, b: np.ndarray, lam: float) -> np.ndarray:
    return np.asarray(np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ b))


def _phi(z: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0))))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("--corpus", type=Path, default=ROOT / "benchmarks" / "corpus")
    ap.add_argument("--lam", type=float, default=3.0, help="ridge penalty")
    ap.add_argument("--threshold", type=float, default=0.95)
    args = ap.parse_args()
    rows = read_measured(args.measured)
    pairs = build_pairs(rows, args.corpus, seed=0)
    x, rest, y, groups = design(rows, pairs)
    mu, sd = np.zeros_like(y), np.zeros_like(y)
    for g in sorted(set(groups)):
        train, test = groups != g, groups == g
        w = _ridge(x[train], y[train] - rest[train], args.lam)
        residual = y[train] - rest[train] - x[train] @ w
        mu[test] = x[test] @ w + rest[test]
        sd[test] = math.sqrt(float(np.mean(residual**2)))
    p = _phi(mu / sd)
    speedups = 2.0**y
    t = args.threshold
    verdicts = metrics.verdicts_at(p, t)
    decided = metrics.decided_summary(verdicts, speedups)
    n_decided = sum(v != "unsure" for v in verdicts)
    print(f"{len(pairs)} pairs, {len(set(groups))} problems, leave-one-problem-out:")
    print(
        f"  pairwise accuracy {metrics.pairwise_accuracy(p, speedups):.3f}  ECE {metrics.ece(p, speedups):.3f}  "
        f"Brier {metrics.brier(p, speedups):.3f}  decided {n_decided} ({n_decided / len(pairs):.1%}), "
        f"error among decided {decided.error:.3f}"
    )
    floor, floor_p90 = metrics.ece_if_calibrated(p, speedups)
    print(
        f"  ECE a perfectly calibrated forecaster would show here: {floor:.3f} (90% at most {floor_p90:.3f})"
    )
    for g in sorted(set(groups)):
        m = groups == g
        print(
            f"    {g:20s} {int(m.sum()):3d} pairs  accuracy {metrics.pairwise_accuracy(p[m], speedups[m]):.2f}"
        )
    w = _ridge(x, y - rest, args.lam)
    rms = math.sqrt(float(np.mean((y - rest - x @ w) ** 2)))
    fitted = ", ".join(f"{n} {v:+.2f}" for n, v in zip(NAMES, w, strict=True))
    print(f"  weights on all pairs: {fitted}; residual rms {rms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
