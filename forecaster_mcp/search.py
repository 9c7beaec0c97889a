"""Budgeted search over a replay space, driven through the MCP tools (`compare_kernels`, `measure_kernel`).

The strategies talk to an abstract async tool caller, `ToolCaller(tool_name, arguments) -> structuredContent`,
so the same code runs against a real server (stdio client) or the in-process `ToolEmulator` used for tuning
and tests. They choose from the space's list of configurations and learn runtimes only by measuring; the
recorded times are read only to report how close a run came to the space's best.

Forecast-guided search, per measurement:
1. candidates: every untried one-parameter step from the best few measured configurations and every
   two-parameter step from the best two (local moves: rugged spaces hide their best configurations
   behind pairs of changes that each look worse alone), plus `pool_size` random untried configurations per
   screening call (global reach);
2. screening: `compare_kernels` of the candidates against the best measured configuration (the baseline),
   in calls of at most 63 candidates; each call's `measure_next` head and any candidate forecast `faster`
   go to a final round;
3. the final round is one more `compare_kernels` among the finalists; its `measure_next` head is measured
   (or a finalist forecast `faster` that the acquisition value ranks higher, for servers that list only
   unsure candidates in measure_next).
The first `n_init` measurements are random (the family model needs a few points before it can rank).

`unsure_guided_search` is the plainest client in the product's own workflow instead: one call of random
candidates per step with `measure_if_unsure`, so the server chooses and makes the measurement itself.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

ToolCaller = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]

MAX_PER_CALL = 63  # candidates per compare_kernels call besides the baseline (the tool takes 2..64 kernels)
# The plainest forecast-guided client: one pool of random untried configurations per step, no local moves.
PLAIN_CLIENT: dict[str, Any] = {"pool_size": MAX_PER_CALL, "screens_per_step": 1, "local_moves": False}
N_INIT = 10
LOCAL_STARTS = 5  # neighbours of this many best configurations are always screened
PAIR_STARTS = 2  # ... and two-step neighbours of this many


class BudgetSpent(Exception):
    """The ledger refused a measurement: the search is over, with what it found (`trace`)."""

    def __init__(self, trace: SearchTrace) -> None:
        super().__init__("the ledger's GPU-seconds are spent")
        self.trace = trace


def _budget_refusal(exc: BaseException) -> bool:
    """Whether a tool call failed because the ledger cannot pay for it (errors.BudgetExhausted's text)."""
    from forecaster_mcp.errors import BUDGET_EXHAUSTED_TEXT
    from forecaster_mcp.server.client import tool_failure

    failed = tool_failure(exc)
    return failed is not None and BUDGET_EXHAUSTED_TEXT in str(failed)


async def until_budget_spent(run: Awaitable[SearchTrace]) -> SearchTrace:
    """The search's trace, also when the ledger stopped it (BudgetSpent)."""
    try:
        return await run
    except BudgetSpent as spent:
        return spent.trace


def init_count(measurements: int) -> int:
    """Random measurements before the forecast guides a search: N_INIT, or half of a smaller budget (with
    N_INIT or fewer measurements in all the forecast would never be asked)."""
    return min(N_INIT, max(1, measurements // 2))


class EntryLike(Protocol):
    """What a search needs of one configuration of a space (measure.replay.ReplayEntry fits)."""

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def time_ms(self) -> float | None: ...


class SpaceLike(Protocol):
    """What a search needs of a replay space (measure.replay.ReplaySpace fits)."""

    @property
    def device(self) -> str: ...

    @property
    def kernel_name(self) -> str: ...

    @property
    def param_keys(self) -> list[str]: ...

    @property
    def entries(self) -> Sequence[EntryLike]: ...

    @property
    def best_time_ms(self) -> float | None: ...


@dataclass
class SearchTrace:
    """What one search run did and found."""

    strategy: str
    seed: int
    best_time_ms: float | None  # recorded runtime of the fastest configuration the search measured
    best_space_ms: float | None  # the space's best recorded runtime
    fraction: float  # best_space_ms / best_time_ms (1.0 = found the optimum; 0 when nothing ran)
    measurements: int
    candidates_considered: int  # distinct configurations forecast (screened) plus measured
    forecast_calls: int
    gpu_seconds: float
    best_params: dict[str, Any] | None
    per_step_best: list[float] = field(default_factory=list)  # fraction after each measurement
    per_step_gpu_seconds: list[float] = field(default_factory=list)  # GPU-seconds spent by then
    wall_seconds: float = 0.0
    measured_by_compare: int = 0  # measurements compare_kernels made itself (measure_if_unsure)
    stopped_by_budget: bool = False  # the ledger refused the next measurement (search --gpu-seconds)


def placeholder_source(kernel_name: str) -> str:
    """The fixed text standing in for a replayed kernel's source (one family for the whole space)."""
    return (
        f"// {kernel_name}: a configuration of a recorded Kernel Tuner search space.\n"
        "// The kernel source is not part of the recording; the tuning parameters are its -D defines.\n"
    )


def kernel_dict(space: SpaceLike, index: int) -> dict[str, Any]:
    """The Kernel dict naming configuration `index` of the space."""
    return {
        "id": f"c{index}",
        "source": placeholder_source(space.kernel_name),
        "entry": space.kernel_name,
        "defines": dict(space.entries[index].params),
    }


class _Tracker:
    """Measurements made, the best so far, and what they cost."""

    def __init__(self, space: SpaceLike, strategy: str, seed: int) -> None:
        self.space = space
        self.strategy = strategy
        self.seed = seed
        self.measured: dict[int, float | None] = {}  # index -> measured median (None: failed)
        self.considered: set[int] = set()
        self.forecast_calls = 0
        self.measured_by_compare = 0
        self.gpu_seconds = 0.0
        self.per_step: list[float] = []
        self.per_step_gs: list[float] = []
        self.started = time.perf_counter()

    @property
    def best_index(self) -> int | None:
        ok = [(t, i) for i, t in self.measured.items() if t is not None]
        return min(ok)[1] if ok else None

    async def measure(self, call: ToolCaller, index: int) -> None:
        try:
            result = await call("measure_kernel", {"kernel": kernel_dict(self.space, index), "workload": {}})
        except Exception as exc:
            if _budget_refusal(exc):
                trace = self.trace()
                trace.stopped_by_budget = True
                raise BudgetSpent(trace) from exc
            raise
        self.record(index, result)

    def record(self, index: int, result: Mapping[str, Any], by_compare: bool = False) -> None:
        """Count one measurement result (from measure_kernel, or made by compare_kernels itself)."""
        self.measured_by_compare += int(by_compare)
        runtime = result.get("runtime_ms")
        ok = result.get("status") == "ok" and isinstance(runtime, Mapping) and runtime.get("median")
        self.measured[index] = float(runtime["median"]) if ok and isinstance(runtime, Mapping) else None
        self.considered.add(index)
        cost = result.get("cost") or {}
        self.gpu_seconds += float(cost.get("gpu_seconds", 0.0) or 0.0)
        self.per_step.append(self._fraction())
        self.per_step_gs.append(self.gpu_seconds)

    def _recorded_best(self) -> tuple[float | None, int | None]:
        best: tuple[float | None, int | None] = (None, None)
        for i, t in self.measured.items():
            rec = self.space.entries[i].time_ms
            if t is not None and rec is not None and (best[0] is None or rec < best[0]):
                best = (rec, i)
        return best

    def _fraction(self) -> float:
        found, _ = self._recorded_best()
        best = self.space.best_time_ms
        if found is None or best is None or found <= 0:
            return 0.0
        return best / found

    def trace(self) -> SearchTrace:
        found, idx = self._recorded_best()
        return SearchTrace(
            strategy=self.strategy,
            seed=self.seed,
            best_time_ms=found,
            best_space_ms=self.space.best_time_ms,
            fraction=self._fraction(),
            measurements=len(self.measured),
            candidates_considered=len(self.considered),
            forecast_calls=self.forecast_calls,
            gpu_seconds=self.gpu_seconds,
            best_params=dict(self.space.entries[idx].params) if idx is not None else None,
            per_step_best=list(self.per_step),
            per_step_gpu_seconds=list(self.per_step_gs),
            wall_seconds=time.perf_counter() - self.started,
            measured_by_compare=self.measured_by_compare,
        )


@dataclass
class SpaceDifficulty:
    """How hard a space is for a budget: what `random_search` reaches there, exactly (no sampling).

    Over all `configurations` (failed ones count: random search spends a measurement on them too), sorted by
    recorded time, the best of a uniform sample of `budget` distinct ones is the j-th fastest with probability
    C(N - j, B - 1) / C(N, B); the mean and median best-fraction follow from that. `within` counts the
    configurations at or above each best-fraction level, and `random_hits` is the chance that such a sample
    holds at least one of them. A search that must reach 0.90 on a space where `random_hits["0.90"]` is 0.09
    must find a handful of configurations in thousands.
    """

    configurations: int
    budget: int
    random_mean: float
    random_median: float
    within: dict[str, int]
    random_hits: dict[str, float]


DIFFICULTY_LEVELS = (0.90, 0.97)


def space_difficulty(space: SpaceLike, budget: int) -> SpaceDifficulty:
    """Exact best-fraction statistics of `budget` uniformly random distinct configurations (SpaceDifficulty)."""
    n = len(space.entries)
    b = max(0, min(budget, n))
    best = space.best_time_ms
    fractions = sorted(
        (best / e.time_ms if best and e.time_ms and e.time_ms > 0 else 0.0 for e in space.entries),
        reverse=True,
    )
    within = {f"{level:.2f}": sum(f >= level for f in fractions) for level in DIFFICULTY_LEVELS}

    def log_choose(m: int, k: int) -> float:
        if k < 0 or k > m:
            return -math.inf
        return math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1)

    def p_none_of_top(j: int) -> float:
        """Chance that none of the j fastest configurations is in the sample."""
        return math.exp(log_choose(n - j, b) - log_choose(n, b)) if b > 0 else 1.0

    mean = median = 0.0
    if b > 0:
        # P(the sample's best is the j-th fastest) = C(N - j, B - 1) / C(N, B).
        ranked = enumerate(fractions, start=1)
        mean = sum(f * math.exp(log_choose(n - j, b - 1) - log_choose(n, b)) for j, f in ranked)
        # The j fastest hold the sample's best at least half the time from the first such j on.
        median = next(f for j, f in enumerate(fractions, start=1) if p_none_of_top(j) <= 0.5)
    hits = {key: 1.0 - p_none_of_top(count) for key, count in within.items()}
    return SpaceDifficulty(n, b, mean, median, within, hits)


def random_order(rng: random.Random, n: int, count: int) -> list[int]:
    """`count` distinct indices below `n`, uniformly at random, one at a time: the first k are the same for any
    `count` of at least k. (`rng.sample` draws a large sample another way, so a random run's configurations
    changed with a --measurements cap its GPU budget never let it reach.) It draws as `rng.sample` does for a
    small sample of a large population (its first 10 of more than 85 are `rng.sample(range(n), 10)`, the forecast
    run's random start of the same seed; 100 of more than 1,045 are what the random runs drew before)."""
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < min(count, n):
        j = rng.randrange(n)
        if j not in seen:
            seen.add(j)
            out.append(j)
    return out


async def random_search(call: ToolCaller, space: SpaceLike, measurements: int, seed: int) -> SearchTrace:
    """Measure `measurements` distinct configurations drawn uniformly at random."""
    rng = random.Random(seed)
    tracker = _Tracker(space, "random", seed)
    for index in random_order(rng, len(space.entries), measurements):
        await tracker.measure(call, index)
    return tracker.trace()


def _neighbours(space: SpaceLike, index: int, lookup: Mapping[tuple[Any, ...], int]) -> list[int]:
    """Configurations one step away in one parameter (adjacent value in that parameter's sorted values)."""
    params = space.entries[index].params
    keys = space.param_keys
    out = []
    for k in keys:
        values = _values(space)[k]
        pos = values.index(params[k]) if params[k] in values else -1
        for step in (-1, 1):
            j = pos + step
            if pos < 0 or not 0 <= j < len(values):
                continue
            moved = tuple(values[j] if kk == k else params[kk] for kk in keys)
            hit = lookup.get(moved)
            if hit is not None:
                out.append(hit)
    return out


# The last space's values, with the space itself: keyed by id() alone, a new space at a freed one's address
# was answered the old one's values.
_VALUES_CACHE: list[tuple[SpaceLike, dict[str, list[Any]]]] = []


def _values(space: SpaceLike) -> dict[str, list[Any]]:
    if _VALUES_CACHE and _VALUES_CACHE[0][0] is space:
        return _VALUES_CACHE[0][1]
    cached: dict[str, list[Any]] = {}
    for k in space.param_keys:
        seen = {json.dumps(e.params[k]): e.params[k] for e in space.entries}
        cached[k] = sorted(seen.values(), key=_sort_key)
    _VALUES_CACHE[:] = [(space, cached)]
    return cached


def _sort_key(value: Any) -> tuple[int, float, str]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _index_of(space: SpaceLike) -> dict[tuple[Any, ...], int]:
    keys = space.param_keys
    return {tuple(e.params[k] for k in keys): i for i, e in enumerate(space.entries)}


async def _compare(
    call: ToolCaller,
    space: SpaceLike,
    baseline: int,
    candidates: Sequence[int],
    tracker: _Tracker,
    **options: Any,
) -> dict[str, Any]:
    """One compare_kernels call of `candidates` against `baseline`; `options` are further tool arguments."""
    tracker.forecast_calls += 1
    tracker.considered.update(candidates)
    kernels = [kernel_dict(space, baseline), *(kernel_dict(space, i) for i in candidates)]
    return await call(
        "compare_kernels",
        {
            "candidates": kernels,
            "workload": {},
            "baseline": f"c{baseline}",
            "hardware": space.device,
            **options,
        },
    )


def _finalists(result: Mapping[str, Any], take: int) -> list[int]:
    """The head of measure_next plus every candidate the forecast calls faster (a decided verdict is left
    out of measure_next by servers that only list unsure candidates, yet it is exactly what a search wants)."""
    out: list[int] = []
    for cid in list(result.get("measure_next") or [])[:take]:
        if isinstance(cid, str) and cid.startswith("c"):
            out.append(int(cid[1:]))
    faster = [
        c
        for c in result.get("candidates") or []
        if c.get("verdict") == "faster" and c.get("decided_by") == "forecast"
    ]
    faster.sort(key=lambda c: -float(c.get("p_faster", 0.0)))
    for c in faster[:take]:
        idx = int(str(c["id"])[1:])
        if idx not in out:
            out.append(idx)
    return out


def _pick(result: Mapping[str, Any], allowed: set[int]) -> int | None:
    """The candidate to measure from a final round: the measure_next head, unless candidates the forecast
    calls faster (left out of measure_next by servers that list only unsure ones) are worth more by the
    same acquisition value, computed from what the answer carries (exact when it carries the extras)."""
    from forecaster_mcp.forecast.acquisition import AcqItem, measurement_value

    by_id = {
        int(str(c["id"])[1:]): c for c in result.get("candidates") or [] if int(str(c["id"])[1:]) in allowed
    }
    head = [int(c[1:]) for c in result.get("measure_next") or [] if isinstance(c, str) and c[1:].isdigit()]
    head = [i for i in head if i in allowed][:1]
    faster = [
        i for i, c in by_id.items() if c.get("verdict") == "faster" and c.get("decided_by") == "forecast"
    ]
    options = list(dict.fromkeys([*head, *faster]))
    if not options:
        return max(by_id, key=lambda i: float(by_id[i].get("p_faster", 0.0))) if by_id else None
    if len(options) == 1:
        return options[0]

    def value(i: int) -> float:
        c = by_id.get(i, {})
        extras = c.get("extras") if isinstance(c.get("extras"), Mapping) else {}
        probs = c.get("speedup_bins") or [1.0 / 8] * 8
        return measurement_value(AcqItem(str(i), probs, extras or {}, float(c.get("p_faster", 0.5))))

    return max(options, key=value)


async def forecast_guided_search(
    call: ToolCaller,
    space: SpaceLike,
    measurements: int,
    seed: int,
    pool_size: int = 64,
    *,
    screens_per_step: int = 4,
    n_init: int = N_INIT,
    local_moves: bool = True,
) -> SearchTrace:
    """Search with `measurements` measurements, screening candidates through compare_kernels (module doc).

    `pool_size` random untried configurations join each screening call (so one step screens about
    `screens_per_step * pool_size` random ones plus the local moves); forecasts are free, measurements are not.
    `local_moves=False, screens_per_step=1, pool_size=63` is the plainest client: one random pool per step.
    """
    rng = random.Random(seed)
    tracker = _Tracker(space, "forecast", seed)
    n = len(space.entries)
    budget = min(measurements, n)
    lookup = _index_of(space)
    for index in rng.sample(range(n), min(n_init, budget)):
        await tracker.measure(call, index)
    while len(tracker.measured) < budget:
        base = tracker.best_index
        untried = [i for i in range(n) if i not in tracker.measured]
        if base is None:  # everything so far failed: keep sampling
            await tracker.measure(call, rng.choice(untried))
            continue
        ok = sorted((t, i) for i, t in tracker.measured.items() if t is not None)
        local: list[int] = []
        for rank, (_, start) in enumerate(ok[:LOCAL_STARTS] if local_moves else []):
            near = _neighbours(space, start, lookup)
            local.extend(j for j in near if j not in tracker.measured)
            if rank < PAIR_STARTS:
                # Two coordinated changes: rugged spaces hide the best configurations behind a pair of
                # parameters that each look worse alone.
                for j in near:
                    local.extend(m for m in _neighbours(space, j, lookup) if m not in tracker.measured)
        local = list(dict.fromkeys(local))
        rand_pool = rng.sample(untried, min(len(untried), pool_size * screens_per_step))
        pool = list(dict.fromkeys([*local, *rand_pool]))
        chunks = [pool[i : i + MAX_PER_CALL] for i in range(0, len(pool), MAX_PER_CALL)]
        finalists: list[int] = []
        for chunk in chunks:
            result = await _compare(call, space, base, chunk, tracker)
            finalists.extend(i for i in _finalists(result, 2) if i not in finalists)
        if not finalists:
            finalists = [rng.choice(untried)]
        choice: int | None = finalists[0]
        if len(finalists) > 1:
            final = await _compare(call, space, base, finalists[:MAX_PER_CALL], tracker)
            choice = _pick(final, set(finalists))
        if choice is None or choice in tracker.measured:
            choice = rng.choice(untried)
        await tracker.measure(call, choice)
    return tracker.trace()


async def unsure_guided_search(
    call: ToolCaller, space: SpaceLike, measurements: int, seed: int, *, n_init: int = N_INIT
) -> SearchTrace:
    """The plain client in the product's own workflow: the server spends the budget.

    Per step, one `compare_kernels` call of MAX_PER_CALL random untried configurations against the best so
    far with `measure_if_unsure=True, max_measurements=1`: the server measures its most valuable unsure
    candidate. When it measured none (every candidate decided), the client measures the head of
    `measure_next` itself (a candidate forecast `faster`, or a `slower` one whose wide forecast still leaves a
    real expected gain), else a random candidate of the call.
    """
    rng = random.Random(seed)
    tracker = _Tracker(space, "forecast", seed)
    n = len(space.entries)
    budget = min(measurements, n)
    for index in rng.sample(range(n), min(n_init, budget)):
        await tracker.measure(call, index)
    while len(tracker.measured) < budget:
        base = tracker.best_index
        untried = [i for i in range(n) if i not in tracker.measured]
        if base is None:
            await tracker.measure(call, rng.choice(untried))
            continue
        pool = rng.sample(untried, min(len(untried), MAX_PER_CALL))
        result = await _compare(call, space, base, pool, tracker, measure_if_unsure=True, max_measurements=1)
        made = [m for m in result.get("measurements") or [] if m.get("kernel_id") != f"c{base}"]
        for m in made:
            tracker.record(int(str(m["kernel_id"])[1:]), m, by_compare=True)
        if made:
            continue
        head = [int(c[1:]) for c in result.get("measure_next") or [] if c != f"c{base}"]
        await tracker.measure(call, head[0] if head else rng.choice(pool))
    return tracker.trace()


# ---------------------------------------------------------------- offline stand-in for the two tools


MEASURE_NEXT_POLICIES = ("server", "unsure", "all")


class ToolEmulator:
    """In-process stand-in for `compare_kernels` and `measure_kernel` over one replay space, for tuning and
    tests without a server: LocalForecaster + a dict-backed FamilyHistory + the acquisition ranking.

    Not the server: there is no ledger, calibration or stored forecasts. Verdicts use a fixed confidence
    threshold (the server's default while its verified history is short). `measure_next` says which candidates
    measure_next lists, ranked by the acquisition value: "server" (as the server does: unsure and faster ones,
    and slower ones while their expected gain is real; `acquisition.worth_measuring`), "unsure" (a server that
    lists only unsure ones) or "all".
    """

    def __init__(
        self,
        space: SpaceLike,
        *,
        threshold: float = 0.95,
        measure_next: str = "server",
        verification_ms: Mapping[int, float] | None = None,
    ) -> None:
        from forecaster_mcp.forecast.local import LocalForecaster

        self.space = space
        self.threshold = threshold
        if measure_next not in MEASURE_NEXT_POLICIES:
            raise ValueError(f"measure_next must be one of {MEASURE_NEXT_POLICIES}, not {measure_next!r}")
        self.policy = measure_next
        self.history = DictHistory()
        self.forecaster = LocalForecaster(self.history, nvcc=None, ptxas_wait_s=0.0)
        self._lookup = _index_of(space)
        self._runtime: dict[str, float | None] = {}
        self.calls: dict[str, int] = {"compare_kernels": 0, "measure_kernel": 0}

    async def __call__(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls[tool] = self.calls.get(tool, 0) + 1
        if tool == "compare_kernels":
            return await self._compare(args)
        if tool == "measure_kernel":
            return self._measure(args)
        raise ValueError(f"unknown tool {tool!r}")

    def _measure(self, args: dict[str, Any]) -> dict[str, Any]:
        from forecaster_mcp.measure.base import MeasureRequest
        from forecaster_mcp.measure.replay import ReplayEntry, recorded_charge
        from forecaster_mcp.models import Kernel, Workload
        from forecaster_mcp.settings import Settings
        from forecaster_mcp.store.db import FamilyPoint

        kernel = Kernel.model_validate(args["kernel"])
        workload = Workload.model_validate(args.get("workload") or {})
        key = tuple(kernel.defines.get(k) for k in self.space.param_keys)
        index = self._lookup.get(key)
        if index is None:
            raise ValueError(f"configuration {kernel.defines} is not in the recording")
        entry = self.space.entries[index]
        times = list(getattr(entry, "times", []) or [])
        ok = entry.time_ms is not None
        gpu_seconds = (
            (sum(times) + float(getattr(entry, "verification_time_ms", 0.0) or 0.0)) / 1000.0 if ok else 0.0
        )
        if isinstance(entry, ReplayEntry):
            # What a replaying server answers under its default caps (ReplayMeasurer's own rule): the recorded
            # runs and verification, or for a failure the device time recorded for its attempt; a run (or an
            # attempt) over the cap is a timeout, not a runtime charged the cap.
            cap = Settings.model_fields["max_measure_seconds"].default
            charge = recorded_charge(
                entry, MeasureRequest(kernel, workload, self.space.device, max_seconds=cap)
            )
            ok, times, gpu_seconds = charge.status == "ok", list(charge.times), charge.gpu_seconds
            status: str = charge.status
        else:
            status = "ok" if ok else str(getattr(entry, "status", "launch_error"))
        median = statistics.median(times) if ok and times else (entry.time_ms if ok else None)
        self._runtime[kernel.content_key()] = median
        self.history.add(
            (kernel.family_key(), self.space.device, workload.key()),
            # As the store keeps it (the launch shape is part of what the family model learns from).
            FamilyPoint(
                dict(kernel.defines),
                kernel.launch.model_dump() if kernel.launch is not None else None,
                status,
                median,
                kernel.content_key(),
                tuple(kernel.compile_options),
            ),
        )
        return {
            "kernel_id": kernel.id,
            "status": status,
            "runtime_ms": {"median": median} if ok else None,
            "cost": {"gpu_seconds": gpu_seconds, "cached": False},
        }

    async def _compare(self, args: dict[str, Any]) -> dict[str, Any]:
        from forecaster_mcp import bins
        from forecaster_mcp.forecast.acquisition import (
            AcqItem,
            against_best,
            rank_for_measurement,
            worth_measuring,
        )
        from forecaster_mcp.forecast.base import PairQuery
        from forecaster_mcp.forecast.selective import decide, p_fail_baseline_of, p_fail_of
        from forecaster_mcp.hardware.specs import lookup
        from forecaster_mcp.models import Kernel, Workload

        kernels = [Kernel.model_validate(k) for k in args["candidates"]]
        workload = Workload.model_validate(args.get("workload") or {})
        base_id = args.get("baseline") or kernels[0].id
        base = next(k for k in kernels if k.id == base_id)
        others = [k for k in kernels if k.id != base_id]
        hardware = str(args.get("hardware") or self.space.device)
        spec = lookup(hardware)
        queries = [PairQuery(base, k, workload, hardware, spec) for k in others]
        forecasts = await self.forecaster.forecast(queries)
        t_base = self._runtime.get(base.content_key())
        # As the server does: measurements are valued against the best of the family measured so far.
        fam = (others[0].family_key(), self.space.device, workload.key()) if others else None
        t_best = min(
            (
                p.runtime_ms
                for p in (await self.history.family_points(*fam) if fam else [])
                if p.status == "ok" and p.runtime_ms is not None and p.runtime_ms > 0
            ),
            default=None,
        )
        out: list[dict[str, Any]] = []
        items: list[AcqItem] = []
        for k, f in zip(others, forecasts, strict=True):
            t_cand = self._runtime.get(k.content_key())
            measured = t_base is not None and t_cand is not None and k.content_key() in self._runtime
            p = f.p_faster
            verdict = decide(p, self.threshold, p_fail_of(f.extras), p_fail_baseline_of(f.extras))
            decided_by = "cache" if measured else "forecast"
            out.append(
                {
                    "id": k.id,
                    "p_faster": p,
                    "speedup_bins": f.probs,
                    "expected_speedup": bins.expected_speedup(f.probs, f.centers),
                    "verdict": verdict,
                    "decided_by": decided_by,
                    "rationale": f.rationale,
                }
            )
            if decided_by != "forecast":
                continue
            same_family = k.family_key() == base.family_key()
            item = against_best(
                AcqItem(str(k.id), f.probs, f.extras, p, k.content_key() if same_family else None),
                t_base,
                t_best,
            )
            listed = (
                self.policy == "all"
                or (self.policy == "unsure" and verdict == "unsure")
                or (self.policy == "server" and worth_measuring(item, verdict))
            )
            if listed:
                items.append(item)
        ranking = sorted(out, key=lambda c: -float(c["expected_speedup"]))
        return {
            "baseline": base_id,
            "candidates": out,
            "ranking": [base_id, *[c["id"] for c in ranking]],
            "measure_next": rank_for_measurement(items),
        }


class DictHistory:
    """A FamilyHistory kept in a dict (latest measurement per content key), for tests and tuning."""

    def __init__(self) -> None:
        self._points: dict[tuple[str, str, str], dict[str, Any]] = {}

    def add(self, key: tuple[str, str, str], point: Any) -> None:
        points = self._points.setdefault(key, {})
        points.pop(point.content_key, None)  # oldest first, as the Store returns them
        points[point.content_key] = point

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[Any]:
        return list(self._points.get((family_key, hardware, workload_key), {}).values())


# ---------------------------------------------------------------- the CLI


def fraction_at(trace: SearchTrace, gpu_seconds: float) -> float:
    """The best-fraction `trace` had reached once it had spent at most `gpu_seconds` (0 before any)."""
    reached = 0.0
    for fraction, spent in zip(trace.per_step_best, trace.per_step_gpu_seconds, strict=True):
        if spent > gpu_seconds + 1e-9:
            break
        reached = fraction
    return reached


def at_equal_gpu_seconds(traces: Sequence[SearchTrace]) -> dict[str, Any] | None:
    """Both strategies at the same GPU budget: per seed, each one's best-fraction at the GPU-seconds the
    cheaper of the two runs spent (runs stop at a number of measurements, and the strategies' measurements
    need not cost the same). None unless both strategies ran on common seeds."""
    by = {(t.strategy, t.seed): t for t in traces}
    seeds = sorted({t.seed for t in traces if ("forecast", t.seed) in by and ("random", t.seed) in by})
    if not seeds:
        return None
    out: dict[str, Any] = {}
    budgets = [min(by[("forecast", s)].gpu_seconds, by[("random", s)].gpu_seconds) for s in seeds]
    for strategy in ("forecast", "random"):
        fr = [fraction_at(by[(strategy, s)], g) for s, g in zip(seeds, budgets, strict=True)]
        out[strategy] = {"fraction_median": statistics.median(fr), "fraction_min": min(fr)}
    out["gpu_seconds_mean"] = statistics.fmean(budgets)
    return out


def summarize(traces: Sequence[SearchTrace]) -> dict[str, Any]:
    """Median / min / max best-fraction and mean cost per strategy (and, when both ran, both at equal
    GPU-seconds under "at_equal_gpu_seconds")."""
    out: dict[str, Any] = {}
    for strategy in sorted({t.strategy for t in traces}):
        ts = [t for t in traces if t.strategy == strategy]
        fr = [t.fraction for t in ts]
        out[strategy] = {
            "runs": len(ts),
            "fraction_median": statistics.median(fr),
            "fraction_min": min(fr),
            "worst_seed": min(ts, key=lambda t: t.fraction).seed,
            "fraction_max": max(fr),
            "measurements_mean": statistics.fmean(t.measurements for t in ts),
            "candidates_considered_mean": statistics.fmean(t.candidates_considered for t in ts),
            "gpu_seconds_mean": statistics.fmean(t.gpu_seconds for t in ts),
            # Totals over the runs, not a mean of ratios: a run that cost nothing (every configuration it
            # measured failed) would make the mean infinite. None when no run cost anything.
            "candidates_per_gpu_second": (
                sum(t.candidates_considered for t in ts) / total_gs
                if (total_gs := sum(t.gpu_seconds for t in ts)) > 0
                else None
            ),
        }
    equal = at_equal_gpu_seconds(traces)
    if equal is not None:
        out["at_equal_gpu_seconds"] = equal
    return out


def _never_forecast(trace: SearchTrace) -> bool:
    """A forecast-guided run that never called compare_kernels: its budget, its --measurements or the space
    itself ended it within its random start, so it measured what the random run of its seed measured."""
    return trace.strategy == "forecast" and trace.forecast_calls == 0


def search_command(settings: Any, args: Any) -> int:
    """`forecaster-mcp search RECORDING`: run the strategies over seeds through a stdio server per run."""
    import os
    import signal
    import tempfile

    import anyio

    from forecaster_mcp.cli import check_writable_file, write_atomically
    from forecaster_mcp.errors import OperatorError
    from forecaster_mcp.measure.replay import load_space

    if args.measurements < 1 or args.seeds < 1:
        raise OperatorError(
            f"--measurements and --seeds must be at least 1 (got {args.measurements} and {args.seeds})"
        )
    from forecaster_mcp.forecast.evaluate import is_pairs_file

    if str(args.recording).endswith(".jsonl") and is_pairs_file(Path(args.recording)):
        raise OperatorError(
            f"{args.recording} is a pairs file (make-pairs writes them): `forecaster-mcp eval {args.recording}` "
            "scores the forecaster on it; a search needs a whole recorded space, a Kernel Tuner cache file (.json "
            "or .json.gz)"
        )
    if str(args.recording).endswith(".jsonl"):
        raise OperatorError(
            f"{args.recording} is a `forecaster-mcp export` file: it replays the kernels it holds (serve --replay), "
            "but a search needs a whole recorded space, a Kernel Tuner cache file (.json or .json.gz)"
        )
    try:
        space = load_space(args.recording)
    except ValueError as exc:
        raise OperatorError(f"{exc}; pass a Kernel Tuner cache file (.json or .json.gz)") from exc
    if space.best_time_ms is None:
        n = len(space.entries)
        what = (
            f"none of its {n} recorded configurations ran successfully"
            if n
            else "it records no configurations"
        )
        raise OperatorError(
            f"{args.recording}: {what}, so there is no best to search for: pass a recording with valid configurations"
        )
    if args.out is not None:
        check_writable_file(Path(args.out))  # before the runs: a bad --out must not lose their report
    if args.gpu_seconds is not None and not (math.isfinite(args.gpu_seconds) and args.gpu_seconds > 0):
        raise OperatorError(f"--gpu-seconds must be a positive number of GPU-seconds, got {args.gpu_seconds}")
    # The servers this command starts charge their default ledger: with --gpu-seconds each run's ledger holds
    # that much and a run ends when it refuses a measurement (both strategies spend the same budget); else it
    # is large enough for the runs, which end at --measurements (GPU-seconds are still reported per run).
    # Set, not defaulted: an operator's own default (600 in the README) would run out partway.
    ledger_seconds = "1000000000" if args.gpu_seconds is None else repr(float(args.gpu_seconds))
    # Claude (paid) only when asked for: an API key in the environment (Claude Code users have one) added it to
    # every compare of every run, billed, and said so only in the report.
    if args.claude and not settings.anthropic_api_key:
        raise OperatorError("--claude needs an Anthropic API key: set ANTHROPIC_API_KEY")
    forecasters = "local+claude" if args.claude else "local"
    # The runs' servers take none of this environment's settings (own_settings); the key only with --claude (an
    # empty ANTHROPIC_API_KEY is no key: the inherited one must not reach them either).
    key_env = {"ANTHROPIC_API_KEY": settings.anthropic_api_key or "" if args.claude else ""}
    del settings  # each run gets its own state directory; nothing else in the settings applies
    strategies = ["forecast", "random"] if args.strategy == "both" else [args.strategy]
    traces: list[SearchTrace] = []

    async def one(strategy: str, seed: int) -> SearchTrace:
        from forecaster_mcp.server.client import connect_stdio

        # A fresh state directory per run: the family model must not learn from another run's measurements.
        with tempfile.TemporaryDirectory(prefix="fmcp-search-") as home:
            # Its own ledger and recording only: a FORECASTER_MCP_LEDGER of this environment names a ledger the
            # fresh state directory lacks, and a FORECASTER_MCP_REPLAY would add recordings (and devices).
            async with connect_stdio(
                Path(home),
                replay=[Path(args.recording)],
                ledger="default",
                extra_env={
                    "FORECASTER_MCP_REPLAY": "",
                    "FORECASTER_MCP_MEASURER": "replay",
                    "FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS": ledger_seconds,
                    **key_env,
                },
                own_settings=True,
            ) as (_client, call):
                n, n_init = args.measurements, init_count(args.measurements)
                if strategy == "random":
                    return await until_budget_spent(random_search(call, space, n, seed))
                if args.client == "plain":
                    run = forecast_guided_search(call, space, n, seed, **{**PLAIN_CLIENT, "n_init": n_init})
                elif args.client == "unsure":
                    run = unsure_guided_search(call, space, n, seed, n_init=n_init)
                else:
                    run = forecast_guided_search(call, space, n, seed, n_init=n_init)
                return await until_budget_spent(run)

    terminated: list[bool] = []

    async def main() -> None:
        # SIGTERM (timeout, a CI cancel, kill) ends the runs as Ctrl-C does: the run in flight is cancelled, its
        # server closed and its throw-away state folder removed. Killed outright, the folder stayed in the temp
        # folder and the server, writing into the closed pipe, printed a traceback.
        async with anyio.create_task_group() as tg:

            async def on_sigterm() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        terminated.append(True)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(on_sigterm)
            await runs()
            tg.cancel_scope.cancel()

    async def runs() -> None:
        for seed in range(args.seeds):
            for strategy in strategies:
                t = await one(strategy, seed)
                traces.append(t)
                print(
                    f"{strategy:8s} seed {seed}: best {t.fraction:.3f} of the space's best after "
                    f"{t.measurements} measurements, {t.candidates_considered} candidates considered, "
                    f"{t.gpu_seconds:.3g} GPU-s"
                    + (
                        " (budget spent before the forecast was asked)"
                        if _never_forecast(t) and t.stopped_by_budget
                        else " (the forecast was never asked)"
                        if _never_forecast(t)
                        else " (budget spent)"
                        if t.stopped_by_budget
                        else ""
                    ),
                    file=sys.stderr,
                )

    try:
        anyio.run(main)
    except Exception as exc:
        from forecaster_mcp.server.client import tool_failure

        failed = tool_failure(exc)
        if failed is None:
            raise
        raise OperatorError(f"a search run stopped: the server answered {failed}") from exc
    if terminated:
        # Cleaned up: now end as the signal asked, so whoever sent it sees the process killed by it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM)  # should the signal reach another thread first
    if args.gpu_seconds is not None and all(t.measurements == 0 for t in traces):
        # Not a result: "best 0.000 ... (budget spent)" at 0 GPU-s, and a space line for 1 measurement.
        raise OperatorError(
            f"no run could make a single measurement within --gpu-seconds {args.gpu_seconds:g}: the ledger "
            "refused the first one (a measurement is held at up to its cap); raise --gpu-seconds"
        )
    guided = [t for t in traces if t.strategy == "forecast"]
    if guided and all(_never_forecast(t) for t in guided) and not any(t.stopped_by_budget for t in guided):
        # Not a comparison either: --measurements or the space ended every guided run in its random start, or
        # every configuration it measured failed (no baseline to forecast against: it kept sampling).
        n_init = init_count(args.measurements)
        n = len(space.entries)
        hint = ""
        if n <= n_init:
            why = (
                f"the space holds {n} configuration{'' if n == 1 else 's'}, all measured in the random start"
            )
        elif args.measurements <= n_init:
            why = f"with --measurements {args.measurements} the random start ({n_init}) is the whole run"
            hint = f"; raise --measurements (the random start is half of it, at most {N_INIT})"
        else:
            why = (
                "none of the configurations the forecast-guided runs measured ran ok (see each run's line; a "
                "recorded run over the server's time cap is a timeout), so there was no baseline to forecast against"
            )
        raise OperatorError(f"{why}: the forecast was never asked, so there is nothing to compare{hint}")
    if guided and all(_never_forecast(t) for t in guided):
        # Not a comparison: a guided run that never forecast measured its seed's random start, as random did.
        n_init = init_count(args.measurements)
        per = sum(t.gpu_seconds for t in guided) / max(1, sum(t.measurements for t in guided))
        raise OperatorError(
            f"no forecast-guided run got past its {n_init} random starting measurements within --gpu-seconds "
            f"{args.gpu_seconds:g} (about {per:.3g} GPU-s a measurement here): the forecast was never asked, so "
            "there is nothing to compare; raise --gpu-seconds, or lower --measurements (the random start is half "
            f"of it, at most {N_INIT})"
        )
    summary = summarize(traces)
    # What the numbers below were reached on, in the report itself (stdout is what gets kept or pasted).
    n_init = init_count(args.measurements)
    seeds = "0" if args.seeds == 1 else f"0-{args.seeds - 1}"
    ledger = ""
    if args.gpu_seconds is not None:
        ledger = f", a ledger of {args.gpu_seconds:g} GPU-s per run" + (
            ""
            if any(t.stopped_by_budget for t in traces)
            else " (no run spent it: each ended at --measurements)"
        )
    print(
        f"{args.recording}: {args.seeds} seed{'' if args.seeds == 1 else 's'} ({seeds}), "
        f"{args.measurements} measurements per run (the first {n_init} random){ledger}"
        + (f"; forecaster {forecasters}, client {args.client}" if "forecast" in strategies else "")
    )
    print(
        "(best-fraction: the space's best runtime over the best a run found; candidates considered: the distinct "
        "configurations a run forecast or measured)"
    )
    for strategy, s in summary.items():
        if strategy == "at_equal_gpu_seconds":
            continue
        rate = s["candidates_per_gpu_second"]
        print(
            f"{strategy:8s} best-fraction median {s['fraction_median']:.3f} min {s['fraction_min']:.3f} "
            f"(seed {s['worst_seed']}) over {s['runs']} seeds; {s['candidates_considered_mean']:.0f} candidates considered, "
            f"{s['gpu_seconds_mean']:.3g} GPU-s per run"
            + (f", {rate:.1f} candidates per GPU-second" if rate is not None else "")
        )
    equal = summary.get("at_equal_gpu_seconds")
    if equal is not None:
        print(
            f"at equal GPU-seconds (per seed, what the cheaper run spent; {equal['gpu_seconds_mean']:.3g} GPU-s "
            "on average): "
            + "; ".join(
                f"{k} median {equal[k]['fraction_median']:.3f} min {equal[k]['fraction_min']:.3f}"
                for k in ("forecast", "random")
            )
        )
    # On a GPU budget the runs made fewer measurements than --measurements: the random runs' count is the yardstick.
    made = [t.measurements for t in traces if t.strategy == "random"] or [t.measurements for t in traces]
    difficulty = space_difficulty(
        space, args.measurements if args.gpu_seconds is None else max(1, round(statistics.fmean(made)))
    )
    print(
        f"space: {difficulty.configurations} configurations, "
        + ", ".join(f"{difficulty.within[k]} within {k} of the best" for k in difficulty.within)
        + f"; random search with {difficulty.budget} measurements expects {difficulty.random_mean:.3f} "
        f"(median {difficulty.random_median:.3f}) and reaches "
        + ", ".join(f"{k} with chance {difficulty.random_hits[k]:.2f}" for k in difficulty.random_hits)
    )
    if args.out is not None:
        report = {
            "recording": str(args.recording),
            "forecasters": forecasters,
            "measurements": args.measurements,
            "gpu_seconds": args.gpu_seconds,
            "n_init": init_count(args.measurements),
            "seeds": args.seeds,
            "strategy": args.strategy,
            "client": args.client,
            "summary": summary,
            "space": asdict(difficulty),
            "runs": [asdict(t) for t in traces],
        }
        try:
            write_atomically(Path(args.out), json.dumps(report, indent=2, default=str, allow_nan=False))
        except OSError as exc:  # checked writable before the runs; the disk filled up or the folder changed
            raise OperatorError(f"cannot write --out {args.out}: {exc.strerror or exc}") from exc
    return 0
