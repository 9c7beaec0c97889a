"""`forecaster-mcp eval` and `make-pairs` through the CLI entry point."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forecaster_mcp.cli import main
from forecaster_mcp.forecast import metrics as M
from forecaster_mcp.forecast.base import MAX_CONFIDENCE
from forecaster_mcp.forecast.evaluate import MemoryHistory, read_pairs_file
from forecaster_mcp.hardware.specs import canonical_name
from forecaster_mcp.models import Kernel, Workload

SRC = """
__global__ void scale(float* out, const float* in, int n) {
    int i = blockIdx.x * BLOCK + threadIdx.x;
    if (i < n) out[i] = 2.0f * in[i];
}
"""
WORKLOAD = {
    "args": [
        {"name": "out", "dtype": "float32", "shape": [1 << 20], "intent": "out"},
        {"name": "in", "dtype": "float32", "shape": [1 << 20]},
        {"name": "n", "dtype": "int32", "value": 1 << 20},
    ],
    "problem": {"n": 1 << 20},
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _kernel(block: int) -> dict[str, Any]:
    return {
        "source": SRC,
        "entry": "scale",
        "defines": {"BLOCK": block},
        "launch": {"grid": [(1 << 20) // block, 1, 1], "block": [block, 1, 1]},
    }


def _pair(i: int, base: int, cand: int, speedup: float, hardware: str = "A100") -> dict[str, Any]:
    return {
        "id": f"p{i}",
        "hardware": hardware,
        "workload": WORKLOAD,
        "baseline": _kernel(base),
        "candidate": _kernel(cand),
        "speedup": speedup,
        "source": "hand-written",
    }


def _write(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


TINY = [
    _pair(0, 32, 256, 1.8),
    _pair(1, 256, 32, 1 / 1.8),
    _pair(2, 128, 256, 1.01),  # a tie
    _pair(3, 64, 512, 1.3),
    _pair(4, 512, 64, 0.7),
    _pair(5, 1024, 128, 1.1, hardware="H100"),
]


def test_eval_writes_metrics_predictions_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", [*TINY])
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out), "--target-error", "0.2"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["n_pairs"] == 6 and report["target_error"] == 0.2
    assert report["forecaster"]["name"] == "local"
    final = report["final"]
    assert final["n_pairs"] == 6 and final["n_ties"] == 1
    assert set(report["thresholds"]) == {canonical_name("A100"), canonical_name("H100")}
    for choice in report["thresholds"].values():
        assert choice["source"] == "default" and choice["threshold"] == pytest.approx(0.9)
    # No history: every forecast came from the static prior, which has its own (default) threshold per GPU.
    assert set(report["thresholds_static_prior"]) == set(report["thresholds"])
    assert all("static prior" in c["reason"] for c in report["thresholds_static_prior"].values())
    assert report["components"]["local"]["n_answered"] == 6

    # The metrics agree with the per-pair predictions written beside them.
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["id"] for p in preds] == [f"p{i}" for i in range(6)]
    p_faster = [p["p_faster"] for p in preds]
    speedups = [p["speedup"] for p in preds]
    assert final["pairwise_accuracy"] == pytest.approx(M.pairwise_accuracy(p_faster, speedups))
    assert final["brier"] == pytest.approx(M.brier(p_faster, speedups))
    assert final["ece"] == pytest.approx(M.ece(p_faster, speedups))
    decided = M.decided_summary([p["verdict"] for p in preds], speedups)
    assert final["coverage"] == pytest.approx(decided.coverage)
    assert all(p["verdict"] == "unsure" or max(p["p_faster"], 1 - p["p_faster"]) >= 0.9 for p in preds)

    for name in ("reliability.png", "risk_coverage.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:3] == ["forecaster", "pairs", "acc"]
    assert "local final" in printed and "threshold on" in printed
    # cover counts ties; the non-tie coverage (the denominator of aurc and risk@) is reported beside it.
    assert final["coverage_non_tie"] == pytest.approx(decided.n_decided_scored / 5)
    assert "over the non-tie pairs" in printed


def test_eval_of_only_ties_says_its_plots_are_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", [_pair(0, 128, 256, 1.01), _pair(1, 64, 512, 0.99)])
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out)]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["final"]["n_ties"] == 2
    # The plots are still written (a stale pair from an earlier run would pass for this one), and say why
    # they hold no line.
    assert report["plots"] == ["reliability.png", "risk_coverage.png"]
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert any("every pair is a tie" in n for n in report["notes"])
    assert "note: plots are empty" in capsys.readouterr().out


def test_eval_notes_repeated_questions_and_pairs_the_history_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = {
        "history": [
            {"hardware": "A100", "workload": WORKLOAD, "kernel": _kernel(b), "runtime_ms": t}
            for b, t in ((32, 2.0), (256, 1.0))
        ]
    }
    pairs = _write(tmp_path / "pairs.jsonl", [history, *TINY, {**TINY[1], "id": "again"}])
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out)]) == 0
    notes = json.loads((out / "metrics.json").read_text())["notes"]
    assert any(
        "3 pair(s) ask the same question as an earlier one" in n and "again (as p0)" in n for n in notes
    )
    assert any("3 pair(s) have both kernels in the file's history (the first: p0)" in n for n in notes)


def test_eval_notes_pairs_of_different_kernels_without_a_launch(tmp_path: Path) -> None:
    """A kernel with no launch, given or read from its host code, turns the prior's launch terms off: said."""
    other = {**_kernel(256), "source": SRC.replace("scale", "scale2"), "entry": "scale2"}
    bare = {k: v for k, v in other.items() if k != "launch"}
    hosted = {
        **bare,
        "source": bare["source"] + "\nvoid run(float* x, int n) { scale2<<<n / 256, 256>>>(x, n); }\n",
    }
    rows = [
        {**_pair(0, 32, 256, 1.3), "candidate": other},  # launches given: nothing to say
        {**_pair(1, 32, 256, 1.3), "candidate": bare},
        {**_pair(2, 32, 256, 1.3), "candidate": hosted},  # read from its host code (WORKLOAD sizes n)
        _pair(3, 32, 256, 1.3),
    ]
    rows[3]["candidate"] = {
        k: v for k, v in rows[3]["candidate"].items() if k != "launch"
    }  # one family: no prior
    out = tmp_path / "out"
    assert main(["eval", str(_write(tmp_path / "pairs.jsonl", rows)), "--out", str(out)]) == 0
    notes = json.loads((out / "metrics.json").read_text())["notes"]
    said = [n for n in notes if "have a kernel with no launch" in n]
    assert (
        len(said) == 1 and said[0].startswith("1 pair(s) of different kernels") and "the first: p1" in said[0]
    )


