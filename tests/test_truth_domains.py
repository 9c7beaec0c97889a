"""Whose measurements answer and teach a server: a replay's recording is some other machine's times, so a server
on a real GPU of the same name neither answers from them nor learns from them, a replay server uses only its own
recordings' measurements, and a real GPU's measurements still pool across restarts (one state folder each)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from replay_kernels import small_recording

from forecaster_mcp.measure.fake import FakeMeasurer
from forecaster_mcp.measure.replay import ReplayMeasurer
from forecaster_mcp.models import Kernel, Workload

pytestmark = pytest.mark.anyio

GPU = "A100-PCIE-40GB"  # what the small recording's "NVIDIA A100-PCIE-40GB" resolves to


def _recording(path: Path, fast_ms: float, slow_ms: float) -> Path:
    return small_recording(
        path,
        {
            "32": {"bx": 32, "time": fast_ms, "times": [fast_ms] * 5},
            "64": {"bx": 64, "time": slow_ms, "times": [slow_ms] * 5},
            "128": {"bx": 128, "time": slow_ms, "times": [slow_ms] * 5},
        },
    )


def _kernels() -> list[Kernel]:
    # The recording's kernel "kk" with its one parameter; replay matches entry and defines, the fake runs anything.
    return [Kernel(id=f"b{bx}", source="// kk\n", entry="kk", defines={"bx": bx}) for bx in (32, 64, 128)]


@asynccontextmanager
async def _previous_version_replay(
    monkeypatch: pytest.MonkeyPatch, home: Path, recordings: list[Path]
) -> AsyncIterator[Any]:
    """A replay server of the version before replays had a history of their own: its store migrated only to 15,
    its measurements filed under the GPU's own name."""
    from forecaster_mcp.store import migrations

    with monkeypatch.context() as m:
        m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:15])
        m.delattr(ReplayMeasurer, "history_device")
        old = await _service(home, ReplayMeasurer(recordings))
        try:
            yield old
        finally:
            await old.close()


async def _service(home: Path, measurer: Any) -> Any:
    from forecaster_mcp.service import Service, build_forecasters
    from forecaster_mcp.settings import Settings
    from forecaster_mcp.store.db import Store

    settings = Settings.from_env(home=home, measurer="none", ledger="team", max_measure_seconds=5)
    store = await Store.open(settings.db_path)
    await store.ensure_ledger("team", 100.0)
    return Service(settings, store, build_forecasters(settings, store), [measurer])


async def _measure_all(svc: Any, kernels: list[Kernel]) -> None:
    for k in kernels:
        r = await svc.measure(ledger="team", kernel=k, workload=Workload(), hardware=GPU)
        assert r.status == "ok", r


async def _compare(svc: Any, kernels: list[Kernel]) -> Any:
    return await svc.compare(
        ledger="team", candidates=kernels, workload=Workload(), baseline=None, hardware=GPU,
        target_error=None, measure_if_unsure=False, max_measurements=0,
    )  # fmt: skip


def _real_gpu() -> FakeMeasurer:
    # Stands in for pycuda on a real A100: b32 is the *slower* one here, unlike the recording.
    fake = FakeMeasurer([GPU], gpu_seconds=0.2)
    fake.script("kk", defines={"bx": 32}, runtime_ms=9.0)
    fake.script("kk", defines={"bx": 64}, runtime_ms=1.0)
    fake.script("kk", defines={"bx": 128}, runtime_ms=2.0)
    return fake


async def test_a_real_gpu_is_neither_answered_nor_taught_by_a_replay_of_the_same_gpu(tmp_path: Path) -> None:
    home = tmp_path / "state"
    ks = _kernels()
    replay = await _service(home, ReplayMeasurer([_recording(tmp_path / "A100.json", 1.0, 4.0)]))
    try:
        await _measure_all(replay, ks[:2])
        # The replay server itself answers from its recording's measurements.
        assert (await _compare(replay, ks[:2])).candidates[0].decided_by == "cache"
    finally:
        await replay.close()

    fake = _real_gpu()
    real = await _service(home, fake)
    try:
        res = await _compare(real, ks)
        # Not "measured" from the recording's times (b64 4x slower there; 9x faster on this GPU).
        assert [c.decided_by for c in res.candidates] == ["forecast", "forecast"]
        assert all(c.measured_speedup is None for c in res.candidates)
        # Nor learned: the family model has no measurement of this family on this GPU (it counted the replay's 2).
        assert "no measurement of this family yet" in res.candidates[1].rationale, res.candidates[1].rationale
        # measure_kernel measures on this GPU (and charges for it) rather than answering from the replay.
        first = await real.measure(ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU)
        assert not first.cost.cached and first.runtime_ms is not None and first.runtime_ms.median == 9.0
    finally:
        await real.close()


