"""benchmarks/tune_local.py's reports run on the recordings they are pointed at."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from forecaster_mcp.measure.replay import load_space

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tune_local


def test_latency_report_runs_on_a_space_with_failed_configurations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The convolution recordings have configurations that failed to compile or launch (no runs): the latency
    report over them (`latency --latency-space conv-A100`) stopped with 'no median for empty data'."""
    values = [16 * k for k in range(1, 31)]
    cache: dict[str, dict[str, object]] = {}
    for bx in values:
        t = 1.0 + 0.05 * abs(bx - 256) / 16
        cache[str(bx)] = {"bx": bx, "time": t, "times": [t, t * 1.01, t * 0.99]}
    cache["16"]["time"] = "CompilationFailedConfig"
    cache["32"]["time"] = "RuntimeFailedConfig"
    for failed in ("16", "32"):
        del cache[failed]["times"]
    doc = {
        "device_name": "NVIDIA A100-PCIE-40GB",
        "kernel_name": "kk",
        "problem_size": [1024],
        "tune_params_keys": ["bx"],
        "tune_params": {"bx": values},
        "objective": "time",
        "cache": cache,
    }
    path = tmp_path / "failing.json"
    path.write_text(json.dumps(doc))
    space = load_space(path)
    assert sum(1 for e in space.entries if not e.times) == 2
    monkeypatch.setitem(tune_local._SPACES, "failing", space)
    out = tune_local.latency_report(repeats=2, name="failing")
    assert len(out) == 6
    assert all(math.isfinite(v) for row in out.values() for v in row.values())
