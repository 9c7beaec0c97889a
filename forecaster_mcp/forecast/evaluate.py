"""`forecaster-mcp eval PAIRS.jsonl` and `forecaster-mcp make-pairs REC...`.

eval writes into --out: metrics.json (metrics.summarize of each component, raw and calibrated, and of the
final forecast with the selective verdicts), predictions.jsonl (one line per pair), reliability.png and
risk_coverage.png (skipped with a note when matplotlib is missing).

Pairs file (JSON lines, DESIGN.md "Formats"): one pair per line, `{"id", "hardware", "workload",
"baseline": Kernel, "candidate": Kernel, "speedup": t_base / t_cand, "source"}`.
A line may instead be `{"history": point}` or `{"history": [point, ...]}` with
`point = {"hardware", "workload", "kernel": Kernel, "runtime_ms", "status"}` (status defaults to "ok"):
measurements the local model may learn from (the kernel family's online model), as the server's store
would hold them. Pairs never share a kernel with history written by make-pairs.

`--calibrate-on CAL.jsonl` forecasts CAL's pairs first and splits them alternately by their order among the pairs
(history lines not counted; a pair no forecaster answered is skipped, and so is one answered from two
measurements of the file's history, which the server would not learn from): the 1st, 3rd, ... fit the calibration and
combination, the 2nd, 4th, ... (forecast with that calibration) choose the selective threshold,
so the threshold is certified on pairs the calibration never saw. Then PAIRS is evaluated.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, get_args

import numpy as np
from pydantic import ValidationError

from forecaster_mcp.errors import OperatorError, validation_message
from forecaster_mcp.forecast import metrics as M
from forecaster_mcp.forecast.base import close_forecasters
from forecaster_mcp.forecast.selective import (
    MAX_TARGET_ERROR,
    MIN_TARGET_ERROR,
    ThresholdChoice,
    decision_p,
    p_fail_baseline_of,
)
from forecaster_mcp.models import Kernel, MeasureStatus, Workload

if TYPE_CHECKING:
    import argparse

    from forecaster_mcp.forecast.base import Forecaster, PairQuery
    from forecaster_mcp.forecast.engine import EngineForecast, ForecastEngine, Regime
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import AnchorPoint, FamilyPoint

    # What _forecast_all gives: the engine, the pairs' queries and forecasts, the thresholds chosen (per forecaster
    # and regime), the calibration fitted (with --calibrate-on) and the notes.
    _Forecasted = tuple[
        ForecastEngine,
        list[PairQuery],
        list[EngineForecast],
        dict[tuple[str, Regime], ThresholdChoice],
        "_Calibration | None",
        list[str],
    ]

log = logging.getLogger(__name__)

KNOWN_FORECASTERS = ("local", "claude")
# make-pairs writes this into the stand-in source of recorded kernels: there is nothing to compile.
PLACEHOLDER_MARKER = "the kernel source is not included"
DELTA = 0.05
# metrics.json keys of the per-GPU thresholds per forecast regime (forecast/engine.py), and how the table
# names them.
_THRESHOLD_KEYS: tuple[tuple[Regime, str, str], ...] = (
    ("model", "thresholds", ""),
    ("unmeasured", "thresholds_unmeasured", " for two unmeasured kernels"),
    ("prior", "thresholds_static_prior", " for static-prior forecasts"),
)


# ---------------------------------------------------------------- reading pairs files


@dataclass(frozen=True)
class EvalPair:
    id: str
    hardware: str
    workload: Workload
    baseline: Kernel
    candidate: Kernel
    speedup: float
    source: str
    line: int


@dataclass(frozen=True)
class HistoryPoint:
    hardware: str
    workload: Workload
    kernel: Kernel
    runtime_ms: float | None
    status: str


@dataclass
class PairsFile:
    path: Path
    pairs: list[EvalPair] = field(default_factory=list)
    history: list[HistoryPoint] = field(default_factory=list)


def _bad(path: Path, line: int, message: str) -> OperatorError:
    return OperatorError(f"{path}:{line}: {message}")


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {validation_message(first)}" if where else validation_message(first)


def _model(path: Path, line: int, what: str, value: Any, cls: type[Kernel] | type[Workload]) -> Any:
    if not isinstance(value, dict):
        raise _bad(path, line, f"'{what}' must be a JSON object")
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        raise _bad(path, line, f"bad {what}: {_validation_message(exc)}") from exc


def _positive(path: Path, line: int, what: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, int) and value.bit_length() > 1000)  # math.isfinite overflows on it
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(path, line, f"'{what}' must be a positive finite number, got {value!r}")
    return float(value)


_STATUSES: tuple[str, ...] = get_args(MeasureStatus)


def _check_hardware(path: Path, line: int, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise _bad(path, line, "'hardware' must be a GPU name such as \"A100\"")


def _pair_id(path: Path, line: int, value: Any) -> str:
    """A pair's id: a string or an integer as written, `line<n>` when absent or null."""
    if value is None:
        return f"line{line}"
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(
            path, line, "'id' must be a string or an integer (or left out: the line number names the pair)"
        )
    return str(value)


def _history_point(path: Path, line: int, d: Any) -> HistoryPoint:
    if not isinstance(d, dict):
        raise _bad(path, line, "each history point must be a JSON object")
    missing = [k for k in ("hardware", "workload", "kernel") if k not in d]
    if missing:
        raise _bad(path, line, f"history point lacks {', '.join(missing)}")
    _check_hardware(path, line, d["hardware"])
    status = str(d.get("status", "ok"))
    if status not in _STATUSES:
        # Anything but "ok" is a failure to the model: a typo ("OK") would drop the runtime and fail the kernel.
        raise _bad(path, line, f"unknown status {status[:40]!r}: one of {', '.join(_STATUSES)}")
    runtime = d.get("runtime_ms")
    return HistoryPoint(
        hardware=str(d["hardware"]),
        workload=_model(path, line, "workload", d["workload"], Workload),
        kernel=_model(path, line, "kernel", d["kernel"], Kernel),
        runtime_ms=_positive(path, line, "runtime_ms", runtime) if status == "ok" else None,
        status=status,
    )


