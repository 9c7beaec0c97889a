"""A real stdio server process driven by the MCP client, as an IDE would."""

from __future__ import annotations

from pathlib import Path

import pytest
from replay_kernels import FAST, conv

from forecaster_mcp.server.client import connect_stdio

pytestmark = pytest.mark.anyio


async def test_stdio_server_lists_and_calls_tools(tmp_path: Path, conv_a100: Path) -> None:
    async with connect_stdio(tmp_path / "home", replay=[conv_a100]) as (client, call):
        names = {t.name for t in (await client.list_tools()).tools}
        assert names == {"compare_kernels", "measure_kernel", "budget_status"}
        k = conv(None, FAST)
        measured = await call("measure_kernel", {"kernel": k})
        assert measured["status"] == "ok"
        assert measured["device"]["backend"] == "replay"
        slower = {**k, "defines": {**FAST, "use_shmem": 0, "block_size_x": 16}}
        out = await call("compare_kernels", {"candidates": [k, slower], "hardware": "a100"})
        assert out["baseline"] == "k0"
        assert [c["id"] for c in out["candidates"]] == ["k1"]
        status = await call("budget_status", {})
        assert status["ledger"] == "default"
        assert status["spent_gpu_seconds"] == pytest.approx(measured["cost"]["gpu_seconds"], abs=1e-6)
