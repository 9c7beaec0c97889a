"""Replay of Kernel Tuner cache files: loading, matching, statistics, costs and refusals."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import dataset

from forecaster_mcp.errors import NotMeasurable, OperatorError
from forecaster_mcp.measure.base import MeasureRequest
from forecaster_mcp.measure.replay import (
    ReplayMeasurer,
    load_space,
    median_ci_ranks,
    normalize_value,
    read_header,
    runtime_stats,
)
from forecaster_mcp.models import Kernel, Workload

SRC = "// recorded kernel; the source is not needed for replay\n"

# (path under the dataset folder, canonical device, kernel, entries, valid) from the dataset README.
SHARED = [
    ("cachefiles/convolution_milo/A100.json.gz", "A100-PCIE-40GB", "convolution_kernel", 4362, 4201),
    ("cachefiles/convolution_milo/A4000.json.gz", "RTX A4000", "convolution_kernel", 4362, 4201),
    ("cachefiles/convolution_milo/A6000.json.gz", "RTX A6000", "convolution_kernel", 4362, 3889),
    ("cachefiles/convolution_milo/A6000_original.json.gz", "RTX A6000", "convolution_kernel", 2442, 2266),
    ("cachefiles/convolution_milo/MI250X.json.gz", "MI250X", "convolution_kernel", 4362, 4362),
    ("cachefiles/convolution_milo/W6600.json.gz", "Radeon PRO W6600", "convolution_kernel", 4362, 4362),
    ("cachefiles/convolution_milo/W7800.json.gz", "Radeon PRO W7800", "convolution_kernel", 4362, 4246),
    ("cachefiles/dedispersion_milo/A100.json.gz", "A100-PCIE-40GB", "dedispersion_kernel", 11130, 11130),
    ("cachefiles/dedispersion_milo/A4000.json.gz", "RTX A4000", "dedispersion_kernel", 11130, 11130),
    ("cachefiles/dedispersion_milo/A6000.json.gz", "RTX A6000", "dedispersion_kernel", 11130, 11130),
    ("cachefiles/dedispersion_milo/MI250X.json.gz", "MI250X", "dedispersion_kernel", 11130, 11130),
    ("cachefiles/dedispersion_milo/W6600.json.gz", "Radeon PRO W6600", "dedispersion_kernel", 11130, 11130),
    ("cachefiles/dedispersion_milo/W7800.json.gz", "Radeon PRO W7800", "dedispersion_kernel", 11130, 11130),
    ("currently_unused/cachefiles/KernelTuner data/convolution/RTX_2080_Ti.json.gz", "RTX 2080 Ti",
     "convolution_kernel", 6768, 5256),
    ("currently_unused/cachefiles/KernelTuner data/convolution/RTX_3060_laptop.json.gz", "RTX 3060 Laptop",
     "convolution_kernel", 6768, 5220),
    ("currently_unused/cachefiles/KernelTuner data/convolution/RTX_3090.json.gz", "RTX 3090",
     "convolution_kernel", 6768, 5220),
    ("currently_unused/cachefiles/KernelTuner data/convolution/RTX_Titan.json.gz", "TITAN RTX",
     "convolution_kernel", 6768, 5256),
    ("currently_unused/cachefiles/KernelTuner data/convolution_milo/a4000.json.gz", "RTX A4000",
     "convolution_kernel", 2442, 2266),
    ("currently_unused/cachefiles/KernelTuner data/convolution_milo/mi50.json.gz", "MI50",
     "convolution_kernel", 2442, 2442),
    ("currently_unused/cachefiles/KernelTuner data/pnpoly/RTX_2080_Ti.json.gz", "RTX 2080 Ti", "cn_pnpoly",
     4092, 3734),
    ("currently_unused/cachefiles/KernelTuner data/pnpoly/RTX_3060_laptop.json.gz", "RTX 3060 Laptop",
     "cn_pnpoly", 4092, 3774),
    ("currently_unused/cachefiles/KernelTuner data/pnpoly/RTX_3090.json.gz", "RTX 3090", "cn_pnpoly", 4092,
     3774),
    ("currently_unused/cachefiles/KernelTuner data/pnpoly/RTX_Titan.json.gz", "TITAN RTX", "cn_pnpoly", 4092,
     3750),
]  # fmt: skip


def _named(path: Path) -> str:
    """How results name a recording: its file name and the start of its sha256, no folders."""
    return f"{path.name}@sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def kernel(entry: str, defines: dict[str, Any], kid: str | None = None) -> Kernel:
    return Kernel(id=kid, source=SRC, entry=entry, defines=defines)


def request(k: Kernel, device: str, **kw: Any) -> MeasureRequest:
    return MeasureRequest(kernel=k, workload=Workload(), device=device, **kw)


def write_cache(
    path: Path,
    entries: dict[tuple[Any, ...], Any],
    *,
    keys: tuple[str, ...] = ("bx", "tile"),
    device: str = "NVIDIA A100-PCIE-40GB",
    kernel_name: str = "toy_kernel",
    sort_keys: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """A small Kernel Tuner cache file: entries map parameter tuples to a time (ms), a list of times or a
    failure string."""
    cache: dict[str, Any] = {}
    for values, outcome in entries.items():
        rec: dict[str, Any] = dict(zip(keys, values, strict=True))
        if isinstance(outcome, list):
            rec |= {"time": sum(outcome) / len(outcome), "times": outcome}
        else:
            rec["time"] = outcome
        rec |= {"compile_time": 800.0, "verification_time": 0, **(extra or {})}
        cache[",".join(str(v) for v in values)] = rec
    tune: dict[str, list[Any]] = {k: [] for k in keys}
    for values in entries:
        for k, v in zip(keys, values, strict=True):
            if v not in tune[k]:
                tune[k].append(v)
    doc = {
        "device_name": device,
        "kernel_name": kernel_name,
        "problem_size": [1024],
        "tune_params_keys": list(keys),
        "tune_params": tune,
        "objective": "time",
        "cache": cache,
    }
    text = json.dumps(doc, sort_keys=sort_keys)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


# The first configuration of the 10-parameter convolution space.
CONV: dict[str, Any] = {
    "block_size_x": 16,
    "block_size_y": 1,
    "tile_size_x": 1,
    "tile_size_y": 1,
    "read_only": 0,
    "use_padding": 0,
    "use_shmem": 0,
    "use_cmem": 1,
    "filter_height": 15,
    "filter_width": 15,
}

TOY = {
    (16, 1): [1.0, 1.2, 1.1, 0.9, 1.05],
    (16, 2): [2.0, 2.0, 2.1],
    (32, 1): [0.5, 0.6],
    (32, 2): "CompilationFailedConfig",
    (64, 1): "RuntimeFailedConfig",
    (64, 2): "InvalidConfig",
}


# ---------------------------------------------------------------- the shared recordings


@pytest.mark.parametrize(
    ("rel", "device", "kernel_name", "entries", "valid"), SHARED, ids=[s[0] for s in SHARED]
)
def test_every_shared_recording_loads(
    rel: str, device: str, kernel_name: str, entries: int, valid: int
) -> None:
    path = dataset(*rel.split("/"))
    header = read_header(path)
    space = load_space(path)
    assert (header.device, header.kernel_name, list(header.param_keys)) == (
        space.device,
        space.kernel_name,
        space.param_keys,
    )
    assert space.device == device and space.kernel_name == kernel_name
    assert len(space.entries) == entries
    ok = [e for e in space.entries if e.ok]
    assert len(ok) == valid
    assert space.best_time_ms == min(e.time_ms for e in ok if e.time_ms is not None)
    assert all(len(e.times) in (10, 32) for e in ok)
    assert all(e.status in ("compile_error", "launch_error") and e.message for e in space.entries if not e.ok)
    assert len(space.index()) == entries


def test_mi250x_device_comes_from_the_file_name() -> None:
    header = read_header(dataset("cachefiles", "convolution_milo", "MI250X.json.gz"))
    assert header.recorded_device_name == "" and header.device == "MI250X"


async def _measure(m: ReplayMeasurer, k: Kernel, device: str, **kw: Any) -> Any:
    return await m.measure(request(k, device, **kw))


@pytest.mark.anyio
async def test_measure_matches_recorded_times(conv_a100: Path) -> None:
    raw = json.loads(gzip.open(conv_a100).read())
    rec = raw["cache"]["16,1,1,1,0,0,0,1,15,15"]
    defines = {k: rec[k] for k in raw["tune_params_keys"]}
    m = ReplayMeasurer([conv_a100])
    assert m.devices() == ["A100-PCIE-40GB"]
    result = await _measure(m, kernel("convolution_kernel", defines, "mine"), "A100-PCIE-40GB")
    times = np.array(rec["times"])
    stats = result.runtime_ms
    assert result.status == "ok" and result.kernel_id == "mine"
    assert stats.runs == len(times) == 32
    assert stats.median == pytest.approx(np.median(times))
    assert stats.mean == pytest.approx(rec["time"])
    assert stats.min == pytest.approx(times.min())
    assert stats.p10 == pytest.approx(np.percentile(times, 10))
    assert stats.p90 == pytest.approx(np.percentile(times, 90))
    assert stats.std == pytest.approx(np.std(times, ddof=1))
    ordered = np.sort(times)
    assert (stats.ci95_low, stats.ci95_high) == (ordered[9], ordered[22])
    assert stats.relative_noise == pytest.approx((ordered[22] - ordered[9]) / 2 / np.median(times))
    assert result.device.backend == "replay" and result.device.recording == _named(conv_a100)
    assert result.device.compute_capability == "8.0"
    assert result.cost.gpu_seconds == pytest.approx(times.sum() / 1000)
    assert result.cost.compile_seconds == pytest.approx(rec["compile_time"] / 1000)
    assert not result.correctness.checked


@pytest.mark.anyio
async def test_cost_includes_recorded_verification_time(dedisp_a100: Path) -> None:
    space = load_space(dedisp_a100)
    entry = space.entries[0]
    assert entry.verification_time_ms and entry.verification_time_ms > 0
    m = ReplayMeasurer([dedisp_a100])
    result = await _measure(m, kernel("dedispersion_kernel", entry.params), "A100-PCIE-40GB", max_seconds=60)
    assert result.cost.gpu_seconds == pytest.approx((sum(entry.times) + entry.verification_time_ms) / 1000)
    again = request(kernel("dedispersion_kernel", entry.params), "A100-PCIE-40GB", max_seconds=60)
    assert m.reservation_seconds(again) == pytest.approx(result.cost.gpu_seconds)


@pytest.mark.anyio
async def test_failed_configurations_map_to_statuses_and_charge_the_device_time_recorded(
    conv_a100: Path,
) -> None:
    """A failing kernel is a result charged like any run: a configuration that failed at run time is charged
    the device time Kernel Tuner recorded for the attempt (its benchmark_time, 0.37 ms here; it was free, so a
    replayed evaluation let an agent probe failing configurations at no cost), one that never compiled
    nothing (the recording has 0 for it; its compile time is reported apart)."""
    space = load_space(conv_a100)
    m = ReplayMeasurer([conv_a100])
    for status, recorded in [
        ("compile_error", "CompilationFailedConfig"),
        ("launch_error", "RuntimeFailedConfig"),
    ]:
        entry = next(e for e in space.entries if e.message == recorded)
        result = await _measure(m, kernel("convolution_kernel", entry.params), "A100-PCIE-40GB")
        assert result.status == status and result.message is not None
        assert result.message.startswith("the recording marks this configuration as one that fails")
        assert result.message.endswith(f"(Kernel Tuner {recorded})")
        assert result.runtime_ms is None
        if status == "compile_error":
            assert result.cost.gpu_seconds == 0.0
        else:
            assert entry.failed_device_ms is not None and entry.failed_device_ms > 0
            assert (
                result.cost.gpu_seconds == pytest.approx(entry.failed_device_ms / 1000)
                and result.cost.gpu_seconds > 0
            )
        assert result.cost.compile_seconds == pytest.approx((entry.compile_time_ms or 0) / 1000)


@pytest.mark.anyio
async def test_a_failed_attempt_longer_than_max_seconds_is_a_timeout_charged_the_cap() -> None:
    """The A6000 convolution recording holds RuntimeFailedConfig entries whose attempt took 5-12 s. Under
    max_seconds=2 one was a launch_error, 'fails at run time', charged 2 s: a GPU stops the run at the cap, a
    timeout that cannot tell how it would have ended, as a run that worked and is over the cap already is."""
    path = dataset("cachefiles/convolution_milo/A6000.json.gz")
    space = load_space(path)
    entry = next(e for e in space.entries if e.failed_device_ms is not None and e.failed_device_ms > 5000)
    m = ReplayMeasurer([path])
    req = request(kernel("convolution_kernel", entry.params), "RTX A6000", max_seconds=2.0)
    result = await m.measure(req)
    assert result.status == "timeout" and result.cost.gpu_seconds == 2.0
    assert result.message is not None and "over max_seconds=2" in result.message
    assert "fails at run time" not in result.message
    assert m.reservation_seconds(req) == 2.0  # the hold is the charge
    # Under a cap it fits in, the recorded failure and its whole attempt.
    req = request(kernel("convolution_kernel", entry.params), "RTX A6000", max_seconds=20.0)
    result = await m.measure(req)
    assert result.status == "launch_error"
    assert result.cost.gpu_seconds == pytest.approx(entry.failed_device_ms / 1000)
    assert m.reservation_seconds(req) == pytest.approx(result.cost.gpu_seconds)


@pytest.mark.anyio
async def test_values_match_forgivingly_and_keys_in_any_order(conv_a100: Path) -> None:
    m = ReplayMeasurer([conv_a100])
    base = dict(CONV)
    loose: dict[str, Any] = {
        k: (str(v) if i % 2 else float(v)) for i, (k, v) in enumerate(reversed(base.items()))
    }
    a = await _measure(m, kernel("convolution_kernel", base), "A100-PCIE-40GB")
    b = await _measure(m, kernel("convolution_kernel", loose), "nvidia a100-pcie-40gb")
    assert a.runtime_ms == b.runtime_ms
    assert normalize_value("16") == normalize_value(16.0) == normalize_value(16) == 16
    assert (
        normalize_value(True) == 1 and normalize_value(" 0.5 ") == 0.5 and normalize_value("float") == "float"
    )
    # As the compiler reads the #define: "016" is octal 14 (it was answered with 16's runtime), hex is hex, and
    # what is no C number stays text (it matches no recorded number).
    assert normalize_value("016") == 14 and normalize_value("0x10") == 16 and normalize_value("1.6e1") == 16
    assert normalize_value("1_6") == "1_6" and normalize_value("16u") == 16 and normalize_value("09") == "09"
    with_octal = {**base, "block_size_x": "016"}
    with pytest.raises(NotMeasurable, match="not in the recorded space"):
        await _measure(m, kernel("convolution_kernel", with_octal), "A100-PCIE-40GB")


@pytest.mark.anyio
async def test_spaces_with_other_tuning_parameters_are_kept_apart() -> None:
    a6000 = dataset("cachefiles", "convolution_milo", "A6000.json.gz")
    original = dataset("cachefiles", "convolution_milo", "A6000_original.json.gz")
    m = ReplayMeasurer([a6000, original])
    assert m.devices() == ["RTX A6000"]
    assert len(m.spaces()) == 2
    six = {"block_size_x": 16, "block_size_y": 1, "tile_size_x": 1, "tile_size_y": 1, "read_only": 0,
           "use_padding": 0}  # fmt: skip
    ten = six | {"use_shmem": 0, "use_cmem": 1, "filter_height": 15, "filter_width": 15}
    r6 = await _measure(m, kernel("convolution_kernel", six), "RTX A6000")
    r10 = await _measure(m, kernel("convolution_kernel", ten), "RTX A6000")
    assert r6.device.recording == _named(original) and r10.device.recording == _named(a6000)


# ---------------------------------------------------------------- refusals


@pytest.mark.anyio
async def test_refusals_say_what_is_recorded(conv_a100: Path, dedisp_a100: Path) -> None:
    m = ReplayMeasurer([conv_a100, dedisp_a100])
    good = dict(CONV)

    with pytest.raises(NotMeasurable, match=r"no replay recording for device 'H100'.*A100-PCIE-40GB"):
        await _measure(m, kernel("convolution_kernel", good), "H100")

    with pytest.raises(NotMeasurable) as exc:
        await _measure(m, kernel("gemm_kernel", good), "A100-PCIE-40GB")
    assert "convolution_kernel" in str(exc.value) and "dedispersion_kernel" in str(exc.value)

    extra = good | {"UNROLL": 4}
    with pytest.raises(NotMeasurable) as exc:
        await _measure(m, kernel("convolution_kernel", extra), "A100-PCIE-40GB")
    assert "UNROLL" in str(exc.value) and "block_size_x" in str(exc.value)

    missing = {k: v for k, v in good.items() if k != "tile_size_y"}
    with pytest.raises(NotMeasurable) as exc:
        await _measure(m, kernel("convolution_kernel", missing), "A100-PCIE-40GB")
    text = str(exc.value)
    assert "Missing: tile_size_y" in text and "tile_size_y: 1, 2, 3, 4" in text

    with pytest.raises(NotMeasurable, match=r"block_size_x=17 \(allowed: 16, 32, 48"):
        await _measure(m, kernel("convolution_kernel", good | {"block_size_x": 17}), "A100-PCIE-40GB")

    # Every value allowed, but the tuner's restrictions excluded the combination.
    unrecorded = good | {"use_padding": 1}
    assert load_space(conv_a100).find(unrecorded) is None
    with pytest.raises(NotMeasurable, match=r"combination was not recorded.*closest recorded configuration"):
        await _measure(m, kernel("convolution_kernel", unrecorded), "A100-PCIE-40GB")


def test_reservation_for_a_refused_request_is_the_smallest(conv_a100: Path) -> None:
    m = ReplayMeasurer([conv_a100])
    req = request(kernel("convolution_kernel", {"x": 1}), "A100-PCIE-40GB", max_seconds=30)
    assert m.reservation_seconds(req) == 0.001
    assert m.reservation_seconds(request(kernel("k", {}), "nope", max_seconds=0.5)) == 0.001


# ---------------------------------------------------------------- files of our own


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["toy.json", "toy.json.gz"])
async def test_plain_and_gzipped_files(tmp_path: Path, name: str) -> None:
    path = write_cache(tmp_path / name, TOY)
    m = ReplayMeasurer([path])
    space = m.spaces()[0]
    assert space.best_time_ms == pytest.approx(0.55)
    assert space.problem_size == [1024] and space.tune_params == {"bx": [16, 32, 64], "tile": [1, 2]}
    result = await _measure(m, kernel("toy_kernel", {"bx": 16, "tile": 1}), "A100-PCIE-40GB")
    times = [1.0, 1.2, 1.1, 0.9, 1.05]
    assert result.runtime_ms.median == pytest.approx(1.05) and result.runtime_ms.runs == 5
    # Five samples cannot give a 95% interval of the median: the full range is reported.
    assert (result.runtime_ms.ci95_low, result.runtime_ms.ci95_high) == (min(times), max(times))
    other = await _measure(m, kernel("toy_kernel", {"bx": 64, "tile": 2}), "A100-PCIE-40GB")
    assert other.status == "launch_error" and other.cost.gpu_seconds == 0
    assert other.message is not None and other.message.endswith("(Kernel Tuner InvalidConfig)")


@pytest.mark.anyio
async def test_caps_limit_runs_and_a_run_over_the_cap_times_out(tmp_path: Path) -> None:
    path = write_cache(tmp_path / "slow.json", {(1, 1): [100.0] * 32, (1, 2): [2000.0] * 4})
    m = ReplayMeasurer([path])
    capped = await _measure(m, kernel("toy_kernel", {"bx": 1, "tile": 1}), "A100-PCIE-40GB", max_seconds=1.0)
    assert capped.runtime_ms.runs == 10 and capped.cost.gpu_seconds == pytest.approx(1.0)
    assert capped.flags == ["runs_capped_by_max_seconds"]
    few = await _measure(m, kernel("toy_kernel", {"bx": 1, "tile": 1}), "A100-PCIE-40GB", max_runs=3)
    # Three runs cannot bound the median at 95% (the range covers it 75% of the time): the result says so.
    assert few.runtime_ms.runs == 3
    assert few.flags == ["runs_capped_by_max_runs", "too_few_runs_for_interval"]
    req = request(kernel("toy_kernel", {"bx": 1, "tile": 2}), "A100-PCIE-40GB", max_seconds=1.5)
    assert m.reservation_seconds(req) == 1.5
    slow = await m.measure(req)
    assert slow.status == "timeout" and slow.cost.gpu_seconds == 1.5 and slow.runtime_ms is None


def test_later_file_wins_for_the_same_space_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = write_cache(tmp_path / "first.json", {(1, 1): [1.0, 1.0]})
    second = write_cache(tmp_path / "second.json", {(1, 1): [3.0, 3.0]})
    with caplog.at_level(logging.WARNING, logger="forecaster_mcp.measure.replay"):
        m = ReplayMeasurer([first, second])
    assert "second.json replaces" in caplog.text and "first.json" in caplog.text
    spaces = m.spaces()
    assert [s.path for s in spaces] == [second]


@pytest.mark.anyio
async def test_construction_reads_headers_only_and_first_measure_loads_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import forecaster_mcp.measure.replay as replay

    path = write_cache(tmp_path / "toy.json.gz", TOY)
    loads: list[Path] = []
    real = replay.load_space

    def counting(p: Path | str) -> Any:
        loads.append(Path(p))
        return real(p)

    monkeypatch.setattr(replay, "load_space", counting)
    m = ReplayMeasurer([path])
    assert m.devices() == ["A100-PCIE-40GB"] and m.kernels("A100-PCIE-40GB") == ["toy_kernel"]
    assert loads == []
    progress: list[tuple[float, float | None, str | None]] = []

    async def report(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    results: list[Any] = []

    async def one() -> None:
        results.append(
            await m.measure(request(kernel("toy_kernel", {"bx": 32, "tile": 1}), "A100-PCIE-40GB"))
        )

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert loads == [path]
    assert all(r.runtime_ms.median == pytest.approx(0.55) for r in results)
    await m.measure(request(kernel("toy_kernel", {"bx": 32, "tile": 1}), "A100-PCIE-40GB"), report)
    assert progress == [(1.0, 1.0, "replayed from toy.json.gz")]

    fresh = ReplayMeasurer([path])
    await fresh.measure(request(kernel("toy_kernel", {"bx": 32, "tile": 1}), "A100-PCIE-40GB"), report)
    assert progress[1:] == [
        (0.0, 1.0, "loading recording toy.json.gz"),
        (1.0, 1.0, "replayed from toy.json.gz"),
    ]


def test_fingerprint_follows_file_content(tmp_path: Path) -> None:
    path = write_cache(tmp_path / "a.json", {(1, 1): [1.0]})
    fp = ReplayMeasurer([path]).device_fingerprint("A100-PCIE-40GB")
    assert fp.startswith("replay:A100-PCIE-40GB:") and fp == ReplayMeasurer([path]).device_fingerprint(
        "nvidia a100-pcie-40gb"
    )
    write_cache(path, {(1, 1): [2.0]})
    assert ReplayMeasurer([path]).device_fingerprint("A100-PCIE-40GB") != fp
    with pytest.raises(NotMeasurable):
        ReplayMeasurer([path]).device_fingerprint("MI300X")


def test_unusual_layouts_still_load(tmp_path: Path) -> None:
    # "cache" before the other keys (sorted JSON): the header comes from a full parse.
    sorted_file = write_cache(tmp_path / "sorted.json", TOY, sort_keys=True)
    assert read_header(sorted_file).kernel_name == "toy_kernel"
    # A file Kernel Tuner left open-ended mid-run (no closing braces).
    text = write_cache(tmp_path / "full.json", TOY).read_text()
    open_ended = tmp_path / "open.json"
    open_ended.write_text(text[:-2] + ",\n")
    assert len(load_space(open_ended).entries) == len(TOY)
    # Empty device_name: the file stem names the device.
    stem = write_cache(tmp_path / "MI300X.json", TOY, device="")
    assert read_header(stem).device == "MI300X"


def test_bad_paths_are_operator_errors(tmp_path: Path) -> None:
    with pytest.raises(OperatorError, match="not found"):
        ReplayMeasurer([tmp_path / "missing.json.gz"])
    notes = tmp_path / "notes.json"
    notes.write_text('{"hello": 1}')
    with pytest.raises(OperatorError, match="not a Kernel Tuner cache file"):
        ReplayMeasurer([notes])
    # A folder: cache files inside are used, other JSON is skipped.
    write_cache(tmp_path / "toy.json", TOY)
    assert ReplayMeasurer([tmp_path]).devices() == ["A100-PCIE-40GB"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OperatorError, match="no Kernel Tuner cache files"):
        ReplayMeasurer([empty])


# ---------------------------------------------------------------- statistics


def _coverage(n: int, lo: int, hi: int) -> float:
    """P(x_(lo+1) <= median <= x_(hi+1)) for n samples of a continuous distribution."""
    return sum(math.comb(n, k) for k in range(lo + 1, hi + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 10, 20, 32, 100, 500])
def test_median_interval_is_the_narrowest_with_95_percent_coverage(n: int) -> None:
    lo, hi = median_ci_ranks(n)
    assert lo + hi == n - 1  # symmetric
    assert _coverage(n, lo, hi) >= 0.95
    assert _coverage(n, lo + 1, hi - 1) < 0.95


def test_runtime_stats_against_numpy() -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 32, 101):
        times = rng.lognormal(0.0, 0.2, n)
        s = runtime_stats(list(times))
        assert s.runs == n
        assert s.median == pytest.approx(np.median(times))
        assert s.mean == pytest.approx(times.mean())
        assert s.p10 == pytest.approx(np.percentile(times, 10))
        assert s.p90 == pytest.approx(np.percentile(times, 90))
        assert s.std == pytest.approx(np.std(times, ddof=1) if n > 1 else 0.0)
        assert s.ci95_low <= s.median <= s.ci95_high
    with pytest.raises(ValueError):
        runtime_stats([])


def test_a_recorded_runtime_of_zero_or_less_is_no_measurement(tmp_path: Path) -> None:
    from replay_kernels import small_recording

    path = small_recording(
        tmp_path / "r.json",
        {
            "32": {"bx": 32, "time": 0.0, "times": [0.0]},
            "64": {"bx": 64, "time": -1.5, "times": [-1.5]},
            "128": {"bx": 128, "time": 2.0, "times": [2.0, 2.0]},
        },
    )
    space = load_space(path)
    by_bx = {e.params["bx"]: e for e in space.entries}
    assert by_bx[128].ok and by_bx[128].time_ms == 2.0
    for bx in (32, 64):
        assert not by_bx[bx].ok and by_bx[bx].time_ms is None and "no usable time" in str(by_bx[bx].message)


def test_recorded_times_whose_sum_overflows_still_load(tmp_path: Path) -> None:
    """fsum of [1e308, 1e308] overflows and of [inf, -inf] is undefined: neither may crash a search or serve."""
    from replay_kernels import small_recording

    path = small_recording(
        tmp_path / "r.json",
        {
            "32": {"bx": 32, "time": 1e308, "times": [1e308, 1e308]},
            "64": {"bx": 64, "time": 2.0, "times": [float("inf"), float("-inf"), 2.0]},
        },
    )
    by_bx = {e.params["bx"]: e for e in load_space(path).entries}
    assert by_bx[64].ok and by_bx[64].time_ms == 2.0
    assert not by_bx[32].ok and by_bx[32].time_ms is None  # 1e308 ms is no runtime (see below)


@pytest.mark.anyio
async def test_kernel_tuners_huge_failure_times_are_failures_not_runs(tmp_path: Path) -> None:
    """Kernel Tuner's strategies record a configuration that failed or broke a restriction with the time 1e20
    (minimize's error_time) or sys.float_info.max. Read as runtimes, replaying one was a `timeout` charging the
    request's whole max_seconds ("a recorded run takes 100000000000000000000.000 ms"); they are failures,
    charged the recorded attempt, and never the best time."""
    from replay_kernels import small_recording

    path = small_recording(
        tmp_path / "r.json",
        {
            "32": {"bx": 32, "time": 1e20, "times": [1e20], "benchmark_time": 0.5},
            "64": {"bx": 64, "time": 1.7976931348623157e308, "benchmark_time": 0.0},
            "128": {"bx": 128, "time": 2.0, "times": [2.0, 2.0, 1e20]},
        },
    )
    space = load_space(path)
    by_bx = {e.params["bx"]: e for e in space.entries}
    assert space.best_time_ms == 2.0 and by_bx[128].times == [2.0, 2.0]
    m = ReplayMeasurer([path])
    for bx, charged in ((32, 0.0005), (64, 0.0)):
        r = await _measure(m, kernel("kk", {"bx": bx}), "A100-PCIE-40GB")
        assert r.status == "launch_error" and r.cost.gpu_seconds == pytest.approx(charged)
        assert "over a day" in str(r.message) and r.runtime_ms is None


@pytest.mark.anyio
async def test_recorded_runs_of_no_length_and_negative_durations_are_not_replayed(tmp_path: Path) -> None:
    # A hand-made recording with a run of -5 ms reported a minimum of -5 ms and a negative cost, and a negative
    # verification time lowered the charge (none of the shared recordings has either).
    import json

    doc = {
        "device_name": "NVIDIA A100-PCIE-40GB", "kernel_name": "k", "problem_size": [1024],
        "tune_params_keys": ["bx"], "tune_params": {"bx": [1, 2]}, "objective": "time",
        "cache": {"1": {"bx": 1, "time": 1.0, "times": [1.0, -5.0, 0.0, 1.0]},
                  "2": {"bx": 2, "time": 1.0, "times": [1.0, 1.0], "verification_time": -1e9}},
    }  # fmt: skip
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(doc))
    m = ReplayMeasurer([path])
    for bx in (1, 2):
        k = Kernel(source="x", entry="k", defines={"bx": bx})
        r = await m.measure(MeasureRequest(kernel=k, workload=Workload(), device=m.devices()[0]))
        assert (
            r.status == "ok" and r.runtime_ms is not None and r.runtime_ms.min > 0 and r.cost.gpu_seconds > 0
        )


@pytest.mark.anyio
async def test_a_recording_damaged_past_its_header_is_refused_by_name(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A truncated recording: its header reads, so the server started, and then every measurement of it
    answered the agent only "Error executing tool" (an unexpected ValueError), with a traceback per call."""
    cut = anyio.Path(tmp_path / "A100.json.gz")
    await cut.write_bytes((await anyio.Path(conv_a100).read_bytes())[:20000])
    m = ReplayMeasurer([Path(cut)])
    with pytest.raises(
        NotMeasurable, match=r"cannot read replay recording .*A100\.json\.gz.*replace or remove"
    ):
        await m.preload()
    with pytest.raises(NotMeasurable, match="cannot read replay recording"):
        await _measure(m, kernel("convolution_kernel", CONV), "A100-PCIE-40GB")


@pytest.mark.anyio
async def test_a_recording_of_an_objective_that_is_no_runtime_is_refused_by_name(tmp_path: Path) -> None:
    """The benchmark hub's hyperparameter-tuning cache files record Kernel Tuner's objective "score" and no
    "time": every configuration read as a failed run, and replaying one was a `timeout` charging the request's
    cap (its benchmark_time is 13 minutes); `search` said none of them "ran successfully". A recording whose
    objective is another observable with "time" beside it (GFLOP/s) still replays its runtimes."""
    from replay_kernels import small_recording

    score = small_recording(
        tmp_path / "score.json",
        {"32": {"bx": 32, "score": -0.4, "scores": [-0.4], "compile_time": 39.4, "benchmark_time": 786954.4}},
    )
    doc = json.loads(score.read_text())
    doc.update(objective="score", objective_higher_is_better=True)
    score.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"record no 'time' \(its objective is 'score'\)"):
        load_space(score)
    unnamed = tmp_path / "unnamed.json"
    unnamed.write_text(json.dumps({k: v for k, v in doc.items() if k != "objective"}))
    with pytest.raises(ValueError, match=r"record no 'time' \(it names no objective\)"):
        load_space(unnamed)
    m = ReplayMeasurer([score])
    with pytest.raises(NotMeasurable, match=r"record no 'time'.*score\.json|score\.json.*record no 'time'"):
        await _measure(m, kernel("kk", {"bx": 32}), "A100-PCIE-40GB")

    doc.update(objective="GFLOP/s", cache={"32": {"bx": 32, "time": 2.0, "times": [2.0], "GFLOP/s": 9.5}})
    gflops = tmp_path / "gflops.json"
    gflops.write_text(json.dumps(doc))
    r = await _measure(ReplayMeasurer([gflops]), kernel("kk", {"bx": 32}), "A100-PCIE-40GB")
    assert r.status == "ok" and r.runtime_ms is not None and r.runtime_ms.median == 2.0