def test_bad_lines_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        "not json": "not valid JSON",
        json.dumps({**TINY[0], "speedup": -1}): "'speedup' must be a positive finite number",
        json.dumps({k: v for k, v in TINY[0].items() if k != "candidate"}): "missing candidate",
        json.dumps({**TINY[0], "baseline": {"source": SRC, "entry": "not an identifier"}}): "bad baseline",
        "[1, 2]": "each line must be a JSON object",
        json.dumps({**TINY[0], "speedup": 10**400}): "'speedup' must be a positive finite number",
        '{"speedup": ' + "9" * 5000 + "}": "not a pairs line this reader accepts (ValueError)",
        "[" * 100_000 + "]" * 100_000: "not a pairs line this reader accepts (RecursionError)",
        json.dumps({**TINY[1], "id": TINY[0]["id"]}): f"pair id {TINY[0]['id']!r} is already used on line 1",
        # A status typo made a measured kernel a failure (its runtime dropped), silently.
        json.dumps(
            {
                "history": {
                    "hardware": "A100",
                    "workload": WORKLOAD,
                    "kernel": _kernel(64),
                    "status": "OK",
                    "runtime_ms": 1.0,
                }
            }
        ): "unknown status 'OK': one of ok, compile_error",
        json.dumps({**TINY[1], "history": []}): "a line is a pair or holds history points",
        # A history point of no GPU ("None", 5) was read, matched no pair and taught nothing, silently.
        json.dumps(
            {"history": {"hardware": None, "workload": WORKLOAD, "kernel": _kernel(64), "runtime_ms": 1.0}}
        ): "'hardware' must be a GPU name",
        json.dumps(
            {"history": {"hardware": 5, "workload": WORKLOAD, "kernel": _kernel(64), "runtime_ms": 1.0}}
        ): ("'hardware' must be a GPU name"),
        json.dumps({**TINY[1], "id": {"a": 1}}): "'id' must be a string or an integer",
    }
    for bad, message in cases.items():
        pairs = _write(tmp_path / "bad.jsonl", [TINY[0], "", bad])
        assert main(["eval", str(pairs), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert f"bad.jsonl:3: {message}" in err, err
    # Bytes that are not UTF-8 are named by line and column too, not by an offset into the file.
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(json.dumps(TINY[0]).encode() + b"\n" + b'{"id": "caf\xe9"}\n')
    assert main(["eval", str(raw), "--out", str(tmp_path / "o")]) == 2
    assert "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 12)" in capsys.readouterr().err
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(TINY[0]).encode() + b"\n")
    assert len(read_pairs_file(bom).pairs) == 1  # a byte-order mark is skipped, not refused
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_a_bad_kernel_line_says_what_the_validator_said_without_pydantics_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = {**TINY[0], "baseline": {"source": SRC, "entry": "not an identifier"}}
    pairs = _write(tmp_path / "bad.jsonl", [bad])
    assert main(["eval", str(pairs), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: bad baseline: entry: entry 'not an identifier' is not a C identifier" in err, err
    assert "Value error" not in err


def test_a_null_id_is_named_by_its_line(tmp_path: Path) -> None:
    """It was the string 'None', so a second null id (or a pair named "None") clashed with it."""
    pairs = _write(tmp_path / "ids.jsonl", [{**TINY[0], "id": None}, {**TINY[1], "id": "None"}])
    assert [p.id for p in read_pairs_file(pairs).pairs] == ["line1", "None"]


def test_a_line_separator_inside_a_string_is_not_a_line_break(tmp_path: Path) -> None:
    # JSON writers leave U+2028 / U+0085 unescaped with ensure_ascii=False; only "\n" ends a line.
    row = {**TINY[0], "baseline": {**TINY[0]["baseline"], "source": "// a\u2028b\u0085c\n" + SRC}}
    path = tmp_path / "u.jsonl"
    path.write_text(
        json.dumps(row, ensure_ascii=False) + "\r\n" + json.dumps(TINY[1]) + "\n", encoding="utf-8"
    )
    pairs = read_pairs_file(path)
    assert [p.line for p in pairs.pairs] == [1, 2]
    assert "\u2028" in pairs.pairs[0].baseline.source


def test_bad_options_are_operator_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", [*TINY])
    assert main(["eval", str(pairs), "--forecaster", "oracle"]) == 2
    assert "local, claude or local+claude" in capsys.readouterr().err
    assert main(["eval", str(pairs), "--forecaster", "claude"]) == 2
    assert "ANTHROPIC_API_KEY" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read pairs file" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", [""])
    assert main(["eval", str(empty)]) == 2
    assert "no pairs" in capsys.readouterr().err
    # The range compare_kernels accepts: 5e-324 was a ValueError traceback from the threshold maths.
    for bad in ("5e-324", "0", "0.5"):
        assert main(["eval", str(pairs), "--target-error", bad]) == 2
        assert "--target-error must be at least 0.0001 and below 0.5" in capsys.readouterr().err


@pytest.mark.anyio
async def test_in_file_history_feeds_the_family_model(tmp_path: Path) -> None:
    hist = [
        {
            "history": {
                "hardware": "A100",
                "workload": WORKLOAD,
                "kernel": _kernel(b),
                "runtime_ms": 1.0 + b / 1000,
            }
        }
        for b in (32, 64, 128)
    ]
    failed_point: dict[str, Any] = {
        "hardware": "A100",
        "workload": WORKLOAD,
        "kernel": _kernel(256),
        "status": "timeout",
    }
    as_list: dict[str, Any] = {"history": [failed_point]}  # a line may hold a list of points
    hist.append(as_list)
    parsed = read_pairs_file(_write(tmp_path / "p.jsonl", [*hist, TINY[0]]))
    assert len(parsed.pairs) == 1 and len(parsed.history) == 4
    history = MemoryHistory(parsed.history)
    k = Kernel.model_validate(_kernel(32))
    points = await history.family_points(
        k.family_key(), canonical_name("A100"), Workload.model_validate(WORKLOAD).key()
    )
    assert sorted(p.defines["BLOCK"] for p in points) == [32, 64, 128, 256]
    failed = next(p for p in points if p.defines["BLOCK"] == 256)
    assert failed.status == "timeout" and failed.runtime_ms is None
    assert await history.family_points(k.family_key(), canonical_name("H100"), "x") == []


def test_make_pairs_then_eval_with_calibration(
    conv_a100: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from forecaster_mcp.measure.replay import load_space

    pairs, cal, again = tmp_path / "pairs.jsonl", tmp_path / "cal.jsonl", tmp_path / "again.jsonl"
    assert main(["make-pairs", str(conv_a100), "-n", "80", "--seed", "1", "--out", str(pairs)]) == 0
    assert main(["make-pairs", str(conv_a100), "-n", "80", "--seed", "1", "--out", str(again)]) == 0
    assert pairs.read_bytes() == again.read_bytes()  # the seed fixes the sample
    assert main(["make-pairs", str(conv_a100), "-n", "120", "--seed", "2", "--out", str(cal)]) == 0
    out = capsys.readouterr().out
    assert "wrote 80 pairs" in out and "recordings" not in out  # "from 1 recording"

    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert len(rows) == 80 and len({r["id"] for r in rows}) == 80
    # The same recording twice: ids stay unique, so eval reads the file.
    twice = tmp_path / "twice.jsonl"
    assert main(["make-pairs", str(conv_a100), str(conv_a100), "-n", "5", "--out", str(twice)]) == 0
    assert len({p.id for p in read_pairs_file(twice).pairs}) == 10
    # ... and each copy is a family of its own: with history, one copy's history points (the same kernels and
    # runtimes) answered the other copy's pairs.
    both = tmp_path / "both.jsonl"
    argv = ["make-pairs", str(conv_a100), str(conv_a100), "-n", "40", "--history", "200", "--out", str(both)]
    assert main(argv) == 0
    read = read_pairs_file(both)
    history = {(h.hardware, h.kernel.content_key()) for h in read.history}
    assert not any(
        (p.hardware, k.content_key()) in history for p in read.pairs for k in (p.baseline, p.candidate)
    )
    space = load_space(conv_a100)
    medians = {tuple(sorted(e.params.items())): statistics.median(e.times) for e in space.entries if e.ok}
    for r in rows[:10]:
        assert r["baseline"]["entry"] == r["candidate"]["entry"] == space.kernel_name
        assert r["baseline"]["source"] == r["candidate"]["source"]  # one family
        t_base = medians[tuple(sorted(r["baseline"]["defines"].items()))]
        t_cand = medians[tuple(sorted(r["candidate"]["defines"].items()))]
        assert r["speedup"] == pytest.approx(t_base / t_cand)
        assert r["hardware"] == space.device

    # Calibrating on the pairs being scored grades the forecaster on its own calibration: refused.
    assert main(["eval", str(pairs), "--calibrate-on", str(pairs), "--out", str(tmp_path / "self")]) == 2
    assert "80 of the 80 pairs" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--calibrate-on", str(cal), "--out", str(out)]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["calibration_pairs"] == 120 and report["n_pairs"] == 80
    assert "calibrated" in report["components"]["local"]
    # No measured history: every pair is answered by the static prior, whose threshold its calibration pairs set.
    assert report["forecasts_per_regime"] == {"model": 0, "unmeasured": 0, "prior": 80}
    [choice] = report["thresholds_static_prior"].values()
    assert 40 < choice["n_history"] <= 60  # the odd half of the calibration file, ties left out
    assert not math.isnan(report["final"]["multiclass_brier"])
    assert "local calibrated" in capsys.readouterr().out


def test_history_in_the_pairs_file_teaches_the_local_model(conv_a100: Path, tmp_path: Path) -> None:
    from forecaster_mcp.forecast.evaluate import make_pairs

    pairs, history = make_pairs([conv_a100], 150, seed=3, history_per_recording=60)
    assert len(pairs) == 150 and len(history) == 60
    measured = {json.dumps(h["history"]["kernel"]["defines"], sort_keys=True) for h in history}
    for p in pairs:  # no pair kernel is in the history: the model must predict both
        for side in ("baseline", "candidate"):
            assert json.dumps(p[side]["defines"], sort_keys=True) not in measured
    path = _write(tmp_path / "hist.jsonl", [*history, *pairs])
    out = tmp_path / "out"
    assert main(["eval", str(path), "--out", str(out)]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["history_points"] == 60
    # Both kernels of every pair are predictions: their own regime and threshold.
    assert report["forecasts_per_regime"] == {"model": 0, "unmeasured": 150, "prior": 0}
    assert "neither kernel measured" in next(iter(report["thresholds_unmeasured"].values()))["reason"]
    # The family model learns from 60 measurements what the bare prior cannot know.
    assert report["final"]["pairwise_accuracy"] > 0.7


def test_eval_refuses_an_out_it_cannot_write_before_forecasting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--forecaster claude` without a key fails when the forecasters are built, just before forecasting: an --out
    error in its place shows the folder was checked first."""
    pairs = _write(tmp_path / "pairs.jsonl", [*TINY])
    cases = {
        str(pairs): "is an existing file, not a folder",
        str(pairs / "sub"): "Not a directory",
        "/proc/forecaster-mcp-no-such-dir/out": "No such file or directory",
    }
    for out, message in cases.items():
        assert main(["eval", str(pairs), "--out", out, "--forecaster", "claude"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("forecaster-mcp: ") and f"--out {out}" in err and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert pairs.read_text().count("\n") == len(TINY)  # the file named as --out is left alone


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_eval_refuses_a_read_only_out_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", [*TINY])
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["eval", str(pairs), "--out", str(ro), "--forecaster", "claude"]) == 2
        assert "Permission denied" in capsys.readouterr().err
        assert main(["eval", str(pairs), "--out", str(ro / "new"), "--forecaster", "claude"]) == 2
        assert "Permission denied" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


def test_eval_notes_gpus_it_has_no_specification_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        *TINY,
        _pair(6, 32, 64, 1.2, hardware="Quadro-XYZ-9000"),
        _pair(7, 64, 32, 0.8, "Quadro-XYZ-9000"),
    ]
    pairs = _write(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out)]) == 0
    [note] = [n for n in json.loads((out / "metrics.json").read_text())["notes"] if "Quadro-XYZ-9000" in n]
    assert "no specification known for GPU 'Quadro-XYZ-9000'" in note and "its 2 pairs" in note
    assert f"note: {note}" in capsys.readouterr().out
    assert not any(
        "A100" in n or "H100" in n for n in json.loads((out / "metrics.json").read_text())["notes"]
    )


def test_make_pairs_refuses_negative_history_and_unwritable_out(
    conv_a100: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pairs.jsonl"
    assert main(["make-pairs", str(conv_a100), "-n", "10", "--history", "-3", "--out", str(out)]) == 2
    assert "--history must be 0 or more, got -3" in capsys.readouterr().err
    assert not out.exists()
    # The --out check comes before the recordings are read (this one does not exist).
    blocker = _write(tmp_path / "file.txt", ["x"])
    missing = tmp_path / "missing.json.gz"
    assert main(["make-pairs", str(missing), "--out", str(blocker / "pairs.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forecaster-mcp: cannot write --out ") and "is a file, not a folder" in err
    # An export file replays kernels but holds no space to draw from: said as search and demo say it.
    export = _write(tmp_path / "measured.jsonl", ['{"kernel": {}}', '{"kernel": {}}'])
    assert main(["make-pairs", str(export), "--out", str(out)]) == 2
    assert "measured.jsonl is a `forecaster-mcp export` file" in capsys.readouterr().err


def test_eval_batch_sends_claude_through_the_batches_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--batch: every pair goes through the Message Batches API (half price), none through /v1/messages."""
    from _anthropic_mock import AnthropicMock, tool_answer

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    faster = [0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05]
    mock = AnthropicMock(lambda params: tool_answer(faster))

    async def no_sleep(s: float) -> None:
        return None

    def claude_only(names: Any, settings: Any, history: Any, *, ptxas: bool = True) -> list[Any]:
        assert list(names) == ["claude"]
        return [
            ClaudeForecaster(
                "test-key",
                "claude-sonnet-5",
                samples=1,
                features=None,
                http_client=mock.client(),
                sleep=no_sleep,
            )
        ]

    monkeypatch.setattr(evaluate, "build_forecasters", claude_only)
    pairs = _write(tmp_path / "pairs.jsonl", TINY)
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out), "--forecaster", "claude", "--batch"]) == 0
    assert not mock.message_bodies
    [batch] = mock.batches.values()
    assert len(batch.requests) == len(TINY)
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == len(TINY)
    assert all(p["raw"]["claude"] == pytest.approx(faster) for p in preds)
    # What the evaluation cost is in the report and on the screen (bulk evaluation is the expensive use).
    llm = json.loads((out / "metrics.json").read_text())["llm"]
    assert llm["requests"] == len(TINY) and llm["input_tokens"] == 1000 * len(TINY) and llm["cost_usd"] > 0
    assert f"claude: {len(TINY)} requests, {1000 * len(TINY)} input" in capsys.readouterr().out
    # Without Claude, --batch only lifted the chunking of the local model (4 GB for 10k pairs): refused.
    assert main(["eval", str(pairs), "--out", str(tmp_path / "local"), "--batch"]) == 2
    assert "--batch applies to the Claude forecaster" in capsys.readouterr().err


@pytest.mark.parametrize("batch", [False, True])
def test_eval_asks_claude_once_for_a_pair_the_file_holds_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: bool
) -> None:
    """A pairs file asking the same question twice (the same kernels, measured again: each is scored) paid Claude
    for each copy's samples in one chunk, and the two draws could forecast the one question differently. It is
    asked once, and both copies get that forecast."""
    from _anthropic_mock import AnthropicMock, tool_answer

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    faster = [0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05]
    mock = AnthropicMock(lambda params: tool_answer(faster))

    async def no_sleep(s: float) -> None:
        return None

    def claude_only(names: Any, settings: Any, history: Any, *, ptxas: bool = True) -> list[Any]:
        return [
            ClaudeForecaster(
                "test-key",
                "claude-sonnet-5",
                samples=2,
                features=None,
                http_client=mock.client(),
                sleep=no_sleep,
            )
        ]

    monkeypatch.setattr(evaluate, "build_forecasters", claude_only)
    repeat = {**_pair(0, 32, 256, 1.7), "id": "p0-again"}
    pairs = _write(tmp_path / "pairs.jsonl", [*TINY, repeat])
    out = tmp_path / "out"
    assert (
        main(
            ["eval", str(pairs), "--out", str(out), "--forecaster", "claude", *(["--batch"] if batch else [])]
        )
        == 0
    )
    sent = sum(len(b.requests) for b in mock.batches.values()) if batch else len(mock.message_bodies)
    assert sent == 2 * len(TINY)  # not 2 * (len(TINY) + 1)
    preds = {p["id"]: p for p in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    assert len(preds) == len(TINY) + 1 and preds["p0-again"]["raw"] == preds["p0"]["raw"]
    assert json.loads((out / "metrics.json").read_text())["llm"]["requests"] == 2 * len(TINY)


def test_eval_fails_when_no_forecaster_answered_any_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--forecaster claude` with the API failing on every request used to exit 0 and write the metrics of the
    engine's even-odds stand-in, which read as a coin-flip forecaster. Through the real SDK (mocked transport)."""
    from _anthropic_mock import AnthropicMock, error

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    mock = AnthropicMock(lambda params: error(401, "authentication_error", "invalid x-api-key"))

    def claude_only(names: Any, settings: Any, history: Any, *, ptxas: bool = True) -> list[Any]:
        return [
            ClaudeForecaster(
                "bad-key", "claude-sonnet-5", samples=1, features=None, http_client=mock.client()
            )
        ]

    monkeypatch.setattr(evaluate, "build_forecasters", claude_only)
    pairs = _write(tmp_path / "pairs.jsonl", TINY)
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out), "--forecaster", "claude"]) == 2
    err = capsys.readouterr().err
    assert "no forecaster answered any of the" in err and "claude" in err
    assert not (out / "metrics.json").exists()


def test_the_final_row_names_who_answered_when_claude_was_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # local+claude with the API refusing every request: the local forecaster answers alone, and the final
    # row said "local+claude final" as if both had.
    from _anthropic_mock import AnthropicMock, error

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    mock = AnthropicMock(lambda params: error(401, "authentication_error", "invalid x-api-key"))
    real = evaluate.build_forecasters

    def local_and_failing_claude(names: Any, settings: Any, history: Any, *, ptxas: bool = True) -> list[Any]:
        claude = ClaudeForecaster(
            "bad-key", "claude-sonnet-5", samples=1, features=None, http_client=mock.client()
        )
        return [*real(["local"], settings, history, ptxas=ptxas), claude]

    monkeypatch.setattr(evaluate, "build_forecasters", local_and_failing_claude)
    pairs = _write(tmp_path / "pairs.jsonl", TINY)
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out), "--forecaster", "local+claude"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert [c.split("@")[0] for c in report["forecaster"]["answered"]] == ["local"]
    assert "local+claude final (local answered)" in capsys.readouterr().out


