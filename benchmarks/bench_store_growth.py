"""Per-call latency of each tool as the store grows: does a server a search loop has used for weeks slow down?

Run: python benchmarks/bench_store_growth.py [SIZES...]   (default: 1000 20000 200000 forecast rows)

For each size it builds a store the way weeks of a search loop leave one, then times each tool in process
(the mcp Client against build_server, as bench_server.py does) on a replay measurer:

- The kernel family the loop is working on (the shared A100 convolution recording) is measured and forecast
  through the server itself: ACTIVE_POINTS measurements, compare calls over them. Its size is the same at every
  store size, so what grows below is the store, not the family model the local forecaster fits.
- The rest is bulk-inserted in the row shapes the service writes (templates taken from the rows the server just
  wrote): other kernel families (other sources, real recorded configurations and runtimes), MEASUREMENTS_PER
  measurements per 1,000 forecast rows (re-measurements, cache-hit copies, failures, a few flagged
  below_physical_floor), and forecasts as compare_kernels stores them: a final row under the engine's name on
  one of LEDGERS ledgers plus its raw:<component> row, in the three regimes. Most pairs have both kernels
  measured; the store's own verification SQL (_VERIFY, _VERIFY_FAILED) then sets what it would have set.
- Then, per round: measure_kernel of a new configuration never compared (replay, paid; it verifies no pair),
  compare_kernels right after it (the engine is stale), compare_kernels of an untried configuration against
  three measured ones, measure_kernel of that configuration (it verifies the pairs it was just forecast in, as
  a search loop's measurements do), compare_kernels right after it (the engine re-reads those pairs and refits
  the forecaster names they changed), compare_kernels again (fresh), measure_kernel of a measured
  configuration (cache hit), budget_status. Medians over ROUNDS rounds.
"""

from __future__ import annotations

import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp import bins  # noqa: E402
from forecaster_mcp.measure.replay import load_space  # noqa: E402
from forecaster_mcp.models import Kernel  # noqa: E402
from forecaster_mcp.server.app import build_server  # noqa: E402
from forecaster_mcp.server.client import structured  # noqa: E402
from forecaster_mcp.service import Service  # noqa: E402
from forecaster_mcp.settings import Settings  # noqa: E402
from forecaster_mcp.store.db import _VERIFY, _VERIFY_FAILED  # noqa: E402

RECORDING = (
    ROOT.parent / "shared/datasets/kernel_tuner_benchmark_hub/cachefiles/convolution_milo/A100.json.gz"
)
SRC = "// convolution_kernel from benchmark_hub (source not bundled)\n"
ENTRY = "convolution_kernel"
LEDGER = "bench"
LEDGERS = 4
ACTIVE_POINTS = 200
ACTIVE_COMPARES = 40
MEASUREMENTS_PER = 100  # per 1,000 forecast rows: 200,000 forecasts, 20,000 measurements
FAMILY_MEASUREMENTS = 200  # measurements per other family
ROUNDS = 15
FORECASTERS = (("local@1.0", 0.6), ("local@1.0:unmeasured", 0.3), ("local@1.0:prior", 0.1))


def _probs(rng: random.Random, speedup: float | None) -> list[float]:
    """A forecast's 8 bins: peaked near the true bin most of the time, as a useful forecaster's are."""
    centre = rng.randrange(bins.N_BINS)
    if speedup is not None and rng.random() < 0.7:
        centre = bins.bin_index(speedup)
    w = [
        rng.random() * 0.3 + (3.0 if i == centre else 1.0 if abs(i - centre) == 1 else 0.0) for i in range(8)
    ]
    total = sum(w)
    return [x / total for x in w]


async def _seed_active(service: Service, configs: list[dict[str, Any]], rng: random.Random) -> None:
    """The active family, measured and forecast through the server."""
    async with Client(build_server(service)) as client:
        for i, d in enumerate(configs[:ACTIVE_POINTS]):
            k = {"id": f"s{i}", "source": SRC, "entry": ENTRY, "defines": d}
            structured(await client.call_tool("measure_kernel", {"kernel": k}))
        for _ in range(ACTIVE_COMPARES):
            pick = rng.sample(configs[: ACTIVE_POINTS + 100], 4)
            cands = [{"id": f"c{j}", "source": SRC, "entry": ENTRY, "defines": d} for j, d in enumerate(pick)]
            structured(await client.call_tool("compare_kernels", {"candidates": cands}))


