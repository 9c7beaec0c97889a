"""What a replay server tells an agent about the request it answers, through the MCP tools on a real SQLite
store: which recording answered (without the operator's folders), and what a request may change and still be
answered by the same recorded entry."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from replay_kernels import FAST, conv
from tool_calls import call, error_of, running

from forecaster_mcp.cli import main
from forecaster_mcp.measure.replay import ReplayMeasurer

pytestmark = pytest.mark.anyio


def _sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------- 3. the recording's name, not its path


async def test_results_name_the_recording_without_the_operators_folders(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Every replayed result carried device.recording = the recording's absolute path on the server
    ('/srv/operator/recordings/A100.json.gz'), shown to every agent, and copied into exports. It is now the
    file name and the start of its sha256, for a recording, a cached copy and an export alike."""
    folder = tmp_path / "operator-private" / "recordings"
    folder.mkdir(parents=True)
    recording = folder / "A100.json.gz"
    shutil.copyfile(conv_a100, recording)
    async with running(tmp_path / "a", [recording]) as (client, _):
        first = await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        cached = await call(client, "measure_kernel", {"kernel": conv("b", FAST)})
    assert cached["cost"]["cached"]
    for result in (first, cached):
        assert result["device"]["recording"] == f"A100.json.gz@sha256:{_sha16(recording)}"
        assert "operator-private" not in json.dumps(result)

    out = folder / "export.jsonl"
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert "operator-private" not in out.read_text()
    async with running(tmp_path / "b", [out]) as (client, _):
        again = await call(client, "measure_kernel", {"kernel": conv("c", FAST)})
    assert again["device"]["recording"] == f"export.jsonl@sha256:{_sha16(out)}"
    assert "operator-private" not in json.dumps(again)