async def test_a_replay_is_not_answered_from_a_real_gpus_measurements(tmp_path: Path) -> None:
    home = tmp_path / "state"
    ks = _kernels()
    real = await _service(home, _real_gpu())
    try:
        await _measure_all(real, ks[:2])
    finally:
        await real.close()

    replay = await _service(home, ReplayMeasurer([_recording(tmp_path / "A100.json", 1.0, 4.0)]))
    try:
        res = await _compare(replay, ks[:2])
        assert res.candidates[0].decided_by == "forecast"
        await _measure_all(replay, ks[:2])
        # Now its own recording decides the pair: b64 is 4x slower, not the real GPU's 9x faster.
        res = await _compare(replay, ks[:2])
        assert res.candidates[0].decided_by == "cache" and res.candidates[0].verdict == "slower"
    finally:
        await replay.close()


async def test_two_recordings_of_one_gpu_keep_their_own_measurements(tmp_path: Path) -> None:
    home = tmp_path / "state"
    ks = _kernels()
    first = await _service(home, ReplayMeasurer([_recording(tmp_path / "one" / "A100.json", 1.0, 4.0)]))
    try:
        await _measure_all(first, ks[:2])
    finally:
        await first.close()

    second = await _service(home, ReplayMeasurer([_recording(tmp_path / "two" / "A100.json", 4.0, 1.0)]))
    try:
        assert (await _compare(second, ks[:2])).candidates[0].decided_by == "forecast"
    finally:
        await second.close()


async def test_a_real_gpus_measurements_still_answer_after_a_restart(tmp_path: Path) -> None:
    home = tmp_path / "state"
    ks = _kernels()
    for make in (_real_gpu, lambda: ReplayMeasurer([_recording(tmp_path / "A100.json", 1.0, 4.0)])):
        before = await _service(home / type(make()).__name__, make())
        try:
            await _measure_all(before, ks[:2])
        finally:
            await before.close()
        after = await _service(home / type(make()).__name__, make())
        try:
            res = await _compare(after, ks[:2])
            assert res.candidates[0].decided_by == "cache"
        finally:
            await after.close()


