"""The one SQLite database (aiosqlite, WAL): ledgers, events, tokens, measurements, forecasts.

This module owns every SQL string in the package (the schema lives in `migrations.py`).

INTERFACE CONTRACT (signatures fixed; bodies are the store work). All methods are coroutines and safe to call
from many coroutines at once (one connection, an asyncio.Lock around each transaction) and from several
processes on one database file (BEGIN IMMEDIATE for every write transaction, busy_timeout).

Money is stored as integer micro-GPU-seconds so ledgers balance exactly; the API speaks float GPU-seconds.
Every transaction runs in its own task shielded from the caller's cancellation: a cancelled caller never
leaves the connection mid-transaction, and a reservation whose caller was cancelled is released again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import socket
import sqlite3
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiosqlite

from forecaster_mcp import bins
from forecaster_mcp.errors import (
    BUDGET_EXHAUSTED_TEXT,
    AlreadyMeasured,
    BudgetExhausted,
    InvalidRequest,
    MeasurementInProgress,
    OperatorError,
    SameMeasurementRunning,
    UnknownLedger,
)
from forecaster_mcp.models import (
    COMPILE_INTERRUPTED,
    INPUTS_UNFINISHED,
    MIN_MEASURE_SECONDS,
    SUSPECT_FLAGS,
    MeasureResult,
)
from forecaster_mcp.store.migrations import NOT_SAVED_COMMITS, RESULT_NOT_SAVED, migrate, refuse_newer

log = logging.getLogger(__name__)

T = TypeVar("T")

MICRO = 1_000_000
MAX_GPU_SECONDS = (
    1e12  # ~31,000 GPU-years: far above any real budget, far below int64 overflow in micro units
)
BUSY_TIMEOUT_S = 30.0
# Below this much free space on the database's filesystem, every write is followed by a checkpoint (`_locked`):
# SQLite's own comes at 1000 pages of write-ahead log (about 4 MB), and a log that filled the disk before it
# could never be checkpointed again (the checkpoint must grow the database, on a disk with no byte left).
LOW_DISK_BYTES = 64 * 1024 * 1024
TOKEN_PREFIX = "fmcp_"
FINGERPRINT_CHARS = 12
_LEDGER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}")  # fullmatch: `$` takes a final newline
# A live process's measurement may wait in a queue before it runs, so expiry is generous and only applies
# to owners whose liveness cannot be checked (another host or PID namespace, no /proc).
EXPIRY_FACTOR = 2.0
EXPIRY_GRACE_S = 300.0
# Statuses that say something about the infrastructure rather than the kernel: never served from cache.
# out_of_memory depends on what else holds the GPU's memory at the time (transient).
_NOT_CACHEABLE = ("worker_crashed", "timeout", "out_of_memory")
NOT_CACHEABLE = frozenset(_NOT_CACHEABLE)  # for callers: a result with one of these says nothing final
# Statuses that say nothing about the configuration itself: family models do not learn them as failures.
# (A timeout is learned: a configuration that runs past its cap is one a search should not propose again.)
_NOT_A_POINT = ("out_of_memory", "worker_crashed")
NOT_A_POINT = frozenset(_NOT_A_POINT)  # for callers keeping family points (evaluate.MemoryHistory)
# ... nor a timeout under a cap below the server's (a caller's max_seconds, or a nearly spent ledger's): the
# kernel may well run in the time the server allows, and one ledger's cap must not mark it failed for all.
TIMEOUT_UNDER_LOWERED_CAP = "timeout_under_lowered_cap"
# ... nor a failure of the reference kernel the caller checked it against (its fault, not this kernel's).
REFERENCE_FAILED = "reference_failed"
# A row that is ok, or whose failure was the kernel's own (none of these flags): what is learned and answered from.
# (COMPILE_INTERRUPTED: the compiler, not the kernel, ran out of time or was killed; INPUTS_UNFINISHED: the time
# ran out while the workload's inputs were made, before the kernel ran.)
NOT_THE_KERNELS = (TIMEOUT_UNDER_LOWERED_CAP, REFERENCE_FAILED, COMPILE_INTERRUPTED, INPUTS_UNFINISHED)
_KERNELS_OWN = (
    "(status = 'ok' OR NOT EXISTS (SELECT 1 FROM json_each(result_json, '$.flags') "
    f"WHERE value IN ({', '.join(repr(flag) for flag in NOT_THE_KERNELS)})))"
)
_PLACES = ", ".join("?" for _ in _NOT_CACHEABLE)
# Whether the measurement row {row} carries a flag saying its runtime may not be the kernel's work
# (models.SUSPECT_FLAGS). The latest ok measurement of a kernel is its runtime, as compare answers from it
# (Store.measured_runtime); when it has such a flag, the kernel has no runtime to learn or verify from, also
# when an earlier one had none, until a later measurement without them.
# (The text search first: parsing each latest row's result for its flags made verified_pairs of 3,000 forecasts
# take about twice as long, 100 -> 240 ms.)
_SUSPECT = (
    f"(({' OR '.join(f'instr({{row}}.result_json, {flag!r}) > 0' for flag in sorted(SUSPECT_FLAGS))}) "
    "AND EXISTS (SELECT 1 FROM json_each({row}.result_json, '$.flags') "
    f"WHERE value IN ({', '.join(repr(flag) for flag in sorted(SUSPECT_FLAGS))})))"
)


@dataclass(frozen=True)
class LedgerView:
    name: str
    limit_gpu_seconds: float
    spent_gpu_seconds: float
    reserved_gpu_seconds: float

    @property
    def remaining_gpu_seconds(self) -> float:
        """In whole micro-seconds, as the ledger keeps them: 0.3 - 0.1 - 0.2 in floats is -2.8e-17."""
        micro = round(self.limit_gpu_seconds * MICRO) - round(self.spent_gpu_seconds * MICRO)
        return _gs(micro - round(self.reserved_gpu_seconds * MICRO))


@dataclass(frozen=True)
class Reservation:
    id: int
    ledger: str
    gpu_seconds: float
    # Committed for a run whose result could not be stored (ResultNotSaved): its commit event says so
    # (RESULT_NOT_SAVED), and budget_status counts the charge as not saved rather than as cancelled.
    result_not_saved: bool = False


@dataclass(frozen=True)
class FamilyPoint:
    """One stored measurement of a kernel family member (for the online model)."""

    defines: dict[str, Any]
    launch: dict[str, Any] | None
    status: str
    runtime_ms: float | None  # median, None when status != ok
    content_key: str
    compile_options: tuple[str, ...] = ()  # the kernel's nvcc flags (they change the binary, not the family)


@dataclass(frozen=True)
class AnchorPoint:
    """A kernel measured running on a workload and GPU, the latest of its family (`Store.workload_anchors`)."""

    kernel_json: str
    family_key: str
    content_key: str
    runtime_ms: float  # median
    resources: dict[str, Any] | None  # MeasureResult.resources (registers, shared memory), when reported


@dataclass(frozen=True)
class VerifiedPair:
    """A stored forecast later checked by measurements of both kernels."""

    forecaster: str
    hardware: str
    probs: list[float]
    p_faster: float
    actual_speedup: float
    verdict: str
    created_at: float
    family_key: str | None = None  # the candidate's kernel family (None for rows stored before it was kept)
    pair: str | None = None  # workload, baseline and candidate keys: the question this row answered
    # 'candidate' / 'baseline': verified by that kernel failing for good while the other ran (actual_speedup
    # is then FAILED_CANDIDATE_SPEEDUP / FAILED_BASELINE_SPEEDUP); None: both ran.
    failure: str | None = None
    # The measurement that settled the pair (the later of the two kernels' measurements). One measurement
    # settles every pair its kernel was forecast in at once, and they are right or wrong together: thresholds
    # are certified on one pair per measurement (engine), never on its copies.
    verified_by: int | None = None
    row_id: int | None = None  # the forecast row (verified pairs are ordered by it)
    # A final forecast's chances of its candidate and baseline failing as its verdict weighed them (ForecastRow);
    # None on component rows and rows stored before they were kept.
    p_fail: float | None = None
    p_fail_baseline: float | None = None
    # A component row's cap on its own confidence (base.MAX_CONFIDENCE, ForecastRow); None: it set none, a final
    # row, or stored before caps were kept.
    max_confidence: float | None = None


# The pair a verified row belongs to, as verified_pairs groups rows: (forecaster, hardware, workload_key, the
# lesser and the greater of the two kernel keys).
PairGroup = tuple[str, str, str, str, str]


@dataclass(frozen=True)
class VerifiedChanges:
    """What changed among the verified pairs since sequence number `since` (Store.verified_changes)."""

    seq: int  # pass it as `since` next time
    groups: list[PairGroup]  # every pair touched since `since` (all of them on a full read)
    pairs: list[
        tuple[PairGroup, VerifiedPair]
    ]  # the verified pair of each of those that has one now, by row id
    full: bool  # a full read: `pairs` is every verified pair


@dataclass(frozen=True)
class IdempotentRequest:
    """What the measurement stored under an idempotency key measured (to refuse a key reused for another)."""

    measurement_id: int
    kernel_id: str | None
    content_key: str  # Kernel.content_key()
    workload_key: str
    hardware: str
    result: MeasureResult  # as first saved, with measurement_id set
    check_key: str | None = None  # what its outputs were checked against (None: saved before it was kept)


@dataclass(frozen=True)
class KeyClaim:
    """This request's hold on an idempotency key (`Store.claim_key`), until it is answered or given up."""

    id: int
    ledger: str
    idempotency_key: str


@dataclass(frozen=True)
class KeyTaken:
    """Another request, still running (possibly in another process), holds the key: `request` is what it was
    claimed for (the `request` given to `Store.claim_key`)."""

    request: dict[str, str]


@dataclass(frozen=True)
class ForecastRow:
    ledger: str | None
    forecaster: str
    hardware: str
    workload_key: str
    baseline_key: str  # Kernel.content_key()
    candidate_key: str
    probs: list[float]
    p_faster: float
    verdict: Literal["faster", "slower", "unsure"]
    decided_by: Literal["forecast", "measurement", "cache"]
    family_key: str | None = None  # the candidate's Kernel.family_key()
    # A final forecast's chances of the candidate and the baseline failing (selective.decision_p weighed them
    # into p_faster): kept so the forecast can be scored again under another calibration. None on raw rows.
    p_fail: float | None = None
    p_fail_baseline: float | None = None
    # A component's raw row: the cap its answer set on its own confidence (EngineForecast.caps), which the
    # engine holds the answer to when scoring it again. None: no cap (and on final rows).
    max_confidence: float | None = None


# The measurements of one family on one GPU and workload (parameters: family_key, hardware, workload_key),
# each numbered per kernel: rn = 1 is the latest ok measurement if there is one, else the latest of any status.
# family_points and best_runtime read the same rows, so the model and measure_next's best agree. A kernel whose
# rn = 1 row is suspect (_SUSPECT) is no point at all: a fake 0.001 ms of a kernel that skipped its work would
# teach the model that its configuration is thousands of times faster.
# The most families of one workload Store.workload_anchors reads (an agent's kernels of one problem are dozens).
ANCHOR_MAX_FAMILIES = 1000
_FAMILY_LATEST = (
    "(SELECT * FROM (SELECT id, defines_json, launch_json, status, runtime_ms, content_key, result_json, "
    "json_extract(kernel_json, '$.compile_options') AS compile_options, row_number() OVER "
    "(PARTITION BY content_key ORDER BY (status = 'ok') DESC, id DESC) AS rn "
    "FROM measurements WHERE family_key = ? AND hardware = ? AND workload_key = ? "
    f"AND status NOT IN ({', '.join(repr(s) for s in _NOT_A_POINT)}) "
    f"AND {_KERNELS_OWN}) AS latest WHERE rn = 1 AND NOT (status = 'ok' AND {_SUSPECT.format(row='latest')}))"
)


# ---------------------------------------------------------------------------- money and names


