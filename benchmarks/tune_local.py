"""Offline tuning and evaluation of the local forecaster and the forecast-guided search (slow; not in CI).

Everything reads Kernel Tuner recordings from ../shared/datasets and goes through the same code the server
runs: searches call `compare_kernels` / `measure_kernel` through `search.ToolEmulator` (LocalForecaster + a
dict-backed family history + the acquisition ranking), never the recorded times.

Spaces are split: TUNE spaces were used to make design choices, HELDOUT spaces (other GPUs, and kernels
never looked at while tuning) are only reported.

    python benchmarks/tune_local.py search --set heldout --seeds 10
    python benchmarks/tune_local.py search --set heldout --opts '{"local_moves": false, "screens_per_step": 1, "pool_size": 63}'
    python benchmarks/tune_local.py search --set tune --opts '{"launch": true, ...}'   # client passes launches
    python benchmarks/tune_local.py model --set heldout
    python benchmarks/tune_local.py latency
    python benchmarks/tune_local.py all --seeds 10 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Small matrices: BLAS threads only fight each other (and the worker processes) here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HUB = ROOT.parent / "shared" / "datasets" / "kernel_tuner_benchmark_hub"
_LEGACY = "currently_unused/cachefiles/KernelTuner data"

TUNE: dict[str, str] = {
    "conv-A100": "cachefiles/convolution_milo/A100.json.gz",
    "conv-A4000": "cachefiles/convolution_milo/A4000.json.gz",
    "dedisp-A100": "cachefiles/dedispersion_milo/A100.json.gz",
    "dedisp-A4000": "cachefiles/dedispersion_milo/A4000.json.gz",
    "legacyconv-3090": f"{_LEGACY}/convolution/RTX_3090.json.gz",
    "legacyconv-3060": f"{_LEGACY}/convolution/RTX_3060_laptop.json.gz",
    "pnpoly-3090": f"{_LEGACY}/pnpoly/RTX_3090.json.gz",
    "pnpoly-3060": f"{_LEGACY}/pnpoly/RTX_3060_laptop.json.gz",
}
HELDOUT: dict[str, str] = {
    "conv-A6000": "cachefiles/convolution_milo/A6000.json.gz",
    "conv-MI250X": "cachefiles/convolution_milo/MI250X.json.gz",
    "conv-W6600": "cachefiles/convolution_milo/W6600.json.gz",
    "conv-W7800": "cachefiles/convolution_milo/W7800.json.gz",
    "dedisp-A6000": "cachefiles/dedispersion_milo/A6000.json.gz",
    "dedisp-MI250X": "cachefiles/dedispersion_milo/MI250X.json.gz",
    "dedisp-W6600": "cachefiles/dedispersion_milo/W6600.json.gz",
    "dedisp-W7800": "cachefiles/dedispersion_milo/W7800.json.gz",
    "conv6-A6000orig": "cachefiles/convolution_milo/A6000_original.json.gz",
    "conv6-A4000": f"{_LEGACY}/convolution_milo/a4000.json.gz",
    "conv6-MI50": f"{_LEGACY}/convolution_milo/mi50.json.gz",
    "legacyconv-2080Ti": f"{_LEGACY}/convolution/RTX_2080_Ti.json.gz",
    "legacyconv-Titan": f"{_LEGACY}/convolution/RTX_Titan.json.gz",
    "pnpoly-2080Ti": f"{_LEGACY}/pnpoly/RTX_2080_Ti.json.gz",
    "pnpoly-Titan": f"{_LEGACY}/pnpoly/RTX_Titan.json.gz",
}
ALL = {**TUNE, **HELDOUT}

_SPACES: dict[str, Any] = {}


def space(name: str) -> Any:
    """The replay space of a named recording (cached per process)."""
    from forecaster_mcp.measure.replay import load_space

    if name not in _SPACES:
        _SPACES[name] = load_space(HUB / ALL[name])
    return _SPACES[name]


def _select(which: str) -> list[str]:
    if which == "tune":
        return list(TUNE)
    if which == "heldout":
        return list(HELDOUT)
    if which == "all":
        return list(ALL)
    names = which.split(",")
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise SystemExit(f"unknown spaces {unknown}; known: {', '.join(ALL)}")
    return names


# ---------------------------------------------------------------- searches


def _apply_patches(patches: dict[str, Any]) -> None:
    """Tuning hook: set module constants, e.g. {"forecaster_mcp.forecast.local.TAIL_WEIGHT": 0.0}."""
    import importlib

    for target, value in patches.items():
        module_name, attr = target.rsplit(".", 1)
        setattr(importlib.import_module(module_name), attr, value)


def _pass_launches() -> None:
    """Make the search client pass each configuration's launch shape, as a client with the kernel would:
    block = (block_size_x, block_size_y, block_size_z), grid = the problem size over block * tile (Kernel
    Tuner's usual grid divisors; the recordings do not keep the real ones). Patches this worker process."""
    import forecaster_mcp.search as search

    if getattr(search.kernel_dict, "passes_launch", False):
        return
    plain = search.kernel_dict

    def with_launch(sp: Any, index: int) -> dict[str, Any]:
        d = plain(sp, index)
        p = sp.entries[index].params
        size = sp.problem_size if isinstance(sp.problem_size, list) else [sp.problem_size]
        block = [int(p.get(f"block_size_{a}", 1)) for a in "xyz"]
        tile = [int(p.get("tile_size_x", p.get("tile_size", 1))), int(p.get("tile_size_y", 1))]
        grid = [math.ceil(int(size[i] if i < len(size) else 1) / (block[i] * tile[i])) for i in range(2)]
        return {**d, "launch": {"grid": [*grid, 1], "block": block}}

    with_launch.passes_launch = True  # type: ignore[attr-defined]
    search.kernel_dict = with_launch


def _search_job(job: tuple[str, str, int, int, dict[str, Any]]) -> dict[str, Any]:
    import anyio

    name, strategy, seed, measurements, opts = job
    _apply_patches(opts.get("patch", {}))
    if opts.get("launch"):
        _pass_launches()
    from forecaster_mcp.search import ToolEmulator, forecast_guided_search, random_search

    sp = space(name)
    emu = ToolEmulator(sp, measure_next=opts.get("measure_next", "server"))
    verdicts: list[tuple[float, str, float]] = []  # (p_faster, verdict, recorded speedup) of screened pairs

    async def call(tool: str, args: dict[str, Any]) -> dict[str, Any]:
        """The emulator, with every forecast verdict scored against the recording (ids are c<index>)."""
        result = await emu(tool, args)
        if tool == "compare_kernels":
            t_base = sp.entries[int(str(result["baseline"])[1:])].time_ms
            for c in result["candidates"]:
                t_cand = sp.entries[int(str(c["id"])[1:])].time_ms
                if c["decided_by"] == "forecast" and t_base and t_cand:
                    verdicts.append((float(c["p_faster"]), str(c["verdict"]), t_base / t_cand))
        return result

    async def run() -> Any:
        if strategy == "random":
            return await random_search(call, sp, measurements, seed)
        kw = {
            k: v for k, v in opts.items() if k in ("pool_size", "screens_per_step", "n_init", "local_moves")
        }
        return await forecast_guided_search(call, sp, measurements, seed, **kw)

    trace = anyio.run(run)
    return {
        "space": name,
        "strategy": strategy,
        "seed": seed,
        "fraction": trace.fraction,
        "candidates": trace.candidates_considered,
        "gpu_seconds": trace.gpu_seconds,
        "wall_s": trace.wall_seconds,
        "per_step": trace.per_step_best,
        "verdicts": verdicts,
    }


def _pool_map(fn: Any, jobs: list[Any], workers: int) -> list[Any]:
    if workers <= 1:
        return [fn(j) for j in jobs]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return list(pool.imap_unordered(fn, jobs, chunksize=1))


def _verdict_quality(screened: list[tuple[float, str, float]]) -> dict[str, Any]:
    """Calibration honesty in the search case: every pair a search screened, scored against the recording."""
    from forecaster_mcp.forecast import metrics

    p = [v[0] for v in screened]
    s = [v[2] for v in screened]
    d = metrics.decided_summary([v[1] for v in screened], s)
    return {
        "n_pairs": len(screened),
        "coverage": d.coverage,
        "decided_error": d.error,
        "pairwise_accuracy": metrics.pairwise_accuracy(p, s),
        "ece": metrics.ece(p, s),
    }


def search_report(
    names: Sequence[str],
    seeds: int,
    measurements: int,
    strategies: Sequence[str],
    workers: int,
    opts: dict[str, Any],
    verbose: bool = False,
) -> dict[str, Any]:
    from dataclasses import asdict

    from forecaster_mcp.search import space_difficulty

    jobs = [(n, s, seed, measurements, opts) for n in names for s in strategies for seed in range(seeds)]
    results = _pool_map(_search_job, jobs, workers)
    table: dict[str, Any] = {}
    print(f"\nbest-fraction after {measurements} measurements ({seeds} seeds): median / min / mean")
    for n in names:
        row = {}
        for s in strategies:
            fr = sorted(r["fraction"] for r in results if r["space"] == n and r["strategy"] == s)
            cand = [r["candidates"] for r in results if r["space"] == n and r["strategy"] == s]
            row[s] = {
                "median": statistics.median(fr),
                "min": fr[0],
                "mean": statistics.fmean(fr),
                "fractions": fr,
                "candidates_mean": statistics.fmean(cand),
            }
        difficulty = space_difficulty(space(n), measurements)
        row["difficulty"] = asdict(difficulty)
        table[n] = row
        cells = "  ".join(
            f"{s}: {row[s]['median']:.3f} / {row[s]['min']:.3f} / {row[s]['mean']:.3f}" for s in strategies
        )
        exact = f"exact random {difficulty.random_median:.3f} / {difficulty.random_mean:.3f}"
        print(f"  {n:18s} {cells}  ({exact}, {difficulty.within['0.90']} configurations within 0.90)")
        screened = [v for r in results if r["space"] == n for v in r["verdicts"]]
        if screened:
            row["verdicts"] = _verdict_quality(screened)
            q = row["verdicts"]
            print(
                f"      verdicts on {q['n_pairs']} screened pairs: decided {q['coverage']:.3f}, "
                f"error among decided {q['decided_error']:.4f}, ECE {q['ece']:.3f}"
            )
        if verbose:
            for st in strategies:
                print(f"      {st} sorted: {' '.join(f'{x:.3f}' for x in row[st]['fractions'])}")
    return {"measurements": measurements, "seeds": seeds, "spaces": table, "options": opts}


# ---------------------------------------------------------------- the family model's pairs


def _model_job(job: tuple[str, int, int, int]) -> dict[str, Any]:
    import anyio
    import numpy as np

    from forecaster_mcp import bins
    from forecaster_mcp.forecast import metrics
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.engine import default_threshold_for
    from forecaster_mcp.forecast.local import LocalForecaster
    from forecaster_mcp.forecast.selective import choose_threshold
    from forecaster_mcp.models import Kernel, Workload
    from forecaster_mcp.search import DictHistory, placeholder_source
    from forecaster_mcp.store.db import FamilyPoint

    name, history_size, seed, n_pairs = job
    sp = space(name)
    rng = np.random.default_rng(seed)
    n = len(sp.entries)
    order = rng.permutation(n)
    hist_idx, rest = order[:history_size], order[history_size:]
    workload = Workload()
    source = placeholder_source(sp.kernel_name)

    def kernel(i: int) -> Kernel:
        return Kernel(id=f"c{i}", source=source, entry=sp.kernel_name, defines=dict(sp.entries[i].params))

    history = DictHistory()
    for i in hist_idx:
        e = sp.entries[i]
        k = kernel(int(i))
        median = statistics.median(e.times) if e.ok and e.times else None
        history.add(
            (k.family_key(), sp.device, workload.key()),
            FamilyPoint(dict(e.params), None, e.status, median, k.content_key()),
        )
    valid_rest = [int(i) for i in rest if sp.entries[i].ok]
    ok_hist = [int(i) for i in hist_idx if sp.entries[i].ok]
    forecaster = LocalForecaster(history, nvcc=None, ptxas_wait_s=0.0)

    def truth(i: int) -> float:
        return float(statistics.median(sp.entries[i].times))

    out: dict[str, Any] = {"space": name, "history": history_size, "seed": seed}
    kept: dict[str, tuple[Any, Any]] = {}
    for kind in ("both_unmeasured", "vs_measured"):
        qs, speedups = [], []
        for _ in range(n_pairs):
            c = int(rng.choice(valid_rest))
            if kind == "vs_measured":
                b = int(rng.choice(ok_hist)) if ok_hist else int(rng.choice(valid_rest))
            else:
                b = int(rng.choice(valid_rest))
                if b == c:
                    continue
            qs.append(PairQuery(kernel(b), kernel(c), workload, sp.device, None))
            speedups.append(truth(b) / truth(c))

        async def run(queries: list[PairQuery] = qs) -> list[Any]:
            return await forecaster.forecast(queries)

        fcs = anyio.run(run)
        p = np.array([f.p_faster for f in fcs])
        probs = np.array([f.probs for f in fcs])
        s = np.array(speedups)
        kept[kind] = (p, s)
        # Verdicts at the server's default threshold (no verified history yet): the honesty that matters.
        default = default_threshold_for("unmeasured" if kind == "both_unmeasured" else "model", 0.1)
        d = metrics.decided_summary(metrics.verdicts_at(p, default), s)
        truth2 = list(zip(fcs, np.log2(s), strict=True))
        out[kind] = {
            "pairwise_accuracy": metrics.pairwise_accuracy(p, s),
            "ece": metrics.ece(p, s),
            "brier": metrics.brier(p, s),
            "bin_accuracy": metrics.bin_accuracy(probs, s),
            # mean confidence minus accuracy on non-tie pairs: > 0 over-confident, < 0 under-confident
            "overconfidence": float(np.mean(np.maximum(p, 1 - p)[~metrics.tie_mask(s)]))
            - metrics.pairwise_accuracy(p, s),
            "pairs": len(s),
            "decided": d.coverage,
            "decided_error": 0.0 if math.isnan(d.error) else d.error,
            # how far the expected speedup an agent reads is from the truth (log2), with and without the
            # forecast's own within-bin means
            "speedup_error": float(
                np.mean([abs(bins.expected_log2(f.probs, f.centers) - t) for f, t in truth2])
            ),
            "speedup_error_fixed_centres": float(
                np.mean([abs(bins.expected_log2(f.probs) - t) for f, t in truth2])
            ),
        }
    # Why the two kinds have separate thresholds in the server (forecast/engine.py): a threshold certified on
    # verified pairs against a measured baseline (the search case), applied to pairs of two predictions.
    p, s = kept["vs_measured"]
    cert = choose_threshold(*metrics.direction_history(p, s), 0.1)
    p, s = kept["both_unmeasured"]
    d = metrics.decided_summary(metrics.verdicts_at(p, cert.threshold), s)
    out["cross"] = {"threshold": cert.threshold, "decided": d.coverage, "decided_error": d.error}
    return out


def model_report(
    names: Sequence[str], sizes: Sequence[int], seeds: int, pairs: int, workers: int
) -> dict[str, Any]:
    jobs = [(n, h, seed, pairs) for n in names for h in sizes for seed in range(seeds)]
    results = _pool_map(_model_job, jobs, workers)
    table: dict[str, Any] = {}
    print("\nfamily model on random pairs (non-tie pairs; 8-bin accuracy over all):")
    print(
        "  space              hist  | both unmeasured: acc  ECE   Brier bin   over  | vs measured: acc  ECE   Brier"
        " bin   over"
    )
    pooled: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for n in names:
        for h in sizes:
            rs = [r for r in results if r["space"] == n and r["history"] == h]
            row = {}
            for kind in ("both_unmeasured", "vs_measured"):
                row[kind] = {
                    m: statistics.fmean(r[kind][m] for r in rs if not math.isnan(r[kind][m]))
                    for m in (
                        "pairwise_accuracy", "ece", "brier", "bin_accuracy", "overconfidence", "decided",
                        "decided_error", "speedup_error", "speedup_error_fixed_centres",
                    )
                }  # fmt: skip
                pooled.setdefault((h, kind), []).append(
                    (
                        row[kind]["pairwise_accuracy"],
                        row[kind]["ece"],
                        row[kind]["decided"],
                        row[kind]["decided_error"],
                        row[kind]["speedup_error"],
                        row[kind]["speedup_error_fixed_centres"],
                    )
                )
            table.setdefault(n, {})[h] = row
            a, b = row["both_unmeasured"], row["vs_measured"]
            print(
                f"  {n:18s} {h:4d}  | {a['pairwise_accuracy']:.3f} {a['ece']:.3f} {a['brier']:.3f} "
                f"{a['bin_accuracy']:.3f} {a['overconfidence']:+.3f} | {b['pairwise_accuracy']:.3f} {b['ece']:.3f} "
                f"{b['brier']:.3f} {b['bin_accuracy']:.3f} {b['overconfidence']:+.3f}"
            )
    for h in sizes:
        cross = [
            statistics.fmean(0.0 if math.isnan(e) else e for e in errors)
            for n in names
            if (
                errors := [
                    r["cross"]["decided_error"] for r in results if r["space"] == n and r["history"] == h
                ]
            )
        ]
        t = statistics.fmean(r["cross"]["threshold"] for r in results if r["history"] == h)
        print(
            f"  history {h:4d}: a threshold certified on pairs against a measured baseline (mean {t:.3f}), applied"
            f" to two unmeasured: error among decided mean {statistics.fmean(cross):.3f}, worst space"
            f" {max(cross):.3f}, above 0.1 in {sum(c > 0.1 for c in cross)} of {len(cross)} spaces"
        )
    for (h, kind), vals in sorted(pooled.items()):
        print(
            f"  mean over spaces, history {h:4d}, {kind:16s}: accuracy {statistics.fmean(v[0] for v in vals):.3f}"
            f"  ECE {statistics.fmean(v[1] for v in vals):.3f}  decided at the default threshold"
            f" {statistics.fmean(v[2] for v in vals):.3f}"
            f" (error among decided: mean {statistics.fmean(v[3] for v in vals):.3f}, worst space {max(v[3] for v in vals):.3f})"
            f"; expected-speedup error {statistics.fmean(v[4] for v in vals):.3f} log2"
            f" (fixed bin centres {statistics.fmean(v[5] for v in vals):.3f})"
        )
    return table


# ---------------------------------------------------------------- latency


def _recorded_ms(entry: Any) -> float | None:
    """The median of a recorded configuration's runs; its recorded time without runs; None for a failure."""
    return statistics.median(entry.times) if entry.times else entry.time_ms


def latency_report(repeats: int = 50, name: str = "dedisp-A100") -> dict[str, Any]:
    """LocalForecaster.forecast wall time for 2 and 64 candidates at 100, 1000 and 1500 family points of space
    `name` in a random order: the first call (hyperparameters fitted), repeated calls (cached model), and a call
    after each of 5 new measurements (posterior updated with the fitted hyperparameters). Configurations the
    recording has as failed (no runs) join the history as failures, as a replaying server stores them."""
    import anyio
    import numpy as np

    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.local import LocalForecaster
    from forecaster_mcp.models import Kernel, Workload
    from forecaster_mcp.search import DictHistory, placeholder_source
    from forecaster_mcp.store.db import FamilyPoint

    sp = space(name)
    print(f"\nlatency on {name}")
    rng = np.random.default_rng(0)
    workload = Workload()
    source = placeholder_source(sp.kernel_name)
    out: dict[str, Any] = {}
    print(
        "\nLocalForecaster.forecast latency (ms): family points x candidates -> first call (fit), then p50/p95,"
        " then the median call after one new measurement"
    )
    for n_points in (100, 1000, 1500):
        order = rng.permutation(len(sp.entries))
        history = DictHistory()
        for i in order[:n_points]:
            e = sp.entries[int(i)]
            k = Kernel(source=source, entry=sp.kernel_name, defines=dict(e.params))
            history.add(
                (k.family_key(), sp.device, workload.key()),
                FamilyPoint(dict(e.params), None, e.status, _recorded_ms(e), k.content_key()),
            )
        base_i = int(order[0])
        for n_cand in (2, 64):
            forecaster = LocalForecaster(history, nvcc=None, ptxas_wait_s=0.0)
            cands = [int(i) for i in order[n_points : n_points + n_cand - 1]]

            def kern(i: int) -> Kernel:
                return Kernel(
                    id=f"c{i}", source=source, entry=sp.kernel_name, defines=dict(sp.entries[i].params)
                )

            queries = [PairQuery(kern(base_i), kern(c), workload, sp.device, None) for c in cands]

            async def timed(qs: list[PairQuery] = queries, f: LocalForecaster = forecaster) -> list[float]:
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    await f.forecast(qs)
                    times.append((time.perf_counter() - t0) * 1000.0)
                return times

            times = anyio.run(timed)
            first, rest = times[0], sorted(times[1:])
            p50, p95 = rest[len(rest) // 2], rest[int(len(rest) * 0.95)]

            # Five points no call has seen (each candidate count gets its own), added one at a time.
            fresh = [int(i) for i in order[len(order) - 5 * (n_cand > 2) - 5 :][:5]]

            async def updates(
                qs: list[PairQuery] = queries,
                f: LocalForecaster = forecaster,
                h: DictHistory = history,
                new: list[int] = fresh,
            ) -> list[float]:
                times = []
                for i in new:
                    e = sp.entries[i]
                    k = kern(i)
                    h.add(
                        (k.family_key(), sp.device, workload.key()),
                        FamilyPoint(dict(e.params), None, e.status, _recorded_ms(e), k.content_key()),
                    )
                    t0 = time.perf_counter()
                    await f.forecast(qs)
                    times.append((time.perf_counter() - t0) * 1000.0)
                return times

            update = sorted(anyio.run(updates))[2]
            out[f"{n_points}pts_{n_cand}cand"] = {
                "first_ms": first,
                "p50_ms": p50,
                "p95_ms": p95,
                "update_ms": update,
            }
            print(
                f"  {n_points:5d} points, {n_cand:2d} candidates: first {first:8.1f}  p50 {p50:6.2f}  p95 {p95:6.2f}"
                f"  update {update:7.1f}"
            )
    return out


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["search", "model", "latency", "all"])
    p.add_argument("--set", default="heldout", help="tune, heldout, all, or comma-separated space names")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--measurements", type=int, default=100)
    p.add_argument("--strategies", default="forecast,random")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--sizes", default="10,30,100", help="history sizes for the model report")
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--model-seeds", type=int, default=3)
    p.add_argument(
        "--opts", default="{}", help="JSON options for the search (pool_size, screens_per_step, ...)"
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--latency-space", default="dedisp-A100", help="the space of the latency report")
    p.add_argument("--verbose", action="store_true", help="print every seed's fraction")
    args = p.parse_args(argv)
    names = _select(args.set)
    report: dict[str, Any] = {}
    t0 = time.time()
    if args.what in ("search", "all"):
        report["search"] = search_report(
            names,
            args.seeds,
            args.measurements,
            args.strategies.split(","),
            args.workers,
            json.loads(args.opts),
            args.verbose,
        )
    if args.what in ("model", "all"):
        sizes = [int(s) for s in args.sizes.split(",")]
        report["model"] = model_report(names, sizes, args.model_seeds, args.pairs, args.workers)
    if args.what in ("latency", "all"):
        report["latency"] = latency_report(name=args.latency_space)
    print(f"\n({time.time() - t0:.0f} s)")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
