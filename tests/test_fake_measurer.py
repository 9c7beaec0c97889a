"""The scripted fake measurer other tests build on."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from forecaster_mcp.errors import NotMeasurable, WorkerCrashed
from forecaster_mcp.measure.base import Measurer, MeasureRequest
from forecaster_mcp.measure.fake import FakeMeasurer
from forecaster_mcp.models import Kernel, Workload

pytestmark = pytest.mark.anyio


def kernel(entry: str = "k", kid: str | None = None, **defines: Any) -> Kernel:
    return Kernel(id=kid, source="__global__ void k() {}", entry=entry, defines=defines)


def request(k: Kernel, device: str = "FAKE-GPU", **kw: Any) -> MeasureRequest:
    return MeasureRequest(kernel=k, workload=Workload(), device=device, **kw)


async def test_scripted_runtimes_by_entry_and_defines() -> None:
    fake = FakeMeasurer(gpu_seconds=0.25)
    seam: Measurer = fake  # type-checks against the protocol
    assert seam.name == "fake" and seam.devices() == ["FAKE-GPU"]
    fake.script("k", runtime_ms=2.0)
    fake.script("k", defines={"BLOCK": 64}, runtime_ms=lambda kern: 10.0 / int(kern.defines["BLOCK"]))
    plain = await fake.measure(request(kernel(kid="a")))
    tuned = await fake.measure(request(kernel(kid="b", BLOCK="64")))  # defines match forgivingly
    other = await fake.measure(request(kernel("unscripted")))
    assert (plain.status, plain.runtime_ms.median, plain.kernel_id) == ("ok", 2.0, "a")
    assert tuned.runtime_ms.median == pytest.approx(10.0 / 64)
    assert other.runtime_ms.median == 1.0  # the default
    assert plain.cost.gpu_seconds == 0.25 and plain.device.backend == "fake"
    assert fake.reservation_seconds(request(kernel())) == 0.25
    assert [r.kernel.id for r in fake.history] == ["a", "b", None]
    assert fake.device_fingerprint("FAKE-GPU") == "fake:FAKE-GPU"


async def test_noise_is_seeded_and_runs_follow_the_cap() -> None:
    fake = FakeMeasurer(runs=20, noise=0.05)
    a = await fake.measure(request(kernel(), seed=1))
    b = await fake.measure(request(kernel(), seed=1))
    c = await fake.measure(request(kernel(), seed=2, max_runs=5))
    assert a.runtime_ms == b.runtime_ms and a.runtime_ms.std > 0
    assert c.runtime_ms.runs == 5 and c.runtime_ms != a.runtime_ms


async def test_timeout_charges_the_cap() -> None:
    fake = FakeMeasurer(gpu_seconds=0.1)
    fake.script("hang", timeout=True)
    req = request(kernel("hang"), max_seconds=3.0)
    assert fake.reservation_seconds(req) == 3.0
    result = await fake.measure(req)
    assert result.status == "timeout" and result.cost.gpu_seconds == 3.0 and result.runtime_ms is None


async def test_status_crash_and_refusal() -> None:
    fake = FakeMeasurer(["A100-PCIE-40GB"], gpu_seconds=0.2, measure_unscripted=False)
    fake.script("bad", status="compile_error", message="error: expected ';'", gpu_seconds=0.0)
    fake.script("dies", crash=True)
    fake.script("nope", not_measurable="not in the recording")
    bad = await fake.measure(request(kernel("bad"), "A100-PCIE-40GB"))
    assert (bad.status, bad.message, bad.cost.gpu_seconds) == ("compile_error", "error: expected ';'", 0.0)
    with pytest.raises(WorkerCrashed):
        await fake.measure(request(kernel("dies"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="not in the recording"):
        await fake.measure(request(kernel("nope"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="no script"):
        await fake.measure(request(kernel("unscripted"), "A100-PCIE-40GB"))
    with pytest.raises(NotMeasurable, match="no device 'H100'"):
        await fake.measure(request(kernel("bad"), "H100"))
    assert fake.in_flight == 0


async def test_blocks_until_released_for_concurrency_tests() -> None:
    fake = FakeMeasurer()
    gate = anyio.Event()
    fake.script("held", block_until=gate)
    done: list[str] = []

    async def one(kid: str) -> None:
        result = await fake.measure(request(kernel("held", kid=kid)))
        done.append(result.kernel_id)

    async with anyio.create_task_group() as tg:
        for kid in ("x", "y", "z"):
            tg.start_soon(one, kid)
        await fake.wait_for_calls(3)
        assert fake.in_flight == 3 and done == []
        gate.set()
    assert sorted(done) == ["x", "y", "z"] and fake.max_in_flight == 3 and fake.in_flight == 0
    assert len(fake.completed) == 3


async def test_wait_for_calls_is_bounded() -> None:
    with pytest.raises(TimeoutError):
        await FakeMeasurer().wait_for_calls(1, within_seconds=0.05)


async def test_progress_is_reported() -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    await FakeMeasurer().measure(request(kernel()), progress)
    assert [s[0] for s in seen] == [0.0, 1.0]