def to_micro(gpu_seconds: float, what: str, error: type[Exception], *, allow_zero: bool) -> int:
    """Validate an amount of GPU-seconds and convert it to integer micro-GPU-seconds."""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(gpu_seconds, bool) or not isinstance(gpu_seconds, int | float):
        raise error(f"{what} must be a number of GPU-seconds {bound}, got {gpu_seconds!r}")
    value = float(gpu_seconds)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise error(f"{what} must be a finite number of GPU-seconds {bound}, got {gpu_seconds!r}")
    if value > MAX_GPU_SECONDS:
        raise error(f"{what} of {value:g} GPU-seconds is over the {MAX_GPU_SECONDS:g} limit")
    if error is OperatorError and 0 < value < 1 / MICRO:
        # A ledger's amounts are kept in micro-GPU-seconds: 1e-9 would be a limit of 0, 1e-300 a top-up of 1e-6.
        raise error(f"{what} of {value:g} GPU-seconds is below the smallest amount kept (0.000001)")
    micro = round(value * MICRO)
    # A positive amount below a micro-GPU-second still holds something (never a free reservation).
    return max(micro, 0 if allow_zero else 1)


def _charge_micro(actual_gpu_seconds: float) -> int:
    """Device time to charge, in micro GPU-seconds: a negative one is 0, a NaN or infinite one the most a hold
    can be (so it charges the whole hold), and device time however short is never charged as nothing."""
    actual = float(actual_gpu_seconds)
    if not math.isfinite(actual):
        return round(MAX_GPU_SECONDS * MICRO)
    micro = round(min(max(actual, 0.0), MAX_GPU_SECONDS) * MICRO)
    return 1 if actual > 0.0 and micro == 0 else micro


def _gs(micro: int) -> float:
    return micro / MICRO


def fmt_gpu_seconds(value: float) -> str:
    """Short human form of an amount: at most 6 decimals, no trailing zeros (3.2, 10, 0.000001)."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def check_ledger_name(name: object, what: str = "ledger name") -> None:
    """OperatorError unless `name` is a name a ledger may have (`ledger create` enforces it)."""
    if not isinstance(name, str) or not _LEDGER_NAME.fullmatch(name):
        raise OperatorError(
            f"{what} {str(name)[:80]!r} is not allowed: use 1 to 128 letters, digits "
            "and _ . : @ + - (starting with a letter or digit)"
        )


def _unknown_ledger(name: str) -> UnknownLedger:
    return UnknownLedger(
        f"ledger {name[:80]!r} does not exist; the operator creates it with: "
        f"forecaster-mcp ledger create {shlex.quote(name[:128])} --gpu-seconds N"
    )


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _view(row: Any) -> LedgerView:
    return LedgerView(
        name=str(row[0]),
        limit_gpu_seconds=_gs(int(row[1])),
        spent_gpu_seconds=_gs(int(row[2])),
        reserved_gpu_seconds=_gs(int(row[3])),
    )


def _result_from_row(row_id: Any, result_json: Any) -> MeasureResult:
    result = MeasureResult.model_validate_json(str(result_json))
    return result.model_copy(update={"measurement_id": int(row_id)})


# ---------------------------------------------------------------------------- process identity

_PROC = Path("/proc")


def _read_boot_id() -> str | None:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _read_pidns() -> str | None:
    try:
        return os.readlink(_PROC / "self/ns/pid")
    except OSError:
        return None


_GONE = "gone"  # _start_ticks: /proc says no such live process (and kill(pid, 0) agrees)


def _start_ticks(pid: int) -> str | None:
    """The start time (clock ticks since boot) of live process `pid`; _GONE when it has surely exited (a
    zombie, or no such pid); None when this process cannot tell (/proc hidden with hidepid, unreadable, or
    absent: an entry that cannot be read is never taken for a dead process)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        # hidepid=invisible shows another user's live process as no entry at all: ask the kernel directly.
        if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT on Windows
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return _GONE
        except OSError:
            return None
        return None
    # Field 2 (comm) may hold spaces and parentheses: split after the last ')'. rest[0] is field 3.
    rest = text[text.rfind(")") + 2 :].split()
    if len(rest) >= 1 and rest[0] in ("Z", "X"):  # a zombie is dead for our purposes
        return _GONE
    return rest[19] if len(rest) >= 20 else None  # field 22


def _proc_start(pid: int, boot_id: str | None) -> str | None:
    """'<boot id>:<start ticks>' of a live process, None when it cannot be read ('?' for an unreadable boot)."""
    ticks = _start_ticks(pid)
    return None if ticks is None or ticks == _GONE else f"{boot_id or '?'}:{ticks}"


@dataclass(frozen=True)
class _Owner:
    """Who holds a reservation: enough to tell later whether that process is still alive."""

    pid: int
    host: str
    pidns: str | None
    start: str | None  # None where /proc is unavailable

    @classmethod
    def current(cls) -> _Owner:
        pid = os.getpid()
        return cls(
            pid=pid, host=socket.gethostname(), pidns=_read_pidns(), start=_proc_start(pid, _read_boot_id())
        )


# ---------------------------------------------------------------------------- owner locks
#
# Each process with a store open holds an exclusive flock on a file of its own in the state folder's owners/
# (named by its identity, as reservations record it). The kernel drops the lock when the process dies, in any
# PID namespace: a server restarted in a fresh container (a new PID namespace, where pids say nothing of the
# old one) can tell that its predecessor's holds are orphans instead of waiting for their expiry (2 x cap +
# 300 s). Trusted only between processes of one kernel (the same boot id): flock over a network filesystem may
# be local to each host.

_OWNER_LOCKS: dict[str, tuple[int, int]] = {}  # path -> (fd, stores of this process holding it)


def _owner_lock_name(pid: int, host: str, pidns: str | None, start: str | None) -> str:
    identity = f"{host}|{pidns}|{pid}|{start}"
    return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".lock"


def _take_owner_lock(folder: Path, owner: _Owner) -> str | None:
    """Hold this process's owner lock (shared by its stores); the lock file's path, None where it cannot be."""
    try:
        import fcntl
    except ImportError:  # Windows: pids and expiry only
        return None
    path = str(folder / _owner_lock_name(owner.pid, owner.host, owner.pidns, owner.start))
    held = _OWNER_LOCKS.get(path)
    if held is not None:
        _OWNER_LOCKS[path] = (held[0], held[1] + 1)
        return path
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.debug("no owner lock in %s: %s", folder, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        log.debug("owner lock %s not taken: %s", path, exc)
        return None
    _OWNER_LOCKS[path] = (fd, 1)
    return path


_OWNER_LOCKS_KEPT: set[str] = set()  # lock files a closed store of this process left an open hold under


def _drop_owner_lock(path: str | None, *, holds_left: bool = True) -> None:
    """Let go of this process's owner lock (once its last store closes). The file is removed when no store
    of this process left an open hold under it: only a checker of such a hold reads it, and one file per
    process ever started (each CLI command, each stdio session) piled up in owners/ for good."""
    held = _OWNER_LOCKS.get(path) if path is not None else None
    if path is None or held is None:
        return
    if holds_left:
        _OWNER_LOCKS_KEPT.add(path)
    fd, count = held
    if count > 1:
        _OWNER_LOCKS[path] = (fd, count - 1)
        return
    del _OWNER_LOCKS[path]
    if path not in _OWNER_LOCKS_KEPT:
        # Removed while still locked: a checker that opened it already sees it held until the close below.
        with contextlib.suppress(OSError):
            os.unlink(path)
    _OWNER_LOCKS_KEPT.discard(path)
    os.close(fd)  # the lock goes with the descriptor; a kept file stays for checkers to find unlocked


def _lock_says(folder: Path | None, pid: int, host: str, pidns: str | None, start: str | None) -> str:
    """'dead' when the owner's lock file is there and nobody holds it, 'alive' when it is held, else
    'unknown' (no such file: an owner from before these locks, or one that could not take its lock)."""
    if folder is None:
        return "unknown"
    try:
        import fcntl
    except ImportError:
        return "unknown"
    path = folder / _owner_lock_name(pid, host, pidns, start)
    fd = -1
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            fd = os.open(path, flags)
            break
        except OSError:
            continue
    if fd < 0:
        return "unknown"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "alive"
    except OSError:
        return "unknown"
    else:
        return "dead"
    finally:
        os.close(fd)


def _boot_ids(me: _Owner, start: str | None) -> tuple[str, str] | None:
    """(this process's boot id, the owner's), None where either cannot be read."""
    if me.start is None or start is None:
        return None
    mine, owner = me.start.split(":", 1)[0], start.split(":", 1)[0]
    return None if "?" in (mine, owner) else (mine, owner)


def _owner_state(
    me: _Owner, pid: int, host: str, pidns: str | None, start: str | None, locks: Path | None = None
) -> str:
    """'dead', 'alive' (verified, same start time) or 'unknown' (cannot check from here). `locks`: the state
    folder's owner-lock folder, asked when pids cannot tell (another PID namespace of this kernel)."""
    # Dead only on positive evidence: a hold released while its owner still measures is an overspent ledger.
    boots = _boot_ids(me, start)
    if host != me.host or pidns != me.pidns:
        # Only under this process's kernel (the same boot id) is an owner's flock authoritative.
        same_kernel = boots is not None and boots[0] == boots[1]
        return _lock_says(locks, pid, host, pidns, start) if same_kernel else "unknown"
    if boots is not None and boots[0] != boots[1]:
        return "dead"  # the machine rebooted since
    ticks = _start_ticks(pid)
    if ticks == _GONE:
        return "dead"
    if ticks is None or start is None:
        return "unknown"  # exists, or cannot be seen from here: without a start time pid reuse is possible
    return "alive" if start.split(":", 1)[1] == ticks else "dead"  # another start time: the pid was reused


def _releasable(state: str, expires_at: Any, now: float) -> bool:
    """Whether an open hold whose owner is in `state` (`_owner_state`) may be released now: its owner is dead,
    or the hold expired and its owner is not provably alive."""
    return state == "dead" or (state == "unknown" and float(expires_at) < now)


# ---------------------------------------------------------------------------- SQL

_LEDGER_COLS = "name, limit_micro, spent_micro, reserved_micro"
_EVENT_INSERT = (
    "INSERT INTO ledger_events (ledger, kind, amount_micro, limit_delta_micro, spent_delta_micro, "
    "reserved_delta_micro, reservation_id, detail, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_LATEST_OK = (
    "SELECT {col} FROM measurements AS m WHERE m.content_key = forecasts.{key} "
    "AND m.hardware = forecasts.hardware AND m.workload_key = forecasts.workload_key "
    "AND m.status = 'ok' AND m.runtime_ms > 0 ORDER BY m.id DESC LIMIT 1"
)
# A verified forecast that rests on no suspect runtime (_SUSPECT): the latest ok measurement of neither kernel
# is flagged. One verified by a kernel failing for good (verified_failure) rests on that failure, not on the
# other kernel's runtime, as compare answers such a pair. What verified_pairs and budget_status count as checked.
# Read as: the kernels whose latest ok measurement is flagged, found once (`_SUSPECT_KERNELS`: a few among
# thousands, read from the measurements_suspect index; a WITH clause SQLite materializes as it is used twice,
# without the MATERIALIZED keyword SQLite before 3.35 refuses), then looked up for each row's two kernels
# (`_ON_TRUSTED_KERNELS`), instead of finding each row's two latest measurements and parsing their flags (most of
# a 0.47 s budget_status at 50,000 forecasts on a ledger).
_SUSPECT_KERNELS = (
    "suspect(content_key, hardware, workload_key) AS (SELECT s.content_key, s.hardware, "
    f"s.workload_key FROM measurements AS s WHERE s.status = 'ok' AND s.runtime_ms > 0 AND {_SUSPECT.format(row='s')} "
    "AND s.id = (SELECT m.id FROM measurements AS m WHERE m.content_key = s.content_key "
    "AND m.hardware = s.hardware AND m.workload_key = s.workload_key AND m.status = 'ok' AND m.runtime_ms > 0 "
    "ORDER BY m.id DESC LIMIT 1))"
)
_ON_TRUSTED_KERNELS = (
    "(verified_failure IS NOT NULL OR (NOT EXISTS (SELECT 1 FROM suspect AS k WHERE k.content_key = baseline_key "
    "AND k.hardware = forecasts.hardware AND k.workload_key = forecasts.workload_key) AND NOT EXISTS "
    "(SELECT 1 FROM suspect AS k WHERE k.content_key = candidate_key AND k.hardware = forecasts.hardware "
    "AND k.workload_key = forecasts.workload_key)))"
)
# A pair of kernels on one GPU and workload, either one the baseline (a GROUP BY over forecasts).
_PAIR = "hardware, workload_key, min(baseline_key, candidate_key), max(baseline_key, candidate_key)"
_GROUP_COLS = f"forecaster, {_PAIR}"  # PairGroup
# What verified_pairs reads of a row (_verified_pair).
_VERIFIED_COLS = (
    "forecaster, hardware, probs_json, p_faster, actual_speedup, verdict, created_at, family_key, "
    "workload_key || '|' || baseline_key || '|' || candidate_key, verified_failure, verified_by_measurement, id, "
    "p_fail, p_fail_baseline, max_confidence"
)
_N_VERIFIED_COLS = 15


def _verified_pair(r: Any) -> VerifiedPair:
    return VerifiedPair(
        forecaster=str(r[0]),
        hardware=str(r[1]),
        probs=[float(p) for p in json.loads(r[2])],
        p_faster=float(r[3]),
        actual_speedup=float(r[4]),
        verdict=str(r[5]),
        created_at=float(r[6]),
        family_key=None if r[7] is None else str(r[7]),
        pair=str(r[8]),
        failure=None if r[9] is None else str(r[9]),
        verified_by=None if r[10] is None else int(r[10]),
        row_id=int(r[11]),
        p_fail=None if r[12] is None else float(r[12]),
        p_fail_baseline=None if r[13] is None else float(r[13]),
        max_confidence=None if r[14] is None else float(r[14]),
    )


def _group(r: Any) -> PairGroup:
    return (str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]))


