"""How well a young family's measured configurations forecast its next one (not in CI).

    python benchmarks/young_family.py [--draws 2000] [--sd 0.9]

`features.sibling_log2_ms` estimates an unmeasured configuration of a kernel from the 1-3 configurations of it
measured so far (their median runtime, spread CONFIG_SD_LOG2 per configuration), and a forecast sets that
against another kernel measured, at most SIBLING_MAX_CONFIDENCE sure (`features.sibling_spread`). Simulated on the Kernel Tuner recordings of benchmarks/tune_local.py: in each
space, n = 1-3 random configurations are measured, another is the target, and a third stands for the other
kernel, whose measured runtime the target is compared with. Prints pairwise accuracy, ECE, Brier, and the share
decided at the 0.95 threshold with the error among those, and log loss, for several spreads and caps (1.0: no
cap), on the TUNE spaces (where they were chosen) and the HELDOUT ones. The recordings have no launch, so the same-family prior's shift between
configurations is 0 here.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tune_local  # noqa: E402

from forecaster_mcp.forecast import metrics  # noqa: E402
from forecaster_mcp.forecast.features import CONFIG_SD_LOG2, SIBLING_MAX_CONFIDENCE  # noqa: E402


def simulate(
    names: list[str], sd0: float, cap: float, draws: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """p_faster of the target against the other kernel, and the true speedups, over `draws` per space."""
    rng = np.random.default_rng(seed)
    p, speedups = [], []
    for name in names:
        log2_ms = np.log2([e.time_ms for e in tune_local.space(name).valid_entries()])
        for _ in range(draws):
            n = int(rng.integers(1, 4))
            idx = rng.choice(log2_ms.size, n + 2, replace=False)
            siblings, target, other = log2_ms[idx[:n]], log2_ms[idx[n]], log2_ms[idx[n + 1]]
            spread = 1.0 / n if n <= 2 else (math.pi / 2.0) / n
            sd = sd0 * math.sqrt(1.0 + spread)
            z = (other - float(np.median(siblings))) / sd
            p.append(min(cap, max(1.0 - cap, 0.5 * (1.0 + math.erf(z / math.sqrt(2.0))))))
            speedups.append(2.0 ** (other - target))
    return np.array(p), np.array(speedups)


def log_loss(p: np.ndarray, speedups: np.ndarray) -> float:
    """Mean log loss of the direction, ties (within 3%) left out as pairwise accuracy leaves them."""
    keep = np.abs(np.log2(speedups)) > math.log2(1.03)
    y, q = speedups[keep] > 1.0, np.clip(p[keep], 1e-6, 1.0 - 1e-6)
    return float(-np.mean(np.where(y, np.log(q), np.log(1.0 - q))))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--draws", type=int, default=2000, help="simulated pairs per space")
    ap.add_argument("--sd", type=float, action="append", help="spreads to try (default: several)")
    args = ap.parse_args()
    spreads = args.sd or sorted({0.6, CONFIG_SD_LOG2, 0.9})
    for sd0, cap in [(sd, c) for sd in spreads for c in sorted({1.0, 0.9, SIBLING_MAX_CONFIDENCE})]:
        for label, names in (("TUNE", list(tune_local.TUNE)), ("HELDOUT", list(tune_local.HELDOUT))):
            p, s = simulate(names, sd0, cap, args.draws, seed=1)
            verdicts = metrics.verdicts_at(p, 0.95)
            decided = metrics.decided_summary(verdicts, s)
            share = sum(v != "unsure" for v in verdicts) / len(p)
            chosen = sd0 == CONFIG_SD_LOG2 and cap == SIBLING_MAX_CONFIDENCE
            print(
                f"sd {sd0:.2f} cap {cap:.2f} {label:8s} accuracy {metrics.pairwise_accuracy(p, s):.3f}  "
                f"ECE {metrics.ece(p, s):.3f}  Brier {metrics.brier(p, s):.4f}  log loss {log_loss(p, s):.4f}  "
                f"decided {share:.1%}, error among decided {decided.error:.3f}"
                + ("   <- chosen" if chosen else "")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
