"""Shared fixtures: every test gets its own state directory; paid API calls fail loudly."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# One BLAS thread, as `forecaster-mcp serve` sets for itself (cli.main): the family model's factorisations are
# small, and the tests that run it in this process (or in CLI commands started from here) took 5-10x as long
# with OpenBLAS threads fighting each other and the other work on a busy 2-core machine. Set before anything
# imports numpy (OpenBLAS reads it once, when loaded); a value already in the environment is kept.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
DATASETS = SHARED / "datasets" / "kernel_tuner_benchmark_hub"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def isolate(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> Path:
    """Point FORECASTER_MCP_HOME at `tmp`/home and make paid API calls fail loudly (every test; fixtures of a
    wider scope, set up before any test's, call it for the processes they start)."""
    home = tmp / "home"
    monkeypatch.setenv("FORECASTER_MCP_HOME", str(home))
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("FORECASTER_MCP_ANTHROPIC_API_KEY", raising=False)
    # Any real Anthropic call in tests must fail loudly (the Claude tests inject a MockTransport).
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9/forbidden-real-api-call-in-tests")
    monkeypatch.setenv("FORECASTER_MCP_FORBID_REAL_API", "1")
    # The stand-in GPUs of every test share one PCI bus id: without a scope of its own, a test's jobs would take
    # turns with those of other tests running on this machine (pycuda_measurer._machine_lock).
    monkeypatch.setenv("FORECASTER_MCP_GPU_LOCK_SCOPE", f"forecaster-mcp-test-{os.getpid()}-{id(tmp):x}")
    return home


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield isolate(monkeypatch, tmp_path)


def dataset(*parts: str) -> Path:
    """Path of a shared dataset file; skips the test when ../shared is not beside the checkout."""
    path = DATASETS.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared dataset missing: {path}")
    return path


@pytest.fixture
def conv_a100() -> Path:
    return dataset("cachefiles", "convolution_milo", "A100.json.gz")


@pytest.fixture
def dedisp_a100() -> Path:
    return dataset("cachefiles", "dedispersion_milo", "A100.json.gz")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FORECASTER_MCP_GPU_TESTS") == "1":
        return
    skip = pytest.mark.skip(
        reason="GPU test: needs an NVIDIA GPU and pycuda (set FORECASTER_MCP_GPU_TESTS=1)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