# Sets actual_speedup = t(baseline) / t(candidate) from the latest ok measurement of each kernel, for the
# forecasts selected by the WHERE clause appended by the caller.
_VERIFY = (
    "UPDATE forecasts SET "
    f"actual_speedup = ({_LATEST_OK.format(col='m.runtime_ms', key='baseline_key')}) "
    f"/ ({_LATEST_OK.format(col='m.runtime_ms', key='candidate_key')}), "
    f"verified_by_measurement = max(({_LATEST_OK.format(col='m.id', key='baseline_key')}), "
    f"({_LATEST_OK.format(col='m.id', key='candidate_key')})), "
    "verified_failure = NULL, verified_at = ? "
    f"WHERE EXISTS ({_LATEST_OK.format(col='1', key='baseline_key')}) "
    f"AND EXISTS ({_LATEST_OK.format(col='1', key='candidate_key')}) AND "
)
# The speedup a pair is verified with when one kernel failed for good and the other ran: the extreme bin's, as
# a forecast puts a measured failure (service._one_side_failed). verified_failure says which side failed.
FAILED_CANDIDATE_SPEEDUP = 2.0**-4
FAILED_BASELINE_SPEEDUP = 2.0**4
# The latest failure of a kernel that is its own, when it was never measured ok: what family models learn as a
# failure (not a crash or an out-of-memory, nor a failure that was its reference's, nor a timeout under a
# lowered cap or an interrupted compile). A timeout under the server's cap counts, as compare_kernels answers
# it: a "faster" said of a kernel that then ran past the cap was wrong, and leaving it out would keep the worst
# errors out of the history that certifies thresholds.
_LATEST_FAILED = (
    "SELECT {col} FROM measurements AS m WHERE m.content_key = forecasts.{key} "
    "AND m.hardware = forecasts.hardware AND m.workload_key = forecasts.workload_key "
    f"AND m.status != 'ok' AND m.status NOT IN ({', '.join(repr(s) for s in _NOT_A_POINT)}) "
    f"AND {_KERNELS_OWN} AND NOT EXISTS ({_LATEST_OK.format(col='1', key='{key}')}) "
    "ORDER BY m.id DESC LIMIT 1"
)


def _failed_side(side: str, other: str) -> str:
    return (
        f"(EXISTS ({_LATEST_FAILED.format(col='1', key=side)}) "
        f"AND EXISTS ({_LATEST_OK.format(col='1', key=other)}))"
    )


# Verifies the not yet verified forecasts (of the caller's WHERE clause) one of whose kernels failed for good
# while the other ran; a pair whose kernels both failed says nothing of which is faster and stays unverified.
_VERIFY_FAILED = (
    "UPDATE forecasts SET "
    f"verified_failure = CASE WHEN {_failed_side('candidate_key', 'baseline_key')} "
    "THEN 'candidate' ELSE 'baseline' END, "
    f"actual_speedup = CASE WHEN {_failed_side('candidate_key', 'baseline_key')} "
    f"THEN {FAILED_CANDIDATE_SPEEDUP!r} ELSE {FAILED_BASELINE_SPEEDUP!r} END, "
    f"verified_by_measurement = max(coalesce(({_LATEST_OK.format(col='m.id', key='baseline_key')}), "
    f"({_LATEST_FAILED.format(col='m.id', key='baseline_key')})), "
    f"coalesce(({_LATEST_OK.format(col='m.id', key='candidate_key')}), "
    f"({_LATEST_FAILED.format(col='m.id', key='candidate_key')}))), "
    "verified_at = ? "
    f"WHERE actual_speedup IS NULL AND ({_failed_side('candidate_key', 'baseline_key')} "
    f"OR {_failed_side('baseline_key', 'candidate_key')}) AND "
)


def damaged(exc: BaseException) -> bool:
    """Whether `exc` says the database file is damaged (a lost or overwritten page: "database disk image is
    malformed", "file is not a database"): not busy, full or read-only (OperationalError), and not a bug of ours
    (IntegrityError, ProgrammingError), which are DatabaseErrors too and must not be told to the operator as
    damage to recover from."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.DatabaseError)
        and isinstance(code, int)
        and (code & 0xFF) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
    )


def _busy(exc: BaseException) -> bool:
    """Whether `exc` is SQLite's "busy" or "locked", in any of their extended codes (SQLITE_BUSY_RECOVERY,
    SQLITE_BUSY_SNAPSHOT, ...: Python reports the extended code, 261 for a WAL being recovered, not 5)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


async def _stopped(connection: Any) -> None:
    """Wait for the thread of an aiosqlite connection that failed to open. aiosqlite stops it without waiting,
    and when the event loop closed first (a CLI command exiting at once with its one-line error) the thread
    printed two tracebacks ("RuntimeError: Event loop is closed") after that line."""
    thread = getattr(connection, "_thread", None)
    if isinstance(thread, threading.Thread) and thread.is_alive():
        await asyncio.to_thread(thread.join, BUSY_TIMEOUT_S)