# How long one eval chunk's kernels may compile for the local model's ptxas features (2 at a time, cached).
EVAL_PTXAS_WAIT_S = 1800.0
# Pairs forecast per engine call by `forecaster-mcp eval` (without --batch).
EVAL_CHUNK_PAIRS = 1000


def is_pairs_file(path: Path) -> bool:
    """Whether `path` starts with a pairs-file line (a pair or a history point), to tell a user who passed one
    where a recording or an export belongs what the file is (the test lives with the replay, which needs it
    without importing this module)."""
    from forecaster_mcp.measure.replay import starts_like_pairs_file

    return starts_like_pairs_file(path)


def read_pairs_file(path: Path) -> PairsFile:
    """Parse a pairs file; OperatorError naming the file and line for anything malformed."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OperatorError(f"cannot read pairs file {path}: {exc}") from exc
    if data[:2] == b"\x1f\x8b":
        raise OperatorError(
            f"{path} is gzip-compressed (a Kernel Tuner recording?), not a pairs file (JSON lines): make one from "
            f"a recording with `forecaster-mcp make-pairs {path} --history 100 --out pairs.jsonl`, then eval that"
        )
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (some editors write one) is skipped
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _bad(path, line, f"not UTF-8 text (byte {data[exc.start]:#04x} at column {column})") from exc
    out = PairsFile(path)
    seen: dict[str, int] = {}  # pair id -> its line
    # Lines end at "\n" only: str.splitlines() would also split inside strings at U+2028, U+0085 and the like,
    # which JSON writers leave unescaped (ensure_ascii=False).
    for n, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _bad(path, n, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits; nesting too deep
            raise _bad(path, n, f"not a pairs line this reader accepts ({type(exc).__name__})") from exc
        if not isinstance(d, dict):
            raise _bad(path, n, "each line must be a JSON object")
        if "history" in d:
            if any(k in d for k in ("baseline", "candidate", "speedup")):
                raise _bad(
                    path, n, "a line is a pair or holds history points ('history'), not both: split it"
                )
            points = d["history"] if isinstance(d["history"], list) else [d["history"]]
            out.history.extend(_history_point(path, n, p) for p in points)
            continue
        missing = [k for k in ("hardware", "baseline", "candidate", "speedup") if k not in d]
        if missing:
            raise _bad(
                path, n, f"missing {', '.join(missing)} (a pair needs hardware, baseline, candidate, speedup)"
            )
        _check_hardware(path, n, d["hardware"])
        pair_id = _pair_id(path, n, d.get("id"))
        out.pairs.append(
            EvalPair(
                id=pair_id,
                hardware=d["hardware"],
                workload=_model(path, n, "workload", d.get("workload", {}), Workload),
                baseline=_model(path, n, "baseline", d["baseline"], Kernel),
                candidate=_model(path, n, "candidate", d["candidate"], Kernel),
                speedup=_positive(path, n, "speedup", d["speedup"]),
                source=str(d.get("source", "")),
                line=n,
            )
        )
        if pair_id in seen:
            raise _bad(
                path,
                n,
                f"pair id {pair_id[:80]!r} is already used on line {seen[pair_id]}: give each pair its own",
            )
        seen[pair_id] = n
    if not out.pairs:
        raise OperatorError(f"{path}: no pairs in the file")
    return out


# ---------------------------------------------------------------- in-file history for the local model


def _canonical(hardware: str) -> str:
    from forecaster_mcp.hardware.specs import canonical_name

    return canonical_name(hardware)


class MemoryHistory:
    """A FamilyHistory over the pairs file's history points (what the store would hold)."""

    def __init__(self, points: Sequence[HistoryPoint]) -> None:
        from forecaster_mcp.store.db import NOT_A_POINT, FamilyPoint

        # As Store.family_points reads them: per kernel its latest ok point if it has one, else its latest of
        # any status, none that says nothing of the kernel (NOT_A_POINT), ordered by the point kept.
        latest: dict[tuple[str, str, str], dict[str, FamilyPoint]] = {}
        for p in points:
            if p.status in NOT_A_POINT:
                continue
            key = (p.kernel.family_key(), _canonical(p.hardware), p.workload.key())
            family, content = latest.setdefault(key, {}), p.kernel.content_key()
            kept = family.get(content)
            if kept is not None and kept.status == "ok" and p.status != "ok":
                continue
            family.pop(content, None)
            family[content] = FamilyPoint(
                defines=dict(p.kernel.defines),
                launch=p.kernel.launch.model_dump() if p.kernel.launch else None,
                status=p.status,
                runtime_ms=p.runtime_ms,
                content_key=content,
                compile_options=tuple(p.kernel.compile_options),
            )
        self._points = {k: list(v.values()) for k, v in latest.items()}
        # Per (GPU, workload): the kernels measured running, latest last, as Store.workload_anchors reads them.
        self._running: dict[tuple[str, str], dict[str, HistoryPoint]] = {}
        for p in points:
            running = self._running.setdefault((_canonical(p.hardware), p.workload.key()), {})
            content = p.kernel.content_key()
            if p.status == "ok" and p.runtime_ms is not None and p.runtime_ms > 0:
                running.pop(content, None)  # latest last: the store anchors on a kernel's latest ok run
                running[content] = p

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        return list(self._points.get((family_key, hardware, workload_key), []))

    async def workload_anchors(
        self, hardware: str, workload_key: str, limit: int, exclude_families: Sequence[str] = ()
    ) -> list[AnchorPoint]:
        """The Store's workload_anchors over the file's history: the latest running kernel of each family."""
        from forecaster_mcp.store.db import AnchorPoint

        excluded = set(exclude_families)
        out: list[AnchorPoint] = []
        for content, p in reversed(self._running.get((hardware, workload_key), {}).items()):
            if len(out) >= limit:
                break
            family = p.kernel.family_key()
            if family in excluded:
                continue
            excluded.add(family)
            assert p.runtime_ms is not None
            out.append(AnchorPoint(p.kernel.model_dump_json(), family, content, p.runtime_ms, None))
        return out


# ---------------------------------------------------------------- running forecasters


