"""Messages between the measurement supervisor (in the server) and a GPU worker process.

Framing over the worker's stdin/stdout: a 4-byte magic `FMW1`, a 4-byte big-endian payload length, then the
payload as UTF-8 JSON. The magic lets the supervisor tell a protocol frame from stray output (a crashing
driver printing to stdout) at the first byte, and the length cap keeps garbage from allocating gigabytes.
Anything that does not parse is a `ProtocolError`; the supervisor treats it as a crashed worker.

Imports only pydantic and the public models, so the server, the real worker and the stand-in worker in the
tests all speak exactly this module.
"""

from __future__ import annotations

import struct
from typing import Annotated, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from forecaster_mcp.errors import validation_message
from forecaster_mcp.models import Correctness, Launch, MeasureStatus, Workload

PROTOCOL_VERSION = 1
MAGIC = b"FMW1"
HEADER = struct.Struct(">4sI")
# A result carries at most MAX_SAMPLES floats; 64 MiB leaves ample room and still rejects garbage lengths.
MAX_FRAME_BYTES = 64 * 2**20
MAX_SAMPLES = 100_000


class ProtocolError(Exception):
    """The peer wrote something that is not a valid frame or message."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- worker -> supervisor


class DeviceInfo(_Msg):
    """What the worker learned about its device when it created the context."""

    index: int
    name: str
    compute_capability: str = Field(description='e.g. "9.0"')
    pci_bus_id: str | None = None
    driver: str | None = Field(
        default=None, description="driver version (NVML / nvidia-smi) or CUDA driver API"
    )
    sm_count: int
    l2_bytes: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int = 255
    shared_mem_per_sm_bytes: int
    max_shared_mem_per_block_bytes: int = Field(description="opt-in maximum per block")
    total_mem_bytes: int
    mem_bandwidth_gbs: float | None = Field(default=None, description="from memory clock and bus width")
    pid: int
    pgid: int

    @property
    def arch(self) -> str:
        """nvcc's -arch value for this device, e.g. sm_90."""
        major, _, minor = self.compute_capability.partition(".")
        return f"sm_{int(major)}{int(minor or 0)}"


class Ready(_Msg):
    type: Literal["ready"] = "ready"
    protocol: int = PROTOCOL_VERSION
    device: DeviceInfo


class Fatal(_Msg):
    """The worker cannot serve at all (no pycuda, no device); it exits after sending this."""

    type: Literal["fatal"] = "fatal"
    message: str


class Progress(_Msg):
    type: Literal["progress"] = "progress"
    job_id: int
    done: float
    total: float | None = None
    message: str | None = None


StopReason = Literal["noise_target", "max_runs", "time_cap"]


class JobResult(_Msg):
    """Raw outcome of one job; the supervisor turns it into a MeasureResult (stats, flags, cost)."""

    type: Literal["result"] = "result"
    job_id: int
    status: MeasureStatus
    message: str | None = None
    samples_ms: list[float] = Field(default_factory=list, max_length=MAX_SAMPLES)
    warmup_runs: int = 0
    stop_reason: StopReason | None = None
    wall_ms: list[float] = Field(
        default_factory=list, description="host wall-clock samples around a device sync"
    )
    correctness: Correctness = Field(default_factory=Correctness)
    registers: int | None = None
    static_shared_bytes: int | None = None
    local_bytes: int | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    throttle_reasons: list[str] = Field(default_factory=list)
    flags: list[str] = Field(default_factory=list)
    restart: bool = Field(
        default=False, description="the context may be damaged: the worker exits after this"
    )
    worker_seconds: float = 0.0


WorkerMessage = Annotated[Ready | Fatal | Progress | JobResult, Field(discriminator="type")]

# ---------------------------------------------------------------- supervisor -> worker


class KernelImage(_Msg):
    """A compiled kernel: the cubin on disk, the symbol to look up in it, and how to launch it."""

    cubin_path: str
    symbol: str = Field(description='the entry\'s symbol in the cubin (mangled unless extern "C")')
    entry: str
    launch: Launch


class MeasureJob(_Msg):
    type: Literal["measure"] = "measure"
    job_id: int
    kernel: KernelImage
    reference: KernelImage | None = None
    workload: Workload
    atol: float
    rtol: float
    max_seconds: float = Field(
        gt=0, description="GPU-time budget for the whole job; the supervisor kills after"
    )
    max_runs: int = Field(ge=1, le=MAX_SAMPLES)
    seed: int
    target_relative_noise: float = 0.01
    min_runs: int = 10


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"


SupervisorMessage = Annotated[MeasureJob | Shutdown, Field(discriminator="type")]

_WORKER_ADAPTER: TypeAdapter[Ready | Fatal | Progress | JobResult] = TypeAdapter(WorkerMessage)
_SUPERVISOR_ADAPTER: TypeAdapter[MeasureJob | Shutdown] = TypeAdapter(SupervisorMessage)


# ---------------------------------------------------------------- framing


def encode_frame(message: BaseModel) -> bytes:
    """Header plus JSON payload of one message."""
    payload = message.model_dump_json().encode("utf-8")
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte frame limit")
    return HEADER.pack(MAGIC, len(payload)) + payload


def parse_header(header: bytes) -> int:
    """Payload length from an 8-byte header; ProtocolError when it is not one of ours."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"truncated frame header ({len(header)} of {HEADER.size} bytes)")
    magic, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"not a protocol frame: output began with {header[:16]!r}")
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {length} is over the {MAX_FRAME_BYTES}-byte limit")
    return int(length)


def decode_worker_message(payload: bytes) -> Ready | Fatal | Progress | JobResult:
    try:
        return _WORKER_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid worker message: {_first_error(exc)}") from exc


def decode_supervisor_message(payload: bytes) -> MeasureJob | Shutdown:
    try:
        return _SUPERVISOR_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid supervisor message: {_first_error(exc)}") from exc


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "message"
    return f"{where}: {validation_message(first)}"


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = stream.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame_sync(stream: BinaryIO) -> bytes | None:
    """One payload from a blocking binary stream; None at a clean end of stream (between frames)."""
    header = _read_exactly(stream, HEADER.size)
    if not header:
        return None
    length = parse_header(header)
    payload = _read_exactly(stream, length)
    if len(payload) != length:
        raise ProtocolError(f"stream ended inside a frame ({len(payload)} of {length} bytes)")
    return payload


def write_frame_sync(stream: BinaryIO, message: BaseModel) -> None:
    stream.write(encode_frame(message))
    stream.flush()


# How a worker's message begins when the reference kernel, not the measured one, failed (gpu_worker._reference).
REFERENCE_FAILURE_PREFIX = "reference kernel:"
# Progress messages a worker sends as a job enters a phase: a job killed at its cap is then reported as what it
# was doing (the workload's inputs, the reference), not as the kernel's own timeout.
PHASE_INPUTS = "generating and uploading the workload's inputs"
PHASE_REFERENCE = "running the reference kernel"
PHASE_KERNEL = "running the kernel"
