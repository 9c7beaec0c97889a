"""The forecast engine: run every forecaster, calibrate each, combine, and choose the selective threshold.

Rows the server stores (ForecastRow.forecaster names), and what the engine reads back. Each component is
named in them as `<name>@<version>` (for Claude the version is the model), written `<c>` below, and the
engine as its components joined by "+", written `<e>` ("local@1.0", "local@1.0+claude@<model>"): what was
learned on one model's forecasts (calibration, combination weights, threshold history) says nothing about
another's, so switching the Claude model, or a new local model version, starts again from the defaults.
- `<e>`: the engine's final, calibrated and combined forecast as it was issued, with its kernels' chances of
  failing. Its verified pairs choose the selective threshold (a forecast made before its outcome was known is
  an honest sample of the policy's error), each scored as today's calibration, fitted without it, would issue
  it (its components' raw rows calibrated out of fold: `_rescored`). `<e>:prior`: the same for forecasts in
  which a component answered from a static prior (a pair no family model covers: different kernels, or too
  few measurements); they choose the threshold of such forecasts (`final_name`).
- `raw:<c>` (e.g. "raw:local@1.0"): each component's uncalibrated forecast, the keys of
  `EngineForecast.per_forecaster`. Their verified pairs fit that component's calibration and, joined by the
  question they answered and calibrated out of fold, the combination weights.
- `raw:<c>:prior`: a component's answers from a static prior instead of a model of measured data
  (the local forecaster on two different kernels, or a family with too few measurements; `extras["prior"]`).
  They are calibrated apart: a calibration learned on a family model's verified pairs says nothing about the
  prior's, and the other way round; likewise a threshold certified on the family model's history does not
  certify the prior's forecasts, which have their own.
- `raw:<c>:unmeasured` and `<e>:unmeasured`: the same split for model answers on a pair of
  which neither kernel is measured (`extras["measured"]` and `extras["baseline_measured"]` both 0). Both
  runtimes are predictions, so these err more than a prediction against a measured baseline (the search case,
  which dominates verified history): on the 15 held-out replay spaces, a threshold certified on
  baseline-measured pairs let pairs of two unmeasured kernels err on 14% / 11% of their decided verdicts with
  30 / 100 measurements (above the 10% target in 14 / 11 of 15 spaces; benchmarks/tune_local.py model).
Regimes, from the least to the most uncertain: model, unmeasured, prior; a final forecast takes the most
uncertain regime of its components' answers (`EngineForecast.regime`).
Within a regime the threshold comes from the verified history of the candidate's kernel family on the GPU when
it has enough of its own (stored rows carry `family_key`), else of the GPU, else pooled over GPUs. Families
differ: three A6000 replay spaces served together (convolution, dedispersion, 6-parameter convolution; 100
measurements each) certified 0.506 on their pooled history, at which the 6-parameter convolution erred on 11.2%
of its decided verdicts; its own history certifies 0.70-0.77 (benchmarks/family_thresholds.py, 2 seeds).
Calibration state is persisted with `save_calibration(<slot>, "*")` for every slot (`<c>`, `<c>:unmeasured`,
`<c>:prior`) and, with several components, `save_calibration(<e>, "*")` for the combiner.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import numpy as np

from forecaster_mcp import bins
from forecaster_mcp.forecast.base import MAX_CONFIDENCE, BinForecast, Forecaster, PairQuery, PartialForecast
from forecaster_mcp.forecast.calibration import OUT_CLIP, Calibrator, Platt, logit, sigmoid, with_p_faster
from forecaster_mcp.forecast.combine import Combiner
from forecaster_mcp.forecast.selective import (
    MIN_TARGET_ERROR,
    ThresholdChoice,
    choose_threshold,
    decide,
    decision_p_array,
    default_min_history,
    p_fail_baseline_of,
    p_fail_of,
    refuted_below,
)
from forecaster_mcp.forecast.verified_rows import VerifiedRows, spread_id
from forecaster_mcp.models import ForecasterInfo, Verdict

if TYPE_CHECKING:
    from forecaster_mcp.store.db import PairGroup, VerifiedPair

log = logging.getLogger(__name__)

RAW_PREFIX = "raw:"
POOLED = "*"  # the `hardware` key of persisted engine state (it holds every GPU's calibration)
STATE_VERSION = 1
# The combiner's saved state: 2 since its weights are fitted on each pair's answers calibrated out of fold
# (`_fit_combiner`). A version 1 state, fitted on calibrations that had seen the same pairs, is refitted.
COMBINER_STATE_VERSION = 2
_EMPTY = np.zeros(0)
# A remote forecaster that bounds its own calls (`time_limit_s`) gets this much longer before it is cut off.
_BACKSTOP_GRACE_S = 10.0


Regime = Literal["model", "unmeasured", "prior"]
REGIMES: tuple[Regime, ...] = ("model", "unmeasured", "prior")  # least to most uncertain
_SUFFIX: dict[Regime, str] = {"model": "", "unmeasured": ":unmeasured", "prior": ":prior"}
# The threshold while a regime's verified history is short is 1 - target_error * share. For a calibrated
# forecaster share 1/2 keeps the decided error under target / 2. Pairs of two predictions have heavier tails
# than their spread says (a surprise in either runtime): at 1 - target/2 they erred on 5.5% / 3.5% of decided
# verdicts on average but 15% / 10.5% in the worst of the 15 held-out replay spaces (30 / 100 measurements);
# at 1 - target/4, 2.2% / 2.7% and 7.8% / 8.4%, deciding 13% / 28% of pairs instead of 22% / 39% (chosen on
# the 8 TUNE spaces, where the worst space went from 19.4% / 8.0% to 7.8% / 5.9%).
_DEFAULT_SHARE: dict[Regime, float] = {"model": 0.5, "unmeasured": 0.25, "prior": 0.5}


def default_threshold_for(regime: Regime, target_error: float) -> float:
    """The threshold a regime's forecasts are decided at until its verified history certifies one."""
    return 1.0 - target_error * _DEFAULT_SHARE[regime]


def smallest_default_target(regime: Regime, confidence: float) -> float:
    """The smallest target_error whose default threshold (`default_threshold_for`) a forecast `confidence`
    sure clears."""
    return (1.0 - confidence) / _DEFAULT_SHARE[regime]


_LABEL: dict[Regime, str] = {
    "model": "",
    "unmeasured": " (neither kernel measured)",
    "prior": " (static prior)",
}


def raw_name(component: str) -> str:
    """The forecaster name under which a component's (or slot's) uncalibrated forecasts are stored."""
    return RAW_PREFIX + component


def regime_of(forecast: BinForecast) -> Regime:
    """Which regime one answer belongs to (module doc): static prior, two unmeasured kernels, or model."""
    extras = forecast.extras
    if extras.get("prior", 0.0) >= 1.0:
        return "prior"
    if extras.get("measured", 1.0) == 0.0 and extras.get("baseline_measured", 1.0) == 0.0:
        return "unmeasured"
    return "model"