def parse_forecaster_arg(arg: str) -> list[str]:
    names = [n.strip() for n in arg.split("+") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_FORECASTERS]
    if not names or unknown or len(set(names)) != len(names):
        raise OperatorError(f"--forecaster must be local, claude or local+claude, got {arg!r}")
    return names


def build_forecasters(
    names: Sequence[str], settings: Settings, history: MemoryHistory | None, *, ptxas: bool = True
) -> list[Forecaster]:
    """The forecasters named by --forecaster; `ptxas=False` stops the local model compiling kernels."""
    out: list[Forecaster] = []
    for name in names:
        if name == "local":
            from forecaster_mcp.forecast.local import LocalForecaster

            cache_dir = settings.home / "cache"
            if ptxas:
                # Every kernel of the file compiled (cached by content): a chunk has far more new kernels than
                # the server's per-call limit, so eval compiled none of them and --no-ptxas changed nothing.
                out.append(
                    LocalForecaster(
                        history,
                        nvcc=settings.nvcc,
                        cache_dir=cache_dir,
                        ptxas_wait_s=EVAL_PTXAS_WAIT_S,
                        max_ptxas_per_call=2 * EVAL_CHUNK_PAIRS,
                    )
                )
            else:
                out.append(
                    LocalForecaster(history, nvcc=settings.nvcc, cache_dir=cache_dir, ptxas_wait_s=0.0)
                )
        elif name == "claude":
            if not settings.anthropic_api_key:
                raise OperatorError(
                    "--forecaster claude needs an Anthropic API key: set FORECASTER_MCP_ANTHROPIC_API_KEY "
                    "(or ANTHROPIC_API_KEY)"
                )
            from forecaster_mcp.forecast.claude import ClaudeForecaster
            from forecaster_mcp.forecast.ptxas import find_nvcc

            try:
                out.append(
                    ClaudeForecaster(
                        api_key=settings.anthropic_api_key,
                        model=settings.claude_model,
                        samples=settings.claude_samples,
                        nvcc=find_nvcc(settings.nvcc) if ptxas else None,
                        cache_dir=settings.home / "cache",
                        # Every kernel of a chunk compiled, as for the local model: with the server's per-call
                        # limit, eval's prompts never carried the registers a compare's prompt does.
                        max_ptxas_kernels=2 * EVAL_CHUNK_PAIRS,
                        ptxas_wait_s=EVAL_PTXAS_WAIT_S,
                    )
                )
            except Exception as exc:  # the SDK's own refusals (forbidden in tests, missing key)
                raise OperatorError(f"cannot start the Claude forecaster: {exc}") from exc
    return out


def _worth_compiling(f: PairsFile) -> bool:
    """False when every kernel is a make-pairs stand-in: ptxas would learn nothing from a declaration."""
    return any(PLACEHOLDER_MARKER not in k.source for p in f.pairs for k in (p.baseline, p.candidate))


def _queries(pairs: Sequence[EvalPair]) -> list[PairQuery]:
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.hardware.specs import lookup

    out = []
    for p in pairs:
        spec = lookup(p.hardware)
        out.append(
            PairQuery(p.baseline, p.candidate, p.workload, spec.name if spec else p.hardware.strip(), spec)
        )
    return out


def _unknown_gpu_notes(pairs: Sequence[EvalPair]) -> list[str]:
    """One note per GPU name the spec table does not know: those pairs are forecast without hardware features."""
    from forecaster_mcp.hardware.specs import lookup, suggest

    counts: dict[str, int] = {}
    for p in pairs:
        if lookup(p.hardware) is None:
            name = p.hardware.strip()
            counts[name] = counts.get(name, 0) + 1
    notes = []
    for name, n in counts.items():
        close = suggest(name, limit=3)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        notes.append(
            f"no specification known for GPU {name[:80]!r}{hint}: its {n} pair{'s were' if n != 1 else ' was'} "
            "forecast without hardware-specific features (known GPUs are listed in the gpu-specs resource)"
        )
    return notes


@dataclass
class _Calibration:
    fit_outcomes: list[Any]
    history_hw: list[str]
    history_raw: list[dict[str, list[float]]]
    history_slots: list[dict[str, str]]
    history_regimes: list[Regime]
    history_speedups: list[float]
    n_pairs: int
    llm: dict[str, float] = field(default_factory=dict)
    # Each history forecast's chances of its candidate and its baseline failing: thresholds are certified on
    # the confidence its verdict was decided on (selective.decision_p), as the server stores it.
    history_fail: list[tuple[float, float]] = field(default_factory=list)
    # Each history forecast's components' caps on their own confidence (EngineForecast.caps).
    history_caps: list[dict[str, float]] = field(default_factory=list)


