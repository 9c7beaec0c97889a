"""The public data types: tool inputs (Kernel, Workload) and tool outputs.

Field names here are the public contract of DESIGN.md: add fields freely, never rename.
Validation messages are read by agents, so they say what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SOURCE_BYTES = 1_000_000
MAX_CANDIDATES = 64
MIN_CANDIDATES = 2

Language = Literal["cuda", "opencl", "hip", "triton", "python"]
Dtype = Literal[
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]
DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}
InitKind = Literal["random_uniform", "random_normal", "zeros", "ones", "arange"]
Intent = Literal["in", "out", "inout"]
DefineValue = int | float | str
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _dim3(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= 3:
        raise ValueError(f"{what} must be a list of 1 to 3 positive integers, e.g. [256, 1, 1]")
    dims = [*value, *([1] * (3 - len(value)))]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must hold integers, got {value!r}")
    if any(d <= 0 for d in dims):
        raise ValueError(f"{what} dimensions must be positive (at least 1), got {value!r}")
    return (dims[0], dims[1], dims[2])


class Launch(_Strict):
    """How a CUDA kernel is launched."""

    grid: tuple[int, int, int] = Field(description="grid dimensions [x, y, z] in blocks")
    block: tuple[int, int, int] = Field(description="block dimensions [x, y, z] in threads")
    shared_mem_bytes: int = Field(default=0, ge=0, description="dynamic shared memory per block")

    @field_validator("grid", mode="before")
    @classmethod
    def _grid(cls, v: Any) -> tuple[int, int, int]:
        return _dim3(v, "launch.grid")

    @field_validator("block", mode="before")
    @classmethod
    def _block(cls, v: Any) -> tuple[int, int, int]:
        dims = _dim3(v, "launch.block")
        if dims[0] * dims[1] * dims[2] > 1024:
            raise ValueError(
                f"launch.block has {dims[0] * dims[1] * dims[2]} threads; CUDA allows at most 1024 per block"
            )
        return dims

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


class Kernel(_Strict):
    """One kernel candidate: source, entry point, launch and tuning parameters."""

    id: str | None = Field(default=None, max_length=128, description="unique in a call; default k0, k1, ...")
    source: str = Field(description="the kernel source (at most 1 MB)")
    entry: str = Field(description="the __global__ function name")
    language: Language = "cuda"
    launch: Launch | None = Field(
        default=None,
        description="grid and block; needed to measure on a GPU, and it sharpens forecasts between different "
        "kernels (waves, occupancy, threads launched for the same workload)",
    )
    defines: dict[str, DefineValue] = Field(default_factory=dict, description="-D macros / tuning parameters")
    compile_options: list[str] = Field(default_factory=list, description="extra nvcc flags")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("source is empty: pass the kernel's full source text")
        size = len(v.encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise ValueError(
                f"source is {size} bytes, over the {MAX_SOURCE_BYTES}-byte limit: "
                "send only the kernel and what it includes"
            )
        return v

    @field_validator("entry")
    @classmethod
    def _entry(cls, v: str) -> str:
        if not _IDENT.match(v) or len(v) > 256:
            raise ValueError(f"entry {v[:80]!r} is not a C identifier: pass the __global__ function's name")
        return v

    @field_validator("defines")
    @classmethod
    def _defines(cls, v: dict[str, DefineValue]) -> dict[str, DefineValue]:
        for name, value in v.items():
            if not _IDENT.match(name):
                raise ValueError(f"define name {name[:80]!r} is not a C identifier")
            if isinstance(value, str) and ("\n" in value or len(value) > 256):
                raise ValueError(f"define {name} has a value with a newline or over 256 characters")
        return v

    @field_validator("compile_options")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("-") or "\n" in opt or len(opt) > 256:
                raise ValueError(f"compile option {opt[:80]!r} must be a single nvcc flag starting with '-'")
            if opt.split("=")[0] in {"-o", "--output-file", "-odir", "--output-directory", "-ccbin"}:
                raise ValueError(
                    f"compile option {opt!r} is not allowed: the server chooses outputs and host compiler"
                )
        return v

    def source_hash(self) -> str:
        """Content hash of the source alone (a kernel family shares it across defines)."""
        return hashlib.sha256(self.source.encode("utf-8", "surrogatepass")).hexdigest()

    def content_key(self) -> str:
        """Hash of everything that changes the compiled binary and its launch (not the id)."""
        payload = {
            "source": self.source_hash(),
            "entry": self.entry,
            "language": self.language,
            "launch": self.launch.model_dump() if self.launch else None,
            "defines": {k: self.defines[k] for k in sorted(self.defines)},
            "compile_options": self.compile_options,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def family_key(self) -> str:
        """Kernels that differ only in defines and launch share a family (the online model's unit)."""
        payload = {"source": self.source_hash(), "entry": self.entry, "language": self.language}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


class BufferArg(_Strict):
    """A device buffer argument."""

    name: str = Field(max_length=128)
    dtype: Dtype
    shape: list[int] = Field(min_length=1, max_length=8)
    init: InitKind = "random_uniform"
    intent: Intent = "in"

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if any(d <= 0 for d in v):
            raise ValueError(f"buffer shape {v} has a non-positive dimension")
        return v

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]


