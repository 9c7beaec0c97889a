"""A plain random-forest-with-uncertainty search on the replay spaces, the reference the issue compares with.

    pip install -e '.[bench]'   # scikit-learn: not a dependency of the product; only this benchmark uses it
    python benchmarks/rf_baseline.py --set heldout --seeds 10 [--trees 100] [--out rf.json]

The same budget and client shape as the plain forecast-guided client of `tune_local.py search`: 10 random
measurements, then per step 63 random untried configurations, of which the one with the largest expected
improvement (in log2 runtime, over the best so far) is measured; 100 measurements in all. The forest is
scikit-learn's `RandomForestRegressor` on the tuning parameters (numbers log2-scaled when they span a wide
positive range, text as ordinal codes); its uncertainty is the spread of the trees' predictions. A
configuration that failed counts as the slowest runtime seen so far (the usual imputation). Recorded times are
the measurements; nothing goes through the MCP tools (the forest is not the product; this is the yardstick).
Prints, per space, the median / worst / mean best-fraction and how many seeds ended below 0.90.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tune_local  # noqa: E402

N_INIT = 10
POOL = 63


def _encode(space: Any) -> list[list[float]]:
    columns: list[list[float]] = []
    for key in space.param_keys:
        values = [e.params[key] for e in space.entries]
        try:
            numbers = [float(v) for v in values]
        except (TypeError, ValueError):
            codes = {v: float(i) for i, v in enumerate(sorted({str(v) for v in values}))}
            columns.append([codes[str(v)] for v in values])
            continue
        lo, hi = min(numbers), max(numbers)
        if lo > 0 and hi / lo >= 4.0:
            numbers = [math.log2(v) for v in numbers]
        columns.append(numbers)
    return [list(row) for row in zip(*columns, strict=True)]


def _ei(mean: Any, sd: Any, best: float) -> Any:
    """Expected improvement for minimisation of log2 runtime."""
    import numpy as np

    sd = np.maximum(sd, 1e-9)
    z = (best - mean) / sd
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (best - mean) * cdf + sd * pdf


def rf_search(name: str, seed: int, measurements: int, trees: int) -> float:
    import numpy as np
    from sklearn.ensemble import RandomForestRegressor

    sp = tune_local.space(name)
    x = np.asarray(_encode(sp))
    rng = random.Random(seed)
    n = len(sp.entries)
    measured: list[int] = rng.sample(range(n), min(N_INIT, n))
    untried = set(range(n)) - set(measured)
    while len(measured) < min(measurements, n):
        ok = [math.log2(sp.entries[i].time_ms) for i in measured if sp.entries[i].time_ms]
        if len(ok) < 2:
            pick = rng.choice(sorted(untried))
        else:
            worst = max(ok)
            y = [math.log2(sp.entries[i].time_ms) if sp.entries[i].time_ms else worst for i in measured]
            forest = RandomForestRegressor(n_estimators=trees, random_state=seed, n_jobs=1)
            forest.fit(x[measured], y)
            pool = rng.sample(sorted(untried), min(POOL, len(untried)))
            per_tree = np.stack([t.predict(x[pool]) for t in forest.estimators_])
            value = _ei(per_tree.mean(axis=0), per_tree.std(axis=0), min(ok))
            pick = pool[int(np.argmax(value))]
        measured.append(pick)
        untried.discard(pick)
    found = min((sp.entries[i].time_ms for i in measured if sp.entries[i].time_ms), default=None)
    return float(sp.best_time_ms / found) if found else 0.0


def _job(job: tuple[str, int, int, int]) -> dict[str, Any]:
    name, seed, measurements, trees = job
    return {"space": name, "seed": seed, "fraction": rf_search(name, seed, measurements, trees)}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--set", default="heldout", help="tune, heldout, all, or comma-separated space names")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--measurements", type=int, default=100)
    ap.add_argument("--trees", type=int, default=100)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.seeds < 1 or args.measurements < 1 or args.trees < 1:
        ap.error("--seeds, --measurements and --trees must be at least 1")
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise SystemExit(
            "this benchmark needs scikit-learn: pip install -e '.[bench]' (or pip install scikit-learn)"
        ) from None
    names = tune_local._select(args.set)
    jobs = [(n, s, args.measurements, args.trees) for n in names for s in range(args.seeds)]
    results = tune_local._pool_map(_job, jobs, args.workers)
    table: dict[str, Any] = {}
    print(f"random forest + EI, {args.measurements} measurements, {args.seeds} seeds: median / min / mean")
    for n in names:
        fr = sorted(r["fraction"] for r in results if r["space"] == n)
        below = sum(f < 0.9 for f in fr)
        table[n] = {
            "median": statistics.median(fr),
            "min": fr[0],
            "mean": statistics.fmean(fr),
            "fractions": fr,
        }
        print(
            f"  {n:18s} {table[n]['median']:.3f} / {fr[0]:.3f} / {table[n]['mean']:.3f}  below 0.90: {below}"
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"options": vars(args) | {"out": str(args.out)}, "spaces": table}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
