"""Calling the tools of an in-process server from tests: the structured answer, or the error text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from forecaster_mcp.server.app import build_server
from forecaster_mcp.server.client import ToolCallFailed, structured
from forecaster_mcp.service import Service
from forecaster_mcp.settings import Settings


async def call(client: Client, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return structured(await client.call_tool(name, args))


async def error_of(client: Client, name: str, args: dict[str, Any]) -> str:
    """The error text of a call that must fail (the test fails if it succeeds)."""
    with pytest.raises(ToolCallFailed) as info:
        await call(client, name, args)
    return str(info.value)


@asynccontextmanager
async def running(
    home: Path, replay: list[Path], ledger_seconds: float | None = 100.0, replay_realtime: float = 0.0
) -> AsyncIterator[tuple[Client, Service]]:
    """An in-process server replaying `replay`, with ledger 'team' of `ledger_seconds` (None: no ledger), at
    `replay_realtime` wall-clock seconds per GPU-second (serve --replay-realtime; 0: at once)."""
    settings = Settings.from_env(
        home=home, replay=replay, measurer="replay", ledger="team", replay_realtime=replay_realtime
    )
    service = await Service.open(settings)
    try:
        if ledger_seconds is not None:
            await service.store.create_ledger("team", ledger_seconds)
        async with Client(build_server(service)) as client:
            yield client, service
    finally:
        await service.close()
