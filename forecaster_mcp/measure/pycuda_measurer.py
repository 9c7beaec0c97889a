"""Measure CUDA kernels on the local NVIDIA GPUs: a supervisor in the server, one worker process per device.

The supervisor never touches CUDA. It compiles with nvcc (to a cubin for the device's architecture, cached by
content), then hands the cubin to the device's worker (`gpu_worker`, the only pycuda importer) over framed
stdin/stdout. Each worker runs in its own process group: a kernel that hangs past its time cap is killed with
the whole group, a crash or garbage on the pipe becomes a `worker_crashed` result, and the next request gets a
fresh worker. Requests to one device are serialised; devices run in parallel.

Gas: `cost.gpu_seconds` is the wall time the worker held the device for the request (inputs, warm-up, timed
runs, correctness), capped at `max_seconds`; a hung kernel is charged the cap. Compiling is `compile_seconds`
and worker start-up is free. A compile takes one of the process's compile slots (`compile_slots`), before the
device is locked: waiting for one holds no GPU and is not charged, and a wait past its bound is `ServerBusy`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.to_thread
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from forecaster_mcp.compile_slots import COMPILE_SLOTS, MEASURE_COMPILE_WAIT_S
from forecaster_mcp.disk_cache import evict_least_recent
from forecaster_mcp.errors import InvalidRequest, NotMeasurable, ServerBusy
from forecaster_mcp.forecast import ptxas
from forecaster_mcp.measure.base import OCCUPIED_ATTR, MeasureRequest, ProgressCallback
from forecaster_mcp.measure.gpu_worker import GUARD_BYTES, empty_if_over
from forecaster_mcp.measure.inputs import draw_scratch_bytes, param_sizes
from forecaster_mcp.measure.timing import (
    below_physical_floor,
    events_disagree,
    floor_bytes,
    median_ci_covers,
    physical_floor_ms,
    summarize,
)
from forecaster_mcp.measure.worker_protocol import (
    HEADER,
    PHASE_INPUTS,
    PHASE_KERNEL,
    PHASE_REFERENCE,
    PROTOCOL_VERSION,
    REFERENCE_FAILURE_PREFIX,
    DeviceInfo,
    Fatal,
    JobResult,
    KernelImage,
    MeasureJob,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    decode_worker_message,
    encode_frame,
    parse_header,
)
from forecaster_mcp.models import (
    COMPILE_INTERRUPTED,
    CONTROL_CHARACTER,
    INPUTS_UNFINISHED,
    BufferArg,
    Correctness,
    DeviceProvenance,
    Kernel,
    MeasureCost,
    MeasureResult,
    MeasureStatus,
    ResourceUsage,
    Workload,
    compile_option_allowed,
    source_problem,
)

log = logging.getLogger(__name__)

NAME = "pycuda"
TARGET_RELATIVE_NOISE = 0.01
MIN_RUNS = 10
_MESSAGE_LIMIT = 4000
_STDERR_TAIL = 2000
MAX_CUBIN_BYTES = 32 << 20
# A worker's stderr file (device printf lands there) is emptied between jobs once it holds this much: it lives
# as long as the worker, unlinked, and would otherwise grow by every launch's output unseen by `du`.
_STDERR_KEEP = 1 << 20

_last_reason = "GPU detection has not run yet"
# The worker imports the package from here even when it is not installed (a checkout on PYTHONPATH).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def detect_reason() -> str:
    """Why the last `PycudaMeasurer.detect` found no usable GPU ("" when it found one)."""
    return _last_reason


# ---------------------------------------------------------------- detection (no pycuda import here)


@dataclass(frozen=True)
class GpuListing:
    names: list[str]
    driver: str | None


def _visible_indices() -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as ordinals, None when unset; [] when it names devices by UUID or MIG id."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.lstrip("-").isdigit():
            return []
        if int(part) < 0:
            break  # CUDA stops at the first invalid ordinal
        out.append(int(part))
    return out


def _list_with_nvidia_smi() -> GpuListing | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[p.strip() for p in line.split(",")] for line in out.strip().splitlines() if line.strip()]
    by_index = {int(r[0]): r for r in rows if len(r) >= 3 and r[0].isdigit()}
    visible = _visible_indices()
    if visible == []:
        return None  # UUID / MIG selection: only the driver can map it
    order = visible if visible is not None else sorted(by_index)
    picked = [by_index[i] for i in order if i in by_index]
    if not picked:
        return GpuListing([], None)
    return GpuListing([r[1] for r in picked], picked[0][2])


def _list_with_libcuda() -> GpuListing | None:
    """Device names through the driver API itself (cuInit creates no context)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if lib.cuInit(0) != 0:
        return GpuListing([], None)
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return GpuListing([], None)
    names: list[str] = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(256)
        if lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and lib.cuDeviceGetName(buf, 256, dev) == 0:
            names.append(buf.value.decode(errors="replace"))
    version = ctypes.c_int(0)
    driver = None
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        driver = f"CUDA driver API {version.value // 1000}.{(version.value % 1000) // 10}"
    return GpuListing(names, driver)


def _libcuda_present() -> bool:
    if ctypes.util.find_library("cuda") is not None:
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def canonical_device_name(raw: str) -> str:
    """The spec table's name for a GPU ("NVIDIA H100 80GB HBM3" -> "H100-SXM5-80GB"), else the raw name."""
    try:
        from forecaster_mcp.hardware.specs import canonical_name

        return canonical_name(raw)
    except Exception:  # the table is optional here; the driver's name is still a name
        return raw.strip()


# ---------------------------------------------------------------- nvcc


@dataclass(frozen=True)
class CompiledKernel:
    """A cubin in the compile cache plus what ptxas and the PTX say about the entry."""

    cubin_path: str
    symbol: str
    param_sizes: list[int] | None
    registers: int | None
    static_shared_bytes: int | None
    spill_bytes: int | None
    stack_bytes: int | None


@dataclass(frozen=True)
class CompileFailure:
    message: str
    # Not the source's fault (nvcc ran out of time or was killed): never cached, a retry may compile.
    transient: bool = False


_RDC_FLAGS = {"-rdc=true", "--relocatable-device-code=true", "-rdc", "-dc", "--device-c"}
_ARCH_FLAGS = ("-arch", "--gpu-architecture", "-gencode", "--generate-code", "-code", "--gpu-code")
_PTXAS_DETAIL = re.compile(r"^\s+\d+ bytes stack frame")
# A host path (to its last component). Segments hold no "/" and a match starts only at the first "/" of a run,
# so the text is scanned once: with "/" inside the repeated segment, nvcc echoing a source line such as
# "/a////...//" made the pattern backtrack exponentially (40 slashes held the event loop for over a minute).
_PATH = re.compile(r"(?<![\w.~/-])/+(?:[^\s/:'\"()<>,]+/+)+([^\s/:'\"()<>,]+)")
# Diagnostics beyond this many characters are cut before any pattern runs (the message keeps far less).
_RAW_MESSAGE_LIMIT = 64 * 1024


def trim_compiler_message(text: str, workdir: str | Path | None = None, limit: int = _MESSAGE_LIMIT) -> str:
    """The compiler's diagnostics for an agent: no host paths, no ptxas info chatter, bounded length."""
    text = text[:_RAW_MESSAGE_LIMIT]
    if workdir is not None:
        for w in {str(workdir), os.path.realpath(workdir)}:
            text = text.replace(w + os.sep, "").replace(w, "")
    text = _PATH.sub(r"\1", text)
    lines = [ln.rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("ptxas info") and not _PTXAS_DETAIL.match(ln)]
    kept: list[str] = []
    size = 0
    for i, ln in enumerate(lines):
        if size + len(ln) + 1 > limit:
            kept.append(f"... ({len(lines) - i} more lines)")
            break
        kept.append(ln)
        size += len(ln) + 1
    return "\n".join(kept).strip()


