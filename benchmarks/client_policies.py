"""Which field a search client measures by, on replay spaces (not in CI; the tools emulated in process).

    python benchmarks/client_policies.py --set conv-W7800,pnpoly-Titan --policies next,ranking,p_faster --seeds 6

Every policy is the plain client of `forecaster_mcp.search` (10 random measurements, then per step 63 random
untried configurations in one `compare_kernels` call against the best so far, one measurement per step, 100
in all) and differs only in what it measures from the answer: `next` the head of `measure_next`, `ranking` the
first untried id of `ranking` (the best guess), `p_faster` the candidate with the highest `p_faster`; `fixed`
measures the head of `measure_next` too but keeps its first measured kernel as the baseline of every call (a
client comparing against a reference); `top4` measures the first four of `measure_next` from each call (a search
loop that forecasts many candidates and measures the top few); `sweep` measures the head of `measure_next` too but
sends the next 63 untried configurations in the recording's own order instead of a random draw (a client walking
the space's listing, each call a slice of neighbouring configurations). `--launch` makes the client pass launch shapes
derived from the parameters (tune_local's option "launch"). Prints median / min / mean best-fraction per space
and policy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tune_local import _pass_launches, _pool_map, _select, space  # noqa: E402

from forecaster_mcp import search as S  # noqa: E402

POLICIES = ("next", "ranking", "p_faster", "fixed", "top4", "sweep")
TOP_FEW = 4  # measurements per call of the "top4" policy


def _pick(policy: str, result: dict[str, Any], base: int, measured: set[int]) -> int | None:
    def index(cid: str) -> int:
        return int(cid[1:])

    if policy in ("next", "fixed", "top4", "sweep"):
        ids = [index(c) for c in result["measure_next"] if c != f"c{base}"]
    elif policy == "ranking":
        ids = [index(c) for c in result["ranking"] if c != f"c{base}"]
    else:
        forecasts = [c for c in result["candidates"] if c["decided_by"] == "forecast"]
        ids = [index(c["id"]) for c in sorted(forecasts, key=lambda c: -float(c["p_faster"]))]
    return next((i for i in ids if i not in measured), None)


async def _run(sp: Any, policy: str, seed: int, measurements: int) -> float:
    call = S.ToolEmulator(sp)
    rng = random.Random(seed)
    tracker = S._Tracker(sp, policy, seed)
    n = len(sp.entries)
    cursor = 0  # the sweep policy's place in the listing
    for i in rng.sample(range(n), S.N_INIT):
        await tracker.measure(call, i)
    while len(tracker.measured) < measurements:
        base = tracker.best_index
        if policy == "fixed":
            base = next((i for i, t in tracker.measured.items() if t is not None), None)
        untried = [i for i in range(n) if i not in tracker.measured]
        if base is None:
            await tracker.measure(call, rng.choice(untried))
            continue
        if policy == "sweep":  # the next slice of the listing, from just after the last call's slice
            cursor = next((k for k, i in enumerate(untried) if i >= cursor), 0)
            pool = (untried[cursor:] + untried[:cursor])[: S.MAX_PER_CALL]
            cursor = pool[-1] + 1
        else:
            pool = rng.sample(untried, S.MAX_PER_CALL)
        result = await S._compare(call, sp, base, pool, tracker)
        choice = _pick(policy, result, base, set(tracker.measured))
        await tracker.measure(call, choice if choice is not None else rng.choice(untried))
        if policy == "top4":  # the rest of the top few of the same answer
            for _ in range(TOP_FEW - 1):
                more = _pick(policy, result, base, set(tracker.measured))
                if more is None or len(tracker.measured) >= measurements:
                    break
                await tracker.measure(call, more)
    return tracker.trace().fraction


def _job(job: tuple[str, str, int, int, bool]) -> tuple[str, str, float]:
    import anyio

    name, policy, seed, measurements, launch = job
    if launch:
        _pass_launches()
    return name, policy, anyio.run(_run, space(name), policy, seed, measurements)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--set", default="conv-W7800", help="tune, heldout, all, or comma-separated space names")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--measurements", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--launch", action="store_true", help="the client passes launch shapes")
    args = ap.parse_args()
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    names = _select(args.set)
    jobs = [
        (n, p, s, args.measurements, args.launch) for n in names for p in policies for s in range(args.seeds)
    ]
    results = _pool_map(_job, jobs, args.workers)
    print(f"best-fraction after {args.measurements} measurements ({args.seeds} seeds): median / min / mean")
    for n in names:
        cells = []
        for p in policies:
            fr = [f for name, policy, f in results if name == n and policy == p]
            cells.append(f"{p}: {statistics.median(fr):.3f} / {min(fr):.3f} / {statistics.fmean(fr):.3f}")
        print(f"  {n:18s} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
