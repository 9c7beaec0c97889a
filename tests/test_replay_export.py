"""`forecaster-mcp export` and replaying an export: DESIGN.md's replay reads "the project's own exported
measurements". Measured through a real server on a real SQLite store, exported by the CLI, replayed by a second
server that has only the export."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anyio.to_thread
import pytest
from replay_kernels import FAILS, FAST, SLOW, conv
from tool_calls import call, error_of, running

from forecaster_mcp.cli import main
from forecaster_mcp.measure.replay import EXPORT_FORMAT, ReplayMeasurer
from forecaster_mcp.models import Kernel, Workload

pytestmark = pytest.mark.anyio


async def _measured_home(home: Path, conv_a100: Path) -> dict[str, dict[str, object]]:
    results = {}
    async with running(home, [conv_a100]) as (client, _):
        for kid, params in (("fast", FAST), ("slow", SLOW), ("fails", FAILS)):
            results[kid] = await call(client, "measure_kernel", {"kernel": conv(kid, params)})
        # A cache hit is not a second measurement: it is not exported twice.
        await call(client, "measure_kernel", {"kernel": conv("again", FAST)})
    return results


async def test_an_export_replays_exactly_what_was_measured(
    tmp_path: Path, conv_a100: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = await _measured_home(tmp_path / "a", conv_a100)
    out = tmp_path / "export.jsonl"
    # The CLI runs its own event loop: from a worker thread, as a separate command would.
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert "exported 3 measurements" in capsys.readouterr().out
    # A search or the demo needs a whole recorded space: an export is refused with the reason.
    assert await anyio.to_thread.run_sync(main, ["search", str(out), "--seeds", "1"]) == 2
    assert await anyio.to_thread.run_sync(main, ["demo", "--replay", str(out)]) == 2
    assert capsys.readouterr().err.count("`forecaster-mcp export` file") == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {d["format"] for d in lines} == {EXPORT_FORMAT}
    assert lines[0]["kernel"]["source"] == conv("x", FAST)["source"]  # the whole kernel, source included

    named = f"export.jsonl@sha256:{hashlib.sha256(out.read_bytes()).hexdigest()[:16]}"
    async with running(tmp_path / "b", [out]) as (client, service):
        assert service.devices() == [measured["fast"]["device"]["name"]]  # type: ignore[index]
        # The request's cap still applies (before it is measured here, so no cache answers): a measurement longer than max_seconds is a timeout charging the cap.
        cost = float(measured["slow"]["cost"]["gpu_seconds"])  # type: ignore[index]
        capped = await call(
            client, "measure_kernel", {"kernel": conv("slow3", SLOW), "max_seconds": cost / 2}
        )
        assert capped["status"] == "timeout"
        assert capped["cost"]["gpu_seconds"] == pytest.approx(cost / 2)
        for kid, params in (("fast", FAST), ("slow", SLOW), ("fails", FAILS)):
            again = await call(client, "measure_kernel", {"kernel": conv(f"{kid}2", params)})
            before = measured[kid]
            assert again["status"] == before["status"]
            assert again["runtime_ms"] == before["runtime_ms"]
            assert again["cost"]["gpu_seconds"] == pytest.approx(before["cost"]["gpu_seconds"])  # type: ignore[index]
            assert again["device"]["backend"] == "replay" and again["device"]["recording"] == named
            assert again["kernel_id"] == f"{kid}2"
            # Its outputs were never checked (a replayed recording, no reference): the replay does not say
            # they were checked when measured.
            assert again["correctness"]["checked"] is False
            assert "checked when it was measured" not in again["correctness"]["detail"]
            assert "replayed from an export" in again["correctness"]["detail"]
        # Exact matching: the same defines with another source, or an unexported configuration, are refused.
        other_source = {**conv("x", FAST), "source": conv("x", FAST)["source"] + "\n// edited\n"}
        message = await error_of(client, "measure_kernel", {"kernel": other_source})
        assert "not among the exported measurements" in message
        message = await error_of(
            client, "measure_kernel", {"kernel": conv("y", {**FAST, "block_size_x": 64})}
        )
        assert "not among the exported measurements" in message
        status = await call(client, "budget_status", {})
        assert status["measurements"]["failures"] >= 2


def test_export_refuses_an_empty_store_and_replay_refuses_a_file_that_is_not_an_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--home", str(tmp_path / "empty"), "export", "--out", str(tmp_path / "e.jsonl")]) == 2
    assert "nothing to export" in capsys.readouterr().err
    assert not (tmp_path / "e.jsonl").exists()
    # Replay knows an export by its suffix: another name was written, and the printed replay command failed.
    assert main(["--home", str(tmp_path / "empty"), "export", "--out", str(tmp_path / "e.json")]) == 2
    assert "must end in .jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something else"}\n')
    from forecaster_mcp.errors import OperatorError

    with pytest.raises(OperatorError, match=r"line 1: not a forecaster-mcp-measurement/1 line"):
        ReplayMeasurer([bad])


def test_serve_replay_names_a_pairs_file_and_what_replay_takes(
    tmp_path: Path, conv_a100: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --replay pairs.jsonl` (what make-pairs writes, for `forecaster-mcp eval`) said only 'line 1: not a
    forecaster-mcp-measurement/1 line; pass a file `forecaster-mcp export` wrote'. It now says the file looks
    like a pairs file for eval, and that --replay takes a Kernel Tuner cache file or an export; a file with
    history points first is known too."""
    home = str(tmp_path / "home")
    for name, extra in (("pairs.jsonl", []), ("history.jsonl", ["--history", "3"])):
        pairs = tmp_path / name
        argv = ["--home", home, "make-pairs", str(conv_a100), "-n", "4", "--seed", "1", "--out", str(pairs)]
        assert main([*argv, *extra]) == 0
        capsys.readouterr()
        assert main(["--home", home, "serve", "--replay", str(pairs)]) == 2
        err = capsys.readouterr().err
        assert "looks like a pairs file for `forecaster-mcp eval`" in err, err
        assert f"`forecaster-mcp eval {pairs}`" in err
        assert "--replay takes a Kernel Tuner cache file (.json or .json.gz)" in err
        assert "`forecaster-mcp export` wrote" in err


