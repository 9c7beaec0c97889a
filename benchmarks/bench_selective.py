"""Does the selective verdict keep its promise? Simulated verified histories through the engine (not in CI).

    python benchmarks/bench_selective.py --reps 100

compare_kernels decides "faster" / "slower" only when the calibrated confidence clears a threshold chosen from
verified history so that the error among decided verdicts stays under `target_error`: certified by a
Clopper-Pearson bound at delta (0.05) once history is long enough, a default (1 - target / 2, safe for a
calibrated forecaster) while it is short. This simulates many independent histories and measures what a user
then gets.

Each pair has a true chance q that the candidate is faster (logit q ~ N(0, --spread^2)); its outcome is drawn
from q. Forecasters (raw p_faster):
  calibrated      p = q
  overconfident   logit p = 2 logit q
  underconfident  logit p = --slope * logit q (0.5)
  shifted         calibrated on A100 (three pairs in four of the history), overconfident and biased on H100
                  (logit p = 2 logit q + 1), the GPU every fresh pair is asked about

A history is one stream of verified pairs issued in order, as a server issues them: each forecast is calibrated
by the Calibrator fitted on the pairs verified before it (refitted after every pair up to 50, then every 5%;
`Calibrator.fit` with the engine's prior), and stored with the confidence it was issued at. After 0, 10, 30,
100, 300 and 1,000 pairs the engine (`ForecastEngine.set_history` + `threshold`: per GPU, pooled over GPUs
while a GPU's own history is short, refuted by a GPU's own record) chooses the threshold for each target, and
fresh pairs from the same forecaster and GPU, calibrated by the current fit, are decided at it. The history
the threshold is certified on is scored as the engine scores it (--history oof): each pair's raw forecast
calibrated by a fit on the pairs outside its fold; --history issued certifies at the confidence each was issued
at (the engine before it scored out of fold), --history in-sample on the current fit, made from those pairs. Their error is
the mean of each decided pair's true chance of being wrong (not of drawn outcomes: no sampling noise there).

Prints, per forecaster, history length and target: how often the decided error exceeded the target (the claim:
at most delta = 5% for a certified threshold, and for a default on a calibrated forecaster), the mean and 95th
percentile of the decided error, the decided fraction beside the best fraction any threshold on the same
calibrated confidences could decide within the target (coverage given up), and how the thresholds were chosen
(history / default / never, and how many of each exceeded the target). Last, how many histories gave a stricter target a lower threshold than a looser
one (a verdict decided at target 0.05 and unsure at 0.1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp import bins  # noqa: E402
from forecaster_mcp.forecast.base import BinForecast, PairQuery  # noqa: E402
from forecaster_mcp.forecast.calibration import Calibrator, Platt, with_p_faster  # noqa: E402
from forecaster_mcp.forecast.engine import OOF_FOLDS, ForecastEngine, Outcome  # noqa: E402

FORECASTERS = ("calibrated", "overconfident", "underconfident", "shifted")
LENGTHS = (0, 10, 30, 100, 300, 1000)
TARGETS = (0.02, 0.05, 0.1, 0.2)
DELTA = 0.05
ASKED = "H100"  # the GPU fresh pairs are asked about
OTHER = "A100"  # the shifted forecaster's calibrated GPU
SPEEDUP = 1.5  # measured speedup of a pair whose candidate was faster (1 / SPEEDUP otherwise): never a tie


class _Silent:
    """The engine's forecaster: only its name and version are read here (forecasts come from `_raw`)."""

    name = "sim"
    version = "0"

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        raise NotImplementedError


