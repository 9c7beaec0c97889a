"""Server benchmarks: cold start over stdio, tool latency in process and over HTTP, HTTP throughput.

Run: python benchmarks/bench_server.py [RECORDING]   (default: the shared A100 convolution recording)
Prints medians of several runs; numbers go into the issue notes.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from serverproc import cli, start_http  # noqa: E402

from forecaster_mcp.server.app import build_server  # noqa: E402
from forecaster_mcp.server.client import connect_http, stdio_params, structured  # noqa: E402
from forecaster_mcp.service import Service  # noqa: E402
from forecaster_mcp.settings import Settings  # noqa: E402

DEFAULT = ROOT.parent / "shared/datasets/kernel_tuner_benchmark_hub/cachefiles/convolution_milo/A100.json.gz"
SRC = "// convolution_kernel from benchmark_hub (source not bundled)\n"
_CONFIGS: list[dict[str, Any]] = []


def load_configs(recording: Path) -> None:
    """Benchmark kernels are drawn from the recorded space (a replay refuses anything else)."""
    from forecaster_mcp.measure.replay import load_space

    _CONFIGS[:] = [e.params for e in load_space(recording).entries]


def kernel(rng: random.Random, kid: str) -> dict[str, Any]:
    return {"id": kid, "source": SRC, "entry": "convolution_kernel", "defines": rng.choice(_CONFIGS)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(name: str, ms: list[float]) -> dict[str, float]:
    out = {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 0.99), "n": len(ms)}
    print(f"{name:45s} p50 {out['p50_ms']:7.2f} ms   p99 {out['p99_ms']:7.2f} ms   (n={len(ms)})")
    return out


async def timed(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def cold_start(recording: Path, runs: int = 5) -> dict[str, float]:
    times = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as home:
            t0 = time.perf_counter()
            async with Client(stdio_params(Path(home), replay=[recording]), read_timeout_seconds=60) as c:
                await c.list_tools()
                times.append((time.perf_counter() - t0) * 1000)
    out = {"median_ms": statistics.median(times), "max_ms": max(times)}
    print(
        f"{'cold start to tools/list over stdio':45s} median {out['median_ms']:7.1f} ms  max {out['max_ms']:.1f} ms"
    )
    return out


async def in_process(recording: Path, n: int = 200) -> dict[str, Any]:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as home:
        settings = Settings.from_env(home=Path(home), replay=[recording], measurer="replay", ledger="bench")
        service = await Service.open(settings)
        await service.store.create_ledger("bench", 1e9)
        try:
            async with Client(build_server(service)) as client:

                async def compare() -> None:
                    structured(
                        await client.call_tool(
                            "compare_kernels", {"candidates": [kernel(rng, "a"), kernel(rng, "b")]}
                        )
                    )

                async def measure() -> None:
                    structured(await client.call_tool("measure_kernel", {"kernel": kernel(rng, "m")}))

                await compare()
                await measure()
                cmp_cold = summary(
                    "in-process compare_kernels (2 cands, no history)", await timed(compare, n)
                )
                meas = summary("in-process measure_kernel (replay)", await timed(measure, n))
                cmp_warm = summary("in-process compare_kernels (2 cands, ~200 pts)", await timed(compare, n))
                many = [kernel(rng, f"c{i}") for i in range(64)]

                async def compare64() -> None:
                    structured(await client.call_tool("compare_kernels", {"candidates": many}))

                c64 = summary("in-process compare_kernels (64 cands)", await timed(compare64, 30))
        finally:
            await service.close()
    return {"compare_2": cmp_cold, "measure": meas, "compare_2_history": cmp_warm, "compare_64": c64}


async def over_http(recording: Path, n: int = 200) -> dict[str, Any]:
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        cli(home, "ledger", "create", "bench", "--gpu-seconds", "1000000")
        token = cli(home, "token", "issue", "--ledger", "bench").stdout.strip().splitlines()[-1]
        srv = start_http(home, ["--replay", str(recording)])
        try:
            async with connect_http(srv.url, token) as (_, call):

                async def compare() -> None:
                    await call("compare_kernels", {"candidates": [kernel(rng, "a"), kernel(rng, "b")]})

                async def measure() -> None:
                    await call("measure_kernel", {"kernel": kernel(rng, "m")})

                await compare()
                cmp = summary("HTTP compare_kernels (2 cands)", await timed(compare, n))
                meas = summary("HTTP measure_kernel (replay)", await timed(measure, n))

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(200):
                        tg.start_soon(compare if i % 2 else measure)
                wall = time.perf_counter() - t0
                print(
                    f"{'HTTP 200 concurrent calls (one session)':45s} {wall:.2f} s  = {200 / wall:.0f} calls/s"
                )
        finally:
            srv.stop()
    return {"compare_2": cmp, "measure": meas, "concurrent_200_s": wall, "calls_per_s": 200 / wall}


async def main() -> None:
    recording = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    load_configs(recording)
    report = {
        "cold_start": await cold_start(recording),
        "in_process": await in_process(recording),
        "http": await over_http(recording),
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "bench_server.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    anyio.run(main)
