"""The three tools through the in-memory MCP client, against a real SQLite store and a replay recording."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from replay_kernels import FAILS, FAST, SLOW, conv
from state_files import damage_table
from tool_calls import call, error_of, running

from forecaster_mcp.forecast.local import VERSION as LOCAL_VERSION
from forecaster_mcp.forecast.ptxas import find_nvcc
from forecaster_mcp.forecast.selective import MAX_TARGET_ERROR, MIN_TARGET_ERROR
from forecaster_mcp.models import MAX_DEFINES, MAX_SOURCE_BYTES, MIN_MEASURE_SECONDS, Kernel
from forecaster_mcp.server.app import build_server
from forecaster_mcp.service import Service, _from_measurement
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import Store

LOCAL = f"local@{LOCAL_VERSION}"  # the local forecaster's name in stored rows (engine module doc)

pytestmark = pytest.mark.anyio


async def test_tools_listed_with_annotations_and_flat_params(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"compare_kernels", "measure_kernel", "budget_status"}
        assert tools["budget_status"].annotations is not None
        assert tools["budget_status"].annotations.read_only_hint is True
        assert tools["measure_kernel"].annotations is not None
        assert tools["measure_kernel"].annotations.read_only_hint is False
        props = tools["compare_kernels"].input_schema["properties"]
        for name in ("candidates", "workload", "baseline", "hardware", "target_error", "measure_if_unsure"):
            assert name in props
        assert tools["compare_kernels"].output_schema is not None
        for name in (
            "kernel",
            "workload",
            "reference",
            "atol",
            "rtol",
            "max_seconds",
            "max_runs",
            "idempotency_key",
        ):
            assert name in tools["measure_kernel"].input_schema["properties"]
        # Unknown argument names are refused at call time; the published schemas say so.
        for tool in tools.values():
            assert tool.input_schema.get("additionalProperties") is False, tool.name


async def test_published_schemas_carry_the_bounds_the_server_enforces(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A client that validates against the schema must not send what the server then refuses."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        compare = tools["compare_kernels"].input_schema["properties"]
        measure = tools["measure_kernel"].input_schema["properties"]
        assert compare["target_error"]["minimum"] == MIN_TARGET_ERROR
        assert compare["target_error"]["exclusiveMaximum"] == MAX_TARGET_ERROR
        assert (compare["max_measurements"]["minimum"], compare["max_measurements"]["maximum"]) == (0, 64)
        assert measure["atol"]["minimum"] == measure["rtol"]["minimum"] == 0
        assert measure["max_seconds"]["minimum"] == MIN_MEASURE_SECONDS
        assert measure["max_runs"]["minimum"] == 1
        kernel = tools["measure_kernel"].input_schema["$defs"]["Kernel"]["properties"]
        assert kernel["source"]["maxLength"] == MAX_SOURCE_BYTES
        assert kernel["entry"]["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"
        assert kernel["defines"]["maxProperties"] == MAX_DEFINES
        # Just past each published bound: the server's own clear error, and nothing charged.
        pair = [conv("a", FAST), conv("b", SLOW)]
        past = [
            ("compare_kernels", {"candidates": pair, "target_error": MAX_TARGET_ERROR}, "target_error"),
            ("compare_kernels", {"candidates": pair, "target_error": MIN_TARGET_ERROR / 2}, "target_error"),
            ("measure_kernel", {"kernel": conv("a", FAST), "atol": -1e-9}, "atol"),
            (
                "measure_kernel",
                {"kernel": conv("a", FAST), "max_seconds": MIN_MEASURE_SECONDS / 2},
                "max_seconds",
            ),
            ("measure_kernel", {"kernel": conv("a", FAST), "max_runs": 0}, "max_runs"),
        ]
        for tool, args, name in past:
            assert name in await error_of(client, tool, args), (tool, args)
        assert (await call(client, "budget_status", {}))["spent_gpu_seconds"] == 0


async def test_max_measurements_without_measure_if_unsure_says_it_measured_nothing(
    tmp_path: Path, conv_a100: Path
) -> None:
    """max_measurements caps measure_if_unsure, which is false unless sent: an agent that sent only
    `max_measurements: 3` expected three measurements and got none, and the answer did not say why (an argument
    ignored in silence, as a misspelt one was before it was refused)."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        pair = [conv("a", FAST), conv("b", SLOW)]
        out = await call(client, "compare_kernels", {"candidates": pair, "max_measurements": 3})
        assert out["measurements"] == [] and out["gpu_seconds_charged"] == 0
        (note,) = [n for n in out["notes"] if "max_measurements" in n]
        assert "measure_if_unsure" in note and "nothing was measured" in note
        out = await call(client, "compare_kernels", {"candidates": pair})
        assert not [n for n in out["notes"] if "max_measurements" in n]
        assert (await call(client, "budget_status", {}))["spent_gpu_seconds"] == 0


async def test_max_measurements_with_measure_if_unsure_false_gets_no_note(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A client that sends measure_if_unsure: false itself (every argument written out, defaults included) asked
    for no measurement, and so did one sending max_measurements: 0: neither is told to pass measure_if_unsure=true
    (a nudge to spend budget it had declined)."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        pair = [conv("a", FAST), conv("b", SLOW)]
        for args in ({"measure_if_unsure": False, "max_measurements": 4}, {"max_measurements": 0}):
            out = await call(client, "compare_kernels", {"candidates": pair, **args})
            assert out["measurements"] == []
            assert not [n for n in out["notes"] if "max_measurements" in n], args


async def test_compare_fills_every_contract_field(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        out = await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("b", SLOW)]})
        assert out["baseline"] == "a"
        assert out["hardware"]  # defaults to the measurement device
        (cand,) = out["candidates"]
        for field in ("p_faster", "speedup_bins", "expected_speedup", "verdict", "decided_by", "rationale"):
            assert field in cand
        assert len(cand["speedup_bins"]) == 8
        assert abs(sum(cand["speedup_bins"]) - 1) < 1e-6
        assert cand["verdict"] in ("faster", "slower", "unsure")
        assert set(out["ranking"]) == {"a", "b"}
        assert out["forecaster"]["name"]
        assert out["gpu_seconds_charged"] == 0