def test_a_write_that_fails_midway_leaves_the_previous_run_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while writing metrics.json: the folder keeps the earlier run's files, all of them, never
    new predictions beside old metrics; and a run without matplotlib removes the earlier run's plots."""
    from forecaster_mcp import cli

    pairs = _write(tmp_path / "pairs.jsonl", [*TINY])
    small = _write(tmp_path / "small.jsonl", TINY[:2])
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = cli.write_partial

    def full_disk(path: Path, text: str) -> None:
        if path.name == "metrics.json":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(cli, "write_partial", full_disk)
    assert main(["eval", str(small), "--out", str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no partial file left either
    monkeypatch.setattr(cli, "write_partial", real)

    import forecaster_mcp.forecast.plots as plots

    def no_matplotlib() -> Any:
        raise plots.PlotsUnavailable("matplotlib is not installed")

    monkeypatch.setattr(plots, "_pyplot", no_matplotlib)
    assert main(["eval", str(small), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "predictions.jsonl"]
    assert json.loads((out / "metrics.json").read_text())["n_pairs"] == 2


def test_calibration_history_certifies_on_the_confidence_verdicts_are_decided_on() -> None:
    """A history forecast at p_faster 0.97 whose candidate fails one time in five is decided at 0.776
    (selective.decision_p), as the server stores it; eval's history recorded it at 0.97, so its thresholds
    were certified on a number its own verdicts never use."""
    from forecaster_mcp import bins
    from forecaster_mcp.forecast.base import ScriptedForecaster
    from forecaster_mcp.forecast.engine import ForecastEngine
    from forecaster_mcp.forecast.evaluate import _apply_calibration, _Calibration
    from forecaster_mcp.forecast.selective import decision_p

    engine = ForecastEngine([ScriptedForecaster()])
    recorded: list[list[float]] = []
    engine.set_history = lambda hw, p, s, r: recorded.append(list(p))  # type: ignore[method-assign]
    probs = bins.from_normal(3.0, 1.6)
    p = bins.p_faster(probs)
    cal = _Calibration(
        fit_outcomes=[], history_hw=["A100", "A100"], history_raw=[{"scripted": probs}] * 2,
        history_slots=[{}, {}], history_regimes=["model", "model"], history_speedups=[2.0, 2.0], n_pairs=4,
        history_fail=[(0.2, 0.0), (0.0, 0.0)], history_caps=[{}, {}],
    )  # fmt: skip
    _apply_calibration(engine, cal)
    assert recorded == [[pytest.approx(decision_p(p, 0.2)), pytest.approx(p)]]
    assert decision_p(p, 0.2) < p - 0.1


def test_eval_compiles_every_kernel_of_the_file_for_ptxas_features(tmp_path: Path) -> None:
    """A chunk of pairs has far more new kernels than the server's per-call compile limit (8), so eval compiled
    none of them: its forecasts had no registers or spills, and --no-ptxas changed nothing."""
    from forecaster_mcp.forecast.ptxas import find_nvcc

    if find_nvcc(None) is None:
        pytest.skip("nvcc is not installed here")
    blocks = [32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    rows: list[dict[str, Any] | str] = [
        _pair(i, b, blocks[(i + 1) % len(blocks)], 1.1) for i, b in enumerate(blocks)
    ]
    pairs = _write(tmp_path / "pairs.jsonl", rows)
    for flag, home in (([], "with"), (["--no-ptxas"], "without")):
        env = {**os.environ, "FORECASTER_MCP_HOME": str(tmp_path / home)}
        done = subprocess.run(
            [sys.executable, "-m", "forecaster_mcp", "eval", str(pairs), "--out", str(tmp_path / f"out-{home}"), *flag],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    compiled = list((tmp_path / "with" / "cache" / "ptxas").glob("*.json"))
    assert len(compiled) == len(blocks)  # one per distinct kernel, more than 8
    assert not (tmp_path / "without" / "cache" / "ptxas").exists()


_Table = dict[int, tuple[float, float]]  # a candidate's V define -> (speedup, p_faster)


class _Keyed:
    """A forecaster answering each pair's p_faster from its table; no answer for a pair not in it. Pairs in
    `lookups` are answered as the local model answers two measured kernels (both flagged measured)."""

    version = "0"

    def __init__(self, name: str, table: _Table, lookups: range = range(0), capped: range = range(0)) -> None:
        self.name, self._table, self._lookups, self._capped = name, table, lookups, capped
        self.calls: list[int] = []  # pairs asked per call

    async def forecast(self, queries: Any) -> list[Any]:
        from forecaster_mcp.forecast.base import BinForecast

        self.calls.append(len(queries))
        out: list[Any] = []
        for q in queries:
            v = int(q.candidate.defines["V"])
            row = self._table.get(v)
            if row is None:
                out.append(None)
            else:
                pf = row[1]
                extras = {"measured": 1.0, "baseline_measured": 1.0} if v in self._lookups else {}
                if v in self._capped:
                    extras[MAX_CONFIDENCE] = 0.85  # as the local model caps a young family's estimate
                out.append(BinForecast([(1 - pf) / 4] * 4 + [pf / 4] * 4, "keyed", extras))
        return out


def _keyed_kernel(v: int) -> dict[str, Any]:
    return {**_kernel(128), "defines": {"BLOCK": 128, "V": v}}


def _table_files(tmp_path: Path, cal_table: _Table, main_table: _Table) -> tuple[Path, Path]:
    """A calibration file and a pairs file with a pair per table entry (its candidate's V define, its speedup)."""
    files = []
    for name, table in (("cal", cal_table), ("main", main_table)):
        rows: list[dict[str, Any] | str] = [
            {"id": f"{name}{i}", "hardware": "A100", "workload": WORKLOAD, "baseline": _keyed_kernel(10_000 + i),
             "candidate": _keyed_kernel(i), "speedup": s}
            for i, (s, _) in table.items()
        ]  # fmt: skip
        files.append(_write(tmp_path / f"{name}.jsonl", rows))
    return files[0], files[1]


def _keyed_files(tmp_path: Path) -> tuple[Path, Path, _Table, _Table]:
    """A calibration file of 160 pairs (right 9 times in 10, confidences 0.6 to 0.95) and 20 pairs to score (raw
    p_faster 0.7, all faster); the tables say each pair's speedup and forecast p_faster."""
    cal_table = {}
    for i in range(160):
        right = 0.6 + 0.35 * (i % 7) / 6
        speedup = 2.0 if (i // 2) % 2 == 0 else 0.5
        cal_table[i] = (speedup, right if (speedup > 1) == (i % 10 > 0) else 1 - right)
    main_table = {i: (2.0, 0.7) for i in range(1000, 1020)}
    return *_table_files(tmp_path, cal_table, main_table), cal_table, main_table


def _eval_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: tuple[Path, Path], *forecasters: Any
) -> list[str]:
    """Eval (target error 0.3) of files[1] calibrated on files[0] with these forecasters; the verdicts."""
    from forecaster_mcp.forecast import evaluate

    cal, pairs = files
    monkeypatch.setattr(evaluate, "build_forecasters", lambda *a, **k: list(forecasters))
    out = tmp_path / "out"
    argv = ["eval", str(pairs), "--calibrate-on", str(cal), "--out", str(out), "--target-error", "0.3"]
    assert main([*argv, "--forecaster", "+".join(f.name for f in forecasters)]) == 0
    return [json.loads(line)["verdict"] for line in (out / "predictions.jsonl").read_text().splitlines()]


def test_a_forecast_missing_a_component_is_decided_at_the_default_as_the_server_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Claude answered none of the scored pairs: the local model's answers alone (0.674 calibrated) were decided
    'faster' at the 0.574 the combination's history certified; the server decides such forecasts at no lower
    than the default (0.85 for target 0.3): unsure."""
    cal, pairs, cal_table, main_table = _keyed_files(tmp_path)
    local, claude = _Keyed("local", {**cal_table, **main_table}), _Keyed("claude", cal_table)
    verdicts = _eval_keyed(tmp_path, monkeypatch, (cal, pairs), local, claude)
    out = capsys.readouterr().out
    assert "threshold on A100-SXM4-80GB: 0.574" in out  # certified on the combination's history
    assert set(verdicts) == {"unsure"}
    assert "20 pair(s) lack a component's answer" in out


def test_capped_forecasts_are_not_said_to_lack_a_component(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forecast its forecaster capped (base.MAX_CONFIDENCE) is decided at no lower than the default, as a
    partial one is; the report said all 20 "lack a component's answer", which none did."""
    cal, pairs, cal_table, main_table = _keyed_files(tmp_path)
    local = _Keyed("local", {**cal_table, **main_table}, capped=range(1000, 1020))
    verdicts = _eval_keyed(tmp_path, monkeypatch, (cal, pairs), local)
    out = capsys.readouterr().out
    assert set(verdicts) == {"unsure"}
    assert "lack a component's answer" not in out
    assert "20 pair(s) are capped by their forecaster" in out


def test_calibration_pairs_missing_a_component_certify_no_threshold_of_the_combination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Claude answered none of the calibration pairs: the local model's answers alone certified 0.585 for
    local+claude, and its forecasts at 0.687 were decided 'faster'. The server stores such forecasts under the
    local model's name: the combination has no history, so its default (0.85) stands."""
    cal, pairs, cal_table, main_table = _keyed_files(tmp_path)
    local, claude = _Keyed("local", {**cal_table, **main_table}), _Keyed("claude", main_table)
    verdicts = _eval_keyed(tmp_path, monkeypatch, (cal, pairs), local, claude)
    assert "threshold on A100-SXM4-80GB: 0.850" in capsys.readouterr().out
    assert set(verdicts) == {"unsure"}


def test_calibration_pairs_the_history_answers_neither_calibrate_nor_certify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibration file whose history measures both kernels of 100 of its 200 pairs: those are answered from
    the measurements (0.9999, right), which the server neither stores nor learns from. Eval counted them: with
    the other forecasts right only 60% of the time at 0.7, they certified 0.645 (20 errors in 100) and every
    scored pair, as good as those forecasts, was decided: 40% of them wrong against a target of 0.3."""

    def forecast(i: int, right: bool, p: float) -> tuple[float, float]:
        speedup = 2.0 if (i // 2) % 2 == 0 else 0.5
        return speedup, p if (speedup > 1) == right else 1 - p

    cal_table = {
        i: forecast(i, True, 0.9999) if i < 100 else forecast(i, i % 5 >= 2, 0.7) for i in range(200)
    }
    main_table = {i: forecast(i, i % 5 >= 2, 0.7) for i in range(1000, 1040)}
    local = _Keyed("local", {**cal_table, **main_table}, lookups=range(100))
    verdicts = _eval_keyed(tmp_path, monkeypatch, _table_files(tmp_path, cal_table, main_table), local)
    assert set(verdicts) == {"unsure"}  # nothing certified on 50 forecasts erring 40% of the time
    notes = json.loads((tmp_path / "out" / "metrics.json").read_text())["notes"]
    assert any("100 pair(s) have both kernels in the file's history" in n for n in notes)


def test_calibration_pairs_are_forecast_in_chunks_as_the_scored_pairs_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--calibrate-on forecast its whole file in one call, while the scored pairs go EVAL_CHUNK_PAIRS at a time
    (the local model predicts a call's unmeasured kernels jointly): 10,000 dedispersion pairs with 100 history
    points took 4.2 GB and 44.5 s as the calibration file, 325 MB and 13 s as the scored one."""
    from forecaster_mcp.forecast import evaluate

    monkeypatch.setattr(evaluate, "EVAL_CHUNK_PAIRS", 4)
    cal_table, main_table = {i: (2.0, 0.7) for i in range(10)}, {i: (2.0, 0.7) for i in range(1000, 1006)}
    local = _Keyed("local", {**cal_table, **main_table})
    _eval_keyed(tmp_path, monkeypatch, _table_files(tmp_path, cal_table, main_table), local)
    assert local.calls == [4, 4, 2, 4, 2]  # the calibration file's 10 pairs, then the 6 scored


def test_calibration_thresholds_are_certified_on_every_calibration_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server certifies on its newest 2000 verified forecasts (older ones were issued under an older
    calibration); eval kept that window, so a calibration file's threshold rested on its last 2000 history pairs
    in file order, often one recording's: on 6,000 convolution then dedispersion A100 pairs, 500 of the 1,500
    convolution ones counted, and the 0.530 certified let convolution's decided verdicts err 13.1% of the
    time (target 0.1; 0.575 and 11.6% on all 2,476)."""
    cal_table = {i: (2.0 if i % 2 else 0.5, 0.9 if i % 2 else 0.1) for i in range(4100)}
    main_table = {i: (2.0, 0.9) for i in range(20_000, 20_004)}
    local = _Keyed("local", {**cal_table, **main_table})
    _eval_keyed(tmp_path, monkeypatch, _table_files(tmp_path, cal_table, main_table), local)
    threshold = json.loads((tmp_path / "out" / "metrics.json").read_text())["thresholds"]["A100-SXM4-80GB"]
    assert threshold["n_history"] == 2050  # the 2nd, 4th, ... of 4,100 calibration pairs


def test_eval_batch_still_asks_the_local_model_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--batch sends Claude's pairs as one Message Batches submission; it also sent the whole file to the local
    model in one call, which predicts a call's kernels jointly (6 GB for 11k kernels; 4.1 GB for 10k pairs).
    Claude still gets one batch; the local model (and any forecaster without batches) its EVAL_CHUNK_PAIRS
    chunks, and a chunk it answers in part keeps its part."""
    from _anthropic_mock import AnthropicMock, tool_answer

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    monkeypatch.setattr(evaluate, "EVAL_CHUNK_PAIRS", 4)
    mock = AnthropicMock(lambda params: tool_answer([0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05]))

    async def no_sleep(s: float) -> None:
        return None

    claude = ClaudeForecaster(
        "test-key", "claude-sonnet-5", samples=1, features=None, http_client=mock.client(), sleep=no_sleep
    )
    from forecaster_mcp.forecast.base import PartialForecast

    class PartlyFailing(_Keyed):
        async def forecast(self, queries: Any) -> list[Any]:
            out = await super().forecast(queries)
            if None in out:
                raise PartialForecast("failed on 1 pair", out)
            return out

    table = {i: (2.0, 0.7) for i in range(10) if i != 5}  # no local answer for pair 5 (a partial chunk)
    local = PartlyFailing("local", table)
    monkeypatch.setattr(evaluate, "build_forecasters", lambda *a, **k: [local, claude])
    _, pairs = _table_files(tmp_path, {}, {i: (2.0, 0.7) for i in range(10)})
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out), "--forecaster", "local+claude", "--batch"]) == 0
    assert local.calls == [4, 4, 2]
    [batch] = mock.batches.values()
    assert len(batch.requests) == 10 and not mock.message_bodies
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [sorted(p["raw"]) for p in preds].count(["claude", "local"]) == 9
    notes = json.loads((out / "metrics.json").read_text())["notes"]
    assert any("forecaster local skipped on 1 of 10 pairs" in n for n in notes), notes


def test_a_file_given_to_the_wrong_command_is_named_with_the_command_that_reads_it(
    conv_a100: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # eval on a recording said "not UTF-8 text (byte 0x8b at column 2)"; search and make-pairs on a pairs file
    # called it a `forecaster-mcp export` file.
    assert main(["eval", str(conv_a100)]) == 2
    err = capsys.readouterr().err
    assert "is gzip-compressed (a Kernel Tuner recording?), not a pairs file" in err
    assert f"forecaster-mcp make-pairs {conv_a100} --history 100 --out pairs.jsonl" in err
    pairs = _write(tmp_path / "pairs.jsonl", [_pair(0, 64, 128, 1.5)])
    assert main(["make-pairs", str(pairs), "--out", str(tmp_path / "more.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl is a pairs file" in err and "export" not in err
    assert main(["search", str(pairs), "--measurements", "2", "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert f"forecaster-mcp eval {pairs}` scores the forecaster on it" in err and "export" not in err


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as a terminal's Ctrl-C does, for the tests that raise one. pytest started
    as a background job of a non-interactive shell (`bash -c 'pytest ... &'`, a script's `nohup pytest &`) inherits
    SIGINT ignored, and Python leaves it so: their SIGINT had no effect, and the batch test polled forever."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)


def _raise_sigint(states: list[str]) -> None:
    """A terminal's Ctrl-C; `states` gets how SIGINT was handled then, for a failure's message."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    states.append(f"SIGINT handler {signal.getsignal(signal.SIGINT)!r}, blocked: {blocked}")
    signal.raise_signal(signal.SIGINT)


def test_an_interrupted_eval_says_what_claude_cost_and_that_nothing_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ctrl_c: None
) -> None:
    """Ctrl-C during a paid eval exited 130 without a word: the requests already answered are billed, and the
    operator was not told what they cost (the report that says it is never written). A real SIGINT, raised while
    the third request is answered, stops the run as a terminal's Ctrl-C does."""
    from _anthropic_mock import AnthropicMock, tool_answer

    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.claude import ClaudeForecaster

    faster = [0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05]
    sent = 0
    sigint: list[str] = []

    def respond(body: Any) -> Any:
        nonlocal sent
        sent += 1
        if sent == 3:
            _raise_sigint(sigint)
        return tool_answer(faster)

    mock = AnthropicMock(respond)
    built: list[ClaudeForecaster] = []

    def claude_only(names: Any, settings: Any, history: Any, *, ptxas: bool = True) -> list[Any]:
        built.append(
            ClaudeForecaster(
                "test-key",
                "claude-sonnet-5",
                samples=1,
                max_concurrency=1,
                warm_cache=False,
                features=None,
                http_client=mock.client(),
            )
        )
        return built

    monkeypatch.setattr(evaluate, "build_forecasters", claude_only)
    pairs = _write(tmp_path / "pairs.jsonl", TINY)
    out = tmp_path / "out"
    code = main(["eval", str(pairs), "--out", str(out), "--forecaster", "claude"])
    assert code == 130, f"the SIGINT did not stop the eval (exit {code}; when raised: {sigint})"
    err = capsys.readouterr().err
    [claude] = built
    spent = claude.usage_total
    assert spent.requests >= 2
    assert f"claude: {spent.requests} requests, {spent.input_tokens} input" in err
    assert f"${claude.cost_usd_total:.4f}" in err
    assert "stopped" in err and f"nothing written to {out}" in err
    assert not (out / "metrics.json").exists()


def test_an_interrupted_eval_rerun_pays_only_for_the_answers_it_did_not_get(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ctrl_c: None
) -> None:
    """Ctrl-C during a paid eval lost every answer already paid for: the rerun sent every request again. Each answer
    is now kept in the state folder as it arrives (also the one in flight at the stop, answered within the close's
    wait): the rerun asks only for what is missing, its report counts only what it paid, and its metrics are those
    of a run never stopped. Through the real eval wiring (the settings' model and samples, its state folder), with
    a real SIGINT raised while the mocked API takes its time over the fifth request."""
    import asyncio
    import hashlib
    from collections import Counter

    import httpx2
    from _anthropic_mock import AnthropicMock, tool_answer, user_text

    from forecaster_mcp.forecast import claude as claude_module

    answers = [
        [0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05],
        [0.05, 0.25, 0.5, 0.15, 0.05, 0.0, 0.0, 0.0],
        [0.0, 0.1, 0.2, 0.2, 0.2, 0.2, 0.1, 0.0],
    ]
    asked: list[str] = []
    stop_at: int | None = 5
    # Requests per prompt over one state folder's runs (the stopped one and its rerun together): a pair's second
    # sample gets the second answer whichever run asks for it.
    sampled: Counter[str] = Counter()

    def respond(body: Any) -> Any:
        text = user_text(body)
        asked.append(text)
        sampled[text] += 1
        # Each pair its own answer, and its two samples differ: a pair given another's samples shows in the metrics.
        n = int(hashlib.sha256(f"{text}{sampled[text]}".encode()).hexdigest(), 16)
        return tool_answer(answers[n % len(answers)])

    mock = AnthropicMock(respond)
    sigint: list[str] = []

    async def handle(request: httpx2.Request) -> httpx2.Response:
        if len(asked) + 1 == stop_at:
            _raise_sigint(sigint)
            await asyncio.sleep(0.3)  # answered after the stop, well within the close's wait
        return mock.handle(request)

    real = claude_module.ClaudeForecaster

    def claude(*args: Any, **kw: Any) -> Any:
        # The SDK over the mocked transport; one request at a time, so that the stop comes at a known request.
        kw.update(features=None, max_concurrency=1, warm_cache=False)
        return real(*args, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handle)), **kw)

    monkeypatch.setattr(claude_module, "ClaudeForecaster", claude)
    monkeypatch.setenv("FORECASTER_MCP_ANTHROPIC_API_KEY", "test-key")
    monkeypatch.setenv("FORECASTER_MCP_CLAUDE_MODEL", "claude-sonnet-5")
    monkeypatch.setenv("FORECASTER_MCP_CLAUDE_SAMPLES", "2")
    pairs = _write(tmp_path / "pairs.jsonl", TINY)

    def run(out: Path) -> int:
        return main(["eval", str(pairs), "--out", str(out), "--forecaster", "claude", "--no-ptxas"])

    code = run(tmp_path / "stopped")
    assert code == 130, f"the SIGINT did not stop the eval (exit {code}; when raised: {sigint})"
    err = capsys.readouterr().err
    assert "spent before the stop: claude: 5 requests" in err
    assert "the 5 Claude answer(s) received are kept in" in err and "reuses them" in err
    stopped = list(asked)
    assert len(stopped) == 5

    asked.clear()
    stop_at = None
    assert run(tmp_path / "rerun") == 0
    assert len(asked) == 2 * len(TINY) - 5
    # Over both runs every pair was asked for its two samples once: no answer received was paid for again.
    assert set(Counter(stopped + asked).values()) == {2} and len(set(stopped + asked)) == len(TINY)
    rerun = json.loads((tmp_path / "rerun" / "metrics.json").read_text())
    assert rerun["llm"]["requests"] == len(asked)  # what this run paid, the stopped run's not counted again
    assert "5 answers" in capsys.readouterr().out

    # The same pairs evaluated from scratch in another state folder, never stopped: the same forecasts.
    monkeypatch.setenv("FORECASTER_MCP_HOME", str(tmp_path / "other-home"))
    asked.clear()
    sampled.clear()
    assert run(tmp_path / "whole") == 0
    assert len(asked) == 2 * len(TINY)
    whole = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert rerun["final"] == whole["final"] and rerun["components"] == whole["components"]
    assert (tmp_path / "rerun" / "predictions.jsonl").read_text() == (
        tmp_path / "whole" / "predictions.jsonl"
    ).read_text()


def test_an_interrupted_batch_eval_bills_and_keeps_what_its_batch_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ctrl_c: None
) -> None:
    """Ctrl-C during `eval --batch`: the batch was cancelled without reading the requests it had finished. The API
    bills those, yet the stop said nothing of them and a rerun paid for them again. Now they are read after the
    cancel: counted in what the stop says was spent, kept, and the rerun's batch asks only for the rest. A real
    SIGINT, raised while the batch's status is checked."""
    import httpx2
    from _anthropic_mock import AnthropicMock, tool_answer

    from forecaster_mcp.forecast import claude as claude_module

    faster = [0.0, 0.0, 0.0, 0.05, 0.15, 0.5, 0.25, 0.05]
    mock = AnthropicMock(lambda params: tool_answer(faster), batch_never_ends=True, finished_before_cancel=2)
    signalled_at: float | None = None
    sigint: list[str] = []
    ignored = False

    def handle(request: httpx2.Request) -> httpx2.Response:
        nonlocal signalled_at, ignored
        if request.method == "GET" and request.url.path.endswith(tuple(mock.batches)):
            if signalled_at is None:
                signalled_at = time.monotonic()
                _raise_sigint(sigint)
            elif mock.batch_never_ends and time.monotonic() - signalled_at > 20:
                # Still polled 20 s after the SIGINT: the stop never came, and the batch, never ending, would be
                # polled for ever. It ends instead: the run returns and the test fails, saying why.
                ignored, mock.batch_never_ends = True, False
        return mock.handle(request)

    real = claude_module.ClaudeForecaster

    def claude(*args: Any, **kw: Any) -> Any:
        kw.update(features=None, batch_poll_interval_s=0.01)
        return real(*args, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handle)), **kw)

    monkeypatch.setattr(claude_module, "ClaudeForecaster", claude)
    monkeypatch.setenv("FORECASTER_MCP_ANTHROPIC_API_KEY", "test-key")
    monkeypatch.setenv("FORECASTER_MCP_CLAUDE_MODEL", "claude-sonnet-5")
    monkeypatch.setenv("FORECASTER_MCP_CLAUDE_SAMPLES", "1")
    pairs = _write(tmp_path / "pairs.jsonl", TINY)

    def run(out: Path) -> int:
        return main(
            ["eval", str(pairs), "--out", str(out), "--forecaster", "claude", "--no-ptxas", "--batch"]
        )

    code = run(tmp_path / "stopped")
    assert not ignored and code == 130, (
        f"the SIGINT raised at the batch's first status check did not stop the eval within 20 s (exit {code}; "
        f"when raised: {sigint})"
    )
    err = capsys.readouterr().err
    [stopped] = mock.batches.values()
    assert stopped.canceled
    assert "spent before the stop: claude: 2 requests" in err
    assert "the 2 Claude answer(s) received are kept in" in err

    mock.batch_never_ends = False
    assert run(tmp_path / "rerun") == 0
    _, rerun = mock.batches.values()
    assert (
        len(rerun.requests) == len(TINY) - 2
    )  # the two answers the stopped batch finished are not paid again


def test_pairs_no_forecaster_answered_are_counted_and_said_how_final_scores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forecaster that answered 8 of 10 pairs: its own row leaves the 2 out, the final row scores them as the
    server answers them, p_faster 0.5 (a coin flip, 0.5 in pairwise_accuracy) and unsure. The report printed
    acc 1.000 over 8 pairs and 0.900 over 10 with no word of why the two rows disagree."""
    from forecaster_mcp.forecast import evaluate
    from forecaster_mcp.forecast.base import PartialForecast

    class PartlyFailing(_Keyed):
        async def forecast(self, queries: Any) -> list[Any]:
            out = await super().forecast(queries)
            raise PartialForecast("no answer for 2 pairs", out)

    local = PartlyFailing("local", {i: (2.0, 0.9) for i in range(10) if i not in (3, 7)})
    monkeypatch.setattr(evaluate, "build_forecasters", lambda *a, **k: [local])
    _, pairs = _table_files(tmp_path, {}, {i: (2.0, 0.9) for i in range(10)})
    out = tmp_path / "out"
    assert main(["eval", str(pairs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "metrics.json").read_text())
    assert report["components"]["local"]["raw"]["pairwise_accuracy"] == pytest.approx(1.0)
    assert report["final"]["pairwise_accuracy"] == pytest.approx((8 + 0.5 + 0.5) / 10)
    assert report["final"]["n_unanswered"] == 2
    assert (
        "2 of 10 pair(s) no forecaster answered (the first: main3): the final row scores them as the server "
        "answers them, p_faster 0.5 (0.5 in pairwise_accuracy) and unsure; the components' rows leave them out"
    ) in printed