async def _wal_mode(conn: Any) -> None:
    """Switch the database to WAL, waiting (up to the busy timeout) for another process switching it too.

    On a new, empty file the switch needs an exclusive lock, and SQLite answers a process that finds another
    one switching (or migrating before its switch is on disk) "database is locked" at once, without its busy
    handler: of three processes started at once on an empty state folder, one in about twelve failed to start.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            await conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.05)


class Store:
    """Async facade over the database file.

    Open with `await Store.open(path)`; close with `await store.close()`."""

    def __init__(self, conn: Any, path: Path) -> None:
        self._conn: Any = conn
        self.path = path
        self._lock = asyncio.Lock()
        self._owner = _Owner.current()
        self._locks: Path | None = path.parent / "owners"
        self._owner_lock = _take_owner_lock(self._locks, self._owner)
        self._background: set[asyncio.Future[Any]] = set()
        # commit_later's retries and what each one commits: close() makes a last attempt, then cancels them.
        self._retrying: dict[asyncio.Future[Any], tuple[Reservation, float | None]] = {}
        # release_claim's retries, cancelled at close (a claim left then is taken over once this process is gone).
        self._releasing_claims: dict[asyncio.Future[Any], KeyClaim] = {}
        # Set (and replaced by a new one) each time a write transaction commits: the database takes writes
        # again, and the retries above try at once instead of waiting out their backoff (_retry_wait).
        self._wrote = asyncio.Event()

    @classmethod
    async def open(cls, path: Path) -> Store:
        """Create the folder and file if needed, enable WAL, apply pending migrations, release orphan
        reservations (owner process dead on this host, or expired)."""
        path = Path(path)
        where = "the state folder (--home, env FORECASTER_MCP_HOME)"
        connecting: Any = None
        try:
            if path.is_dir():
                raise OperatorError(
                    f"cannot open the state database {path}: it is a folder, not a database file; move it "
                    f"aside or point {where} at another folder"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
            connecting = aiosqlite.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn = await connecting
        except (OSError, sqlite3.Error) as exc:
            await _stopped(connecting)
            raise OperatorError(
                f"cannot open the state database {path}: {exc}; point {where} at a folder you can write to"
            ) from exc
        try:
            await conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            # Refused before anything is written: the switch to WAL rewrote a newer database left in another
            # journal mode (its header, new -wal and -shm files) before it was refused.
            await refuse_newer(conn)
            await _wal_mode(conn)
            # NORMAL survives process crashes in WAL mode; only a power cut may lose the last commits.
            await conn.execute("PRAGMA synchronous = NORMAL")
            # A log checkpointed to its end is cut back to the next transaction's size when it restarts, so
            # the space it took is the database's again (`_checkpoint_if_low`).
            await conn.execute("PRAGMA journal_size_limit = 0")
            await conn.execute("PRAGMA foreign_keys = ON")
            await migrate(conn)
            store = cls(conn, path)
            released = await store.release_orphans(best_effort=True)
        except sqlite3.DatabaseError as exc:
            await conn.close()
            if isinstance(exc, sqlite3.OperationalError):  # busy, read-only, ...: says what it is
                raise
            # A file that is no SQLite database, or a damaged one.
            raise OperatorError(
                f"{path} is not a forecaster-mcp state database, or is damaged ({exc}): move it aside (its "
                f"ledgers and measurements are in it) or point {where} at another folder"
            ) from exc
        except BaseException:
            await conn.close()
            raise
        if released:
            log.warning("released %d orphan reservation(s) left by dead or expired owners", released)
        return store

    async def close(self) -> None:
        """Finish transactions still running for cancelled callers, then close the connection. A commit still
        retried by `commit_later` gets one last attempt; if that fails too, its hold is released as an orphan
        at the next start."""
        pending = list(self._retrying.items())
        for fut, _ in pending:
            fut.cancel()
        for claim_retry in list(self._releasing_claims):
            claim_retry.cancel()
        await asyncio.gather(*(fut for fut, _ in pending), return_exceptions=True)
        for _, (reservation, seconds) in pending:
            try:
                await self._settle_now(reservation, seconds)
            except sqlite3.Error as exc:
                log.error(
                    "could not charge reservation %s at close (%s): released at the next start",
                    reservation.id,
                    exc,
                )
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            me = self._owner
            try:
                # A hold still open (its charge failed at close) is released at the next start, which needs
                # this process's lock file to tell that its owner died.
                holds_left = bool(
                    await conn.execute_fetchall(
                        "SELECT 1 FROM reservations WHERE state = 'open' AND owner_pid = ? AND owner_host = ? "
                        "AND owner_pidns IS ? AND owner_start IS ? UNION ALL SELECT 1 FROM idempotency_claims "
                        "WHERE owner_pid = ? AND owner_host = ? AND owner_pidns IS ? AND owner_start IS ? LIMIT 1",
                        (me.pid, me.host, me.pidns, me.start) * 2,
                    )
                )
            except sqlite3.Error:
                holds_left = True
            await conn.close()
            _drop_owner_lock(self._owner_lock, holds_left=holds_left)
            self._owner_lock = None

    # ---------------------------------------------------------------- transactions

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)

    async def _locked(self, body: Callable[[Any], Awaitable[T]], begin: str | None) -> T:
        async with self._lock:
            conn = self._conn
            if conn is None:
                raise RuntimeError("the store is closed")
            if begin is None:
                return await body(conn)
            await conn.execute(begin)
            try:
                result = await body(conn)
                await conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    await conn.execute("ROLLBACK")
                if begin != "BEGIN":
                    await self._checkpoint_if_low(conn)
                raise
            if begin != "BEGIN":  # a write: wake the retries of writes that failed (full disk, locked)
                await self._checkpoint_if_low(conn)
                wrote, self._wrote = self._wrote, asyncio.Event()
                wrote.set()
            return result

    async def _checkpoint_if_low(self, conn: Any) -> None:
        """On a disk with less than LOW_DISK_BYTES free, copy the write-ahead log into the database now (outside
        any transaction, under the store's lock), so that the next write restarts the log at its start and cuts
        it back (journal_size_limit) instead of growing it into the space the database needs. (With SQLite's
        own checkpoint, at about 4 MB of log, a 3 MB disk took 57 holds and charges: then the log had filled it,
        every write failed "database or disk is full", and no checkpoint could run any more, also not at close
        or after a restart.) PASSIVE: it never waits for another process's readers; what it cannot copy now
        is copied after a later write. Best effort: the write itself is done (or failed) already."""
        try:
            free = shutil.disk_usage(self.path.parent).free  # os.statvfs is POSIX only
        except OSError:
            return
        if free >= LOW_DISK_BYTES:
            return
        try:
            await conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:
            log.debug("checkpoint on a low disk failed: %s", exc)

    async def _retry_wait(self, seconds: float) -> None:
        """Sleep `seconds`, or until a write transaction of this store commits (whichever comes first): a
        retry of a write that failed on a full disk or a locked database tries again as soon as the database
        takes writes again. (It waited out its backoff, up to 300 s, while other measurements were saved and
        charged: 42 s and more after a full disk was freed, on a real server; a SIGKILL then let the hold be
        released free at the next start.)"""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wrote.wait(), seconds)

    async def _run(
        self,
        body: Callable[[Any], Awaitable[T]],
        begin: str | None,
        on_abandoned: Callable[[T], Awaitable[Any]] | None = None,
    ) -> T:
        # The transaction runs in its own task: a caller's cancellation (an anyio scope re-cancels every
        # await) cannot interrupt it between BEGIN and COMMIT.
        task = asyncio.ensure_future(self._locked(body, begin))
        self._track(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if on_abandoned is not None:
                undo = on_abandoned

                def _after(t: asyncio.Future[T]) -> None:
                    if not t.cancelled() and t.exception() is None:
                        self._track(asyncio.ensure_future(undo(t.result())))

                task.add_done_callback(_after)
            raise

    async def _write(self, body: Callable[[Any], Awaitable[T]]) -> T:
        return await self._run(body, "BEGIN IMMEDIATE")

    async def _read_tx(self, body: Callable[[Any], Awaitable[T]]) -> T:
        return await self._run(body, "BEGIN")

    async def _fetch(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        async def body(conn: Any) -> list[Any]:
            return list(await conn.execute_fetchall(sql, params))

        return await self._run(body, None)

    @staticmethod
    async def _event(
        conn: Any,
        ledger: str,
        kind: str,
        amount: int,
        *,
        limit_delta: int = 0,
        spent_delta: int = 0,
        reserved_delta: int = 0,
        reservation_id: int | None = None,
        detail: str | None = None,
        now: float,
    ) -> None:
        await conn.execute(
            _EVENT_INSERT,
            (ledger, kind, amount, limit_delta, spent_delta, reserved_delta, reservation_id, detail, now),
        )

    @staticmethod
    async def _ledger_row(conn: Any, name: str) -> Any:
        rows = await conn.execute_fetchall(f"SELECT {_LEDGER_COLS} FROM ledgers WHERE name = ?", (name,))
        return rows[0] if rows else None

    # ---------------------------------------------------------------- ledgers (operator actions and reads)

    async def create_ledger(self, name: str, gpu_seconds: float) -> LedgerView:
        """OperatorError if it exists or the amount is not a finite number >= 0."""
        check_ledger_name(name)
        amount = to_micro(gpu_seconds, "--gpu-seconds", OperatorError, allow_zero=True)

        async def body(conn: Any) -> LedgerView:
            if await self._ledger_row(conn, name) is not None:
                raise OperatorError(
                    f"ledger '{name}' already exists; raise its limit with: "
                    f"forecaster-mcp ledger topup {name} --gpu-seconds N"
                )
            now = time.time()
            await conn.execute(
                "INSERT INTO ledgers (name, limit_micro, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (name, amount, now, now),
            )
            await self._event(conn, name, "create", amount, limit_delta=amount, now=now)
            return LedgerView(name, _gs(amount), 0.0, 0.0)

        return await self._write(body)

    async def ensure_ledger(self, name: str, gpu_seconds: float) -> LedgerView:
        """The ledger, created with `gpu_seconds` if it does not exist yet (atomic across processes)."""
        try:
            return await self.create_ledger(name, gpu_seconds)
        except OperatorError:
            view = await self.get_ledger(name)
            if view is None:
                raise
            return view

    async def topup_ledger(self, name: str, gpu_seconds: float) -> LedgerView:
        """Raise a ledger's limit by a finite amount > 0. OperatorError if it does not exist."""
        amount = to_micro(gpu_seconds, "--gpu-seconds", OperatorError, allow_zero=False)

        async def body(conn: Any) -> LedgerView:
            row = await self._ledger_row(conn, name)
            if row is None:
                raise OperatorError(str(_unknown_ledger(name)))
            if _gs(int(row[1]) + amount) > MAX_GPU_SECONDS:
                raise OperatorError(f"ledger '{name}' would exceed the {MAX_GPU_SECONDS:g} GPU-second limit")
            now = time.time()
            await conn.execute(
                "UPDATE ledgers SET limit_micro = limit_micro + ?, updated_at = ? WHERE name = ?",
                (amount, now, name),
            )
            await self._event(conn, name, "topup", amount, limit_delta=amount, now=now)
            return _view(await self._ledger_row(conn, name))

        return await self._write(body)

    async def get_ledger(self, name: str) -> LedgerView | None:
        rows = await self._fetch(f"SELECT {_LEDGER_COLS} FROM ledgers WHERE name = ?", (name,))
        return _view(rows[0]) if rows else None

    async def list_ledgers(self) -> list[LedgerView]:
        return [_view(r) for r in await self._fetch(f"SELECT {_LEDGER_COLS} FROM ledgers ORDER BY name")]

    async def ledger_events(self, name: str) -> list[dict[str, Any]]:
        """The ledger's append-only history, oldest first (amounts in GPU-seconds)."""
        rows = await self._fetch(
            "SELECT id, kind, amount_micro, limit_delta_micro, spent_delta_micro, reserved_delta_micro, "
            "reservation_id, detail, created_at FROM ledger_events WHERE ledger = ? ORDER BY id",
            (name,),
        )
        return [
            {
                "id": int(r[0]),
                "kind": str(r[1]),
                "gpu_seconds": _gs(int(r[2])),
                "limit_delta_gpu_seconds": _gs(int(r[3])),
                "spent_delta_gpu_seconds": _gs(int(r[4])),
                "reserved_delta_gpu_seconds": _gs(int(r[5])),
                "reservation_id": r[6],
                "detail": r[7],
                "created_at": float(r[8]),
            }
            for r in rows
        ]

    # ---------------------------------------------------------------- budget: reserve, run, commit/release

    async def reserve(
        self,
        ledger: str,
        gpu_seconds: float,
        purpose: str,
        idempotency_key: str | None = None,
        cache_key: str | None = None,
        exclusive: bool = True,
    ) -> Reservation:
        """Atomically hold `gpu_seconds`. UnknownLedger / BudgetExhausted (message names what is left and
        that forecasts are free). The reservation records this process (pid, host, start time) and an
        expiry so a crashed owner's hold is released on the next open.

        With an idempotency key, across every process on this database: AlreadyMeasured when a measurement
        was saved under it, MeasurementInProgress while another hold carries it. With a `cache_key` (the
        measurement the hold pays for), SameMeasurementRunning while an open hold on any ledger pays for the
        same one: its result will be in the cache (`exclusive=False`: record the key, hold regardless)."""
        amount = to_micro(gpu_seconds, "the reservation", InvalidRequest, allow_zero=False)
        me = self._owner

        async def body(conn: Any) -> Reservation | Exception:
            now = time.time()
            await self._release_orphans(conn, now)
            row = await self._ledger_row(conn, ledger)
            if row is None:
                return _unknown_ledger(ledger)
            if idempotency_key is not None:
                done = await conn.execute_fetchall(
                    "SELECT 1 FROM measurements WHERE ledger = ? AND idempotency_key = ? LIMIT 1",
                    (ledger, idempotency_key),
                )
                if done:
                    return AlreadyMeasured(idempotency_key)
                running = await _key_in_progress(conn, ledger, idempotency_key)
                if running is not None:
                    return running
            if cache_key is not None and exclusive:
                same = await conn.execute_fetchall(
                    "SELECT 1 FROM reservations WHERE cache_key = ? AND state = 'open' LIMIT 1", (cache_key,)
                )
                if same:
                    return SameMeasurementRunning(cache_key)
            limit, spent, reserved = int(row[1]), int(row[2]), int(row[3])
            if limit - spent - reserved < amount:
                # Returned, not raised: orphans released above must still be committed.
                return _exhausted(ledger, limit, spent, reserved, amount)
            expires = _expiry(now, _gs(amount))
            cur = await conn.execute(
                "INSERT INTO reservations (ledger, amount_micro, purpose, owner_pid, owner_host, "
                "owner_pidns, owner_start, created_at, expires_at, idempotency_key, cache_key) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    ledger,
                    amount,
                    purpose,
                    me.pid,
                    me.host,
                    me.pidns,
                    me.start,
                    now,
                    expires,
                    idempotency_key,
                    cache_key,
                ),
            )
            rid = int(cur.lastrowid)
            await conn.execute(
                "UPDATE ledgers SET reserved_micro = reserved_micro + ?, updated_at = ? WHERE name = ?",
                (amount, now, ledger),
            )
            await self._event(
                conn,
                ledger,
                "reserve",
                amount,
                reserved_delta=amount,
                reservation_id=rid,
                detail=purpose,
                now=now,
            )
            return Reservation(id=rid, ledger=ledger, gpu_seconds=_gs(amount))

        async def undo(outcome: Reservation | Exception) -> None:
            if isinstance(outcome, Reservation):
                await self.release(outcome)

        outcome = await self._run(body, "BEGIN IMMEDIATE", on_abandoned=undo)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _settle(self, reservation: Reservation, actual_micro: int | None) -> int:
        """Commit (actual_micro not None) or release a held reservation; 0, no change if settled."""
        return await self._write(lambda conn: self._settle_in(conn, reservation, actual_micro))

    async def _settle_in(self, conn: Any, reservation: Reservation, actual_micro: int | None) -> int:
        """`_settle` inside a write transaction."""
        rows = await conn.execute_fetchall(
            "SELECT ledger, amount_micro, state FROM reservations WHERE id = ?", (reservation.id,)
        )
        if not rows or str(rows[0][0]) != reservation.ledger:
            raise ValueError(
                f"no reservation {reservation.id} on ledger '{reservation.ledger}' in {self.path}"
            )
        held, state = int(rows[0][1]), str(rows[0][2])
        if state != "open":
            return 0
        charged = 0 if actual_micro is None else min(actual_micro, held)
        now = time.time()
        await conn.execute(
            "UPDATE ledgers SET spent_micro = spent_micro + ?, reserved_micro = reserved_micro - ?, "
            "updated_at = ? WHERE name = ?",
            (charged, held, now, reservation.ledger),
        )
        new_state = "released" if actual_micro is None else "committed"
        await conn.execute(
            "UPDATE reservations SET state = ?, charged_micro = ?, settled_at = ? WHERE id = ?",
            (new_state, charged, now, reservation.id),
        )
        if actual_micro is None:
            await self._event(
                conn, reservation.ledger, "release", held, reserved_delta=-held,
                reservation_id=reservation.id, now=now,
            )  # fmt: skip
        else:
            await self._event(
                conn, reservation.ledger, "commit", charged, spent_delta=charged, reserved_delta=-held,
                reservation_id=reservation.id,
                detail=f"released {fmt_gpu_seconds(_gs(held - charged))}"
                + (RESULT_NOT_SAVED if reservation.result_not_saved else ""),
                now=now,
            )  # fmt: skip
        return charged

    async def commit(self, reservation: Reservation, actual_gpu_seconds: float) -> float:
        """Charge min(actual, reserved), release the rest, append an event. Returns the charge.

        A negative actual charges 0; a NaN or infinite one charges the whole hold. Committing or releasing a
        reservation already settled (or released as an orphan) changes nothing and returns 0."""
        return _gs(await self._settle(reservation, _charge_micro(actual_gpu_seconds)))

    def commit_later(
        self,
        reservation: Reservation,
        actual_gpu_seconds: float | None,
        *,
        interval_s: float = 10.0,
        max_interval_s: float = 60.0,
    ) -> None:
        """Keep trying `commit` (`release` for None) in the background after it failed on a locked or full
        database, every `interval_s` at first, backing off to `max_interval_s`, for as long as the process
        lives (and once more at `close`): a run that used the device is charged once the database takes
        writes again, and its hold does not stay open (reserved budget, a retry under its key "still
        running") meanwhile. (It gave up after 60 tries, about 10 minutes: the device time was then never
        charged and the hold stayed open until the next start released it free.) Any other write of this store
        that commits meanwhile makes it try again at once (`_retry_wait`); an idle server's retry waits a minute
        at most (a settle on a full disk is one failed write: cheap), since a hold still open when the process is
        killed is released free at the next start."""

        async def retry() -> None:
            wait = interval_s
            while True:
                await self._retry_wait(wait)
                try:
                    await self._settle_now(reservation, actual_gpu_seconds)
                    return
                except sqlite3.Error as exc:
                    log.warning("commit of reservation %s still failing: %s", reservation.id, exc)
                wait = min(max_interval_s, 2.0 * wait)

        fut = asyncio.ensure_future(retry())
        self._retrying[fut] = (reservation, actual_gpu_seconds)
        fut.add_done_callback(lambda done: self._retrying.pop(done, None))

    async def release(self, reservation: Reservation) -> None:
        """Release the whole hold, charging nothing (the measurement did not happen)."""
        await self._settle(reservation, None)

    async def _settle_now(self, reservation: Reservation, actual_gpu_seconds: float | None) -> None:
        if actual_gpu_seconds is None:
            await self.release(reservation)
        else:
            await self.commit(reservation, actual_gpu_seconds)

    async def release_orphans(self, *, best_effort: bool = False) -> int:
        """Release the holds of dead (or expired, unverifiable) owners now; returns how many.

        Takes the write lock only when another owner's hold is open (a read finds out first), so a reader
        (budget_status, `ledger show`) does not wait on a writer for nothing; `best_effort`: a database that
        stays locked (or cannot be written) releases nothing now instead of failing the read."""
        me = self._owner
        others = await self._fetch(
            "SELECT owner_pid, owner_host, owner_pidns, owner_start, expires_at FROM reservations "
            "WHERE state = 'open' AND NOT (owner_pid = ? AND owner_host = ? AND owner_start IS ?)",
            (me.pid, me.host, me.start),
        )
        now = time.time()
        # Only a hold that is releasable now is worth the write lock: another server's live measurement is not
        # (a reader queued behind every writer for nothing, up to the 30 s busy timeout).
        if not any(
            _releasable(_owner_state(me, int(pid), str(host), ns, start, self._locks), exp, now)
            for pid, host, ns, start, exp in others
        ):
            return 0
        try:
            return await self._write(lambda conn: self._release_orphans(conn, time.time()))
        except sqlite3.OperationalError as exc:
            if not best_effort:
                raise
            log.warning("orphan reservations not released now (%s); the next write releases them", exc)
            return 0

    async def extend_hold(self, reservation: Reservation) -> bool:
        """Push an open hold's expiry as far out as at its reservation, from now: a measurement still queued
        or running keeps its hold however long it waits (an owner another host cannot check is otherwise
        released at expiry). False once the hold is settled."""

        async def body(conn: Any) -> bool:
            expires = _expiry(time.time(), reservation.gpu_seconds)
            cur = await conn.execute(
                "UPDATE reservations SET expires_at = max(expires_at, ?) WHERE id = ? AND state = 'open'",
                (expires, reservation.id),
            )
            # The key the hold measures under is claimed for as long (claim_key).
            await conn.execute(
                "UPDATE idempotency_claims SET expires_at = max(expires_at, ?) WHERE (ledger, idempotency_key) "
                "IN (SELECT ledger, idempotency_key FROM reservations WHERE id = ? AND state = 'open')",
                (expires, reservation.id),
            )
            return bool(cur.rowcount)

        return await self._write(body)

    # ---------------------------------------------------------------- idempotency keys

    async def claim_key(
        self, ledger: str, idempotency_key: str, request: dict[str, str], gpu_seconds: float
    ) -> KeyClaim | KeyTaken:
        """Atomically take (ledger, idempotency_key) for `request` (what it measures: the service compares it)
        before it is served or measured, across every process on this database. AlreadyMeasured when a
        measurement was saved under the key; KeyTaken while another request holds it. A claim whose owner is
        dead, or expired and not provably alive (as `reserve` judges holds), is taken over: a server that died
        mid-measurement does not block its key. `gpu_seconds`: how long the request may hold the device and
        wait for it, which sets the expiry (pushed on by `extend_hold` while its hold is open)."""
        me = self._owner

        async def body(conn: Any) -> KeyClaim | KeyTaken | Exception:
            now = time.time()
            done = await conn.execute_fetchall(
                "SELECT 1 FROM measurements WHERE ledger = ? AND idempotency_key = ? LIMIT 1",
                (ledger, idempotency_key),
            )
            if done:
                return AlreadyMeasured(idempotency_key)
            rows = await conn.execute_fetchall(
                "SELECT id, request_json, owner_pid, owner_host, owner_pidns, owner_start, expires_at "
                "FROM idempotency_claims WHERE ledger = ? AND idempotency_key = ?",
                (ledger, idempotency_key),
            )
            if rows:
                cid, request_json, pid, host, pidns, start, expires_at = rows[0]
                state = _owner_state(me, int(pid), str(host), pidns, start, self._locks)
                if not _releasable(state, expires_at, now):
                    return KeyTaken(json.loads(request_json))
                await conn.execute("DELETE FROM idempotency_claims WHERE id = ?", (cid,))
                log.warning(
                    "took over idempotency_key %r on ledger %r: its claim's owner pid %s on %s is %s",
                    idempotency_key, ledger, pid, host, "gone" if state == "dead" else "past its expiry",
                )  # fmt: skip
            cur = await conn.execute(
                "INSERT INTO idempotency_claims (ledger, idempotency_key, request_json, owner_pid, owner_host, "
                "owner_pidns, owner_start, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    ledger, idempotency_key, json.dumps(request, sort_keys=True), me.pid, me.host, me.pidns,
                    me.start, now, _expiry(now, gpu_seconds),
                ),
            )  # fmt: skip
            return KeyClaim(int(cur.lastrowid), ledger, idempotency_key)

        async def undo(outcome: KeyClaim | KeyTaken | Exception) -> None:
            if isinstance(outcome, KeyClaim):
                await self.release_claim(outcome)

        outcome = await self._run(body, "BEGIN IMMEDIATE", on_abandoned=undo)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def release_claim(self, claim: KeyClaim) -> None:
        """Give the key up (its request was answered, saved or not, or failed): the next request under it looks
        again. A database too locked to take it now is retried in the background, as `commit_later` does, so
        that the key is not held, and its retries kept waiting, for the life of this process."""

        me = self._owner

        async def body(conn: Any) -> None:
            # Not by id alone: a claim answered is deleted by its save (or one expired, by a take-over), and
            # SQLite gives the next claim the largest rowid free again, maybe this one's; deleting that by id
            # would free another request's key (another kernel then measured under it, a retry paid twice).
            # Only this process's claim on this key is ours (a key is never claimed again once answered, and
            # a live owner's claim is never taken over by itself).
            await conn.execute(
                "DELETE FROM idempotency_claims WHERE id = ? AND ledger = ? AND idempotency_key = ? "
                "AND owner_pid = ? AND owner_host = ? AND owner_pidns IS ? AND owner_start IS ?",
                (claim.id, claim.ledger, claim.idempotency_key, me.pid, me.host, me.pidns, me.start),
            )

        try:
            await self._write(body)
        except sqlite3.Error as exc:
            log.warning(
                "could not give up the claim on idempotency_key %r now (%s); retrying",
                claim.idempotency_key,
                exc,
            )

            async def retry() -> None:
                wait = 1.0
                while True:
                    await self._retry_wait(wait)
                    try:
                        await self._write(body)
                        return
                    except sqlite3.Error:
                        wait = min(60.0, 2.0 * wait)

            fut = asyncio.ensure_future(retry())
            self._releasing_claims[fut] = claim
            fut.add_done_callback(lambda done: self._releasing_claims.pop(done, None))

    async def _release_orphans(self, conn: Any, now: float) -> int:
        """In a write transaction: release holds whose owner is dead, or expired and not provably alive."""
        me = self._owner
        rows = await conn.execute_fetchall(
            "SELECT id, ledger, amount_micro, owner_pid, owner_host, owner_pidns, owner_start, expires_at "
            "FROM reservations WHERE state = 'open' "
            "AND NOT (owner_pid = ? AND owner_host = ? AND owner_start IS ?)",
            (me.pid, me.host, me.start),
        )
        released = 0
        for rid, ledger, amount, pid, host, pidns, start, expires_at in rows:
            state = _owner_state(me, int(pid), str(host), pidns, start, self._locks)
            if not _releasable(state, expires_at, now):
                continue
            reason = (
                f"owner pid {pid} on {host} is gone"
                if state == "dead"
                else f"expired (owner pid {pid} on {host} cannot be checked from here)"
            )
            await conn.execute(
                "UPDATE reservations SET state = 'orphan_released', charged_micro = 0, settled_at = ? "
                "WHERE id = ?",
                (now, rid),
            )
            await conn.execute(
                "UPDATE ledgers SET reserved_micro = reserved_micro - ?, updated_at = ? WHERE name = ?",
                (amount, now, ledger),
            )
            await self._event(
                conn, str(ledger), "orphan_release", int(amount), reserved_delta=-int(amount),
                reservation_id=int(rid), detail=reason, now=now,
            )  # fmt: skip
            log.warning("released orphan reservation %s on ledger %r: %s", rid, ledger, reason)
            released += 1
        return released

    async def reservations(self, ledger: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        """Reservations for inspection (newest first), optionally filtered by ledger and state."""
        rows = await self._fetch(
            "SELECT id, ledger, amount_micro, purpose, owner_pid, owner_host, state, charged_micro, "
            "created_at, expires_at, settled_at FROM reservations "
            "WHERE (? IS NULL OR ledger = ?) AND (? IS NULL OR state = ?) ORDER BY id DESC",
            (ledger, ledger, state, state),
        )
        return [
            {
                "id": int(r[0]),
                "ledger": str(r[1]),
                "gpu_seconds": _gs(int(r[2])),
                "purpose": str(r[3]),
                "owner_pid": int(r[4]),
                "owner_host": str(r[5]),
                "state": str(r[6]),
                "charged_gpu_seconds": None if r[7] is None else _gs(int(r[7])),
                "created_at": float(r[8]),
                "expires_at": float(r[9]),
                "settled_at": None if r[10] is None else float(r[10]),
            }
            for r in rows
        ]

    # ---------------------------------------------------------------- tokens (HTTP): stored hashed

    async def issue_token(self, ledger: str, label: str | None = None) -> str:
        """A new bearer token for `ledger`; only its SHA-256 is stored: this is the one chance to see it."""
        if label is not None and (len(label) > 200 or any(not ch.isprintable() for ch in label)):
            # A newline in it broke `token list`'s table.
            raise OperatorError("--label must be one line of printable text, at most 200 characters")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)

        async def body(conn: Any) -> str:
            if await self._ledger_row(conn, ledger) is None:
                raise OperatorError(str(_unknown_ledger(ledger)))
            await conn.execute(
                "INSERT INTO tokens (token_sha256, ledger, label, created_at) VALUES (?, ?, ?, ?)",
                (_hash_token(token), ledger, label, time.time()),
            )
            return token

        return await self._write(body)

    async def revoke_token(self, token: str) -> bool:
        """Revoke by the token itself, by the fingerprint `list_tokens` shows, or by its id there (digits,
        fewer than a fingerprint's 8). True if an active token was revoked; OperatorError if a fingerprint
        matches several active tokens."""
        token = token.strip()

        async def body(conn: Any) -> bool:
            if re.fullmatch(r"[0-9]{1,7}", token):
                rows = await conn.execute_fetchall(
                    "SELECT id FROM tokens WHERE id = ? AND revoked_at IS NULL", (int(token),)
                )
            elif token.startswith(TOKEN_PREFIX):
                rows = await conn.execute_fetchall(
                    "SELECT id FROM tokens WHERE token_sha256 = ? AND revoked_at IS NULL",
                    (_hash_token(token),),
                )
            elif re.fullmatch(r"[0-9a-f]{8,64}", token):
                rows = await conn.execute_fetchall(
                    "SELECT id FROM tokens WHERE substr(token_sha256, 1, ?) = ? AND revoked_at IS NULL",
                    (len(token), token),
                )
            else:
                return False
            if len(rows) > 1:
                raise OperatorError(f"fingerprint {token} matches {len(rows)} tokens: give more characters")
            if not rows:
                return False
            await conn.execute("UPDATE tokens SET revoked_at = ? WHERE id = ?", (time.time(), rows[0][0]))
            return True

        return await self._write(body)

    async def ledger_for_token(self, token: str) -> str | None:
        rows = await self._fetch(
            "SELECT ledger FROM tokens WHERE token_sha256 = ? AND revoked_at IS NULL", (_hash_token(token),)
        )
        return str(rows[0][0]) if rows else None

    async def list_tokens(self) -> list[dict[str, Any]]:
        """Every token, never its secret: id, fingerprint (hash prefix), ledger, label, timestamps."""
        rows = await self._fetch(
            "SELECT id, token_sha256, ledger, label, created_at, revoked_at FROM tokens ORDER BY id"
        )
        return [
            {
                "id": int(r[0]),
                "fingerprint": str(r[1])[:FINGERPRINT_CHARS],
                "ledger": str(r[2]),
                "label": r[3],
                "created_at": float(r[4]),
                "revoked_at": None if r[5] is None else float(r[5]),
            }
            for r in rows
        ]

    # ---------------------------------------------------------------- measurements

    async def find_measurement(self, cache_key: str) -> MeasureResult | None:
        """A stored result for this exact (kernel, workload, device fingerprint), if any.

        The latest original (not a cache-hit copy) of any status except those in _NOT_CACHEABLE, as it was
        stored (its cost is the original run's), with measurement_id set to its row."""
        rows = await self._fetch(
            f"SELECT id, result_json FROM measurements WHERE cache_key = ? AND status NOT IN ({_PLACES}) "
            "ORDER BY cached ASC, id DESC LIMIT 1",
            (cache_key, *_NOT_CACHEABLE),
        )
        return _result_from_row(*rows[0]) if rows else None

    async def idempotent_request(self, ledger: str, idempotency_key: str) -> IdempotentRequest | None:
        """What was measured under (ledger, idempotency_key), and its result, in one read."""
        rows = await self._fetch(
            "SELECT id, result_json, json_extract(kernel_json, '$.id'), content_key, workload_key, hardware, "
            "check_key FROM measurements WHERE ledger = ? AND idempotency_key = ?",
            (ledger, idempotency_key),
        )
        if not rows:
            return None
        mid, result_json, kernel_id, content_key, workload_key, hardware, check_key = rows[0]
        return IdempotentRequest(
            measurement_id=int(mid),
            kernel_id=None if kernel_id is None else str(kernel_id),
            content_key=str(content_key),
            workload_key=str(workload_key),
            hardware=str(hardware),
            result=_result_from_row(mid, result_json),
            check_key=None if check_key is None else str(check_key),
        )

    async def save_measurement(
        self,
        *,
        cache_key: str,
        ledger: str | None,
        idempotency_key: str | None,
        kernel_json: str,
        workload_key: str,
        family_key: str,
        content_key: str,
        hardware: str,
        result: MeasureResult,
        charged_gpu_seconds: float,
        cached: bool,
        check_key: str | None = None,
        hold: Reservation | None = None,
    ) -> int:
        """Store a measurement with full provenance (result JSON holds device provenance) and verify every
        stored forecast whose two kernels are now both measured on this hardware and workload. Returns its id.
        `check_key`: what its outputs were checked against (the service's `check_key`).

        A second save under the same (ledger, idempotency_key) inserts nothing and returns the first id.
        `hold`: the paid run's reservation, committed at `charged_gpu_seconds` in the same transaction (see
        `save_and_commit`)."""
        charged = to_micro(charged_gpu_seconds, "charged_gpu_seconds", ValueError, allow_zero=True)
        kernel = json.loads(kernel_json)
        defines_json = json.dumps(kernel.get("defines") or {}, sort_keys=True)
        launch = kernel.get("launch")
        launch_json = None if launch is None else json.dumps(launch, sort_keys=True)
        runtime = (
            result.runtime_ms.median if result.status == "ok" and result.runtime_ms is not None else None
        )
        result_json = result.model_dump_json()

        async def body(conn: Any) -> int:
            if idempotency_key is not None:
                rows = await conn.execute_fetchall(
                    "SELECT id, content_key, workload_key, hardware, check_key FROM measurements "
                    "WHERE ledger IS ? AND idempotency_key = ?",
                    (ledger, idempotency_key),
                )
                if rows:
                    # Checked otherwise (another reference, other atol/rtol) is another measurement too; a row
                    # saved before check keys were kept, or a caller giving none, cannot tell.
                    theirs = rows[0][4]
                    checked_otherwise = None not in (theirs, check_key) and theirs != check_key
                    if tuple(rows[0][1:4]) != (content_key, workload_key, hardware) or checked_otherwise:
                        # Another process saved another measurement under the key first: not this one's id.
                        raise InvalidRequest(
                            f"idempotency_key {idempotency_key[:80]!r} was already used on ledger {ledger!r} for "
                            f"another measurement ({int(rows[0][0])}); use a new key for a new measurement"
                        )
                    return int(rows[0][0])
                if cached:
                    # A free answer must not take a key whose paid measurement another process is making: that
                    # one's save would then find the key taken and its result would be lost.
                    running = await _key_in_progress(conn, ledger, idempotency_key)
                    if running is not None:
                        raise running
            if ledger is not None and await self._ledger_row(conn, ledger) is None:
                raise _unknown_ledger(ledger)
            saved = 0
            if cached:
                rows = await conn.execute_fetchall(
                    # What the result served from cache cost when it was measured (see find_measurement).
                    "SELECT charged_micro FROM measurements WHERE cache_key = ? AND cached = 0 "
                    f"AND status NOT IN ({_PLACES}) ORDER BY id DESC LIMIT 1",
                    (cache_key, *_NOT_CACHEABLE),
                )
                saved = int(rows[0][0]) if rows else 0
            now = time.time()
            cur = await conn.execute(
                "INSERT INTO measurements (cache_key, ledger, idempotency_key, kernel_json, defines_json, "
                "launch_json, workload_key, family_key, content_key, hardware, result_json, status, "
                "runtime_ms, charged_micro, saved_micro, cached, created_at, check_key) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    cache_key, ledger, idempotency_key, kernel_json, defines_json, launch_json, workload_key,
                    family_key, content_key, hardware, result_json, result.status, runtime, charged, saved,
                    int(cached), now, check_key,
                ),
            )  # fmt: skip
            mid = int(cur.lastrowid)
            if idempotency_key is not None:
                # The key is answered now: a claim on it (claim_key) has nothing left to guard.
                await conn.execute(
                    "DELETE FROM idempotency_claims WHERE ledger IS ? AND idempotency_key = ?",
                    (ledger, idempotency_key),
                )
            # A UNION of two index lookups: an OR would scan every forecast on this workload.
            mine = (
                "id IN (SELECT id FROM forecasts WHERE hardware = ? AND workload_key = ? "
                "AND baseline_key = ? UNION SELECT id FROM forecasts WHERE hardware = ? "
                "AND workload_key = ? AND candidate_key = ?)"
            )
            args = (now, hardware, workload_key, content_key, hardware, workload_key, content_key)
            if runtime is not None and runtime > 0:
                await conn.execute(_VERIFY + mine, args)
            # An ok run completes a pair whose other kernel failed; a failure, one whose other kernel ran.
            await conn.execute(_VERIFY_FAILED + mine, args)
            return mid

        async def body_and_commit(conn: Any) -> int:
            mid = await body(conn)
            if hold is not None:
                settled = await self._settle_in(conn, hold, _charge_micro(charged_gpu_seconds))
                if settled != charged:  # the hold was settled already: the row says what was charged
                    await conn.execute(
                        "UPDATE measurements SET charged_micro = ? WHERE id = ?", (settled, mid)
                    )
            return mid

        return await self._write(body_and_commit)

    async def save_and_commit(self, hold: Reservation, **save: Any) -> tuple[int, float]:
        """`save_measurement` of a paid run and the commit of its hold at `charged_gpu_seconds`, in one
        transaction: a result is never stored without its charge (a crash between the two made it free, and
        a failed save after the run used to release the hold uncharged). Returns (id, GPU-seconds charged):
        0 charged when the hold was settled already (released as an orphan meanwhile)."""
        mid = await self.save_measurement(**save, hold=hold)
        rows = await self._fetch("SELECT state, charged_micro FROM reservations WHERE id = ?", (hold.id,))
        return mid, _gs(int(rows[0][1])) if rows and rows[0][0] == "committed" else 0.0

    async def export_rows(self) -> list[tuple[str, str, str, str]]:
        """(hardware, workload_key, kernel_json, result_json) of what `forecaster-mcp export` writes: per kernel
        content, workload and device the latest result that was measured (not served from cache), leaving out
        the results the cache never serves either (a worker crash, a timeout, the device out of memory) and
        failures that were not the kernel's (its reference kernel failed): one would hide an earlier ok result."""
        return [
            (str(h), str(w), str(k), str(r))
            for h, w, k, r in await self._fetch(
                "SELECT hardware, workload_key, kernel_json, result_json FROM measurements WHERE id IN "
                "(SELECT MAX(id) FROM measurements WHERE cached = 0 "
                f"AND status NOT IN ({_PLACES}) AND {_KERNELS_OWN} "
                "GROUP BY hardware, content_key, workload_key) ORDER BY id",
                _NOT_CACHEABLE,
            )
        ]

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        """Every stored measurement of this family on this hardware and workload (latest per content_key).

        Per kernel, the latest ok measurement if there is one, else the latest of any status; oldest first
        (of one configuration stored under several spellings, the model answers from the last ok one). None of
        a kernel whose latest ok measurement is flagged suspect (models.SUSPECT_FLAGS)."""
        rows = await self._fetch(
            "SELECT defines_json, launch_json, status, runtime_ms, content_key, compile_options FROM "
            f"{_FAMILY_LATEST} ORDER BY id",
            (family_key, hardware, workload_key),
        )
        return [
            FamilyPoint(
                defines=json.loads(r[0]),
                launch=None if r[1] is None else json.loads(r[1]),
                status=str(r[2]),
                runtime_ms=None if r[3] is None else float(r[3]),
                content_key=str(r[4]),
                compile_options=tuple(json.loads(r[5])) if r[5] else (),
            )
            for r in rows
        ]

    async def workload_anchors(
        self, hardware: str, workload_key: str, limit: int, exclude_families: Sequence[str] = ()
    ) -> list[AnchorPoint]:
        """The kernels of up to `limit` families (other than `exclude_families`) measured running on this
        hardware and workload: of each family its latest ok measurement, the most recently measured families
        first. What a static prior anchors on (LocalForecaster). A family whose latest ok measurement is flagged
        suspect (models.SUSPECT_FLAGS) has no runtime to anchor on; of more than ANCHOR_MAX_FAMILIES families,
        those are read whose keys sort last."""
        if limit <= 0:
            return []
        # One index seek per family (measurements_workload), however many measurements a tuning family holds.
        where = "hardware = ?1 AND workload_key = ?2 AND status = 'ok'"
        families = await self._fetch(
            "WITH RECURSIVE fam(key) AS ("
            f"SELECT max(family_key) FROM measurements WHERE {where} UNION ALL "
            f"SELECT (SELECT max(family_key) FROM measurements WHERE {where} AND family_key < fam.key) "
            "FROM fam WHERE fam.key IS NOT NULL LIMIT ?3) "
            f"SELECT key, (SELECT max(id) FROM measurements WHERE {where} AND family_key = fam.key) "
            "FROM fam WHERE key IS NOT NULL",
            (hardware, workload_key, ANCHOR_MAX_FAMILIES),
        )
        excluded = set(exclude_families)
        latest = sorted((int(r[1]) for r in families if r[0] not in excluded), reverse=True)[: 2 * limit]
        if not latest:
            return []
        marks = ", ".join("?" for _ in latest)
        rows = await self._fetch(
            f"SELECT id, family_key, content_key, runtime_ms, kernel_json, json_extract(result_json, '$.resources'), "
            f"{_SUSPECT.format(row='m')} FROM measurements AS m WHERE id IN ({marks}) ORDER BY id DESC",
            tuple(latest),
        )
        out = []
        for _, family, content, runtime, kernel_json, resources, suspect in rows:
            if suspect or runtime is None or not runtime > 0:
                continue
            resources_dict = None if resources is None else json.loads(resources)
            out.append(
                AnchorPoint(str(kernel_json), str(family), str(content), float(runtime), resources_dict)
            )
            if len(out) >= limit:
                break
        return out

    async def best_runtime(self, family_key: str, hardware: str, workload_key: str) -> float | None:
        """The fastest runtime (ms) among `family_points` measured ok, if any (one query, no JSON decoding)."""
        rows = await self._fetch(
            f"SELECT MIN(runtime_ms) FROM {_FAMILY_LATEST} WHERE status = 'ok' AND runtime_ms > 0",
            (family_key, hardware, workload_key),
        )
        return float(rows[0][0]) if rows and rows[0][0] is not None else None

    async def measured_interval(
        self, content_key: str, hardware: str, workload_key: str
    ) -> tuple[float, float, float, int] | None:
        """(median, low, high, runs) of the latest ok measurement of this exact kernel, if stored: its median
        runtime (ms), the 95% interval of that median, and its number of timed runs."""
        found = await self.measured_runtime(content_key, hardware, workload_key)
        return None if found is None else found[0]

    async def measured_runtime(
        self, content_key: str, hardware: str, workload_key: str
    ) -> tuple[tuple[float, float, float, int], list[str]] | None:
        """`measured_interval` of the latest ok measurement of this exact kernel, with that measurement's flags."""
        rows = await self._fetch(
            "SELECT runtime_ms, json_extract(result_json, '$.runtime_ms.ci95_low'), "
            "json_extract(result_json, '$.runtime_ms.ci95_high'), json_extract(result_json, '$.runtime_ms.runs'), "
            "json_extract(result_json, '$.flags') "
            "FROM measurements WHERE content_key = ? AND hardware = ? AND workload_key = ? AND status = 'ok' "
            "AND runtime_ms > 0 ORDER BY id DESC LIMIT 1",
            (content_key, hardware, workload_key),
        )
        if not rows:
            return None
        median, low, high, runs, flags_json = rows[0]
        median = float(median)
        low = float(low) if isinstance(low, int | float) else median
        high = float(high) if isinstance(high, int | float) else median
        interval = median, min(low, median), max(high, median), int(runs) if isinstance(runs, int) else 1
        try:
            flags = json.loads(flags_json) if isinstance(flags_json, str) else []
        except ValueError:
            flags = []
        return interval, [str(f) for f in flags] if isinstance(flags, list) else []

    async def failed_status(self, content_key: str, hardware: str, workload_key: str) -> str | None:
        """The status of this exact kernel's latest measurement when it failed (compile or launch error, wrong
        output, an out-of-bounds write) and it was never measured ok; None otherwise. What is never served from
        cache (a crashed worker, a device out of memory, a timeout, which depends on the cap asked for) says
        nothing final of the kernel and does not count."""
        rows = await self._fetch(
            "SELECT status FROM measurements WHERE content_key = ? AND hardware = ? AND workload_key = ? "
            f"AND status NOT IN ({_PLACES}) AND {_KERNELS_OWN} "
            "ORDER BY status = 'ok' DESC, id DESC LIMIT 1",
            (content_key, hardware, workload_key, *_NOT_CACHEABLE),
        )
        return str(rows[0][0]) if rows and rows[0][0] != "ok" else None

    # ---------------------------------------------------------------- forecasts

    async def save_forecasts(self, rows: list[ForecastRow]) -> list[int]:
        """Store forecasts; any whose two kernels are already measured are verified at once."""
        if not rows:
            return []
        params = []
        now = time.time()
        for r in rows:
            if len(r.probs) != bins.N_BINS or not all(math.isfinite(p) for p in r.probs):
                raise ValueError(f"a forecast needs {bins.N_BINS} finite probabilities, got {r.probs!r}")
            if r.max_confidence is not None and not 0.0 <= r.max_confidence <= 1.0:
                raise ValueError(f"a forecast's max_confidence is a probability, got {r.max_confidence!r}")
            params.append(
                (
                    r.ledger, r.forecaster, r.hardware, r.workload_key, r.baseline_key, r.candidate_key,
                    json.dumps([float(p) for p in r.probs]), float(r.p_faster), r.verdict, r.decided_by, now,
                    r.family_key, r.p_fail, r.p_fail_baseline, r.max_confidence,
                )
            )  # fmt: skip
        ledgers = sorted({r.ledger for r in rows if r.ledger is not None})

        totals: dict[str, list[int]] = {}
        for r in rows:
            if r.ledger is not None:
                t = totals.setdefault(r.ledger, [0, 0, 0])
                t[0] += 1
                t[1] += int(r.decided_by == "forecast" and r.verdict != "unsure")
                t[2] += int(r.verdict == "unsure" or r.decided_by == "measurement")

        async def body(conn: Any) -> list[int]:
            for name in ledgers:
                if await self._ledger_row(conn, name) is None:
                    raise _unknown_ledger(name)
            # The new row replaces the pair's unverified ones (only the last forecast of a pair is read).
            await conn.executemany(
                "DELETE FROM forecasts WHERE hardware = ? AND workload_key = ? AND baseline_key = ? "
                "AND candidate_key = ? AND forecaster = ? AND ledger IS ? AND actual_speedup IS NULL",
                sorted(
                    {
                        (r.hardware, r.workload_key, r.baseline_key, r.candidate_key, r.forecaster, r.ledger)
                        for r in rows
                    },
                    key=repr,
                ),
            )
            await conn.executemany(
                "INSERT INTO forecast_totals (ledger, made, decided, deferred) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(ledger) DO UPDATE SET made = made + excluded.made, "
                "decided = decided + excluded.decided, deferred = deferred + excluded.deferred",
                [(name, *t) for name, t in sorted(totals.items())],
            )
            before = await conn.execute_fetchall("SELECT coalesce(max(id), 0) FROM forecasts")
            first = int(before[0][0])
            await conn.executemany(
                "INSERT INTO forecasts (ledger, forecaster, hardware, workload_key, baseline_key, "
                "candidate_key, probs_json, p_faster, verdict, decided_by, created_at, family_key, p_fail, "
                "p_fail_baseline, max_confidence) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                params,
            )
            # We hold the write lock, so the new rows are exactly those above the previous maximum id.
            ids = await conn.execute_fetchall("SELECT id FROM forecasts WHERE id > ? ORDER BY id", (first,))
            await conn.execute(_VERIFY + "id > ?", (now, first))
            await conn.execute(_VERIFY_FAILED + "id > ?", (now, first))
            return [int(i[0]) for i in ids]

        return await self._write(body)

    async def verified_pairs(
        self, forecaster: str | None = None, hardware: str | None = None
    ) -> list[VerifiedPair]:
        """Forecasts checked by measurements, oldest first; rows decided by cache (measured truth) omitted.

        One row per forecaster and pair of kernels (on one GPU and workload, either kernel the baseline): the
        last forecast made before the pair was measured. A search loop asks about the same untried candidate
        again and again, and each copy counted as a pair of its own would let one outcome certify a threshold
        or weigh in a calibration several times over. None whose runtimes include a suspect measurement
        (`_ON_TRUSTED_KERNELS`): its speedup is not the kernels' (a kernel that skipped its work measured
        2000x faster), and recalibrating or certifying a threshold on it would score the forecast against it."""
        rows = await self._fetch(
            f"WITH {_SUSPECT_KERNELS} SELECT {_VERIFIED_COLS} FROM forecasts WHERE id IN "
            "(SELECT MAX(id) FROM forecasts WHERE actual_speedup IS NOT NULL "
            "AND decided_by != 'cache' AND (? IS NULL OR forecaster = ?) AND (? IS NULL OR hardware = ?) "
            f"AND {_ON_TRUSTED_KERNELS} GROUP BY forecaster, {_PAIR}) ORDER BY id",
            (forecaster, forecaster, hardware, hardware),
        )
        return [_verified_pair(r) for r in rows]

    async def verified_changes(self, since: int | None = None) -> VerifiedChanges:
        """`verified_pairs` (of every forecaster and GPU) as changes since sequence number `since`, for a reader
        that keeps them: the pairs whose rows were verified or re-verified since (forecasts.verify_seq, migration
        10), and each one's verified pair now (none when it has none: its kernel's latest measurement is flagged).
        A pair's verified row and whether it counts change only when one of its rows is (re-)verified: a new
        measurement of either kernel re-verifies every row of that kernel. `since` None: every pair (a full read).

        Applied in order to what the previous calls returned (replace each of `groups` by its entry in `pairs`,
        or drop it), it gives what `verified_pairs()` returns now."""

        async def body(conn: Any) -> VerifiedChanges:
            top = await conn.execute_fetchall("SELECT coalesce(max(verify_seq), 0) FROM forecasts")
            seq = int(top[0][0])
            if since is None:
                # Every verified row: the suspect kernels found once (_ON_TRUSTED_KERNELS), not per row.
                rows = await conn.execute_fetchall(
                    f"WITH {_SUSPECT_KERNELS} SELECT {_VERIFIED_COLS}, {_GROUP_COLS} FROM forecasts WHERE id IN "
                    "(SELECT MAX(id) FROM forecasts WHERE actual_speedup IS NOT NULL AND decided_by != 'cache' "
                    f"AND {_ON_TRUSTED_KERNELS} GROUP BY forecaster, {_PAIR}) ORDER BY id"
                )
                pairs = [(_group(r[_N_VERIFIED_COLS:]), _verified_pair(r)) for r in rows]
                return VerifiedChanges(seq, [g for g, _ in pairs], pairs, full=True)
            if seq <= since:
                return VerifiedChanges(seq, [], [], full=False)
            changed = [
                _group(r)
                for r in await conn.execute_fetchall(
                    f"SELECT DISTINCT {_GROUP_COLS} FROM forecasts WHERE verify_seq > ? AND verify_seq <= ?",
                    (since, seq),
                )
            ]
            # Every row of those pairs, either kernel the baseline (two lookups on forecasts_pair), then the
            # verified pair of each as verified_pairs picks it.
            rows = await conn.execute_fetchall(
                f"WITH {_SUSPECT_KERNELS}, changed(forecaster, hardware, workload_key, lo, hi) AS "
                f"(SELECT DISTINCT {_GROUP_COLS} FROM forecasts WHERE verify_seq > ? AND verify_seq <= ?) "
                f"SELECT {_VERIFIED_COLS}, {_GROUP_COLS} FROM forecasts WHERE id IN "
                "(SELECT MAX(id) FROM forecasts WHERE id IN ("
                "SELECT f.id FROM changed AS c JOIN forecasts AS f ON f.hardware = c.hardware "
                "AND f.workload_key = c.workload_key AND f.baseline_key = c.lo AND f.candidate_key = c.hi "
                "AND f.forecaster = c.forecaster UNION "
                "SELECT f.id FROM changed AS c JOIN forecasts AS f ON f.hardware = c.hardware "
                "AND f.workload_key = c.workload_key AND f.baseline_key = c.hi AND f.candidate_key = c.lo "
                "AND f.forecaster = c.forecaster) "
                "AND actual_speedup IS NOT NULL AND decided_by != 'cache' "
                f"AND {_ON_TRUSTED_KERNELS} GROUP BY forecaster, {_PAIR}) ORDER BY id",
                (since, seq),
            )
            return VerifiedChanges(
                seq, changed, [(_group(r[_N_VERIFIED_COLS:]), _verified_pair(r)) for r in rows], full=False
            )

        return await self._read_tx(body)

    # ---------------------------------------------------------------- Claude usage

    async def record_llm_usage(
        self,
        *,
        ledger: str | None,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cache_read_tokens: int,
        cache_write_tokens: int,
        cost_usd: float,
    ) -> None:
        async def body(conn: Any) -> None:
            if ledger is not None and await self._ledger_row(conn, ledger) is None:
                raise _unknown_ledger(ledger)
            await conn.execute(
                "INSERT INTO llm_usage (ledger, model, input_tokens, output_tokens, cache_read_tokens, "
                "cache_write_tokens, cost_usd, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    ledger, model, int(input_tokens), int(output_tokens), int(cache_read_tokens),
                    int(cache_write_tokens), float(cost_usd), time.time(),
                ),
            )  # fmt: skip

        await self._write(body)

    # ---------------------------------------------------------------- calibration state (opaque JSON)

    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None:
        async def body(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO calibration (forecaster, hardware, state_json, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (forecaster, hardware) DO UPDATE SET state_json = excluded.state_json, "
                "updated_at = excluded.updated_at",
                (forecaster, hardware, state_json, time.time()),
            )

        await self._write(body)

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None:
        rows = await self._fetch(
            "SELECT state_json FROM calibration WHERE forecaster = ? AND hardware = ?", (forecaster, hardware)
        )
        return str(rows[0][0]) if rows else None

    async def save_family_state(
        self, family_key: str, hardware: str, workload_key: str, state_json: str
    ) -> None:
        """What the local model keeps of a family between fits (its hyperparameters), for the next process."""

        async def body(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO family_state (family_key, hardware, workload_key, state_json, updated_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (family_key, hardware, workload_key) DO UPDATE SET "
                "state_json = excluded.state_json, updated_at = excluded.updated_at",
                (family_key, hardware, workload_key, state_json, time.time()),
            )

        await self._write(body)

    async def load_family_state(self, family_key: str, hardware: str, workload_key: str) -> str | None:
        rows = await self._fetch(
            "SELECT state_json FROM family_state WHERE family_key = ? AND hardware = ? AND workload_key = ?",
            (family_key, hardware, workload_key),
        )
        return str(rows[0][0]) if rows else None

    # ---------------------------------------------------------------- reports

    async def ledger_report(self, ledger: str) -> dict[str, Any]:
        """Everything budget_status shows: limit/spent/reserved/remaining; measurements (count, cache_hits,
        failures); forecasts (count, decided, deferred, verified, verified_correct); gpu_seconds_saved
        (cache hits' recorded cost + estimated cost of measurements decided forecasts avoided);
        llm usage (calls, tokens, cost_usd). UnknownLedger if missing.

        Definitions (rows of this ledger only):
        - measurements.count includes cache hits; failures: rows whose status is not ok.
        - forecasts.decided: decided_by forecast with verdict faster/slower; deferred: verdict unsure or
          decided_by measurement; rows decided by cache count only in `count`.
        - forecasts.verified: pairs of kernels decided by a forecast whose two kernels were later measured
          (the last forecast of each pair), ties within noise (|log2 S| <= bins.TIE_LOG2, as in
          forecast.metrics.pairwise_accuracy) and pairs resting on a suspect measurement (`verified_pairs`)
          left out; verified_correct: those naming the faster kernel; accuracy: correct/verified.
        - gpu_seconds_saved.cache: what the results served from cache cost when measured; .forecasts: pairs
          decided by a forecast and never measured since, times the median charge of this ledger's
          non-cached measurements.
        - calibration: Brier of the stored p_faster (the probability the verdict was decided by,
          selective.decision_p) against S > 1 (forecast.metrics.brier) over every verified pair (the
          last forecast of each) not decided by cache (unsure ones included), ties left out; verified_pairs:
          how many."""

        # A crashed owner's hold is released first, so the report does not show it as reserved (it would be
        # until the next reservation on this database released it).
        await self.release_orphans(best_effort=True)

        async def body(conn: Any) -> dict[str, Any] | None:
            row = await self._ledger_row(conn, ledger)
            if row is None:
                return None
            m = (
                await conn.execute_fetchall(
                    "SELECT count(*), coalesce(sum(cached), 0), coalesce(sum(status != 'ok'), 0), "
                    "coalesce(sum(charged_micro), 0), coalesce(sum(saved_micro), 0) "
                    "FROM measurements WHERE ledger = ?",
                    (ledger,),
                )
            )[0]
            costs = await conn.execute_fetchall(
                "SELECT charged_micro FROM measurements WHERE ledger = ? AND cached = 0", (ledger,)
            )
            # Charges for runs whose result could not be stored: no measurement row either, but not cancelled.
            not_saved = (
                await conn.execute_fetchall(
                    "SELECT coalesce(sum(spent_delta_micro), 0) FROM ledger_events INDEXED BY ledger_events_not_saved "
                    f"WHERE ledger = ? AND {NOT_SAVED_COMMITS}",
                    (ledger,),
                )
            )[0][0]
            # Every forecast made counts, also those a later forecast of the same pair replaced.
            f = (
                await conn.execute_fetchall(
                    "SELECT made, decided, deferred FROM forecast_totals WHERE ledger = ?", (ledger,)
                )
                or [(0, 0, 0)]
            )[0]
            # One row per pair of kernels (the last forecast of it): a loop that asks about the same pair again
            # and again has still had one forecast checked. Whatever name it was stored under: a pair asked
            # before and after its baseline was measured is stored under two (the regime's suffix, `:unmeasured`),
            # and counted once per name it was one pair verified twice, and one measurement spared twice.
            # The columns of each pair's MAX(id) row are SQLite's bare columns of a max() aggregate (taken from
            # that row), read from forecasts_ledger_verified without looking the row up (migration 11). Oldest
            # first, as the rows were always read: the Brier score sums them in this order.
            verified = await conn.execute_fetchall(
                f"WITH {_SUSPECT_KERNELS} SELECT verdict, decided_by, p_faster, actual_speedup FROM "
                "(SELECT MAX(id) AS id, verdict, decided_by, p_faster, actual_speedup FROM forecasts "
                "WHERE ledger = ? AND actual_speedup IS NOT NULL "
                f"AND decided_by != 'cache' AND {_ON_TRUSTED_KERNELS} GROUP BY {_PAIR}) ORDER BY id",
                (ledger,),
            )
            # Measurements a decided verdict spared: pairs decided by a forecast and never measured after.
            spared = (
                await conn.execute_fetchall(
                    "SELECT count(*) FROM (SELECT 1 FROM forecasts WHERE ledger = ? "
                    "AND decided_by = 'forecast' AND verdict != 'unsure' AND actual_speedup IS NULL "
                    f"GROUP BY {_PAIR})",
                    (ledger,),
                )
            )[0][0]
            llm = (
                await conn.execute_fetchall(
                    "SELECT count(*), coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0), "
                    "coalesce(sum(cost_usd), 0.0), coalesce(sum(cache_read_tokens), 0), "
                    "coalesce(sum(cache_write_tokens), 0), "
                    # Every known price is positive: tokens recorded at cost 0 are of a model with no price.
                    "coalesce(sum(CASE WHEN cost_usd = 0 THEN input_tokens + output_tokens + cache_read_tokens "
                    "+ cache_write_tokens ELSE 0 END), 0) FROM llm_usage WHERE ledger = ?",
                    (ledger,),
                )
            )[0]
            return {
                "ledger": row, "m": m, "costs": costs, "not_saved": not_saved, "f": f, "verified": verified, "spared": spared, "llm": llm,
            }  # fmt: skip

        raw = await self._read_tx(body)
        if raw is None:
            raise _unknown_ledger(ledger)
        limit, spent, reserved = (int(x) for x in raw["ledger"][1:4])
        not_saved = int(raw["not_saved"])
        m, f, llm = raw["m"], raw["f"], raw["llm"]
        scored = [(v, by, p, float(s)) for v, by, p, s in raw["verified"] if not bins.is_tie(float(s))]
        decided_checked = [(str(v), s) for v, by, _, s in scored if by == "forecast" and v != "unsure"]
        correct = sum((v == "faster") == (s > 1.0) for v, s in decided_checked)
        outcomes = [(float(p), 1.0 if s > 1.0 else 0.0) for _, _, p, s in scored]
        decided = int(f[1])
        typical_cost = statistics.median(int(c[0]) for c in raw["costs"]) if raw["costs"] else 0
        return {
            "limit_gpu_seconds": _gs(limit),
            "spent_gpu_seconds": _gs(spent),
            "reserved_gpu_seconds": _gs(reserved),
            "remaining_gpu_seconds": _gs(limit - spent - reserved),
            "measurements": {
                "count": int(m[0]),
                "cache_hits": int(m[1]),
                "failures": int(m[2]),
                "gpu_seconds": _gs(int(m[3])),
                # Only measurements charge a ledger; a cancelled one is charged its device time but stores no
                # row, so it is what spent holds beyond the rows' charges and those of results not saved.
                "cancelled_gpu_seconds": _gs(max(0, spent - int(m[3]) - not_saved)),
                "not_saved_gpu_seconds": _gs(not_saved),
            },
            "forecasts": {
                "count": int(f[0]),
                "decided": decided,
                "deferred": int(f[2]),
                "verified": len(decided_checked),
                "verified_correct": correct,
                "accuracy": correct / len(decided_checked) if decided_checked else None,
            },
            "gpu_seconds_saved": {
                "cache": _gs(int(m[4])),
                "forecasts": int(raw["spared"]) * typical_cost / MICRO,
            },
            "llm": {
                "calls": int(llm[0]),
                "input_tokens": int(llm[1]),
                "output_tokens": int(llm[2]),
                "cache_read_tokens": int(llm[4]),
                "cache_write_tokens": int(llm[5]),
                "cost_usd": float(llm[3]),
                "unpriced_tokens": int(llm[6]),
            },
            "calibration": {
                "verified_pairs": len(outcomes),
                "brier": sum((p - y) ** 2 for p, y in outcomes) / len(outcomes) if outcomes else None,
            },
        }


def _expiry(now: float, gpu_seconds: float) -> float:
    """When a hold of `gpu_seconds` taken (or last extended) at `now` may be released as an orphan by a server
    that cannot check its owner."""
    return now + EXPIRY_FACTOR * gpu_seconds + EXPIRY_GRACE_S


async def _key_in_progress(
    conn: Any, ledger: str | None, idempotency_key: str
) -> MeasurementInProgress | None:
    """The refusal to give while an open hold on `ledger` carries `idempotency_key` (a measurement under it is
    still running, possibly in another process), else None."""
    running = await conn.execute_fetchall(
        "SELECT 1 FROM reservations WHERE ledger = ? AND idempotency_key = ? AND state = 'open'",
        (ledger, idempotency_key),
    )
    if not running:
        return None
    return MeasurementInProgress(
        f"a measurement with idempotency_key {idempotency_key!r} is still running on ledger {ledger!r}; call "
        "again with the same key when it has finished (it will not be charged twice)"
    )


def _exhausted(ledger: str, limit: int, spent: int, reserved: int, amount: int) -> BudgetExhausted:
    held = f", {fmt_gpu_seconds(_gs(reserved))} held by measurements in progress" if reserved else ""
    left = limit - spent - reserved
    # A measurement holds its time cap up front: with something left, a smaller cap may still fit.
    smaller = (
        f"pass max_seconds at most {fmt_gpu_seconds(_gs(left))} to measure within what is left, or "
        if left >= round(MIN_MEASURE_SECONDS * MICRO)
        else ""
    )
    # A hold is a measurement's whole cap, most of it released unused when it ends: budget held is not spent.
    # Said only where this measurement would fit once nothing is held (not of a cap above what is unspent).
    wait = (
        "What is held comes back, less what those measurements use, as each finishes: call again then. "
        if reserved and amount <= limit - spent
        else ""
    )
    return BudgetExhausted(
        f"ledger '{ledger}' has {fmt_gpu_seconds(_gs(left))} {BUDGET_EXHAUSTED_TEXT} "
        f"(limit {fmt_gpu_seconds(_gs(limit))}, spent {fmt_gpu_seconds(_gs(spent))}{held}); "
        f"this measurement needs up to {fmt_gpu_seconds(_gs(amount))}. {wait}"
        f"Forecasts with compare_kernels are free; {smaller}"
        f"ask the operator to top up (forecaster-mcp ledger topup {ledger} --gpu-seconds N)",
        left_gpu_seconds=_gs(max(left, 0)),
        needed_gpu_seconds=_gs(amount),
    )