async def test_measure_charges_recorded_time_and_cache_is_free(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        first = await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        assert first["status"] == "ok"
        assert first["runtime_ms"]["runs"] == 32
        assert 0.5 < first["runtime_ms"]["median"] < 0.7
        charged = first["cost"]["gpu_seconds"]
        assert charged > 0 and not first["cost"]["cached"]
        again = await call(client, "measure_kernel", {"kernel": conv("a2", FAST)})
        assert again["cost"]["cached"] is True and again["cost"]["gpu_seconds"] == 0
        status = await call(client, "budget_status", {})
        assert status["spent_gpu_seconds"] == pytest.approx(charged, abs=1e-6)
        assert status["remaining_gpu_seconds"] == pytest.approx(100 - charged, abs=1e-6)
        assert status["measurements"]["cache_hits"] == 1


async def test_recorded_failure_is_a_result(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        out = await call(client, "measure_kernel", {"kernel": conv("x", FAILS)})
        assert out["status"] == "launch_error"
        assert out["runtime_ms"] is None


async def test_idempotency_key_never_charges_twice(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        args = {"kernel": conv("s", SLOW), "idempotency_key": "run-1/step-7"}
        first = await call(client, "measure_kernel", args)
        second = await call(client, "measure_kernel", args)
        assert second["runtime_ms"] == first["runtime_ms"]
        assert second["cost"]["gpu_seconds"] == 0
        status = await call(client, "budget_status", {})
        assert status["spent_gpu_seconds"] == pytest.approx(first["cost"]["gpu_seconds"], abs=1e-6)


async def test_measured_pairs_answer_from_measurements(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        await call(client, "measure_kernel", {"kernel": conv("b", SLOW)})
        out = await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("b", SLOW)]})
        (cand,) = out["candidates"]
        assert cand["decided_by"] == "cache"
        assert cand["verdict"] == "slower"
        assert cand["expected_speedup"] < 0.1  # 0.55 ms vs 32 ms
        assert out["ranking"] == ["a", "b"]


def test_a_measured_rationale_writes_an_extreme_speedup_in_significant_digits() -> None:
    """Measured at 1e-3 ms against 20 ms (and the mirror), the rationale said 'speedup 20000.000x' and
    'speedup 0.000x' beside a measured_speedup of 2e4 and 5e-05; an ordinary one keeps its three decimals."""
    base, fast = (20.0, 19.9, 20.1, 100), (1e-3, 0.99e-3, 1.01e-3, 100)
    up, down = _from_measurement("c", base, fast, "cache"), _from_measurement("c", fast, base, "cache")
    assert "(speedup 2e+04x)" in up.rationale and "(speedup 5e-05x)" in down.rationale
    assert up.measured_speedup == pytest.approx(2e4) and down.measured_speedup == pytest.approx(5e-5)
    ordinary = _from_measurement("c", (0.55, 0.54, 0.56, 100), (32.0, 31.9, 32.1, 100), "cache")
    assert "(speedup 0.017x)" in ordinary.rationale


async def test_a_candidate_measured_failing_ranks_below_one_that_runs(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A candidate that failed when measured does not run: it ranks last, below a measured kernel 57x slower
    than the baseline. Its expected_speedup (the extreme bin's 0.18x) ranked it above that one (0.018x), both
    when measure_if_unsure measured it and when the next call answered from the store."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        args = {"candidates": [conv("a", FAST), conv("b", SLOW), conv("c", FAILS)]}
        out = await call(client, "compare_kernels", {**args, "measure_if_unsure": True})
        assert [m["status"] for m in out["measurements"]] == ["ok", "ok", "launch_error"]
        assert out["ranking"] == ["a", "b", "c"]
        again = await call(client, "compare_kernels", args)
        assert {c["id"]: c["decided_by"] for c in again["candidates"]} == {"b": "cache", "c": "cache"}
        assert again["ranking"] == ["a", "b", "c"]


async def test_candidates_measured_against_a_failed_baseline_rank_by_their_runtimes(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Against a baseline measured failing no speedup is defined: every candidate that ran gets the extreme
    bin (expected_speedup 5.66). The ranking then followed the order they were sent in, and put a kernel
    measured at 31 ms first, ahead of one measured at 0.55 ms."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        for kernel in (conv("fast", FAST), conv("slow", SLOW), conv("fails", FAILS)):
            await call(client, "measure_kernel", {"kernel": kernel})
        out = await call(
            client,
            "compare_kernels",
            {"candidates": [conv("fails", FAILS), conv("slow", SLOW), conv("fast", FAST)]},
        )
        assert {c["id"]: c["verdict"] for c in out["candidates"]} == {"slow": "faster", "fast": "faster"}
        assert out["ranking"] == ["fast", "slow", "fails"]


async def test_a_baseline_measured_failing_by_measure_if_unsure_is_noted_as_what_happened(
    tmp_path: Path, conv_a100: Path
) -> None:
    """measure_if_unsure measured a baseline that fails (launch_error): the candidates measured before came back
    'faster', decided by measurement, and measure_next listed another, while the note said 'no measurement
    settles a pair against it'. It now says what decides them and that measure_if_unsure measures no more."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        for kernel in (conv("fast", FAST), conv("slow", SLOW)):
            await call(client, "measure_kernel", {"kernel": kernel})
        mid = conv("mid", {**FAST, "block_size_x": 16})
        args = {"candidates": [conv("fails", FAILS), conv("slow", SLOW), conv("fast", FAST), mid]}
        for measure in (True, False):  # measured in this call, then answered from the store
            out = await call(client, "compare_kernels", {**args, "measure_if_unsure": measure})
            assert [m["kernel_id"] for m in out["measurements"]] == (["fails"] if measure else [])
            decided = {c["id"]: (c["verdict"], c["decided_by"]) for c in out["candidates"]}
            by = "measurement" if measure else "cache"
            assert decided["fast"] == decided["slow"] == ("faster", by)
            assert out["measure_next"] == ["mid"]
            (note,) = [n for n in out["notes"] if "the baseline fails was measured launch_error" in n]
            assert "no measurement settles" not in note
            assert "decided only by its own measurement (one that runs is faster" in note
            assert "measure_if_unsure measures none against it" in note


async def test_measure_if_unsure_measures_and_charges(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        near = {**FAST, "block_size_x": 48}
        out = await call(
            client,
            "compare_kernels",
            {
                "candidates": [conv("a", FAST), conv("b", near)],
                "measure_if_unsure": True,
                "max_measurements": 2,
            },
        )
        (cand,) = out["candidates"]
        nothing = any("measure_if_unsure measured nothing" in n for n in out["notes"])
        if cand["decided_by"] == "forecast":
            assert cand["verdict"] != "unsure"  # decided without measuring
            assert out["gpu_seconds_charged"] == 0 and nothing
        else:
            assert not nothing
            assert cand["decided_by"] == "measurement"
            assert out["gpu_seconds_charged"] > 0
            status = await call(client, "budget_status", {})
            assert status["spent_gpu_seconds"] == pytest.approx(out["gpu_seconds_charged"], abs=1e-6)


async def test_forgiving_gpu_names_and_unknown_gpu_note(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        pair = [conv("a", FAST), conv("b", SLOW)]
        for name in ("A100", "NVIDIA A100-PCIE-40GB", "a100 pcie 40gb"):
            out = await call(client, "compare_kernels", {"candidates": pair, "hardware": name})
            assert out["hardware_known"] is True, name
        out = await call(client, "compare_kernels", {"candidates": pair, "hardware": "Imaginary GPU 9000"})
        assert out["hardware_known"] is False
        assert any("hardware-specific" in n for n in out["notes"])
        assert len(out["candidates"]) == 1
        # A typo is answered with the GPUs it may mean, aliases included (H10 is not far from H100).
        out = await call(client, "compare_kernels", {"candidates": pair, "hardware": "H10"})
        assert any("did you mean H100-SXM5-80GB" in n for n in out["notes"])


async def _unchanged(client: Client, spent: float) -> None:
    status = await call(client, "budget_status", {})
    assert status["spent_gpu_seconds"] == pytest.approx(spent, abs=1e-9)
    assert status["reserved_gpu_seconds"] == 0


async def test_bad_input_is_a_clear_error_and_charges_nothing(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, service):
        a, b = conv("a", FAST), conv("b", SLOW)
        msg = await error_of(client, "compare_kernels", {"candidates": [a, b], "baseline": "zzz"})
        assert "zzz" in msg and "a, b" in msg
        msg = await error_of(client, "compare_kernels", {"candidates": [a, {**b, "id": "a"}]})
        assert "twice" in msg
        msg = await error_of(client, "compare_kernels", {"candidates": [a], "baseline": "b"})
        assert "2 to 64" in msg and "the baseline is one of the candidates" in msg
        many = [conv(f"c{i}", FAST) for i in range(65)]
        msg = await error_of(client, "compare_kernels", {"candidates": many})
        assert "2 to 64" in msg
        msg = await error_of(client, "measure_kernel", {"kernel": {**a, "source": "   "}})
        assert "source is empty" in msg
        msg = await error_of(client, "measure_kernel", {"kernel": {**a, "source": "x" * 1_000_001}})
        assert "limit" in msg
        bad_dtype = {"args": [{"name": "x", "dtype": "float7", "shape": [4]}]}
        msg = await error_of(client, "measure_kernel", {"kernel": a, "workload": bad_dtype})
        assert "float7" in msg or "dtype" in msg
        zero_launch = {**a, "launch": {"grid": [0, 1, 1], "block": [128, 1, 1]}}
        msg = await error_of(client, "measure_kernel", {"kernel": zero_launch})
        assert "positive" in msg
        msg = await error_of(client, "measure_kernel", {"kernel": a, "hardware": "H100"})
        assert "can measure on" in msg
        msg = await error_of(client, "budget_status", {"ledger": "someone-else"})
        assert "bound to ledger 'team'" in msg
        unknown = {**a, "entry": "not_recorded"}
        msg = await error_of(client, "measure_kernel", {"kernel": unknown})
        assert "convolution_kernel" in msg
        await _unchanged(client, 0.0)
        assert await service.store.idempotent_request("team", "nope") is None


async def test_a_misspelt_field_is_one_line_naming_the_field_meant(tmp_path: Path, conv_a100: Path) -> None:
    # pydantic's frame came with it: "1 validation error for measure_kernelArguments" before the summary and
    # "[type=invalid_arguments, input_value='(above)', input_type=str]" after, on three lines.
    async with running(tmp_path, [conv_a100]) as (client, _service):
        typo = {**conv("a", FAST), "entyr": "convolution_kernel"}
        msg = await error_of(client, "measure_kernel", {"kernel": typo})
        assert "\n" not in msg
        assert "kernel.entyr: Extra inputs are not permitted (did you mean 'entry'?)" in msg
        assert "validation error for" not in msg and "input_value" not in msg
        assert "nothing was run or charged" in msg


async def test_an_argument_with_neither_shape_nor_value_is_told_what_to_send(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A workload argument with neither shape nor value (a scalar sent without its value) was refused as
    'workload.args[1].buffer.shape: Field required': nothing said that a scalar takes a value. Several problems
    come one to a line, a validator's message without pydantic's 'Value error, ' before it."""
    async with running(tmp_path, [conv_a100]) as (client, _service):
        pair = [conv("a", FAST), conv("b", SLOW)]
        x = {"name": "x", "dtype": "float32", "shape": [4]}
        n = {"name": "n", "dtype": "int32"}
        msg = await error_of(client, "compare_kernels", {"candidates": pair, "workload": {"args": [x, n]}})
        assert "\n" not in msg and "Field required" not in msg
        assert (
            "workload.args[1]: has neither shape nor value: send shape and dtype for an array (a buffer), "
            "value and dtype for a scalar; got {'name': 'n', 'dtype': 'int32'}" in msg
        )
        bad = {"args": [{**x, "shape": [-1]}, n]}
        msg = await error_of(
            client, "measure_kernel", {"kernel": {**pair[0], "entry": 3}, "workload": bad, "max_runs": "x"}
        )
        head, *lines = msg.split("\n")
        assert "do not fit the tool" in head and len(lines) == 4
        assert lines[0].startswith("- kernel.entry: Input should be a valid string")
        assert (
            lines[1]
            == "- workload.args[0].buffer.shape: buffer shape [-1] has a non-positive dimension; got [-1]"
        )
        assert lines[2].startswith("- workload.args[1]: has neither shape nor value: send shape and dtype")
        assert lines[3].startswith("- max_runs: Input should be a valid integer")
        # Sent as a scalar, the argument is taken.
        out = await call(
            client, "compare_kernels", {"candidates": pair, "workload": {"args": [x, {**n, "value": 4}]}}
        )
        assert len(out["candidates"]) == 1
        await _unchanged(client, 0.0)


async def test_one_mistake_over_many_candidates_is_one_short_line(tmp_path: Path, conv_a100: Path) -> None:
    # pydantic's text echoed every error of every item (a null define fails each branch of int | float | str):
    # 64 candidates made 40 KB, an agent's context spent on one mistake.
    async with running(tmp_path, [conv_a100]) as (client, _service):
        many = [conv(f"c{i}", FAST) for i in range(64)]
        nulls = [{**k, "defines": {**k["defines"], "use_padding": None}} for k in many]
        msg = await error_of(client, "compare_kernels", {"candidates": nulls})
        assert len(msg) < 1000 and "errors.pydantic.dev" not in msg
        assert (
            "candidates[*].defines.use_padding: should be int or float or str; got None (64 items: [0], [1]"
            in msg
        )
        assert "nothing was run or charged" in msg
        extra = [{**k, "name": "x"} for k in many[:2]] + many[2:]
        msg = await error_of(client, "compare_kernels", {"candidates": extra})
        assert "candidates[*].name: Extra inputs are not permitted; got 'x' (2 items: [0], [1])" in msg
        # One item is named by its index; two fields of one kernel are two lines (not read as a union).
        msg = await error_of(
            client, "compare_kernels", {"candidates": [*many[:3], {**many[3], "source": None}]}
        )
        assert "candidates[3].source: Input should be a valid string; got None" in msg
        msg = await error_of(client, "measure_kernel", {"kernel": {"source": None, "entry": None}})
        assert "kernel.source: Input should be a valid string" in msg and "kernel.entry: Input should" in msg
        # A validator's own message comes through whole.
        msg = await error_of(client, "measure_kernel", {"kernel": {**many[0], "source": "   "}})
        assert "source is empty" in msg
        await _unchanged(client, 0.0)


async def test_exhausted_ledger_refuses_and_names_what_is_left(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100], ledger_seconds=0.001) as (client, _):
        msg = await error_of(client, "measure_kernel", {"kernel": conv("s", SLOW)})
        assert "left" in msg and "free" in msg
        await _unchanged(client, 0.0)


async def test_unknown_ledger_tells_the_operator_command(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100], ledger_seconds=None) as (client, _):
        msg = await error_of(client, "measure_kernel", {"kernel": conv("s", SLOW)})
        assert "ledger create team" in msg


async def test_no_measurer_says_forecasts_are_free(tmp_path: Path) -> None:
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="default")
    service = await Service.open(settings)
    try:
        async with Client(build_server(service)) as client:
            msg = await error_of(client, "measure_kernel", {"kernel": conv("a", FAST)})
            assert "cannot measure" in msg and "free" in msg
            out = await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("b", SLOW)]})
            assert out["hardware"] == "unknown"
    finally:
        await service.close()


