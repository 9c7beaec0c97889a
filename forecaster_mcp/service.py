"""The product's behaviour, free of MCP: compare, measure and budget on top of the seams.

The MCP layer (server/app.py) maps tool calls onto `Service` methods and `AgentError`s onto `ToolError`s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from forecaster_mcp import __version__, bins
from forecaster_mcp.errors import (
    BUDGET_EXHAUSTED_TEXT,
    AgentError,
    AlreadyMeasured,
    BudgetExhausted,
    InvalidRequest,
    MeasurementInProgress,
    NotMeasurable,
    OperatorError,
    ResultNotSaved,
    SameMeasurementRunning,
    ServerBusy,
    UnknownLedger,
)
from forecaster_mcp.forecast.base import USAGE_LEDGER, Forecaster, PairQuery, close_forecasters
from forecaster_mcp.forecast.engine import one_line, smallest_default_target
from forecaster_mcp.forecast.features import PYTHON_LANGUAGES, entry_parameter_count
from forecaster_mcp.forecast.local import member_key
from forecaster_mcp.forecast.selective import (
    MAX_TARGET_ERROR,
    MIN_TARGET_ERROR,
    ThresholdChoice,
    decide,
    decision_p,
    p_fail_baseline_of,
)
from forecaster_mcp.hardware import specs
from forecaster_mcp.measure.base import (
    OCCUPIED_ATTR,
    Measurer,
    MeasureRequest,
    ProgressCallback,
    history_device,
)
from forecaster_mcp.measure.timing import median_ci_covers
from forecaster_mcp.measure.worker_protocol import REFERENCE_FAILURE_PREFIX
from forecaster_mcp.models import (
    CONTROL_CHARACTER,
    MAX_CANDIDATES,
    MIN_MEASURE_SECONDS,
    REPLAY_HISTORY_MARK,
    SUSPECT_FLAGS,
    BufferArg,
    CandidateForecast,
    CompareResult,
    DecidedBy,
    Kernel,
    MeasureCost,
    MeasureResult,
    Verdict,
    Workload,
    candidate_count_problem,
    history_gpu,
)
from forecaster_mcp.reports import BudgetStatus, GpuSpecRow
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import (
    NOT_CACHEABLE,
    NOT_THE_KERNELS,
    REFERENCE_FAILED,
    TIMEOUT_UNDER_LOWERED_CAP,
    ForecastRow,
    IdempotentRequest,
    KeyClaim,
    Reservation,
    Store,
    fmt_gpu_seconds,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_NORM = re.compile(r"[^a-z0-9]+")


def _norm(name: str) -> str:
    return _NORM.sub("", name.lower().replace("nvidia", "").replace("geforce", ""))


def _names_device(wanted: str, spec: specs.GpuSpec | None, device: str) -> bool:
    """Whether `wanted` (not the device's exact name nor its spec row) still means this device.

    When both names are in the spec table, only a bare family name does ("A100" for an A100-PCIE-40GB,
    "H100" for an H100 PCIe): "A10" or "RTX 3080" (for a 3080 Ti) are other GPUs. Otherwise `wanted` must be
    a run of whole words of the device's name that includes its model number ("GTX 1080" or "1080" for an
    "NVIDIA GeForce GTX 1080"), so fragments such as "1", "40", "GB" or "PCIE" match nothing.
    """
    device_spec = specs.lookup(device)
    if spec is not None and device_spec is not None:
        return any(_norm(alias) == _norm(wanted) for alias in device_spec.aliases)
    want, have = specs.name_words(wanted), specs.name_words(device)
    if not want or len(want) > len(have):
        return False
    model = next((i for i, t in enumerate(have) if any(c.isdigit() for c in t)), 0)
    return any(
        have[start : start + len(want)] == want and start <= model < start + len(want)
        for start in range(len(have) - len(want) + 1)
    )


@dataclass
class HardwareChoice:
    name: str  # canonical name used in answers
    spec: specs.GpuSpec | None
    device_of: Measurer | None  # the measurer that has this device, if any
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """What this GPU's measurements, forecasts and calibration are stored under (measure.base.history_device):
        its name, or for a replayed device its name and recordings."""
        return history_device(self.device_of, self.name)


@dataclass
class _Pair:
    candidate: Kernel
    truth: CandidateForecast | None = None
    query: PairQuery | None = None


# Float slack when comparing a threshold with a confidence ceiling (1 - 2e-4 / 2 is not exactly 1 - 1e-4).
_CONFIDENCE_EPS = 1e-12


def _out_of_reach_note(
    target: float,
    out_of_reach: Sequence[tuple[float, float, float]],
    n_forecasts: int,
    measuring: bool,
    capped: bool = False,
) -> str:
    """Why forecasts stay unsure whatever they say: at this target_error their threshold is above the most
    confident they can be (a target below about 2e-4 asked for verdicts no forecast can give; an answer its
    forecaster capped, `capped`: a young family's estimate, at most 85% sure), and the target_error from which
    they can be decided."""
    threshold = max(t for t, _, _ in out_of_reach)
    ceiling = max(c for _, c, _ in out_of_reach)
    needed = max(n for _, _, n in out_of_reach) * (1.0 - 1e-9)  # float slack, not a rounding up of the need
    exponent = math.floor(math.log10(needed)) - 1
    shown = math.ceil(needed / 10.0**exponent) * 10.0**exponent  # rounded up to 2 significant digits
    measure = (
        "measure_if_unsure measures them"
        if measuring
        else "measure_if_unsure=true settles them by measurement"
    )
    return (
        f"target_error {target:g} is out of the forecasts' reach: {len(out_of_reach)} of {n_forecasts} can be at "
        f"most {ceiling:.6g} sure under this forecaster's calibration"
        f"{' and the caps its answers from few measurements set on themselves' if capped else ''}, below the "
        f"{threshold:.6g} this target "
        f"needs, so they are unsure whatever they forecast; they can be decided from target_error {shown:.2g} "
        f"on ({measure}, up to max_measurements)"
    )


class Service:
    """Compare, measure and report, for one server process. Open with `await Service.open(settings)`."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        forecasters: Sequence[Forecaster],
        measurers: Sequence[Measurer],
        measurer_notes: Sequence[str] = (),
    ) -> None:
        from forecaster_mcp.compile_slots import COMPILE_SLOTS
        from forecaster_mcp.forecast.engine import ForecastEngine

        # Process-wide: every compile of this server, forecasts' and measurements', shares these slots.
        COMPILE_SLOTS.set_limit(settings.max_concurrent_compiles)
        self.settings = settings
        self.store = store
        self.engine = ForecastEngine(list(forecasters), store, timeout_s=settings.forecast_timeout_s)
        self.measurers = list(measurers)
        self.measurer_notes = list(measurer_notes)
        self._inflight: dict[tuple[str, ...], anyio.Event] = {}

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(cls, settings: Settings, *, http: bool = False) -> Service:
        """Open the store and build the forecasters and measurers the settings and machine allow. A stdio
        server creates the `default` ledger when it charges that one; an HTTP server charges each token's own
        ledger and creates none."""
        store = await Store.open(settings.db_path)
        try:
            forecasters = build_forecasters(settings, store)
            measurers, notes = build_measurers(settings)
            if settings.ledger == "default" and not http:
                await store.ensure_ledger("default", settings.default_ledger_gpu_seconds)
        except BaseException:
            await store.close()
            raise
        return cls(settings, store, forecasters, measurers, notes)

    async def preload(self) -> None:
        """Warm what the first calls would otherwise wait for: the replay recordings' parsing (0.1-0.4 s a
        file), then the forecast engine's first read of the verified pairs (a full read: 6 s on a store of
        200,000 forecasts, benchmarks/bench_store_growth.py, which the first compare_kernels paid). A call
        arriving meanwhile waits for the same work (the recording's load, the engine's lock); none is done
        twice."""
        for m in self.measurers:
            warm = getattr(m, "preload", None) or getattr(getattr(m, "inner", None), "preload", None)
            if warm is not None:
                try:
                    await warm()
                except NotMeasurable as exc:  # a recording that cannot be read: each use of it says so too
                    print(f"forecaster-mcp: warning: {one_line(str(exc), 400)}", file=sys.stderr)
                except Exception:
                    log.warning("preloading %s failed", m.name, exc_info=True)
        try:
            await self.engine.refresh()
        except Exception:  # the first compare_kernels reads again (and keeps forecasting if that fails too)
            log.warning("preloading the forecast engine failed", exc_info=True)

    async def close(self) -> None:
        # The forecasters first: Claude's requests still running record their usage in the store.
        await close_forecasters(self.engine.forecasters)
        for m in self.measurers:
            closer = getattr(m, "aclose", None)
            if closer is not None:
                await closer()
        await self.store.close()

    # ------------------------------------------------------------------ hardware

    def devices(self) -> list[str]:
        return [d for m in self.measurers for d in m.devices()]

    def _measured_elsewhere_notes(self, name: str) -> list[str]:
        """For a GPU this server does not measure on, while it measures on others: what it measures there
        (stored under that device) never reaches forecasts for `name`."""
        have = self.devices()
        if not have:
            return []
        return [
            f"this server measures on {', '.join(have)}, not {name}: forecasts for {name} do not learn from "
            f"those measurements; pass hardware={have[0]!r} to forecast for the device measure_kernel uses"
        ]

    def resolve_hardware(self, hardware: str | None) -> HardwareChoice:
        """Forgiving GPU-name resolution: measurement devices first, then the spec table."""
        wanted = hardware or self.settings.hardware
        if wanted is None:
            for m in self.measurers:
                for d in m.devices():
                    return HardwareChoice(d, specs.lookup(d), m)
            return HardwareChoice(
                "unknown",
                None,
                None,
                [
                    "no hardware given and this server has no measurement device: pass hardware (e.g. 'H100') "
                    "for hardware-aware forecasts"
                ],
            )
        wanted = wanted.strip()
        if not wanted or len(wanted) > 128 or CONTROL_CHARACTER.search(wanted):
            # One line of text: the name reaches the Claude prompt and the store as it is.
            raise InvalidRequest(
                "hardware must be a GPU name such as 'H100' or 'A100-80GB' (one line, at most 128 characters)"
            )
        spec = specs.lookup(wanted)
        key = _norm(wanted)
        for m in self.measurers:
            for d in m.devices():
                if (spec is not None and specs.lookup(d) == spec) or _norm(d) == key:
                    return HardwareChoice(d, spec or specs.lookup(d), m)
        for m in self.measurers:
            for d in m.devices():
                if _names_device(wanted, spec, d):
                    return HardwareChoice(d, specs.lookup(d), m)
        # A name that does not settle the form factor or memory ("A100 40GB") picks its family's first row
        # (SXM4); a measurement device of the same model that it does not contradict (an A100-PCIE-40GB) is
        # what the caller means. Taken for another GPU, the forecasts never learned from the measurements.
        for m in self.measurers:
            for d in m.devices():
                device_spec = specs.lookup(d)
                if spec is not None and device_spec is not None and specs.could_be(wanted, device_spec):
                    return HardwareChoice(d, device_spec, m)
        # An architecture ("gfx942", "sm_90") is no one GPU: the one measurement device of it is what the caller
        # means; without one, the caller is asked to name the GPU (below).
        of_arch = specs.same_architecture(wanted)
        if of_arch:
            of_it = [
                (d, m, s) for m in self.measurers for d in m.devices() if (s := specs.lookup(d)) in of_arch
            ]
            if len(of_it) == 1:
                d, m, s = of_it[0]
                return HardwareChoice(d, s, m)
        # A recording that names no GPU (device_name empty, a file name that is no GPU's): the only such device
        # is the one the caller means, whatever it calls it; the caller's name gives the specification.
        unnamed = [(d, m) for m in self.measurers for d in getattr(m, "unnamed_devices", list)()]
        if len(unnamed) == 1:
            d, m = unnamed[0]
            return HardwareChoice(
                d,
                spec,
                m,
                [f"the recording of device {d!r} names no GPU: taken to be the {wanted} this call names"],
            )
        if spec is not None:
            return HardwareChoice(spec.name, spec, None, self._measured_elsewhere_notes(spec.name))
        if of_arch and hardware:
            # Forecast as a GPU nobody knows, it lost every hardware feature the table has for each GPU of it. (A
            # configured --hardware gets the note below instead: an error would refuse every call.)
            names = [s.name for s in of_arch]
            listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise InvalidRequest(
                f"hardware {wanted!r} is an architecture, not a GPU: name the GPU, one of {listed} (or another "
                "GPU of it; the gpu-specs resource lists the known ones)"
            )
        close = specs.suggest(wanted, limit=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        return HardwareChoice(
            wanted,
            None,
            None,
            [
                f"no specification known for GPU {wanted!r}: forecast made without hardware-specific features "
                f"({hint}known GPUs are listed in the gpu-specs resource)",
                *self._measured_elsewhere_notes(wanted),
            ],
        )

    def gpu_specs(self) -> list[GpuSpecRow]:
        return [GpuSpecRow.from_spec(s) for s in specs.all_specs()]

    # ------------------------------------------------------------------ compare_kernels

    async def compare(
        self,
        *,
        ledger: str | None,
        candidates: Sequence[Kernel],
        workload: Workload,
        baseline: str | None,
        hardware: str | None,
        target_error: float | None,
        measure_if_unsure: bool,
        max_measurements: int,
        progress: ProgressCallback | None = None,
    ) -> CompareResult:
        kernels = _assign_ids(candidates)
        workload = self._seen_by(ledger, workload)
        base_id = baseline if baseline is not None else kernels[0].id
        by_id = {k.id: k for k in kernels}
        if base_id not in by_id:
            raise InvalidRequest(
                f"baseline {str(base_id)[:80]!r} is not a candidate id; ids in this call: "
                f"{', '.join(map(str, by_id))}"
            )
        target = self.settings.target_error if target_error is None else target_error
        if not MIN_TARGET_ERROR <= target < MAX_TARGET_ERROR:
            whose = "" if target_error is not None else f" (this server's default is {target:g}; pass one)"
            raise InvalidRequest(
                f"target_error must be at least {MIN_TARGET_ERROR:g} and below {MAX_TARGET_ERROR:g} (e.g. 0.1 "
                f"= at most 10% wrong verdicts){whose}"
            )
        if max_measurements < 0 or max_measurements > MAX_CANDIDATES:
            raise InvalidRequest(f"max_measurements must be between 0 and {MAX_CANDIDATES}")
        if ledger is not None and (measure_if_unsure or self._forecasts_paid()):
            await self._require_ledger(ledger)
        hw = self.resolve_hardware(hardware)
        base = by_id[base_id]
        assert base.id is not None
        wkey = workload.history_key()
        hkey = hw.key  # a replay's own history, apart from a real GPU's of the same name
        others = [k for k in kernels if k.id != base_id]

        measured, suspect = await self._measured(kernels, hkey, wkey)
        base_failed = await self._failed(base, hkey, wkey)
        pairs = [_Pair(k) for k in others]
        for p in pairs:
            m_base, m_cand = measured.get(base.id), measured.get(str(p.candidate.id))
            if m_base is not None and m_cand is not None:
                p.truth = _from_measurement(
                    str(p.candidate.id), m_base, m_cand, "cache", _suspicion(base.id, p.candidate.id, suspect)
                )
            else:
                p.query = PairQuery(base, p.candidate, workload, hkey, hw.spec)

        queries = [p.query for p in pairs if p.query is not None]
        # A paid forecaster (Claude) records its usage on the caller's ledger, not the server's default.
        token = USAGE_LEDGER.set(ledger)
        try:
            forecasts = await self.engine.forecast(queries) if queries else []
        finally:
            USAGE_LEDGER.reset(token)
        # Each regime (a model against a measured kernel, two unmeasured kernels, a static prior) has its own
        # verified history, hence its own threshold, and a kernel family with enough history of its own is
        # thresholded on it (forecast/engine.py).
        family = {str(q.candidate.id): q.candidate.family_key() for q in queries}  # hashes the source: once
        choices = {
            (f.regime, fam): await self.engine.threshold(hkey, target, f.regime, fam)
            for f, fam in zip(forecasts, family.values(), strict=True)
        }
        results: dict[str, CandidateForecast] = {}
        fc_by_id = {}
        base_member = member_key(base)
        measured_failing: set[str] = set()  # candidates whose stored measurement failed: they do not run
        it = iter(forecasts)
        # Forecasts the threshold is out of reach for (threshold, their ceiling, the target that reaches it).
        out_of_reach: list[tuple[float, float, float]] = []
        capped_out_of_reach = False  # one of them held to its forecaster's own cap (EngineForecast.caps)
        # The thresholds verdicts were decided at, as they apply to each forecast (engine.threshold_for: a capped
        # or partial forecast at no lower than its regime's default), for the notes.
        applied: list[ThresholdChoice] = []
        for p in pairs:
            cid = str(p.candidate.id)
            if p.truth is not None:
                results[cid] = p.truth
                continue
            f = next(it)
            fc_by_id[cid] = f
            choice = self.engine.threshold_for(f, choices[(f.regime, family[cid])])
            applied.append(choice)
            threshold = choice.threshold
            verdict = f.verdict(threshold)
            if choice.source == "default" and not f.from_measurements:
                ceiling = self.engine.confidence_ceiling(f, hkey)
                if threshold > ceiling + _CONFIDENCE_EPS:
                    out_of_reach.append((threshold, ceiling, smallest_default_target(f.regime, ceiling)))
                    capped_out_of_reach |= bool(f.caps)
            rationale = f.rationale
            if verdict == "unsure" and (plain := decide(f.p_faster, threshold)) != "unsure":
                p_fail, whose = (
                    (f.p_fail, "its")
                    if plain == "faster"
                    else (p_fail_baseline_of(f.extras), "the baseline's")
                )
                rationale += f"; unsure only for {whose} {p_fail:.0%} chance of failing to compile or run"
            elif verdict != "unsure" and decide(f.p_faster, threshold) != verdict:
                # Decided by a chance of failing, not by the runtimes (a "slower" at p_faster 0.5 whose rationale
                # said only "near 50/50", or one that said "baseline failed when measured"): say so.
                p_fail, whose = (
                    (f.p_fail, "its")
                    if verdict == "slower"
                    else (p_fail_baseline_of(f.extras), "the baseline's")
                )
                rationale += (
                    f"; {verdict} for {whose} {100 * p_fail:.3g}% chance of failing to compile or run"
                )
            if not f.from_measurements and member_key(p.candidate) == base_member:
                # Left out of measure_next (_measure_next): say why, as its forecast only says "near 50/50".
                rationale += (
                    "; the baseline's own configuration (its defines spelled otherwise, or the same kernel): "
                    "a tie, settled by the baseline's measurement"
                )
            if (unused := _suspicion(base.id, cid, suspect, learned=True)) is not None:
                rationale += f"; {unused}"
            # A candidate whose stored measurement failed is "slower" because it was measured, not forecast:
            # answered from the store ("cache"), neither saved as a forecast nor counted as one decided.
            measured_failed = f.extras.get("measured", 0.0) >= 1.0 and f.p_fail >= 1.0
            # So is a pair the local model found measured under other spellings of its parameters (0x20 for
            # 32): saved as a forecast, it later verified near-certain and right, and inflated the history
            # that certifies thresholds and the calibration fitted on forecasts.
            from_store = measured_failed or f.from_measurements
            if measured_failed:
                measured_failing.add(cid)
            both_ran = f.from_measurements and f.p_fail < 1.0 and p_fail_baseline_of(f.extras) < 1.0
            mu = f.extras.get("mu_log2", math.nan)
            # Likewise a candidate that ran against a baseline whose measurement failed is the faster one.
            if base_failed is not None and cid in measured:
                results[cid] = _one_side_failed(cid, base_failed, base_failed=True, by="cache")
                continue
            results[cid] = CandidateForecast(
                id=cid,
                p_faster=f.p_faster,
                speedup_bins=list(f.probs),
                expected_speedup=f.expected_speedup,
                verdict="slower" if measured_failed else verdict,
                decided_by="cache" if from_store else "forecast",
                rationale=rationale,
                # The chance the verdict rests on: either kernel's chance of failing counted, as decide() does
                # (a "faster" decided because the baseline likely fails reported the runtime's 0.93 for "slower").
                confidence=max(
                    dp := decision_p(f.p_faster, f.p_fail, p_fail_baseline_of(f.extras)), 1.0 - dp
                ),
                measured_speedup=2.0**mu if both_ran and math.isfinite(mu) else None,
            )
        # Saved once the call succeeds (below): a compare refused for its measurements records nothing.
        forecast_results = dict(results)

        async def next_to_measure() -> list[str]:
            """measure_next as things stand (measured and results as they are now)."""
            return await self._measure_next(
                base, measured, results, fc_by_id, family, hkey, wkey, by_id, base_failed
            )

        measure_next = await next_to_measure()
        notes = list(hw.notes)
        if hw.device_of is None or hw.device_of.name != "replay":
            # (A replay answers from recordings matched on entry and defines: it neither compiles nor runs.)
            notes.extend(
                await anyio.to_thread.run_sync(_source_notes, kernels, workload)
            )  # reads every source
        notes.extend(dict.fromkeys(n for f in forecasts for n in f.notes))  # e.g. a forecaster skipped
        for c in dict.fromkeys(applied):
            shown = f"{c.threshold:.3f}" if c.threshold < 0.9995 else f"{c.threshold:.6g}"  # not "1.000"
            notes.append(f"verdicts decided at confidence >= {shown} ({c.reason})")
        if out_of_reach:
            notes.append(
                _out_of_reach_note(
                    target, out_of_reach, len(forecasts), measure_if_unsure, capped_out_of_reach
                )
            )
        measurements: list[MeasureResult] = []
        charged = 0.0
        unsure = [i for i in measure_next if i != base.id and results[i].verdict == "unsure"]
        copies: list[str] = []
        if not unsure and measure_next == [base.id]:
            # Measured candidates, or unsure copies of the baseline: the baseline's measurement settles them.
            copies = [
                i for i, r in results.items() if r.verdict == "unsure" and member_key(by_id[i]) == base_member
            ]
            unsure = _waiting_on_baseline(results, measured) or copies
        if base_failed is not None:
            notes.append(_base_failed_note(base.id, base_failed, measure_if_unsure))
            unsure = []  # measure_if_unsure measures nothing against a baseline that does not run
        if measure_if_unsure and unsure and max_measurements == 0:
            notes.append(
                f"measure_if_unsure with max_measurements 0 measured nothing ({len(unsure)} unsure): raise "
                "max_measurements to let this call measure them"
            )
        elif measure_if_unsure and unsure:
            if ledger is None:
                raise InvalidRequest("measure_if_unsure needs a ledger; this server has none configured")
            if measure_next[0] == base.id:
                # (Not the copies of the baseline: its measurement answers them; one spelled otherwise, "0x20"
                # for 32, was measured again, and paid for on a GPU.)
                unsure = [base.id, *(i for i in unsure if i not in measured and i not in copies)]
            not_measurable: set[str] = set()
            try:
                measurements, charged, stopped, not_measurable = await self._measure_unsure(
                    ledger, base, by_id, unsure, max_measurements, workload, hw, progress
                )
            except (NotMeasurable, BudgetExhausted, InvalidRequest, ServerBusy) as exc:
                # Nothing could run here (no GPU, no such device, a baseline the recordings lack or the backend
                # refuses as sent, a ledger that cannot pay for it, a server too busy compiling to compile it), and
                # nothing ran or was charged: the free forecasts are still the answer.
                where = (
                    ""
                    if isinstance(exc, BudgetExhausted | ServerBusy)
                    else ", and measure_kernel measures where they can run"
                )
                stopped = (
                    f"measure_if_unsure measured nothing: {one_line(str(exc), 400).rstrip('.')}. Nothing was "
                    f"charged; the forecasts stand{where}"
                )
            if stopped is not None:
                notes.append(stopped)
            measured, suspect = await self._measured(kernels, hkey, wkey)
            m_base = measured.get(base.id)
            base_failed = await self._failed(base, hkey, wkey)
            if base_failed is not None:
                # Measured in this call and it failed: measure_if_unsure measures nothing more against it.
                notes.append(_base_failed_note(base.id, base_failed, measure_if_unsure=False))
            # A crash or OOM is no verdict; a timeout is, as the family model learns it (under the server's cap).
            failed = {
                by_id[m.kernel_id].content_key(): m.status
                for m in measurements
                if m.status != "ok"
                and (
                    m.status not in NOT_CACHEABLE
                    or (m.status == "timeout" and not set(NOT_THE_KERNELS) & set(m.flags))
                )
            }
            for cid in list(results):
                m_cand = measured.get(cid)
                if results[cid].decided_by != "forecast":
                    continue
                if m_cand is None and cid in copies:
                    m_cand = m_base  # the baseline's configuration spelled otherwise: its measurement answers
                if m_base is not None and m_cand is not None:
                    results[cid] = _from_measurement(
                        cid, m_base, m_cand, "measurement", _suspicion(base.id, cid, suspect)
                    )
                elif (status := failed.get(by_id[cid].content_key())) is not None:
                    # Measured in this call and it failed: slower now, not an unsure forecast until the next call.
                    results[cid] = _one_side_failed(cid, status, base_failed=False, by="measurement")
                    measured_failing.add(cid)
                elif base_failed is not None and m_cand is not None:
                    results[cid] = _one_side_failed(cid, base_failed, base_failed=True, by="measurement")
            stale = [i for i in results if results[i].decided_by == "forecast"]
            if measurements and stale:
                # Their rationales still read as before these measurements ("no measurement of this family yet"
                # beside the family's measurements in this answer): the next call is the one that learns.
                notes.append(
                    f"the forecasts of {_listed_ids(stale)} were made before this call's {len(measurements)} "
                    f"measurement{'' if len(measurements) == 1 else 's'} and do not learn from them: ask "
                    "compare_kernels again (free) for forecasts that do"
                )
            measure_next = await next_to_measure()
            # measure_next lists what the caller should measure: not what this server just found it cannot.
            measure_next = [i for i in measure_next if i not in not_measurable]
            left = [i for i in measure_next if i != base.id and results[i].verdict == "unsure"]
            if stopped is None and base_failed is None and left and len(measurements) >= max_measurements:
                notes.append(
                    f"measure_if_unsure measured {len(measurements)} (max_measurements {max_measurements}); still "
                    f"unsure: {_listed_ids(left)}. Raise max_measurements, or measure_kernel the head of measure_next"
                )

        if base_failed is None:  # against a baseline that does not run, no forecast can ever be verified
            await self._save_forecasts(ledger, hkey, wkey, base, others, forecast_results, fc_by_id, family)
        ordered = [results[str(k.id)] for k in others]
        if measure_if_unsure and not unsure and base_failed is None:
            cannot = self._no_device_message(hw.name) if hw.device_of is None else None
            notes.append(_nothing_unsure_note(measure_next, results, base.id, cannot))
        # Unmeasured: forecast, and neither in `measured` nor a kernel the forecaster holds as measured.
        unmeasured = [
            r
            for r in ordered
            if r.decided_by == "forecast"
            and r.id not in measured
            and fc_by_id[r.id].extras.get("measured", 0.0) < 1.0
        ]
        # Candidates (and a baseline) whose source does not compile: left out of measure_next, and said why.
        if note := _compile_errors_note(
            base.id, [r for r in ordered if r.decided_by == "forecast"], fc_by_id
        ):
            notes.append(note)
        unmeasured = [r for r in unmeasured if not _does_not_compile(fc_by_id[r.id].extras)]
        if not measure_next and unmeasured and all(r.verdict == "slower" for r in unmeasured):
            # An empty list is an answer too; say what it means so a client does not read it as a fault.
            notes.append(
                "measure_next is empty: every unmeasured candidate is forecast slower than the baseline (or "
                "the best measured kernel of its family) with no real chance of a clear win; measure none of "
                "them, and send candidates from elsewhere (other parameter values, another approach) to keep "
                "searching"
            )
        # What the caller is told to measure, less what this server's measurer can tell at once it would refuse
        # (measure_if_unsure, above, tried those itself: a baseline it cannot measure stops it, free).
        unmeasurable: dict[str, str] = {}
        measure_next = self._measurable_only(measure_next, by_id, workload, hw, unmeasurable)
        if unmeasurable:
            first = next(iter(unmeasurable.values()))
            notes.append(
                f"left out of measure_next, as this server cannot measure them: {_listed_ids(list(unmeasurable))} "
                f"({one_line(first, 300)}); their forecasts stand, "
                "but do not send them to measure_kernel here"
            )
        speed = {base.id: 1.0, **{r.id: r.measured_speedup or r.expected_speedup for r in ordered}}
        # A kernel more likely than not to fail to compile or run (forecast so, or measured failing) ranks below
        # every one that likely runs: expected_speedup is its runtime if it runs, and a measured failure's is
        # its extreme bin's centre (0.18x), which ranked it above a measured kernel 50x slower than the baseline.
        fails = {r.id for r in ordered if r.decided_by == "forecast" and fc_by_id[r.id].p_fail >= 0.5}
        fails |= measured_failing
        if base_failed is not None or any(
            p_fail_baseline_of(fc_by_id[r.id].extras) >= 0.5 for r in ordered if r.decided_by == "forecast"
        ):
            fails.add(base.id)
        # Kernels measured against a baseline that failed all have the extreme bin's speedup (none is defined
        # against it): their measured runtimes order them, not the order they were sent in.
        # So do unmeasured ones against it, by the runtime the family model predicts for them, where it does.
        runtime = {
            r.id: 2.0 ** fc_by_id[r.id].extras["cand_log2_ms"]
            for r in ordered
            if r.decided_by == "forecast" and "cand_log2_ms" in fc_by_id[r.id].extras
        }
        runtime.update({i: m[0] for i, m in measured.items()})
        ranking = sorted(speed, key=lambda i: (i in fails, -speed[i], runtime.get(i, math.inf)))
        return CompareResult(
            baseline=base.id,
            hardware=hw.name,
            hardware_known=hw.spec is not None,
            candidates=ordered,
            ranking=ranking,
            measure_next=measure_next,
            forecaster=self.engine.info(forecasts),
            target_error=target,
            gpu_seconds_charged=charged,
            measurements=measurements,
            notes=notes,
            bins=list(bins.LABELS),
        )

    def _seen_by(self, ledger: str | None, workload: Workload) -> Workload:
        """The workload within `ledger`'s own history where ledgers are isolated (Settings.isolate_ledgers):
        its cache, measured answers and family models then hold that ledger's measurements only."""
        return workload.scoped(ledger) if self.settings.isolate_ledgers and ledger is not None else workload

    async def _failed(self, kernel: Kernel, hardware: str, wkey: str) -> str | None:
        """The status of the kernel's stored failed measurement (never measured ok), or None."""
        return await _by_content(kernel, lambda key: self.store.failed_status(key, hardware, wkey))

    async def _measured(
        self, kernels: Sequence[Kernel], hardware: str, wkey: str
    ) -> tuple[dict[str, tuple[float, float, float, int]], dict[str, list[str]]]:
        """Per kernel id, the (median, low, high, runs) of its latest ok measurement, for those measured; and
        per measured kernel id with some, that measurement's flags saying its runtime may not be the kernel's
        work (SUSPECT_FLAGS)."""
        out: dict[str, tuple[float, float, float, int]] = {}
        suspect: dict[str, list[str]] = {}
        for k in kernels:
            found = await _by_content(k, lambda key: self.store.measured_runtime(key, hardware, wkey))
            if found is not None and found[0][0] > 0:
                out[str(k.id)] = found[0]
                if flags := [f for f in found[1] if f in SUSPECT_FLAGS]:
                    suspect[str(k.id)] = flags
        return out, suspect

    @staticmethod
    def _measurable_only(
        ranked: Sequence[str],
        by_id: dict[str | None, Kernel],
        workload: Workload,
        hw: HardwareChoice,
        refused: dict[str, str],
    ) -> list[str]:
        """`ranked` without the candidates this server's measurer can tell at once it would refuse (a replay
        recording without that combination of values); those go into `refused` with why. A combination the
        tuner never ran stayed at the head of measure_next call after call, and a client that measures the
        head never moved on (a refusal charges nothing)."""
        check = getattr(hw.device_of, "cannot_measure", None)
        if check is None:
            return list(ranked)
        out = []
        for cid in ranked:
            why = check(by_id[cid], workload, hw.name)
            if why is None:
                out.append(cid)
            else:
                refused[cid] = why
        return out

    async def _measure_next(
        self,
        base: Kernel,
        measured: dict[str, tuple[float, float, float, int]],
        results: dict[str, CandidateForecast],
        fc_by_id: dict[str, Any],
        family: dict[str, str],
        hardware: str,
        wkey: str,
        by_id: dict[str | None, Kernel],
        base_failed: str | None = None,
    ) -> list[str]:
        from forecaster_mcp.forecast.acquisition import (
            AcqItem,
            against_best,
            rank_for_measurement,
            worth_measuring,
        )

        # A candidate decided faster is what a search wants to measure next, as much as an unsure one; one
        # decided slower only while its expected gain is still real (acquisition.MIN_VALUE_LOG2). Each is
        # valued against the best so far: the fastest kernel measured of any family in the call (the baseline's
        # included), or the measured baseline where it is faster; against a baseline without a measured runtime
        # (not measured yet, or failed) through the candidate's own predicted runtime (acquisition.against_best).
        # A candidate that beats its own family's best but not another family's is no gain on what the caller
        # has. (Each family was valued against its own best: with a measured baseline of 5 ms and another
        # family's 1 ms kernel, a family whose best is 11 ms headed the list with its 3 ms forecasts.)
        t_base = measured[str(base.id)][0] if str(base.id) in measured else None
        base_family = base.family_key()
        best = {f: await self.store.best_runtime(f, hardware, wkey) for f in {*family.values(), base_family}}
        fastest = min((t for t in best.values() if t is not None), default=None)
        best = dict.fromkeys(best, fastest)
        items = [
            against_best(
                AcqItem(
                    id=cid,
                    probs=fc_by_id[cid].probs,
                    extras=fc_by_id[cid].extras,
                    p_faster=r.p_faster,
                    explore_key=by_id[cid].content_key() if family.get(cid) == base_family else None,
                ),
                t_base,
                best.get(family.get(cid, "")),
            )
            for cid, r in results.items()
            if r.decided_by == "forecast" and cid not in measured
        ]
        # A candidate whose source this server's nvcc rejected is left out: its measurement would be a compile
        # error (the rationale has the first error line; `_compile_errors_note` says so).
        listed = [
            it
            for it in items
            if worth_measuring(it, results[it.id].verdict)
            and fc_by_id[it.id].raw
            and not _does_not_compile(fc_by_id[it.id].extras)
        ]
        ranked = rank_for_measurement(listed) if listed else []
        # A candidate no forecaster answered has no value to rank by (its even odds are not a forecast): it
        # is worth a measurement, after those whose forecasts say why.
        ranked += [it.id for it in items if not fc_by_id[it.id].raw]
        # One measurement answers every candidate that is the same member of its family as the model tells
        # them apart (the same content, or defines spelled otherwise: 32 and "0x20"), and a copy of the
        # baseline: list it once. (Only same-content copies were left out: a "0x20" copy of the baseline was
        # listed, and measuring it paid for the baseline's runtime twice.)
        base_key = member_key(by_id[base.id])
        members = {cid: member_key(by_id[cid]) for cid in ranked}  # each hashes its source: once
        seen = {base_key}
        unique = []
        for cid in ranked:
            if members[cid] not in seen:
                seen.add(members[cid])
                unique.append(cid)
        # A copy of the baseline is settled by the baseline's own measurement (equal runtimes).
        copies_of_base = base_key in members.values()
        ranked = unique
        if (
            str(base.id) not in measured
            and base_failed is None  # measuring a failed baseline again only answers the failure again
            # nor one whose source does not compile
            and not any(_does_not_compile(f.extras, baseline=True) for f in fc_by_id.values())
            and (ranked or copies_of_base or _waiting_on_baseline(results, measured))
        ):
            # A candidate's measurement only settles the pair once the baseline is measured too; with every
            # candidate measured already, the baseline alone settles the unsure ones.
            ranked = [str(base.id), *ranked]
        return ranked

    async def _save_forecasts(
        self,
        ledger: str | None,
        hardware: str,
        wkey: str,
        base: Kernel,
        others: Sequence[Kernel],
        results: dict[str, CandidateForecast],
        fc_by_id: dict[str, Any],
        family: dict[str, str],
    ) -> None:
        rows = []
        for k in others:
            r = results[str(k.id)]
            if r.decided_by != "forecast" or not fc_by_id[str(k.id)].raw:
                continue  # measured, or no forecaster answered: there is no forecast to learn from
            fc = fc_by_id[str(k.id)]
            row = ForecastRow(
                ledger=ledger,
                # Static-prior forecasts are stored apart: they certify their own threshold.
                forecaster=self.engine.final_name(fc_by_id[str(k.id)]),
                hardware=hardware,
                workload_key=wkey,
                baseline_key=base.content_key(),
                candidate_key=k.content_key(),
                probs=list(r.speedup_bins),
                # What the verdict weighed (either kernel's chance of failing counted): thresholds are
                # certified on the direction and confidence verdicts are decided by.
                p_faster=decision_p(r.p_faster, fc.p_fail, p_fail_baseline_of(fc.extras)),
                verdict=r.verdict,
                decided_by="forecast",
                family_key=family[str(k.id)],
                p_fail=fc.p_fail,
                p_fail_baseline=p_fail_baseline_of(fc.extras),
            )
            rows.append(row)
            per = getattr(fc_by_id[str(k.id)], "per_forecaster", None) or {}
            caps = getattr(fc_by_id[str(k.id)], "per_forecaster_caps", None) or {}
            for comp, probs in per.items():
                # Component rows (same pair, named raw:<name>@<version>[regime], never the engine's own name)
                # feed per-forecaster calibration only; they are not the caller's forecasts.
                rows.append(
                    dataclasses.replace(
                        row,
                        ledger=None,
                        forecaster=comp,
                        probs=list(probs),
                        p_faster=bins.p_faster(probs),
                        verdict="unsure",
                        p_fail=None,
                        p_fail_baseline=None,
                        # Its own cap on its confidence: the history scores it again held to it, as it was issued.
                        max_confidence=caps.get(comp),
                    )
                )
        if rows:
            await self.store.save_forecasts(rows)

    async def _measure_unsure(
        self,
        ledger: str,
        base: Kernel,
        by_id: dict[str | None, Kernel],
        measure_next: list[str],
        max_measurements: int,
        workload: Workload,
        hw: HardwareChoice,
        progress: ProgressCallback | None,
    ) -> tuple[list[MeasureResult], float, str | None, set[str]]:
        """Measure in order, up to `max_measurements`; when one fails after others were made, stop and say why
        in a note. A candidate this server cannot measure (not in its recordings) is skipped, with a note, for
        the next one; the baseline is not: without it no candidate's pair is settled. So is a candidate whose
        hold is more than the ledger has left while something is left (a cheaper one later may fit); a ledger
        with nothing left stops the loop at once.

        Returns the measurements made (and charged; only a failure of the first one raises), what they cost,
        the note, and the ids skipped as not measurable here.
        """
        if hw.device_of is None:
            raise NotMeasurable(self._no_device_message(hw.name))
        out: list[MeasureResult] = []
        charged = 0.0
        skipped: dict[str, str] = {}  # id -> why this server cannot measure it
        unaffordable: dict[str, str] = {}  # id -> what it needed and what the ledger had left
        total = min(max_measurements, len(measure_next))
        for n, kid in enumerate(measure_next):
            if len(out) >= max_measurements:
                break
            if progress is not None:
                await progress(len(out), total, f"measuring {kid}")
            try:
                res = await self.measure(
                    ledger=ledger, kernel=by_id[kid], workload=workload, hardware=hw.name
                )
            except (NotMeasurable, InvalidRequest) as exc:
                # Not in the recordings, or refused as sent (pycuda: no launch given, shared memory that does
                # not fit): that kernel only, and nothing ran or was charged.
                if kid == base.id:
                    if not out:
                        raise
                    note = self._stopped_note(out, kid, str(exc), measure_next[n:], skipped, unaffordable)
                    return out, charged, note, set(skipped)
                skipped[kid] = one_line(str(exc), 160)
                continue
            except BudgetExhausted as exc:
                left, needed = exc.left_gpu_seconds, exc.needed_gpu_seconds
                if kid != base.id and left is not None and needed is not None and left > 0:
                    # More than is left, nothing charged: a cheaper candidate later in the list may still fit.
                    unaffordable[kid] = (
                        f"needs up to {fmt_gpu_seconds(needed)}, {fmt_gpu_seconds(left)} {BUDGET_EXHAUSTED_TEXT}"
                    )
                    continue
                if not out:
                    raise
                note = self._stopped_note(out, kid, str(exc), measure_next[n:], skipped, unaffordable)
                return out, charged, note, set(skipped)
            except Exception as exc:
                if isinstance(exc, ResultNotSaved):
                    charged += exc.charged_gpu_seconds  # it ran and was charged; its result was lost
                elif not out:
                    raise
                if isinstance(exc, AgentError):
                    why = str(exc)
                else:
                    log.exception("measure_if_unsure: measuring %s failed", kid)
                    why = "an internal error, logged on the server"
                return (
                    out,
                    charged,
                    self._stopped_note(out, kid, why, measure_next[n:], skipped, unaffordable),
                    set(skipped),
                )
            out.append(res)
            charged += res.cost.gpu_seconds
            if kid == base.id and res.status != "ok":
                # No speedup is defined against a baseline that did not run: stop paying (a candidate's own
                # measurement would only say whether it runs; measure_kernel measures one). A final
                # failure is explained by the failed-baseline note; a passing one (a crash, no memory, the cap)
                # is said here.
                if res.status not in NOT_CACHEABLE:
                    return out, charged, None, set(skipped)
                why = f"it measured {res.status}: {one_line(res.message or 'no detail', 200)}"
                note = self._stopped_note(out, kid, why, measure_next[n + 1 :], skipped, unaffordable)
                return out, charged, note, set(skipped)
        notes = []
        if skipped:
            notes.append(
                f"measure_if_unsure skipped what this server cannot measure as sent: {_listed(skipped)}. Those "
                "are forecasts only, left out of measure_next (fix what the reason says, or measure them where "
                "they can run)"
            )
        if unaffordable:
            notes.append(
                f"measure_if_unsure skipped, as each needs more than the ledger had left: {_listed(unaffordable)}. "
                "They stay in measure_next: measure them once the ledger is topped up (forecasts with "
                "compare_kernels are free)"
            )
        return out, charged, ". ".join(notes) or None, set(skipped)

    @staticmethod
    def _stopped_note(
        out: Sequence[MeasureResult],
        kid: str,
        why: str,
        rest: Sequence[str],
        skipped: Mapping[str, str],
        unaffordable: Mapping[str, str],
    ) -> str:
        also = f" Skipped as not measurable here: {_listed(skipped)}." if skipped else ""
        if unaffordable:
            also += f" Skipped as more than the ledger had left: {_listed(unaffordable)}."
        return (
            f"measure_if_unsure stopped after {len(out)} measurements: {kid} could not be measured "
            f"({one_line(why, 300)}). Not measured: {', '.join(rest)}.{also} The measurements made are in "
            "`measurements` and charged in gpu_seconds_charged; measure the rest with measure_kernel once the "
            "reason above is fixed"
        )

    # ------------------------------------------------------------------ measure_kernel

    def _no_device_message(self, hardware: str | None) -> str:
        have = self.devices()
        if not have:
            why = "; ".join(self.measurer_notes) or "no GPU backend is configured"
            return (
                f"this server cannot measure: {why}. compare_kernels forecasts are free and work without a GPU; "
                "to measure, run the server on a machine with an NVIDIA GPU, the CUDA toolkit (nvcc) and pycuda "
                "(pip install 'forecaster-mcp[gpu]') or start it with --replay RECORDING."
            )
        return f"this server has no device {hardware!r}; it can measure on: {', '.join(have)}"

    def _pick_measurer(self, hardware: str | None) -> tuple[Measurer, str]:
        if not self.measurers or not self.devices():
            raise NotMeasurable(self._no_device_message(hardware))
        if hardware is None:
            # The device compare_kernels forecasts for when it is not told (serve --hardware where this server
            # measures on it): its measure_next is measured there, not on another device of the server.
            with contextlib.suppress(InvalidRequest):  # a configured name that is no GPU name: the first
                configured = self.resolve_hardware(None)
                if configured.device_of is not None:
                    return configured.device_of, configured.name
            for m in self.measurers:
                for d in m.devices():
                    return m, d
        hw = self.resolve_hardware(hardware)
        if hw.device_of is None:
            raise NotMeasurable(self._no_device_message(hardware))
        return hw.device_of, hw.name

    def _forecasts_paid(self) -> bool:
        """Whether a forecaster bills per request (Claude): its spending is recorded on the caller's ledger."""
        return any(getattr(f, "paid", False) for f in self.engine.forecasters)

    async def _require_ledger(self, ledger: str) -> None:
        if await self.store.get_ledger(ledger) is None:
            # Claude's spending is recorded on the caller's ledger: with no ledger to record it on, a compare
            # paid the API and the record of it was lost (logged as an error), so it is refused first.
            free = (
                "Forecasts (compare_kernels) on this server use Claude, whose spending is recorded on the ledger, "
                "so they need it too."
                if self._forecasts_paid()
                else "Forecasts (compare_kernels) are free."
            )
            raise UnknownLedger(
                f"ledger {ledger!r} does not exist; an operator creates it with "
                f"`forecaster-mcp ledger create {shlex.quote(ledger)} --gpu-seconds N`. {free}"
            )

    async def measure(
        self,
        *,
        ledger: str,
        kernel: Kernel,
        workload: Workload,
        reference: Kernel | None = None,
        atol: float = 1e-5,
        rtol: float = 1e-3,
        max_seconds: float | None = None,
        max_runs: int = 1000,
        idempotency_key: str | None = None,
        hardware: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> MeasureResult:
        """Measure one kernel, charging the ledger; cached and idempotent results are free."""
        workload = self._seen_by(ledger, workload)
        if not (math.isfinite(atol) and atol >= 0 and math.isfinite(rtol) and rtol >= 0):
            raise InvalidRequest("atol and rtol must be finite and >= 0")
        cap = self.settings.max_measure_seconds
        if max_seconds is not None and not (
            math.isfinite(max_seconds) and max_seconds >= MIN_MEASURE_SECONDS
        ):
            raise InvalidRequest(
                f"max_seconds must be a number of at least {MIN_MEASURE_SECONDS:g} (the device is held for a "
                f"launch, a checked run and timing); more than this server's cap of {cap:g} is run at the cap"
            )
        if max_runs < 1:
            raise InvalidRequest("max_runs must be at least 1")
        if reference is not None and not any(
            isinstance(a, BufferArg) and a.intent in ("out", "inout") for a in workload.args
        ):
            raise InvalidRequest(
                "a reference kernel is compared with this one on the workload's output buffers, and none is "
                "marked: give each buffer the kernels write intent 'out' or 'inout' (buffers are 'in' by "
                "default), or leave the reference out (nothing was checked or charged)"
            )
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 200:
            raise InvalidRequest("idempotency_key must be 1 to 200 characters")
        kid = kernel.id or "k0"
        kernel = kernel.model_copy(update={"id": kid})
        measurer, device = self._pick_measurer(hardware)
        await self._require_ledger(ledger)
        # A backend that cannot run a reference (a replay) answers as if none were sent: the request is then the
        # unchecked one, a cache hit or idempotent retry of it, not a new measurement charged again for every
        # reference or atol/rtol that checked nothing.
        reference_not_run = reference is not None and not getattr(measurer, "runs_references", True)
        if reference_not_run:
            reference = None

        # What the outputs are checked against (stored), then the earlier spelling a stored retry may hold.
        checks = tuple(
            dict.fromkeys((check_key(reference, atol, rtol), check_key(reference, atol, rtol, earlier=True)))
        )
        run = functools.partial(
            self._measure_uncached,
            ledger,
            kernel,
            workload,
            reference,
            atol,
            rtol,
            max_seconds,
            max_runs,
            idempotency_key,
            measurer,
            device,
            progress,
            checks,
        )
        if idempotency_key is None:
            result = await run()
        else:
            async with self._alone(("idempotency", ledger, idempotency_key)):
                result = await self._measure_under_key(
                    ledger,
                    idempotency_key,
                    kernel,
                    workload,
                    history_device(measurer, device),
                    checks,
                    max_seconds,
                    progress,
                    run,
                )
        if reference_not_run:
            said = result.correctness.detail
            note = f"the reference kernel was not run: {measurer.name} cannot check outputs"
            result = result.model_copy(
                update={
                    "correctness": result.correctness.model_copy(
                        update={"detail": f"{said}; {note}" if said else note}
                    )
                }
            )
        return result

    @contextlib.asynccontextmanager
    async def _alone(self, key: tuple[str, ...]) -> AsyncIterator[None]:
        """Runs the block while no other coroutine of this process runs one under the same key (requests in
        other processes on the same database are kept apart by the store: reservations, idempotency keys)."""
        while key in self._inflight:
            await self._inflight[key].wait()
        done = anyio.Event()
        self._inflight[key] = done
        try:
            yield
        finally:
            del self._inflight[key]
            done.set()

    async def _measure_under_key(
        self,
        ledger: str,
        key: str,
        kernel: Kernel,
        workload: Workload,
        stored_as: str,
        checks: tuple[str, ...],
        max_seconds: float | None,
        progress: ProgressCallback | None,
        run: Callable[[], Awaitable[MeasureResult]],
    ) -> MeasureResult:
        """`run` once `key` is claimed for this request, across every server process on this database (the
        claim comes before the cache is looked in, so that a free answer and a paid one cannot both take the key);
        the recorded answer if the key was used for the same request; a refusal if it was used, or is in use, for
        another one. While another process runs the same request under the key, this one waits for its answer
        (for about as long as that measurement may take), free. `stored_as`: the device's `history_device`."""
        cap = min(max_seconds or self.settings.max_measure_seconds, self.settings.max_measure_seconds)
        request = {
            "kernel": kernel.content_key(),
            "workload": workload.history_key(),
            "hardware": stored_as,
            "check": checks[0],
        }
        may_take = (SAME_MEASUREMENT_WAIT_FACTOR + 1) * cap + SAME_MEASUREMENT_WAIT_S
        wait_until = time.monotonic() + SAME_MEASUREMENT_WAIT_FACTOR * cap + SAME_MEASUREMENT_WAIT_S
        told = False
        while True:
            prior = await self._idempotent_prior(ledger, key, kernel, workload, stored_as, checks)
            if prior is not None:
                return prior
            try:
                claim = await self.store.claim_key(ledger, key, request, may_take)
            except AlreadyMeasured:
                continue  # saved since the look-up: that measurement answers (or refuses) this request
            if isinstance(claim, KeyClaim):
                break
            labels = {
                "kernel": "kernel",
                "workload": "workload",
                "hardware": "hardware",
                "check": "reference or atol/rtol",
            }
            differs = [label for what, label in labels.items() if claim.request.get(what) != request[what]]
            if differs:
                raise InvalidRequest(
                    f"idempotency_key {key[:80]!r} is in use on ledger {ledger!r} by a measurement of a different "
                    f"{' and '.join(differs)}, still running (possibly at another server process); a retry must send "
                    "the same kernel, workload, reference, atol, rtol and hardware. Use a new key for a new "
                    "measurement; nothing was charged."
                )
            if time.monotonic() >= wait_until:
                raise MeasurementInProgress(
                    f"a measurement with idempotency_key {key!r} is still running on ledger {ledger!r}; call "
                    "again with the same key when it has finished (it will not be charged twice)"
                )
            if progress is not None and not told:
                told = True
                await progress(
                    0.0, None, "another server process is measuring under this idempotency_key: waiting"
                )
            await anyio.sleep(SAME_MEASUREMENT_POLL_S)
        try:
            return await run()
        finally:
            with anyio.CancelScope(shield=True):
                await self.store.release_claim(claim)

    async def _idempotent_prior(
        self,
        ledger: str,
        key: str,
        kernel: Kernel,
        workload: Workload,
        stored_as: str,
        checks: tuple[str, ...],
    ) -> MeasureResult | None:
        """The free answer to a retry under `key`, or None if the key is new; a key already used for another
        kernel, workload or device is refused (answering with that measurement would mislabel it), and so is
        one whose first measurement checked its outputs otherwise (`checks`: this request's `check_key`, then
        its earlier spelling; another reference kernel or none, other atol/rtol). For a measurement saved
        before check keys were kept, only whether it was checked at all is known, and that is compared.
        `stored_as`: the device's `history_device` (a replay's is not the real GPU's of its name)."""
        used = await self.store.idempotent_request(ledger, key)
        if used is None:
            return None
        differs = _differences(used, kernel, workload.history_key(), stored_as)
        if used.check_key is not None:
            if used.check_key not in checks:
                differs.append("reference or atol/rtol")
        elif used.result.status in ("ok", "wrong_output") and used.result.correctness.checked != (
            checks[0] != _UNCHECKED
        ):
            differs.append("reference")
        if differs:
            first = f"kernel id {used.kernel_id!r}, " if used.kernel_id is not None else ""
            raise InvalidRequest(
                f"idempotency_key {key[:80]!r} was already used on ledger {ledger!r} for a different "
                f"{' and '.join(differs)} ({first}measurement {used.measurement_id} on {used.hardware}); "
                "a retry must send the same kernel, workload, reference, atol, rtol and hardware. Use a new key "
                "for a new measurement; nothing was charged."
            )
        prior = _free_copy(used.result, str(kernel.id))
        if prior.status in NOT_CACHEABLE:
            # The key answers with what it recorded, as a retry must; a transient failure is worth another try,
            # which needs a key of its own (the recorded answer is not served to anyone else).
            prior.message = (
                f"{prior.message or prior.status}; this is the recorded answer to idempotency_key {key[:80]!r} "
                f"({prior.status} says nothing final of the kernel): to measure again, use a new key"
            )
        return prior

    async def _measure_uncached(
        self,
        ledger: str,
        kernel: Kernel,
        workload: Workload,
        reference: Kernel | None,
        atol: float,
        rtol: float,
        max_seconds: float | None,
        max_runs: int,
        idempotency_key: str | None,
        measurer: Measurer,
        device: str,
        progress: ProgressCallback | None,
        checks: tuple[str, ...],
    ) -> MeasureResult:
        """`checks`: `check_key` of the reference and tolerances (stored, for idempotent retries), then the
        earlier spelling a stored retry may hold."""
        cap = min(max_seconds or self.settings.max_measure_seconds, self.settings.max_measure_seconds)
        lowered_to_budget = False
        if max_seconds is None:
            # The default cap is also held to what the ledger has left: a measurement holds its whole cap
            # up front, and 20 GPU-seconds left should still buy a measurement capped at 20, not a refusal.
            view = await self.store.get_ledger(ledger)
            if view is not None and MIN_MEASURE_SECONDS <= view.remaining_gpu_seconds < cap:
                cap = view.remaining_gpu_seconds
                lowered_to_budget = True
        request = MeasureRequest(
            kernel=kernel,
            workload=workload,
            device=device,
            reference=reference,
            atol=atol,
            rtol=rtol,
            max_seconds=cap,
            max_runs=max_runs,
        )
        fingerprint = measurer.device_fingerprint(device)
        # A measurer that answers several spellings of a kernel or workload with one result (a replay: defines
        # 32 and 32.0, or problem {width: 4096, height: 4096} and none, are one recorded entry) names the kernel
        # and workload its results are stored under; the request's own keys, under which such results were
        # stored before, are still looked up.
        cache_request = getattr(measurer, "cache_request", None)
        keyed = request if cache_request is None else cache_request(request)
        cache_key = _cache_key(keyed, fingerprint)
        save: dict[str, Any] = {
            "cache_key": cache_key,
            "ledger": ledger,
            "idempotency_key": idempotency_key,
            "kernel_json": kernel.model_dump_json(),
            "workload_key": workload.history_key(),
            "family_key": kernel.family_key(),
            "content_key": kernel.content_key(),
            "hardware": history_device(measurer, device),
            "check_key": checks[0],
        }
        # One measurement of the same request at a time: concurrent callers (parallel search clients sharing
        # an unmeasured baseline) wait for the first and are then served from the cache, free.
        # Callers in other server processes on this database are kept apart by the store: a hold records the
        # cache key it pays for, and while one is open the others wait for its result (SameMeasurementRunning),
        # for at most about as long as that measurement may take, then measure themselves.
        wait_until = time.monotonic() + SAME_MEASUREMENT_WAIT_FACTOR * cap + SAME_MEASUREMENT_WAIT_S
        told = False
        # Looked up under this key, then under the key results were stored under before (_legacy_cache_key).
        lookup_keys = tuple(
            dict.fromkeys(
                (
                    cache_key,
                    _cache_key(request, fingerprint),
                    _legacy_cache_key(keyed, fingerprint),
                    _legacy_cache_key(request, fingerprint),
                )
            )
        )
        min_runs = getattr(measurer, "min_runs", 1)

        async def cached_hit() -> tuple[MeasureResult, str] | None:
            """A stored result that may answer this request, and the key it was found under; or None."""
            for key in lookup_keys:
                hit = await self.store.find_measurement(key)
                if hit is not None:
                    return (hit, key) if _precise_enough(hit, request, min_runs) else None
            return None

        async def serve(hit: MeasureResult, hit_key: str) -> MeasureResult:
            """A free copy of `hit`, saved as a cache hit."""
            result = _free_copy(hit, str(kernel.id))
            # The copy joins the key it was found under: what it saved is read from that key's original.
            result.measurement_id = await self.store.save_measurement(
                **{**save, "cache_key": hit_key}, result=result, charged_gpu_seconds=0.0, cached=True
            )
            return result

        async with self._alone(("cache", cache_key)):
            while True:
                found = await cached_hit()
                if found is not None:
                    return await serve(*found)
                try:
                    hold = await self.store.reserve(
                        ledger,
                        measurer.reservation_seconds(request),
                        f"measure {kernel.entry}",
                        idempotency_key,
                        cache_key=cache_key,
                        exclusive=time.monotonic() < wait_until,
                    )
                except SameMeasurementRunning:
                    if progress is not None and not told:
                        told = True
                        await progress(0.0, None, "another server process is measuring this kernel: waiting")
                    await anyio.sleep(SAME_MEASUREMENT_POLL_S)
                except AlreadyMeasured:
                    # Another server process on this database finished the same key first.
                    assert idempotency_key is not None
                    prior = await self._idempotent_prior(
                        ledger, idempotency_key, kernel, workload, save["hardware"], checks
                    )
                    assert prior is not None
                    return prior
                else:
                    # Another process may have saved the same measurement between the lookup above and this
                    # hold (the lookup read while its save held the write lock, and the hold waited for that
                    # save to commit and close its hold): look once more before paying for it again. The hold
                    # is released before the free copy is saved: under an idempotency key, an open hold on
                    # the key reads as that very request still running.
                    try:
                        found = await cached_hit()
                    except BaseException:
                        with anyio.CancelScope(shield=True):
                            await self.store.release(hold)
                        raise
                    if found is None:
                        break
                    with anyio.CancelScope(shield=True):
                        await self.store.release(hold)
                    return await serve(*found)
            settled = False
            try:
                try:
                    result = await self._measure_holding(measurer, request, progress, hold)
                except BaseException as exc:
                    # Cancelled (or failed) after the job reached the device: the measurer says how long the device
                    # was occupied (OCCUPIED_ATTR), and that is charged like any other run; the exception goes on.
                    occupied = getattr(exc, OCCUPIED_ATTR, None)
                    if isinstance(occupied, int | float) and not isinstance(occupied, bool):
                        used = max(0.0, min(float(occupied), hold.gpu_seconds))
                        with anyio.CancelScope(shield=True):
                            settled = True  # charged now or, on a locked database, in the background
                            try:
                                await self.store.commit(hold, used)
                            except Exception:
                                log.warning("could not charge hold %s now; retrying", hold.id, exc_info=True)
                                self.store.commit_later(hold, used)
                    raise
                with anyio.CancelScope(shield=True):
                    # Saved and charged in one transaction: a retry under the same key in another process
                    # finds the result, and no crash or failed save leaves a result uncharged (or device time
                    # used and released free).
                    cost = result.cost.gpu_seconds
                    # A cost that is not a number charges the whole hold (the device time is unknown).
                    expected = (
                        max(0.0, min(cost, hold.gpu_seconds)) if math.isfinite(cost) else hold.gpu_seconds
                    )
                    result = result.model_copy(
                        update={
                            "kernel_id": kernel.id,
                            "cost": result.cost.model_copy(
                                update={"gpu_seconds": expected, "max_seconds": cap, "max_runs": max_runs}
                            ),
                            "flags": _cap_flags(
                                result, cap, self.settings.max_measure_seconds, lowered_to_budget
                            ),
                        }
                    )
                    try:
                        result.measurement_id, charged = await self.store.save_and_commit(
                            hold, **save, result=result, charged_gpu_seconds=expected, cached=False
                        )
                    except Exception as exc:
                        # The result cannot be stored (disk full, database locked too long): the device time
                        # is still charged, and the caller is told the result was not kept.
                        log.exception(
                            "could not save the measurement of %s; charging its device time", kernel.id
                        )
                        settled = True  # never released free: the device time was used
                        lost = dataclasses.replace(
                            hold, result_not_saved=True
                        )  # budget_status: not cancelled
                        try:
                            charged = await self.store.commit(lost, expected)
                            how = f"was charged {fmt_gpu_seconds(charged)} GPU-seconds"
                        except Exception:
                            # Not charged yet: the charge is kept only in this process until the database
                            # takes writes again (Store.commit_later), so the caller is not told it was.
                            self.store.commit_later(lost, expected)
                            charged = expected
                            how = (
                                f"is charged {fmt_gpu_seconds(charged)} GPU-seconds once the server can write its "
                                "database again"
                            )
                        raise ResultNotSaved(
                            f"the measurement of {kernel.id} ran and {how}, but the server could not store its "
                            f"result ({type(exc).__name__}: "
                            f"{one_line(str(exc), 200)}): tell the server's operator (its state folder may be full "
                            "or locked); a retry measures, and is charged, again",
                            charged,
                        ) from exc
                    settled = True
                    result.cost.gpu_seconds = charged
                    # New verified pairs: let calibration and the threshold see them on the next call.
                    self.engine.mark_stale()
                return result
            finally:
                if not settled:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self.store.release(hold)
                        except Exception:
                            # A locked database: the hold (reserved budget, a retry under its key waiting on
                            # it) must not stay open for the life of the server.
                            log.warning("could not release hold %s now; retrying", hold.id, exc_info=True)
                            self.store.commit_later(hold, None)

    async def _measure_holding(
        self,
        measurer: Measurer,
        request: MeasureRequest,
        progress: ProgressCallback | None,
        hold: Reservation,
    ) -> MeasureResult:
        """measurer.measure, its hold kept from expiring meanwhile; its exception is raised as it is."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_hold, hold)
                result = await measurer.measure(request, progress)
                tg.cancel_scope.cancel()
            return result
        except BaseExceptionGroup as group:
            # The task group wraps what measure raised; the keep-alive never raises (it logs).
            if len(group.exceptions) == 1:
                inner = group.exceptions[0]
                # As it was raised: its own cause kept (`raise ... from exc` in the measurer), and no group.
                raise inner from inner.__cause__
            raise

    async def _keep_hold(self, hold: Reservation) -> None:
        """While a measurement runs (or waits for the device), keep its hold from expiring (Store.extend_hold)."""
        while True:
            await anyio.sleep(HOLD_KEEPALIVE_S)
            try:
                if not await self.store.extend_hold(hold):
                    return
            except Exception:  # a busy database: the next round tries again; the expiry has a long grace
                log.warning("could not extend hold %s", hold.id, exc_info=True)

    # ------------------------------------------------------------------ budget_status

    async def budget_status(self, ledger: str) -> BudgetStatus:
        await self._require_ledger(ledger)
        report = await self.store.ledger_report(ledger)
        return BudgetStatus.from_report(
            ledger=ledger,
            report=report,
            forecaster=self.engine.info(),
            devices=self.devices(),
            notes=self.measurer_notes,
        )


# ---------------------------------------------------------------------- helpers


# How long a measurement request waits for the same measurement in another server process (module
# constants, so tests can shorten them): FACTOR x its own cap + S, polling every POLL_S.
SAME_MEASUREMENT_WAIT_FACTOR = 2.0
SAME_MEASUREMENT_WAIT_S = 10.0
SAME_MEASUREMENT_POLL_S = 0.2
# How often a running measurement pushes its hold's expiry out (well inside store.EXPIRY_GRACE_S).
HOLD_KEEPALIVE_S = 60.0


def _assign_ids(candidates: Sequence[Kernel]) -> list[Kernel]:
    if (problem := candidate_count_problem(len(candidates))) is not None:
        raise InvalidRequest(problem)
    # A default id is positional (k<i>); where the caller gave that id to another candidate, the first k<j>
    # nobody uses: [{"id": "k1"}, {no id}] is no clash of the caller's making.
    taken = {k.id for k in candidates if k.id}
    out = []
    for i, k in enumerate(candidates):
        if not k.id:
            default = f"k{i}"
            j = len(candidates)
            while default in taken:
                default, j = f"k{j}", j + 1
            taken.add(default)
            k = k.model_copy(update={"id": default})
        out.append(k)
    seen: set[str] = set()
    for k in out:
        assert k.id is not None
        if k.id in seen:
            raise InvalidRequest(f"candidate id {k.id!r} appears twice; give every candidate a unique id")
        seen.add(k.id)
    return out


def _waiting_on_baseline(
    results: dict[str, CandidateForecast], measured: dict[str, tuple[float, float, float, int]]
) -> list[str]:
    """Candidates measured already whose verdict is still an unsure forecast: the baseline is not measured."""
    return [
        cid
        for cid, r in results.items()
        if cid in measured and r.decided_by == "forecast" and r.verdict == "unsure"
    ]


def _suspicion(
    base_id: object, cid: object, suspect: Mapping[str, list[str]], *, learned: bool = False
) -> str | None:
    """Why a measured pair of these two kernels is not decided, or None. `learned`: the pair was forecast, and
    says that the flagged measurement was not learned from (the store leaves it out of the family's points)."""
    parts = [
        f"the {role}'s measurement is flagged {', '.join(flags)}"
        for role, kid in (("baseline", base_id), ("candidate", cid))
        if (flags := suspect.get(str(kid)))
    ]
    if not parts:
        return None
    return (
        "; ".join(parts)
        + " (its runtime may not be the kernel's work: skipped work, inputs never read, or work "
        + "outside the timed stream)"
        + (": not learned from, forecast as if unmeasured" if learned else "")
        + "; measure it with a reference kernel so its output is checked, and see the measurement's notes"
    )


async def _by_content(kernel: Kernel, lookup: Callable[[str], Awaitable[_T | None]]) -> _T | None:
    """`lookup` under the kernel's content key, else under the key results were stored under before
    (`Kernel.earlier_content_key`)."""
    found = await lookup(kernel.content_key())
    if found is None and (earlier := kernel.earlier_content_key()) is not None:
        found = await lookup(earlier)
    return found


def _one_side_failed(cid: str, status: str, *, base_failed: bool, by: DecidedBy) -> CandidateForecast:
    """A pair one of whose kernels was measured failing (compile or launch error, wrong output) while the
    other ran: the one that ran is faster, all mass on the extreme bin (as a forecast involving a failed member
    puts it), though no speedup is defined against a kernel that does not run."""
    probs = bins.one_hot(2.0**4 if base_failed else 2.0**-4)
    rationale = (
        f"measured: the baseline failed ({status}) and this candidate ran, so it is the faster one (no speedup is "
        "defined against a kernel that does not run)"
        if base_failed
        else f"measured: the candidate failed ({status}); the baseline is the faster one"
    )
    return CandidateForecast(
        id=cid,
        p_faster=1.0 if base_failed else 0.0,
        speedup_bins=probs,
        expected_speedup=bins.expected_speedup(probs),
        verdict="faster" if base_failed else "slower",
        decided_by=by,
        rationale=rationale,
        confidence=1.0,
    )


MAX_SECONDS_LOWERED_TO_BUDGET = "max_seconds_lowered_to_budget"  # a result flag (MeasureResult.flags)


def _listed(skipped: Mapping[str, str]) -> str:
    """The candidates measure_if_unsure skipped, each with why: "k3 (not in the recording); k7 (...)"."""
    return "; ".join(f"{kid} ({why})" for kid, why in skipped.items())


def _cap_flags(result: MeasureResult, cap: float, server_cap: float, lowered_to_budget: bool) -> list[str]:
    """The result's flags, plus what its request explains: a cap the ledger's remaining budget lowered
    (max_seconds left out), a timeout under a cap below the server's (store.TIMEOUT_UNDER_LOWERED_CAP: the
    kernel may run fine with more time), and a failure of the reference kernel (store.REFERENCE_FAILED):
    family models do not learn those two as the kernel's failure, nor compare_kernels answer from them."""
    # The measurer's own flags; one of _REQUEST_FLAGS there came with a replayed export, from its request.
    flags = [f for f in result.flags if f not in _REQUEST_FLAGS]
    if lowered_to_budget:
        flags.append(MAX_SECONDS_LOWERED_TO_BUDGET)
    if result.status == "timeout" and cap < server_cap:
        flags.append(TIMEOUT_UNDER_LOWERED_CAP)
    if result.status != "ok" and (result.message or "").startswith(REFERENCE_FAILURE_PREFIX):
        # The reference kernel faulted: the caller's check failed, not this kernel (store.REFERENCE_FAILED).
        flags.append(REFERENCE_FAILED)
    return list(dict.fromkeys(flags))


def _listed_ids(ids: Sequence[str], limit: int = 10) -> str:
    """ "k1, k2, k3" (the first `limit`, then "..."), for a note."""
    return ", ".join(ids[:limit]) + (" ..." if len(ids) > limit else "")


def _base_failed_note(base_id: str, status: str, measure_if_unsure: bool) -> str:
    """Why pairs against a baseline measured failing are answered as they are. A candidate's own measurement
    still decides its pair (`_one_side_failed`: one that ran is faster, one that failed slower), so candidates
    measured are decided by measurement and measure_next may list more; measure_if_unsure measures none."""
    what = "measure_if_unsure measured nothing: " if measure_if_unsure else ""
    return (
        f"{what}the baseline {base_id} was measured {status} and never ran: no speedup is defined against it, so "
        "a candidate is decided only by its own measurement (one that runs is faster, one that fails slower) "
        "and measure_if_unsure measures none against it; its forecasts are not kept (they could never be "
        "verified). Compare against a baseline that runs, e.g. a candidate measured ok"
    )


def _nothing_unsure_note(
    measure_next: Sequence[str],
    results: dict[str, CandidateForecast],
    base_id: str,
    cannot_measure: str | None = None,
) -> str:
    """Why measure_if_unsure measured nothing, and what a search would measure instead (`cannot_measure`: why
    this server cannot measure for the call's hardware, when it cannot)."""
    text = (
        "measure_if_unsure measured nothing: no candidate's forecast is unsure (it measures only those; a measured "
        "pair left unsure is within its noise: measure_kernel both with a larger max_runs to separate them)"
    )
    if not measure_next:
        return text
    head = measure_next[0]
    # _measure_next puts an unmeasured baseline first: candidates' measurements settle nothing without it.
    why = "the baseline, not measured yet" if head == base_id else f"verdict {results[head].verdict}"
    if cannot_measure is not None:
        # Sent to measure_kernel here, it is refused: a server without a GPU (an IDE on a laptop) said to.
        return (
            f"{text}; measure_next ranks {head} ({why}) most worth a measurement, but not on this server: "
            f"{one_line(cannot_measure, 400)}"
        )
    return (
        f"{text}; measure_next still ranks {head} ({why}) most worth a measurement: a verdict is a forecast, "
        "so to confirm it or keep searching, measure that id with measure_kernel"
    )


# A measured pair is decided when the 95% interval of its speedup leaves out 1.
_MEASURED_Z = 1.959964
# A measurement of too few runs to bound its median at 95% (timing.median_ci_covers: fewer than 6) has an
# interval that covers less (0% at one run, 75% at three): for it, the metrics' tie band (3%) stands in as
# the half-width of a 95% interval.
_FEW_RUNS_LOG_SD = bins.TIE_LOG2 * math.log(2.0) / _MEASURED_Z  # ln(1.03) / z


# CUDA events resolve about half a microsecond (cudaEventElapsedTime), and Kernel Tuner's recordings are event
# times too: a median is known to within a tick at best, whatever its order statistics say. A few-microsecond
# kernel's samples fall on a handful of ticks, often one, and its interval is then a point (z infinite: any
# difference decided, a one-tick 0.8% one with p_faster 1.0).
_EVENT_RESOLUTION_MS = 0.0005


def _log_sd(interval: tuple[float, float, float, int]) -> float:
    """Standard deviation of the log of a median from its 95% interval, widened to at least one timer tick
    either side of the median (`_EVENT_RESOLUTION_MS`; a median within a tick of zero as if known to a factor
    of two below)."""
    median, low, high, runs = interval
    high = max(high, median + _EVENT_RESOLUTION_MS)
    low = min(low, median - _EVENT_RESOLUTION_MS)
    if low <= 0:
        low = median / 2.0
    sd = math.log(high / low) / (2.0 * _MEASURED_Z) if low > 0 and high > 0 else 0.0
    return sd if median_ci_covers(runs) else max(sd, _FEW_RUNS_LOG_SD)


def _from_measurement(
    cid: str,
    base: tuple[float, float, float, int],
    cand: tuple[float, float, float, int],
    by: str,
    suspicion: str | None = None,
) -> CandidateForecast:
    """The answer two measurements give: (median, low, high, runs) of each kernel's runtime interval (ms).

    Decided, at its measured bin, when the speedup's 95% interval (from both medians' intervals) leaves out 1;
    otherwise the two are within each other's noise: unsure, with p_faster and the bins of that interval. Two
    equal medians (one kernel sent twice) are never "slower". A `suspicion` (`_suspicion`: a measurement whose
    runtime may not be the kernel's work) leaves the pair unsure and says why."""
    t_base_ms, t_cand_ms = base[0], cand[0]
    s = t_base_ms / t_cand_ms
    sd = math.hypot(_log_sd(base), _log_sd(cand))
    z = math.log(s) / sd if sd > 0 else (math.inf if s > 1 else -math.inf if s < 1 else 0.0)
    probs = bins.one_hot(s)
    p = 1.0 if s > 1 else 0.0
    verdict: Verdict = "faster" if s > 1 else "slower"
    rationale = f"measured: baseline {t_base_ms:.4g} ms, candidate {t_cand_ms:.4g} ms (speedup {bins.speedup_text(s, 3)}x)"
    if s == 1.0:
        # Equal runtimes: half the mass on each side of S = 1, so that p_faster and the bins agree.
        probs = [0.0] * bins.N_BINS
        probs[bins.N_BINS // 2 - 1] = probs[bins.N_BINS // 2] = 0.5
        p, verdict = 0.5, "unsure"
        rationale = f"measured: equal runtimes ({t_base_ms:.4g} ms each); neither kernel is faster"
    elif abs(z) < _MEASURED_Z:
        probs, _ = bins.normal_bins(math.log2(s), sd / math.log(2.0))
        p, verdict = bins.p_faster(probs), "unsure"
        rationale = (
            f"measured within noise: baseline {t_base_ms:.4g} ms [{base[1]:.4g}, {base[2]:.4g}], candidate "
            f"{t_cand_ms:.4g} ms [{cand[1]:.4g}, {cand[2]:.4g}] (speedup {bins.speedup_text(s, 3)}x, its 95% interval includes 1); "
            "measure both with more runs to separate them"
        )
    if suspicion is not None and verdict != "unsure":
        verdict = "unsure"
        rationale += f"; not decided: {suspicion}"
    return CandidateForecast(
        id=cid,
        p_faster=p,
        speedup_bins=probs,
        expected_speedup=s,
        verdict=verdict,
        decided_by="cache" if by == "cache" else "measurement",
        rationale=rationale,
        confidence=max(p, 1.0 - p),
        measured_speedup=s,
    )


def _does_not_compile(extras: Mapping[str, Any], baseline: bool = False) -> bool:
    """Whether a forecast found its candidate's source (`baseline`: its baseline's) rejected by this server's
    nvcc (`extras["compile_error"]`, from the local forecaster's ptxas compile)."""
    return float(extras.get("compile_error_baseline" if baseline else "compile_error", 0.0)) >= 1.0


def _compile_errors_note(
    base_id: str, forecast: Sequence[CandidateForecast], fc_by_id: Mapping[str, Any]
) -> str | None:
    """What measure_next left out because this server's nvcc rejects the source, and what to do; None if none."""
    ids = [r.id for r in forecast if _does_not_compile(fc_by_id[r.id].extras)]
    if any(_does_not_compile(fc_by_id[r.id].extras, baseline=True) for r in forecast):
        ids.insert(0, f"{base_id} (the baseline)")
    if not ids:
        return None
    return (
        f"left out of measure_next, as their source does not compile with this server's nvcc: {_listed_ids(ids)} "
        "(the first error line is in each rationale); fix the source and ask again, or measure_kernel one for the "
        "compiler's full output"
    )


def _source_notes(kernels: Sequence[Kernel], workload: Workload) -> list[str]:
    """Mistakes in a candidate that a measurement would fail on, or (a Python or Triton module's) that leave its
    forecast reading the whole module: an entry the source does not define, a workload listing another number of
    arguments than the kernel takes. One note per mistake, naming the candidates that make it (a search sends many
    members of one family)."""
    found: dict[str, list[str]] = {}
    checked: dict[tuple[str, str], str | None] = {}
    for k in kernels:
        if k.language not in ("cuda", "hip", *PYTHON_LANGUAGES):
            continue
        key = (k.source_hash(), k.entry)
        if key not in checked:
            checked[key] = None
            python = k.language in PYTHON_LANGUAGES
            # In a Python source the raw text is searched, strings and all: a CuPy or load_inline kernel's name
            # is in its CUDA string.
            if re.search(rf"\b{re.escape(k.entry)}\b", k.source) is None:
                checked[key] = (
                    f"the source never names {k.entry!r} (the entry): the forecast cannot tell which kernel runs "
                    "and reads the whole module; pass the @triton.jit function's name (or, for CUDA in a Python "
                    "string, its __global__ function's)"
                    if python
                    else f"the source never names {k.entry!r} (the entry): unless a macro builds that name, "
                    "measure_kernel will find no such kernel; pass the __global__ function's name"
                )
            elif not python:  # (parameters against workload.args: read from a C source only)
                count = entry_parameter_count(k.source, k.entry)
                if workload.args and count is not None and count != len(workload.args):
                    checked[key] = (
                        f"{k.entry} appears to take {count} parameters but workload.args lists "
                        f"{len(workload.args)}: measure_kernel checks the compiled kernel and refuses a mismatch; "
                        "list one argument per parameter, in order"
                    )
        problem = checked[key]
        if problem is not None:
            found.setdefault(problem, []).append(str(k.id))
    out = []
    for problem, ids in found.items():
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        out.append(f"candidate{'s' if len(ids) > 1 else ''} {shown}: {problem}")
    return out


_UNCHECKED = "unchecked"


def check_key(reference: Kernel | None, atol: float, rtol: float, *, earlier: bool = False) -> str:
    """What a measurement's outputs are checked against: the reference kernel's content and the tolerances,
    or nothing (tolerances mean nothing without a reference). `earlier`: with the reference's earlier content
    key (`Kernel.earlier_content_key`), as rows saved before it changed hold it."""
    if reference is None:
        return _UNCHECKED
    # One spelling per tolerance: 0, 0.0 and -0.0 are one request.
    tolerances = {"atol": repr(float(atol) + 0.0), "rtol": repr(float(rtol) + 0.0)}
    key = (reference.earlier_content_key() if earlier else None) or reference.content_key()
    return json.dumps({"reference": key, **tolerances}, sort_keys=True)


def _differences(used: IdempotentRequest, kernel: Kernel, workload_key: str, stored_as: str) -> list[str]:
    """What a retry under a used idempotency key changed (a kernel saved under its earlier content key is
    the same kernel; a replay of the same GPU is the same device, whichever recordings it has now)."""
    out = [] if used.content_key in (kernel.content_key(), kernel.earlier_content_key()) else ["kernel"]
    if used.workload_key != workload_key:
        out.append("workload")
    if used.hardware != stored_as and not _same_replayed_gpu(used.hardware, stored_as):
        out.append("hardware")
    return out


def _same_replayed_gpu(a: str, b: str) -> bool:
    """Whether two stored histories are replays of one GPU: a retry under an idempotency key is the same request
    after the operator adds a recording of that GPU (its history key names the recordings), and after an upgrade
    moved the replayed measurements stored before to "<GPU> (replay)" (store migration 16); the key's recorded
    answer answers it, free (it was refused as another device's)."""
    return REPLAY_HISTORY_MARK in a and REPLAY_HISTORY_MARK in b and history_gpu(a) == history_gpu(b)


# Flags that describe the request a result answered, not the result: not carried to the copies others get.
_REQUEST_FLAGS = frozenset({MAX_SECONDS_LOWERED_TO_BUDGET})


def _free_copy(result: MeasureResult, kernel_id: str) -> MeasureResult:
    return result.model_copy(
        update={
            "kernel_id": kernel_id,
            "cost": MeasureCost(
                gpu_seconds=0.0,
                compile_seconds=0.0,
                cached=True,
                max_seconds=result.cost.max_seconds,
                max_runs=result.cost.max_runs,
            ),
            "flags": [f for f in result.flags if f not in _REQUEST_FLAGS],
        }
    )


# Flags by which a measurer says a run stopped before it was as precise as it could have been.
_IMPRECISE_FLAGS = frozenset(
    {"noise_target_not_reached", "runs_capped_by_max_runs", "runs_capped_by_max_seconds"}
)


def _precise_enough(hit: MeasureResult, request: MeasureRequest, min_runs: int) -> bool:
    """Whether a cached result may answer `request` (the cache key leaves out max_runs and max_seconds).

    Failures and results without timings are served as they are. An ok result is served when a fresh run
    under this request could be no more precise: it already has max_runs runs, or it used at least the
    request's max_seconds, or it ran under limits at least this request's (a measurer stops before the run that
    would cross its cap, so a capped result costs a little under it), or it was complete (none of
    _IMPRECISE_FLAGS, and at least min(max_runs, min_runs) runs, min_runs being the measurer's own minimum).
    Otherwise the kernel is measured again (and charged), so a quick max_runs=1 result never stands in for a
    max_runs=1000 request."""
    stats = hit.runtime_ms
    if hit.status != "ok" or stats is None:
        return True
    if stats.runs >= request.max_runs or hit.cost.gpu_seconds >= request.max_seconds:
        return True
    ran_seconds, ran_runs = hit.cost.max_seconds, hit.cost.max_runs
    if ran_seconds is not None and ran_runs is not None:
        if ran_seconds >= request.max_seconds and ran_runs >= request.max_runs:
            return True
    complete = not _IMPRECISE_FLAGS.intersection(hit.flags)
    return complete and stats.runs >= min(request.max_runs, max(1, min_runs))


def _cache_key(request: MeasureRequest, fingerprint: str) -> str:
    """Which stored results may answer `request`: same kernel, workload, device and output check.

    The check is `check_key`'s: tolerances in one spelling (0, 0.0 and -0.0 are one request) and none without
    a reference kernel, where they check nothing (a kernel measured unchecked under another atol is a hit)."""
    return _digest(request, fingerprint, check=check_key(request.reference, request.atol, request.rtol))


def _legacy_cache_key(request: MeasureRequest, fingerprint: str) -> str:
    """The key results were stored under before `_cache_key` normalised the check (raw tolerances, kept even
    without a reference) and before define values were read as the compiler reads them (the kernels' earlier
    content keys); still looked up, so those results keep answering."""
    ref = request.reference
    reference = (ref.earlier_content_key() or ref.content_key()) if ref is not None else None
    kernel = request.kernel.earlier_content_key() or request.kernel.content_key()
    return _digest(request, fingerprint, kernel, reference=reference, atol=request.atol, rtol=request.rtol)


def _digest(request: MeasureRequest, fingerprint: str, kernel: str | None = None, **check: Any) -> str:
    payload = {
        "kernel": kernel or request.kernel.content_key(),
        "workload": request.workload.history_key(),
        "device": fingerprint,
        **check,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_forecasters(settings: Settings, store: Store) -> list[Forecaster]:
    from forecaster_mcp.forecast.local import LocalForecaster

    out: list[Forecaster] = [
        LocalForecaster(
            store,
            nvcc=settings.nvcc,
            cache_dir=settings.home / "cache",
            max_cache_bytes=int(settings.model_cache_mb * 2**20),
        )
    ]
    if settings.anthropic_api_key:
        from forecaster_mcp.forecast.claude import ClaudeForecaster
        from forecaster_mcp.forecast.ptxas import find_nvcc

        out.append(
            ClaudeForecaster(
                api_key=settings.anthropic_api_key,
                model=settings.claude_model,
                samples=settings.claude_samples,
                usage_sink=store,
                ledger=settings.ledger,
                time_limit_s=settings.forecast_timeout_s,
                nvcc=find_nvcc(settings.nvcc),
                cache_dir=settings.home / "cache",
            )
        )
    return out


def build_measurers(settings: Settings) -> tuple[list[Measurer], list[str]]:
    """Replay recordings when given; pycuda on a local GPU when present (auto)."""
    measurers: list[Measurer] = []
    notes: list[str] = []
    # An explicit choice that cannot work is refused at start-up, not at the agent's first measurement.
    if settings.replay and settings.measurer in ("pycuda", "none"):
        raise OperatorError(
            f"--replay recordings are measured only with --measurer auto or replay, not {settings.measurer!r}: "
            "drop one of the two (or unset FORECASTER_MCP_REPLAY / FORECASTER_MCP_MEASURER)"
        )
    if settings.measurer == "replay" and not settings.replay:
        raise OperatorError("--measurer replay needs a recording: add --replay RECORDING")
    if settings.measurer in ("auto", "replay") and settings.replay:
        from forecaster_mcp.measure.replay import ReplayMeasurer

        missing = [str(p) for p in settings.replay if not p.exists()]
        if missing:
            raise OperatorError(f"replay recording not found: {', '.join(missing)}")
        replay: Measurer = ReplayMeasurer(list(settings.replay))
        if settings.replay_realtime > 0:
            from forecaster_mcp.measure.realtime import RealtimeReplay

            replay = RealtimeReplay(replay, settings.replay_realtime)
        measurers.append(replay)
    if settings.measurer in ("auto", "pycuda"):
        from forecaster_mcp.measure.pycuda_measurer import PycudaMeasurer, detect_reason

        gpu = PycudaMeasurer.detect(settings.home / "compile-cache", nvcc=settings.nvcc)
        if gpu is not None:
            measurers.append(gpu)
        elif settings.measurer == "pycuda":
            raise OperatorError(f"--measurer pycuda cannot measure on this machine: {detect_reason()}")
        elif measurers:
            # The replay measures: a missing GPU backend is no fault of this server (budget_status shows these
            # notes, and a bare "pycuda is not installed" had an agent ask its user to install it).
            notes.append(
                "measurements replay the recordings given with --replay (their kernels are measured); no local "
                f"GPU besides them: {detect_reason()}"
            )
        else:
            notes.append(f"no local GPU measurement: {detect_reason()}")
    return measurers, notes


__all__ = ["HardwareChoice", "Service", "__version__", "build_forecasters", "build_measurers"]