def resolve_symbol(entry: str, symbols: Sequence[str]) -> str | CompileFailure:
    """The symbol of `entry` among the cubin's entry functions."""
    if entry in symbols:
        return entry
    matches = [s for s in symbols if ptxas.itanium_function_name(s) == entry]
    if len(matches) == 1:
        return matches[0]
    found = ", ".join(symbols) if symbols else "none"
    if len(matches) > 1:
        return CompileFailure(
            f"entry {entry!r} names {len(matches)} kernels (overloads or template instances: "
            f'{", ".join(matches)}); declare the one to run extern "C" or instantiate the template once'
        )
    return CompileFailure(
        f"no __global__ function named {entry!r} in the compiled source (entry functions found: {found}); "
        "check the name, and instantiate templates explicitly"
    )


def parse_ptxas(stderr: str) -> dict[str, dict[str, int]]:
    """Per entry symbol: registers, static shared memory, stack and spill bytes from `ptxas -v` output (the
    forecaster's parser: a `__noinline__` helper's figures are its own, never the kernel's)."""
    return {
        e.name: {
            "registers": e.registers,
            "shared": e.shared_bytes,
            "stack": e.stack_frame_bytes,
            "spill_stores": e.spill_stores_bytes,
            "spill_loads": e.spill_loads_bytes,
        }
        for e in ptxas.parse_ptxas(stderr)
    }


_PTX_SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}


