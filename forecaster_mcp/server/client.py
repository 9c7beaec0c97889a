"""Small MCP-client helpers: start a server over stdio (or reach one over HTTP) and call its tools.

Used by the demo, the search command and the tests; any MCP client works the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.types import CallToolResult, TextContent

from forecaster_mcp.errors import ForecasterMcpError, OperatorError

ToolCaller = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ToolCallFailed(ForecasterMcpError):
    """A tool answered with isError: the message is the server's, meant for the agent."""


def tool_failure(exc: BaseException) -> ToolCallFailed | None:
    """The tool refusal inside `exc`: through the client's task groups it arrives wrapped in a group."""
    if isinstance(exc, ToolCallFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = tool_failure(inner)
            if found is not None:
                return found
    return None


def structured(result: CallToolResult) -> dict[str, Any]:
    """The structured content of a tool result, or ToolCallFailed with the server's message."""
    if result.is_error:
        text = " ".join(c.text for c in result.content if isinstance(c, TextContent))
        raise ToolCallFailed(text or "tool call failed")
    if result.structured_content is None:
        raise ToolCallFailed("tool returned no structured content")
    return dict(result.structured_content)


def stdio_params(
    home: Path,
    *,
    replay: Sequence[Path] = (),
    ledger: str | None = None,
    extra_env: dict[str, str] | None = None,
    own_settings: bool = False,
) -> StdioServerParameters:
    """Parameters that start `forecaster-mcp serve` with this Python over stdio. `own_settings`: none of this
    environment's FORECASTER_MCP_* settings reach the server (a search's runs must not depend on them)."""
    args = ["-m", "forecaster_mcp", "serve"]
    for p in replay:
        args += ["--replay", str(p)]
    if ledger:
        args += ["--ledger", ledger]
    prefixes = (
        ("ANTHROPIC_", "PATH", "CUDA") if own_settings else ("FORECASTER_MCP_", "ANTHROPIC_", "PATH", "CUDA")
    )
    env = {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
    env["FORECASTER_MCP_HOME"] = str(home)
    env.update(extra_env or {})
    return StdioServerParameters(command=sys.executable, args=args, env=env)


@asynccontextmanager
async def connect_stdio(
    home: Path,
    *,
    replay: Sequence[Path] = (),
    ledger: str | None = None,
    extra_env: dict[str, str] | None = None,
    own_settings: bool = False,
) -> AsyncIterator[tuple[Client, ToolCaller]]:
    """Start a server subprocess over stdio; yield the client and a structured-content tool caller. A server
    that exits before it answers (a state folder it cannot write, a setting it refuses) has printed why on its
    stderr, which is the caller's: that ends in an OperatorError saying so, not the client's exception group."""
    params = stdio_params(home, replay=replay, ledger=ledger, extra_env=extra_env, own_settings=own_settings)
    started = False
    try:
        async with Client(params, read_timeout_seconds=300) as client:
            started = True

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                return structured(await client.call_tool(name, arguments))

            yield client, call
    except Exception as exc:
        if started:
            raise
        raise OperatorError(
            "the server process started for this command (`forecaster-mcp serve` over stdio) exited before it "
            "answered; its own message, printed above, says why"
        ) from exc


@asynccontextmanager
async def connect_http(url: str, token: str | None) -> AsyncIterator[tuple[Client, ToolCaller]]:
    """Reach a running HTTP server with a bearer token."""
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with create_mcp_http_client(headers=headers) as http:
        async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=300) as client:

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                return structured(await client.call_tool(name, arguments))

            yield client, call