async def test_resource_lists_gpu_specs_and_prompt_teaches_workflow(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _):
        resources = (await client.list_resources()).resources
        assert any(str(r.uri) == "forecaster://gpu-specs" for r in resources)
        content = (await client.read_resource("forecaster://gpu-specs")).contents[0]
        rows = json.loads(getattr(content, "text", "[]"))
        names = {r["name"] for r in rows}
        assert any("H100" in n for n in names) and any("A100" in n for n in names)
        by_name = {r["name"]: r for r in rows}
        assert by_name["H100-SXM5-80GB"]["tensor_cores"] and by_name["H100-SXM5-80GB"]["fp64_ratio"] == 2
        assert not by_name["MI50"]["tensor_cores"] and by_name["RTX 4090"]["fp64_ratio"] == 64
        prompts = (await client.list_prompts()).prompts
        assert [p.name for p in prompts] == ["forecast_first"]
        text = (await client.get_prompt("forecast_first")).messages[0].content
        assert "measure_next" in getattr(text, "text", "")


async def test_static_prior_forecasts_are_stored_and_thresholded_apart(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Before a family has measurements its forecasts come from the static prior: they are stored under
    their own names (their own calibration and threshold history) and still count in budget_status."""
    async with running(tmp_path, [conv_a100]) as (client, service):
        out = await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("b", SLOW)]})
        assert any("(static prior)" in n and n.startswith("verdicts decided at") for n in out["notes"])
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        await call(client, "measure_kernel", {"kernel": conv("b", SLOW)})
        verified = await service.store.verified_pairs()
        assert sorted(v.forecaster for v in verified) == [f"{LOCAL}:prior", f"raw:{LOCAL}:prior"]
        # The final row keeps the chances of failing its verdict weighed, to be scored again out of fold.
        final, raw = sorted(verified, key=lambda v: v.forecaster.startswith("raw:"))
        assert final.p_fail is not None and final.p_fail_baseline is not None and raw.p_fail is None
        status = await call(client, "budget_status", {})
        assert status["calibration"]["verified_pairs"] == 1


async def test_a_pair_measured_under_other_spellings_is_answered_from_the_store_not_stored_as_a_forecast(
    tmp_path: Path, conv_a100: Path
) -> None:
    """The local model knows block_size_x "0x20" is the 32 it measured: its answer is two measurements, so it
    says so (decided_by cache, the measured speedup) and is not stored as a forecast, which later verified
    near-certain and right and inflated the history thresholds are certified on."""
    async with running(tmp_path, [conv_a100]) as (client, service):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        await call(client, "measure_kernel", {"kernel": conv("b", SLOW)})
        spelled = conv("a2", {**FAST, "block_size_x": "0x20"})
        out = await call(client, "compare_kernels", {"candidates": [spelled, conv("b", SLOW)]})
        [slow] = out["candidates"]
        assert slow["verdict"] == "slower" and slow["decided_by"] == "cache", slow
        assert 0.01 < slow["measured_speedup"] < 0.03  # 0.55 ms against 31 ms
        assert out["measure_next"] == []
        status = await call(client, "budget_status", {})
        assert status["forecasts"]["count"] == 0
    with sqlite3.connect(service.settings.db_path) as db:  # nor any component's row
        assert db.execute("SELECT count(*) FROM forecasts").fetchone() == (0,)


async def test_a_forecast_whose_candidate_then_fails_is_verified_by_that_failure(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A candidate forecast and then measured failing (here a launch error) checks the forecast: the baseline
    was the better choice. Until stop 29 such pairs never verified, and a "faster" verdict on a kernel that
    did not even run was never counted against the threshold."""
    async with running(tmp_path, [conv_a100]) as (client, service):
        await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("f", FAILS)]})
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        failed = await call(client, "measure_kernel", {"kernel": conv("f", FAILS)})
        assert failed["status"] == "launch_error"
        verified = await service.store.verified_pairs()
        assert sorted(v.forecaster for v in verified) == [f"{LOCAL}:prior", f"raw:{LOCAL}:prior"]
        assert {v.failure for v in verified} == {"candidate"}
        status = await call(client, "budget_status", {})
        assert status["calibration"]["verified_pairs"] == 1  # (this verdict was unsure: none decided)