_LLM_COUNTS = ("requests", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


def _llm_line(llm: dict[str, float]) -> str:
    """One line of what Claude cost, from `_llm_usage`."""
    return (
        f"claude: {llm['requests']:.0f} requests, {llm['input_tokens']:.0f} input "
        f"(+{llm['cache_read_tokens']:.0f} cache read, {llm['cache_write_tokens']:.0f} cache write) / "
        f"{llm['output_tokens']:.0f} output tokens, ${llm['cost_usd']:.4f}"
    )


def _answers_kept(forecasters: Sequence[object], counter: str) -> tuple[int, Path] | None:
    """Claude's answers saved (`answers_saved`) or reused (`answers_reused`), and their folder; None: none."""
    found = [(getattr(f, counter, 0), getattr(f, "answers_dir", None)) for f in forecasters]
    total = sum(n for n, _ in found)
    folder = next((d for n, d in found if n and d is not None), None)
    return (total, folder) if total and folder is not None else None


def _llm_usage(forecasters: Sequence[object], into: dict[str, float] | None = None) -> dict[str, float]:
    """Requests, tokens and dollars the paid forecasters (Claude) spent, added to `into`."""
    out = dict(into or {})
    for f in forecasters:
        usage = getattr(f, "usage_total", None)
        if usage is None:
            continue
        for k in _LLM_COUNTS:
            out[k] = out.get(k, 0) + getattr(usage, k)
        out["cost_usd"] = out.get("cost_usd", 0.0) + float(getattr(f, "cost_usd_total", 0.0))
    return out


async def _calibrate_phase(
    names: Sequence[str],
    settings: Settings,
    cal: PairsFile,
    ptxas: bool,
    batch: bool = False,
    built: list[Forecaster] | None = None,
) -> tuple[_Calibration, list[str]]:
    from forecaster_mcp.forecast.engine import ForecastEngine

    forecasters = build_forecasters(
        names, settings, MemoryHistory(cal.history), ptxas=ptxas and _worth_compiling(cal)
    )
    if built is not None:
        built.extend(forecasters)
    engine = ForecastEngine(forecasters, None)
    queries = _queries(cal.pairs)
    forecasts = await _forecast_in_chunks(engine, queries, batch)
    fit, hw, raw, slots, speedups = [], [], [], [], []
    regimes: list[Regime] = []
    fails: list[tuple[float, float]] = []
    caps: list[dict[str, float]] = []
    lookups = 0
    for i, (q, p, f) in enumerate(zip(queries, cal.pairs, forecasts, strict=True)):
        if f.from_measurements:
            # Answered from two measurements of the file's history: measured truth, near-certain and right. The
            # server neither stores nor learns from such answers; here they sharpened the calibration and
            # certified thresholds the forecasts themselves would not.
            lookups += 1
            continue
        if not f.raw:
            continue
        if i % 2 == 0:
            fit.append(f.outcome(q.hardware_name, p.speedup))
        elif not f.partial:
            # A forecast some components did not answer is not the combination's: the server stores it under
            # the names of those that did, so it certifies none of the combination's thresholds.
            hw.append(q.hardware_name)
            raw.append(dict(f.raw))
            slots.append(dict(f.slots))
            regimes.append(f.regime)
            speedups.append(p.speedup)
            fails.append((f.p_fail, p_fail_baseline_of(f.extras)))
            caps.append(dict(f.caps))
    notes = _unknown_gpu_notes(cal.pairs) + sorted({n for f in forecasts for n in f.notes})
    if lookups:
        notes.append(
            f"{lookups} pair(s) have both kernels in the file's history: answered from those measurements, they "
            "are left out of the calibration and the thresholds (as the server leaves such answers out)"
        )
    return _Calibration(
        fit, hw, raw, slots, regimes, speedups, len(cal.pairs), _llm_usage(forecasters), fails, caps
    ), notes


async def _forecast_in_chunks(
    engine: ForecastEngine, queries: Sequence[PairQuery], batch: bool
) -> list[EngineForecast]:
    """The engine's forecasts of `queries`, EVAL_CHUNK_PAIRS pairs a call (the pairs file and --calibrate-on's).

    In chunks: the local model predicts a call's unmeasured kernels jointly (memory grows with the square of their
    number; 11k distinct kernels in one call took 6 GB). Each pair's two kernels share a chunk. With `batch`, one
    Message Batches submission for the file (chunks would each wait their turn on the API), and the forecasters
    without batches still answer in chunks."""
    if batch:
        return await engine.forecast(queries, bulk=True, chunk_pairs=EVAL_CHUNK_PAIRS)
    forecasts: list[EngineForecast] = []
    for start in range(0, len(queries), EVAL_CHUNK_PAIRS):
        forecasts += await engine.forecast(queries[start : start + EVAL_CHUNK_PAIRS])
    return forecasts


def _apply_calibration(engine: ForecastEngine, cal: _Calibration) -> None:
    from forecaster_mcp import bins

    engine.fit(cal.fit_outcomes)
    finals = [
        decision_p(bins.p_faster(engine.combine_raw(r, hw, sl, cp)), p_fail, p_fail_baseline)
        for r, hw, sl, (p_fail, p_fail_baseline), cp in zip(
            cal.history_raw,
            cal.history_hw,
            cal.history_slots,
            cal.history_fail,
            cal.history_caps,
            strict=True,
        )
    ]
    engine.set_history(cal.history_hw, finals, cal.history_speedups, cal.history_regimes)


# ---------------------------------------------------------------- the report


def _fmt(v: Any, width: int = 9) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:.3f}".rjust(width)
    return str(v).rjust(width)


def _small(x: float) -> str:
    """Three decimals, or two significant digits below 0.01 (0.00079 is not 0.001 next to 0.00046)."""
    return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.2g}"


def _final_label(forecaster: dict[str, Any]) -> str:
    """ "<name> final", naming the components that answered when not all did (Claude skipped, say)."""
    answered = forecaster.get("answered")
    components = forecaster.get("components") or []
    if answered is None or len(answered) == len(components):
        return f"{forecaster['name']} final"
    names = "+".join(str(c).split("@")[0] for c in answered) or "none"
    return f"{forecaster['name']} final ({names} answered)"


def print_table(report: dict[str, Any], out: TextIO) -> None:
    cols = [
        ("pairs", "n_pairs"),
        ("acc", "pairwise_accuracy"),
        ("bin_acc", "bin_accuracy"),
        ("brier", "brier"),
        ("ece", "ece"),
        ("aurc", "aurc"),
        ("risk@80", "risk_at_80"),
        ("cover", "coverage"),
        ("dec_acc", "decided_accuracy"),
    ]
    rows: list[tuple[str, dict[str, Any]]] = []
    for name, comp in report["components"].items():
        rows.append((f"{name} raw", comp["raw"]))
        if "calibrated" in comp:
            rows.append((f"{name} calibrated", comp["calibrated"]))
    rows.append((_final_label(report["forecaster"]), report["final"]))
    width = max(len(r[0]) for r in rows) + 2
    print("forecaster".ljust(width) + "".join(_fmt(c) for c, _ in cols), file=out)
    for label, m in rows:
        print(label.ljust(width) + "".join(_fmt(m.get(k)) for _, k in cols), file=out)
    final = report["final"]
    print(f"ties (|log2 S| <= log2 1.03) left out of direction metrics: {final['n_ties']}", file=out)
    if final.get("coverage_non_tie") is not None:
        print(
            f"cover: decided verdicts over all pairs, ties included; over the non-tie pairs (the denominator "
            f"of aurc and risk@80) {final['coverage_non_tie']:.3f}",
            file=out,
        )
    if final.get("ece_if_calibrated") is not None:
        print(
            f"sampling noise: a perfectly calibrated forecaster with the final confidences would show ECE "
            f"{_small(final['ece_if_calibrated'])} on these pairs on average (90% of the time at most "
            f"{_small(final['ece_if_calibrated_p90'])}); read the final ece against it",
            file=out,
        )
    used = report.get("forecasts_per_regime", {})
    for regime, key, label in _THRESHOLD_KEYS:
        if not used.get(regime) and (regime != "model" or any(used.values())):
            continue  # no forecast was made in this regime: its threshold decided nothing
        for hw, choice in report[key].items():
            print(f"threshold on {hw}{label}: {choice['threshold']:.3f} ({choice['reason']})", file=out)


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


