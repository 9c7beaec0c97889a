"""Hostile and unusual exports for `serve --replay F.jsonl`: what a corrupt line, a request's max_runs, a kernel
missing from the export or the same export named twice do to a real server."""

from __future__ import annotations

import json
from pathlib import Path

import anyio.to_thread
import pytest
from replay_kernels import FAST, SLOW, conv
from tool_calls import call, error_of, running

from forecaster_mcp.cli import main
from forecaster_mcp.errors import OperatorError
from forecaster_mcp.measure.replay import ReplayMeasurer

pytestmark = pytest.mark.anyio


async def _export(tmp_path: Path, conv_a100: Path) -> Path:
    async with running(tmp_path / "a", [conv_a100]) as (client, _):
        for kid, params in (("fast", FAST), ("slow", SLOW)):
            await call(client, "measure_kernel", {"kernel": conv(kid, params)})
    out = tmp_path / "export.jsonl"
    assert (
        await anyio.to_thread.run_sync(main, ["--home", str(tmp_path / "a"), "export", "--out", str(out)])
        == 0
    )
    return out


def _edited(src: Path, dst: Path, field: str, value: object) -> Path:
    docs = [json.loads(line) for line in src.read_text().splitlines()]
    where, _, name = field.rpartition(".")
    target = docs[0]["result"]
    for part in where.split("."):
        target = target[part]
    target[name] = value
    dst.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return dst


async def test_an_export_line_with_impossible_runtimes_is_refused_at_start_up(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A NaN or infinite median used to be replayed and charged, then fail the call as an internal error (the
    answer cannot be serialised); a negative one was served as a measured runtime. Refused like a bad cost."""
    out = await _export(tmp_path, conv_a100)
    cases = [
        ("runtime_ms.median", float("nan")),
        ("runtime_ms.median", float("inf")),
        ("runtime_ms.p90", -1.0),
        ("runtime_ms.runs", 0),
        ("cost.compile_seconds", float("nan")),
    ]
    for n, (field, value) in enumerate(cases):
        bad = _edited(out, tmp_path / f"bad{n}.jsonl", field, value)
        with pytest.raises(OperatorError, match=r"line 1: "):
            ReplayMeasurer([bad])


async def test_an_export_does_not_replay_more_runs_than_max_runs_allows(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A recorded measurement of 32 runs cannot stand for one capped at 3: it used to come back with 32 runs,
    charged in full. Refused (nothing charged), naming the runs recorded; a cap at or above them replays."""
    out = await _export(tmp_path, conv_a100)
    async with running(tmp_path / "b", [out]) as (client, _):
        message = await error_of(client, "measure_kernel", {"kernel": conv("f", FAST), "max_runs": 3})
        assert "32 runs" in message and "max_runs=3" in message
        status = await call(client, "budget_status", {})
        assert status["spent_gpu_seconds"] == 0.0 and status["reserved_gpu_seconds"] == 0.0
        again = await call(client, "measure_kernel", {"kernel": conv("f", FAST), "max_runs": 32})
        assert again["status"] == "ok" and again["runtime_ms"]["runs"] == 32


async def test_a_kernel_missing_from_an_export_is_named_in_compare_kernels(
    tmp_path: Path, conv_a100: Path
) -> None:
    """measure_if_unsure measures several kernels: the refusal must say which one the export lacks."""
    out = await _export(tmp_path, conv_a100)
    async with running(tmp_path / "b", [out]) as (client, _):
        missing = conv("wide", {**FAST, "block_size_x": 64})
        out = await call(
            client,
            "compare_kernels",
            {
                "candidates": [missing, conv("fast", FAST), conv("slow", SLOW)],
                "measure_if_unsure": True,
                "target_error": 0.001,
            },
        )
        # The baseline cannot be measured, so nothing is: the forecasts come back with the reason.
        (note,) = [n for n in out["notes"] if n.startswith("measure_if_unsure measured nothing")]
        assert "'wide'" in note and "Nothing was charged" in note
        assert out["measurements"] == [] and out["gpu_seconds_charged"] == 0
        assert {c["decided_by"] for c in out["candidates"]} == {"forecast"}


async def test_an_export_named_twice_keeps_the_device_fingerprint(tmp_path: Path, conv_a100: Path) -> None:
    """The fingerprint keys the second server's cache: naming the same export twice (a file and its folder)
    must not change it, as naming a Kernel Tuner file twice does not."""
    out = await _export(tmp_path, conv_a100)
    once = ReplayMeasurer([out])
    twice = ReplayMeasurer([out, out.parent])
    device = once.devices()[0]
    assert twice.device_fingerprint(device) == once.device_fingerprint(device)


async def test_export_of_a_device_with_nothing_stored_names_the_devices_that_have_measurements(
    tmp_path: Path, conv_a100: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--device A100` reads as the A100-SXM4-80GB: the operator's next move is the name the store uses."""
    await _export(tmp_path, conv_a100)
    capsys.readouterr()
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(tmp_path / "x.jsonl"), "--device", "A100"]
    assert await anyio.to_thread.run_sync(main, argv) == 2
    err = capsys.readouterr().err
    assert "nothing to export" in err and "A100-PCIE-40GB" in err
    assert not (tmp_path / "x.jsonl").exists()


async def test_export_skips_a_stored_kernel_an_older_version_accepted_and_this_one_refuses(
    tmp_path: Path, conv_a100: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    await _export(tmp_path, conv_a100)
    capsys.readouterr()
    db = tmp_path / "a" / "forecaster.sqlite3"
    with sqlite3.connect(db) as conn:  # a kernel id with a tab, as stored before ids had to be one line
        conn.execute(
            "UPDATE measurements SET kernel_json = json_set(kernel_json, '$.id', 'fa\tst') WHERE id = 1"
        )
    out = tmp_path / "again.jsonl"
    assert (
        await anyio.to_thread.run_sync(main, ["--home", str(tmp_path / "a"), "export", "--out", str(out)])
        == 0
    )
    captured = capsys.readouterr()
    assert "skipped 1 stored measurement(s) this version no longer accepts" in captured.err
    assert len(out.read_text().splitlines()) == 1 and "exported 1 measurements" in captured.out