async def test_pairs_of_two_unmeasured_kernels_are_stored_and_thresholded_apart(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Once the family model answers, a pair of which neither kernel is measured is a forecast of two
    predictions: stored under its own names (own calibration and threshold history), said in the notes."""
    async with running(tmp_path, [conv_a100]) as (client, service):
        for bx, by in ((16, 2), (32, 8), (64, 4), (128, 1), (48, 2)):
            await call(
                client,
                "measure_kernel",
                {"kernel": conv(None, {**FAST, "block_size_x": bx, "block_size_y": by})},
            )
        a, b = (
            conv("a", {**FAST, "block_size_x": 32, "block_size_y": 2}),
            conv("b", {**FAST, "block_size_x": 96}),
        )
        measured = conv("m", {**FAST, "block_size_x": 64, "block_size_y": 4})
        out = await call(client, "compare_kernels", {"candidates": [a, b]})
        notes = [n for n in out["notes"] if n.startswith("verdicts decided at")]
        assert len(notes) == 1 and "(neither kernel measured)" in notes[0]
        out = await call(client, "compare_kernels", {"candidates": [measured, a, b]})
        notes = [n for n in out["notes"] if n.startswith("verdicts decided at")]
        assert len(notes) == 1 and "neither kernel measured" not in notes[0]
        await call(client, "measure_kernel", {"kernel": a})
        await call(client, "measure_kernel", {"kernel": b})
        verified = await service.store.verified_pairs()
        # Every row remembers the candidates' kernel family (a family's own history sets its threshold).
        assert {v.family_key for v in verified} == {Kernel.model_validate(a).family_key()}
        names = sorted(v.forecaster for v in verified)
        # a vs b (both predicted then), and a, b against the measured baseline.
        assert names == [
            LOCAL,
            LOCAL,
            f"{LOCAL}:unmeasured",
            f"raw:{LOCAL}",
            f"raw:{LOCAL}",
            f"raw:{LOCAL}:unmeasured",
        ]


async def test_measure_next_values_candidates_against_the_best_measured_not_the_named_baseline(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A client may keep comparing against a reference kernel: measure_next still ranks by what a measurement
    may gain over the best kernel measured so far, so which measured baseline is named does not reorder it."""
    from forecaster_mcp.measure.replay import load_space

    ok = [e.params for e in load_space(conv_a100).valid_entries()]
    measured, unmeasured = ok[5::290], ok[7::150][:24]
    async with running(tmp_path, [conv_a100]) as (client, _):
        times = {}
        for i, params in enumerate(measured):
            out = await call(client, "measure_kernel", {"kernel": conv(f"m{i}", params)})
            times[f"m{i}"] = out["runtime_ms"]["median"]
        slow, best = max(times, key=times.__getitem__), min(times, key=times.__getitem__)
        assert times[slow] > 2 * times[best]
        cands = [conv(f"c{i}", p) for i, p in enumerate(unmeasured)]
        order = {}
        for base in (slow, best):
            out = await call(
                client,
                "compare_kernels",
                {"candidates": [conv(base, measured[int(base[1:])]), *cands], "baseline": base},
            )
            order[base] = out["measure_next"]
        common = [c for c in order[slow] if c in order[best]]
        assert len(common) >= 8
        assert [c for c in order[best] if c in common] == common


async def test_an_empty_measure_next_and_a_measure_if_unsure_that_measured_nothing_say_why(
    tmp_path: Path, conv_a100: Path
) -> None:
    from forecaster_mcp.measure.replay import load_space

    ok = load_space(conv_a100).valid_entries()
    best_t = min(e.time_ms for e in ok if e.time_ms is not None)
    measured = ok[3::60]
    very_slow = [e for e in ok[5::97] if e.time_ms and e.time_ms > 8 * best_t and e not in measured]
    assert len(very_slow) >= 2
    empty_note = "measure_next is empty"
    async with running(tmp_path, [conv_a100], ledger_seconds=1000) as (client, _):
        times = {}
        for i, e in enumerate(measured):
            out = await call(client, "measure_kernel", {"kernel": conv(f"m{i}", e.params)})
            times[i] = out["runtime_ms"]["median"]
            if i == 1:  # two measurements: every candidate is unsure, and listed
                early = await call(
                    client,
                    "compare_kernels",
                    {"candidates": [conv("m0", measured[0].params), conv("v", very_slow[0].params)]},
                )
                assert early["measure_next"] and not any(empty_note in n for n in early["notes"])
        b = min(times, key=times.__getitem__)
        cands = [conv(f"s{i}", e.params) for i, e in enumerate(very_slow)]
        out = await call(
            client, "compare_kernels", {"candidates": [conv(f"m{b}", measured[b].params), *cands]}
        )
        # A client asking compare_kernels to measure the unsure ones is told why nothing was measured ...
        asked = await call(
            client,
            "compare_kernels",
            {"candidates": [conv(f"m{b}", measured[b].params), *cands], "measure_if_unsure": True},
        )
        # ... and, when candidates are decided faster than a slow baseline, which one to measure itself.
        slow = max(times, key=times.__getitem__)
        assert times[slow] > 8 * times[b]
        others = [conv(f"u{i}", e.params) for i, e in enumerate(ok[7::41][:40]) if e not in measured]
        faster = await call(
            client,
            "compare_kernels",
            {
                "candidates": [conv(f"m{slow}", measured[slow].params), *others],
                "measure_if_unsure": True,
                "max_measurements": 1,
            },
        )
    assert all(c["verdict"] == "slower" for c in out["candidates"])
    assert out["measure_next"] == []
    assert any(empty_note in n for n in out["notes"])
    nothing = "measure_if_unsure measured nothing"
    assert not any(nothing in n for n in out["notes"])
    assert asked["measurements"] == [] and asked["gpu_seconds_charged"] == 0
    assert any(nothing in n for n in asked["notes"]) and any(empty_note in n for n in asked["notes"])
    assert all(c["verdict"] == "faster" for c in faster["candidates"]) and faster["measurements"] == []
    head = faster["measure_next"][0]
    assert any(nothing in n and f"ranks {head} (verdict faster)" in n for n in faster["notes"])


def test_the_nothing_unsure_note_names_an_unmeasured_baseline_first() -> None:
    """measure_next lists an unmeasured baseline first (no candidate's pair settles without it): a client told
    what to measure instead is told that, not the first candidate after it."""
    from forecaster_mcp.models import CandidateForecast
    from forecaster_mcp.service import _nothing_unsure_note

    faster = CandidateForecast(
        id="c1", p_faster=0.99, speedup_bins=[0.0] * 7 + [1.0], expected_speedup=5.0, verdict="faster",
        decided_by="forecast", rationale="", confidence=0.99,
    )  # fmt: skip
    note = _nothing_unsure_note(["b", "c1"], {"c1": faster}, "b")
    assert "ranks b (the baseline, not measured yet)" in note and "c1" not in note
    assert "ranks c1 (verdict faster)" in _nothing_unsure_note(["c1"], {"c1": faster}, "b")
    assert _nothing_unsure_note([], {"c1": faster}, "b").endswith("with a larger max_runs to separate them)")


async def test_a_measured_tie_is_neither_faster_nor_slower(tmp_path: Path, conv_a100: Path) -> None:
    """One kernel sent under two ids has one measurement, S = 1 exactly: it used to come back `slower` at
    p_faster 0 and confidence 1 with all its bins on the faster side of S = 1."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        out = await call(client, "compare_kernels", {"candidates": [conv("a", FAST), conv("b", FAST)]})
        (cand,) = out["candidates"]
        assert cand["decided_by"] == "cache"
        assert (cand["verdict"], cand["p_faster"], cand["expected_speedup"]) == ("unsure", 0.5, 1.0)
        assert cand["speedup_bins"][3] == cand["speedup_bins"][4] == 0.5
        assert "equal runtimes" in cand["rationale"]
        assert "b" not in out["measure_next"]


async def test_default_ids_do_not_clash_with_ids_the_caller_gave(tmp_path: Path, conv_a100: Path) -> None:
    """The default id is positional (k<i>); a caller that named its first candidate "k1" used to be told
    that "k1" appears twice."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        out = await call(client, "compare_kernels", {"candidates": [conv("k1", FAST), conv(None, SLOW)]})
        assert out["baseline"] == "k1"
        assert [c["id"] for c in out["candidates"]] == ["k2"]
        out = await call(client, "compare_kernels", {"candidates": [conv(None, FAST), conv(None, SLOW)]})
        assert (out["baseline"], [c["id"] for c in out["candidates"]]) == ("k0", ["k1"])


async def test_a_measured_pair_within_its_noise_is_unsure(tmp_path: Path, conv_a100: Path) -> None:
    """Two kernels 0.6% apart measured with 3 runs each: the speedup's 95% interval includes 1, so the answer
    is unsure at the p_faster of that interval (it used to be `slower` at confidence 1). With 32 runs each the
    intervals separate and the same 0.6% is decided: the rule is the measurements' noise, not a fixed band. One
    run bounds nothing (its interval is a point): the 3% tie band stands in for it."""
    tie_a = {**FAST, "tile_size_x": 2, "tile_size_y": 2, "use_shmem": 0}
    tie_b = {**tie_a, "block_size_x": 48, "block_size_y": 1, "tile_size_y": 1, "read_only": 0}
    for runs, expected in ((1, "unsure"), (3, "unsure"), (32, "slower")):
        async with running(tmp_path / str(runs), [conv_a100]) as (client, _):
            for kid, params in (("a", tie_a), ("b", tie_b), ("fast", FAST)):
                await call(client, "measure_kernel", {"kernel": conv(kid, params), "max_runs": runs})
            out = await call(
                client,
                "compare_kernels",
                {"candidates": [conv("a", tie_a), conv("b", tie_b), conv("fast", FAST)]},
            )
        b, fast = out["candidates"]
        assert b["verdict"] == expected and b["decided_by"] == "cache"
        assert 0.99 < b["expected_speedup"] < 1.0
        assert (fast["verdict"], fast["p_faster"]) == ("faster", 1.0)
        if expected == "unsure":
            assert 0.05 < b["p_faster"] < 0.5
            assert b["p_faster"] == pytest.approx(sum(b["speedup_bins"][4:]))
            assert "within noise" in b["rationale"]
        else:
            assert b["p_faster"] == 0.0


async def test_a_replay_server_gives_no_source_notes(tmp_path: Path, conv_a100: Path) -> None:
    # A recording answers on entry and defines, whatever the source says: "measure_kernel will find no such
    # kernel" was false there, and the measurement went through.
    async with running(tmp_path, [conv_a100]) as (client, _service):
        stub = [{**conv(kid, p), "source": "// convolution\n"} for kid, p in (("a", FAST), ("b", SLOW))]
        out = await call(client, "compare_kernels", {"candidates": stub})
        assert not any("never names" in n for n in out["notes"])
        measured = await call(client, "measure_kernel", {"kernel": stub[1]})
        assert measured["status"] == "ok"


async def test_an_entry_the_source_lacks_or_a_wrong_argument_count_is_noted_before_any_measurement(
    tmp_path: Path,
) -> None:
    src = (
        "__global__ void scale(float* x /* data, in place */, float a, int n /* count, elements */) {\n"
        "  int i = threadIdx.x; if (i < n) x[i] *= a; }\n"
    )
    good = {"id": "good", "source": src, "entry": "scale"}
    typo = {"id": "typo", "source": src, "entry": "scal"}
    args = [{"name": "x", "dtype": "float32", "shape": [256]}, {"name": "n", "dtype": "int32", "value": 256}]
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="default")
    service = await Service.open(settings)
    try:
        async with Client(build_server(service)) as client:
            out = await call(
                client, "compare_kernels", {"candidates": [good, typo], "workload": {"args": args}}
            )
            notes = " | ".join(out["notes"])
            assert "candidate typo: the source never names 'scal'" in notes
            assert "candidate good: scale appears to take 3 parameters but workload.args lists 2" in notes
            right = [*args[:1], {"name": "a", "dtype": "float32", "value": 2.0}, args[1]]
            out = await call(
                client,
                "compare_kernels",
                {"candidates": [good, {**good, "id": "again"}], "workload": {"args": right}},
            )
            assert not [n for n in out["notes"] if n.startswith("candidate ")]
    finally:
        await service.close()