def test_a_recording_with_a_byte_order_mark_reads(tmp_path: Path) -> None:
    """A cache file saved with a UTF-8 byte-order mark: load_space read it (json.loads skips the mark) but
    read_header, which serve and the measurer start from, refused it as "the file is not a JSON object";
    open-ended (Kernel Tuner's interrupted run) it did not load at all."""
    from replay_kernels import small_recording

    path = small_recording(tmp_path / "r.json", {"32": {"bx": 32, "time": 2.0, "times": [2.0]}})
    text = path.read_text()
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_header(path).kernel_name == "kk" and load_space(path).best_time_ms == 2.0
    path.write_bytes(b"\xef\xbb\xbf" + text.rstrip().removesuffix("}}").encode() + b",\n")
    assert read_header(path).kernel_name == "kk" and load_space(path).best_time_ms == 2.0


def test_a_t4_results_file_is_refused_as_what_it_is(tmp_path: Path) -> None:
    """Kernel Tuner's T4 export (the benchmark hub ships one *_T4.json.gz beside each cache file) was refused as
    "not a Kernel Tuner cache file", leaving an operator to guess why a Kernel Tuner file was not one."""
    t4 = {
        "schema_version": "1.0.0",
        "metadata": {"timeunit": "miliseconds"},
        "results": [
            {"configuration": {"bx": 32}, "times": {"compilation": 1.0, "runtimes": [2.0]},
             "invalidity": "correct", "correctness": 1,
             "measurements": [{"name": "time", "value": 2.0, "unit": ""}], "objectives": ["time"]}
        ],
    }  # fmt: skip
    path = tmp_path / "A100_T4.json.gz"
    path.write_bytes(gzip.compress(json.dumps(t4).encode()))
    for read in (read_header, load_space):
        with pytest.raises(
            ValueError, match=r"A100_T4\.json\.gz: it is a T4 results file .*cache file it was"
        ):
            read(path)


