"""Replay of recorded measurements: Kernel Tuner cache files (`.json` or `.json.gz`) and the project's own
exports (`forecaster-mcp export`, `.jsonl`).

An exported measurement is matched exactly: the kernel's content (source, entry, defines, launch, compile
options), the workload and the device must be those measured, and the recorded result comes back as it was
measured (its runtime statistics, correctness check and cost), except that one which took more GPU time than
the request's `max_seconds` is a `timeout` charging the cap, and one of more runs than the request's `max_runs`
is refused (its statistics cannot be cut down to fewer runs). Exports are read whole at start-up; a line with
an impossible cost or time is refused there.

A "measurement" is a lookup: the kernel's `entry` must equal the recording's `kernel_name` and its `defines`
must be exactly the recorded tuning parameters (values compared forgivingly: 16 == 16.0 == "16"). Anything
else is refused with `NotMeasurable`, naming what the recording does hold, as Kernel Tuner's simulation mode
refuses a configuration it has not seen. So is a request that contradicts what the recording holds besides:
a workload.problem whose sizes are not the recorded problem_size (compared as numbers under any names, sizes
of 1 left out), or a launch.block other than the block the tuning parameters block_size_x/y/z set. What the
recording does not hold (the grid, shared memory, compile options, the argument buffers) cannot be checked: a
result that was asked with any of them says so in its `message`.

Start-up is cheap: construction reads only each file's header (the keys before `"cache"`, which Kernel Tuner
writes first). The entries are parsed on first use: in a worker thread by `measure`, in place by
`reservation_seconds` (a sync call that must know the exact cost; 0.1-0.4 s once per file), or all at once
off the event loop by `await preload()`, which a server should call at start-up.

Cost, the GPU-seconds a replayed measurement charges: the recorded device time, i.e. the sum of the
recorded kernel runs plus the recorded verification time (both in ms in the file). Compile time is reported
as `compile_seconds` and never charged. A configuration that failed is charged like any run: the device time
recorded for its attempt (Kernel Tuner's `benchmark_time`, a fraction of a ms for one that failed at run time),
0 for one that never compiled (it never reached the device). The request's caps apply as they would on a GPU: only the recorded runs that
fit in `max_runs` and `max_seconds` are used, and a single run longer than `max_seconds` is a `timeout` that
charges the cap.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import hashlib
import io
import json
import logging
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

from pydantic import ValidationError

from forecaster_mcp.errors import NotMeasurable, OperatorError
from forecaster_mcp.hardware.specs import canonical_name, lookup
from forecaster_mcp.measure.base import MeasureRequest, ProgressCallback
from forecaster_mcp.measure.timing import median_ci_covers, median_ci_ranks
from forecaster_mcp.models import (
    REPLAY_HISTORY_MARK,
    Correctness,
    DeviceProvenance,
    Kernel,
    MeasureCost,
    MeasureResult,
    RuntimeStats,
    Workload,
    c_integer,
)

log = logging.getLogger(__name__)

ReplayStatus = Literal["ok", "compile_error", "launch_error"]
_FAILURES: dict[str, ReplayStatus] = {
    "CompilationFailedConfig": "compile_error",
    "RuntimeFailedConfig": "launch_error",
}
_MIN_RESERVATION_SECONDS = 0.001  # the ledger refuses a zero hold
_MAX_RECORDED_RUN_MS = 86400.0 * 1000.0  # no recorded kernel run takes a day: a longer "time" is a marker


# ---------------------------------------------------------------- statistics


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def runtime_stats(times_ms: Sequence[float]) -> RuntimeStats:
    """Summary of repeated runtimes (ms): std is the sample standard deviation (ddof=1)."""
    if not times_ms:
        raise ValueError("runtime_stats needs at least one time")
    ordered = sorted(float(t) for t in times_ms)
    n = len(ordered)
    mean = math.fsum(ordered) / n
    std = math.sqrt(math.fsum((t - mean) ** 2 for t in ordered) / (n - 1)) if n > 1 else 0.0
    median = _percentile(ordered, 0.5)
    lo, hi = median_ci_ranks(n)
    ci_low, ci_high = ordered[lo], ordered[hi]
    noise = (ci_high - ci_low) / 2.0 / median if median > 0 else 0.0
    return RuntimeStats(
        median=median,
        mean=mean,
        min=ordered[0],
        p10=_percentile(ordered, 0.1),
        p90=_percentile(ordered, 0.9),
        std=std,
        ci95_low=ci_low,
        ci95_high=ci_high,
        runs=n,
        relative_noise=noise,
    )


# ---------------------------------------------------------------- value matching


# A plain decimal float literal (the text a define becomes; an integer literal is models.c_integer's).
_C_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?[0-9]+[eE][+-]?[0-9]+")


def normalize_value(value: Any) -> int | float | str:
    """Tuning-parameter values compared as the compiler reads them, forgiving only the spelling of a number:
    16 == 16.0 == "16" == "0x10" == "16u", True == 1, " 0.5" == 0.5. A string is read as a C literal (as the
    local forecaster reads it): "016" is octal 14 (it was taken for 16 and answered with 16's runtime), and
    text that is no C number ("1_6") stays text, matching no recorded number."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    text = str(value).strip()
    integer = c_integer(text)
    if integer is not None:
        return integer
    if _C_FLOAT.fullmatch(text):
        number = float(text)
        if math.isfinite(number):
            return int(number) if number.is_integer() else number
    return text


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _fmt_values(values: Sequence[Any], limit: int = 24) -> str:
    shown = ", ".join(_fmt(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} values)" if len(values) > limit else "")


# ---------------------------------------------------------------- what a request says beyond the entry


# Kernel Tuner's default names of the tuning parameters it sets the thread block from (x, y, z).
_BLOCK_PARAMS = ("block_size_x", "block_size_y", "block_size_z")


def _sizes(values: Sequence[Any]) -> list[int | float] | None:
    """Problem sizes compared as numbers, in order of size, a size of 1 left out (a dimension of one is no
    dimension: [25000, 2048, 1] is the problem {"samples": 25000, "channels": 2048}, and [1, 1] has no sizes
    left, []); None when a value is no number (a size given as a formula) or there are none."""
    numbers = [normalize_value(v) for v in values]
    if not numbers or not all(isinstance(n, int | float) for n in numbers):
        return None
    return sorted(cast(int | float, n) for n in numbers if n != 1)


def _recorded_sizes(header: ReplayHeader) -> list[int | float] | None:
    """The recording's problem_size as `_sizes`; None when it records none."""
    recorded = header.problem_size
    if recorded is None:
        return None
    return _sizes(recorded if isinstance(recorded, list) else [recorded])


def _size_value(value: Any) -> int | None:
    """`value` as a problem size: a whole number of at least 1 however spelt (4096, 4096.0, "4096"); None for
    what can be no size: a label ("float32"), a flag (true), a factor (alpha 1.5), 0 or a negative."""
    if isinstance(value, bool):
        return None
    number = normalize_value(value)
    return number if isinstance(number, int) and number >= 1 else None


def _given_sizes(workload: Workload) -> list[int | float] | None:
    """The sizes a request's workload.problem gives (its values that can be sizes, `_size_value`), as `_sizes`:
    [] when every one is 1 ({"n": 1} is no problem of 4096 x 4096); None when it gives none."""
    return _sizes([size for value in workload.problem.values() if (size := _size_value(value)) is not None])


def _fmt_given(sizes: Sequence[int | float]) -> str:
    return f"the sizes {_fmt_values(sizes)}" if sizes else "only sizes of 1"


def _block_axes(header: ReplayHeader) -> list[tuple[int, str]]:
    """(axis, tuning parameter) for each axis of the block the recording sets from a tuning parameter."""
    return [(i, name) for i, name in enumerate(_BLOCK_PARAMS) if name in header.param_keys]


def _contradiction(kernel: Kernel, workload: Workload, header: ReplayHeader, device: str) -> str | None:
    """Why the recording cannot answer this request although it holds its entry: its workload.problem gives
    other sizes than the recorded problem_size, or its launch.block another block than the one the recorded
    tuning parameters set. None when nothing the request gives contradicts what the recording holds."""
    parts = []
    recorded, given = _recorded_sizes(header), _given_sizes(workload)
    if recorded is not None and given is not None and given != recorded:
        parts.append(
            f"the recording {header.path.name} was made for problem_size {header.problem_size}, and this "
            f"request's workload.problem gives {_fmt_given(given)}: a replay answers only for the "
            "recorded problem. Send workload.problem with exactly the sizes "
            f"{_fmt_values(recorded)} (under any names; sizes of 1 may be left out), or leave it out."
        )
    if kernel.launch is not None:
        axes = _block_axes(header)
        expected = list(kernel.launch.block)
        for i, name in axes:
            value = normalize_value(kernel.defines.get(name))
            if isinstance(value, int):
                expected[i] = value
        if expected != list(kernel.launch.block):
            params = ", ".join(f"{name}={_fmt(kernel.defines.get(name))}" for _, name in axes)
            parts.append(
                f"the recorded block is set by the tuning parameters ({params}), as Kernel Tuner sets it, and "
                f"this request's launch.block is {list(kernel.launch.block)}: send launch.block {expected}, or "
                "leave launch out."
            )
    if not parts:
        return None
    return (
        f"{kernel.entry} on {device}: "
        + " ".join(parts)
        + " Other sizes or launches can be forecast with compare_kernels (free); nothing was charged."
    )


def _unchecked_note(kernel: Kernel, workload: Workload, header: ReplayHeader) -> str | None:
    """What the request gives that the recording does not record (a Kernel Tuner cache file holds the kernel
    name, the tuning parameters, the problem size and the device; not the grid, shared memory, compiler flags or
    buffers), so it was answered unchecked; None when it gives nothing such."""
    unchecked = []
    if kernel.launch is not None:
        unchecked.append("launch.grid")
        recorded_axes = {i for i, _ in _block_axes(header)}
        unchecked += [
            f"launch.block.{'xyz'[i]}"
            for i, d in enumerate(kernel.launch.block)
            if i not in recorded_axes and d != 1
        ]
        if kernel.launch.shared_mem_bytes:
            unchecked.append("launch.shared_mem_bytes")
    if kernel.compile_options:
        unchecked.append("compile_options")
    if workload.args:
        unchecked.append("workload.args")
    if workload.problem and (_recorded_sizes(header) is None or _given_sizes(workload) is None):
        unchecked.append("workload.problem")
    if not unchecked:
        return None
    problem = f" on problem_size {header.problem_size}" if _recorded_sizes(header) is not None else ""
    return (
        f"the recording {header.path.name} does not hold this request's {', '.join(unchecked)}: the time "
        f"replayed is the one recorded for these tuning parameters{problem} with whatever of these the tuner "
        "used, not checked against this request's"
    )


# ---------------------------------------------------------------- the recording format


@dataclass(slots=True)
class ReplayEntry:
    """One recorded configuration."""

    params: dict[str, Any]
    time_ms: float | None  # the recorded mean; None for a failed configuration
    status: ReplayStatus
    times: list[float]  # every recorded run (ms); empty for a failed configuration
    message: str | None = None  # the recorded failure string
    compile_time_ms: float | None = None
    verification_time_ms: float | None = None
    # The device time Kernel Tuner recorded for a failed configuration (its `benchmark_time`: the launch that
    # failed at run time; 0 for one that never compiled). None for a run that worked, whose runs are its cost.
    failed_device_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class ReplayHeader:
    """What a recording holds, read without parsing its entries."""

    path: Path
    device: str  # canonical name
    recorded_device_name: str  # as written in the file ("" in the MI250X files)
    kernel_name: str
    problem_size: Any
    param_keys: tuple[str, ...]
    tune_params: Mapping[str, list[Any]]


@dataclass
class ReplaySpace:
    """A whole recorded search space: one kernel on one device."""

    path: Path
    device: str
    recorded_device_name: str
    kernel_name: str
    problem_size: Any
    param_keys: list[str]
    tune_params: dict[str, list[Any]]
    entries: list[ReplayEntry]
    best_time_ms: float | None  # fastest valid configuration's recorded time
    _index: dict[tuple[Any, ...], ReplayEntry] | None = field(default=None, repr=False, compare=False)

    def key(self, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The normalized lookup key of a parameter mapping; None unless it names exactly `param_keys`."""
        if set(params) != set(self.param_keys):
            return None
        return tuple(normalize_value(params[k]) for k in self.param_keys)

    def find(self, params: Mapping[str, Any]) -> ReplayEntry | None:
        """The recorded entry for exactly these tuning parameters, or None."""
        key = self.key(params)
        return None if key is None else self.index().get(key)

    def index(self) -> dict[tuple[Any, ...], ReplayEntry]:
        """Entries by normalized parameter tuple (in `param_keys` order), built once."""
        if self._index is None:
            self._index = {
                tuple(normalize_value(e.params.get(k)) for k in self.param_keys): e for e in self.entries
            }
        return self._index

    def valid_entries(self) -> list[ReplayEntry]:
        return [e for e in self.entries if e.ok]


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return path.open("rb")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _scan_header(text: str, decoder: json.JSONDecoder) -> tuple[dict[str, Any], bool] | None:
    """Top-level keys before "cache" -> (header, reached_cache); None when `text` is too short to tell."""
    pos = _skip_ws(text, 0)
    if pos >= len(text):
        return None
    if text[pos] != "{":
        raise ValueError("the file is not a JSON object")
    pos += 1
    header: dict[str, Any] = {}
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return None
        if text[pos] == "}":
            return header, False
        try:
            key, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return None
        if text[pos] != ":" or not isinstance(key, str):
            raise ValueError("the file is not a JSON object")
        pos = _skip_ws(text, pos + 1)
        if pos >= len(text):
            return None
        if key == "cache":
            return header, True
        if key == "results" and "kernel_name" not in header:
            # A T4 results file: its header says what it is (_make_header), without decoding all its results.
            # Told by its first result (T4's {configuration, times, ...}): a cache file of another writer may
            # hold a "results" of its own before kernel_name, and is read on (load_space reads it).
            t4 = _t4_results(text, pos, decoder)
            if t4 is None:
                return None
            if t4:
                return {**header, "results": []}, False
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        # A number that ends the buffer may continue in the next chunk.
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return None
        header[key] = value
        if text[pos] == ",":
            pos += 1
        elif text[pos] == "}":
            return header, False
        else:
            raise ValueError("the file is not a JSON object")


def _t4_results(text: str, pos: int, decoder: json.JSONDecoder) -> bool | None:
    """Whether the value at `pos` opens T4's results, a list of {configuration, ...}; None when `text` is too
    short to tell (only the first result is decoded)."""
    if text[pos] != "[":
        return False
    first = _skip_ws(text, pos + 1)
    if first >= len(text):
        return None
    if text[first] != "{":
        return False
    try:
        line, _ = decoder.raw_decode(text, first)
    except json.JSONDecodeError:
        return None
    return isinstance(line, dict) and "configuration" in line


def _read_header_fields(path: Path, max_chars: int = 8 * 2**20) -> dict[str, Any] | None:
    """The keys before "cache", streamed; None when "cache" does not come last (parse the whole file)."""
    decoder = json.JSONDecoder()
    # utf-8-sig: a byte-order mark (a file saved by a Windows editor) is no part of the JSON, as json.loads
    # already reads it; the header scan refused such a file that load_space read.
    utf8 = codecs.getincrementaldecoder("utf-8-sig")()
    text = ""
    with _open_binary(path) as f:
        while True:
            # Each read doubles the text: every scan starts again from the top, and a value too long for the
            # text so far (a JSON file that is no cache file) cost a rescan per 16 KiB, 42 s for an 18 MB file.
            chunk = f.read(max(16384, len(text)))
            text += utf8.decode(chunk, final=not chunk)
            scanned = _scan_header(text, decoder)
            if scanned is not None:
                header, reached_cache = scanned
                if reached_cache and "kernel_name" in header and "tune_params_keys" in header:
                    return header
                if not reached_cache and "results" in header:
                    return header  # a T4 results file, refused by name (_make_header)
                return None
            if not chunk:
                raise ValueError("the file ends before its first key/value pairs are complete")
            if len(text) > max_chars:
                return None


def _load_json(path: Path) -> dict[str, Any]:
    with _open_binary(path) as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        # Kernel Tuner leaves a cache file open-ended while tuning and closes it this way when reading it.
        text = raw.decode("utf-8-sig").rstrip().rstrip(",")
        doc = json.loads(text + "}}")
    if not isinstance(doc, dict):
        raise ValueError("the file is not a JSON object")
    return doc


def _device_of(header: Mapping[str, Any], path: Path) -> tuple[str, str]:
    recorded = str(header.get("device_name") or "").strip()
    if recorded:
        return canonical_name(recorded), recorded
    # The MI250X recordings leave device_name empty: the file is named after the device.
    stem = path.name.removesuffix(".gz").removesuffix(".json")
    return canonical_name(stem), ""


def _make_header(path: Path, fields: Mapping[str, Any]) -> ReplayHeader:
    keys = fields.get("tune_params_keys")
    kernel = fields.get("kernel_name")
    if not isinstance(keys, list) or not isinstance(kernel, str) or not kernel:
        if isinstance(fields.get("results"), list) and "cache" not in fields:
            # Kernel Tuner's T4 export (cache/convert.py convert_cache_to_t4; the hub's *_T4.json.gz files).
            raise ValueError(
                "it is a T4 results file (Kernel Tuner's T4 export): it names no kernel, device or tuning "
                "parameters to replay; replay the Kernel Tuner cache file it was converted from"
            )
        raise ValueError("it has no kernel_name / tune_params_keys: not a Kernel Tuner cache file")
    tune = fields.get("tune_params")
    tune_params = {str(k): list(v) for k, v in tune.items()} if isinstance(tune, dict) else {}
    device, recorded = _device_of(fields, path)
    return ReplayHeader(
        path=path,
        device=device,
        recorded_device_name=recorded,
        kernel_name=kernel,
        problem_size=fields.get("problem_size"),
        param_keys=tuple(str(k) for k in keys),
        tune_params=tune_params,
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _times(raw: Any) -> list[float]:
    if not isinstance(raw, list):
        return []
    try:
        # Fast path for the usual all-numeric list: fsum runs in C and rejects strings and None.
        if math.isfinite(math.fsum(raw)) and not any(isinstance(t, bool) for t in raw):
            return raw
    except (TypeError, ValueError, OverflowError):  # a string; inf + -inf; a sum beyond float range
        pass
    return [float(t) for t in raw if _number(t) is not None]


def _entry(key: str, rec: Mapping[str, Any], param_keys: Sequence[str]) -> ReplayEntry:
    if all(k in rec for k in param_keys):
        params = {k: rec[k] for k in param_keys}
    else:
        params = dict(zip(param_keys, key.split(","), strict=False))
    compile_ms = _number(rec.get("compile_time"))
    verify_ms = _number(rec.get("verification_time"))
    time = rec.get("time")
    number = _number(time)
    if verify_ms is not None and verify_ms < 0:
        verify_ms = None  # a negative duration is no measurement of one (it would lower the charge)
    # A zero or negative runtime is no measurement: no usable time. Nor is one over a day: Kernel Tuner's
    # strategies record a configuration that failed or broke a restriction as 1e20 (minimize's error_time)
    # or sys.float_info.max, which replayed as a run that works and times out, charging the request's cap.
    if number is not None and 0 < number <= _MAX_RECORDED_RUN_MS:
        # Runs of zero or negative length are dropped the same way (a minimum of -5 ms, a cost below 0).
        runs = [t for t in _times(rec.get("times")) if 0 < t <= _MAX_RECORDED_RUN_MS]
        return ReplayEntry(params, number, "ok", runs or [number], None, compile_ms, verify_ms)
    failed_ms = _number(rec.get("benchmark_time"))
    failed_ms = failed_ms if failed_ms is not None and failed_ms > 0 else None
    if isinstance(time, str):
        status = _FAILURES.get(time, "launch_error")
        return ReplayEntry(params, None, status, [], time, compile_ms, verify_ms, failed_ms)
    why = f"no usable time recorded ({time!r})"
    if number is not None and number > _MAX_RECORDED_RUN_MS:
        why = (
            f"no usable time recorded ({time!r} ms, over a day: the value Kernel Tuner records for a failure)"
        )
    return ReplayEntry(
        params,
        None,
        "launch_error",
        [],
        why,
        compile_ms,
        verify_ms,
        failed_ms,
    )


def _space_from(path: Path, doc: Mapping[str, Any]) -> ReplaySpace:
    header = _make_header(path, doc)
    cache = doc.get("cache")
    if not isinstance(cache, dict):
        raise ValueError("it has no 'cache' object: not a Kernel Tuner cache file")
    keys = list(header.param_keys)
    records = [(str(k), rec) for k, rec in cache.items() if isinstance(rec, dict)]
    if records and not any("time" in rec for _, rec in records):
        # Kernel Tuner records the objective it tuned for; one that is no runtime (a hyperparameter tuning
        # "score", an energy) without "time" beside it was read as a failed run of every configuration,
        # each charged its recorded benchmark_time (minutes) as a timeout.
        objective = doc.get("objective")
        named = f"its objective is {objective!r}" if objective is not None else "it names no objective"
        raise ValueError(
            f"its entries record no 'time' ({named}): a replay answers with recorded kernel runtimes (Kernel "
            "Tuner's 'time', in ms) and this recording holds none"
        )
    # One entry per configuration as requests are matched (normalize_value): a merged file spelling one twice
    # (bx 32 and 32.0) with other times answered the later while the earlier stood as the space's best, which no
    # measurement could reach, and make-pairs paired the kernel with itself. The later wins, as for a JSON key.
    index: dict[tuple[Any, ...], ReplayEntry] = {}
    for k, rec in records:
        e = _entry(k, rec, keys)
        index[tuple(normalize_value(e.params.get(p)) for p in keys)] = e
    entries = list(index.values())
    if len(entries) < len(records):
        log.warning(
            "replay: %s records %d configuration(s) more than once (values spelt alike, such as 32 and 32.0); "
            "the later entry of each is replayed",
            path,
            len(records) - len(entries),
        )
    tune_params = dict(header.tune_params)
    if not tune_params:
        for k in keys:
            tune_params[k] = list(dict.fromkeys(e.params.get(k) for e in entries))
    valid = [e.time_ms for e in entries if e.time_ms is not None]
    return ReplaySpace(
        path=path,
        device=header.device,
        recorded_device_name=header.recorded_device_name,
        kernel_name=header.kernel_name,
        problem_size=header.problem_size,
        param_keys=keys,
        tune_params=tune_params,
        entries=entries,
        best_time_ms=min(valid) if valid else None,
        _index=index,
    )


def load_space(path: Path | str) -> ReplaySpace:
    """Parse one Kernel Tuner cache file completely. ValueError when it is not one."""
    path = Path(path)
    try:
        return _space_from(path, _load_json(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read replay recording {path}: {exc}") from exc


def read_header(path: Path | str) -> ReplayHeader:
    """The header of one cache file, streaming only its first bytes when "cache" comes last (Kernel Tuner's
    layout); otherwise by parsing the file. ValueError when it is not a cache file."""
    path = Path(path)
    try:
        fields = _read_header_fields(path)
        if fields is None:
            fields = _load_json(path)
        return _make_header(path, fields)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read replay recording {path}: {exc}") from exc


# ---------------------------------------------------------------- the measurer


@dataclass
class _Recording:
    header: ReplayHeader
    lock: threading.Lock = field(default_factory=threading.Lock)
    space: ReplaySpace | None = None
    digest: str | None = None

    def load(self) -> ReplaySpace:
        # Concurrent first uses parse once: the others wait here, in their own worker threads.
        with self.lock:
            if self.space is None:
                try:
                    space = load_space(self.header.path)
                except ValueError as exc:
                    # Its header read at start-up, its body not (truncated, damaged): every measurement of it
                    # answered the agent "Error executing tool" before. Said as what it is, nothing charged; the
                    # agent is told the file's name, the operator's log its whole path.
                    log.warning("%s", exc)
                    why = str(exc).replace(str(self.header.path), self.header.path.name)
                    raise NotMeasurable(
                        f"{why}; this server's operator must replace or remove the recording"
                    ) from exc
                space.index()  # built here, off the event loop
                # The history key names the recording by its contents (ReplayMeasurer.history_device): read
                # now, with it, so that a recording moved or deleted once parsed does not fail every compare.
                self.file_digest()
                self.space = space
            return self.space

    def file_digest(self) -> str:
        if self.digest is None:
            h = hashlib.sha256()
            with self.header.path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            self.digest = h.hexdigest()
        return self.digest

    def identifier(self) -> str:
        """What results name this recording by (`recording_id`)."""
        return recording_id(self.header.path, self.file_digest())


def recording_id(path: Path, sha256: str) -> str:
    """A recording as results name it: its file name and the start of its content's sha256
    (`A100.json.gz@sha256:1a2b3c4d5e6f7a8b`). Enough to tell which file answered and that it is the same file
    (`sha256sum`), without the operator's folders: results go to the agent, and exports leave the machine."""
    return f"{path.name}@sha256:{sha256[:16]}"


# ---------------------------------------------------------------- the project's own exports

EXPORT_FORMAT = "forecaster-mcp-measurement/1"
_MAX_RECORDED_GPU_SECONDS = 86400.0  # no recorded measurement occupies a GPU for more than a day
ExportKey = tuple[str, str, str]  # (device, kernel content key, workload key)


@dataclass(frozen=True)
class _Exported:
    path: Path
    entry: str
    result: MeasureResult
    recording: str  # recording_id of the export file


def export_line(hardware: str, workload_key: str, kernel: Kernel, result: MeasureResult) -> str:
    """One line of an export file (what `forecaster-mcp export` writes and `read_export` reads)."""
    doc = {
        "format": EXPORT_FORMAT,
        "hardware": hardware,
        "workload_key": workload_key,
        "kernel": kernel.model_dump(mode="json"),
        "result": result.model_dump(mode="json", exclude={"measurement_id"}),
    }
    return json.dumps(doc, sort_keys=False)


def _check_recorded(result: MeasureResult) -> None:
    """ValueError for values no measurement records: a cost that is not finite, negative or over a day (it
    would reach a ledger), a NaN, infinite or negative runtime (served, it would fail the call or stand as a
    measured speedup) or compile time, or statistics of no runs."""
    cost = result.cost.gpu_seconds
    if not (math.isfinite(cost) and 0.0 <= cost <= _MAX_RECORDED_GPU_SECONDS):
        raise ValueError(f"its cost is {cost} GPU-seconds")
    compile_seconds = result.cost.compile_seconds
    if not (math.isfinite(compile_seconds) and compile_seconds >= 0.0):
        raise ValueError(f"its compile time is {compile_seconds} seconds")
    stats = result.runtime_ms
    if stats is None:
        return
    if stats.runs < 1:
        raise ValueError(f"its runtime statistics are of {stats.runs} runs")
    for name, value in stats.model_dump().items():
        if name != "runs" and not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"its runtime_ms.{name} is {value}")


def read_export(path: Path | str) -> tuple[dict[ExportKey, _Exported], str]:
    """Every measurement of one export file, by exact key (a later line for the same key wins), and the
    file's sha256 (read once for both). ValueError naming the line when the file is not an export."""
    path = Path(path)
    out: dict[ExportKey, _Exported] = {}
    try:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        with io.StringIO(data.decode("utf-8"), newline=None) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
                        raise ValueError(f"not a {EXPORT_FORMAT} line")
                    kernel = Kernel.model_validate(doc["kernel"])
                    result = MeasureResult.model_validate({**doc["result"], "measurement_id": None})
                    _check_recorded(result)
                    key = (str(doc["hardware"]), kernel.content_key(), str(doc["workload_key"]))
                except (ValueError, KeyError, TypeError, ValidationError) as exc:
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    raise ValueError(f"line {number}: {first[:200]}") from exc
                out[key] = _Exported(path, kernel.entry, result, recording_id(path, digest))
    except (OSError, ValueError) as exc:  # ValueError includes UnicodeDecodeError and the lines' own
        raise ValueError(f"cannot read replay export {path}: {exc}") from exc
    if not out:
        raise ValueError(f"cannot read replay export {path}: it holds no measurements")
    return out, digest


def _runs_refusal(request: MeasureRequest, found: _Exported) -> str | None:
    """Why this request cannot be answered by `found`: it caps the timed runs below those recorded. A GPU would
    have stopped at max_runs and charged less; the export holds only the statistics of all its runs."""
    stats = found.result.runtime_ms
    if stats is None or stats.runs <= request.max_runs:
        return None
    return (
        f"kernel {request.kernel.id or 'k0'!r}: its exported measurement has {stats.runs} runs, more than "
        f"max_runs={request.max_runs}, and an export cannot replay fewer runs than it recorded; measure with "
        f"max_runs >= {stats.runs} (or without max_runs). Nothing was charged."
    )


def _exported_result(request: MeasureRequest, device: str, found: _Exported) -> MeasureResult:
    recorded = found.result
    provenance = recorded.device.model_copy(
        update={"name": device, "backend": "replay", "recording": found.recording}
    )
    kernel_id = request.kernel.id or "k0"
    if recorded.cost.gpu_seconds > request.max_seconds:
        return MeasureResult(
            kernel_id=kernel_id,
            status="timeout",
            message=f"the exported measurement took {recorded.cost.gpu_seconds:.3f} GPU-seconds, over "
            f"max_seconds={request.max_seconds:g}",
            device=provenance,
            cost=MeasureCost(gpu_seconds=request.max_seconds, compile_seconds=recorded.cost.compile_seconds),
        )
    # Only a check that was made is "checked when it was measured": an export of a replay, or of a measurement
    # without a reference, was never checked.
    checked = "checked when it was measured, " if recorded.correctness.checked else ""
    note = f"replayed from an export: {checked}not run again"
    if request.reference is not None:
        note += " (this request's reference kernel was not run)"
    detail = f"{recorded.correctness.detail}; {note}" if recorded.correctness.detail else note
    return recorded.model_copy(
        update={
            "kernel_id": kernel_id,
            "device": provenance,
            "correctness": recorded.correctness.model_copy(update={"detail": detail}),
        },
        deep=True,
    )


def _expand(paths: Sequence[Path | str]) -> Iterator[tuple[Path, bool]]:
    """(file, named explicitly) for each path; folders yield their cache files and exports, sorted."""
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = [
                p for p in path.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz", ".jsonl"))
            ]
            for p in sorted(found):
                yield p, False
        elif path.is_file():
            yield path, True
        else:
            raise OperatorError(f"replay recording not found: {path}")


def starts_like_pairs_file(path: Path) -> bool:
    """Whether the first non-blank line of `path` is a line of a pairs file for `forecaster-mcp eval` (a pair:
    baseline and candidate; or a history point), so `--replay pairs.jsonl` can say what the file is. Read only
    on the way to refusing the file. Here, not with the evaluation code that also asks it
    (forecast.evaluate.is_pairs_file): a measurer does not import that (numpy, the forecasters)."""
    try:
        with path.open("rb") as f:
            first = next((raw for raw in f if raw.strip()), b"")
        doc = json.loads(first.decode("utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and ("history" in doc or ("baseline" in doc and "candidate" in doc))


def _refuse_or_skip(exc: ValueError, explicit: bool, hint: str) -> None:
    """A file that is not a recording: an OperatorError when it was named, skipped with a warning when a
    folder held it."""
    if explicit:
        raise OperatorError(f"{exc}; {hint}") from exc
    log.warning("skipping %s", exc)


class ReplayMeasurer:
    """Answers measurements from recorded Kernel Tuner search spaces and from the project's exports
    (`--replay PATH`, file or folder; see the module doc)."""

    name = "replay"
    # A recording holds no outputs to check: a reference kernel is never run here (the service then keys and
    # charges the request as one without a reference).
    runs_references = False

    def __init__(self, paths: Sequence[Path | str]) -> None:
        recordings: dict[tuple[str, str, frozenset[str]], _Recording] = {}
        self._exported: dict[ExportKey, _Exported] = {}
        self._export_digests: dict[str, list[str]] = {}  # device -> digests of the exports that hold it
        # Recording identifier -> hash of the first kernel source replayed from it (_edited_source_note).
        self._first_source: dict[str, str] = {}
        for path, explicit in _expand(paths):
            if path.name.endswith(".jsonl"):
                try:
                    found, digest = read_export(path)
                except ValueError as exc:
                    why = exc
                    if starts_like_pairs_file(path):
                        why = ValueError(
                            f"{path} is not a replay export: it looks like a pairs file for `forecaster-mcp "
                            "eval` (make-pairs writes them; its first line is a pair or a history point, not "
                            f"a {EXPORT_FORMAT} measurement), which `forecaster-mcp eval {path}` scores the "
                            "forecaster on"
                        )
                    _refuse_or_skip(
                        why,
                        explicit,
                        "--replay takes a Kernel Tuner cache file (.json or .json.gz) or a file "
                        "`forecaster-mcp export` wrote",
                    )
                    continue
                self._exported.update(found)
                for device in dict.fromkeys(k[0] for k in found):
                    # Once per content: an export named twice (a file and its folder) keeps the fingerprint.
                    if digest not in self._export_digests.setdefault(device, []):
                        self._export_digests[device].append(digest)
                continue
            try:
                header = read_header(path)
            except ValueError as exc:
                _refuse_or_skip(exc, explicit, "pass a Kernel Tuner cache file (.json or .json.gz)")
                continue
            key = (header.device, header.kernel_name, frozenset(header.param_keys))
            if key in recordings:
                log.warning(
                    "replay: %s replaces %s for %s on %s (same tuning parameters; the later file wins)",
                    path,
                    recordings[key].header.path,
                    header.kernel_name,
                    header.device,
                )
                del recordings[key]
            recordings[key] = _Recording(header)
        if not recordings and not self._exported:
            raise OperatorError(
                f"no Kernel Tuner cache files or exports found in {', '.join(str(p) for p in paths)}"
            )
        self._recordings = list(recordings.values())

    # ---- listing (cheap: headers only)

    def devices(self) -> list[str]:
        return list(
            dict.fromkeys([*(r.header.device for r in self._recordings), *(k[0] for k in self._exported)])
        )

    def unnamed_devices(self) -> list[str]:
        """Devices of recordings that name no GPU: device_name empty and a file name that is no known GPU (a
        copy renamed `unseen.json.gz`). Whatever GPU a caller names is taken to be such a device (service)."""
        return list(
            dict.fromkeys(
                r.header.device
                for r in self._recordings
                if not r.header.recorded_device_name and lookup(r.header.device) is None
            )
        )

    def headers(self) -> list[ReplayHeader]:
        return [r.header for r in self._recordings]

    def kernels(self, device: str) -> list[str]:
        resolved = self._device_or_none(device)
        recorded = [r.header.kernel_name for r in self._recordings if r.header.device == resolved]
        exported = [e.entry for k, e in self._exported.items() if k[0] == resolved]
        return list(dict.fromkeys([*recorded, *exported]))

    def spaces(self) -> list[ReplaySpace]:
        """Every recorded space, fully parsed (blocking; about 0.1-0.3 s per large file on first call)."""
        return [r.load() for r in self._recordings]

    async def preload(self) -> None:
        """Parse every recording in a worker thread, so no later call waits for a parse."""
        import anyio.to_thread

        unreadable = []
        for r in self._recordings:
            try:
                await anyio.to_thread.run_sync(r.load)
            except NotMeasurable as exc:  # the others are still worth parsing now
                unreadable.append(str(exc))
        if unreadable:
            raise NotMeasurable("; ".join(unreadable))

    def cannot_measure(self, kernel: Kernel, workload: Workload, device: str) -> str | None:
        """Why `measure` would refuse `kernel` on `workload` and `device`, or None when it would not or that
        cannot be told without loading a recording. compare_kernels leaves such candidates out of
        `measure_next`: a combination of recorded values the tuner never ran stayed at its head call after
        call, and a client that measures the head never moved on (the refusal charges nothing)."""
        resolved = self._device_or_none(device)
        if resolved is None:
            return None  # not this measurer's device: the service picked another
        try:
            if self._export_for(kernel, workload.key(), resolved) is not None:
                return None
            rec = self._recording(resolved, kernel)
        except NotMeasurable as exc:
            return str(exc)
        if (why := _contradiction(kernel, workload, rec.header, resolved)) is not None:
            return why
        space = rec.space
        if space is None or space.find(kernel.defines) is not None:
            return None
        return self._values_message(resolved, kernel, space)

    # ---- resolution and refusals

    def _device_or_none(self, device: str) -> str | None:
        known = self.devices()
        if device in known:
            return device
        canonical = canonical_name(device)
        if canonical in known:
            return canonical
        folded = device.strip().lower()
        for d in known:
            if d.lower() == folded:
                return d
        return None

    def _device(self, device: str) -> str:
        resolved = self._device_or_none(device)
        if resolved is None:
            raise NotMeasurable(
                f"no replay recording for device {device!r}. Recorded devices: {', '.join(self.devices())}. "
                "Measure on one of these, or ask compare_kernels for a forecast (free) instead."
            )
        return resolved

    def _export_of(self, request: MeasureRequest, device: str) -> _Exported | None:
        """The exported measurement of exactly this kernel and workload on `device`; NotMeasurable when the
        device has only exports and this is not among them."""
        return self._export_for(request.kernel, request.workload.key(), device)

    def _export_for(self, kernel: Kernel, workload_key: str, device: str) -> _Exported | None:
        found = self._exported.get((device, kernel.content_key(), workload_key))
        if found is None and not any(r.header.device == device for r in self._recordings):
            entries = [e.entry for k, e in self._exported.items() if k[0] == device]
            same = sum(e == kernel.entry for e in entries)
            raise NotMeasurable(
                f"kernel {kernel.id or 'k0'!r} is not among the exported measurements on {device}: an "
                "export replays a kernel only with the source, entry, defines, launch, compile options and "
                "workload it was measured with "
                f"({same} of the {len(entries)} exported there have entry {kernel.entry[:80]!r}). "
                "Forecast it with compare_kernels (free) instead."
            )
        return found

    def _recording(self, device: str, kernel: Kernel) -> _Recording:
        mine = [r for r in self._recordings if r.header.device == device]
        same_kernel = [r for r in mine if r.header.kernel_name == kernel.entry]
        if not same_kernel:
            names = ", ".join(dict.fromkeys(r.header.kernel_name for r in mine))
            raise NotMeasurable(
                f"kernel entry {kernel.entry!r} is not recorded on {device}. Recorded kernels on {device}: "
                f"{names}. Replay matches kernel.entry to the recording's kernel_name; other kernels can "
                "only be forecast here."
            )
        given = set(kernel.defines)
        for r in same_kernel:
            if set(r.header.param_keys) == given:
                return r
        raise NotMeasurable(self._keys_message(device, kernel, same_kernel))

    @staticmethod
    def _keys_message(device: str, kernel: Kernel, candidates: Sequence[_Recording]) -> str:
        given = set(kernel.defines)
        best = min(candidates, key=lambda r: len(given ^ set(r.header.param_keys)))
        expected = list(best.header.param_keys)
        missing = [k for k in expected if k not in given]
        extra = sorted(given - set(expected))
        parts = [
            f"{kernel.entry} on {device} is recorded with defines = exactly its tuning parameters "
            f"{', '.join(expected)}."
        ]
        if missing:
            parts.append(f"Missing: {', '.join(missing)}.")
        if extra:
            parts.append(f"Not tuning parameters of this recording (remove them): {', '.join(extra)}.")
        if len(candidates) > 1:
            others = "; ".join(", ".join(r.header.param_keys) for r in candidates if r is not best)
            parts.append(f"Other recordings of this kernel on {device} take: {others}.")
        allowed = "; ".join(
            f"{k}: {_fmt_values(best.header.tune_params[k])}"
            for k in expected
            if k in best.header.tune_params
        )
        if allowed:
            parts.append(f"Allowed values: {allowed}.")
        return " ".join(parts)

    @staticmethod
    def _values_message(device: str, kernel: Kernel, space: ReplaySpace) -> str:
        bad = []
        for k in space.param_keys:
            allowed = {normalize_value(v) for v in space.tune_params.get(k, [])}
            if allowed and normalize_value(kernel.defines[k]) not in allowed:
                bad.append(f"{k}={_fmt(kernel.defines[k])} (allowed: {_fmt_values(space.tune_params[k])})")
        if bad:
            return (
                f"{kernel.entry} on {device}: these values are not in the recorded space: {'; '.join(bad)}. "
                "Pick recorded values, or ask compare_kernels for a forecast (free) instead."
            )
        wanted = space.key(kernel.defines) or ()
        nearest = min(
            space.entries,
            key=lambda e: (
                sum(
                    normalize_value(e.params.get(k)) != w
                    for k, w in zip(space.param_keys, wanted, strict=True)
                ),
                not e.ok,
            ),
            default=None,
        )
        hint = ""
        if nearest is not None:
            hint = (
                " The closest recorded configuration is "
                + ", ".join(f"{k}={_fmt(nearest.params.get(k))}" for k in space.param_keys)
                + "."
            )
        return (
            f"{kernel.entry} on {device}: every value is in the space, but this combination was not recorded "
            f"(the tuner's restrictions excluded it).{hint}"
        )

    # ---- the Measurer protocol

    def device_fingerprint(self, device: str) -> str:
        resolved = self._device(device)
        digests = sorted(
            [
                *(r.file_digest() for r in self._recordings if r.header.device == resolved),
                *self._export_digests.get(resolved, []),
            ]
        )
        combined = hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]
        return f"replay:{resolved}:{combined}"

    def history_device(self, device: str) -> str:
        """What the store files `device`'s measurements, forecasts and calibration under: the device and its
        recordings (as the fingerprint), so that neither a real GPU of the same name nor a replay of other
        recordings of it is answered or taught by these replayed times, nor these by theirs."""
        return f"{self._device(device)}{REPLAY_HISTORY_MARK} {self.device_fingerprint(device).rsplit(':', 1)[1]})"

    def cache_request(self, request: MeasureRequest) -> MeasureRequest:
        """The request whose stored results answer `request` (the service keys its cache by its kernel and
        workload), so that spellings one recorded entry answers alike are one measurement, charged once:
        - for a kernel a recording answers, its defines in the values the recording matches them by
          (normalize_value): block_size_x = 32, 32.0, "32.0" and "0x20";
        - and a workload that gets the very answer no workload gets (no args, and no problem or exactly the
          recorded sizes under any names, in any order, with sizes of 1 or labels beside them) as the empty
          workload: {width: 4096, height: 4096}, {height: 4096, width: 4096} and none (`_keyed_workload`).
        Any other workload (one the result's message tells apart, or that the recording refuses), and a kernel
        an export answers (it matches exactly) or none does, as they are."""
        rec = self._recording_answering(request)
        if rec is None:
            return request
        kernel = request.kernel.model_copy(
            update={"defines": {k: normalize_value(v) for k, v in request.kernel.defines.items()}}
        )
        return dataclasses.replace(
            request, kernel=kernel, workload=self._keyed_workload(rec, request.workload)
        )

    @staticmethod
    def _keyed_workload(rec: _Recording, workload: Workload) -> Workload:
        if workload.args:
            return workload
        if workload.problem:
            recorded = _recorded_sizes(rec.header)
            if recorded is None or _given_sizes(workload) != recorded:
                return workload
        # model_copy keeps the workload's ledger scope (Workload.scoped), which its history key carries.
        return workload.model_copy(update={"problem": {}, "name": None})

    def _recording_answering(self, request: MeasureRequest) -> _Recording | None:
        """The recording that holds `request`'s kernel on its device; None when an export answers it (an
        export matches exactly) or nothing does."""
        try:
            device = self._device(request.device)
            if self._export_of(request, device) is not None:
                return None
            return self._recording(device, request.kernel)
        except NotMeasurable:
            return None

    def reservation_seconds(self, request: MeasureRequest) -> float:
        """The exact charge of the recorded entry (parsing its file here on first use, so the hold is never
        short), or the smallest hold when the recording will refuse the request (a refusal charges nothing):
        a hold of up to 1 GPU-s there turned the recording's refusal into "the ledger has 0.5 left, this
        measurement needs up to 1" on a nearly spent ledger, and stopped measure_if_unsure at that candidate."""
        fallback = _MIN_RESERVATION_SECONDS
        try:
            device = self._device(request.device)
            exported = self._export_of(request, device)
            if exported is not None:
                if _runs_refusal(request, exported) is not None:
                    return fallback
                return max(
                    min(exported.result.cost.gpu_seconds, request.max_seconds), _MIN_RESERVATION_SECONDS
                )
            rec = self._recording(device, request.kernel)
        except NotMeasurable:
            return fallback
        if _contradiction(request.kernel, request.workload, rec.header, device) is not None:
            return fallback
        entry = rec.load().find(request.kernel.defines)
        if entry is None:
            return fallback
        return max(recorded_charge(entry, request).gpu_seconds, _MIN_RESERVATION_SECONDS)

    async def measure(
        self, request: MeasureRequest, progress: ProgressCallback | None = None
    ) -> MeasureResult:
        device = self._device(request.device)
        exported = self._export_of(request, device)
        if exported is not None:
            refusal = _runs_refusal(request, exported)
            if refusal is not None:
                raise NotMeasurable(refusal)
            if progress is not None:
                await progress(1.0, 1.0, f"replayed from {exported.path.name}")
            return _exported_result(request, device, exported)
        rec = self._recording(device, request.kernel)
        refusal = _contradiction(request.kernel, request.workload, rec.header, device)
        if refusal is not None:
            raise NotMeasurable(refusal)
        space = rec.space
        if space is None:
            import anyio.to_thread

            if progress is not None:
                await progress(0.0, 1.0, f"loading recording {rec.header.path.name}")
            space = await anyio.to_thread.run_sync(rec.load)
        entry = space.find(request.kernel.defines)
        if entry is None:
            raise NotMeasurable(self._values_message(device, request.kernel, space))
        result = _result(request, device, rec.identifier(), entry)
        for note in (
            _unchecked_note(request.kernel, request.workload, rec.header),
            self._edited_source_note(rec, request.kernel),
        ):
            if note is not None:
                result.message = f"{result.message}; {note}" if result.message else note
        if progress is not None:
            await progress(1.0, 1.0, f"replayed from {rec.header.path.name}")
        return result

    def _edited_source_note(self, rec: _Recording, kernel: Kernel) -> str | None:
        """A Kernel Tuner recording holds one kernel's times, matched by entry and tuning parameters only (it holds
        no source): a source other than the first this measurer replayed from it (an agent's edit of the kernel)
        is answered with the recorded kernel's time all the same. Said, so that the edit is not taken as timed."""
        digest = hashlib.sha256(kernel.source.encode("utf-8", "surrogatepass")).hexdigest()
        if self._first_source.setdefault(rec.identifier(), digest) == digest:
            return None
        return (
            f"this kernel's source differs from the first one replayed from {rec.header.path.name} by this "
            "server: a recording holds one kernel's times, matched by entry and tuning parameters only, so the "
            "time replayed is the recorded kernel's, not this source's"
        )


@dataclass(frozen=True)
class _Charge:
    status: Literal["ok", "compile_error", "launch_error", "timeout"]
    times: list[float]
    gpu_seconds: float
    flags: tuple[str, ...]
    message: str | None


_FAILURE_WORDS = {
    "CompilationFailedConfig": "fails to compile",
    "RuntimeFailedConfig": "fails at run time",
    "InvalidConfig": "is invalid (it breaks a restriction of the space)",
}


def _failure_message(entry: ReplayEntry) -> str:
    """What a recorded failure says, in words, with the recording's own label."""
    label = entry.message or "no label"
    words = _FAILURE_WORDS.get(label)
    if words is None:
        return f"the recording has no runtime for this configuration: {label}"
    return f"the recording marks this configuration as one that {words} (Kernel Tuner {label})"


def recorded_charge(entry: ReplayEntry, request: MeasureRequest) -> _Charge:
    """What replaying `entry` under the request's caps uses and charges (also what search.ToolEmulator charges)."""
    if not entry.ok:
        # Charged like any run (a failing kernel is a result, not a free probe): the device time recorded for
        # the attempt, within the request's cap; nothing when none was recorded (a compile error, which never
        # reached the device, records 0).
        attempt_ms = entry.failed_device_ms or 0.0
        if attempt_ms > request.max_seconds * 1000.0:
            # An attempt longer than the cap (the A6000 convolution's RuntimeFailedConfig entries of 5-12 s)
            # is stopped at the cap on a GPU, a timeout, before its failure could show, as a run that worked is.
            return _Charge(
                "timeout",
                [],
                request.max_seconds,
                (),
                f"the recorded attempt at this configuration occupied the device for {attempt_ms:.3f} ms, "
                f"over max_seconds={request.max_seconds:g}",
            )
        return _Charge(entry.status, [], attempt_ms / 1000.0, (), _failure_message(entry))
    cap_ms = request.max_seconds * 1000.0
    spent = entry.verification_time_ms or 0.0
    used: list[float] = []
    flags: list[str] = []
    for i, t in enumerate(entry.times):
        if i >= max(request.max_runs, 1):
            flags.append("runs_capped_by_max_runs")
            break
        if spent + t > cap_ms:
            if not used:
                return _Charge(
                    "timeout",
                    [],
                    request.max_seconds,
                    (),
                    f"a recorded run takes {t:.3f} ms (plus {spent:.1f} ms verification), "
                    f"over max_seconds={request.max_seconds:g}",
                )
            flags.append("runs_capped_by_max_seconds")
            break
        used.append(t)
        spent += t
    if not median_ci_covers(len(used)):
        flags.append("too_few_runs_for_interval")
    return _Charge("ok", used, spent / 1000.0, tuple(flags), None)


def _result(request: MeasureRequest, device: str, recording: str, entry: ReplayEntry) -> MeasureResult:
    charge = recorded_charge(entry, request)
    spec = lookup(device)
    compile_seconds = (entry.compile_time_ms or 0.0) / 1000.0
    detail = "replay of a recording: outputs were not re-checked"
    if request.reference is not None:
        detail += " (a reference kernel cannot be run against a recording)"
    return MeasureResult(
        kernel_id=request.kernel.id or "k0",
        status=charge.status,
        message=charge.message,
        runtime_ms=runtime_stats(charge.times) if charge.times else None,
        correctness=Correctness(checked=False, detail=detail),
        device=DeviceProvenance(
            name=device,
            backend="replay",
            compute_capability=spec.compute_capability if spec is not None else None,
            recording=recording,
        ),
        cost=MeasureCost(gpu_seconds=charge.gpu_seconds, compile_seconds=compile_seconds),
        flags=list(charge.flags),
    )