async def test_a_damaged_recording_is_named_to_the_agent_by_file_name_only(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A recording whose body cannot be read was refused with 'cannot read replay recording /its/whole/path'."""
    folder = tmp_path / "operator-private"
    folder.mkdir()
    cut = folder / "A100.json.gz"
    await anyio.Path(cut).write_bytes((await anyio.Path(conv_a100).read_bytes())[:20000])
    async with running(tmp_path / "home", [cut]) as (client, _):
        message = await error_of(client, "measure_kernel", {"kernel": conv("a", FAST)})
    assert "cannot read replay recording A100.json.gz" in message and "replace or remove" in message
    assert "operator-private" not in message


# ---------------------------------------------------------------- 2. one recorded entry, one charge


async def spent(client: object) -> float:
    status = await call(client, "budget_status", {})  # type: ignore[arg-type]
    return float(status["spent_gpu_seconds"])


@pytest.mark.parametrize("realtime", [0.0, 1e-9], ids=["replay", "replay-realtime"])
async def test_defines_spelt_differently_for_one_recorded_entry_are_charged_once(
    tmp_path: Path, conv_a100: Path, realtime: float
) -> None:
    """The recording answers block_size_x = 32, 32.0, "32.0" and "0x20" with one recorded entry, but each
    spelling was keyed as a kernel of its own: the same 0.018 GPU-s lookup charged once per spelling. The
    second and later spellings are now cache hits, free, with the first one's answer (also in real time)."""
    async with running(tmp_path, [conv_a100], replay_realtime=realtime) as (client, _):
        first = await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        paid = await spent(client)
        assert paid > 0 and not first["cost"]["cached"]
        for n, value in enumerate((32.0, "32.0", "0x20", "32u")):
            again = await call(
                client, "measure_kernel", {"kernel": conv(f"b{n}", {**FAST, "block_size_x": value})}
            )
            assert again["cost"]["cached"] and again["cost"]["gpu_seconds"] == 0.0, value
            assert again["runtime_ms"] == first["runtime_ms"]
        assert await spent(client) == pytest.approx(paid, abs=1e-9)
        # Another recorded entry is still a measurement of its own.
        other = await call(client, "measure_kernel", {"kernel": conv("c", {**FAST, "block_size_x": 64})})
        assert not other["cost"]["cached"] and await spent(client) > paid


@pytest.mark.parametrize("realtime", [0.0, 1e-9], ids=["replay", "replay-realtime"])
async def test_the_recorded_problem_under_any_names_or_none_is_charged_once(
    tmp_path: Path, conv_a100: Path, realtime: float
) -> None:
    """The A100 convolution recording is of problem_size [4096, 4096]: workload.problem {width: 4096,
    height: 4096}, the same sizes under other names or in another order, and no workload are answered with one
    recorded entry, but each was keyed by its own workload and charged the same 0.018 GPU-s again. The second
    and later are now cache hits, free, with the first one's answer. A workload the answer tells apart (args,
    which its message names as unchecked) is still a measurement of its own."""
    async with running(tmp_path, [conv_a100], replay_realtime=realtime) as (client, _):
        problem = {"problem": {"width": 4096, "height": 4096}}
        first = await call(client, "measure_kernel", {"kernel": conv("a", FAST), "workload": problem})
        paid = await spent(client)
        assert paid > 0 and not first["cost"]["cached"]
        for n, workload in enumerate(
            (
                None,
                {},
                {"problem": {}},
                {"problem": {"height": 4096, "width": 4096}},
                {"problem": {"nx": 4096.0, "ny": "4096", "nz": 1}},
                {"problem": {"width": 4096, "height": 4096, "dtype": "float32"}, "name": "image"},
            )
        ):
            arguments: dict[str, object] = {"kernel": conv(f"b{n}", FAST)}
            if workload is not None:
                arguments["workload"] = workload
            again = await call(client, "measure_kernel", arguments)
            assert again["cost"]["cached"] and again["cost"]["gpu_seconds"] == 0.0, workload
            assert again["runtime_ms"] == first["runtime_ms"] and again["message"] is None
        assert await spent(client) == pytest.approx(paid, abs=1e-9)
        args = {"args": [{"name": "out", "dtype": "float32", "shape": [4096, 4096], "intent": "out"}]}
        told = await call(client, "measure_kernel", {"kernel": conv("c", FAST), "workload": args})
        assert not told["cost"]["cached"] and "workload.args" in told["message"]
        assert await spent(client) > paid


async def test_a_result_stored_under_its_workloads_own_key_is_still_found(
    tmp_path: Path, conv_a100: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measurement stored before the replay keyed the recorded problem as no workload (under the key of
    {width: 4096, height: 4096} itself, as a server whose ReplayMeasurer.cache_request kept the workload as
    it was stores it) still answers that request, free, after a restart."""
    problem = {"problem": {"height": 4096, "width": 4096}}
    monkeypatch.setattr(ReplayMeasurer, "_keyed_workload", staticmethod(lambda rec, workload: workload))
    async with running(tmp_path, [conv_a100]) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST), "workload": problem})
        paid = await spent(client)
    monkeypatch.undo()
    assert (
        "_keyed_workload" in vars(ReplayMeasurer)
        and ReplayMeasurer._keyed_workload.__name__ == "_keyed_workload"
    )
    async with running(tmp_path, [conv_a100], ledger_seconds=None) as (client, _):
        again = await call(client, "measure_kernel", {"kernel": conv("b", FAST), "workload": problem})
        assert again["cost"]["cached"] and again["cost"]["gpu_seconds"] == 0.0
        assert await spent(client) == pytest.approx(paid, abs=1e-9)


async def test_an_export_keeps_defines_spelt_differently_apart(tmp_path: Path, conv_a100: Path) -> None:
    """An export replays a kernel only as it was measured: 32.0 is not the 32 it holds, and is refused free
    (the cache does not answer it with 32's measurement either)."""
    async with running(tmp_path / "a", [conv_a100]) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
    out = tmp_path / "export.jsonl"
    argv = ["--home", str(tmp_path / "a"), "export", "--out", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    async with running(tmp_path / "b", [out]) as (client, _):
        await call(client, "measure_kernel", {"kernel": conv("a", FAST)})
        paid = await spent(client)
        message = await error_of(
            client, "measure_kernel", {"kernel": conv("b", {**FAST, "block_size_x": 32.0})}
        )
        assert "not among the exported measurements" in message
        assert await spent(client) == pytest.approx(paid, abs=1e-9)


# ---------------------------------------------------------------- 1. what the recording was made with


async def test_a_problem_size_or_block_the_recording_was_not_made_with_is_refused_free(
    tmp_path: Path, conv_a100: Path
) -> None:
    """The A100 convolution recording is of a 4096 x 4096 image, with the block (block_size_x, block_size_y).
    An agent that asked for its fastest configuration on an 8192 x 8192 image, or launched with another block,
    was answered the recorded 4096 x 4096 time (0.55 ms) and charged for it, silently. Refused now, naming
    what the recording holds and what to send, nothing charged; the recorded problem under any names, in any
    order or with a size of 1, is answered."""
    launch = {"grid": [128, 342, 1], "block": [32, 4, 1]}
    async with running(tmp_path, [conv_a100]) as (client, _):
        for problem in ({"width": 8192, "height": 8192}, {"n": 4096}, {"M": 4096, "N": 4096, "K": 64}):
            message = await error_of(
                client, "measure_kernel", {"kernel": conv("a", FAST), "workload": {"problem": problem}}
            )
            assert "problem_size [4096, 4096]" in message and "exactly the sizes 4096, 4096" in message
            assert "nothing was charged" in message
        wrong_block = {**conv("b", FAST), "launch": {**launch, "block": [64, 4, 1]}}
        message = await error_of(client, "measure_kernel", {"kernel": wrong_block})
        assert "block_size_x=32, block_size_y=4" in message and "launch.block [32, 4, 1]" in message
        assert await spent(client) == 0.0
        status = await call(client, "budget_status", {})
        assert status["reserved_gpu_seconds"] == 0.0

        # compare_kernels does not offer to measure what measure_kernel would refuse.
        pair = [conv("a", FAST), conv("s", {**FAST, "block_size_x": 16})]
        out = await call(
            client,
            "compare_kernels",
            {"candidates": pair, "workload": {"problem": {"width": 8192, "height": 8192}}},
        )
        assert out["measure_next"] == []

        for problem in ({"height": 4096, "width": 4096}, {"x": 4096, "y": 4096, "z": 1, "dtype": "float32"}):
            ok = await call(
                client,
                "measure_kernel",
                {"kernel": {**conv("c", FAST), "launch": launch}, "workload": {"problem": problem}},
            )
            assert ok["status"] == "ok" and ok["runtime_ms"]["median"] == pytest.approx(0.554, abs=0.01)


async def test_a_problem_of_ones_is_refused_and_labels_are_not_sizes(tmp_path: Path, conv_a100: Path) -> None:
    """A workload.problem whose sizes are all 1 ({"width": 1, "height": 1}) was taken for one that gives no
    sizes: answered with the recorded 4096 x 4096 time and charged, its message saying the recording does not
    hold workload.problem. Refused now, free. Values that can be no size (a flag, a factor such as alpha 1.5,
    0) are not compared as sizes: {"width": 4096, "height": 4096, "alpha": 1.5} was refused for "the sizes
    1.5, 4096, 4096", which no renaming could fix."""
    async with running(tmp_path, [conv_a100]) as (client, _):
        for problem in ({"width": 1, "height": 1}, {"n": 1}, {"n": "1", "batched": 1.0}):
            message = await error_of(
                client, "measure_kernel", {"kernel": conv("a", FAST), "workload": {"problem": problem}}
            )
            assert "gives only sizes of 1" in message and "exactly the sizes 4096, 4096" in message, problem
            assert "nothing was charged" in message
        assert await spent(client) == 0.0
        labelled = {"width": 4096, "height": 4096, "alpha": 1.5, "offset": 0, "dtype": "float32"}
        ok = await call(
            client, "measure_kernel", {"kernel": conv("b", FAST), "workload": {"problem": labelled}}
        )
        assert ok["status"] == "ok" and ok["runtime_ms"]["median"] == pytest.approx(0.554, abs=0.01)
        assert ok["message"] is None


async def test_a_result_says_what_the_recording_could_not_check(tmp_path: Path, conv_a100: Path) -> None:
    """A recording holds no grid, compiler flags or buffers: a request giving them was answered the recorded
    time as if it had been measured with them. It is still answered (nothing in the recording contradicts
    it), and its message names what was not checked; a request giving none of them has no such message."""
    kernel = {
        **conv("a", FAST),
        "launch": {"grid": [128, 342], "block": [32, 4]},
        "compile_options": ["-use_fast_math"],
    }
    workload = {"args": [{"name": "out", "dtype": "float32", "shape": [4096, 4096], "intent": "out"}]}
    async with running(tmp_path, [conv_a100]) as (client, _):
        plain = await call(client, "measure_kernel", {"kernel": conv("p", FAST)})
        assert plain["status"] == "ok" and plain["message"] is None
        told = await call(client, "measure_kernel", {"kernel": kernel, "workload": workload})
    assert told["status"] == "ok" and told["runtime_ms"] == plain["runtime_ms"]
    assert "does not hold this request's launch.grid, compile_options, workload.args" in told["message"]
    assert "problem_size [4096, 4096]" in told["message"]


async def test_the_three_axes_of_a_dedispersion_block_are_checked(tmp_path: Path, dedisp_a100: Path) -> None:
    """dedispersion_kernel sets all three block axes from tuning parameters, and its problem_size is
    [25000, 2048, 1]."""
    defines = {
        "block_size_x": 1,
        "block_size_y": 32,
        "block_size_z": 1,
        "tile_size_x": 1,
        "tile_size_y": 1,
        "tile_stride_x": 0,
        "tile_stride_y": 0,
        "loop_unroll_factor_channel": 0,
    }
    kernel = {"id": "d", "source": "// dedispersion\n", "entry": "dedispersion_kernel", "defines": defines}
    async with running(tmp_path, [dedisp_a100]) as (client, _):
        message = await error_of(
            client, "measure_kernel", {"kernel": {**kernel, "launch": {"grid": [1], "block": [32, 1, 1]}}}
        )
        assert "launch.block [1, 32, 1]" in message
        ok = await call(
            client,
            "measure_kernel",
            {
                "kernel": {**kernel, "launch": {"grid": [1], "block": [1, 32, 1]}},
                "workload": {"problem": {"samples": 25000, "channels": 2048}},
            },
        )
        assert ok["status"] == "ok" and "launch.grid" in ok["message"]