async def _forecast_all(
    names: Sequence[str],
    settings: Settings,
    main: PairsFile,
    cal_file: PairsFile | None,
    target: float,
    ptxas: bool,
    batch: bool = False,
    built: list[Forecaster] | None = None,
) -> _Forecasted:
    """Forecast the calibration file (if any) then the pairs; `built` gets every forecaster made, both phases,
    for what they spent should the run be stopped. The forecasters are closed at the end, also of a run stopped
    (Ctrl-C): Claude's requests still running get CLOSE_WAIT_S to answer, so that what they cost is counted and
    their answers kept for a rerun."""
    import anyio

    built = [] if built is None else built
    try:
        return await _forecast_both(names, settings, main, cal_file, target, ptxas, batch, built)
    finally:
        with anyio.CancelScope(shield=True):
            await close_forecasters(built)


async def _forecast_both(
    names: Sequence[str],
    settings: Settings,
    main: PairsFile,
    cal_file: PairsFile | None,
    target: float,
    ptxas: bool,
    batch: bool,
    built: list[Forecaster],
) -> _Forecasted:
    from forecaster_mcp.forecast.engine import ForecastEngine

    notes: list[str] = []
    calibration = None
    if cal_file is not None:
        calibration, cal_notes = await _calibrate_phase(names, settings, cal_file, ptxas, batch, built)
        notes += [f"calibration file: {n}" for n in cal_notes]
    forecasters = build_forecasters(
        names, settings, MemoryHistory(main.history), ptxas=ptxas and _worth_compiling(main)
    )
    built.extend(forecasters)
    # Thresholds certified on every calibration pair: the newest-first window of a server (forecasts under an
    # older calibration stop counting) would keep only the file's last pairs here, often one recording's.
    engine = ForecastEngine(forecasters, None, history_window=None)
    if calibration is not None:
        _apply_calibration(engine, calibration)
    queries = _queries(main.pairs)
    forecasts = await _forecast_in_chunks(engine, queries, batch)
    notes += _unknown_gpu_notes(main.pairs) + _pairs_notes(main)
    notes += sorted({n for f in forecasts for n in f.notes})
    # Per GPU the threshold of each regime forecasts were made in (module doc of forecast/engine.py).
    keys: list[tuple[str, Regime]] = [(q.hardware_name, "model") for q in queries]
    keys += [(q.hardware_name, f.regime) for q, f in zip(queries, forecasts, strict=True)]
    thresholds = {k: await engine.threshold(k[0], target, k[1]) for k in dict.fromkeys(keys)}
    return engine, queries, forecasts, thresholds, calibration, notes


def _pair_key(p: EvalPair) -> tuple[str, str, frozenset[str]]:
    """The question a pair asks, either kernel the baseline."""
    return (
        _canonical(p.hardware),
        p.workload.key(),
        frozenset((p.baseline.content_key(), p.candidate.content_key())),
    )


def _pairs_notes(pairs_file: PairsFile) -> list[str]:
    """What a reader of the metrics should know of the file: pairs asked twice, pairs the history answers."""
    notes = []
    seen: dict[tuple[str, str, frozenset[str]], str] = {}
    repeats = []
    for p in pairs_file.pairs:
        key = _pair_key(p)
        if key in seen:
            repeats.append(f"{p.id} (as {seen[key]})")
        else:
            seen[key] = p.id
    if repeats:
        notes.append(
            f"{len(repeats)} pair(s) ask the same question as an earlier one (the same two kernels by content, "
            f"either as baseline, on the same GPU and workload), and each is scored: {', '.join(repeats[:5])}"
            f"{' ...' if len(repeats) > 5 else ''}"
        )
    measured = {
        (_canonical(h.hardware), h.workload.key(), h.kernel.content_key()) for h in pairs_file.history
    }
    looked_up = [
        p
        for p in pairs_file.pairs
        if all(
            (_canonical(p.hardware), p.workload.key(), k.content_key()) in measured
            for k in (p.baseline, p.candidate)
        )
    ]
    if looked_up:
        notes.append(
            f"{len(looked_up)} pair(s) have both kernels in the file's history (the first: {looked_up[0].id}): "
            "the local model answers them from those measurements, so they score a lookup, not a forecast"
        )
    if unlaunched := _without_launch(pairs_file.pairs):
        notes.append(
            f"{len(unlaunched)} pair(s) of different kernels have a kernel with no launch (not given, and none its "
            f"source's host code could be read for; the first: {unlaunched[0]}): the static prior's work-per-thread, "
            "occupancy and waves terms are off for them. Give each kernel its launch (grid, block, "
            "shared_mem_bytes) for the figures the prior is fitted for"
        )
    return notes


def _without_launch(pairs: Sequence[EvalPair]) -> list[str]:
    """Ids of the pairs of two families in which a kernel has no launch, given or read from its host code."""
    from forecaster_mcp.forecast.host_launch import source_launch

    out = []
    for p in pairs:
        if p.baseline.family_key() == p.candidate.family_key():
            continue
        for k in (p.baseline, p.candidate):
            if k.launch is not None:
                continue
            found = source_launch(k, p.workload)
            if found is None or found.grid is None or found.block is None:
                out.append(p.id)
                break
    return out


