"""Replay start-up and lookup speed: construction, devices(), first measure (parses the file), later measures.

Run: python benchmarks/bench_replay_load.py [RECORDING ... | --synthetic N]
Default: the largest shared recording, a synthetic 18,000-entry file written to a tmp dir, and all shared
recordings at once. Prints medians (ms) of several fresh runs. `--synthetic N` times a synthetic recording of
N entries instead (200000: a space larger than any recorded one), with the memory its parsed space holds.
"""

from __future__ import annotations

import gzip
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp.measure.base import MeasureRequest  # noqa: E402
from forecaster_mcp.measure.replay import ReplayMeasurer, read_header  # noqa: E402
from forecaster_mcp.models import Kernel, Workload  # noqa: E402

DATASETS = ROOT.parent / "shared/datasets/kernel_tuner_benchmark_hub"
REPEATS = 5
LATER = 200


def synthetic(path: Path, entries: int = 18_000, runs: int = 32) -> Path:
    """A Kernel Tuner-shaped cache file with `entries` configurations of `runs` timings each."""
    rng = random.Random(0)
    values = {
        "block_size_x": list(range(1, 31)),
        "block_size_y": list(range(1, 31)),
        "tile": list(range(1, 21)),
    }
    keys = list(values)
    cache: dict[str, Any] = {}
    for i in range(entries):
        params = {"block_size_x": i % 30 + 1, "block_size_y": i // 30 % 30 + 1, "tile": i // 900 + 1}
        base = rng.uniform(1.0, 10.0)
        times = [base * rng.uniform(0.99, 1.01) for _ in range(runs)]
        cache[",".join(str(params[k]) for k in keys)] = {
            **params,
            "time": sum(times) / runs,
            "times": times,
            "compile_time": 500.0,
            "verification_time": 0,
            "benchmark_time": sum(times),
        }
    doc = {
        "device_name": "NVIDIA A100-PCIE-40GB",
        "kernel_name": "synthetic_kernel",
        "problem_size": [4096],
        "tune_params_keys": keys,
        "tune_params": values,
        "objective": "time",
        "cache": cache,
    }
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000.0


async def bench(label: str, paths: list[Path]) -> None:
    header = read_header(paths[0])
    space_probe = ReplayMeasurer([paths[0]]).spaces()[0]
    entry = next(e for e in space_probe.entries if e.ok)
    kernel = Kernel(source="// replay", entry=header.kernel_name, defines=entry.params)
    request = MeasureRequest(kernel=kernel, workload=Workload(), device=header.device, max_seconds=1e6)

    construct, listing, first, later = [], [], [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        measurer = ReplayMeasurer(paths)
        t1 = time.perf_counter()
        measurer.devices()
        t2 = time.perf_counter()
        await measurer.measure(request)
        t3 = time.perf_counter()
        construct.append(t1 - t0)
        listing.append(t2 - t1)
        first.append(t3 - t2)
    for _ in range(LATER):
        t0 = time.perf_counter()
        await measurer.measure(request)
        later.append(time.perf_counter() - t0)
    size = sum(p.stat().st_size for p in paths) / 1e6
    print(
        f"{label:<44} files={len(paths):>2} size={size:5.1f}MB "
        f"entries(first file)={len(space_probe.entries):>6}  "
        f"construct={median_ms(construct):7.2f}ms devices()={median_ms(listing):6.3f}ms "
        f"first_measure={median_ms(first):7.1f}ms later_measure={median_ms(later):6.3f}ms"
    )


def rss_mb() -> float:
    """This process's resident memory (Linux), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def bench_big(entries: int) -> None:
    """One parse of a synthetic recording of `entries` entries (a fresh parse is what start-up pays): header
    read, full parse, first lookup, and the memory the parsed space holds."""
    from forecaster_mcp.measure.replay import load_space

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = synthetic(Path(tmp) / f"synthetic{entries}.json.gz", entries=entries)
        written = time.perf_counter() - t0
        before = rss_mb()
        t0 = time.perf_counter()
        read_header(path)
        t1 = time.perf_counter()
        space = load_space(path)
        t2 = time.perf_counter()
        space.find(space.entries[-1].params)
        t3 = time.perf_counter()
        after = rss_mb()
        print(
            f"synthetic {entries:,} entries x 32 runs: file={path.stat().st_size / 1e6:.1f}MB (gz, written in "
            f"{written:.1f}s) read_header={(t1 - t0) * 1e3:.2f}ms load_space={t2 - t1:.2f}s "
            f"first_find(index)={(t3 - t2) * 1e3:.0f}ms rss_growth={after - before:.0f}MB "
            f"(rss={after:.0f}MB, process peak incl. writing the file={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}MB) "
            f"valid={len(space.valid_entries())}"
        )


async def main(argv: list[str]) -> None:
    if argv[:1] == ["--synthetic"]:
        bench_big(int(argv[1]))
        return
    if argv:
        for p in argv:
            await bench(p, [Path(p)])
        return
    shared = sorted(p for p in DATASETS.rglob("*.json.gz")) if DATASETS.exists() else []
    if shared:
        biggest = max(shared, key=lambda p: p.stat().st_size)
        await bench(f"largest shared: {biggest.relative_to(DATASETS)}", [biggest])
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic(Path(tmp) / "synthetic18k.json.gz")
        await bench("synthetic 18,000 entries x 32 runs", [path])
    if shared:
        await bench("all shared recordings (measure: the first)", shared)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
