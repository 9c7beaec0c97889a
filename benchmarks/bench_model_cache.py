"""Memory of the local forecaster's model cache with many large families (not in CI).

    python benchmarks/bench_model_cache.py [--families 24] [--points 1500] [--cache-mb 512]

Fits `--families` synthetic families of `--points` measurements each (one forecast per family, as a search
client screening several kernels would cause), then prints what the cache holds (`cached_bytes`), how many
models it kept, the process's resident memory now and at its peak, and the time of each first fit.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from forecaster_mcp.forecast.base import PairQuery  # noqa: E402
from forecaster_mcp.forecast.local import LocalForecaster  # noqa: E402
from forecaster_mcp.hardware.specs import lookup  # noqa: E402
from forecaster_mcp.models import Kernel, Workload  # noqa: E402
from forecaster_mcp.store.db import FamilyPoint  # noqa: E402

HW = "H100-SXM5-80GB"
WL = Workload(problem={"n": 1 << 24})


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class History:
    def __init__(self, families: int, points: int) -> None:
        rng = np.random.default_rng(0)
        self.points: dict[str, list[FamilyPoint]] = {}
        self.sources = [
            f"__global__ void k(float* a) {{ a[threadIdx.x] *= {i}.0f; }}\n" for i in range(families)
        ]
        for src in self.sources:
            key = Kernel(source=src, entry="k").family_key()
            rows = []
            for j in range(points):
                d = {
                    "BX": int(2 ** rng.integers(4, 11)),
                    "TX": int(rng.integers(1, 9)),
                    "U": int(rng.integers(0, 2)),
                    "J": j,
                }
                t = 1.0 + abs(math.log2(d["BX"]) - 7) * 0.3 + 0.1 * d["TX"] + 0.05 * rng.standard_normal()
                rows.append(FamilyPoint(d, None, "ok", t, f"{key}-{j}"))
            self.points[key] = rows

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        return list(self.points.get(family_key, []))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--families", type=int, default=24)
    ap.add_argument("--points", type=int, default=1500)
    ap.add_argument("--cache-mb", type=float, default=512.0)
    args = ap.parse_args()
    history = History(args.families, args.points)
    f = LocalForecaster(history, ptxas_wait_s=0.0, max_cache_bytes=int(args.cache_mb * 2**20))
    start = _rss_mb()
    fits = []

    async def run() -> None:
        for src in history.sources:
            a = Kernel(id="a", source=src, entry="k", defines={"BX": 64, "TX": 2, "U": 0, "J": -1})
            b = Kernel(id="b", source=src, entry="k", defines={"BX": 256, "TX": 4, "U": 1, "J": -2})
            t0 = time.perf_counter()
            await f.forecast([PairQuery(a, b, WL, HW, lookup(HW))])
            fits.append(time.perf_counter() - t0)

    anyio.run(run)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{args.families} families x {args.points} points, cache bound {args.cache_mb:g} MB: "
        f"{len(f._models)} models kept, {f.cached_bytes / 2**20:.0f} MB by model_bytes; "
        f"RSS {start:.0f} MB before, {_rss_mb():.0f} MB after, peak {peak:.0f} MB; "
        f"first fit median {sorted(fits)[len(fits) // 2]:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
