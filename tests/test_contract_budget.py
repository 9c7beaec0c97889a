"""budget_status scores the forecaster as DESIGN.md "Metrics" defines it: ties within noise are not scored."""

from __future__ import annotations

import json
import math
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from replay_kernels import FAST, SLOW, conv
from tool_calls import call, running

import forecaster_mcp
from forecaster_mcp import bins
from forecaster_mcp.forecast.base import BinForecast, PairQuery, PartialForecast, ScriptedForecaster
from forecaster_mcp.forecast.calibration import with_p_faster
from forecaster_mcp.forecast.selective import decision_p
from forecaster_mcp.models import Kernel, Workload
from forecaster_mcp.server.app import build_server
from forecaster_mcp.service import Service, build_measurers
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import Store

pytestmark = pytest.mark.anyio

# Two configurations of the A100 convolution recording whose runtimes differ by about 0.5% (a tie).
TIE_A = {**FAST, "tile_size_x": 2, "tile_size_y": 2, "use_shmem": 0}
TIE_B = {**TIE_A, "block_size_x": 48, "block_size_y": 1, "tile_size_y": 1, "read_only": 0}
FASTER = [0.0] * 7 + [1.0]  # every candidate forecast much faster than the baseline


async def _replay_service(home: Path, recording: Path, forecaster: Any) -> Service:
    """A service replaying `recording`, forecasting with `forecaster`, its ledger "team" holding 100 GPU-s."""
    settings = Settings.from_env(home=home, replay=[recording], measurer="replay", ledger="team")
    store = await Store.open(settings.db_path)
    measurers, notes = build_measurers(settings)
    service = Service(settings, store, [forecaster], measurers, notes)
    await store.create_ledger("team", 100)
    return service


async def test_budget_status_leaves_ties_within_noise_out_of_accuracy_and_brier(
    tmp_path: Path, conv_a100: Path
) -> None:
    service = await _replay_service(tmp_path, conv_a100, ScriptedForecaster(default=FASTER))
    try:
        async with Client(build_server(service)) as client:
            out = await call(
                client,
                "compare_kernels",
                {
                    "candidates": [
                        conv("a", TIE_A),
                        conv("tie", TIE_B),
                        conv("fast", FAST),
                        conv("slow", SLOW),
                    ]
                },
            )
            assert [c["verdict"] for c in out["candidates"]] == ["faster"] * 3
            t = {}
            for kid, params in (("a", TIE_A), ("tie", TIE_B), ("fast", FAST), ("slow", SLOW)):
                t[kid] = (await call(client, "measure_kernel", {"kernel": conv(kid, params)}))["runtime_ms"]
            assert abs(math.log2(t["a"]["median"] / t["tie"]["median"])) <= bins.TIE_LOG2
            status = await call(client, "budget_status", {})
    finally:
        await service.close()
    # Scored: fast (right) and slow (wrong); the tie is neither right nor wrong.
    forecasts = status["forecasts"]
    assert (forecasts["verified"], forecasts["verified_correct"]) == (2, 1)
    assert forecasts["accuracy"] == pytest.approx(0.5)
    calibration = status["calibration"]
    assert calibration["verified_pairs"] == 2
    p = out["candidates"][1]["p_faster"]
    assert calibration["brier"] == pytest.approx(((p - 1) ** 2 + p**2) / 2)


class _FailsOnPoison:
    """A forecaster that answers every pair but the one whose candidate is `poison` (as the local forecaster
    does when one kernel cannot be read): a PartialForecast."""

    name = "local"
    version = "test"

    async def forecast(self, queries: list[PairQuery]) -> list[BinForecast]:
        out: list[BinForecast | None] = [
            None if q.candidate.id == "poison" else BinForecast(list(FASTER), "scripted") for q in queries
        ]
        raise PartialForecast("failed on 1 pair", out)