async def test_an_unmeasured_baseline_of_measured_candidates_is_worth_measuring(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Every candidate measured, the baseline not: measuring the baseline alone settles every pair."""
    base, fast, slow = conv("b", FAST), conv("f", {**FAST, "block_size_x": 64}), conv("s", SLOW)
    async with running(tmp_path, [conv_a100]) as (client, _service):
        for k in (fast, slow):
            await call(client, "measure_kernel", {"kernel": k})
        out = await call(client, "compare_kernels", {"candidates": [base, fast, slow]})
        assert out["measure_next"] == ["b"]
        assert not any("measure_next is empty" in n for n in out["notes"])
        done = await call(
            client, "compare_kernels", {"candidates": [base, fast, slow], "measure_if_unsure": True}
        )
    assert [m["kernel_id"] for m in done["measurements"]] == ["b"]
    assert {c["decided_by"] for c in done["candidates"]} == {"measurement"}
    assert done["measure_next"] == []


async def test_a_candidate_that_failed_when_measured_is_not_called_unmeasured(
    tmp_path: Path, conv_a100: Path
) -> None:
    base, broken = conv("b", FAST), conv("x", FAILS)
    async with running(tmp_path, [conv_a100]) as (client, _service):
        for k in (base, broken):
            await call(client, "measure_kernel", {"kernel": k})
        out = await call(client, "compare_kernels", {"candidates": [base, broken]})
        status = await call(client, "budget_status", {})
    [c] = out["candidates"]
    assert c["verdict"] == "slower" and "failed when measured" in c["rationale"]
    # Known from its measurement, not forecast: neither reported nor counted as a decided forecast.
    assert c["decided_by"] == "cache" and status["forecasts"]["decided"] == 0
    assert out["measure_next"] == []
    assert not any("measure_next is empty" in n for n in out["notes"])  # nothing unmeasured to speak of


async def test_copies_of_one_kernel_are_listed_once_and_a_zero_cap_says_so(
    tmp_path: Path, conv_a100: Path
) -> None:
    base = conv("b", FAST)
    cand = conv("c", {**FAST, "block_size_x": 64})
    twin = {**cand, "id": "twin"}
    base_copy = {**base, "id": "b2"}
    async with running(tmp_path, [conv_a100]) as (client, _service):
        out = await call(client, "compare_kernels", {"candidates": [base, cand, twin, base_copy]})
        assert out["measure_next"] == ["b", "c"]  # one measurement of c answers twin; b answers b2
        capped = await call(
            client,
            "compare_kernels",
            {"candidates": [base, cand], "measure_if_unsure": True, "max_measurements": 0},
        )
    assert capped["measurements"] == [] and capped["gpu_seconds_charged"] == 0
    assert any("max_measurements 0 measured nothing" in n for n in capped["notes"])


async def test_a_copy_spelled_otherwise_is_listed_once_and_its_rationale_says_why(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Defines the compiler and the family model read as one value (32, "0x20", "32u", "32.0") make one kernel:
    a copy of the baseline so spelled was listed in measure_next (an agent paid for the baseline's runtime
    twice), and so was a second spelling of a candidate. Both are left out, and a copy of the baseline's
    unsure forecast says it is the baseline's configuration; measuring the baseline alone settles it."""
    base = conv("b", FAST)
    hex_copy = conv("hex", {**FAST, "block_size_x": "0x20"})
    suffixed = conv("u", {**FAST, "block_size_x": "32u", "block_size_y": "4.0"})
    cand = conv("c", {**FAST, "block_size_x": 64})
    cand_again = conv("c2", {**FAST, "block_size_x": "64u"})
    async with running(tmp_path, [conv_a100]) as (client, _service):
        out = await call(
            client, "compare_kernels", {"candidates": [base, hex_copy, suffixed, cand, cand_again]}
        )
        # One of c and c2 (ranked alike): measuring it answers the other.
        assert out["measure_next"][0] == "b" and out["measure_next"][1:] in (["c"], ["c2"])
        by_id = {c["id"]: c for c in out["candidates"]}
        for cid in ("hex", "u"):
            assert (
                by_id[cid]["verdict"] == "unsure"
                and "the baseline's own configuration" in by_id[cid]["rationale"]
            )
        assert "baseline's own configuration" not in by_id["c2"]["rationale"]
        # Only copies of the baseline unsure: measure_if_unsure measures the baseline, which settles them.
        settled = await call(
            client, "compare_kernels", {"candidates": [base, hex_copy, suffixed], "measure_if_unsure": True}
        )
    assert [m["kernel_id"] for m in settled["measurements"]] == ["b"]
    assert {c["id"]: c["decided_by"] for c in settled["candidates"]} == {
        "hex": "measurement",
        "u": "measurement",
    }
    assert settled["measure_next"] == []


@pytest.mark.parametrize("realtime", [0.0, 1e-6])
async def test_measure_next_leaves_out_what_the_recording_cannot_replay(
    tmp_path: Path, conv_a100: Path, realtime: float
) -> None:
    """A combination of recorded values the tuner never ran is refused by measure_kernel (free): at the head of
    measure_next call after call, a client that measures the head never moved on. The same at a replay pace
    (serve --replay-realtime), whose wrapper hid the recording's check: all four were listed."""
    import itertools

    from forecaster_mcp.measure.replay import load_space

    space = load_space(conv_a100)
    values = [space.tune_params[k] for k in space.param_keys]
    unrecorded = [
        dict(zip(space.param_keys, combo, strict=True))
        for combo in itertools.islice(itertools.product(*values), 20_000)
        if space.find(dict(zip(space.param_keys, combo, strict=True))) is None
    ][::997][:4]
    recorded = [e.params for e in space.valid_entries()][7::301][:4]
    assert len(unrecorded) == 4 and len(recorded) == 4
    async with running(tmp_path, [conv_a100], replay_realtime=realtime) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("base", FAST)})
        candidates = [conv("base", FAST)]
        candidates += [conv(f"u{i}", p) for i, p in enumerate(unrecorded)]
        candidates += [conv(f"r{i}", p) for i, p in enumerate(recorded)]
        out = await call(client, "compare_kernels", {"candidates": candidates})
        assert not any(i.startswith("u") for i in out["measure_next"]), out["measure_next"]
        assert {c["id"] for c in out["candidates"]} >= {"u0", "u1", "u2", "u3"}  # still forecast
        [note] = [n for n in out["notes"] if n.startswith("left out of measure_next")]
        assert "u0" in note and "not recorded" in note, note