def test_replay_refuses_an_export_line_with_an_impossible_cost(tmp_path: Path) -> None:
    """A corrupt export must not reach the ledger: a NaN or negative recorded cost is refused at start-up."""
    from forecaster_mcp.errors import OperatorError
    from forecaster_mcp.measure.replay import export_line
    from forecaster_mcp.models import DeviceProvenance, Kernel, MeasureCost, MeasureResult

    kernel = Kernel.model_validate(conv("a", FAST))
    for cost in (float("nan"), -1.0):
        result = MeasureResult(
            kernel_id="a",
            status="ok",
            device=DeviceProvenance(name="A100-PCIE-40GB", backend="pycuda"),
            cost=MeasureCost(gpu_seconds=cost),
        )
        path = tmp_path / "bad.jsonl"
        path.write_text(export_line("A100-PCIE-40GB", "w", kernel, result) + "\n")
        with pytest.raises(OperatorError, match="line 1: its cost is"):
            ReplayMeasurer([path])


async def test_an_export_of_isolated_ledgers_replays_on_any_server(
    tmp_path: Path, conv_a100: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An isolated ledger files its history under "<workload key>@<ledger>"; the export (and replay) use the
    # workload's own key.
    monkeypatch.setenv("FORECASTER_MCP_ISOLATE_LEDGERS", "1")
    measured = await _measured_home(tmp_path / "a", conv_a100)
    out = tmp_path / "export.jsonl"
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    keys = {json.loads(line)["workload_key"] for line in out.read_text().splitlines()}
    assert len(keys) == 1 and "@" not in next(iter(keys))
    # Measured again by another ledger: still one line per kernel.
    async with running(tmp_path / "a", [conv_a100], ledger_seconds=None) as (_client, service):
        await service.store.create_ledger("other", 10.0)
        fast = Kernel.model_validate(conv("fast-b", FAST))
        assert not (await service.measure(ledger="other", kernel=fast, workload=Workload())).cost.cached
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert len(out.read_text().splitlines()) == 3
    monkeypatch.delenv("FORECASTER_MCP_ISOLATE_LEDGERS")
    async with running(tmp_path / "b", [out]) as (client, _):
        again = await call(client, "measure_kernel", {"kernel": conv("fast2", FAST)})
        assert again["runtime_ms"] == measured["fast"]["runtime_ms"]


async def test_a_replayed_export_does_not_say_this_request_was_lowered_to_the_budget(
    tmp_path: Path, conv_a100: Path
) -> None:
    """max_seconds_lowered_to_budget describes the request a result answered (a nearly spent ledger held the
    default cap down), not the measurement. Exported with the result, it came back on every replay of it,
    though the replaying ledger had 100 GPU-seconds and the request's cap was not lowered."""
    async with running(tmp_path / "a", [conv_a100], ledger_seconds=5.0) as (client, _):
        first = await call(client, "measure_kernel", {"kernel": conv("fast", FAST)})
    assert "max_seconds_lowered_to_budget" in first["flags"]
    out = tmp_path / "export.jsonl"
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    async with running(tmp_path / "b", [out]) as (client, _):
        again = await call(client, "measure_kernel", {"kernel": conv("fast2", FAST)})
    assert again["runtime_ms"] == first["runtime_ms"]
    assert "max_seconds_lowered_to_budget" not in again["flags"]
    assert again["cost"]["max_seconds"] == 30.0