def parse_ptx_params(ptx: str, symbol: str) -> list[int] | None:
    """Byte size of each parameter of `.entry symbol` in PTX text; None when the entry is not there."""
    m = re.search(r"\.entry\s+" + re.escape(symbol) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        m = re.search(r"\.entry\s+" + re.escape(symbol) + r"\s*\(\s*\)", ptx)
        return [] if m is not None else None
    sizes: list[int] = []
    for decl in m.group(1).split(","):
        decl = decl.strip()
        if not decl.startswith(".param"):
            continue
        array = re.search(r"\[(\d+)\]\s*$", decl)
        if array:
            sizes.append(int(array.group(1)))
            continue
        kind = re.search(r"\.[usbf](8|16|32|64)\b", decl)
        if kind is None:
            return None
        sizes.append(_PTX_SIZES[kind.group(1)])
    return sizes


class NvccCompiler:
    """nvcc to cubin with `-Xptxas -v`, cached by content under `cache_dir/kernels`; a compile waits up to
    `slot_wait_s` for a compile slot of the process (`compile_slots.COMPILE_SLOTS`)."""

    FLOW = "cubin-v3"  # bump when the compile flow changes what a cached entry means (v3: made directives refused)

    def __init__(
        self,
        cache_dir: Path,
        nvcc: str | Sequence[str] | None = None,
        timeout_s: float = 120.0,
        slot_wait_s: float = MEASURE_COMPILE_WAIT_S,
    ) -> None:
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self.slot_wait_s = slot_wait_s
        if nvcc is None:
            found = shutil.which("nvcc") or next(
                (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None
            )
            self.command: list[str] | None = [found] if found else None
        elif isinstance(nvcc, str):
            # A configured path that is not an executable is no compiler (FORECASTER_MCP_NVCC mistyped).
            configured = shutil.which(nvcc)
            self.command = [configured] if configured else None
        else:
            self.command = list(nvcc)
        self._version: str | None = None

    @property
    def available(self) -> bool:
        return self.command is not None

    def version(self) -> str:
        """The compiler's version line (part of every cache key); 'unavailable' without nvcc."""
        if self._version is None:
            self._version = "unavailable" if self.command is None else ptxas.nvcc_version(tuple(self.command))
        return self._version

    def key(self, kernel: Kernel, arch: str) -> str:
        payload = {
            "flow": self.FLOW,
            "nvcc": self.version(),
            "arch": arch,
            "source": kernel.source_hash(),
            "entry": kernel.entry,
            "defines": {k: kernel.defines[k] for k in sorted(kernel.defines)},
            "options": kernel.compile_options,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    async def compile(
        self, kernel: Kernel, arch: str, progress: ProgressCallback | None = None
    ) -> CompiledKernel | CompileFailure:
        """The cached compile of `kernel` for `arch`, or a fresh one. ServerBusy when no compile slot came free
        within `slot_wait_s` (nothing compiled, nothing cached)."""
        if self.command is None:
            raise NotMeasurable(
                "nvcc (the CUDA toolkit) is not installed on the measurement machine; install it or set "
                "FORECASTER_MCP_NVCC to its path"
            )
        _refuse_unsafe_flags(kernel)
        await self._refuse_untargetable(kernel, arch)
        key = self.key(kernel, arch)
        entry_dir = self.cache_dir / "kernels" / key
        meta_path = entry_dir / "meta.json"
        cached = _read_meta(meta_path)
        if cached is not None:
            with contextlib.suppress(OSError):
                os.utime(meta_path)  # last used: what eviction orders by
            return cached
        if not await COMPILE_SLOTS.acquire(0):
            slots = f"{COMPILE_SLOTS.limit} compile slot{'s' if COMPILE_SLOTS.limit != 1 else ''}"
            if progress is not None:
                await progress(0.0, None, f"waiting for a compile slot (this server has {slots}, all taken)")
            if not await COMPILE_SLOTS.acquire(self.slot_wait_s):
                raise ServerBusy(
                    f"the server is busy compiling other kernels (its {slots} stayed taken for "
                    f"{self.slot_wait_s:g} s): {kernel.entry} was not compiled or run, and nothing was charged; "
                    "retry in a minute, or use compare_kernels (free) meanwhile"
                )
        try:
            result, cacheable = await self._compile_fresh(kernel, arch, entry_dir)
        finally:
            COMPILE_SLOTS.release()
        if cacheable:
            _write_meta(meta_path, result)
            if isinstance(result, CompiledKernel):
                await anyio.to_thread.run_sync(evict_compiled, self.cache_dir / "kernels", entry_dir)
        return result

    async def _refuse_untargetable(self, kernel: Kernel, arch: str) -> None:
        """NotMeasurable when this nvcc cannot compile for the device's `arch` at all (nvcc 13 dropped sm_70 and
        older; an older toolkit lacks the newest GPUs): every kernel would fail with "Unsupported gpu
        architecture", and that is the server's toolkit, not the kernel, so it must not be kept (or learned) as
        the kernel's compile_error. A caller that names its own architecture in compile_options is not checked:
        its failure is its own. Where nvcc cannot list its targets, nothing is refused."""
        assert self.command is not None
        if len(self.command) != 1 or any(opt.split("=")[0] in _ARCH_FLAGS for opt in kernel.compile_options):
            return
        supported = await anyio.to_thread.run_sync(ptxas.supported_archs, self.command[0])
        if supported and arch not in supported:
            raise NotMeasurable(
                f"this server's nvcc ({self.version()}) cannot compile for {arch}, the measurement GPU's "
                f"architecture (it targets {', '.join(supported)}): no kernel can be measured on this GPU until its "
                "operator installs a CUDA toolkit that supports it (or sets FORECASTER_MCP_NVCC to one); nothing was "
                "charged"
            )

    def _command(self, kernel: Kernel, arch: str, relocatable: bool, out_name: str) -> list[str]:
        assert self.command is not None
        cmd = [*self.command, "-cubin"]
        if not any(opt.split("=")[0] in _ARCH_FLAGS for opt in kernel.compile_options):
            cmd.append(f"-arch={arch}")
        if relocatable and not any(opt in _RDC_FLAGS for opt in kernel.compile_options):
            cmd.append("-rdc=true")
        cmd += ["-Xptxas", "-v", "--keep", "--keep-dir", "keep"]
        cmd += [opt for opt in kernel.compile_options if opt not in ("-dc", "--device-c")]
        cmd += ["-o", out_name, "kernel.cu"]
        return cmd

    async def _compile_fresh(
        self, kernel: Kernel, arch: str, entry_dir: Path
    ) -> tuple[CompiledKernel | CompileFailure, bool]:
        """The outcome and whether to cache it (a timeout may pass on retry; a compiler error will not)."""
        (self.cache_dir / "tmp").mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="nvcc-", dir=self.cache_dir / "tmp"))
        try:
            (work / "keep").mkdir()
            (work / "kernel.cu").write_text(kernel.compile_source(), encoding="utf-8", errors="surrogatepass")
            relocatable = any(opt in _RDC_FLAGS for opt in kernel.compile_options)
            out_name = "device.cubin" if relocatable else "kernel.cubin"
            rc, output = await _run_bounded(
                self._command(kernel, arch, relocatable, out_name), work, self.timeout_s
            )
            if rc is None:
                return CompileFailure(
                    f"nvcc did not finish within {self.timeout_s:g} s", transient=True
                ), False
            if rc < 0:  # killed by a signal (the machine's OOM killer, an operator): not the source's doing
                return CompileFailure(f"nvcc was killed (signal {-rc})", transient=True), False
            made = await anyio.to_thread.run_sync(ptxas.made_directive, work / "keep", kernel.source)
            if made == ptxas.NO_PREPROCESSED_SOURCE and rc == 0:
                raise NotMeasurable(
                    f"nvcc kept no preprocessed source ({ptxas.PREPROCESSED_GLOB}) for the server to check before "
                    "it uses a compile: this nvcc's compile flow is not one the server knows; tell its operator"
                )
            if made is not None and made != ptxas.NO_PREPROCESSED_SOURCE:
                # Nothing from this compile (messages, cubin) may reach the caller: cicc obeyed that directive.
                log.info("refused %s: a macro writes the directive %r", kernel.entry, made)
                raise InvalidRequest(f"source refused: {ptxas.MADE_DIRECTIVE_ADVICE}")
            if ptxas.over_limits(rc, output):
                return CompileFailure(ptxas.OVER_LIMITS_MESSAGE), True
            if rc != 0:
                return CompileFailure(
                    trim_compiler_message(output, work) or f"nvcc failed (exit status {rc})"
                ), True
            if relocatable:
                # Device-side launches need the device runtime linked in: device-link to one cubin.
                assert self.command is not None
                link = [
                    *self.command,
                    "-dlink",
                    "-cubin",
                    f"-arch={arch}",
                    "-o",
                    "kernel.cubin",
                    out_name,
                    "-lcudadevrt",
                ]
                rc, link_output = await _run_bounded(link, work, self.timeout_s)
                if rc is None or rc < 0:
                    return CompileFailure("nvcc -dlink did not finish", transient=True), False
                if rc != 0:
                    return CompileFailure(
                        trim_compiler_message(link_output, work) or "device link failed"
                    ), True
            return _install(kernel.entry, output, work, entry_dir), True
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _refuse_unsafe_flags(kernel: Kernel) -> None:
    """Models.Kernel validation already turns these away; this guards kernels built without it, since every
    option reaches nvcc's command line and every define a line of the compiled source."""
    for opt in kernel.compile_options:
        if not compile_option_allowed(opt):
            raise InvalidRequest(f"compile option {opt[:80]!r} is not accepted: see Kernel.compile_options")
    for name, value in kernel.defines.items():
        if CONTROL_CHARACTER.search(f"{name}{value}"):
            raise InvalidRequest(f"define {name[:80]!r} has a control character: pass printable text")
    problem = source_problem(kernel.source)
    if problem is not None:
        raise InvalidRequest(f"source {problem}: see Kernel.source")


def _install(entry: str, ptxas_output: str, work: Path, entry_dir: Path) -> CompiledKernel | CompileFailure:
    """Move a fresh cubin into the cache and describe its entry (symbol, parameters, resources)."""
    infos = parse_ptxas(ptxas_output)
    symbol = resolve_symbol(entry, list(infos))
    if isinstance(symbol, CompileFailure):
        return symbol
    ptx_files = sorted((work / "keep").glob("*.ptx"))
    params = parse_ptx_params(ptx_files[0].read_text(errors="replace"), symbol) if ptx_files else None
    info = infos.get(symbol, {})
    size = (work / "kernel.cubin").stat().st_size
    if size > MAX_CUBIN_BYTES:
        # Compiles are free and kept: without a bound, `__device__ char big[1 << 26] = {1};` filled the
        # server's disk 64 MB at a time.
        return CompileFailure(
            f"the compiled kernel is {size / 2**20:.0f} MiB, over the {MAX_CUBIN_BYTES >> 20} MiB this server "
            "keeps: large initialised __device__ arrays belong in the workload's buffers"
        )
    entry_dir.mkdir(parents=True, exist_ok=True)
    cubin = entry_dir / "kernel.cubin"
    os.replace(work / "kernel.cubin", cubin)
    return CompiledKernel(
        cubin_path=str(cubin),
        symbol=symbol,
        param_sizes=params,
        registers=info.get("registers"),
        static_shared_bytes=info.get("shared", 0) if info else None,
        spill_bytes=(info["spill_stores"] + info["spill_loads"]) if "spill_stores" in info else None,
        stack_bytes=info.get("stack"),
    )


# The compile cache's bound: compiles are free, so without one a client cycling a define over a kernel with a
# large initialised __device__ array kept 30 MiB per request (each under MAX_CUBIN_BYTES) until the disk was
# full. Past it the least recently used entries go (a later request recompiles them), down to
# KERNEL_CACHE_LOW_WATER of it, never one used within KERNEL_CACHE_MIN_AGE_S (a job may be about to load it).
KERNEL_CACHE_BYTES = 4 << 30
KERNEL_CACHE_LOW_WATER = 0.8
KERNEL_CACHE_MIN_AGE_S = 600.0


def evict_compiled(kernels_dir: Path, keep: Path) -> int:
    """Remove the least recently used compile-cache entries while the cache is over KERNEL_CACHE_BYTES (not
    `keep`, nor any used in the last KERNEL_CACHE_MIN_AGE_S); how many went."""
    return evict_least_recent(
        kernels_dir,
        KERNEL_CACHE_BYTES,
        KERNEL_CACHE_LOW_WATER,
        what="compile cache",
        spare=lambda path: path == str(keep),
        min_age_s=KERNEL_CACHE_MIN_AGE_S,
    )


def _read_meta(path: Path) -> CompiledKernel | CompileFailure | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "error" in meta:
        return CompileFailure(str(meta["error"]))
    try:
        compiled = CompiledKernel(**meta)
    except TypeError:
        return None
    return compiled if Path(compiled.cubin_path).exists() else None


def _write_meta(path: Path, result: CompiledKernel | CompileFailure) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = asdict(result) if isinstance(result, CompiledKernel) else {"error": result.message}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)  # atomic: a reader never sees half an entry