def _refuse_overlap(main: PairsFile, cal: PairsFile) -> None:
    """A calibration fit on pairs it then scores grades itself: refuse the overlap instead of reporting it."""
    fitted = {_pair_key(p) for p in cal.pairs}
    shared = [p for p in main.pairs if _pair_key(p) in fitted]
    if shared:
        first = shared[0]
        raise OperatorError(
            f"{len(shared)} of the {len(main.pairs)} pairs of {main.path} are also in --calibrate-on {cal.path} "
            f"(the first: line {first.line}, {first.id}): a calibration must be fit on other pairs than those it "
            "is scored on. Make the calibration pairs from other spaces or GPUs, or with another --seed"
        )


# What `eval` writes into --out; put in place together once all are written (predictions.jsonl, the plots,
# then metrics.json), so that a reader never sees files of two runs side by side.
_EVAL_FILES = ("predictions.jsonl", "reliability.png", "risk_coverage.png", "metrics.json")


def _drop_partials(out_dir: Path) -> None:
    from forecaster_mcp.cli import partial_path

    for name in _EVAL_FILES:
        partial_path(out_dir / name).unlink(missing_ok=True)


def _write_failed(path: Path, exc: OSError) -> OperatorError:
    return OperatorError(f"cannot write to {path}: {exc.strerror or exc}")