def test_a_cache_file_with_results_of_its_own_before_kernel_name_is_no_t4_file(tmp_path: Path) -> None:
    """The header scan took any top-level "results" before kernel_name for T4's: a cache file another tool
    wrote with a "results" key first was refused by read_header (so by serve) as a T4 results file, while
    load_space read it."""
    from replay_kernels import small_recording

    path = small_recording(tmp_path / "r.json", {"32": {"bx": 32, "time": 2.0, "times": [2.0]}})
    doc = json.loads(path.read_text())
    for results in ([], [1.5, 2.5], [{"bx": 32, "score": 0.9}]):
        path.write_text(json.dumps({"results": results, **doc}))
        assert read_header(path).kernel_name == "kk" and load_space(path).best_time_ms == 2.0


def test_a_large_json_file_that_is_no_cache_file_is_refused_without_rescanning_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header scan started again from the top at every 16 KiB read while a value was longer than the text
    read so far: an 18 MB T4 results file took 42 s to refuse and a 10 MB JSON file of other data 132 s, each,
    at serve start-up over a folder that holds them (the hub's *_T4.json.gz lie beside its cache files). A T4
    file is now told from its header alone, even cut short, and any other file is rescanned a few times."""
    import forecaster_mcp.measure.replay as replay

    scans = 0
    real = replay._scan_header

    def counting(text: str, decoder: json.JSONDecoder) -> Any:
        nonlocal scans
        scans += 1
        return real(text, decoder)

    monkeypatch.setattr(replay, "_scan_header", counting)
    result = {"configuration": {"bx": 32}, "times": {"runtimes": [2.0] * 32}, "objectives": ["time"]}
    t4 = json.dumps({"schema_version": "1.0.0", "metadata": {}, "results": [result] * 5000})
    path = tmp_path / "A100_T4.json.gz"
    path.write_bytes(gzip.compress(t4.encode())[:1000])  # cut short: only its header can be read
    with pytest.raises(ValueError, match="it is a T4 results file"):
        read_header(path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"data": [result] * 20000, "cache": {}}))  # 3 MB before "cache"
    scans = 0
    with pytest.raises(ValueError, match="not a Kernel Tuner cache file"):
        read_header(other)
    assert scans <= 12


def test_a_configuration_recorded_twice_is_one_configuration_answered_as_measured(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A merged cache file spelling one configuration twice (bx 32 and 32.0, as a run with float tune_params
    writes it) with other times: measuring bx=32 answered the later entry (5 ms) while the space's best was the
    earlier one (1 ms), which no measurement could reach (a search's best-fraction at most 0.2), and make-pairs
    wrote pairs of that kernel against itself with speedup 5 and 0.2."""
    from replay_kernels import small_recording

    from forecaster_mcp.cli import main

    path = small_recording(
        tmp_path / "r.json",
        {
            "32": {"bx": 32, "time": 1.0, "times": [1.0, 1.0]},
            "32.0": {"bx": 32.0, "time": 5.0, "times": [5.0, 5.0]},
            "64": {"bx": 64, "time": 2.0, "times": [2.0, 2.0]},
        },
    )
    with caplog.at_level(logging.WARNING):
        space = load_space(path)
    assert len(space.entries) == 2
    answered = space.find({"bx": 32})
    assert (
        answered is not None and answered.time_ms == 5.0
    )  # the later entry wins, as for a repeated JSON key
    assert space.best_time_ms == 2.0
    assert "1 configuration" in caplog.text and "r.json" in caplog.text

    out = tmp_path / "pairs.jsonl"
    assert (
        main(["--home", str(tmp_path / "home"), "make-pairs", str(path), "-n", "10", "--out", str(out)]) == 0
    )
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert pairs
    for pair in pairs:
        base, cand = pair["baseline"]["defines"]["bx"], pair["candidate"]["defines"]["bx"]
        assert normalize_value(base) != normalize_value(cand), pair


@pytest.mark.anyio
async def test_an_edited_source_is_answered_with_the_recorded_time_and_told_so(conv_a100: Path) -> None:
    """A Kernel Tuner recording holds no source: a request is matched by entry and tuning parameters only. An agent
    that edited the kernel and measured it again got the recorded kernel's time, said nowhere, and could take its
    edit as timed. The first source replayed from a recording is the recorded kernel's; another is told."""
    raw = json.loads(gzip.open(conv_a100).read())
    defines = {k: raw["cache"]["16,1,1,1,0,0,0,1,15,15"][k] for k in raw["tune_params_keys"]}
    m = ReplayMeasurer([conv_a100])
    first = await _measure(m, kernel("convolution_kernel", defines), "A100-PCIE-40GB")
    assert first.status == "ok" and first.message is None
    edited = Kernel(source=SRC + "// unrolled by hand\n", entry="convolution_kernel", defines=defines)
    told = await _measure(m, edited, "A100-PCIE-40GB")
    assert told.runtime_ms == first.runtime_ms
    assert told.message is not None and "source differs from the first one replayed" in told.message
    again = await _measure(m, kernel("convolution_kernel", defines), "A100-PCIE-40GB")
    assert again.message is None
