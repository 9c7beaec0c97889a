"""Thresholds certified on history pooled over kernel families vs each family's own (not in CI).

    python benchmarks/family_thresholds.py --set conv-A6000,dedisp-A6000,conv6-A6000orig --history 100

Several replay spaces of one GPU stand for kernel families served by one server. Each family gets `--history`
measured configurations and 1,000 forecasts of a random unmeasured configuration against a measured one (the
search case), all scored against the recording as verified history. Prints the threshold certified on the
pooled history and, per family, its own certified threshold and the error among its verdicts decided at the
pooled one (target error 0.1): why the engine thresholds a family on its own history once it has enough.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tune_local import _select, space  # noqa: E402

from forecaster_mcp.forecast import metrics  # noqa: E402
from forecaster_mcp.forecast.selective import choose_threshold  # noqa: E402

TARGET = 0.1


def _pairs(name: str, history: int, seed: int, n_pairs: int = 1000) -> tuple[Any, Any]:
    import anyio

    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.local import LocalForecaster
    from forecaster_mcp.models import Kernel, Workload
    from forecaster_mcp.search import DictHistory, placeholder_source
    from forecaster_mcp.store.db import FamilyPoint

    sp = space(name)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(sp.entries))
    source, workload = placeholder_source(sp.kernel_name), Workload()

    def kernel(i: int) -> Kernel:
        return Kernel(id=f"c{i}", source=source, entry=sp.kernel_name, defines=dict(sp.entries[i].params))

    def runtime(i: int) -> float:
        return float(statistics.median(sp.entries[i].times))

    points = DictHistory()
    for i in map(int, order[:history]):
        e, k = sp.entries[i], kernel(i)
        point = FamilyPoint(dict(e.params), None, e.status, runtime(i) if e.ok else None, k.content_key())
        points.add((k.family_key(), sp.device, workload.key()), point)
    measured = [int(i) for i in order[:history] if sp.entries[i].ok]
    rest = [int(i) for i in order[history:] if sp.entries[i].ok]
    queries, speedups = [], []
    for _ in range(n_pairs):
        b, c = int(rng.choice(measured)), int(rng.choice(rest))
        queries.append(PairQuery(kernel(b), kernel(c), workload, sp.device, None))
        speedups.append(runtime(b) / runtime(c))
    forecaster = LocalForecaster(points, nvcc=None, ptxas_wait_s=0.0)
    forecasts = anyio.run(forecaster.forecast, queries)
    return np.array([f.p_faster for f in forecasts]), np.array(speedups)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--set", default="conv-A6000,dedisp-A6000,conv6-A6000orig", help="spaces of one GPU")
    ap.add_argument("--history", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    names = _select(args.set)
    for seed in range(args.seeds):
        data = {n: _pairs(n, args.history, seed) for n in names}
        scored = [metrics.direction_history(p, s) for p, s in data.values()]
        pooled = choose_threshold(
            np.concatenate([c for c, _ in scored]), np.concatenate([r for _, r in scored]), TARGET
        )
        print(f"seed {seed}: certified on the pooled history {pooled.threshold:.3f}")
        for (n, (p, s)), (conf, right) in zip(data.items(), scored, strict=True):
            own = choose_threshold(conf, right, TARGET)
            d = metrics.decided_summary(metrics.verdicts_at(p, pooled.threshold), s)
            error = 0.0 if math.isnan(d.error) else d.error
            print(
                f"  {n:18s} own {own.threshold:.3f}; at the pooled threshold decided {d.coverage:.2f}, "
                f"error {error:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