class ScalarArg(_Strict):
    """A by-value scalar argument."""

    name: str = Field(max_length=128)
    dtype: Dtype
    value: int | float


WorkloadArg = Annotated[BufferArg | ScalarArg, Field(union_mode="smart")]
MAX_WORKLOAD_BYTES = 64 * 2**30


class Workload(_Strict):
    """What the kernel runs on: ordered kernel arguments plus free-form problem sizes."""

    args: list[WorkloadArg] = Field(default_factory=list, max_length=64)
    problem: dict[str, int | float | str] = Field(default_factory=dict)
    name: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _sizes(self) -> Workload:
        total = sum(a.nbytes for a in self.args if isinstance(a, BufferArg))
        if total > MAX_WORKLOAD_BYTES:
            raise ValueError(f"workload buffers need {total / 2**30:.1f} GiB, over the 64 GiB limit")
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError("workload argument names must be unique")
        return self

    def key(self) -> str:
        """Stable hash of the workload (part of every measurement's cache key)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:32]

    def bytes_moved_floor(self) -> int:
        """Bytes that must cross DRAM at least once: inputs read, outputs written."""
        total = 0
        for a in self.args:
            if isinstance(a, BufferArg):
                total += a.nbytes * (2 if a.intent == "inout" else 1)
        return total


# ---------------------------------------------------------------- measurement results

MeasureStatus = Literal[
    "ok",
    "compile_error",
    "launch_error",
    "timeout",
    "wrong_output",
    "out_of_bounds_write",
    "worker_crashed",
]
Backend = Literal["replay", "pycuda", "fake"]


class RuntimeStats(BaseModel):
    """Runtime statistics in milliseconds."""

    median: float
    mean: float
    min: float
    p10: float
    p90: float
    std: float
    ci95_low: float = Field(description="95% interval of the median, low end")
    ci95_high: float = Field(description="95% interval of the median, high end")
    runs: int
    relative_noise: float = Field(default=0.0, description="half-width of the 95% interval over the median")


class Correctness(BaseModel):
    checked: bool = False
    passed: bool | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    input_sets: int = 0
    detail: str | None = None


class ResourceUsage(BaseModel):
    registers: int | None = None
    shared_mem_bytes: int | None = None
    spill_bytes: int | None = None
    occupancy: float | None = Field(default=None, description="theoretical occupancy 0..1")


class DeviceProvenance(BaseModel):
    name: str
    backend: Backend
    compute_capability: str | None = None
    driver: str | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    throttle_reasons: list[str] = Field(default_factory=list)
    recording: str | None = Field(default=None, description="replay: the recording file the result came from")


class MeasureCost(BaseModel):
    gpu_seconds: float = Field(description="GPU-seconds charged to the ledger by this call")
    compile_seconds: float = 0.0
    cached: bool = False


class MeasureResult(BaseModel):
    """What `measure_kernel` returns. A failing kernel is a result with a status, not an error."""

    kernel_id: str
    status: MeasureStatus
    message: str | None = None
    runtime_ms: RuntimeStats | None = None
    correctness: Correctness = Field(default_factory=Correctness)
    resources: ResourceUsage = Field(default_factory=ResourceUsage)
    device: DeviceProvenance
    cost: MeasureCost
    flags: list[str] = Field(default_factory=list, description="e.g. below_physical_floor")
    measurement_id: int | None = None


# ---------------------------------------------------------------- forecasts

Verdict = Literal["faster", "slower", "unsure"]
DecidedBy = Literal["forecast", "measurement", "cache"]


class CandidateForecast(BaseModel):
    id: str
    p_faster: float = Field(description="probability that this candidate is faster than the baseline")
    speedup_bins: list[float] = Field(description="8 probabilities over log2 speedup bins (see bins)")
    expected_speedup: float = Field(
        description="t(baseline) / t(candidate), expected (geometric mean of the forecast distribution)"
    )
    verdict: Verdict
    decided_by: DecidedBy
    rationale: str
    confidence: float = Field(description="calibrated probability of the more likely direction")
    measured_speedup: float | None = None


class ForecasterInfo(BaseModel):
    name: str
    version: str
    components: list[str] = Field(default_factory=list)


class CompareResult(BaseModel):
    """What `compare_kernels` returns."""

    baseline: str
    hardware: str
    hardware_known: bool
    candidates: list[CandidateForecast]
    ranking: list[str] = Field(
        description="all ids, fastest first (by expected speedup): the best guess now. To choose what to "
        "measure next in a search, use measure_next (measuring ranking's head every time gets stuck)"
    )
    measure_next: list[str] = Field(
        description="ids worth measuring, most valuable first (the chance and size of beating the best "
        "kernel of their family measured so far, or the baseline when that is faster or nothing is measured): "
        "unsure and faster candidates, and slower ones whose wide forecast still leaves a real expected gain"
    )
    forecaster: ForecasterInfo
    target_error: float
    gpu_seconds_charged: float = 0.0
    measurements: list[MeasureResult] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    bins: list[str] = Field(default_factory=list, description="the 8 bin labels, in log2 speedup")