def slot_of(component: str, forecast: BinForecast) -> str:
    """The calibration slot of one answer: `<component>` plus its regime's suffix."""
    return component + _SUFFIX[regime_of(forecast)]


def _both_measured(forecast: BinForecast) -> bool:
    return (
        forecast.extras.get("measured", 0.0) >= 1.0 and forecast.extras.get("baseline_measured", 0.0) >= 1.0
    )


def _regime_of_slot(slot: str) -> Regime:
    return next((r for r in REGIMES if _SUFFIX[r] and slot.endswith(_SUFFIX[r])), "model")


# Verified final forecasts (newest) a threshold is certified on, per GPU, family or pool (_set_regime_history);
# more when the target error needs more to certify anything (default_min_history: 5,990 pairs for 0.001).
HISTORY_WINDOW = 2000
# Folds of the out-of-fold scoring of the threshold history (`_rescored`).
OOF_FOLDS = 5
# A target's threshold is raised to that of each looser target here (`threshold`). Each target is chosen on its
# own rules, and they disagree: while history is short for 0.05 (118 pairs needed) it keeps its default 0.975
# unless refuted by a test, while 0.1, with enough history to test (58), decides nothing once its own default
# 0.95 errs above 10% of the time; a family history long enough for 0.1 but not for 0.05 thresholds them on
# different pairs. So a client asking at 0.05 got "faster" where 0.1 said "unsure". Raising only ever makes a
# verdict unsure, and makes thresholds monotone wherever the looser of two targets is one of these.
_LOOSER_TARGETS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
# Extras that describe one component's own predictive distribution (acquisition.expected_improvement).
_OWN_DISTRIBUTION = frozenset(
    {
        "mu_log2",
        "sd_log2",
        "tail_weight",
        "tail_scale",
        "cand_log2_ms",
        "cand_sd_log2",
        "cand_tail_weight",
        "cand_tail_scale",
    }
)


def _component_of(slot: str) -> str:
    return slot.removesuffix(_SUFFIX[_regime_of_slot(slot)])


class CalibrationStore(Protocol):
    """The part of the store the engine reads and writes."""

    async def verified_pairs(
        self, forecaster: str | None = None, hardware: str | None = None
    ) -> list[VerifiedPair]: ...

    async def save_calibration(self, forecaster: str, hardware: str, state_json: str) -> None: ...

    # Optional (`ForecastEngine._read_verified`): async def verified_changes(self, since: int | None) ->
    # VerifiedChanges, the verified pairs that changed since a sequence number (Store.verified_changes).

    async def load_calibration(self, forecaster: str, hardware: str) -> str | None: ...


@dataclass(frozen=True)
class Outcome:
    """A verified pair: the components' raw forecasts and the measured speedup."""

    hardware: str
    speedup: float
    raw: Mapping[str, Sequence[float]]
    slots: Mapping[str, str] = field(default_factory=dict)  # component -> calibration slot (default: itself)
    caps: Mapping[str, float] = field(
        default_factory=dict
    )  # component -> the cap its answer set (MAX_CONFIDENCE)

    def slot(self, component: str) -> str:
        return self.slots.get(component, component)


@dataclass
class EngineForecast:
    """The engine's answer to one PairQuery."""

    probs: list[float]  # final 8 bins: calibrated, combined
    p_faster: float
    confidence: float  # max(p_faster, 1 - p_faster)
    expected_speedup: float
    rationale: str
    raw: dict[str, list[float]] = field(default_factory=dict)  # component -> uncalibrated bins
    calibrated: dict[str, list[float]] = field(default_factory=dict)  # component -> calibrated bins
    # Flat numbers for ranking measurements: the first component's extras as they are (the local model's
    # mu_log2 / sd_log2 / p_fail), and every component's under "<component>.<key>".
    extras: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Extra rows to store beside the final one: forecaster name ("raw:<name>@<version><regime suffix>") -> bins.
    per_forecaster: dict[str, list[float]] = field(default_factory=dict)
    slots: dict[str, str] = field(default_factory=dict)  # component -> calibration slot of its answer
    regime: Regime = "model"  # the most uncertain of its components' regimes (module doc)
    # Answered from two stored measurements (the local model found both kernels measured, for instance under
    # other spellings of their parameters): measured truth, not a forecast to store, verify or learn from.
    from_measurements: bool = False
    # Some of the engine's components did not answer (Claude down, timed out, or skipped this pair): stored under
    # the names of those that did (`final_name`), and decided at no lower a threshold than its regime's default.
    partial: bool = False
    # component -> the cap its answer set on its own confidence (base.MAX_CONFIDENCE), for those that set one.
    caps: dict[str, float] = field(default_factory=dict)
    # The same caps by the name of the row each answer is stored under (the keys of `per_forecaster`): stored
    # with it (forecasts.max_confidence), the history is scored again at no more than the cap (`_rescored`).
    per_forecaster_caps: dict[str, float] = field(default_factory=dict)

    @property
    def capped(self) -> bool:
        """Every component that answered capped its answer (base.MAX_CONFIDENCE): the forecast decides nothing
        on the history its regime certified (ForecastEngine.threshold_for)."""
        return bool(self.raw) and not self.from_measurements and self.caps.keys() >= self.raw.keys()

    @property
    def p_fail(self) -> float:
        """The chance the candidate fails to compile or run (`selective.p_fail_of`)."""
        return p_fail_of(self.extras)

    def verdict(self, threshold: float) -> Verdict:
        """faster / slower / unsure at this threshold, either kernel's chance of failing counted
        (`selective.decide`)."""
        return decide(self.p_faster, threshold, self.p_fail, p_fail_baseline_of(self.extras))

    def outcome(self, hardware: str, speedup: float) -> Outcome:
        """This forecast's raw answers as a verified outcome (evaluation)."""
        return Outcome(hardware, speedup, dict(self.raw), dict(self.slots), dict(self.caps))


def _capped(calibrated: list[float], cap: float | None) -> list[float]:
    """A calibrated answer held to its own cap (base.MAX_CONFIDENCE), if it set one: a calibration fitted on the
    slot's other answers (an underconfident prior's slope above 1) must not make it surer than it said it may be."""
    if cap is None:
        return calibrated
    p = bins.p_faster(calibrated)
    held = _held(p, cap)
    return calibrated if held == p else with_p_faster(calibrated, held)


def _held(p: float, cap: float | None) -> float:
    """A calibrated p_faster held to a cap (None: none set)."""
    if cap is None:
        return p
    cap = max(cap, 0.5)  # a cap below 0.5 would flip the answer's direction
    return min(max(p, 1.0 - cap), cap)