async def test_replayed_measurements_stored_before_are_moved_off_the_real_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A state folder a replay server of the previous version wrote: its measurements (and the forecasts they
    # verified) filed under the GPU's own name.
    home = tmp_path / "state"
    ks = _kernels()
    rec = _recording(tmp_path / "A100.json", 1.0, 4.0)
    async with _previous_version_replay(monkeypatch, home, [rec]) as old:
        await _compare(old, ks[:2])
        await _measure_all(old, ks[:2])
        assert len(await old.store.verified_pairs(hardware=GPU)) > 0

    real = await _service(home, _real_gpu())
    try:
        assert await real.store.verified_pairs(hardware=GPU) == []
        assert [c.decided_by for c in (await _compare(real, ks)).candidates] == ["forecast", "forecast"]
        first = await real.measure(ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU)
        assert not first.cost.cached
    finally:
        await real.close()
    # The replay server's measure_kernel still answers from them, free, and then its compare does too.
    replay = await _service(home, ReplayMeasurer([rec]))
    try:
        for k in ks[:2]:
            again = await replay.measure(ledger="team", kernel=k, workload=Workload(), hardware=GPU)
            assert again.cost.cached
        assert (await _compare(replay, ks[:2])).candidates[0].decided_by == "cache"
    finally:
        await replay.close()


def test_claude_is_told_the_gpu_not_where_a_replays_history_is_stored(tmp_path: Path) -> None:
    from forecaster_mcp.forecast.base import PairQuery
    from forecaster_mcp.forecast.prompt import build_pair_prompt

    replay = ReplayMeasurer([_recording(tmp_path / "MYSTERY.json", 1.0, 4.0)])
    stored_as = replay.history_device(GPU)
    assert stored_as.startswith(f"{GPU} (replay ")
    a, b = _kernels()[:2]
    # A GPU without a specification row is described by its name alone.
    text = build_pair_prompt(PairQuery(a, b, Workload(), "Mystery-GPU (replay 1a2b3c4d)", None)).text
    assert "unknown GPU: 'Mystery-GPU'" in text and "replay" not in text


async def test_a_retry_under_an_idempotency_key_used_before_the_upgrade_is_answered_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replay server of the previous version measured under an idempotency key; the agent's retry of that very
    # request reaches the upgraded server (migration 16 moved the measurement to "<GPU> (replay)").
    home = tmp_path / "state"
    ks = _kernels()
    rec = _recording(tmp_path / "A100.json", 1.0, 4.0)
    async with _previous_version_replay(monkeypatch, home, [rec]) as old:
        first = await old.measure(
            ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU, idempotency_key="run-1"
        )
        assert first.status == "ok" and not first.cost.cached

    replay = await _service(home, ReplayMeasurer([rec]))
    try:
        again = await replay.measure(
            ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU, idempotency_key="run-1"
        )
        assert again.cost.cached and again.runtime_ms == first.runtime_ms
        # Another kernel under the key is still refused.
        with pytest.raises(Exception, match="different kernel"):
            await replay.measure(
                ledger="team", kernel=ks[1], workload=Workload(), hardware=GPU, idempotency_key="run-1"
            )
    finally:
        await replay.close()


async def test_a_retry_is_answered_after_the_operator_adds_a_recording_of_the_same_gpu(
    tmp_path: Path,
) -> None:
    # The replay's history key names its recordings: one more recording of the GPU (another kernel) is another
    # history, but the request under the key is the same one, on the same GPU, and its retry is answered free.
    home = tmp_path / "state"
    ks = _kernels()
    rec = _recording(tmp_path / "A100.json", 1.0, 4.0)
    before = await _service(home, ReplayMeasurer([rec]))
    try:
        first = await before.measure(
            ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU, idempotency_key="run-1"
        )
    finally:
        await before.close()
    other = _recording(tmp_path / "other" / "A100.json", 2.0, 3.0)
    doc = json.loads(other.read_text())
    other.write_text(json.dumps({**doc, "kernel_name": "other_kernel"}))
    after = await _service(home, ReplayMeasurer([rec, other]))
    try:
        again = await after.measure(
            ledger="team", kernel=ks[0], workload=Workload(), hardware=GPU, idempotency_key="run-1"
        )
        assert again.cost.cached and again.runtime_ms == first.runtime_ms
    finally:
        await after.close()


async def test_a_real_gpus_family_model_does_not_start_from_what_a_replay_fitted_before_the_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The family model keeps its fitted hyperparameters per family, GPU and workload across restarts: those a
    # replay server of the previous version fitted on the recording's times, under the GPU's own name, would
    # be a real GPU's starting point after the upgrade (and, past 100 measurements, its hyperparameters until
    # it has 10% more measurements than the replay had).
    home = tmp_path / "state"
    values = [8, 16, 32, 64, 128, 256]
    path = tmp_path / "A100.json"
    doc = json.loads(_recording(path, 1.0, 4.0).read_text())
    doc["tune_params"] = {"bx": values}
    doc["cache"] = {str(v): {"bx": v, "time": 1.0 + v / 64, "times": [1.0 + v / 64] * 5} for v in values}
    path.write_text(json.dumps(doc))
    ks = [Kernel(id=f"b{v}", source="// kk\n", entry="kk", defines={"bx": v}) for v in values]
    async with _previous_version_replay(monkeypatch, home, [path]) as old:
        await _measure_all(old, ks[:5])
        await _compare(old, ks)  # the family model fits its 5 measurements, and keeps what it fitted
        key = (ks[0].family_key(), GPU, Workload().history_key())
        assert await old.store.load_family_state(*key) is not None

    real = await _service(home, _real_gpu())
    try:
        assert await real.store.load_family_state(*key) is None
    finally:
        await real.close()


async def test_a_replay_server_still_forecasts_after_its_recording_is_removed_from_disk(
    tmp_path: Path,
) -> None:
    # The replay's history key names its recordings by their contents: read once, when the server loads them
    # (serve preloads at start-up), not at each compare. A recording moved or deleted once the server had
    # parsed it made every compare_kernels on its device fail (FileNotFoundError), though forecasts read none.
    rec = _recording(tmp_path / "A100.json", 1.0, 4.0)
    svc = await _service(tmp_path / "state", ReplayMeasurer([rec]))
    try:
        await svc.preload()
        rec.unlink()
        res = await _compare(svc, _kernels())
        assert [c.decided_by for c in res.candidates] == ["forecast", "forecast"]
        # Its parsed times still answer measure_kernel, and then compare.
        await _measure_all(svc, _kernels()[:2])
        assert (await _compare(svc, _kernels()[:2])).candidates[0].decided_by == "cache"
    finally:
        await svc.close()