def _logit(p: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _draw(
    kind: str, n: int, spread: float, slope: float, rng: np.random.Generator, fresh: bool
) -> tuple[Any, Any, Any]:
    """(q, raw p_faster, GPU) of n pairs."""
    z = rng.normal(0.0, spread, n)
    q = _sigmoid(z)
    hw = np.full(n, ASKED, dtype=object)
    if kind == "calibrated":
        zp = z
    elif kind == "overconfident":
        zp = 2.0 * z
    elif kind == "underconfident":
        zp = slope * z
    else:
        other = np.zeros(n, bool) if fresh else rng.random(n) < 0.75
        hw[other] = OTHER
        zp = np.where(other, z, 2.0 * z + 1.0)
    return q, np.clip(_sigmoid(zp), 1e-9, 1 - 1e-9), hw


def _calibrate(
    cal: Calibrator, p_raw: np.ndarray[Any, Any], hw: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    out = np.empty_like(p_raw)
    for h in set(hw.tolist()):
        sel = hw == h
        out[sel] = cal.for_hardware(h).p_array(p_raw[sel])
    return out


def _out_of_fold(
    p_raw: np.ndarray[Any, Any],
    faster: np.ndarray[Any, Any],
    hw: np.ndarray[Any, Any],
    folds: int,
    prior: Platt,
    issued: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """Each pair's raw forecast calibrated by a fit on the pairs outside its fold, as ForecastEngine._rescored
    scores its history (there a fold is a hash of the measurement that settled a pair; here of its place)."""
    out = issued.copy()
    if p_raw.size < 2 * folds:
        return out
    fold = (np.arange(p_raw.size) * 2654435761 % 2**32) % folds
    for k in range(folds):
        sel = fold == k
        cal = Calibrator.fit(p_raw[~sel], faster[~sel], hw[~sel], prior=prior)
        out[sel] = _calibrate(cal, p_raw[sel], hw[sel])
    return out


def _refit_points(n_max: int) -> list[int]:
    points, n = [], 1
    while n <= n_max:
        points.append(n)
        n = n + 1 if n < 50 else n + max(1, n // 20)
    return points


@dataclass
class _Cell:
    exceeded: int = 0
    histories: int = 0
    errors: list[float] | None = None
    coverage: float = 0.0
    best: float = 0.0
    by_source: dict[str, int] | None = None
    exceeded_by_source: dict[str, int] | None = None


def _best_coverage(conf: np.ndarray[Any, Any], wrong: np.ndarray[Any, Any], target: float) -> float:
    """The largest fraction of pairs a threshold on `conf` decides with mean error within `target`."""
    order = np.argsort(-conf, kind="stable")
    mean = np.cumsum(wrong[order]) / np.arange(1, conf.size + 1)
    ok = np.flatnonzero(mean <= target)
    return 0.0 if ok.size == 0 else float(ok[-1] + 1) / conf.size


def _check_engine_path(p_raw: Any, faster: Any, hw: Any, speedups: Any) -> None:
    """The calibration used below (`Calibrator.fit`, vectorised) is the engine's own: fit through `engine.fit`,
    calibrate through `engine.combine_raw`, compare on a few pairs."""
    engine = ForecastEngine([_Silent()])
    cal = Calibrator.fit(p_raw, faster, hw, prior=Platt())
    uniform = [1.0 / bins.N_BINS] * bins.N_BINS
    outcomes = [
        Outcome(str(h), float(s), {"sim": with_p_faster(uniform, float(p))})
        for p, h, s in zip(p_raw, hw, speedups, strict=True)
    ]
    engine.fit(outcomes)
    mine = _calibrate(cal, p_raw[:20], hw[:20])
    theirs = [bins.p_faster(engine.combine_raw({"sim": o.raw["sim"]}, o.hardware)) for o in outcomes[:20]]
    if not np.allclose(mine, theirs, atol=1e-6):
        raise SystemExit(f"calibration shortcut disagrees with the engine: {mine[:3]} vs {theirs[:3]}")


async def _history_run(
    kind: str, rep: int, args: argparse.Namespace, fresh: tuple[Any, Any, Any], cells: dict[Any, _Cell]
) -> list[tuple[int, list[float]]]:
    rng = np.random.default_rng([rep, FORECASTERS.index(kind)])
    lengths = [int(v) for v in args.lengths.split(",")]
    n_max = max(lengths)
    q, p_raw, hw = _draw(kind, n_max, args.spread, args.slope, rng, fresh=False)
    faster = rng.random(n_max) < q
    speedups = np.where(faster, SPEEDUP, 1.0 / SPEEDUP)
    prior = Platt()  # the engine's prior for a forecaster without calibration_slope
    issued = np.empty(n_max)
    cal = Calibrator(prior)
    fits = {n: None for n in _refit_points(n_max)}
    checkpoints: dict[int, Calibrator] = {}
    for i in range(n_max + 1):
        if i in lengths:
            checkpoints[i] = cal
        if i == n_max:
            break
        issued[i] = _calibrate(cal, p_raw[i : i + 1], hw[i : i + 1])[0]
        if i + 1 in fits:
            cal = Calibrator.fit(p_raw[: i + 1], faster[: i + 1], hw[: i + 1], prior=prior)
    if rep == 0:
        _check_engine_path(p_raw, faster, hw, speedups)

    fq, fp_raw, fhw = fresh
    thresholds_by_length = []
    for length in lengths:
        engine = ForecastEngine([_Silent()], delta=DELTA)
        if args.history == "oof":
            history = _out_of_fold(
                p_raw[:length], faster[:length], hw[:length], args.folds, prior, issued[:length]
            )
        elif args.history == "in-sample":
            history = _calibrate(checkpoints[length], p_raw[:length], hw[:length])
        else:
            history = issued[:length]
        engine.set_history(list(hw[:length]), list(history), list(speedups[:length]))
        p = _calibrate(checkpoints[length], fp_raw, fhw)
        conf = np.maximum(p, 1.0 - p)
        wrong = np.where(p > 0.5, 1.0 - fq, fq)
        ts = []
        for target in TARGETS:
            choice = await engine.threshold(ASKED, target)
            ts.append(choice.threshold)
            cell = cells.setdefault(
                (kind, length, target), _Cell(errors=[], by_source={}, exceeded_by_source={})
            )
            assert (
                cell.errors is not None and cell.by_source is not None and cell.exceeded_by_source is not None
            )
            cell.histories += 1
            cell.by_source[choice.source] = cell.by_source.get(choice.source, 0) + 1
            decided = conf >= choice.threshold
            cell.coverage += float(decided.mean())
            cell.best += _best_coverage(conf, wrong, target)
            if decided.any():
                error = float(wrong[decided].mean())
                cell.errors.append(error)
                cell.exceeded += error > target
                over = cell.exceeded_by_source
                over[choice.source] = over.get(choice.source, 0) + (error > target)
        thresholds_by_length.append((length, ts))
    return thresholds_by_length


async def _main(args: argparse.Namespace) -> int:
    cells: dict[Any, _Cell] = {}
    inversions: dict[tuple[str, int], int] = {}
    started = time.perf_counter()
    for kind in args.forecasters.split(","):
        fresh = _draw(
            kind,
            args.fresh,
            args.spread,
            args.slope,
            np.random.default_rng([10**6, FORECASTERS.index(kind)]),
            True,
        )
        for rep in range(args.reps):
            for length, ts in await _history_run(kind, rep, args, fresh, cells):
                # Targets ascend: a stricter target must not have a lower threshold than a looser one.
                bad = any(ts[i] < ts[j] for i in range(len(ts)) for j in range(i + 1, len(ts)))
                inversions[(kind, length)] = inversions.get((kind, length), 0) + bad
    print(
        f"{args.reps} histories per forecaster, {args.fresh} fresh pairs, spread {args.spread}, delta {DELTA}, "
        f"history scored {args.history}" + (f" ({args.folds} folds)" if args.history == "oof" else "")
    )
    print(f"{'forecaster':15s} {'n':>5s} {'target':>6s} {'exceed':>7s} {'err mean':>8s} {'err p95':>8s} "
          f"{'decided':>8s} {'best':>6s}  sources")  # fmt: skip
    for (kind, length, target), c in cells.items():
        assert c.errors is not None and c.by_source is not None and c.exceeded_by_source is not None
        errs = np.array(c.errors) if c.errors else np.zeros(1)
        sources = " ".join(
            f"{s}:{n}" + (f" ({over} over)" if (over := c.exceeded_by_source.get(s, 0)) else "")
            for s, n in sorted(c.by_source.items())
        )
        print(
            f"{kind:15s} {length:5d} {target:6.2f} {c.exceeded / c.histories:7.1%} {errs.mean():8.4f} "
            f"{np.quantile(errs, 0.95):8.4f} {c.coverage / c.histories:8.3f} {c.best / c.histories:6.3f}  {sources}"
        )
    print("histories with a stricter target given a lower threshold than a looser one:")
    for (kind, length), n in inversions.items():
        if n:
            print(f"  {kind:15s} n={length:5d}: {n} of {args.reps}")
    print(f"{time.perf_counter() - started:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--reps", type=int, default=100, help="independent histories per forecaster")
    ap.add_argument("--fresh", type=int, default=20000, help="fresh pairs a threshold is scored on")
    ap.add_argument("--spread", type=float, default=2.5, help="sd of the true log-odds of a pair")
    ap.add_argument("--forecasters", default=",".join(FORECASTERS))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="history lengths reported")
    ap.add_argument(
        "--history",
        choices=("oof", "issued", "in-sample"),
        default="oof",
        help="how the verified history is scored before thresholds are certified on it: its raw forecasts "
        "calibrated out of fold, as the engine scores it (default); at the confidence each was issued at; or "
        "calibrated by the current fit, made from those same pairs",
    )
    ap.add_argument("--folds", type=int, default=OOF_FOLDS, help="folds of --history oof")
    ap.add_argument("--slope", type=float, default=0.5, help="the underconfident forecaster's logit slope")
    args = ap.parse_args()
    return anyio.run(_main, args)


if __name__ == "__main__":
    raise SystemExit(main())