def _capped_p(p: np.ndarray[Any, Any], caps: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """`_capped` of calibrated p_faster values, each held to its cap (NaN: none set)."""
    cap = np.maximum(np.where(np.isnan(caps), 1.0, caps), 0.5)
    out: np.ndarray[Any, Any] = np.minimum(np.maximum(p, 1.0 - cap), cap)
    return out


def _family_slot(hardware: str, family: str | None) -> str:
    """The history key of one kernel family on one GPU (beside the GPU's own key and POOLED)."""
    return f"{hardware}\x00{family}"


def _combined_centers(
    calibrated: Mapping[str, Sequence[float]], centers: Mapping[str, Sequence[float] | None]
) -> list[float] | None:
    """Each bin's mean log2 speedup across the answering forecasters, weighted by the mass each puts there
    (the fixed bin centres for one that has no distribution behind its bins); None when none has one."""
    if all(c is None for c in centers.values()):
        return None
    parts = [(probs, centers.get(n) or bins.CENTERS_LOG2) for n, probs in calibrated.items()]
    return bins.mix_centers(parts, bins.CENTERS_LOG2)


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


async def _in_chunks(
    f: Forecaster, queries: Sequence[PairQuery], chunk: int | None
) -> list[BinForecast | None]:
    """`f`'s forecasts of `queries`, `chunk` pairs a call (all at once without a chunk); a chunk it answered in
    part keeps its part, and the call then fails as partial for the whole list."""
    if chunk is None or len(queries) <= chunk:
        return list(await f.forecast(queries))
    out: list[BinForecast | None] = []
    errors: list[Exception] = []
    for start in range(0, len(queries), chunk):
        part = queries[start : start + chunk]
        try:
            out += await f.forecast(part)
        except Exception as exc:
            partial = getattr(exc, "partial", None)
            if not (isinstance(partial, list) and len(partial) == len(part)):
                raise
            out += partial
            errors.append(exc)
    if errors:
        raise PartialForecast(
            f"{errors[0]} (and {len(errors) - 1} more chunks)" if len(errors) > 1 else str(errors[0]), out
        ) from errors[0]
    return out


class ForecastEngine:
    """Glue between forecasters, calibration, combination and the selective policy.

    Hot path: `forecast` and `threshold` only touch the store when the cached state is older than
    `refresh_interval_s` or `mark_stale()` was called; a refresh re-reads verified pairs and refits only what
    their counts say changed.

    `timeout_s` bounds forecasters that declare `remote = True` (a network API such as Claude's): one still
    answering after that long is skipped with a note. Local forecasters are not timed out: their answer is
    the one a compare falls back on, and a first fit or ptxas compile may take seconds.

    `history_window`: the newest verified forecasts a threshold is certified on (HISTORY_WINDOW: forecasts
    issued under an older calibration stop counting). None counts them all: an evaluation's were all made under
    one calibration, and their order is only the file's.
    """

    def __init__(
        self,
        forecasters: Sequence[Forecaster],
        store: CalibrationStore | None = None,
        *,
        refresh_interval_s: float = 5.0,
        delta: float = 0.05,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        history_window: int | None = HISTORY_WINDOW,
    ) -> None:
        if not forecasters:
            raise ValueError("the engine needs at least one forecaster")
        names = [f.name for f in forecasters]
        if len(set(names)) != len(names):
            raise ValueError(f"forecaster names must be unique: {names}")
        self._forecasters = list(forecasters)
        self._names = names
        self._store = store
        self._refresh_interval_s = refresh_interval_s
        self._delta = delta
        self._timeout_s = timeout_s
        self._clock = clock
        self._history_window = history_window
        self._slots = [n + _SUFFIX[r] for n in names for r in REGIMES]
        # In the store every component is "<name>@<version>" (for Claude the version is the model): a
        # calibration, combination weights or threshold history learned on one model's forecasts says nothing
        # about another's, so a new Claude model (or local model version) starts from the defaults.
        self._keys = {f.name: f"{f.name}@{f.version}" for f in forecasters}
        self._stored_name = "+".join(self._keys[n] for n in names)
        # A forecaster may say how far its stated confidence is trusted before any pair is verified
        # (`calibration_slope`, 1 unless set): its calibration starts there, and its fits are drawn to it.
        slopes = {f.name: float(getattr(f, "calibration_slope", 1.0)) for f in forecasters}
        self._prior: dict[str, Platt] = {s: Platt(a=slopes[_component_of(s)]) for s in self._slots}
        self._calibrators: dict[str, Calibrator] = {s: Calibrator(self._prior[s]) for s in self._slots}
        self._combiner = Combiner.equal(names)
        # What the last fits saw (verified_rows.rows_signature of the rows): a refit happens when the rows change, not only
        # their number (a re-measured kernel re-verifies its pairs, a new forecast replaces a pair's row).
        self._fit_signatures: dict[str, str] = {}
        self._combiner_signatures: dict[str, str] = {}
        # Verified final forecasts per regime, then per GPU, per (GPU, kernel family) and pooled over GPUs.
        self._history: dict[Regime, dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]] = {}
        self._history_signatures: dict[Regime, str] = {}
        # Each slot's calibration fitted without each fold of its rows (`_rescored`) and the signature of the rows
        # they were fitted on; what each regime's history was last scored with (those and the combiner's rows).
        self._oof: dict[str, list[Calibrator]] = {}
        self._oof_signatures: dict[str, str] = {}
        self._history_scored_with: dict[Regime, str] = {}
        self._thresholds: dict[tuple[str, float, Regime, str | None], ThresholdChoice] = {}
        # Each target's own choice (`_threshold_at`), before it is compared with looser targets'.
        self._raw_thresholds: dict[tuple[str, float, Regime, str | None], ThresholdChoice] = {}
        # Of those, the choice on the GPU's or the pooled history, before a family's own history refutes it.
        self._wide_thresholds: dict[tuple[str, float, Regime], ThresholdChoice] = {}
        # The verified pairs as last read (`_read_verified`), by forecaster name (None: not read yet), and the
        # sequence number of that read; the names whose pairs changed since the last completed refresh (None: all).
        self._tables: dict[str, VerifiedRows] | None = None
        self._seq = 0
        self._dirty: set[str] | None = None
        self._slot_signatures: dict[str, str] = {}
        self._loaded = False
        self._stale = True
        self._fresh_until = -math.inf
        self._lock = anyio.Lock()

    # ------------------------------------------------------------------ identity

    @property
    def name(self) -> str:
        return "+".join(self._names)

    def info(self, forecasts: Sequence[EngineForecast] | None = None) -> ForecasterInfo:
        """Who forecasts; given a call's forecasts, also which components answered them (`answered`)."""
        components = [f"{f.name}@{f.version}" for f in self._forecasters]
        answered = None
        if forecasts is not None:
            seen = {n for fc in forecasts for n in fc.raw}
            answered = [c for c, n in zip(components, self._names, strict=True) if n in seen]
        return ForecasterInfo(
            name=self.name,
            version="+".join(f.version for f in self._forecasters),
            components=components,
            answered=answered,
        )

    @property
    def forecasters(self) -> tuple[Forecaster, ...]:
        """The forecasters combined, in order."""
        return tuple(self._forecasters)

    def row_names(self) -> list[str]:
        """Every forecaster name the engine reads verified pairs under."""
        return [
            *(self._stored_name + _SUFFIX[r] for r in REGIMES),
            *(raw_name(self._stored(s)) for s in self._slots),
        ]

    def final_name(self, forecast: EngineForecast) -> str:
        """The forecaster name a final forecast is stored under (its regime's threshold history): the
        components' names and versions (`local@1.0+claude@<model>`), then the regime's suffix. A forecast some
        components did not answer goes under the names of those that did: one forecaster's record must not
        certify another's (local-only verdicts in a Claude outage fed the combination's history)."""
        if forecast.partial:
            answered = "+".join(self._keys[n] for n in self._names if n in forecast.raw)
            return answered + _SUFFIX[forecast.regime]
        return self._stored_name + _SUFFIX[forecast.regime]

    def threshold_for(self, forecast: EngineForecast, choice: ThresholdChoice) -> ThresholdChoice:
        """`choice` (certified on this engine's history) as it applies to `forecast`: a partial forecast is
        not what that history certified, nor is one whose every answer is capped (base.MAX_CONFIDENCE: it
        decides nothing on its own), so each is decided at no lower a threshold than its regime's default."""
        if forecast.partial:
            why = "forecasts lacking a component's answer are not what that history certified"
        elif forecast.capped:
            why = "forecasts capped by their forecaster decide nothing on that history alone"
        else:
            return choice
        floor = default_threshold_for(forecast.regime, choice.target_error)
        if choice.threshold >= floor:
            return choice
        return replace(
            choice,
            threshold=floor,
            error_ucb=None,
            source="default",
            reason=f"{choice.reason}; {why}: default {floor:.3f}",
        )

    def _stored(self, slot: str) -> str:
        """A calibration slot's name in the store: its component's `name@version`, then the regime suffix."""
        component = _component_of(slot)
        return self._keys[component] + slot.removeprefix(component)

    # ------------------------------------------------------------------ forecasting

    async def forecast(
        self, queries: Sequence[PairQuery], *, bulk: bool = False, chunk_pairs: int | None = None
    ) -> list[EngineForecast]:
        """One EngineForecast per query. A forecaster that raises (or times out) is skipped with a note; one
        that answered some pairs (an exception with `partial`) is kept for those.

        `bulk`: forecasters with a `forecast_batch` (Claude: the Message Batches API, half price, minutes to
        hours) answer through it; for evaluations, not for an agent waiting on a call. `chunk_pairs`: the
        others are asked that many pairs a call (the local model predicts a call's kernels jointly, in memory
        growing with the square of their number)."""
        if not queries:
            return []
        await self._maybe_refresh()
        answers: list[list[BinForecast | None] | Exception | None] = [None] * len(self._forecasters)
        notes: list[str] = []

        async def run(i: int, f: Forecaster) -> None:
            limit = self._timeout_s if getattr(f, "remote", False) else None
            own = getattr(f, "time_limit_s", None)
            if limit is not None and own is not None:
                # It stops itself at its own limit and keeps what it has; this is only a backstop.
                limit = own + _BACKSTOP_GRACE_S
            try:
                batch = getattr(f, "forecast_batch", None) if bulk else None
                with anyio.CancelScope(
                    deadline=math.inf if limit is None else anyio.current_time() + limit
                ) as scope:
                    if batch is not None:
                        out = await batch(queries)
                    else:
                        out = await _in_chunks(f, queries, chunk_pairs)
                if scope.cancelled_caught:
                    raise TimeoutError(
                        f"no answer within {limit:g} s (forecast_timeout_s); the other forecasters answered"
                    )
                if len(out) != len(queries):
                    raise ValueError(f"answered {len(out)} of {len(queries)} queries")
                answers[i] = list(out)
            except Exception as exc:
                partial = getattr(exc, "partial", None)
                if isinstance(partial, list) and len(partial) == len(queries) and any(partial):
                    # What a paid forecaster did answer is kept; only the pairs it missed go without it.
                    log.warning(
                        "forecaster %s answered %d of %d pairs: %s",
                        f.name,
                        sum(map(bool, partial)),
                        len(queries),
                        one_line(str(exc), 300),
                    )
                    answers[i] = list(partial)
                    missed = sum(p is None for p in partial)
                    notes.append(
                        f"forecaster {f.name} skipped on {missed} of {len(queries)} pairs: "
                        f"{type(exc).__name__}: {one_line(str(exc), 200)}"
                    )
                    return
                # One line: the answer's notes say it to the caller, and a traceback per call (an unreachable
                # API, a refused key) would flood a server's log. The traceback is there at debug level.
                log.warning(
                    "forecaster %s skipped: %s: %s", f.name, type(exc).__name__, one_line(str(exc), 300)
                )
                log.debug("forecaster %s failed", f.name, exc_info=exc)
                answers[i] = exc

        async with anyio.create_task_group() as tg:
            for i, f in enumerate(self._forecasters):
                tg.start_soon(run, i, f)

        notes = [
            f"forecaster {name} skipped: {type(a).__name__}: {one_line(str(a), 200)}"
            for name, a in zip(self._names, answers, strict=True)
            if isinstance(a, Exception)
        ] + notes
        answered = [(n, a) for n, a in zip(self._names, answers, strict=True) if isinstance(a, list)]
        out: list[EngineForecast] = []
        for i, q in enumerate(queries):
            per = {n: fc for n, a in answered if (fc := a[i]) is not None}
            out.append(self._assemble(q.hardware_name, per, notes))
        return out

    def _assemble(self, hardware: str, per: Mapping[str, BinForecast], notes: list[str]) -> EngineForecast:
        if not per:
            probs = [1.0 / bins.N_BINS] * bins.N_BINS
            return EngineForecast(
                probs=probs,
                p_faster=0.5,
                confidence=0.5,
                expected_speedup=1.0,
                rationale="no forecaster answered: " + "; ".join(notes),
                notes=list(notes),
            )
        raw = {n: list(f.probs) for n, f in per.items()}
        slots = {n: slot_of(n, f) for n, f in per.items()}
        caps = {n: float(f.extras[MAX_CONFIDENCE]) for n, f in per.items() if MAX_CONFIDENCE in f.extras}
        # An answer from two stored measurements (the local model found both kernels measured, for instance
        # under other spellings of their parameters) is measurement noise, not a forecast: no calibration
        # fitted on forecasts applies to it, and no other component's guess is mixed in.
        measured = next((n for n, f in per.items() if _both_measured(f)), None)
        if measured is not None:
            calibrated = {measured: raw[measured]}
            probs = list(raw[measured])
        else:
            calibrated = self._calibrated(raw, hardware, slots, caps)
            probs = self._combiner.combine(calibrated)
        p = bins.p_faster(probs)
        centers = _combined_centers(calibrated, {n: f.centers for n, f in per.items()})
        if len(self._names) == 1:
            rationale = one_line(next(iter(per.values())).rationale)
        else:
            rationale = one_line("; ".join(f"{n}: {f.rationale}" for n, f in per.items()))
        extras: dict[str, float] = {}
        for n, f in per.items():
            extras.update({f"{n}.{k}": float(v) for k, v in f.extras.items()})
        first = self._names[0]
        if first in per:
            # The first component's extras stand for the forecast (p_fail, measured flags...), except its own
            # predictive distribution when others answered too: measure_next would then rank on one
            # component's numbers instead of the combined forecast it shows, so it ranks on the final bins.
            own = {} if len(per) == 1 or measured == first else _OWN_DISTRIBUTION
            extras.update({k: float(v) for k, v in per[first].extras.items() if k not in own})
        return EngineForecast(
            probs=probs,
            p_faster=p,
            confidence=max(p, 1.0 - p),
            expected_speedup=bins.expected_speedup(probs, centers),
            rationale=rationale,
            raw=raw,
            calibrated=calibrated,
            extras=extras,
            notes=list(notes),
            per_forecaster={raw_name(self._stored(slots[n])): v for n, v in raw.items()},
            slots=slots,
            regime=max((_regime_of_slot(s) for s in slots.values()), key=REGIMES.index),
            from_measurements=measured is not None,
            partial=len(raw) < len(self._names),
            caps=caps,
            per_forecaster_caps={raw_name(self._stored(slots[n])): c for n, c in caps.items()},
        )

    def _calibrated(
        self,
        raw: Mapping[str, Sequence[float]],
        hardware: str,
        slots: Mapping[str, str],
        caps: Mapping[str, float],
    ) -> dict[str, list[float]]:
        """Each component's raw bins calibrated for its slot, held to the cap its answer set (`_capped`)."""
        return {
            n: _capped(self._calibrators[slots.get(n, n)].probs(p, hardware), caps.get(n))
            for n, p in raw.items()
        }

    def combine_raw(
        self,
        raw: Mapping[str, Sequence[float]],
        hardware: str,
        slots: Mapping[str, str] | None = None,
        caps: Mapping[str, float] | None = None,
    ) -> list[float]:
        """The final bins the current calibration and combination give for components' raw bins (held to
        `caps`, the answers' own caps: EngineForecast.caps)."""
        return self._combiner.combine(self._calibrated(raw, hardware, slots or {}, caps or {}))

    def confidence_ceiling(self, forecast: EngineForecast, hardware: str) -> float:
        """The most confident `forecast`'s components can be in either direction under the current calibration
        and combination (their raw answers are clipped at calibration.P_CLIP before calibrating), each held to the
        cap its answer set (EngineForecast.caps): a threshold above it decides none of their forecasts. 1.0 for an
        answer from measurements (not calibrated)."""
        if forecast.from_measurements or not forecast.raw:
            return 1.0
        top = (
            bins.N_BINS - 1
        )  # S >= 4: a raw answer certain the candidate is faster; bin 0 certain it is slower
        certain = {
            side: {n: [1.0 if i == side else 0.0 for i in range(bins.N_BINS)] for n in forecast.raw}
            for side in (0, top)
        }
        p_high = bins.p_faster(self.combine_raw(certain[top], hardware, forecast.slots, forecast.caps))
        p_low = bins.p_faster(self.combine_raw(certain[0], hardware, forecast.slots, forecast.caps))
        return max(p_high, 1.0 - p_low)

    # ------------------------------------------------------------------ selective threshold

    async def threshold(
        self, hardware: str, target_error: float, regime: Regime = "model", family: str | None = None
    ) -> ThresholdChoice:
        """The confidence threshold for verdicts on this GPU for forecasts of one regime (module doc), from
        that regime's own verified history: of this kernel family on this GPU when it has enough of its own
        (a family rougher than the rest errs more at a threshold certified on theirs), else of this GPU, else
        pooled over GPUs. Never below the threshold of a looser target in _LOOSER_TARGETS."""
        await self._maybe_refresh()
        key = (hardware, round(float(target_error), 9), regime, family)
        cached = self._thresholds.get(key)
        if cached is not None:
            return cached
        choice = self._threshold_at(hardware, target_error, regime, family)
        # A stricter target never decides what a looser one leaves unsure (_LOOSER_TARGETS).
        for looser in _LOOSER_TARGETS:
            if looser <= target_error:
                continue
            other = self._threshold_at(hardware, looser, regime, family)
            if other.threshold > choice.threshold:
                shown = f"{other.threshold:.3f}" if other.threshold < 0.9995 else f"{other.threshold:.6g}"
                choice = replace(
                    other,
                    target_error=choice.target_error,
                    reason=f"{choice.reason}; but target_error {looser:g} decides only at confidence >= {shown} "
                    f"({other.reason}), and a stricter target decides no more",
                )
        self._thresholds[key] = choice
        return choice

    def _threshold_at(
        self, hardware: str, target_error: float, regime: Regime, family: str | None
    ) -> ThresholdChoice:
        """`threshold` for this target alone (cached with the looser targets it is compared with)."""
        key = (hardware, round(float(target_error), 9), regime, family)
        cached = self._raw_thresholds.get(key)
        if cached is not None:
            return cached
        history = self._history.get(regime, {})
        default = default_threshold_for(regime, target_error)
        need = default_min_history(target_error, self._delta)
        # A window below `need` could never certify this target; None: every verified forecast (evaluation).
        window = None if self._history_window is None else max(self._history_window, need)

        def newest(key: str | None) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
            c, r = history.get(key, (_EMPTY, _EMPTY)) if key is not None else (_EMPTY, _EMPTY)
            return (c, r) if window is None else (c[-window:], r[-window:])

        conf, correct = newest(hardware)
        pooled = newest(POOLED)
        own = newest(_family_slot(hardware, family) if family else None)
        who = self.name + _LABEL[regime]
        if own[0].size >= need:
            choice = choose_threshold(own[0], own[1], target_error, self._delta, default=default)
            choice = replace(choice, reason=f"{who} on {hardware}, this kernel family: {choice.reason}")
        else:
            # The same for every family without enough history of its own: chosen once, not once per family
            # (with the looser targets, 7 choices of about 1.5 ms each per family of a compare).
            wide = (hardware, key[1], regime)
            chosen = self._wide_thresholds.get(wide)
            if chosen is None:
                if conf.size < need and pooled[0].size > conf.size:
                    chosen = choose_threshold(
                        pooled[0], pooled[1], target_error, self._delta, default=default
                    )
                    chosen = replace(chosen, reason=f"{who}, pooled over GPUs: {chosen.reason}")
                else:
                    chosen = choose_threshold(conf, correct, target_error, self._delta, default=default)
                    chosen = replace(chosen, reason=f"{who} on {hardware}: {chosen.reason}")
                self._wide_thresholds[wide] = chosen
            choice = chosen
        # A narrower history too short to choose on may still refute what the wider one chose.
        if own[0].size < need:
            choice = refuted_below(choice, own[0], own[1], "this kernel family")
        if conf.size < need:
            choice = refuted_below(choice, conf, correct, f"the forecaster on {hardware}")
        self._raw_thresholds[key] = choice
        return choice

    def _clear_thresholds(self) -> None:
        self._thresholds.clear()
        self._raw_thresholds.clear()
        self._wide_thresholds.clear()

    def set_history(
        self,
        hardware: Sequence[str],
        p_faster: Sequence[float],
        speedups: Sequence[float],
        regimes: Sequence[Regime] | None = None,
        families: Sequence[str | None] | None = None,
    ) -> None:
        """Use these verified final forecasts for thresholds (evaluation; a store refresh replaces them).
        `regimes[i]`: the regime forecast i was made in (default: "model" for all); `families[i]`: its
        candidate's kernel family (default: unknown)."""
        flags: list[Regime] = ["model"] * len(p_faster) if regimes is None else list(regimes)
        fams: list[str | None] = [None] * len(p_faster) if families is None else list(families)
        if not (len(hardware) == len(p_faster) == len(speedups) == len(flags) == len(fams)):
            raise ValueError("hardware, p_faster, speedups, regimes and families must have the same length")
        for regime in REGIMES:
            self._set_regime_history(
                regime,
                [
                    (h, p, s, fam)
                    for h, p, s, f, fam in zip(hardware, p_faster, speedups, flags, fams, strict=True)
                    if f == regime
                ],
            )

    def _set_regime_history(
        self, regime: Regime, rows: Sequence[tuple[str, float, float, str | None]]
    ) -> None:
        by_hw: dict[str, tuple[list[float], list[float]]] = {}
        for hw, p, s, family in rows:
            if bins.is_tie(s):
                continue
            right = 0.5 if p == 0.5 else float((p > 0.5) == (s > 1.0))
            for key in (hw, POOLED, *([_family_slot(hw, family)] if family else [])):
                conf_list, correct_list = by_hw.setdefault(key, ([], []))
                conf_list.append(max(p, 1.0 - p))
                correct_list.append(right)
        keep = self._history_keep()
        self._history[regime] = {
            k: (np.array(c if keep is None else c[-keep:]), np.array(r if keep is None else r[-keep:]))
            for k, (c, r) in by_hw.items()
        }
        self._clear_thresholds()

    # ------------------------------------------------------------------ fitting

    def fit(self, outcomes: Sequence[Outcome]) -> None:
        """Fit every component's calibration and the combination weights from verified outcomes."""
        by_slot: dict[str, list[tuple[str, Outcome, int]]] = {s: [] for s in self._slots}
        for i, o in enumerate(outcomes):
            for n in o.raw:
                if o.slot(n) in by_slot:
                    by_slot[o.slot(n)].append((n, o, i))
        for s, rows in by_slot.items():
            self._calibrators[s] = self._fit_calibrator(s, [(n, o) for n, o, _ in rows])
        if len(self._names) > 1:
            # As refresh fits them (`_fit_combiner`): on each outcome's answers calibrated by fits without its
            # fold (an outcome's fold from its place in `outcomes`).
            fold = [int(spread_id(i) % OOF_FOLDS) for i in range(len(outcomes))]
            oof = {
                s: [
                    self._fit_calibrator(s, [(n, o) for n, o, i in rows if fold[i] != k])
                    for k in range(OOF_FOLDS)
                ]
                for s, rows in by_slot.items()
                if rows
            }
            joint = [
                (i, o)
                for i, o in enumerate(outcomes)
                if all(n in o.raw for n in self._names) and not bins.is_tie(o.speedup)
            ]
            # Each answer held to its own cap, as a forecast combines it (`_capped`).
            p = [
                [
                    _held(oof[o.slot(n)][fold[i]].p(bins.p_faster(o.raw[n]), o.hardware), o.caps.get(n))
                    for n in self._names
                ]
                for i, o in joint
            ]
            self._combiner = Combiner.fit(
                self._names, np.array(p).reshape(-1, len(self._names)), [o.speedup > 1 for _, o in joint]
            )
        self._clear_thresholds()

    def _fit_calibrator(self, slot: str, rows: Sequence[tuple[str, Outcome]]) -> Calibrator:
        """One slot's calibration from (component, outcome) rows."""
        scored = [(n, o) for n, o in rows if not bins.is_tie(o.speedup)]
        return Calibrator.fit(
            [bins.p_faster(o.raw[n]) for n, o in scored],
            [o.speedup > 1.0 for _, o in scored],
            [o.hardware for _, o in scored],
            prior=self._prior[slot],
        )

    def _fit_combiner(self, tables: Mapping[str, VerifiedRows], empty: VerifiedRows) -> Combiner:
        """The combination weights, fitted on the verified pairs every component answered in its model regime
        (joined by question: `_joined`), each answer calibrated by its slot's fit without the row's fold
        (`self._oof`, the fits `_rescored` scores the threshold history with).

        Calibrated by today's fits, made on these same rows, every answer looked better than it will on a new pair,
        and most so the component whose calibration fits its rows most closely (fewer rows, a GPU of its own): the
        weights trusted it beyond its record and the pooled forecast was overconfident. Simulated (six GPUs, a
        noisier component with 15 verified pairs per GPU beside an informative one with 200), its weight came out
        at 0.79 in sample against 0.27 out of fold, and the pool's held-out log loss 0.617 against 0.595
        (benchmarks/bench_oof_combiner.py, 20 seeds; with 200 verified pairs of each, 0.588 either way)."""
        inputs = [tables.get(raw_name(self._stored(n)), empty).combination_inputs() for n in self._names]
        at = _joined([question for question, *_ in inputs])
        # The first component's row says whether the pair is a tie and which kernel was faster.
        *_, faster, tie, _ = inputs[0]
        scored = ~tie[at[0]]
        p = np.empty((int(scored.sum()), len(self._names)))
        for j, n in enumerate(self._names):
            _, p_raw, fold_key, hw_code, hw_names, _, _, caps = inputs[j]
            rows = at[j][scored]
            p[:, j] = _capped_p(  # each answer held to its own cap, as a forecast combines it (`_capped`)
                _calibrated_out_of_fold(self._oof[n], p_raw[rows], fold_key[rows], hw_code[rows], hw_names),
                caps[rows],
            )
        return Combiner.fit(self._names, p, faster[at[0][scored]])

    # ------------------------------------------------------------------ store refresh

    def mark_stale(self) -> None:
        """New measurements may have verified forecasts: re-read the store on the next call."""
        self._stale = True

    async def _maybe_refresh(self) -> None:
        if self._store is None or (not self._stale and self._clock() < self._fresh_until):
            return
        try:
            await self.refresh()
        except Exception:
            # A store hiccup must not fail a forecast: keep the last state and retry after the interval.
            log.warning("calibration refresh failed; using the previous state", exc_info=True)
            self._stale = False
            self._fresh_until = self._clock() + self._refresh_interval_s

    async def refresh(self, force: bool = False) -> None:
        """Re-read verified pairs; refit and persist what changed (cheap when counts are unchanged)."""
        store = self._store
        if store is None:
            return
        async with self._lock:
            if not force and not self._stale and self._clock() < self._fresh_until:
                return  # another caller refreshed while we waited
            if not self._loaded:
                await self._load(store)
                self._loaded = True
            # Cleared before the read, not after: a measurement that lands during the read marks the engine
            # stale again, and the next call re-reads what this read may have missed.
            self._stale = False
            # One read, split by forecaster name (row_names): the raw rows of every slot and the final rows.
            tables = await self._read_verified(store)
            dirty = self._dirty

            def changed(name: str) -> bool:
                return dirty is None or name in dirty

            # Slot s of component n: its rows are raw_name(_stored(s)); the component is s without the regime
            # suffix.
            # A component's raw p_faster is its chance of being faster if both run: a pair verified by a kernel
            # failing (VerifiedPair.failure) scores the verdict (thresholds, below), not that calibration.
            # Only the names whose pairs changed are signed again: the others' rows, and so their signatures, are
            # those of the last refresh. Signatures and fit inputs come from the name's columns (VerifiedRows):
            # the values _fit_calibrator would compute from the rows, without a pass over them in Python.
            empty = VerifiedRows(_family_slot)
            for s in self._slots:
                if changed(raw_name(self._stored(s))) or s not in self._slot_signatures:
                    table = tables.get(raw_name(self._stored(s)), empty)
                    self._slot_signatures[s] = table.calibration_signature()
            signatures = self._slot_signatures
            for s in self._slots:
                refit = signatures[s] != self._fit_signatures.get(s)
                # A calibration restored from the store is not refitted, but its out-of-fold fits are made.
                if not refit and signatures[s] == self._oof_signatures.get(s):
                    continue
                table = tables.get(raw_name(self._stored(s)), empty)
                p_raw, faster, _ = table.calibration_inputs()
                codes, names = table.calibration_codes()
                if refit:
                    self._calibrators[s] = Calibrator.fit_codes(
                        p_raw, faster, codes, names, prior=self._prior[s]
                    )
                    self._fit_signatures[s] = signatures[s]
                    await store.save_calibration(self._stored(s), POOLED, self._calibration_state(s))
                if signatures[s] != self._oof_signatures.get(s):
                    fold = table.calibration_folds(OOF_FOLDS)
                    self._oof[s] = [
                        Calibrator.fit_codes(
                            p_raw[fold != k],
                            faster[fold != k],
                            codes[fold != k],
                            names,
                            prior=self._prior[s],
                            start=self._calibrators[s],  # a fit of these and a fifth more: fewer steps
                        )
                        for k in range(OOF_FOLDS)
                    ]
                    self._oof_signatures[s] = signatures[s]
            # The combination weights are learned on the components' model answers (joined per pair), calibrated
            # out of fold by the fits just made from the same rows (a signature's rows fix both).
            combined = {n: signatures[n] for n in self._names}
            if len(self._names) > 1 and combined != self._combiner_signatures:
                self._combiner = self._fit_combiner(tables, empty)
                self._combiner_signatures = combined
                await store.save_calibration(self._stored_name, POOLED, self._combiner_state())
            scored_with = json.dumps(
                [[self._oof_signatures.get(s, "") for s in self._slots], self._combiner_signatures],
                sort_keys=True,
            )
            for regime in REGIMES:
                name = self._stored_name + _SUFFIX[regime]
                same_fits = self._history_scored_with.get(regime) == scored_with
                if not changed(name) and regime in self._history_signatures and same_fits:
                    continue  # the same rows as at the last refresh: the same signature
                # _set_regime_history of the newest row of each measurement (VerifiedRows), from its columns.
                table = tables.get(name, empty)
                signature = table.history_signature()
                if signature != self._history_signatures.get(regime) or not same_fits:
                    scores = self._rescored(table, tables, empty)
                    self._history[regime] = table.history(self._history_keep(), POOLED, scores)
                    self._clear_thresholds()
                    self._history_signatures[regime] = signature
                    self._history_scored_with[regime] = scored_with
            self._dirty = set()
            self._fresh_until = self._clock() + self._refresh_interval_s

    def _rescored(
        self, table: VerifiedRows, tables: Mapping[str, VerifiedRows], empty: VerifiedRows
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
        """The confidence and right/wrong score of each of `table`'s final forecasts as the components' calibrations
        fitted out of fold give them: each forecast's raw component answers (the rows stored with it) calibrated by
        fits on the slots' rows outside its fold (its measurement's; OOF_FOLDS), combined by the current weights,
        its kernels' chances of failing weighed as its verdict weighed them (selective.decision_p).

        The history certified thresholds at the confidence each forecast was issued at, under whatever calibration
        was current then: an underconfident forecaster's early forecasts, issued too low, are right more often than
        today's at the same confidence, and certified thresholds too low (logit slope 0.33, 1,000 verified pairs,
        target 0.1: error above target in 11.2% of histories, not 5%; benchmarks/bench_selective.py). Scored again
        under today's fit, in sample, a calibrated forecaster's history looks better than it is (5.8% against
        4.7%); out of fold it does not (4.7%, and 3.0% for the underconfident one). A forecast without its raw rows or its chances of failing (stored before they were
        kept) keeps its issued score. None: nothing to score again."""
        idx, ids, join, fold_key, hw_code, code_names, p_fail, p_fail_baseline = table.rescoring_inputs()
        if idx.size == 0:
            return None
        answers = np.full((len(self._names), idx.size), np.nan)
        for i, n in enumerate(self._names):
            for regime in REGIMES:
                s = n + _SUFFIX[regime]
                raw_ids, keys, p_raw, caps = tables.get(raw_name(self._stored(s)), empty).raw_p()
                if raw_ids.size == 0 or s not in self._oof:
                    continue
                # A forecast's raw rows are stored right after its final row, one per component (service
                # _save_forecasts): the first of this slot's rows after it, if it is the same forecast's.
                at = np.searchsorted(raw_ids, ids, side="right")
                near = np.minimum(at, raw_ids.size - 1)
                hit = (at < raw_ids.size) & (raw_ids[near] <= ids + len(self._names)) & (keys[near] == join)
                if not hit.any():
                    continue
                # Each row's (fold, GPU): the calibration that scores it.
                p_n = _calibrated_out_of_fold(self._oof[s], p_raw[near], fold_key, hw_code, code_names)
                p_n = _capped_p(p_n, caps[near])  # held to its own cap, as it was issued (`_capped`)
                answers[i] = np.where(hit, p_n, answers[i])
        if len(self._names) == 1:
            p = answers[0]
        else:
            # Combiner.combine's pool of p_faster with every component present (final rows are stored only so).
            w = np.asarray(self._combiner.weights, dtype=np.float64)
            p = np.full(idx.size, 0.5) if w.sum() <= 0 else sigmoid(w @ logit(answers))
            p = np.where(np.isnan(answers).any(axis=0), np.nan, p)
        ok = np.isfinite(p)
        if not ok.any():
            return None
        d = decision_p_array(p[ok], p_fail[ok], p_fail_baseline[ok])
        issued_conf, issued_right, faster = table.scores()
        conf, right = issued_conf.copy(), issued_right.copy()
        scored = idx[ok]
        conf[scored] = np.maximum(d, 1.0 - d)
        right[scored] = np.where(d == 0.5, 0.5, ((d > 0.5) == faster[scored]).astype(np.float64))
        return conf, right

    async def _read_verified(self, store: CalibrationStore) -> dict[str, VerifiedRows]:
        """The verified pairs by forecaster name, as `store.verified_pairs()` returns them, and the names whose
        pairs changed since the last read added to `_dirty`.

        A store with `verified_changes` is read for what changed since the last read only (a search loop
        measures once per compare: re-reading every verified pair after each measurement made a compare take
        0.7 s at 16,000 verified rows, 7 s at 160,000), and only those pairs are applied to the names' tables."""
        changes_since = getattr(store, "verified_changes", None)
        if changes_since is None:
            by_name: dict[str, list[tuple[PairGroup, VerifiedPair]]] = {}
            for i, v in enumerate(await store.verified_pairs()):
                # A store that does not number its rows: they come oldest first, numbered by their place.
                v = v if v.row_id is not None else replace(v, row_id=i)
                by_name.setdefault(v.forecaster, []).append(((v.forecaster, str(v.row_id), "", "", ""), v))
            self._dirty = None
            tables = {name: VerifiedRows(_family_slot) for name in by_name}
            for name, pairs in by_name.items():
                tables[name].apply([], pairs)
            return tables
        changes = await changes_since(None if self._tables is None else self._seq)
        if changes.full or self._tables is None:
            self._tables = {}
            self._dirty = None
        gone: dict[str, list[PairGroup]] = {}
        for g in changes.groups:
            gone.setdefault(g[0], []).append(g)
        added: dict[str, list[tuple[PairGroup, VerifiedPair]]] = {}
        for g, v in changes.pairs:
            added.setdefault(g[0], []).append((g, v))
        touched: set[str] = set()
        for name in {*gone, *added}:
            table = self._tables.setdefault(name, VerifiedRows(_family_slot))
            before = len(table)
            table.apply(gone.get(name, []), added.get(name, []))
            if before or len(table):
                touched.add(name)
        self._seq = changes.seq
        if self._dirty is not None:
            self._dirty |= touched
        return self._tables

    def _history_keep(self) -> int | None:
        # Each threshold is certified on the latest HISTORY_WINDOW verified forecasts of its key (`threshold`):
        # forecasts issued under an early, overconfident calibration otherwise stayed at the top of the
        # confidence range for good, failed the first test of the fixed sequence and kept a GPU from ever
        # deciding. Kept: as many as the smallest target error accepted needs.
        if self._history_window is None:
            return None
        return max(self._history_window, default_min_history(MIN_TARGET_ERROR, self._delta))

    def _calibration_state(self, name: str) -> str:
        return json.dumps(
            {
                "kind": "engine-calibration",
                "version": STATE_VERSION,
                "rows": self._fit_signatures.get(name, ""),
                "calibrator": self._calibrators[name].to_dict(),
            },
            sort_keys=True,
        )

    def _combiner_state(self) -> str:
        return json.dumps(
            {
                "kind": "engine-combiner",
                "version": COMBINER_STATE_VERSION,
                "rows": self._combiner_signatures,
                "combiner": self._combiner.to_dict(),
            },
            sort_keys=True,
        )

    async def _load(self, store: CalibrationStore) -> None:
        """Start from the persisted state; an unreadable one is ignored and refitted from the pairs."""
        for n in self._slots:
            text = await store.load_calibration(self._stored(n), POOLED)
            if text is None:
                continue
            try:
                d = json.loads(text)
                if d.get("kind") != "engine-calibration" or d.get("version") != STATE_VERSION:
                    raise ValueError(f"unknown state {d.get('kind')}/{d.get('version')}")
                self._calibrators[n] = Calibrator.from_dict(d["calibrator"])
                self._fit_signatures[n] = str(d.get("rows", ""))  # a state from before signatures: refitted
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("ignoring unreadable calibration state of %s: %s", n, exc)
        if len(self._names) > 1:
            text = await store.load_calibration(self._stored_name, POOLED)
            if text is None:
                return
            try:
                d = json.loads(text)
                if d.get("kind") == "engine-combiner" and d.get("version") == 1:
                    # Expected once after an upgrade: not worth a warning.
                    log.info("combiner state of %s was fitted in sample: refitted out of fold", self.name)
                    return
                if d.get("kind") != "engine-combiner" or d.get("version") != COMBINER_STATE_VERSION:
                    raise ValueError(f"unknown state {d.get('kind')}/{d.get('version')}")
                combiner = Combiner.from_dict(d["combiner"])
                if list(combiner.names) != self._names:
                    raise ValueError(f"combiner pools {list(combiner.names)}, engine has {self._names}")
                self._combiner = combiner
                # A state from before signatures ("n_rows") matches none: refitted.
                self._combiner_signatures = {str(k): str(v) for k, v in d.get("rows", {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("ignoring unreadable combiner state of %s: %s", self.name, exc)


def _calibrated_out_of_fold(
    fits: Sequence[Calibrator],
    p_raw: np.ndarray[Any, Any],
    fold_key: np.ndarray[Any, Any],
    hw_code: np.ndarray[Any, Any],
    hw_names: Sequence[str],
) -> np.ndarray[Any, Any]:
    """Raw p_faster calibrated, each by the fit without its fold (`fits[fold_key % len(fits)]`) for its GPU
    (`hw_names[hw_code]`): one Platt per (fold, GPU) group."""
    group_of = (fold_key % np.uint64(len(fits))).astype(np.int64) * len(hw_names) + hw_code
    groups, group = np.unique(group_of, return_inverse=True)
    platts = [fits[int(g) // len(hw_names)].for_hardware(hw_names[int(g) % len(hw_names)]) for g in groups]
    a = np.array([f.a for f in platts], np.float64)[group]
    b = np.array([f.b for f in platts], np.float64)[group]
    out: np.ndarray[Any, Any] = np.clip(sigmoid(a * logit(p_raw) + b), OUT_CLIP, 1.0 - OUT_CLIP)
    return out


def _joined(questions: Sequence[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    """The rows of every component that answered the same question, as one index array per component into its
    `questions` (VerifiedRows.combination_inputs), aligned, in the first component's row order.

    Each component has one row per question in a store (the store keeps the last forecast of each pair). Rows
    keyed by their measured speedup (no `pair`: an evaluation's) may share a question: the k-th row of each
    component (oldest first) is joined with the k-th of the others'."""
    keyed = []
    for q in questions:
        # Each row's rank among its component's rows of the same question, mixed into its key (0: the key).
        order = np.argsort(q, kind="stable")
        sorted_q = q[order]
        starts = (
            np.flatnonzero(np.r_[True, sorted_q[1:] != sorted_q[:-1]]) if q.size else np.zeros(0, np.int64)
        )
        rank = np.zeros(q.size, np.uint64)
        rank[order] = (np.arange(q.size) - np.repeat(starts, np.diff(np.r_[starts, q.size]))).astype(
            np.uint64
        )
        keyed.append(q ^ (rank * np.uint64(0x9E3779B97F4A7C15)))
    at = [np.arange(questions[0].size)]
    for j in range(1, len(questions)):
        _, mine, theirs = np.intersect1d(keyed[0][at[0]], keyed[j], assume_unique=True, return_indices=True)
        at = [a[mine] for a in at] + [theirs]
    order = np.argsort(at[0], kind="stable")
    return [a[order] for a in at]
