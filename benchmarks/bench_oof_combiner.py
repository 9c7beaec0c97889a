"""Combination weights fitted in sample or out of fold: which pools new pairs better? (not in CI)

    python benchmarks/bench_oof_combiner.py --seeds 20
    python benchmarks/bench_oof_combiner.py --refresh-cost 5000 50000

With several forecasters the engine pools their calibrated p_faster, logit p = sum_i w_i logit p_i, the weights
fitted on the verified pairs every component answered (combine.Combiner.fit). Each component's calibration is
fitted on its verified pairs too, so calibrating those same pairs with it (in sample) makes every answer look
better than it will on a new pair, most of all the answers of a component whose calibration fits its rows
closely (few rows per GPU). Out of fold, each pair's answers are calibrated by the fits that did not see its fold
(the engine's OOF_FOLDS fits, as for the threshold history).

Simulated: each pair has a latent z ~ N(0, 1.5^2); the candidate is faster with chance sigmoid(z). Two components:
  local   informative, about calibrated: logit p = s_g (z + N(0, 1)), s_g ~ U(0.7, 1.3) per GPU
  claude  noisier and overconfident, biased per GPU: logit p = 2.5 (rho z + N(0, 1.2^2)) + b_g, b_g ~ N(0, 0.7^2);
          its prior slope is Claude's (calibration_slope 0.4)
Per GPU, local answered --local pairs and claude the first `claude` of them (the scenario's). Both are fitted
with the engine's own code: ForecastEngine.fit (calibrations, and the weights out of fold) and, for the weights in
sample, combine.Combiner.fit on the same pairs calibrated by the engine's final fits. Then 4,000 new pairs per GPU
are pooled with each set of weights; printed per scenario, means over seeds: the weights, the held-out log loss
and ECE (metrics.log_loss / metrics.ece) of the pooled forecast, of local's calibrated forecast alone and of the
pool with the best weights for the new pairs (fitted on them: a bound, not a method), and in how many seeds the
out-of-fold pool had the lower log loss.

--refresh-cost N...: the time of ForecastEngine.refresh with two components and N verified pairs in a real
SQLite store (a first refresh, and the median refresh after one measurement that verifies 3 more pairs).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp import bins  # noqa: E402
from forecaster_mcp.forecast import metrics  # noqa: E402
from forecaster_mcp.forecast.base import ScriptedForecaster  # noqa: E402
from forecaster_mcp.forecast.calibration import logit, sigmoid, with_p_faster  # noqa: E402
from forecaster_mcp.forecast.combine import Combiner  # noqa: E402
from forecaster_mcp.forecast.engine import ForecastEngine, Outcome  # noqa: E402

NAMES = ("local", "claude")
CLAUDE_SLOPE = 0.4  # ClaudeForecaster.calibration_slope


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    local: int  # verified pairs per GPU local answered
    claude: int  # of which claude answered these
    rho: float  # how much of the latent claude's answers carry


SCENARIOS = (
    Scenario("claude on 15 of 200 pairs per GPU, 6 GPUs", 6, 200, 15, 0.5),
    Scenario("claude on 30 of 200 pairs per GPU, 6 GPUs", 6, 200, 30, 0.5),
    Scenario("claude on 12 of 100 pairs per GPU, 10 GPUs", 10, 100, 12, 0.5),
    Scenario("claude on 60 of 300 pairs per GPU, 3 GPUs", 3, 300, 60, 0.5),
    Scenario("claude weak (rho 0.15) on 12 of 120, 4 GPUs", 4, 120, 12, 0.15),
    Scenario("both on 200 pairs per GPU, 6 GPUs", 6, 200, 200, 0.5),
    Scenario("both on 1000 pairs per GPU, 2 GPUs", 2, 1000, 1000, 0.5),
)


def _scripted(name: str, slope: float = 1.0) -> ScriptedForecaster:
    f = ScriptedForecaster()
    f.name = name
    f.calibration_slope = slope  # type: ignore[attr-defined]
    return f


class World:
    def __init__(self, scenario: Scenario, seed: int) -> None:
        self.s = scenario
        self.rng = np.random.default_rng(seed)
        self.gpus = [f"gpu{g}" for g in range(scenario.gpus)]
        self.scale = self.rng.uniform(0.7, 1.3, scenario.gpus)
        self.bias = self.rng.normal(0.0, 0.7, scenario.gpus)

    def draw(self, g: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        z = self.rng.normal(0.0, 1.5, n)
        faster = self.rng.random(n) < sigmoid(z)
        p_local = sigmoid(self.scale[g] * (z + self.rng.normal(0.0, 1.0, n)))
        p_claude = sigmoid(2.5 * (self.s.rho * z + self.rng.normal(0.0, 1.2, n)) + self.bias[g])
        return faster, p_local, p_claude


def _bins(p: float) -> list[float]:
    return with_p_faster([1.0 / bins.N_BINS] * bins.N_BINS, p)


def one_run(scenario: Scenario, seed: int, held_out: int) -> dict[str, np.ndarray]:
    world = World(scenario, seed)
    outcomes: list[Outcome] = []
    for g, gpu in enumerate(world.gpus):
        faster, p_local, p_claude = world.draw(g, scenario.local)
        for i in range(scenario.local):
            raw = {"local": _bins(float(p_local[i]))}
            if i < scenario.claude:
                raw["claude"] = _bins(float(p_claude[i]))
            outcomes.append(Outcome(gpu, 2.0 if faster[i] else 0.5, raw))
    engine = ForecastEngine([_scripted("local"), _scripted("claude", CLAUDE_SLOPE)])
    engine.fit(outcomes)  # calibrations, and the weights out of fold
    w_oof = np.array(engine._combiner.weights)
    joint = [o for o in outcomes if "claude" in o.raw]
    p_in = [[engine._calibrators[n].p(bins.p_faster(o.raw[n]), o.hardware) for n in NAMES] for o in joint]
    w_in = np.array(Combiner.fit(NAMES, np.array(p_in), [o.speedup > 1 for o in joint]).weights)

    x_parts, y_parts = [], []
    for g, gpu in enumerate(world.gpus):
        faster, p_local, p_claude = world.draw(g, held_out)
        cal = [engine._calibrators[n].for_hardware(gpu) for n in NAMES]
        x_parts.append(
            np.column_stack([logit(c.p_array(p)) for c, p in zip(cal, (p_local, p_claude), strict=True)])
        )
        y_parts.append(faster)
    x, y = np.vstack(x_parts), np.concatenate(y_parts)
    speedups = np.where(y, 2.0, 0.5)
    w_best = np.array(Combiner.fit(NAMES, sigmoid(x), y).weights)
    out = {"w_in": w_in, "w_oof": w_oof, "w_best": w_best}
    for label, p in (
        ("in", sigmoid(x @ w_in)),
        ("oof", sigmoid(x @ w_oof)),
        ("best", sigmoid(x @ w_best)),
        ("local", sigmoid(x[:, 0])),
    ):
        out[label] = np.array([metrics.log_loss(p, speedups), metrics.ece(p, speedups)])
    return out


def quality(seeds: int, held_out: int) -> None:
    print(f"{seeds} seeds, {held_out} held-out pairs per GPU; means over seeds (log loss / ECE of the pool)")
    print(
        f"{'scenario':46} {'w in sample':>13} {'w oof':>13} {'in sample':>15} {'out of fold':>15} "
        f"{'local alone':>15} {'best weights':>15} {'oof better':>10}"
    )
    for s in SCENARIOS:
        runs = [one_run(s, seed, held_out) for seed in range(seeds)]

        def mean(key: str, runs: list[dict[str, np.ndarray]] = runs) -> np.ndarray:
            return np.mean([r[key] for r in runs], axis=0)

        def pair(v: np.ndarray) -> str:
            return f"{v[0]:.4f} / {v[1]:.4f}"

        def weights(v: np.ndarray) -> str:
            return f"{v[0]:.2f} / {v[1]:.2f}"

        better = sum(r["oof"][0] < r["in"][0] for r in runs)
        print(
            f"{s.name:46} {weights(mean('w_in')):>13} {weights(mean('w_oof')):>13} {pair(mean('in')):>15} "
            f"{pair(mean('oof')):>15} {pair(mean('local')):>15} {pair(mean('best')):>15} {better:>6}/{seeds}"
        )


# ---------------------------------------------------------------------------------------------- refresh cost


async def refresh_cost(n_pairs: int, rounds: int = 5) -> None:
    from forecaster_mcp.models import (
        DeviceProvenance,
        Kernel,
        Launch,
        MeasureCost,
        MeasureResult,
        RuntimeStats,
    )
    from forecaster_mcp.store.db import ForecastRow, Store

    rng = random.Random(0)
    source = "__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }"

    def kernel(i: int) -> Kernel:
        return Kernel(
            source=source, entry="k", defines={"BS": i}, launch=Launch(grid=(4, 1, 1), block=(32, 1, 1))
        )

    async def measure(store: Store, k: Kernel, median: float) -> None:
        stats = RuntimeStats(
            median=median, mean=median, min=median, p10=median, p90=median, std=0.0,
            ci95_low=median, ci95_high=median, runs=10,
        )  # fmt: skip
        result = MeasureResult(
            kernel_id="k0", status="ok", runtime_ms=stats,
            device=DeviceProvenance(name="A100", backend="fake", driver="550.1"), cost=MeasureCost(gpu_seconds=0.5),
        )  # fmt: skip
        await store.save_measurement(
            cache_key=f"{k.content_key()}/A100/w", ledger="bench", idempotency_key=None,
            kernel_json=k.model_dump_json(), workload_key="w", family_key=k.family_key(),
            content_key=k.content_key(), hardware="A100", result=result, charged_gpu_seconds=0.5, cached=False,
        )  # fmt: skip

    def rows(base: Kernel, cand: Kernel, log2_speedup: float) -> list[ForecastRow]:
        p_local = 1 / (1 + math.exp(-(1.5 * log2_speedup + rng.gauss(0, 1))))
        p_claude = 1 / (1 + math.exp(-(3 * log2_speedup + rng.gauss(0, 2.5))))

        def row(name: str, p: float, ledger: str | None, **fails: float) -> ForecastRow:
            return ForecastRow(
                ledger=ledger, forecaster=name, hardware="A100", workload_key="w",
                baseline_key=base.content_key(), candidate_key=cand.content_key(),
                probs=[(1 - p) / 4] * 4 + [p / 4] * 4, p_faster=p, verdict="unsure", decided_by="forecast",
                family_key=cand.family_key(), **fails,  # type: ignore[arg-type]
            )  # fmt: skip

        return [
            row("local@0+claude@0", p_local, "bench", p_fail=0.0, p_fail_baseline=0.0),
            row("raw:local@0", p_local, None),
            row("raw:claude@0", p_claude, None),
        ]

    n_kernels = math.ceil((1 + math.sqrt(1 + 8 * n_pairs)) / 2)
    ks = [kernel(i) for i in range(n_kernels)]
    runtime = [math.exp(rng.gauss(0, 0.7)) for _ in ks]
    pairs = [(a, b) for a in range(n_kernels) for b in range(a + 1, n_kernels)][:n_pairs]
    with tempfile.TemporaryDirectory() as tmp:
        store = await Store.open(Path(tmp) / "forecaster.sqlite3")
        try:
            await store.create_ledger("bench", 1e9)
            for start in range(0, len(pairs), 5000):
                chunk = pairs[start : start + 5000]
                await store.save_forecasts(
                    [r for a, b in chunk for r in rows(ks[a], ks[b], math.log2(runtime[a] / runtime[b]))]
                )
            for k, t in zip(ks, runtime, strict=True):
                await measure(store, k, t)
            engine = ForecastEngine([_scripted("local"), _scripted("claude")], store, refresh_interval_s=1e9)
            t0 = time.perf_counter()
            await engine.refresh(force=True)
            first = time.perf_counter() - t0
            after: list[float] = []
            for r in range(rounds):
                new, t = kernel(10**6 + r), math.exp(rng.gauss(0, 0.7))
                await store.save_forecasts(
                    [x for j in range(3) for x in rows(ks[j], new, math.log2(runtime[j] / t))]
                )
                await measure(store, new, t)
                engine.mark_stale()
                t0 = time.perf_counter()
                await engine.refresh()
                after.append(time.perf_counter() - t0)
        finally:
            await store.close()
    print(
        f"{n_pairs} verified pairs of 2 components: first refresh {first:.3f} s, refresh after one measurement "
        f"{statistics.median(after):.3f} s (median of {rounds}, max {max(after):.3f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--held-out", type=int, default=4000, help="new pairs per GPU")
    ap.add_argument(
        "--refresh-cost", type=int, nargs="+", metavar="N", help="time refreshes at N verified pairs"
    )
    args = ap.parse_args()
    if args.refresh_cost:
        for n in args.refresh_cost:
            anyio.run(refresh_cost, n)
        return
    quality(args.seeds, args.held_out)


if __name__ == "__main__":
    main()
