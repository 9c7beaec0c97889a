"""Resource usage from `ptxas -v`: registers, shared memory and spills per entry, when nvcc is present.

Compiling takes a second or two, so results are cached on disk by content hash, architecture and compiler version
(failed compiles too; a timeout, a kill or a full disk is not cached: a timeout is remembered a while in memory,
`_OutOfTime`). Only device code is compiled (`-cubin`): the host compiler and assembler never see the source, so
`asm(".incbin ...")` in host code can neither read the server's files nor write a huge object file. A compile error
of the source itself is a `PtxasError` (`ptxas_result`: its first error line, host paths stripped): the forecaster
reports such a kernel as one that does not compile. Anything else that stops a compile (no nvcc, a language nvcc
does not take, a timeout, a kill, a full disk, no compile slot free in time) gives None: the forecaster then works
without these features. Every compile holds one of the process's compile slots (`compile_slots.COMPILE_SLOTS`)
while nvcc runs; the wait for one counts against the compile's time.

An nvcc covers a window of architectures (CUDA 13 dropped sm_5x-sm_72; CUDA 12.2 knows nothing after sm_90).
For a GPU outside the window, `stand_in_arch` picks the nearest one inside it: register and shared-memory
counts of neighbouring architectures are close, and close is better than none.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from forecaster_mcp.compile_slots import COMPILE_SLOTS
from forecaster_mcp.disk_cache import WritesSinceScan, evict_least_recent
from forecaster_mcp.models import Kernel, compile_option_allowed, is_arch_option

_K = TypeVar("_K", bound=Hashable)

log = logging.getLogger(__name__)

# 4: callee spills charged to entries, -rdc left out; 5: to the entry calling them; 6: made directives refused (a
# result cached before may hold a server file's word); 7: a raw string literal's lines are not (6 cached refusals)
CACHE_VERSION = "7"
_ARCH = re.compile(r"^sm_\d{2,3}[a-z]?$")
_PLAIN_ARCH = re.compile(r"^sm_(\d{2,3})$")
_DEVICE_C_FLAGS = ("-dc", "--device-c")
# Relocatable device code leaves file-scope `__shared__` arrays to the link: ptxas then reports no shared memory
# for the entry (2,048 bytes of `__shared__ float t[512]` read as 0), so the resource compile is whole-program.
_RELOCATABLE = re.compile(r"^(?:-rdc|--relocatable-device-code)=")
_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class PtxasEntry:
    """What ptxas reported for one entry function."""

    name: str  # as ptxas names it (mangled unless extern "C")
    registers: int
    shared_bytes: int  # static shared memory
    spill_stores_bytes: int
    spill_loads_bytes: int
    stack_frame_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores_bytes + self.spill_loads_bytes


def measured_entry(kernel: Kernel, resources: dict[str, Any] | None) -> PtxasEntry | None:
    """What ptxas would report for a measured kernel, from the registers and shared memory its measurement
    reported (MeasureResult.resources); None when it reported none (a replay, an older result). The measurement
    reports the shared memory of a block, static and dynamic together; ptxas, the static part alone
    (kernel_features adds the launch's dynamic part). Used for the kernels a static prior anchors on
    (LocalForecaster) and by benchmarks/corpus_lopo.py."""
    if not resources:
        return None
    try:
        spills = int(resources.get("spill_bytes") or 0)
        dynamic = kernel.launch.shared_mem_bytes if kernel.launch is not None else 0
        return PtxasEntry(
            name=kernel.entry,
            registers=int(resources["registers"]),
            shared_bytes=max(0, int(resources.get("shared_mem_bytes") or 0) - dynamic),
            spill_stores_bytes=spills,
            spill_loads_bytes=0,
            stack_frame_bytes=0,
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class PtxasUsage:
    """Per-entry resource usage of one compiled kernel source for one architecture."""

    arch: str
    entries: tuple[PtxasEntry, ...]
    # The headers this server's nvcc lacks (torch/extension.h) that were left out to compile the source's device
    # code alone (`ptxas_results`, features.device_code_alone); empty for a source compiled as it was sent.
    without_headers: tuple[str, ...] = ()

    def for_entry(self, entry: str) -> PtxasEntry | None:
        """The entry named `entry`: an extern "C" name, or the unqualified name of an Itanium-mangled one
        (`_Z4gemvPf`, and `_ZN3opt4gemvEPf` in a namespace); the first of several overloads."""
        for e in self.entries:
            if e.name == entry or itanium_function_name(e.name) == entry:
                return e
        return self.entries[0] if len(self.entries) == 1 else None


@dataclass(frozen=True)
class PtxasError:
    """A compile that failed for the source's own reason (nvcc exited with an error; not a timeout, a signal or
    a full disk), for architecture `arch`."""

    arch: str
    message: str  # the first error line, host paths stripped ("kernel.cu(3): error: expected a \";\"")


# The missing-header messages of nvcc's front end (EDG) and of its host preprocessor: gcc, clang (`-ccbin
# clang`), MSVC (cl.exe). In English: compiler_env sets LANGUAGE=en, which gcc's translations follow; MSVC's
# follow its language pack, so its C1083 is read by number in any wording.
_MISSING_HEADER = re.compile(
    r'cannot open source file "([^"\n]{1,200})"'
    r"|fatal error: ([^\n:']{1,200}): No such file or directory"
    r"|fatal error: '([^'\n]{1,200})' file not found"
    r"|fatal error C1083: Cannot open include file: '([^'\n]{1,200})'"
    # Localised: the name quoted as its language quotes (French 'x', whose "d'ouvrir" opens no name; German "x";
    # Chinese \u201cx\u201d) or not at all (Russian), just before the C runtime's words, English in every
    # language pack.
    r"|fatal error C1083: [^\n]{0,200}?(?:'([^'\n]{1,200})'|\"([^\"\n]{1,200})\"|\u201c([^\u201d\n]{1,200})\u201d"
    r"|:[ \t]*([^\s'\"\u201c\u201d:]{1,200}))[ \t]*:[ \t]*No such file or directory"
)


def missing_header(e: PtxasError) -> str | None:
    """The header `e` says this server's nvcc could not find, or None for any other error.

    Not the kernel's failure: a library header (torch/extension.h, cutlass/gemm.h) may be installed where the
    kernel runs, and the same kernel sent as a Python source (torch's load_inline) is never compiled here at all.
    A header that is nowhere is the measurement's compile_error to find."""
    m = _MISSING_HEADER.search(e.message)
    return None if m is None else next(g for g in m.groups() if g is not None).strip()


def itanium_function_name(symbol: str) -> str | None:
    """The unqualified name in an Itanium-mangled symbol (`_Z3addPf` -> add, `_ZN2ns3addE...` -> add)."""
    if not symbol.startswith("_Z"):
        return None
    i = 2
    nested = symbol.startswith("_ZN")
    if nested:
        i = 3
    name: str | None = None
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while j < len(symbol) and symbol[j].isdigit():
            j += 1
        length = int(symbol[i:j])
        name = symbol[j : j + length]
        i = j + length
        if not nested:
            break
    return name


def find_nvcc(configured: str | None) -> str | None:
    """The nvcc to use: the configured path or name, else PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    if configured:
        path = Path(configured)
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        return shutil.which(configured)
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidate = Path(root) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


@functools.lru_cache(maxsize=8)
def nvcc_version(command: str | tuple[str, ...]) -> str:
    """The compiler's version line (the last line `nvcc --version` prints), part of every cache key here and
    in the measurer's: a toolkit upgraded behind the same path must not be served the old compiler's results.
    `command`: nvcc's path, or the words that run it. 'unknown' when it cannot say."""
    words = [command] if isinstance(command, str) else list(command)
    try:
        done = subprocess.run([*words, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, ValueError, subprocess.SubprocessError):  # ValueError: a path with a NUL
        return "unknown"
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


@functools.lru_cache(maxsize=8)
def supported_archs(nvcc: str) -> tuple[str, ...]:
    """The real architectures this nvcc compiles for (`nvcc --list-gpu-code`); () when it cannot say."""
    try:
        done = subprocess.run(
            [nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(t for t in done.stdout.split() if _PLAIN_ARCH.match(t)) if done.returncode == 0 else ()


def stand_in_arch(arch: str, supported: Sequence[str]) -> str:
    """`arch` when the compiler takes it (or cannot say which it takes); otherwise the nearest architecture it
    does take: the newest one older than `arch` (same generation more often than not), else the oldest."""
    plain = [a for a in supported if _PLAIN_ARCH.match(a)]
    wanted = _PLAIN_ARCH.match(arch)
    if not plain or wanted is None or arch in supported:
        return arch

    def number(a: str) -> int:
        found = _PLAIN_ARCH.match(a)
        return int(found.group(1)) if found else 0

    older = [a for a in plain if number(a) < int(wanted.group(1))]
    return max(older, key=number) if older else min(plain, key=number)


def safe_options(options: list[str]) -> list[str]:
    """The kernel's compile options to pass here: those models.Kernel accepts (validation already rejects the
    rest; this guards kernels built without it), less the architecture flags, since this compile picks its own,
    less `-dc`, which names another output than the `-cubin` this compile makes, and less `-rdc=...`, under which
    ptxas cannot count file-scope shared memory (_RELOCATABLE)."""
    return [
        o
        for o in options
        if compile_option_allowed(o)
        and not is_arch_option(o)
        and o not in _DEVICE_C_FLAGS
        and not _RELOCATABLE.match(o)
    ]


def parse_ptxas(output: str) -> tuple[PtxasEntry, ...]:
    """Parse `ptxas -v` output into per-entry records."""
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, tuple[int, int]] = {}
    order: list[str] = []
    # Spills of device functions that are not inlined (`__noinline__`, recursion), by the entry whose section
    # reported them (None: before any entry).
    callee_spills: dict[str | None, tuple[int, int]] = {}
    current_entry: str | None = None
    props_for: str | None = None
    for line in output.splitlines():
        if m := _RE_ENTRY.search(line):
            current_entry = m.group(1)
            if current_entry not in order:
                order.append(current_entry)
            continue
        if m := _RE_PROPS.search(line):
            props_for = m.group(1)
            continue
        if (m := _RE_FRAME.search(line)) and props_for is not None:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            if props_for in order:
                frames[props_for] = frame
            else:
                stores, loads = callee_spills.get(current_entry, (0, 0))
                callee_spills[current_entry] = (stores + frame[1], loads + frame[2])
            props_for = None
            continue
        if (m := _RE_USED.search(line)) and current_entry is not None:
            smem_match = _RE_SMEM.search(line)
            used[current_entry] = (int(m.group(1)), int(smem_match.group(1)) if smem_match else 0)
    # ptxas compiles each entry with its own copy of the device functions it calls and reports their
    # properties, under the function's own name, after the entry's block and before the next entry: an entry
    # is charged the spills of its section's functions (a helper two kernels call is reported, and charged,
    # once for each, with the spills of that kernel's copy). Any reported before the first entry are charged
    # to every entry. (Stack frames are left as reported: ptxas's own cumulative figure for the entry already
    # counts the callees' frames.)
    before_stores, before_loads = callee_spills.get(None, (0, 0))
    out = []
    for name in order:
        regs, smem = used.get(name, (0, 0))
        stack, stores, loads = frames.get(name, (0, 0, 0))
        own_stores, own_loads = callee_spills.get(name, (0, 0))
        out.append(
            PtxasEntry(
                name,
                regs,
                smem,
                stores + before_stores + own_stores,
                loads + before_loads + own_loads,
                stack,
            )
        )
    return tuple(out)


def _cache_key(kernel: Kernel, arch: str, nvcc: str, flags: list[str], target: str) -> str:
    defines = {k: kernel.defines[k] for k in sorted(kernel.defines)}
    payload = {
        "v": CACHE_VERSION, "source": kernel.source_hash(), "defines": defines, "arch": arch, "nvcc": nvcc,
        "nvcc_version": nvcc_version(nvcc), "flags": flags, "target": target,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:40]


def _read_cache(path: Path) -> tuple[bool, PtxasUsage | PtxasError | None]:
    """(hit, result): a source that compiled without entries is a hit with None. A failure cached without its
    message (written before failures kept one) is a miss: compiled again, its error line is kept."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False, None
    try:
        if not raw.get("ok"):
            if not isinstance(raw.get("error"), str) or not isinstance(raw.get("arch"), str):
                return False, None
            return True, PtxasError(raw["arch"], raw["error"])
        entries = tuple(PtxasEntry(**e) for e in raw["entries"])
        return True, PtxasUsage(raw["arch"], entries) if entries else None
    except (AttributeError, KeyError, TypeError):
        return False, None


def _write_cache(path: Path, result: PtxasUsage | PtxasError | None, arch: str) -> int:
    """Keep `result` at `path`; the bytes written (0 when it could not be)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        body: dict[str, Any] = {"ok": True, "arch": arch, "entries": []}
        if isinstance(result, PtxasError):
            body = {"ok": False, "arch": result.arch, "error": result.message}
        elif result is not None:
            body = {"ok": True, "arch": result.arch, "entries": [asdict(e) for e in result.entries]}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        text = json.dumps(body)
        tmp.write_text(text)
        tmp.replace(path)
        return len(text)
    except OSError as exc:  # a read-only or full cache dir only costs a recompile next time
        log.debug("ptxas cache write failed: %s", exc)
        return 0


# The disk cache's bound: compares are free, and every compile's result was kept (a source of a thousand kernels,
# each reported by ptxas, 500 KB a compare): a client cycling a define over one grew the cache without end. Past
# the bound the least recently used results go (a later compare compiles them again), down to
# PTXAS_CACHE_LOW_WATER of it (forecaster_mcp.disk_cache).
PTXAS_CACHE_BYTES = 256 << 20
PTXAS_CACHE_LOW_WATER = 0.8


_CACHE_WRITES = WritesSinceScan()


def evict_ptxas_cache(folder: Path, keep: Path) -> int:
    """Remove the least recently used (a hit touches it) results of the cache `folder` while it is over
    PTXAS_CACHE_BYTES, down to PTXAS_CACHE_LOW_WATER of it, never `keep`; how many went."""
    return evict_least_recent(
        folder,
        PTXAS_CACHE_BYTES,
        PTXAS_CACHE_LOW_WATER,
        what="ptxas cache",
        spare=lambda path: path == str(keep),
    )


class _OutOfTime:
    """The compiles that ran out of time, by cache key: how long nvcc ran before it was killed, and when.

    A timeout is not cached on disk (a quieter moment may compile the source), but a kernel nvcc takes longer than
    the ptxas wait to compile (2,000 unrolled steps of a loop took 24 s) was compiled again, as long, for every
    compare that asked about it under another launch or workload: the whole wait (10 s) each, a compile slot held
    throughout. For OUT_OF_TIME_MEMORY_S it is not compiled again unless given OUT_OF_TIME_RETRY_FACTOR times the
    time it ran out of (an evaluation's long wait). The process's: forecasters on other event loops share it."""

    def __init__(self, limit: int = 4096) -> None:
        # key -> (seconds nvcc ran, time.monotonic() then), oldest first
        self._ran: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def add(self, key: str, ran_s: float) -> None:
        with self._lock:
            before = self._ran.pop(key, None)
            if before is not None and time.monotonic() - before[1] < OUT_OF_TIME_MEMORY_S:
                ran_s = max(ran_s, before[0])
            self._ran[key] = (ran_s, time.monotonic())
            while len(self._ran) > self._limit:
                self._ran.popitem(last=False)

    def too_little(self, key: str, timeout_s: float) -> bool:
        """Whether a compile of `key` given `timeout_s` would run out of time again, as one did lately."""
        with self._lock:
            found = self._ran.get(key)
            if found is None:
                return False
            ran_s, when = found
            if time.monotonic() - when >= OUT_OF_TIME_MEMORY_S:
                del self._ran[key]
                return False
            return timeout_s < ran_s * OUT_OF_TIME_RETRY_FACTOR


OUT_OF_TIME_MEMORY_S = 600.0
OUT_OF_TIME_RETRY_FACTOR = 1.5
OUT_OF_TIME = _OutOfTime()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# What is kept of a compiler's output: its head (the first diagnostics) and its tail (ptxas's resource lines
# come last). A source that includes itself again and again prints errors without end, ~10 MB/s, all of it
# held in memory before.
OUTPUT_KEEP_BYTES = 256 * 1024
# Variables a compiler never needs and a kernel must not reach (a diagnostic can print the environment).
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)


def compiler_env(**extra: str) -> dict[str, str]:
    """The environment for nvcc: the server's, without anything named like a secret (API keys, tokens), and with
    its messages in English (LANGUAGE=en: gettext's choice of translation, which outranks LC_ALL and LANG and
    changes nothing else of the locale), as `missing_header` and `first_error_line` read them. Under a German
    locale gcc wrote "schwerwiegender Fehler: ...: Datei oder Verzeichnis nicht gefunden"."""
    kept = {k: v for k, v in os.environ.items() if not _SECRET_NAME.search(k)}
    return {**kept, "LANGUAGE": "en", **extra}


# What one compile (nvcc and every program it runs) may use: address space and the size of any file it writes. A
# 40-line source of nested macros grew gcc's preprocessor by 150 MB/s (4 GB after 28 s, under a measurement's
# 120 s compile timeout), two compiles a call; a file that includes itself twice writes without end. Heavy
# template code (CUTLASS) stays well under both; past them the compile fails as the source's own doing.
COMPILE_ADDRESS_SPACE_BYTES = 8 << 30
COMPILE_FILE_BYTES = 1 << 30
_LIMITS_SHIM = (
    "import os, resource, signal, sys\n"
    # Python ignores these at start-up and an exec keeps that: gcc, ignoring SIGXFSZ, wrote on past the limit.
    "for s in (signal.SIGPIPE, signal.SIGXFSZ):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "for r, v in ((resource.RLIMIT_AS, int(sys.argv[1])), (resource.RLIMIT_FSIZE, int(sys.argv[2]))):\n"
    "    hard = resource.getrlimit(r)[1]\n"
    "    v = v if hard == resource.RLIM_INFINITY else min(v, hard)\n"
    "    resource.setrlimit(r, (v, v))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def limited(cmd: Sequence[str]) -> list[str]:
    """`cmd` run under the compile limits (COMPILE_ADDRESS_SPACE_BYTES, COMPILE_FILE_BYTES), which its children
    inherit: a small exec shim sets them (anyio starts processes without a preexec hook)."""
    if not hasattr(signal, "SIGXFSZ"):  # no POSIX resource limits here
        return list(cmd)
    limits = [str(COMPILE_ADDRESS_SPACE_BYTES), str(COMPILE_FILE_BYTES)]
    return [sys.executable, "-I", "-S", "-c", _LIMITS_SHIM, *limits, *cmd]


def over_limits(returncode: int | None, output: str) -> bool:
    """Whether a failed compile ran into the compile limits (out of memory, a file past its size)."""
    return returncode is not None and returncode != 0 and _OVER_LIMITS.search(output) is not None


_OVER_LIMITS = re.compile(
    r"out of memory|Cannot allocate memory|std::bad_alloc|File size limit|[Ss]ignal 25\b"
)
OVER_LIMITS_MESSAGE = (
    f"the compile went past this server's limits ({COMPILE_ADDRESS_SPACE_BYTES >> 30} GiB of memory, "
    f"{COMPILE_FILE_BYTES >> 30} GiB per file): a macro or #include that expands without bound? "
    "Simplify the source"
)


async def read_bounded(stream: AsyncIterable[bytes], keep: int = OUTPUT_KEEP_BYTES) -> bytes:
    """All of `stream` read (so the writer never blocks), at most `keep` bytes of its head and of its tail
    kept, with a line saying how much was left out between them."""
    head = bytearray()
    tail = bytearray()
    dropped = 0
    async for chunk in stream:
        room = keep - len(head)
        if room > 0:
            head += chunk[:room]
            chunk = chunk[room:]
        tail += chunk
        if len(tail) > 2 * keep:  # trimmed in steps: each byte is moved at most twice
            dropped += len(tail) - keep
            del tail[:-keep]
    if len(tail) > keep:
        dropped += len(tail) - keep
        del tail[:-keep]
    middle = f"\n[... {dropped} bytes of compiler output left out ...]\n".encode() if dropped else b""
    return bytes(head) + middle + bytes(tail)


# cicc, nvcc's device front end, reads the host compiler's preprocessed output (`<name>.cpp1.ii`) and obeys any
# directive in it. gcc writes its own there at the start of a line (linemarkers `# 12 "file"`, `#pragma`), and
# also a '#' that a macro leaves first on a line (`#define H #` then `H include "/etc/passwd"`; a `%:` pasted
# from '%' and ':'), indented by a space that gcc's reader would skip but cicc does not: cicc then included the
# file and quoted it in its errors ('passwd(1): error: identifier "root" is undefined' came back in a
# compare_kernels rationale). Macros build such a directive where no check of the source can see it, so the
# preprocessed text is checked after every compile: a hash first on a line is gcc's own (at the line's very
# start, a linemarker, #pragma or #ident), or the source's own line as written (a line of a raw string literal,
# which gcc copies as it is and cicc reads as string text), or the compile is refused. A line the source holds
# as written is one the source checks (models.source_problem) have read, as they read a directive written plainly.
PREPROCESSED_GLOB = "*.cpp1.ii"
NO_PREPROCESSED_SOURCE = "no preprocessed source"
_LINE_HASH = re.compile(rb"[\r\n][ \t\f\v]*(#|%:|\?\?=)")  # "(?:\A|[\r\n])" scans 4x slower: the start apart
_FIRST_HASH = re.compile(rb"[ \t\f\v]*(#|%:|\?\?=)")
_GCC_DIRECTIVE = re.compile(rb'# \d+ "|#pragma\b|#ident\b')
_CHUNK = 1 << 20
_LINEMARKER = re.compile(rb'# (\d+) "((?:[^"\\\n]|\\.)*)"')
MADE_DIRECTIVE_ADVICE = (
    "a macro writes a preprocessor directive (a '#' or '%:' that a macro expansion leaves first on a line, "
    "as '#define H #' then 'H include ...'): the compiler would obey it, and the server does not compile such "
    "sources; write directives in the source itself"
)


def made_directive(keep_dir: Path, source: str | None = None) -> str | None:
    """The start of the first line in the preprocessed source nvcc kept in `keep_dir` (PREPROCESSED_GLOB) that
    is a directive gcc did not write, or None when there is none. A line starting with '#' that is the same line
    of `source` (the kernel's own source, which the compiled `kernel.cu` holds) as written is not one: a line of
    a raw string literal. No preprocessed source at all reads as such a line (NO_PREPROCESSED_SOURCE): nothing
    then says what cicc read was checked."""
    files = sorted(keep_dir.glob(PREPROCESSED_GLOB))
    if not files:
        return NO_PREPROCESSED_SOURCE
    # The source's lines as gcc reads them (a CR LF or a lone CR ends a line), as bytes, as the compile wrote them.
    lines = (
        re.split(rb"\r\n|\r|\n", source.removeprefix("\ufeff").encode("utf-8", "surrogatepass"))
        if source is not None
        else []
    )
    for path in files:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                continue
            # Mapped, not read: a preprocessor explosion can leave hundreds of MB here.
            failure: Exception | None = None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as text:
                try:
                    found = _made_directive_in(text, lines)
                except Exception as exc:
                    # Its frames hold regex scanners over the map, which then cannot close: the map's BufferError
                    # ("cannot close exported pointers exist") took this error's place. Raised once it is closed.
                    traceback.clear_frames(exc.__traceback__)
                    failure = exc
            if failure is not None:
                raise failure
        if found is not None:
            return found
    return None


def _made_directive_in(text: mmap.mmap, source_lines: Sequence[bytes] = ()) -> str | None:
    """made_directive in one mapped file (its matches are gone once this returns: the map can close)."""
    first = _FIRST_HASH.match(text)
    starts = [(0, first.start(1))] if first else []
    found = ((m.start() + 1, m.start(1)) for m in _LINE_HASH.finditer(text))
    # Where each line came from, by gcc's last linemarker ('# 12 "kernel.cu"': the next line is line 12 of that
    # file): the line starting at `cursor` is line `line_no` of the source when `in_source`. Counted only up to
    # each line checked, so the whole file is counted at most once.
    in_source, line_no, cursor = False, 0, 0
    # One byte past the source's longest line and its CR: a line read that far is none of the source's.
    reach = max(max(map(len, source_lines), default=0) + 2, 60)
    for line_at, hash_at in itertools.chain(starts, found):
        if hash_at == line_at and _GCC_DIRECTIVE.match(text, hash_at):
            if (marker := _LINEMARKER.match(text, hash_at)) is not None:
                name = marker.group(2)
                in_source = name == b"kernel.cu" or name.endswith(b"/kernel.cu")
                line_no, cursor = int(marker.group(1)), text.find(b"\n", marker.end()) + 1
            continue
        # Read no further than any source line reaches (a preprocessor explosion may write a line of a GB).
        end = text.find(b"\n", line_at, line_at + reach)
        line = bytes(text[line_at : end if end >= 0 else line_at + reach]).removesuffix(b"\r")
        if in_source and text[hash_at] == ord("#") and 0 < cursor <= line_at:
            # A map has no count of its own; counted a MB at a time (the lines between may be a GB).
            line_no += sum(
                text[i : min(i + _CHUNK, line_at)].count(b"\n") for i in range(cursor, line_at, _CHUNK)
            )
            cursor = line_at
            # Copied as written (gcc writes a macro's expansion, and a directive it made, otherwise): a raw string
            # literal's line, which cicc reads as text, and which the source checks read as the source's own.
            if 1 <= line_no <= len(source_lines) and source_lines[line_no - 1] == line:
                continue
        return line[:60].decode("utf-8", "replace").strip()
    return None


async def ptxas_usage(
    kernel: Kernel, arch: str, nvcc: str | None, cache_dir: Path | None, timeout_s: float = 20.0
) -> PtxasUsage | None:
    """Compile `kernel`'s device code with `nvcc -cubin -arch=<arch> -Xptxas -v` and report per-entry
    resources, or None."""
    result = await ptxas_result(kernel, arch, nvcc, cache_dir, timeout_s)
    return result if isinstance(result, PtxasUsage) else None


async def ptxas_result(
    kernel: Kernel,
    arch: str,
    nvcc: str | None,
    cache_dir: Path | None,
    timeout_s: float = 20.0,
    *,
    on_start: Callable[[], None] | None = None,
) -> PtxasUsage | PtxasError | None:
    """`ptxas_usage`, or the source's own compile error (`PtxasError`); None when no compile could tell
    (no nvcc, another language, a timeout, a kill, a full disk, no compile slot within `timeout_s`) or the source
    has no entry function. `timeout_s` covers the wait for a compile slot and the compile. `on_start` is called when
    the answer is the cache's or nvcc is about to start (its slot taken): a compile that never started is no answer
    about the source."""
    if kernel.language != "cuda" or nvcc is None or not _ARCH.match(arch):
        return None
    deadline = anyio.current_time() + timeout_s
    flags = safe_options(kernel.compile_options)
    target = _target_flag(kernel.compile_options, arch)
    key = await anyio.to_thread.run_sync(
        _cache_key, kernel, arch, nvcc, flags, target
    )  # nvcc --version, once
    cache_path = cache_dir / "ptxas" / f"{key}.json" if cache_dir else None
    if cache_path is not None:
        hit, cached = _read_cache(cache_path)
        if hit:
            with contextlib.suppress(OSError):
                os.utime(cache_path)  # used now: what eviction orders by
            if on_start is not None:
                on_start()
            return cached
    left = deadline - anyio.current_time()
    if OUT_OF_TIME.too_little(key, left):
        # An answer about the source (it takes longer than this): as a timeout is, so on_start.
        if on_start is not None:
            on_start()
        log.info("nvcc ran out of time on %s lately, given as much: ptxas features unavailable", kernel.entry)
        return None
    if left <= 0 or not await COMPILE_SLOTS.acquire(left):
        # Not cached: nothing was learned about the source, and a quieter moment compiles it.
        log.info(
            "no compile slot free within %.1f s (%d compiles at once, this server's limit): ptxas features of %s "
            "unavailable",
            timeout_s,
            COMPILE_SLOTS.limit,
            kernel.entry,
        )
        return None
    try:
        if on_start is not None:
            on_start()
        return await _compile(kernel, arch, nvcc, flags, target, cache_path, deadline, key)
    finally:
        COMPILE_SLOTS.release()


async def _compile(
    kernel: Kernel,
    arch: str,
    nvcc: str,
    flags: list[str],
    target: str,
    cache_path: Path | None,
    deadline: float,
    key: str,
) -> PtxasUsage | PtxasError | None:
    """ptxas_result's compile, its compile slot held, killed at `deadline` (anyio.current_time); one killed is
    remembered in OUT_OF_TIME under `key`."""
    with tempfile.TemporaryDirectory(prefix="fmcp-ptxas-") as tmp:
        src = Path(tmp) / "kernel.cu"
        # As the measurer writes it: a lone surrogate (valid JSON, not valid UTF-8) must not raise here.
        src.write_text(kernel.compile_source(), encoding="utf-8", errors="surrogatepass")
        keep = Path(tmp) / "keep"  # the preprocessed source cicc read, checked below (made_directive)
        keep.mkdir()
        cmd = [
            nvcc,
            "-cubin",
            target,
            "-Xptxas",
            "-v",
            "--keep",
            "--keep-dir",
            str(keep),
            *flags,
            "-o",
            str(Path(tmp) / "kernel.cubin"),
            str(src),
        ]
        try:
            proc = await anyio.open_process(
                limited(cmd),
                cwd=tmp,
                # nvcc's own intermediates (tmpxft_*) go to TMPDIR: here, so a killed compile leaves none.
                env=compiler_env(TMPDIR=tmp),
                # Not the server's: on stdio that is the client's requests, and a source can read a device.
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:  # ValueError: an argument the OS refuses (an embedded NUL)
            log.info("nvcc could not start (%s): ptxas features unavailable", exc)
            return None
        raw = b""
        timed_out = True
        started = anyio.current_time()
        try:
            with anyio.move_on_after(deadline - anyio.current_time()):
                if proc.stdout is not None:
                    raw = await read_bounded(proc.stdout)
                await proc.wait()
                timed_out = False
        finally:
            if timed_out or proc.returncode is None:
                # nvcc runs cicc and ptxas as children: kill the whole session we started.
                _kill_group(proc.pid)
                with anyio.CancelScope(shield=True):
                    await proc.wait()
            await proc.aclose()
        made = None if timed_out else await anyio.to_thread.run_sync(made_directive, keep, kernel.source)
    if timed_out:
        OUT_OF_TIME.add(key, max(0.0, deadline - started))
        log.info("nvcc did not finish in its time on %s: ptxas features unavailable", kernel.entry)
        return None
    output = raw.decode("utf-8", "replace")
    result: PtxasUsage | PtxasError | None = None
    if made == NO_PREPROCESSED_SOURCE and proc.returncode != 0:
        made = None  # the host preprocessor failed (its messages are its own): cicc never ran
    if made == NO_PREPROCESSED_SOURCE:
        log.warning(
            "nvcc kept no preprocessed source (%s) to check: ptxas features unavailable", PREPROCESSED_GLOB
        )
        return None
    if made is not None:
        log.info("refused %s: a macro writes the directive %r", kernel.entry, made)
        result = PtxasError(arch, f"source refused: {MADE_DIRECTIVE_ADVICE}")
    elif proc.returncode == 0:
        entries = parse_ptxas(output)
        result = PtxasUsage(arch, entries) if entries else None
    else:
        log.debug("nvcc failed (rc=%s) on %s: %s", proc.returncode, kernel.entry, output[-500:])
        if not _source_failure(proc.returncode, output):
            return None  # the machine's doing, not the source's: the next compile may pass
        line = first_error_line(output, tmp)
        if not line:
            # No diagnostic at all (a crashed front end, or a configured "nvcc" that is another program): nothing
            # says the source is wrong.
            return None
        result = PtxasError(arch, line)
    if cache_path is not None:
        written = _write_cache(cache_path, result, arch)
        if written and _CACHE_WRITES.due(cache_path.parent, written, PTXAS_CACHE_BYTES):
            await anyio.to_thread.run_sync(evict_ptxas_cache, cache_path.parent, cache_path)
    return result


_ERROR_LINE = re.compile(r"\berror\b|\bfatal\b", re.IGNORECASE)
ERROR_LINE_CHARS = 240


def first_error_line(output: str, workdir: str | Path | None = None) -> str:
    """The first line of a compiler's output that reports an error, without host paths (as the measurer trims
    compiler messages), at most ERROR_LINE_CHARS long; '' when no line does."""
    from forecaster_mcp.measure.pycuda_measurer import trim_compiler_message

    lines = trim_compiler_message(output, workdir).splitlines()
    line = next((ln for ln in lines if _ERROR_LINE.search(ln)), "").strip()
    return line if len(line) <= ERROR_LINE_CHARS else line[: ERROR_LINE_CHARS - 1] + "…"


_SUFFIXED_ARCH = re.compile(r"(?:sm|compute)_(\d{2,3})([af])\b")


def _target_flag(options: Sequence[str], arch: str) -> str:
    """`-arch=<arch>`, or the architecture-specific target (sm_90a, sm_100f) the kernel's own options ask for on
    this GPU's architecture: wgmma, setmaxnreg or tcgen05 compile only there, so the plain target gave no
    features for such kernels."""
    plain = _PLAIN_ARCH.match(arch)
    for option in options:
        if not is_arch_option(option):
            continue
        for found in _SUFFIXED_ARCH.finditer(option):
            if plain is not None and found.group(1) == plain.group(1):
                n, suffix = found.groups()
                return f"-gencode=arch=compute_{n}{suffix},code=sm_{n}{suffix}"
    return f"-arch={arch}"


# A compile that failed for one of these reasons failed because of the machine, not the source. "nvcc fatal" is
# the compiler driver refusing its command or its setup (an architecture it does not take, its host compiler's
# set-up, an option), and "unsupported GNU version" the toolkit's own check of the host compiler: neither is an
# error in the kernel's code.
_ENVIRONMENT_FAILURE = re.compile(
    r"No space left on device|Cannot allocate memory|out of memory|Killed|nvcc fatal|unsupported GNU version"
)


def _source_failure(returncode: int | None, output: str) -> bool:
    """Whether a failed compile is the source's own (cached as a failure) rather than a kill by a signal (the
    OOM killer, an operator) or an environment error such as a full disk (not cached)."""
    return returncode is not None and returncode > 0 and _ENVIRONMENT_FAILURE.search(output) is None


async def ptxas_usages(
    kernels: Mapping[_K, tuple[Kernel, str]],
    nvcc: str,
    cache_dir: Path | None,
    wait_s: float,
    concurrency: int = 2,
) -> dict[_K, PtxasUsage]:
    """`ptxas_usage` of each (kernel, architecture), `concurrency` compiles at a time (each also waiting for a
    compile slot of the process), all within one wait of `wait_s` (+1 s); an architecture this nvcc does not target
    is replaced by the nearest one it does. Kernels that fail to compile, or are still compiling or waiting when the
    wait ends, are left out."""
    found = await ptxas_results(kernels, nvcc, cache_dir, wait_s, concurrency)
    return {key: r for key, r in found.items() if isinstance(r, PtxasUsage)}


# The most headers this server's nvcc lacks that are left out of one source (each found by a compile of its own).
MAX_MISSING_HEADERS = 4


async def _device_code_alone(
    kernel: Kernel,
    error: PtxasError,
    nvcc: str,
    cache_dir: Path | None,
    deadline: float,
) -> tuple[PtxasUsage | None, bool]:
    """ptxas's figures for `kernel`'s device code compiled without the headers this server's nvcc lacks (`error`
    names the first): their #include lines and the host code that uses them left out
    (features.device_code_alone), the next missing header found by the next compile, up to MAX_MISSING_HEADERS.
    A PyTorch extension's kernel is plain CUDA; only its wrapper needs torch/extension.h. None when the device
    code needs the headers itself, or has no entry `kernel.entry` compiled alone (a template instantiated only by
    the host code's AT_DISPATCH): the kernel is then read without register counts, as before. With whether every
    compile it needed started: one that never did (no compile slot came free, or no time was left) says nothing
    of the source."""
    from forecaster_mcp.forecast.features import device_code_alone  # features reads ptxas's PtxasEntry

    headers: set[str] = set()
    started: list[bool] = []
    found: str | None = missing_header(error)
    while found is not None and found not in headers and len(headers) < MAX_MISSING_HEADERS:
        headers.add(found)
        started.clear()
        result = None
        if deadline > anyio.current_time():
            # Up to 1 MB of source read for its host functions: off the event loop.
            source = await anyio.to_thread.run_sync(
                device_code_alone, kernel.source, frozenset(headers), kernel.entry
            )
            result = await ptxas_result(
                kernel.model_copy(update={"source": source}),
                error.arch,
                nvcc,
                cache_dir,
                timeout_s=deadline - anyio.current_time(),
                on_start=lambda: started.append(True),
            )
        if not started:
            return None, False
        if isinstance(result, PtxasUsage):
            if result.for_entry(kernel.entry) is None:
                return None, True
            return replace(result, without_headers=tuple(sorted(headers))), True
        found = missing_header(result) if isinstance(result, PtxasError) else None
    return None, True


async def ptxas_results(
    kernels: Mapping[_K, tuple[Kernel, str]],
    nvcc: str,
    cache_dir: Path | None,
    wait_s: float,
    concurrency: int = 2,
    *,
    unstarted: set[_K] | None = None,
) -> dict[_K, PtxasUsage | PtxasError]:
    """`ptxas_usages`, with the kernels whose source failed to compile as their `PtxasError` (its `arch` the
    stand-in when one was used). Kernels no compile could tell about are left out; those whose compile never
    started (no compile slot came free within the wait) are also added to `unstarted`, when given, as are those
    whose device code was to be compiled alone (a missing header) by a compile that never started."""
    deadline = anyio.current_time() + wait_s
    archs = await anyio.to_thread.run_sync(supported_archs, nvcc)
    limiter = anyio.CapacityLimiter(concurrency)
    out: dict[_K, PtxasUsage | PtxasError] = {}
    started: set[_K] = set()
    unsettled: set[_K] = set()

    async def one(key: _K, kernel: Kernel, arch: str) -> None:
        async with limiter:
            # The wait for this call's turn and for a compile slot are both spent out of wait_s.
            result = await ptxas_result(
                kernel,
                stand_in_arch(arch, archs),
                nvcc,
                cache_dir,
                timeout_s=deadline - anyio.current_time(),
                on_start=lambda: started.add(key),
            )
            if isinstance(result, PtxasError) and missing_header(result) is not None:
                # Its compile alone may find no compile slot on a busy server: then unsettled, as a first compile
                # that found none is (a later call compiles it), though this call reads the missing header.
                alone, settled = await _device_code_alone(kernel, result, nvcc, cache_dir, deadline)
                result = alone or result
                if not settled:
                    unsettled.add(key)
        if result is not None:
            out[key] = result

    with anyio.move_on_after(wait_s + 1.0):
        async with anyio.create_task_group() as tg:
            for key, (kernel, arch) in kernels.items():
                tg.start_soon(one, key, kernel, arch)
    if unstarted is not None:
        unstarted.update(key for key in kernels if key not in out and key not in started)
        unstarted.update(unsettled)
    return out
