"""GPU check: measure the bundled examples for real, write them as a Kernel Tuner cache recording, and compare
the harness's timing noise with a plain CUDA-event loop and with triton.testing.do_bench.

Run on a machine with an NVIDIA GPU and pycuda (benchmarks/gpu_check.sh sets that up):
    python benchmarks/gpu_check.py --out OUT
Writes into OUT:
    examples_measured.json   each example's MeasureResult, raw samples and the status examples.json expects
    recordings/<entry>.json  Kernel Tuner cache files of the good examples (replay them with --replay)
    noise.json               per kernel and timing method: median, CV within a run, spread of run medians
    device.json              what the worker reported about the device
Exit status 0 when every example got its expected status, 1 otherwise, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp.examples import ExampleSuite, load_examples  # noqa: E402
from forecaster_mcp.measure.base import MeasureRequest  # noqa: E402
from forecaster_mcp.measure.pycuda_measurer import (  # noqa: E402
    CompiledKernel,
    NvccCompiler,
    PycudaMeasurer,
    detect_reason,
)
from forecaster_mcp.models import Kernel  # noqa: E402

NOISE_KERNELS = [
    ("vector_add", "vector_add_naive"),
    ("matmul", "matmul_tiled_16"),
    ("reduction", "reduce_warp_shuffle"),
]


# ---------------------------------------------------------------- recordings (Kernel Tuner cache format)


def write_recordings(rows: list[dict[str, Any]], device_name: str, out_dir: Path) -> list[Path]:
    """One Kernel Tuner cache file per kernel entry from measured rows (status ok only).

    Each row: {"kernel": Kernel JSON, "problem": {...}, "result": MeasureResult JSON, "samples_ms": [...]}.
    The tuning parameters are the kernel's defines (none for most examples: the key is then "").
    Header keys come before "cache", as Kernel Tuner writes them (replay reads headers only at start-up).
    """
    by_entry: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["result"]["status"] == "ok" and row["samples_ms"]:
            by_entry.setdefault(row["kernel"]["entry"], []).append(row)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for entry, entry_rows in by_entry.items():
        keys = sorted({k for row in entry_rows for k in row["kernel"]["defines"]})
        tune_params: dict[str, list[Any]] = {k: [] for k in keys}
        cache: dict[str, dict[str, Any]] = {}
        for row in entry_rows:
            defines = row["kernel"]["defines"]
            for k in keys:
                if defines.get(k) not in tune_params[k]:
                    tune_params[k].append(defines.get(k))
            samples = [float(x) for x in row["samples_ms"]]
            cost = row["result"]["cost"]
            cache[",".join(str(defines.get(k)) for k in keys)] = {
                **{k: defines.get(k) for k in keys},
                "time": statistics.fmean(samples),
                "times": samples,
                "compile_time": cost["compile_seconds"] * 1e3,
                "verification_time": 0,
                "benchmark_time": cost["gpu_seconds"] * 1e3,
                "strategy_time": 0,
                "framework_time": 0,
                "timestamp": dt.datetime.now(dt.UTC).isoformat(),
            }
        doc = {
            "device_name": device_name,
            "kernel_name": entry,
            "problem_size": list(entry_rows[0]["problem"].values()),
            "tune_params_keys": keys,
            "tune_params": tune_params,
            "objective": "time",
            "cache": cache,
        }
        path = out_dir / f"{entry}.json"
        path.write_text(json.dumps(doc, indent=1))
        written.append(path)
    return written


# ---------------------------------------------------------------- measuring the examples


async def measure_examples(gpu: PycudaMeasurer, out: Path) -> tuple[list[dict[str, Any]], bool]:
    device = gpu.devices()[0]
    rows: list[dict[str, Any]] = []
    all_expected = True
    for suite in load_examples():
        for example in suite.kernels:
            is_reference = example.kernel.id == suite.reference_id
            request = MeasureRequest(
                kernel=example.kernel,
                workload=suite.workload,
                device=device,
                reference=None if is_reference else suite.reference,
                atol=suite.atol,
                rtol=suite.rtol,
                max_seconds=example.max_seconds or 20.0,
                max_runs=2000,
            )
            result, samples = await gpu.measure_with_samples(request)
            ok = result.status == example.expect_status
            all_expected &= ok
            stats = result.runtime_ms
            print(
                f"{suite.name:12s} {example.kernel.id:22s} {result.status:20s} "
                f"{'as expected' if ok else 'EXPECTED ' + example.expect_status:24s} "
                f"median {stats.median if stats else float('nan'):10.5f} ms  "
                f"runs {stats.runs if stats else 0:5d}  "
                f"noise {stats.relative_noise if stats else float('nan'):.4f}  "
                f"gpu {result.cost.gpu_seconds:.2f} s  flags {','.join(result.flags) or '-'}",
                flush=True,
            )
            rows.append(
                {
                    "suite": suite.name,
                    "id": example.kernel.id,
                    "expect_status": example.expect_status,
                    "as_expected": ok,
                    "kernel": example.kernel.model_dump(exclude={"source"}),
                    "problem": suite.workload.problem,
                    "result": result.model_dump(),
                    "samples_ms": samples if suite.name != "bad_kernels" else [],
                }
            )
    (out / "examples_measured.json").write_text(json.dumps(rows, indent=1))
    return rows, all_expected


# ---------------------------------------------------------------- noise: harness vs plain loops vs do_bench


def _cv(samples: list[float]) -> float:
    return statistics.stdev(samples) / statistics.fmean(samples) if len(samples) > 1 else 0.0


def noise_comparison(out: Path, repeats: int, runs: int) -> dict[str, Any]:
    """Same kernel, same buffers, four timing methods, `repeats` independent runs of `runs` samples each."""
    from forecaster_mcp.measure.gpu_worker import GpuSession, GuardedBuffers  # imports pycuda
    from forecaster_mcp.measure.inputs import generate_inputs
    from forecaster_mcp.measure.timing import relative_noise
    from forecaster_mcp.measure.worker_protocol import KernelImage

    session = GpuSession(0)
    compiler = NvccCompiler(out / "cache")
    try:
        from triton.testing import do_bench  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        do_bench = None
        triton_note = f"triton unavailable: {exc}"
    else:
        triton_note = "triton.testing.do_bench(return_mode='all'), launches on the legacy default stream"
    methods = {
        "harness": "L2 flush (memset of exactly the L2 size) + events + device-wide sync per sample",
        "plain_events": "events around each launch, stream sync, no flush (warm L2)",
        "plain_batched": f"one event pair around {runs} back-to-back launches, their mean (one value/run)",
        "do_bench": triton_note,
    }
    report: dict[str, Any] = {"device": session.info.model_dump(), "runs": runs, "repeats": repeats}
    report |= {"methods": methods, "kernels": {}}
    suites = {s.name: s for s in load_examples()}
    for suite_name, kid in NOISE_KERNELS:
        suite: ExampleSuite = suites[suite_name]
        kernel: Kernel = suite.kernel(kid)
        compiled = anyio.run(compiler.compile, kernel, session.info.arch)
        assert isinstance(compiled, CompiledKernel), compiled
        assert kernel.launch is not None
        image = KernelImage(
            cubin_path=compiled.cubin_path, symbol=compiled.symbol, entry=kernel.entry, launch=kernel.launch
        )
        loaded = session.load(image, suite.workload)
        buffers = GuardedBuffers(session.cuda, suite.workload, generate_inputs(suite.workload, 0))
        cuda = session.cuda
        results: dict[str, list[list[float]]] = {
            "harness": [],
            "plain_events": [],
            "plain_batched": [],
            "do_bench": [],
        }
        try:
            for _ in range(5):
                session.timed_sample(loaded, buffers)  # warm-up
            for _ in range(repeats):
                results["harness"].append([session.timed_sample(loaded, buffers) for _ in range(runs)])
                plain = []
                for _ in range(runs):
                    session.start.record(session.stream)
                    session.launch(loaded, buffers)
                    session.end.record(session.stream)
                    session.end.synchronize()
                    plain.append(float(session.end.time_since(session.start)))
                results["plain_events"].append(plain)
                session.start.record(session.stream)
                for _ in range(runs):
                    session.launch(loaded, buffers)
                session.end.record(session.stream)
                session.end.synchronize()
                results["plain_batched"].append([float(session.end.time_since(session.start)) / runs])
                if do_bench is not None:
                    # Stream None: the legacy default stream, which do_bench's events are recorded on.
                    on_default_stream = functools.partial(
                        loaded.function.prepared_async_call,
                        tuple(kernel.launch.grid),
                        tuple(kernel.launch.block),
                        None,
                        *buffers.params,
                        shared_size=kernel.launch.shared_mem_bytes,
                    )
                    times = do_bench(on_default_stream, warmup=25, rep=100, return_mode="all")
                    results["do_bench"].append([float(t) for t in times])
                cuda.Context.synchronize()
        finally:
            buffers.free()
        summary: dict[str, Any] = {}
        for method, per_run in results.items():
            if not per_run:
                continue
            medians = [statistics.median(r) for r in per_run]
            summary[method] = {
                "median_of_medians_ms": statistics.median(medians),
                "cv_within_run": statistics.fmean(_cv(r) for r in per_run),
                "ci95_rel_halfwidth": statistics.fmean(relative_noise(r) for r in per_run if len(r) > 1)
                if len(per_run[0]) > 1
                else None,
                "spread_of_medians": (max(medians) - min(medians)) / statistics.median(medians),
                "samples_per_run": [len(r) for r in per_run],
            }
        report["kernels"][f"{suite_name}/{kid}"] = summary
        print(f"\n{suite_name}/{kid}")
        for method, s in summary.items():
            print(
                f"  {method:14s} median {s['median_of_medians_ms']:10.5f} ms  "
                f"cv within {s['cv_within_run']:.4f}  spread of medians {s['spread_of_medians']:.4f}",
                flush=True,
            )
    session.close()
    (out / "noise.json").write_text(json.dumps(report, indent=1))
    return report


# ---------------------------------------------------------------- entry


async def _measure_all(out: Path) -> int:
    gpu = PycudaMeasurer.detect(out / "cache")
    if gpu is None:
        print(f"no GPU measurement here: {detect_reason()}", file=sys.stderr)
        return 2
    async with gpu:
        rows, all_expected = await measure_examples(gpu, out)
        info = gpu.device_info(gpu.devices()[0])
        if info is not None:
            (out / "device.json").write_text(info.model_dump_json(indent=1))
        written = write_recordings(rows, info.name if info else gpu.devices()[0], out / "recordings")
        print(f"recordings: {', '.join(p.name for p in written)}")
    return 0 if all_expected else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5, help="independent runs per timing method")
    parser.add_argument("--runs", type=int, default=100, help="samples per run")
    parser.add_argument("--skip-noise", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    code = anyio.run(_measure_all, args.out)
    if code == 2:
        return code
    if not args.skip_noise:
        noise_comparison(args.out, args.repeats, args.runs)
    return code


if __name__ == "__main__":
    sys.exit(main())