def run_eval(
    settings: Settings,
    pairs_path: Path,
    out_dir: Path,
    forecaster: str = "local",
    target_error: float | None = None,
    calibrate_on: Path | None = None,
    stdout: TextIO | None = None,
    ptxas: bool = True,
    batch: bool = False,
) -> dict[str, Any]:
    """Evaluate, write metrics.json and the plots into `out_dir`, print the table; returns the report.

    `batch`: Claude answers through the Message Batches API (half price; minutes to hours).

    Runs its own event loop (anyio.run): call it from synchronous code."""
    import anyio

    from forecaster_mcp.cli import check_writable_dir

    out = stdout or sys.stdout
    started = time.perf_counter()
    target = settings.target_error if target_error is None else target_error
    if not MIN_TARGET_ERROR <= target < MAX_TARGET_ERROR:  # the range compare_kernels accepts
        raise OperatorError(
            f"--target-error must be at least {MIN_TARGET_ERROR:g} and below {MAX_TARGET_ERROR:g}, got {target}"
        )
    names = parse_forecaster_arg(forecaster)
    if batch and "claude" not in names:
        # It only changes how Claude is asked; for the local model it lifted the chunking (4 GB for 10k pairs).
        raise OperatorError(
            "--batch applies to the Claude forecaster: add --forecaster claude (or local+claude)"
        )
    main = read_pairs_file(pairs_path)
    cal_file = read_pairs_file(calibrate_on) if calibrate_on is not None else None
    if cal_file is not None:
        _refuse_overlap(main, cal_file)
    check_writable_dir(out_dir)  # before forecasting: a bad --out must not cost the whole run
    from forecaster_mcp.compile_slots import COMPILE_SLOTS

    COMPILE_SLOTS.set_limit(settings.max_concurrent_compiles)  # as a server's: eval compiles every kernel
    built: list[Forecaster] = []
    try:
        engine, queries, forecasts, thresholds, calibration, notes = anyio.run(
            _forecast_all, names, settings, main, cal_file, target, ptxas, batch, built
        )
    except KeyboardInterrupt:
        # The report that says what Claude cost is never written: say it here, since the answered requests are
        # billed all the same. Those still in flight when the loop stopped are billed too, and not counted.
        llm = _llm_usage(built)
        if llm.get("requests"):
            print(
                f"forecaster-mcp: spent before the stop: {_llm_line(llm)} (at least: requests still in flight "
                "are billed too)",
                file=sys.stderr,
            )
        if kept := _answers_kept(built, "answers_saved"):
            print(
                f"forecaster-mcp: the {kept[0]} Claude answer(s) received are kept in {kept[1]}: a rerun with the "
                "same model and samples reuses them, without paying for them again",
                file=sys.stderr,
            )
        print(f"forecaster-mcp: eval stopped: nothing written to {out_dir}", file=sys.stderr)
        raise
    if reused := _answers_kept(built, "answers_reused"):
        notes.append(
            f"claude: {reused[0]} answers kept by an earlier run (in {reused[1]}) were reused, not asked or paid for "
            "again: the llm figures count only this run's requests"
        )
    if main.pairs and not any(f.raw for f in forecasts):
        # Metrics of the engine's even-odds stand-in would read as a coin-flip forecaster: refuse instead.
        raise OperatorError(
            f"no forecaster answered any of the {len(main.pairs)} pairs, nothing written: "
            + "; ".join(notes or ["no reason given"])
        )
    speedups = np.array([p.speedup for p in main.pairs])
    hardware = [q.hardware_name for q in queries]

    final_probs = np.array([f.probs for f in forecasts])
    final = M.summarize(final_probs, speedups)
    # Pairs no forecaster answered keep the engine's stand-in: scored in `final`, left out of the components' rows.
    unanswered = [p.id for p, f in zip(main.pairs, forecasts, strict=True) if not f.raw]
    final["n_unanswered"] = len(unanswered)
    if unanswered:
        notes.append(
            f"{len(unanswered)} of {len(main.pairs)} pair(s) no forecaster answered (the first: {unanswered[0]}): "
            "the final row scores them as the server answers them, p_faster 0.5 (0.5 in pairwise_accuracy) and "
            "unsure; the components' rows leave them out"
        )
    # As the server decides: a forecast lacking a component's answer at no lower than its regime's default.
    choices = [thresholds[(hw, f.regime)] for f, hw in zip(forecasts, hardware, strict=True)]
    applied = [engine.threshold_for(f, c) for f, c in zip(forecasts, choices, strict=True)]
    verdicts = [f.verdict(c.threshold) for f, c in zip(forecasts, applied, strict=True)]
    raised = [f for f, a, c in zip(forecasts, applied, choices, strict=True) if a is not c]
    if partial := sum(f.partial for f in raised):
        notes.append(
            f"{partial} pair(s) lack a component's answer: decided at no lower than their regime's default "
            "threshold, as the server decides them, not at the threshold printed for the combination"
        )
    if capped := sum(f.capped and not f.partial for f in raised):
        notes.append(
            f"{capped} pair(s) are capped by their forecaster (base.MAX_CONFIDENCE: a young family's estimate "
            "decides nothing alone): decided at no lower than their regime's default threshold, as the server "
            "decides them, not at the threshold printed"
        )
    d = M.decided_summary(verdicts, speedups)
    final.update(
        {
            "coverage": d.coverage,
            "coverage_non_tie": None if math.isnan(d.coverage_non_tie) else d.coverage_non_tie,
            "n_decided": d.n_decided,
            "decided_accuracy": None if math.isnan(d.accuracy) else d.accuracy,
            "decided_error": None if math.isnan(d.error) else d.error,
        }
    )
    components: dict[str, dict[str, Any]] = {}
    series: dict[str, tuple[list[float], list[float]]] = {}
    for name in names:
        idx = [i for i, f in enumerate(forecasts) if name in f.raw]
        if not idx:
            continue
        raw = [forecasts[i].raw[name] for i in idx]
        s = speedups[idx]
        comp = {"n_answered": len(idx), "raw": M.summarize(raw, s)}
        series[f"{name} raw"] = ([float(x) for x in M.p_faster_of(raw)], s.tolist())
        if calibration is not None:
            calibrated = [forecasts[i].calibrated[name] for i in idx]
            comp["calibrated"] = M.summarize(calibrated, s)
        components[name] = comp
    info = engine.info(forecasts)  # with `answered`: a configured forecaster that was skipped is not credited
    final_label = _final_label(info.model_dump()) + (" (calibrated)" if calibration is not None else "")
    series[final_label] = ([f.p_faster for f in forecasts], speedups.tolist())
    by_hw: dict[str, Any] = {}
    if len({hw for hw, _ in thresholds}) > 1:
        for hw in dict.fromkeys(hw for hw, _ in thresholds):
            idx = [i for i, h in enumerate(hardware) if h == hw]
            by_hw[hw] = M.summarize(final_probs[idx], speedups[idx])

    plots: list[str] = []
    from forecaster_mcp.cli import partial_path, write_partial
    from forecaster_mcp.forecast.plots import PlotsUnavailable, reliability_png, risk_coverage_png

    # Every file is written aside first and put in place only once all are written (metrics.json last): a
    # full disk midway leaves the previous run's files as they were, never a mix of two runs.
    plot_files = {name: out_dir / name for name in _EVAL_FILES if name.endswith(".png")}
    try:
        try:
            drawn = reliability_png(partial_path(plot_files["reliability.png"]), series)
            risk_coverage_png(partial_path(plot_files["risk_coverage.png"]), series, target)
            plots = list(plot_files)
            if not drawn:
                notes.append("plots are empty: every pair is a tie, so there is no direction to score")
        except PlotsUnavailable as exc:
            notes.append(f"plots skipped: {exc}")
        rows = [
            {
                "id": p.id,
                "hardware": q.hardware_name,
                "speedup": p.speedup,
                "p_faster": fc.p_faster,
                "verdict": verdict,
                "probs": fc.probs,
                "raw": fc.raw,
            }
            for p, q, fc, verdict in zip(main.pairs, queries, forecasts, verdicts, strict=True)
        ]
        write_partial(out_dir / "predictions.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    except OSError as exc:  # checked writable at the start; the disk filled up or the folder changed since
        _drop_partials(out_dir)
        raise _write_failed(out_dir, exc) from exc

    report: dict[str, Any] = {
        "pairs_file": str(pairs_path),
        "calibrate_on": str(calibrate_on) if calibrate_on is not None else None,
        "calibration_pairs": calibration.n_pairs if calibration is not None else 0,
        "history_points": len(main.history),
        "forecaster": info.model_dump(),
        "target_error": target,
        "delta": DELTA,
        "n_pairs": len(main.pairs),
        "forecasts_per_regime": {r: sum(f.regime == r for f in forecasts) for r, _, _ in _THRESHOLD_KEYS},
        # Per GPU and regime: model forecasts against a measured kernel (always, as before regimes were split),
        # forecasts of two unmeasured kernels and static-prior forecasts (when any were made). Per GPU only: a
        # server also thresholds a kernel family on its own history once it has enough.
        **{
            key: {hw: c.to_dict() for (hw, r), c in thresholds.items() if r == regime}
            for regime, key, _ in _THRESHOLD_KEYS
        },
        "final": final,
        "components": components,
        "by_hardware": by_hw,
        "plots": plots,
        # What Claude cost (both phases; empty without a paid forecaster). The Batches API's half price is in.
        "llm": _llm_usage(engine.forecasters, calibration.llm if calibration is not None else None),
        "notes": notes,
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    report = _finite(report)
    try:
        write_partial(out_dir / "metrics.json", json.dumps(report, indent=2, sort_keys=False) + "\n")
        for name in _EVAL_FILES:
            if name in ("metrics.json", "predictions.jsonl", *plots):
                os.replace(partial_path(out_dir / name), out_dir / name)
            else:
                (out_dir / name).unlink(missing_ok=True)  # an earlier run's plot would pass for this run's
                partial_path(out_dir / name).unlink(missing_ok=True)
    except OSError as exc:
        _drop_partials(out_dir)
        raise _write_failed(out_dir, exc) from exc
    print_table(report, out)
    llm = report["llm"]
    if llm.get("requests"):
        print(_llm_line(llm), file=out)
    for n in notes:
        print(f"note: {n}", file=out)
    written = ", ".join(["metrics.json", "predictions.jsonl", *plots])
    print(f"wrote {written} to {out_dir}", file=out)
    return report


def eval_command(settings: Settings, args: argparse.Namespace) -> int:
    """`forecaster-mcp eval PAIRS.jsonl [--out DIR] [--forecaster F] [--target-error E] [--calibrate-on F]`"""
    # --no-ptxas (when the parser has it): skip compiling kernels for static features, e.g. to go fast.
    ptxas = not getattr(args, "no_ptxas", False)
    run_eval(
        settings,
        args.pairs,
        args.out,
        args.forecaster,
        args.target_error,
        args.calibrate_on,
        ptxas=ptxas,
        batch=getattr(args, "batch", False),
    )
    return 0


# ---------------------------------------------------------------- make-pairs


def _placeholder_source(kernel_name: str, recording: Path) -> str:
    # One source per recording's kernel, so every configuration shares a kernel family.
    return (
        f"// {kernel_name}: a Kernel Tuner recording ({recording.name}); {PLACEHOLDER_MARKER}.\n"
        "// Tuning parameters are #define macros ahead of the source (see `defines`).\n"
        f"__global__ void {kernel_name}();\n"
    )


def _workload(kernel_name: str, problem_size: Any) -> Workload:
    problem: dict[str, int | float | str] = {}
    if isinstance(problem_size, list | tuple):
        for axis, v in zip("xyz", problem_size, strict=False):
            if isinstance(v, int | float | str) and not isinstance(v, bool):
                problem[f"size_{axis}"] = v
    elif isinstance(problem_size, int | float | str) and not isinstance(problem_size, bool):
        problem["size_x"] = problem_size
    return Workload(problem=problem, name=kernel_name)


def _defines(params: dict[str, Any]) -> dict[str, int | float | str]:
    out: dict[str, int | float | str] = {}
    for k, v in params.items():
        out[k] = int(v) if isinstance(v, bool) else v if isinstance(v, int | float | str) else str(v)
    return out


def _kernel_dict(params: dict[str, Any], kid: str, source: str, entry: str) -> dict[str, Any]:
    kernel = Kernel(id=kid, source=source, entry=entry, defines=_defines(params))  # validates
    return {"id": kernel.id, "source": kernel.source, "entry": kernel.entry, "defines": kernel.defines}


def make_pairs(
    recordings: Sequence[Path], n_per_recording: int, seed: int, history_per_recording: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Sample (pairs, history points) from Kernel Tuner recordings; both kernels of a pair from one file."""
    from forecaster_mcp.measure.replay import load_space

    if n_per_recording < 1:
        raise OperatorError(f"-n must be at least 1, got {n_per_recording}")
    if history_per_recording < 0:
        raise OperatorError(f"--history must be 0 or more, got {history_per_recording}")
    pairs: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    prefixes: set[str] = set()  # pair ids are "<folder>-<name>-<i>", unique in the file
    for r, path in enumerate(recordings):
        try:
            space = load_space(path)
        except ValueError as exc:
            raise OperatorError(str(exc)) from exc
        valid = [e for e in space.entries if e.ok and e.times]
        if len(valid) - history_per_recording < 2:
            raise OperatorError(
                f"{path}: {len(valid)} valid configurations, too few for pairs"
                + (f" after {history_per_recording} history points" if history_per_recording else "")
            )
        rng = np.random.default_rng([seed, r])
        order = rng.permutation(len(valid))
        hist_idx, pool = order[:history_per_recording], order[history_per_recording:]
        prefix = f"{path.parent.name}-{path.name.split('.')[0]}"
        source = _placeholder_source(space.kernel_name, path)
        if prefix in prefixes:
            # The same recording given again: a family of its own, or its history points (the same kernels
            # and runtimes) would answer the other copy's pairs.
            prefix = f"{prefix}-r{r}"
            source += f"// copy {r}: this recording was given more than once\n"
        prefixes.add(prefix)
        workload = _workload(space.kernel_name, space.problem_size).model_dump(exclude_none=True)
        median = {id(e): statistics.median(e.times) for e in valid}

        for i in hist_idx:
            e = valid[int(i)]
            history.append(
                {
                    "history": {
                        "hardware": space.device,
                        "workload": workload,
                        "kernel": _kernel_dict(e.params, f"h{len(history)}", source, space.kernel_name),
                        "runtime_ms": median[id(e)],
                        "status": "ok",
                    }
                }
            )
        seen: set[tuple[int, int]] = set()
        max_pairs = len(pool) * (len(pool) - 1)
        want = min(n_per_recording, max_pairs)
        while len(seen) < want:
            a, b = (int(x) for x in rng.choice(pool, size=2, replace=False))
            if (a, b) in seen:
                continue
            seen.add((a, b))
            base, cand = valid[a], valid[b]
            pairs.append(
                {
                    # The recording's position too when a folder/name repeats (the same file given twice).
                    "id": f"{prefix}-{len(seen) - 1}",
                    "hardware": space.device,
                    "workload": workload,
                    "baseline": _kernel_dict(base.params, "baseline", source, space.kernel_name),
                    "candidate": _kernel_dict(cand.params, "candidate", source, space.kernel_name),
                    "speedup": median[id(base)] / median[id(cand)],
                    "source": f"kernel_tuner:{path}",
                }
            )
    return pairs, history


def make_pairs_command(settings: Settings, args: argparse.Namespace) -> int:
    """`forecaster-mcp make-pairs REC... -n N --seed S --out F [--history K]`."""
    from forecaster_mcp.cli import check_writable_file, write_atomically

    exports = [str(r) for r in args.recordings if str(r).endswith(".jsonl")]
    pairs_files = [e for e in exports if is_pairs_file(Path(e))]
    if pairs_files:
        raise OperatorError(
            f"{pairs_files[0]} is a pairs file (make-pairs writes them, `forecaster-mcp eval` reads them): "
            "make-pairs draws configurations of a Kernel Tuner cache file (.json or .json.gz)"
        )
    if exports:
        raise OperatorError(
            f"{exports[0]} is a `forecaster-mcp export` file: it replays the kernels it holds (serve --replay), "
            "but make-pairs draws configurations of a whole recorded space, a Kernel Tuner cache file (.json or "
            ".json.gz)"
        )
    history_n = int(getattr(args, "history", 0) or 0)
    check_writable_file(args.out)  # before reading the recordings
    pairs, history = make_pairs(args.recordings, args.n, args.seed, history_n)

    try:
        write_atomically(
            args.out, "".join(json.dumps(row, sort_keys=False) + "\n" for row in [*history, *pairs])
        )
    except OSError as exc:
        raise _write_failed(args.out, exc) from exc
    extra = f" and {len(history)} history points" if history else ""
    n_rec = len(args.recordings)
    print(f"wrote {len(pairs)} pairs{extra} from {n_rec} recording{'' if n_rec == 1 else 's'} to {args.out}")
    return 0