async def test_measure_next_explores_a_young_tuning_family_in_a_random_order(
    tmp_path: Path, conv_a100: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server marks configurations of the baseline's family for exploration (acquisition.EXPLORE_POINTS):
    with a measured baseline and few points, measure_next's order is drawn from the candidates, not their
    value; with exploration off it is by value. Every id is listed either way."""
    from replay_kernels import conv_block

    from forecaster_mcp.forecast import acquisition

    shapes = [(bx, by) for bx in (16, 32, 48, 64, 96, 128) for by in (1, 2, 4)]
    cands = [conv("base", FAST), *(conv_block(bx, by, f"c{bx}x{by}") for bx, by in shapes)]
    orders, default = {}, acquisition.EXPLORE_POINTS
    for explore in (default, 0):
        monkeypatch.setattr(acquisition, "EXPLORE_POINTS", explore)
        async with running(tmp_path / f"home{explore}", [conv_a100]) as (client, _):
            await call(client, "measure_kernel", {"kernel": cands[0]})
            out = await call(client, "compare_kernels", {"candidates": cands, "baseline": "base"})
            orders[explore] = out["measure_next"]
            again = await call(client, "compare_kernels", {"candidates": cands, "baseline": "base"})
            assert again["measure_next"] == out["measure_next"]  # the same call, the same order
    explored, by_value = orders[default], orders[0]
    assert sorted(explored) == sorted(by_value) and explored != by_value


async def test_a_list_of_a_million_candidates_is_refused_at_its_length(
    tmp_path: Path, conv_a100: Path
) -> None:
    """The 64-candidate bound was only advertised: pydantic validated every item of the list and the error
    summary described each one (a 4 MiB body of empty strings peaked at 2 GB of server memory, 10 s on the
    event loop; 95 MiB took the server down)."""
    import tracemalloc

    async with running(tmp_path, [conv_a100]) as (client, _):
        tracemalloc.start()
        try:
            msg = await error_of(client, "compare_kernels", {"candidates": [""] * 1_000_000})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert "2 to 64 candidates, got 1000000" in msg and len(msg) < 2000
    assert peak < 600 * 2**20  # the request itself (a million list items) and not much more


async def test_a_list_past_the_hard_bound_is_told_the_contracts_count(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Past the hard bound (256) the refusal named that bound: 300 candidates were told "at most 256 items",
    and 256 were then told "2 to 64". Every count past 64 is now told the contract's."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        for count in (65, 256, 257, 300):
            many = [conv(f"c{i}", FAST) for i in range(count)]
            msg = await error_of(client, "compare_kernels", {"candidates": many})
            assert f"2 to 64 candidates, got {count}" in msg and "split larger sets" in msg, count
            assert "256" not in msg.replace(f"got {count}", "")


_ADD = """
__global__ void add(float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] += b[i];
}
"""
_ADD_STRIDED = """
__global__ void add(float* a, const float* __restrict__ b, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) a[i] += b[i];
}
"""
# A real kernel with a missing ";" (and an undefined name after it).
_ADD_BROKEN = """
__global__ void add(float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x
  if (i < n) a[i] += undefined_buffer[i];
}
"""


def _add(kid: str, source: str, grid: int = 4096, block: int = 256) -> dict[str, object]:
    return {
        "id": kid,
        "source": source,
        "entry": "add",
        "launch": {"grid": [grid, 1, 1], "block": [block, 1, 1]},
    }


async def _compiled_beforehand(home: Path, kernels: list[dict[str, object]], arch: str) -> None:
    """ptxas results of `kernels` put in the server's cache first, so a busy test machine cannot make the
    compare's own wait for nvcc run out (the forecast would then have no ptxas result, rightly)."""
    from forecaster_mcp.forecast.ptxas import find_nvcc, ptxas_results

    nvcc = find_nvcc(None)
    assert nvcc is not None
    jobs = {i: (Kernel.model_validate({**k, "id": None}), arch) for i, k in enumerate(kernels)}
    assert len(await ptxas_results(jobs, nvcc, home / "cache", wait_s=300.0)) == len(kernels)


@pytest.mark.skipif(find_nvcc(None) is None, reason="needs nvcc")
async def test_a_candidate_that_does_not_compile_is_ranked_last_and_not_measured_next(tmp_path: Path) -> None:
    """With nvcc present, a source nvcc rejects ("this is not C", a kernel missing a ";") ranked first and second
    in measure_next, ahead of kernels that compile: a failed compile only took the ptxas features away. Now it is
    "slower" (never "faster"), ranks below every kernel likely to run, stays out of measure_next, and its
    rationale gives the compiler's first error line."""
    candidates = [
        _add("base", _ADD),
        _add("notc", "this is not C"),
        _add("broken", _ADD_BROKEN),
        _add("strided", _ADD_STRIDED, grid=1024),
        _add("narrow", _ADD, block=128, grid=8192),
    ]
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="default")
    await _compiled_beforehand(settings.home, candidates, "sm_90")
    service = await Service.open(settings)
    try:
        async with Client(build_server(service)) as client:
            args = {"candidates": candidates, "hardware": "H100", "workload": {"problem": {"n": 1 << 20}}}
            out = await call(client, "compare_kernels", args)
            swapped = await call(client, "compare_kernels", {**args, "baseline": "broken"})
    finally:
        await service.close()
    by_id = {c["id"]: c for c in out["candidates"]}
    for kid, line in (
        ("notc", "kernel.cu(1): error: expected a declaration"),
        ("broken", 'error: expected a ";"'),
    ):
        assert by_id[kid]["verdict"] == "slower", by_id[kid]
        assert by_id[kid]["rationale"].startswith("candidate does not compile"), by_id[kid]["rationale"]
        assert line in by_id[kid]["rationale"] and "/tmp" not in by_id[kid]["rationale"]
    assert set(out["ranking"][-2:]) == {"notc", "broken"}
    assert out["measure_next"] and not {"notc", "broken"} & set(out["measure_next"])
    assert any("does not compile" in n and "notc, broken" in n for n in out["notes"])
    # Against a baseline that does not compile: the baseline is not measured next, and ranks below those that
    # compile (the kernels that compile are "faster": they run, it does not).
    assert "broken" not in swapped["measure_next"] and "notc" not in swapped["measure_next"]
    assert set(swapped["ranking"][-2:]) == {"notc", "broken"}
    by_id = {c["id"]: c for c in swapped["candidates"]}
    assert by_id["notc"]["verdict"] != "faster"
    assert "baseline does not compile" in by_id["strided"]["rationale"]
    assert any("broken (the baseline)" in n for n in swapped["notes"])


