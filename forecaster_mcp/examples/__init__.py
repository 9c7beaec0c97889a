"""Bundled example kernels (`examples.json` plus one .cu file per kernel) for demos, forecasts and GPU checks.

Suites pair kernels whose order is known (vector add naive vs float4, matmul naive vs shared-memory tiles,
reduction tree vs warp shuffles) and one suite of bad kernels the measurement harness must catch (a hang, a
fault, an out-of-bounds write, a side-stream launch, a cached answer), each with the status it must get.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forecaster_mcp.models import Kernel, MeasureStatus, Workload

EXAMPLES_DIR = Path(__file__).resolve().parent
INDEX = EXAMPLES_DIR / "examples.json"


@dataclass(frozen=True)
class ExampleKernel:
    kernel: Kernel
    file: str
    expect_status: MeasureStatus
    note: str | None = None
    max_seconds: float | None = None


@dataclass(frozen=True)
class ExampleSuite:
    name: str
    description: str
    workload: Workload
    reference_id: str
    atol: float
    rtol: float
    kernels: list[ExampleKernel]

    @property
    def reference(self) -> Kernel:
        return self.kernel(self.reference_id)

    def kernel(self, kernel_id: str) -> Kernel:
        for k in self.kernels:
            if k.kernel.id == kernel_id:
                return k.kernel
        raise KeyError(f"suite {self.name} has no kernel {kernel_id!r}")


def _kernel(spec: dict[str, Any], base: Path) -> ExampleKernel:
    source = (base / spec["file"]).read_text(encoding="utf-8")
    kernel = Kernel.model_validate(
        {
            "id": spec["id"],
            "source": source,
            "entry": spec["entry"],
            "launch": spec["launch"],
            "defines": spec.get("defines", {}),
            "compile_options": spec.get("compile_options", []),
        }
    )
    return ExampleKernel(
        kernel=kernel,
        file=spec["file"],
        expect_status=spec.get("expect_status", "ok"),
        note=spec.get("note"),
        max_seconds=spec.get("max_seconds"),
    )


def load_examples(index: Path = INDEX) -> list[ExampleSuite]:
    """Every suite in an index (`examples.json` by default; kernel files beside it), kernels validated as Kernel
    and workloads as Workload."""
    doc = json.loads(index.read_text(encoding="utf-8"))
    suites: list[ExampleSuite] = []
    for s in doc["suites"]:
        suite = ExampleSuite(
            name=s["name"],
            description=s["description"],
            workload=Workload.model_validate(s["workload"]),
            reference_id=s["reference"],
            atol=float(s["atol"]),
            rtol=float(s["rtol"]),
            kernels=[_kernel(k, index.parent) for k in s["kernels"]],
        )
        suite.kernel(suite.reference_id)  # the reference must be one of the suite's kernels
        suites.append(suite)
    return suites


def suite(name: str) -> ExampleSuite:
    for s in load_examples():
        if s.name == name:
            return s
    raise KeyError(f"no example suite {name!r}")
