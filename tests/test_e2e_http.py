"""A real HTTP server process: bearer tokens map to ledgers, bad tokens get 401 and touch nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from replay_kernels import conv_block as kernel
from serverproc import HttpServer, cli, start_http

from forecaster_mcp.server.client import ToolCallFailed, connect_http


@pytest.fixture
def server(tmp_path: Path, conv_a100: Path) -> Iterator[tuple[HttpServer, dict[str, str]]]:
    home = tmp_path / "srv"
    cli(home, "ledger", "create", "alice", "--gpu-seconds", "50")
    cli(home, "ledger", "create", "bob", "--gpu-seconds", "50")
    tokens = {
        "alice": cli(home, "token", "issue", "--ledger", "alice").stdout.strip().splitlines()[-1],
        "bob": cli(home, "token", "issue", "--ledger", "bob").stdout.strip().splitlines()[-1],
    }
    srv = start_http(home, ["--replay", str(conv_a100)])
    try:
        yield srv, tokens
    finally:
        srv.stop()


def _ledger(home: Path, name: str) -> dict[str, Any]:
    out = json.loads(cli(home, "ledger", "show", name, "--json").stdout)
    return out[0] if isinstance(out, list) else out


def test_missing_or_wrong_token_gets_401(server: tuple[HttpServer, dict[str, str]]) -> None:
    srv, _ = server
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with httpx2.Client(timeout=10) as http:
        assert http.post(srv.url, json=body, headers=headers).status_code == 401
        wrong = {**headers, "Authorization": "Bearer fmcp_not-a-real-token"}
        assert http.post(srv.url, json=body, headers=wrong).status_code == 401


@pytest.mark.anyio
async def test_each_token_charges_its_own_ledger(server: tuple[HttpServer, dict[str, str]]) -> None:
    srv, tokens = server
    async with connect_http(srv.url, tokens["alice"]) as (client, call):
        names = {t.name for t in (await client.list_tools()).tools}
        assert names == {"compare_kernels", "measure_kernel", "budget_status"}
        res = await call("measure_kernel", {"kernel": kernel(32, 4)})
        assert res["status"] == "ok"
        with pytest.raises(ToolCallFailed, match="bound to ledger 'alice'"):
            await call("budget_status", {"ledger": "bob"})
        mine = await call("budget_status", {})
        assert mine["ledger"] == "alice"
        assert mine["spent_gpu_seconds"] == pytest.approx(res["cost"]["gpu_seconds"], abs=1e-6)
    async with connect_http(srv.url, tokens["bob"]) as (_, call):
        theirs = await call("budget_status", {})
        assert theirs["spent_gpu_seconds"] == 0


def test_revoked_token_is_refused(server: tuple[HttpServer, dict[str, str]]) -> None:
    srv, tokens = server
    cli(srv.home, "token", "revoke", tokens["bob"])
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {tokens['bob']}",
    }
    with httpx2.Client(timeout=10) as http:
        assert http.post(srv.url, json=body, headers=headers).status_code == 401


@pytest.mark.anyio
async def test_concurrent_clients_never_overspend(tmp_path: Path, conv_a100: Path) -> None:
    """Hundreds of concurrent measure_kernel calls from several clients against a small ledger."""
    home = tmp_path / "attack"
    cli(home, "ledger", "create", "small", "--gpu-seconds", "0.5")
    token = cli(home, "token", "issue", "--ledger", "small").stdout.strip().splitlines()[-1]
    srv = start_http(home, ["--replay", str(conv_a100)])
    configs = [(bx, by) for bx in (16, 32, 48, 64, 80, 96, 112, 128) for by in (1, 2, 4, 8)]
    charged: list[float] = []
    refused = 0
    try:

        async def one_client(offset: int) -> None:
            nonlocal refused
            async with connect_http(srv.url, token) as (_, call):

                async def one(i: int) -> None:
                    nonlocal refused
                    bx, by = configs[(i + offset) % len(configs)]
                    try:
                        res = await call("measure_kernel", {"kernel": kernel(bx, by, f"k{i}")})
                        charged.append(res["cost"]["gpu_seconds"])
                    except ToolCallFailed as exc:
                        assert "left" in str(exc)
                        refused += 1

                async with anyio.create_task_group() as tg:
                    for i in range(50):
                        tg.start_soon(one, i)

        async with anyio.create_task_group() as tg:
            for c in range(4):
                tg.start_soon(one_client, c * 7)
    finally:
        srv.stop()
    state = _ledger(home, "small")
    assert refused > 0
    assert state["spent_gpu_seconds"] <= 0.5 + 1e-9
    assert state["reserved_gpu_seconds"] == 0
    assert state["spent_gpu_seconds"] == pytest.approx(sum(charged), abs=1e-5)