async def test_a_family_of_one_measurement_is_said_in_the_singular(tmp_path: Path, conv_a100: Path) -> None:
    async with running(tmp_path, [conv_a100]) as (client, _service):
        await call(client, "measure_kernel", {"kernel": conv("fast", FAST)})
        out = await call(client, "compare_kernels", {"candidates": [conv("fast", FAST), conv("slow", SLOW)]})
        rationale = out["candidates"][0]["rationale"]
        assert "only 1 measurement of this family" in rationale, rationale


async def test_a_verdict_decided_by_a_chance_of_failing_says_so(tmp_path: Path) -> None:
    """A kernel family whose every measurement failed: an unmeasured member is "slower" (it likely fails too)
    at p_faster 0.5. Its rationale said only "static prior ...: no informative static difference, near 50/50",
    and against a baseline measured failing "baseline failed when measured", beside p_faster 1.0: nothing in
    the answer said why the verdict was "slower"."""
    cache: dict[str, dict[str, object]] = {
        str(bx): {"bx": bx, "time": "RuntimeFailedConfig"} for bx in range(12)
    }
    cache["12"] = {"bx": 12, "time": 1.0, "times": [1.0] * 5}
    cache["13"] = {"bx": 13, "time": 1.0, "times": [1.0] * 5}
    doc = {
        "device_name": "NVIDIA A100-PCIE-40GB",
        "kernel_name": "kk",
        "problem_size": [1024],
        "tune_params_keys": ["bx"],
        "tune_params": {"bx": list(range(14))},
        "objective": "time",
        "cache": cache,
    }
    recording = tmp_path / "fails.json"
    recording.write_text(json.dumps(doc))

    def kk(kid: str, bx: int) -> dict[str, object]:
        return {"id": kid, "source": "// kk\n", "entry": "kk", "defines": {"bx": bx}}

    async with running(tmp_path, [recording]) as (client, _):
        for bx in range(12):
            assert (await call(client, "measure_kernel", {"kernel": kk("m", bx)}))["status"] != "ok"
        for base in (13, 0):  # unmeasured, then measured failing
            out = await call(client, "compare_kernels", {"candidates": [kk("base", base), kk("c", 12)]})
            (cand,) = out["candidates"]
            assert (cand["verdict"], cand["decided_by"]) == ("slower", "forecast"), cand
            assert cand["p_faster"] >= 0.5
            assert "slower for its 99" in cand["rationale"], cand["rationale"]
            assert "chance of failing to compile or run" in cand["rationale"]