async def _run_bounded(cmd: list[str], cwd: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run in its own process group; (exit status or None on timeout, stdout+stderr: its head and tail,
    ptxas.read_bounded). The environment leaves out secrets (ptxas.compiler_env)."""
    # nvcc's own temporaries go in the work directory too: a failed front end leaves files behind.
    env = ptxas.compiler_env(TMPDIR=str(cwd))
    process = await anyio.open_process(
        ptxas.limited(cmd),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output = b""
    try:
        with anyio.move_on_after(timeout_s) as scope:
            assert process.stdout is not None
            output = await ptxas.read_bounded(process.stdout)
            await process.wait()
        if scope.cancelled_caught:
            return None, ""
        return process.returncode, output.decode(errors="replace")
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                _killpg(process.pid)
                with anyio.move_on_after(5):
                    await process.wait()
            await process.aclose()


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------- worker processes


class WorkerGone(Exception):
    """The worker's output ended (it exited or was killed)."""


# How long progress reports may hold up one job's supervision in all (a client that reads its stream slowly).
PROGRESS_WAIT_S = 5.0


class _Worker:
    """One running worker process, its framed pipes, and its stderr (kept in an unlinked temp file)."""

    def __init__(self, process: Process, stderr: IO[bytes]) -> None:
        self.process = process
        self.stderr = stderr
        assert process.stdout is not None and process.stdin is not None
        self.reader = BufferedByteReceiveStream(process.stdout)
        self.writer = process.stdin
        self.info: DeviceInfo | None = None

    @property
    def pgid(self) -> int:
        return self.process.pid  # start_new_session: the worker leads its own group

    async def send(self, message: MeasureJob | Shutdown) -> None:
        try:
            await self.writer.send(encode_frame(message))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise WorkerGone("the worker's input pipe is closed") from exc

    async def receive(self) -> Ready | Fatal | Progress | JobResult:
        try:
            header = await self.reader.receive_exactly(HEADER.size)
            payload = await self.reader.receive_exactly(parse_header(header))
        except (
            anyio.IncompleteRead,
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ) as exc:
            raise WorkerGone("the worker's output ended") from exc
        return decode_worker_message(payload)

    def trim_log(self) -> None:
        """Empty the stderr file when it holds more than _STDERR_KEEP bytes (between jobs: the worker is idle).
        The worker writes through a duplicate of this descriptor, so rewinding it rewinds the worker too."""
        try:
            fd = self.stderr.fileno()
        except ValueError:  # closed
            return
        empty_if_over(fd, _STDERR_KEEP)

    def stderr_tail(self, limit: int = _STDERR_TAIL) -> str:
        try:
            fd = self.stderr.fileno()
            size = os.fstat(fd).st_size
            start = max(0, size - limit)
            return os.pread(fd, size - start, start).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def exit_description(self) -> str:
        code = self.process.returncode
        if code is None:
            return "the worker stopped answering"
        if code < 0:
            try:
                return f"the worker was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"the worker was killed by signal {-code}"
        return f"the worker exited with status {code}"

    async def describe_failure(self, exc: Exception) -> str:
        """How the worker failed (`WorkerGone` or `ProtocolError`), for the caller's message."""
        if isinstance(exc, WorkerGone):
            # It is exiting on its own: let it, so its exit status says how it died.
            with anyio.move_on_after(1.0):
                await self.process.wait()
            return self.exit_description()
        return f"the worker broke the protocol ({exc})"

    async def kill(self) -> None:
        """Kill the whole process group (the worker and anything it started) and reap the worker."""
        with anyio.CancelScope(shield=True):
            _killpg(self.pgid)
            with anyio.move_on_after(5):
                await self.process.wait()
            with contextlib.suppress(Exception):
                await self.process.aclose()

    def close_log(self) -> None:
        self.stderr.close()

    async def shutdown(self, grace_s: float = 2.0) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                with contextlib.suppress(WorkerGone):
                    await self.send(Shutdown())
                with anyio.move_on_after(grace_s):
                    await self.process.wait()
            await self.kill()
            self.close_log()


def _alive(pid: int) -> bool:
    """Whether the process runs (not gone, not a zombie); True where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The state follows the command name in parentheses, which may itself hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 1 :].split()
    return not fields or fields[0] not in ("Z", "X")


@contextlib.asynccontextmanager
async def _device_lock(path: Path, poll_s: float = 0.05) -> Any:
    """An exclusive flock on `path` (created if need be), polled so that waiting stays cancellable; a folder
    that cannot hold the lock file (read-only) leaves the job unlocked rather than unmeasured."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.warning("device lock %s unavailable (%s): measuring without it", path, exc)
        yield
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await anyio.sleep(poll_s)
            except OSError as exc:  # ENOLCK, EOPNOTSUPP: a file system without locks (NFS without lockd)
                log.warning("device lock %s unavailable (%s): measuring without it", path, exc)
                break
        yield
    finally:
        os.close(fd)  # releases the lock


# Servers that share a GPU must share this (the default does): the machine-wide lock's name starts with it.
GPU_LOCK_SCOPE_ENV = "FORECASTER_MCP_GPU_LOCK_SCOPE"


@contextlib.asynccontextmanager
async def _machine_lock(name: str, poll_s: float = 0.05) -> Any:
    """A lock every process on this machine shares, whatever its user or state folder: a Unix socket bound to
    `name` in Linux's abstract namespace (no file, no permissions; the kernel releases it when its holder
    exits, even killed). Polled, so waiting stays cancellable. Containers with their own network namespace do
    not share it (the state folder's lock still serves them where they share that); elsewhere than Linux, or
    where the socket cannot be made, the job runs without it."""
    if not sys.platform.startswith("linux"):
        yield
        return
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:  # AF_UNIX refused (a sandbox), no descriptor left: the job is not refused for it
        log.warning("machine-wide device lock %r unavailable (%s): measuring without it", name, exc)
        yield
        return
    try:
        while True:
            try:
                sock.bind("\0" + name)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    log.warning(
                        "machine-wide device lock %r unavailable (%s): measuring without it", name, exc
                    )
                    break
                await anyio.sleep(poll_s)
        yield
    finally:
        sock.close()  # releases the name


@dataclass
class _Slot:
    """One device: its lock (requests are serialised), its worker, and what the worker reported."""

    index: int
    name: str
    lock: anyio.Lock
    worker: _Worker | None = None
    info: DeviceInfo | None = None


@dataclass(frozen=True)
class _JobOutcome:
    result: JobResult | None
    status: MeasureStatus
    message: str | None
    gpu_seconds: float
    flags: tuple[str, ...] = ()


_PHASES = frozenset({PHASE_INPUTS, PHASE_REFERENCE, PHASE_KERNEL})


def _timed_out(phase: str, cap: float) -> _JobOutcome:
    """A job killed at its cap, reported as what it was doing then: making the workload's inputs (not the
    kernel's failure: INPUTS_UNFINISHED), running the reference (REFERENCE_FAILURE_PREFIX: the caller's check,
    not this kernel), or running the kernel."""
    killed = "the worker and its process group were killed and the cap was charged"
    if phase == PHASE_INPUTS:
        return _JobOutcome(
            None,
            "timeout",
            f"max_seconds={cap:g} ran out while the workload's inputs were being generated and uploaded, before "
            f"the kernel ran on them: raise max_seconds, or use smaller buffers; {killed}",
            cap,
            (INPUTS_UNFINISHED,),
        )
    if phase == PHASE_REFERENCE:
        return _JobOutcome(
            None,
            "timeout",
            f"{REFERENCE_FAILURE_PREFIX} the reference kernel did not finish within max_seconds={cap:g} (a hang, "
            f"or too slow for the cap); the kernel measured had run; {killed}",
            cap,
        )
    return _JobOutcome(
        None,
        "timeout",
        f"the kernel did not finish within max_seconds={cap:g} (a hang, or runs too slow for the cap); {killed}",
        cap,
    )


# ---------------------------------------------------------------- the measurer


class PycudaMeasurer:
    """The `pycuda` backend of the Measurer seam: real runs on local NVIDIA GPUs through worker processes."""

    name = NAME
    min_runs = MIN_RUNS  # the worker times at least this many runs unless max_runs or max_seconds stop it

    def __init__(
        self,
        cache_dir: Path,
        worker_cmd: list[str] | None = None,
        device_names: list[str] | None = None,
        *,
        nvcc: str | Sequence[str] | None = None,
        driver: str | None = None,
        startup_grace_s: float = 60.0,
        compile_timeout_s: float = 120.0,
        compile_slot_wait_s: float = MEASURE_COMPILE_WAIT_S,
        kill_slack_s: float = 1.0,
        target_relative_noise: float = TARGET_RELATIVE_NOISE,
    ) -> None:
        """`worker_cmd` defaults to this interpreter running `gpu_worker`; `--device N` is appended.
        `device_names` (CUDA ordinal order) default to what nvidia-smi or the driver lists."""
        self.cache_dir = Path(cache_dir)
        self.worker_cmd = (
            list(worker_cmd) if worker_cmd else [sys.executable, "-m", "forecaster_mcp.measure.gpu_worker"]
        )
        if device_names is None:
            listing = _list_with_nvidia_smi() or _list_with_libcuda() or GpuListing([], None)
            device_names = listing.names
            driver = driver or listing.driver
        self._slots = [
            _Slot(index=i, name=canonical_device_name(raw), lock=anyio.Lock())
            for i, raw in enumerate(device_names)
        ]
        self._driver = driver
        self.compiler = NvccCompiler(self.cache_dir, nvcc, compile_timeout_s, compile_slot_wait_s)
        self.startup_grace_s = startup_grace_s
        self.kill_slack_s = kill_slack_s
        self.target_relative_noise = target_relative_noise
        self._job_ids = itertools.count(1)
        self._round_robin = itertools.count()
        self._closed = False
        self._lock_scope = os.environ.get(GPU_LOCK_SCOPE_ENV) or "forecaster-mcp"

    # ---------------------------------------------------------------- detection

    @classmethod
    def detect(cls, cache_dir: Path, **kwargs: Any) -> PycudaMeasurer | None:
        """A measurer for this machine's GPUs, or None (reason in `detect_reason()`). Never imports pycuda."""
        global _last_reason
        if importlib.util.find_spec("pycuda") is None:
            # The interpreter's path goes to the server's log only: the reason is shown to remote clients too.
            log.info("pycuda is not importable by %s", sys.executable)
            _last_reason = (
                "pycuda is not installed in the server's Python environment (pip install 'forecaster-mcp[gpu]' "
                "there)"
            )
            return None
        if not _libcuda_present():
            _last_reason = "no NVIDIA driver here (libcuda not found), so no local GPU to measure on"
            return None
        listing = _list_with_nvidia_smi() or _list_with_libcuda()
        if listing is None or not listing.names:
            _last_reason = (
                "the NVIDIA driver reports no usable GPU (check CUDA_VISIBLE_DEVICES and nvidia-smi)"
            )
            return None
        measurer = cls(Path(cache_dir), device_names=listing.names, driver=listing.driver, **kwargs)
        if not measurer.compiler.available:
            _last_reason = (
                "nvcc (the CUDA toolkit) is not installed on this GPU machine, and every measurement compiles "
                "with it; install it or set FORECASTER_MCP_NVCC to its path"
            )
            return None
        _last_reason = ""
        return measurer

    detect_reason = staticmethod(detect_reason)

    # ---------------------------------------------------------------- Measurer seam

    def devices(self) -> list[str]:
        return list(dict.fromkeys(slot.name for slot in self._slots))

    def device_fingerprint(self, device: str) -> str:
        return f"{NAME}|{device}|driver={self._driver or 'unknown'}|nvcc={self.compiler.version()}"

    def reservation_seconds(self, request: MeasureRequest) -> float:
        # The most a request is charged: a hung kernel costs its whole cap, nothing costs more.
        return float(request.max_seconds)

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        result, _ = await self.measure_with_samples(request, progress)
        return result

    async def measure_with_samples(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> tuple[MeasureResult, list[float]]:
        """`measure`, plus the raw timed samples in ms (for recordings such as Kernel Tuner cache files)."""
        if self._closed:
            raise NotMeasurable("the GPU measurer is shut down")
        await _check_runnable(request.kernel, "kernel", request.workload)
        if request.reference is not None:
            await _check_runnable(request.reference, "reference", request.workload)
        slot = self._slot_for(request.device)
        info = await self._device_info(slot)
        for what, k in (("kernel", request.kernel), ("reference", request.reference)):
            if k is not None and k.launch is not None:
                _check_shared_fits(what, k.launch.shared_mem_bytes, info)
        _check_workload_fits(request.workload, info)

        # Compiled before the device is locked: a compile, or a wait for a compile slot, holds no GPU and is free.
        t_compile = time.perf_counter()
        compiled = await self.compiler.compile(request.kernel, info.arch, progress)
        ref_compiled = (
            await self.compiler.compile(request.reference, info.arch, progress)
            if request.reference is not None
            else None
        )
        compile_seconds = time.perf_counter() - t_compile
        for what, built in (("", compiled), (f"{REFERENCE_FAILURE_PREFIX} ", ref_compiled)):
            if isinstance(built, CompileFailure):
                # A compile that ran out of time is no verdict on the kernel: "timeout" is never cached.
                status: MeasureStatus = "timeout" if built.transient else "compile_error"
                message = what + built.message + (" (not a compile error; retry)" if built.transient else "")
                failed = self._result(request, slot, status, message, 0.0, compile_seconds)
                if built.transient:
                    failed.flags.append(COMPILE_INTERRUPTED)
                return failed, []
        assert isinstance(compiled, CompiledKernel)
        assert ref_compiled is None or isinstance(ref_compiled, CompiledKernel)
        for what, ck, k in (
            ("kernel", compiled, request.kernel),
            ("reference", ref_compiled, request.reference),
        ):
            if ck is not None and k is not None:
                mismatch = _parameter_mismatch(what, k, ck, request.workload) or _shared_total_mismatch(
                    what, k, ck, info
                )
                if mismatch is not None:
                    if what == "reference":  # the caller's check cannot run: not this kernel's failure
                        mismatch = f"{REFERENCE_FAILURE_PREFIX} {mismatch}"
                    refused = self._result(
                        request, slot, "launch_error", mismatch, 0.0, compile_seconds, compiled=compiled
                    )
                    return refused, []

        job = MeasureJob(
            job_id=next(self._job_ids),
            kernel=_image(request.kernel, compiled),
            reference=_image(request.reference, ref_compiled) if request.reference and ref_compiled else None,
            workload=request.workload,
            atol=request.atol,
            rtol=request.rtol,
            max_seconds=request.max_seconds,
            max_runs=max(1, min(request.max_runs, 100_000)),
            seed=request.seed,
            target_relative_noise=self.target_relative_noise,
            min_runs=MIN_RUNS,
        )
        async with slot.lock:
            await self._ensure_worker(slot)  # it says which device it holds (its PCI bus id)
            # Other server processes on this machine (one per IDE session) measure on the same GPU: one job at a
            # time across them, or each one's events would time the other's kernels too. Waiting is uncharged.
            # Servers with another state folder (another user, another FORECASTER_MCP_HOME) share the GPU too,
            # not the folder's lock: the machine-wide one covers them.
            async with _device_lock(self._lock_path(slot)), _machine_lock(self._machine_lock_name(slot)):
                outcome = await self._run_job(slot, job, progress)
        result = self._result(
            request,
            slot,
            outcome.status,
            outcome.message,
            outcome.gpu_seconds,
            compile_seconds,
            compiled=compiled,
            job=outcome.result,
            flags=outcome.flags,
        )
        return result, list(outcome.result.samples_ms) if outcome.result else []

    def _lock_path(self, slot: _Slot) -> Path:
        """The lock file of the slot's device, shared by every server using this state folder."""
        bus = slot.info.pci_bus_id if slot.info is not None else None
        # The host too: machines sharing a state folder (over NFS) may have GPUs at the same bus id.
        name = re.sub(
            r"[^A-Za-z0-9_.-]", "_", f"{socket.gethostname()}-{bus or f'device{slot.index}-{slot.name}'}"
        )
        return self.cache_dir / "locks" / f"gpu-{name}.lock"

    def _machine_lock_name(self, slot: _Slot) -> str:
        """The machine-wide lock of the slot's device (`_machine_lock`): its PCI bus id, under the scope."""
        bus = slot.info.pci_bus_id if slot.info is not None else None
        # A worker that reports no bus id: named as the state folder's lock names it (not "...-gpu-None").
        name = f"{self._lock_scope}-gpu-{bus or f'device{slot.index}-{slot.name}'}"
        if len(name.encode()) > 100:  # an abstract socket name holds at most 107 bytes (a scope may be UTF-8)
            name = f"forecaster-mcp-gpu-{hashlib.sha256(name.encode()).hexdigest()[:40]}"
        return name

    def device_info(self, device: str) -> DeviceInfo | None:
        """What the worker reported about `device` (L2, SMs, bandwidth...); None before it first started."""
        for slot in self._slots:
            if slot.name == device and slot.info is not None:
                return slot.info
        return None

    # ---------------------------------------------------------------- lifecycle

    async def aclose(self) -> None:
        """Stop every worker (a running job is killed)."""
        self._closed = True
        for slot in self._slots:
            worker, slot.worker = slot.worker, None
            if worker is not None:
                await worker.shutdown()

    async def __aenter__(self) -> PycudaMeasurer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def worker_pid(self, device: str) -> int | None:
        """The pid of a live worker for `device` (diagnostics and tests)."""
        for slot in self._slots:
            if slot.name == device and slot.worker is not None and slot.worker.process.returncode is None:
                return slot.worker.process.pid
        return None

    # ---------------------------------------------------------------- internals

    def _slot_for(self, device: str) -> _Slot:
        slots = [s for s in self._slots if s.name == device]
        if not slots:
            have = ", ".join(self.devices()) or "none"
            raise NotMeasurable(f"no local GPU named {device!r}; this machine has: {have}")
        free = [s for s in slots if not s.lock.locked()]
        if free:
            return free[0]
        return slots[next(self._round_robin) % len(slots)]

    async def _device_info(self, slot: _Slot) -> DeviceInfo:
        if slot.info is not None:
            return slot.info
        async with slot.lock:
            await self._ensure_worker(slot)
        assert slot.info is not None
        return slot.info

    async def _ensure_worker(self, slot: _Slot) -> _Worker:
        """The slot's live worker, starting one if needed (start-up is never charged). A worker that died while
        idle (its return code not collected yet) is replaced here, not blamed on the next kernel."""
        if (
            slot.worker is not None
            and slot.worker.process.returncode is None
            and _alive(slot.worker.process.pid)
        ):
            return slot.worker
        if slot.worker is not None:
            await self._retire(slot)
        if self._closed:  # a request that queued for the slot while aclose() ran starts no new worker
            raise NotMeasurable("the GPU measurer is shut down")
        env = dict(os.environ)
        # Ordinals in PCI order match nvidia-smi's indices, which named the devices.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        stderr = tempfile.TemporaryFile(prefix="gpu-worker-")
        try:
            process = await anyio.open_process(
                [*self.worker_cmd, "--device", str(slot.index)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            stderr.close()
            raise NotMeasurable(f"cannot start the GPU worker ({self.worker_cmd[0]}): {exc}") from exc
        worker = _Worker(process, stderr)
        failure: str | None = None
        try:
            with anyio.fail_after(self.startup_grace_s):
                message = await worker.receive()
        except anyio.get_cancelled_exc_class():
            # The request went away while the worker started (a client hung up): the worker is not the slot's
            # yet, so nothing else would ever stop it and its CUDA context.
            await worker.kill()
            worker.close_log()
            raise
        except TimeoutError:
            failure = f"it did not become ready within {self.startup_grace_s:g} s"
        except (WorkerGone, ProtocolError) as exc:
            what = await worker.describe_failure(exc)
            await worker.kill()
            tail = trim_compiler_message(worker.stderr_tail(), limit=1500) or "no stderr"
            failure = f"{what} during start-up; its stderr ends: {tail}"
            message = None
        else:
            if isinstance(message, Fatal):
                failure = message.message
            elif not isinstance(message, Ready) or message.protocol != PROTOCOL_VERSION:
                failure = f"it spoke an unexpected first message ({type(message).__name__})"
            elif canonical_device_name(message.device.name) != slot.name:
                # Every result, cache key and family model would name the listed GPU for another one's times.
                failure = (
                    f"CUDA device {slot.index} is a {message.device.name!r}, not the {slot.name} the driver listed "
                    "there (the listing and CUDA order devices differently, or a MIG instance stands for its "
                    "GPU), so its measurements would be filed under another GPU. Set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                    "and select devices with CUDA_VISIBLE_DEVICES (a MIG instance by its UUID), then restart the "
                    "server"
                )
        if failure is not None:
            await worker.kill()
            worker.close_log()
            raise NotMeasurable(
                f"the GPU worker for device {slot.index} ({slot.name}) cannot start: {failure}"
            )
        assert isinstance(message, Ready)
        worker.info = message.device
        slot.info = message.device
        slot.worker = worker
        return worker

    async def _retire(self, slot: _Slot) -> None:
        worker, slot.worker = slot.worker, None
        if worker is not None:
            await worker.kill()
            worker.close_log()

    async def _run_job(self, slot: _Slot, job: MeasureJob, progress: ProgressCallback | None) -> _JobOutcome:
        """Run one job on the slot's worker under the time cap; the caller holds the slot's lock."""
        worker = await self._ensure_worker(slot)
        cap = job.max_seconds
        started = time.perf_counter()
        # Seconds spent forwarding progress to a slow client: the worker goes on meanwhile, so they move the kill
        # deadline but stay in a crash's or a cancellation's charge (the device was held all along).
        stalled = 0.0
        done = False
        sent = False
        phase = PHASE_KERNEL  # what the job was doing, as the worker last said (worker_protocol.PHASE_*)
        result: JobResult | None = None
        try:
            try:
                await worker.send(job)
                sent = True
                with anyio.move_on_after(cap + self.kill_slack_s) as scope:
                    while True:
                        message = await worker.receive()
                        if isinstance(message, Progress):
                            if message.job_id != job.job_id:
                                raise ProtocolError(
                                    f"progress for job {message.job_id} during job {job.job_id}"
                                )
                            if message.message in _PHASES:
                                phase = message.message
                            if progress is not None and stalled < PROGRESS_WAIT_S:
                                # A slow client (an SSE stream with no buffer) stalls this await while the
                                # worker goes on. The wait is shielded from the kill deadline and moves it (the
                                # stall is not the job's), PROGRESS_WAIT_S in all per job: later reports are
                                # dropped, so a hung kernel is still killed at most that long after its cap.
                                # The charge is the worker's own time (below), not the supervisor's.
                                t_progress = time.perf_counter()
                                with anyio.move_on_after(PROGRESS_WAIT_S - stalled, shield=True):
                                    await progress(message.done, message.total, message.message)
                                spent = time.perf_counter() - t_progress
                                stalled += spent
                                scope.deadline += spent
                            continue
                        if isinstance(message, JobResult) and message.job_id == job.job_id:
                            result = message
                            break
                        raise ProtocolError(f"unexpected {type(message).__name__} message during a job")
            except (WorkerGone, ProtocolError) as exc:
                elapsed = time.perf_counter() - started
                what = await worker.describe_failure(exc)
                slot.worker = None
                await worker.kill()
                tail = worker.stderr_tail()
                worker.close_log()
                if tail:
                    what += "; its stderr ends: " + trim_compiler_message(tail, limit=1500)
                done = True
                return _JobOutcome(
                    None,
                    "worker_crashed",
                    f"{what}. The device went to a fresh worker; check the kernel for faults, or retry.",
                    min(elapsed, cap),
                )
            elapsed = time.perf_counter() - started
            if scope.cancelled_caught:
                await self._retire(slot)
                done = True
                return _timed_out(phase, cap)
            assert result is not None
            if result.restart:
                await self._retire(slot)
            else:
                worker.trim_log()
            done = True
            # The worker's time on the job is the device's occupancy; the supervisor's elapsed time also holds
            # what it spent forwarding progress (0 from a worker that does not say: elapsed, as before).
            occupied = result.worker_seconds if 0.0 < result.worker_seconds <= elapsed else elapsed
            return _JobOutcome(result, result.status, result.message, min(occupied, cap))
        except BaseException as exc:
            if not done and sent:
                # Cancelled from outside (or the progress callback raised) with the job on the device: that
                # occupancy is charged like a run's (the service commits it), and the exception goes on.
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, OCCUPIED_ATTR, min(time.perf_counter() - started, cap))
            raise
        finally:
            if not done:
                # Cancelled from outside (client went away): the worker is mid-job and cannot be reused.
                await self._retire(slot)

    def _result(
        self,
        request: MeasureRequest,
        slot: _Slot,
        status: MeasureStatus,
        message: str | None,
        gpu_seconds: float,
        compile_seconds: float,
        *,
        compiled: CompiledKernel | None = None,
        job: JobResult | None = None,
        flags: Sequence[str] = (),
    ) -> MeasureResult:
        info = slot.info
        flags = [*(job.flags if job is not None else []), *flags]
        stats = summarize(job.samples_ms) if job is not None and job.samples_ms else None
        notes: list[str] = [message] if message else []
        if stats is not None and job is not None:
            if job.stop_reason != "noise_target" and stats.relative_noise > self.target_relative_noise:
                flags.append("noise_target_not_reached")
            # Which limit ended the sampling (the result schema's flags; replay sets them as well): a request
            # with a larger one could get more runs.
            if job.stop_reason == "max_runs":
                flags.append("runs_capped_by_max_runs")
            elif job.stop_reason == "time_cap":
                flags.append("runs_capped_by_max_seconds")
            if not median_ci_covers(stats.runs):
                flags.append("too_few_runs_for_interval")
            peak = _peak_bandwidth_gbs(slot.name, info)
            if peak is not None:
                moved = floor_bytes(request.workload, info.l2_bytes if info else 0)
                if below_physical_floor(stats.median, moved, peak):
                    flags.append("below_physical_floor")
                    notes.append(
                        f"below_physical_floor: median {stats.median:.4g} ms is under the "
                        f"{physical_floor_ms(moved, peak):.4g} ms it takes to move {moved} bytes at "
                        f"{peak:g} GB/s; check that the kernel does all its work and reads all of its inputs"
                    )
            if events_disagree(stats.median, job.wall_ms):
                flags.append("events_disagree_with_wall_clock")
                notes.append(
                    f"events_disagree_with_wall_clock: host wall clock ({min(job.wall_ms):.4g} ms) is far "
                    f"above the event median ({stats.median:.4g} ms): work outside the timed stream may be "
                    "unaccounted"
                )
        resources = ResourceUsage()
        if compiled is not None or job is not None:
            registers = (job.registers if job else None) or (compiled.registers if compiled else None)
            static_shared = job.static_shared_bytes if job else None
            if static_shared is None and compiled is not None:
                static_shared = compiled.static_shared_bytes
            launch = request.kernel.launch
            dynamic = launch.shared_mem_bytes if launch else 0
            shared = (static_shared or 0) + dynamic
            local = job.local_bytes if job else None
            if local is None and compiled is not None:
                local = compiled.stack_bytes
            resources = ResourceUsage(
                registers=registers,
                shared_mem_bytes=shared,
                spill_bytes=compiled.spill_bytes if compiled else None,
                occupancy=_occupancy(info, launch.threads_per_block if launch else 0, registers or 0, shared),
                local_bytes=local,
            )
        device = DeviceProvenance(
            name=slot.name,
            backend="pycuda",
            compute_capability=info.compute_capability if info else None,
            driver=self._driver or (info.driver if info else None),
            sm_clock_mhz=job.sm_clock_mhz if job else None,
            mem_clock_mhz=job.mem_clock_mhz if job else None,
            throttle_reasons=list(job.throttle_reasons) if job else [],
        )
        return MeasureResult(
            kernel_id=request.kernel.id or "k0",
            status=status,
            message=_bounded("; ".join(notes)) if notes else None,
            runtime_ms=stats,
            correctness=job.correctness if job is not None else Correctness(),
            resources=resources,
            device=device,
            cost=MeasureCost(
                gpu_seconds=max(0.0, gpu_seconds), compile_seconds=compile_seconds, cached=False
            ),
            flags=flags,
        )


# ---------------------------------------------------------------- helpers


def _bounded(text: str, limit: int = _MESSAGE_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _check_runnable(kernel: Kernel, what: str, workload: Workload) -> None:
    if kernel.language != "cuda":
        # Read in a worker thread: a Python source is parsed for the CUDA in its strings.
        held = await anyio.to_thread.run_sync(_embedded_advice, kernel, workload)
        raise NotMeasurable(
            f"the {what} is {kernel.language}; the local GPU backend runs CUDA C++ kernels only "
            f"(other languages can be forecast, or measured through a replay recording){held}"
        )
    if kernel.launch is None:
        # Read in a worker thread: up to 0.4 s for a crafted 1 MB source, which the event loop must not wait on.
        advice = await anyio.to_thread.run_sync(_launch_advice, kernel, workload)
        raise InvalidRequest(f"{what}.launch is required to run it: {advice}")
    if not workload.args:
        raise InvalidRequest(
            "workload.args is required to run a kernel: list its parameters in order, buffers as "
            '{"name", "dtype", "shape", "init", "intent"} and scalars as {"name", "dtype", "value"}'
        )


def _embedded_advice(kernel: Kernel, workload: Workload) -> str:
    """For a Python source holding its kernel's CUDA (torch's load_inline, CuPy, PyCUDA: features.embedded_cuda),
    how to have that kernel measured: as a CUDA kernel of its own, with the launch its wrapper or Python call
    gives it where that could be read. Empty for any other source."""
    from forecaster_mcp.forecast.features import PYTHON_LANGUAGES, embedded_cuda

    if kernel.language not in PYTHON_LANGUAGES:
        return ""
    try:
        embedded = embedded_cuda(kernel.source, kernel.entry)
        if embedded is None or not embedded.entry:
            return ""
        advice = _launch_advice(kernel, workload)
    except Exception:  # advice only
        log.debug("no CUDA read from the Python source", exc_info=True)
        return ""
    return (
        f". Its CUDA kernel {embedded.entry!r} can be measured as a kernel of its own: send its device code as "
        f"language 'cuda', entry {embedded.entry!r} (the CUDA alone: this server builds no torch extension or "
        f"Python around it), workload.args in that kernel's parameter order, and a launch: {advice}"
    )


def _launch_advice(kernel: Kernel, workload: Workload) -> str:
    """What to pass as `launch`: what the source's own host code launches the kernel with, where it says (the
    forecasts read it: forecast/host_launch.py), else the shape of one. Never used in its place: a launch read
    wrongly would be charged."""
    from forecaster_mcp.forecast.host_launch import source_launch

    try:
        found = source_launch(kernel, workload)
    except Exception:  # advice only: a source it cannot read gets the general kind
        log.debug("no launch read from the source", exc_info=True)
        found = None
    if found is not None and found.grid is not None and found.block is not None:
        shared = found.shared_mem_bytes
        shown = {"grid": list(found.grid), "block": list(found.block), "shared_mem_bytes": shared or 0}
        return (
            f"its source's host code launches it with {json.dumps(shown)}"
            + ("" if shared is not None else " (its dynamic shared memory could not be read: give it)")
            + "; pass that as launch if it is what you mean to measure"
        )
    return 'give grid and block, e.g. {"grid": [4096, 1, 1], "block": [256, 1, 1]}'


def _check_shared_fits(what: str, shared_mem_bytes: int, info: DeviceInfo) -> None:
    """Refuse, before anything is charged, dynamic shared memory the device cannot give one block."""
    if shared_mem_bytes > info.max_shared_mem_per_block_bytes:
        raise InvalidRequest(
            f"{what}.launch.shared_mem_bytes is {shared_mem_bytes}, over the {info.max_shared_mem_per_block_bytes} "
            f"bytes of shared memory {info.name} gives one block (static __shared__ arrays count too): "
            "use less dynamic shared memory"
        )


def _shared_total_mismatch(
    what: str, kernel: Kernel, compiled: CompiledKernel, info: DeviceInfo
) -> str | None:
    """Static __shared__ arrays and dynamic shared memory together over what the device gives one block."""
    static = compiled.static_shared_bytes or 0
    dynamic = kernel.launch.shared_mem_bytes if kernel.launch is not None else 0
    if static + dynamic <= info.max_shared_mem_per_block_bytes:
        return None
    return (
        f"{what} {kernel.entry} uses {static} bytes of static __shared__ memory plus launch.shared_mem_bytes "
        f"{dynamic}, over the {info.max_shared_mem_per_block_bytes} bytes {info.name} gives one block: use "
        "smaller tiles or less dynamic shared memory"
    )


# Device memory the measurement itself holds besides the workload's buffers: the L2-flush buffer (the L2's
# size), guard regions around each buffer, the CUDA context and module (a few hundred MiB on current GPUs).
_CONTEXT_RESERVE_BYTES = 512 * 2**20
# Host copies of the buffers a measurement holds at once (`_check_workload_fits`).
HOST_COPIES = 4


def _check_workload_fits(workload: Workload, info: DeviceInfo) -> None:
    """Refuse, before anything is charged, buffers the device could not hold at once."""
    buffers = [a for a in workload.args if isinstance(a, BufferArg)]
    data = sum(a.nbytes for a in buffers)
    need = data + 2 * GUARD_BYTES * len(buffers) + info.l2_bytes
    if need + _CONTEXT_RESERVE_BYTES > info.total_mem_bytes:
        raise InvalidRequest(
            f"the workload's buffers need {need / 2**30:.2f} GiB of device memory with the L2-flush buffer, "
            f"more than {info.name}'s {info.total_mem_bytes / 2**30:.2f} GiB less "
            f"{_CONTEXT_RESERVE_BYTES // 2**20} MiB for the CUDA context: use smaller shapes"
        )
    # The worker holds up to HOST_COPIES host copies of the buffers at once (the inputs, a fresh input set for
    # the second check, the kernel's and the reference's outputs): past the machine's free memory the kernel
    # would be killed by the OOM killer and the caller told "worker crashed ... check the kernel for faults".
    # ... and the temporaries of drawing the largest one (measured peaks: 6x the buffer for bfloat16, 5x
    # normal-drawn int8, 3x int32 arange; inputs.draw_scratch_bytes).
    host_need = HOST_COPIES * data + max((draw_scratch_bytes(a) for a in buffers), default=0)
    available = _host_memory_available()
    if available is not None and host_need > available:
        raise InvalidRequest(
            f"the workload's buffers need about {host_need / 2**30:.2f} GiB of host memory while measuring "
            f"({HOST_COPIES} copies: inputs, a fresh input set, the kernel's and the reference's outputs, and "
            "the scratch of drawing the largest one), more "
            f"than the {available / 2**30:.2f} GiB free on the measurement machine: use smaller shapes"
        )


def _host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _parameter_mismatch(
    what: str, kernel: Kernel, compiled: CompiledKernel, workload: Workload
) -> str | None:
    """Explain a disagreement between the kernel's parameter list and workload.args, before anything runs."""
    if compiled.param_sizes is None:
        return None
    want = param_sizes(workload)
    have = compiled.param_sizes
    described = ", ".join(
        f"{a.name} ({'pointer' if isinstance(a, BufferArg) else a.dtype})" for a in workload.args
    )
    if len(have) != len(want):
        return (
            f"{what} {kernel.entry} takes {len(have)} parameters "
            f"({', '.join(f'{s} bytes' for s in have) or 'none'}) but workload.args lists {len(want)}: "
            f"{described}; list one argument per kernel parameter, in order"
        )
    for i, (h, w, arg) in enumerate(zip(have, want, workload.args, strict=True)):
        if h != w:
            kind = "a device pointer (8 bytes)" if isinstance(arg, BufferArg) else f"{arg.dtype} ({w} bytes)"
            return (
                f"{what} {kernel.entry} parameter {i} is {h} bytes but workload argument {arg.name!r} "
                f"is {kind}; fix the argument's dtype or order"
            )
    return None


def _image(kernel: Kernel, compiled: CompiledKernel) -> KernelImage:
    assert kernel.launch is not None
    return KernelImage(
        cubin_path=compiled.cubin_path, symbol=compiled.symbol, entry=kernel.entry, launch=kernel.launch
    )


def _peak_bandwidth_gbs(name: str, info: DeviceInfo | None) -> float | None:
    """The larger of the spec table's and the device's own figure: the floor must never be too high."""
    figures: list[float] = []
    try:
        from forecaster_mcp.hardware.specs import lookup

        spec = lookup(name)
        if spec is not None:
            figures.append(spec.mem_bandwidth_gbs)
    except Exception:  # the spec table is optional
        pass
    if info is not None and info.mem_bandwidth_gbs:
        figures.append(info.mem_bandwidth_gbs)
    return max(figures) if figures else None


def _occupancy(info: DeviceInfo | None, threads: int, registers: int, shared: int) -> float | None:
    """Theoretical occupancy from the device's own limits (hardware.occupancy), None when unavailable."""
    if info is None or threads <= 0:
        return None
    try:
        from forecaster_mcp.hardware.occupancy import theoretical_occupancy
        from forecaster_mcp.hardware.specs import GpuSpec
    except ImportError:
        return None
    spec = GpuSpec(
        name=info.name,
        vendor="nvidia",
        arch=info.arch,
        compute_capability=info.compute_capability,
        sms=info.sm_count,
        max_threads_per_sm=info.max_threads_per_sm,
        max_blocks_per_sm=info.max_blocks_per_sm,
        registers_per_sm=info.registers_per_sm,
        max_registers_per_thread=info.max_registers_per_thread,
        shared_mem_per_sm_bytes=info.shared_mem_per_sm_bytes,
        max_shared_mem_per_block_bytes=info.max_shared_mem_per_block_bytes,
        l2_bytes=info.l2_bytes,
        mem_bandwidth_gbs=info.mem_bandwidth_gbs or 0.0,
        fp32_tflops=0.0,
        fp16_tensor_tflops=0.0,
        mem_gib=info.total_mem_bytes / 2**30,
    )
    try:
        return float(theoretical_occupancy(spec, threads, registers, shared))
    except Exception:  # a helper's failure must not fail a measurement
        return None
