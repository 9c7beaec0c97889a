"""Check a kernel corpus index without a GPU: schema, nvcc compile for a target arch, parameter lists.

    python benchmarks/corpus_check.py benchmarks/corpus/*.json [--arch sm_90]

Every index uses the bundled examples' format (`forecaster_mcp/examples/examples.json`, kernel files beside the
index). Prints one line per kernel (registers, shared memory, spills, parameter check) and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp.examples import load_examples  # noqa: E402
from forecaster_mcp.measure.pycuda_measurer import (  # noqa: E402
    CompiledKernel,
    NvccCompiler,
    _parameter_mismatch,
)

MAX_CORPUS_WORKLOAD_BYTES = 2 * 2**30


async def check(indexes: list[Path], arch: str, cache: Path) -> int:
    compiler = NvccCompiler(cache)
    if not compiler.available:
        print("nvcc not found")
        return 2
    problems = 0
    seen_ids: set[str] = set()
    for index in indexes:
        try:
            suites = load_examples(index)
        except (OSError, ValueError, KeyError) as e:
            print(
                f"{index}: not a readable corpus index ({type(e).__name__}: {e}); pass benchmarks/corpus/*.json"
            )
            problems += 1
            continue
        for suite in suites:
            size = sum(getattr(a, "nbytes", 0) for a in suite.workload.args)
            if size > MAX_CORPUS_WORKLOAD_BYTES:
                print(f"{suite.name}: workload is {size / 2**30:.2f} GiB, keep it under 2 GiB")
                problems += 1
            for ex in suite.kernels:
                k = ex.kernel
                if str(k.id) in seen_ids:
                    print(f"{suite.name}/{k.id}: duplicate kernel id")
                    problems += 1
                seen_ids.add(str(k.id))
                built = await compiler.compile(k, arch)
                if not isinstance(built, CompiledKernel):
                    print(f"{suite.name}/{k.id}: COMPILE FAILED {built.message[:600]}")
                    problems += 1
                    continue
                mismatch = _parameter_mismatch("kernel", k, built, suite.workload)
                line = (
                    f"{suite.name:28s} {k.id:34s} regs {built.registers!s:>4} "
                    f"smem {built.static_shared_bytes!s:>6} spill {built.spill_bytes!s:>4}"
                )
                if mismatch:
                    line += f"  PARAM MISMATCH: {mismatch}"
                    problems += 1
                print(line)
    print(f"{len(seen_ids)} kernels, {problems} problem(s)")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("indexes", nargs="+", type=Path)
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return anyio.run(check, args.indexes, args.arch, Path(tmp))


if __name__ == "__main__":
    raise SystemExit(main())
