"""Measure a kernel corpus on a real GPU through the product's measurer (`PycudaMeasurer`), one JSON line per kernel.

    python benchmarks/measure_corpus.py --corpus benchmarks/corpus --out OUT/corpus.jsonl [--budget-s 220]

The corpus holds several problems, each with several *different* implementations (same workload, different
source), in the bundled examples' index format. Every kernel is measured with the problem's reference kernel as
the correctness check, exactly as `measure_kernel` would. Compiles run 16 at a time first (nvcc is the slow part),
then measurements run one at a time. Each line is flushed as soon as it is measured, so a run stopped at its time
limit keeps what it measured. `benchmarks/corpus_pairs.py` turns the lines into a pairs file for `forecaster-mcp
eval`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp.examples import ExampleSuite, load_examples  # noqa: E402
from forecaster_mcp.measure.base import MeasureRequest  # noqa: E402
from forecaster_mcp.measure.pycuda_measurer import PycudaMeasurer, detect_reason  # noqa: E402


def _suites(corpus: Path) -> list[tuple[str, ExampleSuite]]:
    """Every suite of every index, the first size of each problem before the second (a stopped run covers all)."""
    per_index = [(p.stem, load_examples(p)) for p in sorted(corpus.glob("*.json"))]
    ordered: list[tuple[str, ExampleSuite]] = []
    depth = max((len(s) for _, s in per_index), default=0)
    for i in range(depth):
        ordered += [(problem, suites[i]) for problem, suites in per_index if i < len(suites)]
    return ordered


async def run(args: argparse.Namespace) -> int:
    suites = _suites(args.corpus)
    if not suites:
        print(f"no corpus index (*.json) in {args.corpus}; pass --corpus benchmarks/corpus", file=sys.stderr)
        return 2
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for _, s in suites}
        if unknown:
            print(f"no such suite(s) in the corpus: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        suites = [(p, s) for p, s in suites if s.name in wanted]
    gpu = PycudaMeasurer.detect(args.cache)
    if gpu is None:
        print(f"no GPU measurement here: {detect_reason()}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    measured = failed = 0
    async with gpu:
        device = gpu.devices()[0]
        first = suites[0][1]
        await gpu.measure(MeasureRequest(kernel=first.reference, workload=first.workload, device=device))
        info = gpu.device_info(device)
        assert info is not None
        limiter = anyio.CapacityLimiter(args.jobs)

        async def build(kernel: Any) -> None:
            async with limiter:
                await gpu.compiler.compile(kernel, info.arch)

        unique = {gpu.compiler.key(ex.kernel, info.arch): ex.kernel for _, s in suites for ex in s.kernels}
        async with anyio.create_task_group() as tg:
            for kernel in unique.values():
                tg.start_soon(build, kernel)
        print(f"compiled {len(unique)} kernels in {time.monotonic() - t0:.1f} s", flush=True)

        with args.out.open("w", encoding="utf-8") as out:
            for problem, suite in suites:
                for ex in suite.kernels:
                    if time.monotonic() - t0 > args.budget_s:
                        print(f"budget of {args.budget_s} s spent: stopping", flush=True)
                        print(f"measured {measured}, failed {failed}")
                        return 0
                    is_ref = ex.kernel.id == suite.reference_id
                    request = MeasureRequest(
                        kernel=ex.kernel,
                        workload=suite.workload,
                        device=device,
                        reference=None if is_ref else suite.reference,
                        atol=suite.atol,
                        rtol=suite.rtol,
                        max_seconds=args.max_seconds,
                        max_runs=args.max_runs,
                    )
                    result, samples = await gpu.measure_with_samples(request)
                    ok = result.status == "ok"
                    measured += ok
                    failed += not ok
                    stats = result.runtime_ms
                    print(
                        f"{suite.name:24s} {ex.kernel.id or '':34s} {result.status:14s} "
                        f"{stats.median if stats else float('nan'):10.5f} ms  runs {stats.runs if stats else 0:4d} "
                        f"noise {stats.relative_noise if stats else float('nan'):.4f}"
                        + ("" if ok else f"  {(result.message or '')[:300]}"),
                        flush=True,
                    )
                    row = {
                        "problem": problem,
                        "suite": suite.name,
                        "reference": suite.reference_id,
                        "id": ex.kernel.id,
                        "hardware": info.name,
                        "kernel": ex.kernel.model_dump(exclude={"source"}),
                        "file": ex.file,
                        "workload": suite.workload.model_dump(),
                        "result": result.model_dump(mode="json"),
                        "samples_ms": samples,
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    print(f"measured {measured}, failed {failed}, {time.monotonic() - t0:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=ROOT / "benchmarks" / "corpus")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/forecaster-corpus-cache"))
    ap.add_argument("--budget-s", type=float, default=220.0)
    ap.add_argument("--max-seconds", type=float, default=6.0, help="GPU-time cap per measurement")
    ap.add_argument("--max-runs", type=int, default=300)
    ap.add_argument("--only", help="comma-separated suite names (default: every suite)")
    ap.add_argument("--jobs", type=int, default=16, help="parallel nvcc compiles")
    args = ap.parse_args()
    return anyio.run(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