def _bulk(db: Path, n_forecasts: int, configs: list[dict[str, Any]], runtimes: list[float | None]) -> None:
    """Other families' measurements and every family's forecasts, in the shapes the server wrote above."""
    rng = random.Random(n_forecasts)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    m_tpl = conn.execute(
        "SELECT result_json, workload_key, hardware FROM measurements WHERE status = 'ok' AND cached = 0 LIMIT 1"
    ).fetchone()
    result_tpl, wkey, hw = json.loads(m_tpl[0]), m_tpl[1], m_tpl[2]
    now = time.time() - 30 * 86400
    n_meas = n_forecasts * MEASUREMENTS_PER // 1000
    families: list[list[tuple[str, str]]] = []  # per family: (content_key, family_key) of measured kernels
    unmeasured: list[list[tuple[str, str]]] = []
    m_rows = []
    runtime_of: dict[str, float] = {}
    fam = -1
    for i in range(n_meas):
        if i % FAMILY_MEASUREMENTS == 0:
            fam += 1
            families.append([])
            unmeasured.append([])
        j = rng.randrange(len(configs))
        k = Kernel(id=f"k{i}", source=f"{SRC}// variant {fam}\n", entry=ENTRY, defines=configs[j])
        key = (k.content_key(), k.family_key())
        r = rng.random()
        status, runtime, flags, cached = "ok", runtimes[j], [], 0
        if runtime is None or r < 0.04:
            status, runtime = "compile_error", None
        elif r < 0.045:
            flags, runtime = ["below_physical_floor"], 0.001
        elif r < 0.15 and families[fam]:
            key, cached = rng.choice(families[fam]), 1  # a cache-hit copy of a measured kernel
        elif r < 0.2 and families[fam]:
            key = rng.choice(families[fam])  # re-measured
            runtime = runtime * (1 + rng.gauss(0, 0.02))
        res = dict(result_tpl, kernel_id=k.id, status=status, flags=flags)
        res["runtime_ms"] = (
            None
            if runtime is None
            else dict(result_tpl["runtime_ms"], median=runtime, ci95_low=runtime * 0.99)
        )
        if status != "ok":
            res["message"] = "nvcc: error"
        families[fam].append(key)
        if runtime is not None:
            runtime_of[key[0]] = runtime
        unmeasured[fam].append(
            (Kernel(id="u", source=f"{SRC}// variant {fam}\n", entry=ENTRY, defines=rng.choice(configs)).content_key(),
             key[1])
        )  # fmt: skip
        m_rows.append(
            (
                f"{i:064x}", LEDGER if i % LEDGERS == 0 else f"L{i % LEDGERS}", k.model_dump_json(),
                json.dumps(configs[j], sort_keys=True), wkey, key[1], key[0], hw, json.dumps(res), status,
                runtime, 0 if cached else 40000 + rng.randrange(100000), 40000 if cached else 0, cached,
                now + i, "unchecked",
            )
        )  # fmt: skip
    conn.executemany(
        "INSERT INTO measurements (cache_key, ledger, kernel_json, defines_json, workload_key, family_key, "
        "content_key, hardware, result_json, status, runtime_ms, charged_micro, saved_micro, cached, created_at, "
        "check_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        m_rows,
    )
    f_rows = []
    names, weights = zip(*FORECASTERS, strict=True)
    for i in range(n_forecasts // 2):
        fam = rng.randrange(len(families)) if families else 0
        measured = families[fam] if families else [("x", "x")]
        base = rng.choice(measured)
        cand = rng.choice(measured) if rng.random() < 0.8 else rng.choice(unmeasured[fam])
        name = rng.choices(names, weights)[0]
        ledger = LEDGER if i % LEDGERS == 0 else f"L{i % LEDGERS}"
        t_base, t_cand = runtime_of.get(base[0]), runtime_of.get(cand[0])
        probs = _probs(rng, t_base / t_cand if t_base and t_cand else None)
        p = sum(probs[4:])
        verdict = "faster" if p > 0.95 else "slower" if p < 0.05 else "unsure"
        t = now + i * 10
        # The final row keeps its kernels' chances of failing (the engine scores it again with them), a raw
        # row none.
        for row_name, row_ledger, row_verdict, p_fail in (
            (name, ledger, verdict, 0.02),
            (f"raw:{name}", None, "unsure", None),
        ):
            f_rows.append(
                (
                    row_ledger, row_name, hw, wkey, base[0], cand[0], json.dumps(probs), p, row_verdict,
                    "forecast", t, cand[1], p_fail, p_fail,
                )
            )  # fmt: skip
    conn.executemany(
        "INSERT INTO forecasts (ledger, forecaster, hardware, workload_key, baseline_key, candidate_key, "
        "probs_json, p_faster, verdict, decided_by, created_at, family_key, p_fail, p_fail_baseline) VALUES "
        "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        f_rows,
    )
    # What save_measurement and save_forecasts would have set: the store's own verification of every row.
    conn.execute(_VERIFY + "actual_speedup IS NULL", (now,))
    conn.execute(_VERIFY_FAILED + "id > 0", (now,))
    for k in range(1, LEDGERS):
        conn.execute("INSERT OR IGNORE INTO ledgers VALUES (?, ?, 0, 0, ?, ?)", (f"L{k}", 10**15, now, now))
    conn.execute(
        "INSERT INTO forecast_totals (ledger, made, decided, deferred) SELECT ledger, 3 * count(*), "
        "3 * sum(verdict != 'unsure'), 3 * sum(verdict = 'unsure') FROM forecasts WHERE ledger IS NOT NULL "
        "GROUP BY ledger ON CONFLICT (ledger) DO UPDATE SET made = made + excluded.made, "
        "decided = decided + excluded.decided, deferred = deferred + excluded.deferred"
    )
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()


async def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def run_size(
    n_forecasts: int, configs: list[dict[str, Any]], runtimes: list[float | None]
) -> dict[str, Any]:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        settings = Settings.from_env(home=home, replay=[RECORDING], measurer="replay", ledger=LEDGER)
        service = await Service.open(settings)
        await service.store.create_ledger(LEDGER, 1e9)
        t0 = time.perf_counter()
        await _seed_active(service, configs, rng)
        await service.close()
        _bulk(home / "forecaster.sqlite3", n_forecasts, configs, runtimes)
        build_s = time.perf_counter() - t0
        conn = sqlite3.connect(home / "forecaster.sqlite3")
        counts = {
            t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("forecasts", "measurements")
        }
        counts["verified"] = conn.execute(
            "SELECT count(*) FROM forecasts WHERE actual_speedup IS NOT NULL"
        ).fetchone()[0]
        conn.close()
        service = await Service.open(settings)
        times: dict[str, list[float]] = {}
        fresh = iter(configs[ACTIVE_POINTS + 100 :])
        try:
            async with Client(build_server(service)) as client:

                def kernel(d: dict[str, Any], kid: str) -> dict[str, Any]:
                    return {"id": kid, "source": SRC, "entry": ENTRY, "defines": d}

                async def compare() -> None:
                    pick = rng.sample(configs[: ACTIVE_POINTS + 100], 4)
                    cands = [kernel(d, f"c{j}") for j, d in enumerate(pick)]
                    structured(await client.call_tool("compare_kernels", {"candidates": cands}))

                async def measure_new() -> None:
                    structured(await client.call_tool("measure_kernel", {"kernel": kernel(next(fresh), "m")}))

                # A search loop's step: compare an untried configuration against measured ones, then measure
                # it; that measurement verifies the pairs it was just forecast in (the engine's final and raw
                # rows), so the next compare re-signs and refits those forecaster names.
                tried: list[dict[str, Any]] = []

                async def compare_untried() -> None:
                    tried.append(next(fresh))
                    pick = [*rng.sample(configs[:ACTIVE_POINTS], 3), tried[-1]]
                    cands = [kernel(d, f"c{j}") for j, d in enumerate(pick)]
                    structured(await client.call_tool("compare_kernels", {"candidates": cands}))

                async def measure_compared() -> None:
                    structured(await client.call_tool("measure_kernel", {"kernel": kernel(tried[-1], "m")}))

                async def measure_hit() -> None:
                    d = rng.choice(configs[:ACTIVE_POINTS])
                    structured(await client.call_tool("measure_kernel", {"kernel": kernel(d, "h")}))

                async def budget() -> None:
                    structured(await client.call_tool("budget_status", {}))

                first = await _timed(compare)  # the first call reads and fits everything
                for _ in range(ROUNDS):
                    for name, fn in (
                        ("measure_kernel (replay, new)", measure_new),
                        ("compare_kernels (after a measurement)", compare),
                        ("compare_kernels (an untried candidate)", compare_untried),
                        ("measure_kernel (replay, the untried one)", measure_compared),
                        ("compare_kernels (after it verified pairs)", compare),
                        ("compare_kernels (no new measurement)", compare),
                        ("measure_kernel (cache hit)", measure_hit),
                        ("compare_kernels (after a cache hit)", compare),
                        ("budget_status", budget),
                    ):
                        times.setdefault(name, []).append(await _timed(fn))
        finally:
            await service.close()
    out: dict[str, Any] = {"rows": counts, "build_s": round(build_s, 1), "first_compare_ms": round(first, 1)}
    print(
        f"\n{n_forecasts:,} forecast rows: {counts} (built in {build_s:.1f} s); first compare {first:.0f} ms"
    )
    for name, ms in times.items():
        out[name] = {"p50_ms": round(statistics.median(ms), 2), "max_ms": round(max(ms), 2)}
        print(f"  {name:42s} p50 {statistics.median(ms):8.1f} ms   max {max(ms):8.1f} ms")
    return out


async def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 20000, 200000]
    space = load_space(RECORDING)
    rng = random.Random(0)
    entries = list(space.entries)
    rng.shuffle(entries)
    configs = [dict(e.params) for e in entries]
    runtimes = [e.time_ms if e.ok else None for e in entries]
    report = {str(n): await run_size(n, configs, runtimes) for n in sizes}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "bench_store_growth.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    anyio.run(main)
