"""A server SIGKILLed in the middle of measurements leaves no orphan reservation once it restarts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from replay_kernels import conv_block
from serverproc import cli, start_http

from forecaster_mcp.server.client import ToolCallFailed, connect_http


def ledger(home: Path) -> dict[str, Any]:
    out = json.loads(cli(home, "ledger", "show", "crash", "--json").stdout)
    return out[0] if isinstance(out, list) else out


def test_sigkill_mid_measurement_then_restart_balances(tmp_path: Path, conv_a100: Path) -> None:
    home = tmp_path / "srv"
    cli(home, "ledger", "create", "crash", "--gpu-seconds", "100")
    token = cli(home, "token", "issue", "--ledger", "crash").stdout.strip().splitlines()[-1]
    # Each replayed measurement now holds the simulated device for ~100x its recorded time (seconds).
    slow = {"FORECASTER_MCP_REPLAY_REALTIME": "300"}
    srv = start_http(home, ["--replay", str(conv_a100)], env=slow)
    db = home / "forecaster.sqlite3"

    async def fire() -> None:
        async def one(bx: int) -> None:
            kernel = conv_block(bx, 4)
            try:
                async with connect_http(srv.url, token) as (_, call):
                    await call("measure_kernel", {"kernel": kernel})
            except (ToolCallFailed, Exception):
                pass  # the server dies under us: that is the point

        async with anyio.create_task_group() as tg:
            for bx in (16, 32, 48, 64):
                tg.start_soon(one, bx)
            # Bounded wait until the server holds reservations, read straight from the database.
            import sqlite3

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with sqlite3.connect(db) as conn:
                    held = conn.execute("SELECT COUNT(*) FROM reservations WHERE state = 'open'").fetchone()[
                        0
                    ]
                if held >= 2:
                    break
                await anyio.sleep(0.05)
            assert held >= 2, "server never reserved"
            srv.kill()
            tg.cancel_scope.cancel()

    anyio.run(fire)
    restarted = start_http(home, ["--replay", str(conv_a100)])
    try:
        state = ledger(home)
    finally:
        restarted.stop()
    assert state["reserved_gpu_seconds"] == 0
    assert state["spent_gpu_seconds"] >= 0
    assert state["spent_gpu_seconds"] + state["remaining_gpu_seconds"] == pytest.approx(100, abs=1e-6)