async def test_a_pair_no_forecaster_answered_is_ranked_last_and_never_recorded(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Its even odds are not a forecast: recorded, it entered the calibration history and budget_status's
    Brier score as a forecast of p 0.5; ranked by them, it came first in measure_next."""
    service = await _replay_service(tmp_path, conv_a100, _FailsOnPoison())
    kernels = {"a": TIE_A, "poison": SLOW, "fast": FAST}
    try:
        async with Client(build_server(service)) as client:
            out = await call(
                client, "compare_kernels", {"candidates": [conv(k, p) for k, p in kernels.items()]}
            )
            poison = next(c for c in out["candidates"] if c["id"] == "poison")
            assert poison["verdict"] == "unsure" and "no forecaster answered" in poison["rationale"]
            assert out["measure_next"][-1] == "poison"
            for kid, params in kernels.items():
                await call(client, "measure_kernel", {"kernel": conv(kid, params)})
            status = await call(client, "budget_status", {})
    finally:
        await service.close()
    assert status["forecasts"]["count"] == 1
    assert status["calibration"]["verified_pairs"] == 1


async def test_the_same_capped_request_again_is_served_from_cache_free(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A replayed measurement stops before the run that would cross max_seconds, so a capped result costs a
    little under its cap, and the cache (which served a hit only when its cost reached the request's cap) charged
    the very same request again on every call: 20 concurrent copies of one request drained a 3 GPU-second
    ledger. A fresh run under limits no larger than the stored one's can be no more precise: it is served free.
    A larger cap still buys a new measurement."""
    service = await _replay_service(tmp_path, conv_a100, ScriptedForecaster(default=FASTER))
    try:
        async with Client(build_server(service)) as client:
            args = {"kernel": conv("s", SLOW), "max_seconds": 0.5}
            first = await call(client, "measure_kernel", args)
            assert "runs_capped_by_max_seconds" in first["flags"] and 0 < first["cost"]["gpu_seconds"] < 0.5
            assert (first["cost"]["max_seconds"], first["cost"]["max_runs"]) == (0.5, 1000)
            for smaller in (args, {**args, "max_seconds": 0.4}):
                again = await call(client, "measure_kernel", smaller)
                assert again["cost"]["cached"] and again["cost"]["gpu_seconds"] == 0.0
                assert again["runtime_ms"] == first["runtime_ms"]
            spent = (await call(client, "budget_status", {}))["spent_gpu_seconds"]
            assert spent == pytest.approx(first["cost"]["gpu_seconds"])
            more = await call(client, "measure_kernel", {**args, "max_seconds": 1.0})
            assert not more["cost"]["cached"] and more["runtime_ms"]["runs"] > first["runtime_ms"]["runs"]
    finally:
        await service.close()


async def test_confidence_and_ranking_count_the_chance_of_failing(tmp_path: Path) -> None:
    """A verdict decided by a kernel's chance of failing reports the confidence it was decided at, and a
    kernel that likely fails ranks below those that likely run. The baseline here likely fails: "faster" for a
    candidate whose runtime forecast says slower (p_faster 0.07) came with confidence 0.93 (the other side's),
    and the ranking put the failing baseline above it."""
    settings = Settings.from_env(home=tmp_path, measurer="none")
    store = await Store.open(settings.db_path)
    scripted = ScriptedForecaster()
    slower = with_p_faster(bins.from_normal(-1.0, 0.5), 0.07)
    scripted.enqueue(BinForecast(slower, "runs; the baseline likely fails", extras={"p_fail_baseline": 0.97}))
    scripted.enqueue(BinForecast(slower, "also runs", extras={"p_fail_baseline": 0.97}))
    service = Service(settings, store, [scripted], [])
    source = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }\n"
    kernels = [Kernel(id=f"b{b}", source=source, entry="k", defines={"B": b}) for b in (64, 128, 256)]
    try:
        out = await service.compare(
            ledger=None, candidates=kernels, workload=Workload(), baseline=None, hardware="A100",
            target_error=None, measure_if_unsure=False, max_measurements=0,
        )  # fmt: skip
    finally:
        await service.close()
    for c in out.candidates:
        assert c.verdict == "faster" and c.p_faster == pytest.approx(0.07, abs=1e-6)
        assert c.confidence == pytest.approx(decision_p(0.07, 0.0, 0.97)) and c.confidence >= 0.95
    assert out.ranking[-1] == "b64"  # the baseline, which likely fails, last


async def test_measure_if_unsure_on_a_server_without_a_gpu_does_not_send_the_agent_to_measure_kernel(
    tmp_path: Path,
) -> None:
    """A server that cannot measure (an IDE on a laptop, no GPU, no recording), every verdict decided: the
    note of measure_if_unsure told the agent to "measure that id with measure_kernel", which this server then
    refuses. It now says measure_next's head is worth a measurement, but not here, and why."""
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="team")
    store = await Store.open(settings.db_path)
    service = Service(settings, store, [ScriptedForecaster(default=FASTER)], [])
    source = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }\n"
    kernels = [{"id": f"b{b}", "source": source, "entry": "k", "defines": {"B": b}} for b in (64, 128)]
    try:
        await store.create_ledger("team", 100)
        async with Client(build_server(service)) as client:
            out = await call(
                client,
                "compare_kernels",
                {"candidates": kernels, "hardware": "H100", "measure_if_unsure": True},
            )
            refused = await client.call_tool("measure_kernel", {"kernel": kernels[0]})
    finally:
        await service.close()
    assert [c["verdict"] for c in out["candidates"]] == ["faster"] and out["measure_next"][0] == "b64"
    (note,) = [n for n in out["notes"] if n.startswith("measure_if_unsure measured nothing")]
    assert "measure that id with measure_kernel" not in note
    assert "not on this server: this server cannot measure" in note
    assert refused.is_error and "this server cannot measure" in str(refused.content)


def test_a_replay_server_without_a_gpu_says_it_measures_by_replay(tmp_path: Path, conv_a100: Path) -> None:
    # budget_status shows these notes: a replay server's read "no local GPU measurement: pycuda is not installed
    # (pip install ...)" alone, and an agent told its user to install pycuda on a server measuring fine.
    settings = Settings.from_env(home=tmp_path, replay=[conv_a100], measurer="auto")
    measurers, notes = build_measurers(settings)
    assert measurers  # the replay recording measures here
    gpu_notes = [n for n in notes if "GPU" in n]
    assert gpu_notes, notes
    assert all(n.startswith("measurements replay the recordings given with --replay") for n in gpu_notes), (
        notes
    )


async def test_budget_status_description_names_what_it_answers_and_no_internal_names(
    tmp_path: Path, conv_a100: Path
) -> None:
    """An agent picks a tool by its description. budget_status's said GPU-seconds, measurements, forecasts and
    savings, not that it also answers Claude's tokens and dollar cost (`llm`), what an agent whose forecasts use
    Claude asks for; and the published Brier score was explained by an internal function's name
    (selective.decision_p), which no client can look up."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        tools = {t.name: t for t in (await client.list_tools()).tools}
    description = tools["budget_status"].description or ""
    for part in (
        "remaining_gpu_seconds",
        "spent_gpu_seconds",
        "gpu_seconds_saved",
        "llm",
        "cost_usd",
        "calibration",
    ):
        assert part in description, part
    published = json.dumps([t.model_dump() for t in tools.values()])
    modules = {
        m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(forecaster_mcp.__path__, "forecaster_mcp.")
    }
    named = {m for m in re.findall(r"\b([a-z_]+)\.[a-z_]+\b", published) if m in modules}
    assert not named, named
