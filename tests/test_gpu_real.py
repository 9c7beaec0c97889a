"""Real-GPU checks of the pycuda backend; skipped unless FORECASTER_MCP_GPU_TESTS=1 (benchmarks/gpu_check.sh).

They measure the bundled examples through the real worker: known orderings (float4 never loses to scalar
loads, shared tiles beat naive SGEMM, warp shuffles beat a divergent tree), low noise, honest gas, and every
bad kernel getting the status examples.json promises, with the device usable again afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from forecaster_mcp.examples import ExampleSuite, load_examples
from forecaster_mcp.measure.base import MeasureRequest
from forecaster_mcp.measure.pycuda_measurer import PycudaMeasurer, detect_reason
from forecaster_mcp.models import Kernel, MeasureResult

pytestmark = pytest.mark.gpu

SUITES = {s.name: s for s in load_examples()}


@pytest.fixture
async def gpu(tmp_path: Path) -> AsyncIterator[PycudaMeasurer]:
    measurer = PycudaMeasurer.detect(tmp_path / "cache")
    assert measurer is not None, detect_reason()
    async with measurer:
        yield measurer


async def measure(
    gpu: PycudaMeasurer, suite: ExampleSuite, kernel: Kernel, max_seconds: float = 20.0, checked: bool = True
) -> MeasureResult:
    request = MeasureRequest(
        kernel=kernel,
        workload=suite.workload,
        device=gpu.devices()[0],
        reference=suite.reference if checked else None,
        atol=suite.atol,
        rtol=suite.rtol,
        max_seconds=max_seconds,
        max_runs=2000,
    )
    with anyio.fail_after(max_seconds + 120):  # + start-up and compile
        return await gpu.measure(request)


@pytest.mark.anyio
async def test_detect_and_device_description(gpu: PycudaMeasurer) -> None:
    device = gpu.devices()[0]
    suite = SUITES["vector_add"]
    result = await measure(gpu, suite, suite.kernel("vector_add_naive"))
    assert result.status == "ok", result.message
    info = gpu.device_info(device)
    assert info is not None
    assert info.l2_bytes >= 2**20 and info.sm_count > 0
    assert result.device.compute_capability == info.compute_capability
    assert result.device.driver
    assert result.resources.registers and result.resources.occupancy
    assert 0 < result.cost.gpu_seconds <= 20.0
    assert result.cost.compile_seconds > 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("suite_name", "slow", "fast", "strict"),
    [
        # Both vector adds stream at close to peak bandwidth: float4 must not lose, need not win clearly.
        ("vector_add", "vector_add_naive", "vector_add_float4", False),
        ("matmul", "matmul_naive", "matmul_tiled_16", True),
        ("matmul", "matmul_naive", "matmul_tiled_32", True),
        ("reduction", "reduce_naive", "reduce_warp_shuffle", True),
    ],
)
async def test_known_orderings_and_correctness(
    gpu: PycudaMeasurer, suite_name: str, slow: str, fast: str, strict: bool
) -> None:
    suite = SUITES[suite_name]
    results = {}
    for kid in (slow, fast):
        result = await measure(gpu, suite, suite.kernel(kid))
        assert result.status == "ok", f"{kid}: {result.message}"
        assert result.correctness.checked and result.correctness.passed, result.correctness.detail
        assert result.correctness.input_sets == 2
        assert "below_physical_floor" not in result.flags
        assert "events_disagree_with_wall_clock" not in result.flags
        results[kid] = result
    slow_ms = results[slow].runtime_ms
    fast_ms = results[fast].runtime_ms
    assert slow_ms is not None and fast_ms is not None
    why = f"{fast} {fast_ms.median} ms vs {slow} {slow_ms.median} ms"
    if strict:
        assert fast_ms.ci95_high < slow_ms.ci95_low, why
    else:
        assert fast_ms.median <= 1.02 * slow_ms.median, why


@pytest.mark.anyio
async def test_timing_noise_is_low_on_a_memory_bound_kernel(gpu: PycudaMeasurer) -> None:
    suite = SUITES["vector_add"]
    medians = []
    for _ in range(3):
        result = await measure(gpu, suite, suite.kernel("vector_add_float4"), checked=False)
        assert result.runtime_ms is not None
        assert result.runtime_ms.relative_noise <= 0.02
        medians.append(result.runtime_ms.median)
    # Three separate measurements (fresh inputs each) agree within a few percent.
    assert max(medians) / min(medians) < 1.05


@pytest.mark.anyio
async def test_bad_kernels_get_their_status_and_the_device_recovers(gpu: PycudaMeasurer) -> None:
    suite = SUITES["bad_kernels"]
    good = suite.reference
    for example in suite.kernels:
        if example.kernel.id == suite.reference_id:
            continue
        cap = example.max_seconds or 20.0
        result = await measure(gpu, suite, example.kernel, max_seconds=cap)
        assert result.status == example.expect_status, (
            f"{example.kernel.id}: {result.status} {result.message}"
        )
        if example.expect_status == "timeout":
            assert result.cost.gpu_seconds == cap
        else:
            assert result.cost.gpu_seconds < cap
        if example.kernel.id == "side_stream":
            assert result.correctness.passed
            assert "events_disagree_with_wall_clock" not in result.flags
        after = await measure(gpu, suite, good)
        assert after.status == "ok", f"after {example.kernel.id}: {after.message}"