async def test_a_state_database_that_cannot_be_written_is_named_to_the_agent(
    tmp_path: Path, conv_a100: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full, read-only or long-locked state folder: measure_kernel answered only 'Error executing tool
    measure_kernel' (an unexpected error), so the agent could neither act on it nor tell anyone what was wrong."""
    from forecaster_mcp.store import db

    monkeypatch.setattr(db, "BUSY_TIMEOUT_S", 0.2)
    async with running(tmp_path, [conv_a100]) as (client, service):
        other = sqlite3.connect(service.store.path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another process writing, for longer than the busy timeout
            text = await error_of(client, "measure_kernel", {"kernel": conv("k", FAST)})
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert "the server's state database cannot be used now (database is locked)" in text, text
        assert "tell the server's operator" in text
        status = await call(client, "budget_status", {})
        assert status["spent_gpu_seconds"] == 0 and status["reserved_gpu_seconds"] == 0


async def test_a_damaged_state_database_is_named_to_the_agent(tmp_path: Path, conv_a100: Path) -> None:
    """A database damaged past the pages Store.open reads (a lost block under the ledgers table) answered every
    tool call 'Error executing tool budget_status': the CLI names such damage, the server told the agent
    nothing it could pass on."""
    store = await Store.open(Settings.from_env(home=tmp_path).db_path)
    try:
        await store.create_ledger("team", 100.0)
    finally:
        await store.close()
    damage_table(Settings.from_env(home=tmp_path).db_path, "ledgers")
    async with running(tmp_path, [conv_a100], ledger_seconds=None) as (client, _):
        text = await error_of(client, "budget_status", {})
    assert "the server's state database is damaged (database disk image is malformed)" in text, text
    assert "tell the server's operator" in text


async def test_a_python_or_triton_entry_the_source_never_names_is_noted(tmp_path: Path) -> None:
    # Only CUDA and HIP candidates were checked: a Triton candidate with a mistyped entry was forecast as its whole
    # file (python_entry_text keeps everything when the entry is not defined) with nothing said.
    triton_src = (
        "import triton\nimport triton.language as tl\n\n@triton.jit\n"
        "def add_kernel(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)\n"
    )
    cupy_src = (
        'import cupy as cp\nk = cp.RawKernel(r"""extern "C" __global__ void relu(float* x) {}""", "relu")\n'
    )
    candidates = [
        {"id": "ok", "source": triton_src, "entry": "add_kernel", "language": "triton"},
        {"id": "typo", "source": triton_src, "entry": "add_kernal", "language": "triton"},
        # A name inside the module's CUDA string is the entry of a CuPy kernel: named, so no note.
        {"id": "cupy", "source": cupy_src, "entry": "relu", "language": "python"},
    ]
    settings = Settings.from_env(home=tmp_path, measurer="none", ledger="default")
    service = await Service.open(settings)
    try:
        async with Client(build_server(service)) as client:
            out = await call(client, "compare_kernels", {"candidates": candidates})
    finally:
        await service.close()
    named = [n for n in out["notes"] if "never names" in n]
    assert len(named) == 1 and named[0].startswith("candidate typo: the source never names 'add_kernal'"), (
        named
    )
    assert "@triton.jit" in named[0]


async def test_the_published_p_faster_says_it_assumes_both_kernels_run(
    tmp_path: Path, conv_a100: Path
) -> None:
    # p_faster is the bins' mass above a speedup of 1, a distribution over runtimes: a candidate that likely fails
    # to compile reads p_faster 0.5 beside verdict "slower". The schema called it plainly "probability that this
    # candidate is faster", and an outside client sorting by it took such a candidate for a coin flip.
    async with running(tmp_path, [conv_a100]) as (client, _):
        tools = {t.name: t for t in (await client.list_tools()).tools}
    schema = tools["compare_kernels"].output_schema
    assert schema is not None
    text = json.dumps(schema)
    assert "if both compile and run" in text and "confidence" in text


def test_a_measured_difference_below_the_event_timer_s_resolution_is_not_decided() -> None:
    """CUDA events resolve about half a microsecond: a few-microsecond kernel's samples fall on a handful of
    timer ticks, often all on one, and its order-statistic interval is then a point. Two such kernels one tick
    apart (4.096 vs 4.064 us, 0.8%) were decided 'faster' with p_faster 1.0 on the quantisation alone. The same
    relative difference at 2 ms, far above the timer's resolution, is still decided."""
    tiny_base, tiny_cand = (0.004096, 0.004096, 0.004096, 50), (0.004064, 0.004064, 0.004064, 50)
    tiny = _from_measurement("c", tiny_base, tiny_cand, "measurement")
    assert tiny.verdict == "unsure" and 0.5 < tiny.p_faster < 0.9
    big = _from_measurement("c", (2.0, 2.0, 2.0, 50), (1.984, 1.984, 1.984, 50), "measurement")
    assert big.verdict == "faster" and big.p_faster == 1.0
    # A kernel at or under one tick is no better known than 'about a tick': never a point, never a crash.
    at_tick = _from_measurement("c", (0.0004, 0.0004, 0.0004, 50), (0.0003, 0.0003, 0.0003, 50), "cache")
    assert at_tick.verdict == "unsure"


@pytest.mark.parametrize(
    ("tool", "arguments", "refusal"),
    [
        (
            "compare_kernels",
            lambda many: {"candidates": [{**conv("a", FAST), "defines": many}, conv("b", FAST)]},
            "1000000 defines, over the limit of 64",
        ),
        (
            "measure_kernel",
            lambda many: {"kernel": conv("a", FAST), "workload": {"problem": many}},
            "workload.problem has 1000000 entries, over 64",
        ),
    ],
    ids=["defines", "problem"],
)
async def test_a_dict_of_a_million_entries_is_refused_at_its_count_without_reading_them(
    tmp_path: Path, conv_a100: Path, tool: str, arguments: Any, refusal: str
) -> None:
    """Only the count of `defines` or `workload.problem` was checked after pydantic had validated every entry,
    and the refusal's sample was the repr of the whole dict: on an HTTP server one 92 MB request (7.5 million
    defines) held the event loop, every other agent's call waiting, for 47 s. The count now comes first."""
    many = {f"d{i}": 1 for i in range(1_000_000)}
    async with running(tmp_path, [conv_a100]) as (_, service):
        took, message = await _refused_in(service, tool, arguments(many))
    assert refusal in message and len(message) < 2000, message
    assert took < 0.2, f"{took:.2f} s to refuse the arguments"


async def _refused_in(service: Any, tool: str, arguments: dict[str, Any]) -> tuple[float, str]:
    """The fastest of a few calls of `tool` the server refuses (ToolError), in seconds, and the refusal's text:
    on a thread, as an HTTP server's event loop would be held."""
    from mcp.server.mcpserver.exceptions import ToolError
    from timing import fastest_s

    server = build_server(service)
    messages: list[str] = []

    def refused() -> None:
        async def one() -> None:
            with pytest.raises(ToolError) as info:
                await server.call_tool(tool, arguments)
            messages.append(str(info.value))

        anyio.from_thread.run(one)

    took = await anyio.to_thread.run_sync(lambda: fastest_s(refused, limit_s=0.2))
    return took, messages[0]


async def test_against_a_failed_baseline_measure_next_and_ranking_follow_the_family_model(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A baseline measured failing defines no speedup: every candidate's forecast is the extreme bin, so
    measure_next (by value) and ranking (by expected speedup) came back in the order the candidates were sent,
    with the recording's fastest configuration last. The family's best measured kernel is the best so far:
    measure_next values each candidate against it, and ranking orders them by their predicted runtimes."""
    from forecaster_mcp.measure.replay import load_space

    ok = load_space(conv_a100).valid_entries()
    best_t = min(e.time_ms for e in ok if e.time_ms is not None)
    measured = [e for e in ok[3::70] if e.params != FAST][:12]
    slow = [e for e in ok[5::31] if e.time_ms and e.time_ms > 6 * best_t and e not in measured][:6]
    assert len(slow) == 6
    async with running(tmp_path, [conv_a100]) as (client, _):
        for i, e in enumerate(measured):
            await call(client, "measure_kernel", {"kernel": conv(f"m{i}", e.params)})
        failed = await call(client, "measure_kernel", {"kernel": conv("fails", FAILS)})
        assert failed["status"] == "launch_error"
        candidates = [conv("fails", FAILS), *(conv(f"s{i}", e.params) for i, e in enumerate(slow))]
        out = await call(client, "compare_kernels", {"candidates": [*candidates, conv("fast", FAST)]})
    assert all(c["decided_by"] == "forecast" for c in out["candidates"])
    assert out["measure_next"][0] == "fast", out["measure_next"]
    assert out["ranking"][0] == "fast" and out["ranking"][-1] == "fails", out["ranking"]


async def test_an_unmeasured_baseline_does_not_reorder_measure_next(tmp_path: Path, conv_a100: Path) -> None:
    """An agent naming an unmeasured kernel as its baseline gets it at the head of measure_next; the candidates
    after it were valued against that baseline's predicted runtime and its uncertainty, so which unmeasured
    kernel was named reordered them. They are valued against the family's best measured kernel, as with a
    measured baseline: the same candidates come in the same order whichever baseline is named."""
    from forecaster_mcp.measure.replay import load_space

    ok = [e.params for e in load_space(conv_a100).valid_entries()]
    measured, unmeasured = ok[5::290], ok[7::150][:24]
    async with running(tmp_path, [conv_a100]) as (client, _):
        for i, params in enumerate(measured):
            await call(client, "measure_kernel", {"kernel": conv(f"m{i}", params)})
        cands = [conv(f"c{i}", p) for i, p in enumerate(unmeasured[2:])]
        orders = []
        for base in ("u0", "u1"):
            kernel = conv(base, unmeasured[int(base[1:])])
            out = await call(client, "compare_kernels", {"candidates": [kernel, *cands], "baseline": base})
            assert out["measure_next"][0] == base
            orders.append(out["measure_next"][1:])
    assert len(orders[0]) >= 8
    assert orders[0] == orders[1]


def _two_families(tmp_path: Path) -> tuple[Path, Path]:
    """Recordings of two kernels on one A100 and workload: 'slowk' (11 to 20 ms, faster as bx grows) and
    'fastk' (about 1 ms everywhere), over bx 1..16 and by 1..4; fastk at bx 16, by 4 fails to run."""

    def recording(name: str, time_of: Any) -> Path:
        grid = [(bx, by) for bx in range(1, 17) for by in range(1, 5)]
        doc = {
            "device_name": "NVIDIA A100-PCIE-40GB",
            "kernel_name": name,
            "problem_size": [1024],
            "tune_params_keys": ["bx", "by"],
            "tune_params": {"bx": list(range(1, 17)), "by": list(range(1, 5))},
            "objective": "time",
            "cache": {
                f"{bx},{by}": {"bx": bx, "by": by, "time": (t := time_of(bx, by)), "times": [t]}
                for bx, by in grid
            },
        }
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        return path

    return (
        recording("slowk", lambda bx, by: 20.0 / (1 + 0.15 * bx) * (1 + 0.05 * by)),
        recording(
            "fastk",
            lambda bx, by: (
                "RuntimeFailedConfig" if (bx, by) == (16, 4) else (1 + 0.01 * abs(bx - 8)) * (1 + 0.02 * by)
            ),
        ),
    )


def _kk(kid: str, entry: str, bx: int, by: int) -> dict[str, Any]:
    return {
        "id": kid,
        "source": f"__global__ void {entry}() {{}}\n",
        "entry": entry,
        "defines": {"bx": bx, "by": by},
    }


@pytest.mark.parametrize(
    "baseline",
    [("fastk", 15, 4), ("fastk", 16, 4), ("slowk", 1, 1)],
    ids=["unmeasured", "failed", "measured-in-the-slower-family"],
)
async def test_measure_next_values_every_family_against_the_fastest_kernel_measured(
    tmp_path: Path, baseline: tuple[str, int, int]
) -> None:
    """Two approaches measured on one problem: 'slowk' at best 11 ms, 'fastk' at best 1 ms. Against a baseline
    without a measured runtime (a new fastk configuration, or one that failed), a slowk candidate predicted at
    8 ms beats its own family's best, but not the 1 ms measured: measure_next listed the slowk candidates
    first, ahead of fastk configurations that may beat 1 ms, and an agent measuring its head spent the GPU on
    kernels eight times slower than the one it has. So did a measured baseline of the slower family (18 ms):
    each family was valued against its own best or the baseline."""
    slow, fast = _two_families(tmp_path)
    async with running(tmp_path / "home", [slow, fast]) as (client, _):
        for bx in range(1, 7):
            for by in (1, 3):
                await call(client, "measure_kernel", {"kernel": _kk(f"ms{bx}{by}", "slowk", bx, by)})
                await call(client, "measure_kernel", {"kernel": _kk(f"mf{bx}{by}", "fastk", bx + 6, by)})
        base = _kk("base", *baseline)
        if baseline == ("fastk", 16, 4):
            assert (await call(client, "measure_kernel", {"kernel": base}))["status"] != "ok"
        cands = [_kk(f"s{bx}", "slowk", bx, 2) for bx in (9, 12, 16)]
        cands += [_kk(f"f{bx}", "fastk", bx, 2) for bx in (7, 8, 9)]
        out = await call(client, "compare_kernels", {"candidates": [base, *cands], "baseline": "base"})
    listed = [i for i in out["measure_next"] if i != "base"]
    fast_first = [i for i in listed if i.startswith("f")]
    assert fast_first and listed[: len(fast_first)] == fast_first, out["measure_next"]
    assert out["ranking"].index("f8") < min(out["ranking"].index(s) for s in ("s9", "s12", "s16"))


async def test_a_deeply_nested_argument_is_refused_without_reading_it_all(
    tmp_path: Path, conv_a100: Path
) -> None:
    """An argument error shows a 40-character sample of what was sent; it was taken from a copy of the input
    holding 16 items of every container at every level, which for a tree 16 wide (a JSON body of nested
    lists sent as `defines`) is the whole of it: 16.7 million leaves at depth 6 (a 50 MB body) held an HTTP
    server's event loop for seconds to show 40 characters. (The tree here shares its branches to stay small in
    the test; a JSON body cannot, but reads the same.)"""
    tree: Any = 1
    for _ in range(6):
        tree = [tree] * 16
    async with running(tmp_path, [conv_a100]) as (_, service):
        took, message = await _refused_in(
            service, "measure_kernel", {"kernel": {**conv("k", FAST), "defines": tree}}
        )
    assert (
        "kernel.defines: Input should be a valid dictionary; got [[[[[[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1...;"
        in message
    )
    assert took < 0.2, f"{took:.2f} s to refuse the arguments"
