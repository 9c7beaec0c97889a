"""compare_kernels as DESIGN.md "compare_kernels" defines its output, on forecasts the family model makes.

The other contract tests look at one pair or at measured pairs; here a dozen candidates of the A100 convolution
recording are forecast from a family model fitted on measurements of the same space, as in a tuning loop.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from replay_kernels import conv
from tool_calls import call, running

pytestmark = pytest.mark.anyio

# DESIGN.md: "Bins, symmetric in log2 S ... `(-inf,-2)`, `[-2,-1)`, ... `[2,inf)`" (S < 0.25, ..., S >= 4).
DESIGN_BINS = ["(-inf,-2)", "[-2,-1)", "[-1,-0.5)", "[-0.5,0)", "[0,0.5)", "[0.5,1)", "[1,2)", "[2,inf)"]


def _configurations(recording: Path, count: int) -> list[dict[str, Any]]:
    """`count` configurations of the recording that ran (a recorded time), spread over the space."""
    doc = json.loads(gzip.decompress(recording.read_bytes()))
    keys = doc["tune_params_keys"]
    ran = [{k: e[k] for k in keys} for e in doc["cache"].values() if isinstance(e.get("time"), int | float)]
    step = len(ran) // count
    return [ran[i * step] for i in range(count)]


async def test_forecast_fields_follow_the_contract(tmp_path: Path, conv_a100: Path) -> None:
    configs = _configurations(conv_a100, 20)
    async with running(tmp_path, [conv_a100]) as (client, _):
        for params in configs[:8]:
            await call(client, "measure_kernel", {"kernel": conv(None, params)})
        spent = (await call(client, "budget_status", {}))["spent_gpu_seconds"]
        candidates = [conv("base", configs[0])] + [conv(f"c{i}", p) for i, p in enumerate(configs[8:])]
        out = await call(client, "compare_kernels", {"candidates": candidates, "target_error": 0.3})

        assert out["bins"] == DESIGN_BINS
        assert out["baseline"] == "base"
        ids = [k["id"] for k in candidates]
        # One answer for each non-baseline candidate, in the order sent.
        assert [c["id"] for c in out["candidates"]] == ids[1:]
        forecasts = [c for c in out["candidates"] if c["decided_by"] == "forecast"]
        assert len(forecasts) == len(ids) - 1  # none of them measured: these are the family model's
        for c in out["candidates"]:
            assert len(c["speedup_bins"]) == 8 and sum(c["speedup_bins"]) == pytest.approx(1.0)
            # "p_faster = mass on S > 1": the last four bins, log2 S >= 0.
            assert c["p_faster"] == pytest.approx(sum(c["speedup_bins"][4:]), abs=1e-12)
            assert c["verdict"] in ("faster", "slower", "unsure")
            if c["verdict"] == "faster":
                assert c["p_faster"] > 0.5
            if c["verdict"] == "slower":
                assert c["p_faster"] < 0.5
            assert c["expected_speedup"] > 0 and c["rationale"] and "\n" not in c["rationale"]
        # A model fitted on 8 of its points tells these apart: not every forecast is the 50/50 prior.
        assert len({round(c["p_faster"], 6) for c in forecasts}) > 1
        # "ranking (ids, best first)": every id once, by expected speedup against the baseline (1 for itself).
        assert sorted(out["ranking"]) == sorted(ids)
        expected = {c["id"]: c["expected_speedup"] for c in out["candidates"]} | {"base": 1.0}
        ranked = [expected[i] for i in out["ranking"]]
        assert ranked == sorted(ranked, reverse=True)
        assert set(out["measure_next"]) <= set(ids) and len(set(out["measure_next"])) == len(
            out["measure_next"]
        )
        assert out["forecaster"]["name"] and out["forecaster"]["version"]
        # Forecasts are free: the call charged nothing, and the ledger says so.
        assert out["gpu_seconds_charged"] == 0 and out["measurements"] == []
        assert (await call(client, "budget_status", {}))["spent_gpu_seconds"] == spent


async def test_a_family_with_nothing_measured_is_said_to_have_none(tmp_path: Path, conv_a100: Path) -> None:
    # An agent's first call on a tuning space read "only 0 measurements of this family (need 4)".
    configs = _configurations(conv_a100, 3)
    async with running(tmp_path, [conv_a100]) as (client, _):
        out = await call(client, "compare_kernels", {"candidates": [conv(None, p) for p in configs]})
    for c in out["candidates"]:
        assert "no measurement of this family yet (need 4)" in c["rationale"], c["rationale"]
        assert "only 0" not in c["rationale"]


async def test_forecasts_made_before_this_calls_measurements_say_so(tmp_path: Path, conv_a100: Path) -> None:
    """measure_if_unsure measured part of the family and the ledger ran dry: the candidates left unmeasured keep
    forecasts made before those measurements (rationale "no measurement of this family yet"), and the answer
    says so and that asking again is free; the next call learns from them."""
    configs = _configurations(conv_a100, 10)
    candidates = [conv(f"k{i}", p) for i, p in enumerate(configs)]
    async with running(tmp_path, [conv_a100], ledger_seconds=0.35) as (client, _):
        out = await call(
            client,
            "compare_kernels",
            {"candidates": candidates, "measure_if_unsure": True, "max_measurements": 10},
        )
        measured = len(out["measurements"])
        left = [c["id"] for c in out["candidates"] if c["decided_by"] == "forecast"]
        assert measured >= 2 and left  # the budget stopped it part way
        note = next(n for n in out["notes"] if "made before this call's" in n)
        assert f"made before this call's {measured} measurements" in note
        assert left[0] in note and "again" in note and "free" in note
        again = await call(client, "compare_kernels", {"candidates": candidates})
    later = {c["id"]: c["rationale"] for c in again["candidates"]}
    assert not any("no measurement of this family yet" in later[i] for i in left)
