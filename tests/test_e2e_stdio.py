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


def test_stdio_server_answers_a_line_with_a_lone_surrogate(tmp_path: Path, conv_a100: Path) -> None:
    """`json.dumps` writes a lone surrogate (a file read with errors="surrogateescape") as `"\\udc80"`; the
    SDK's transport used to drop such a line without replying, so the client waited forever. The raw wire of
    a real server process: the request is answered, the surrogate read as U+FFFD, and the server goes on."""
    import json
    import subprocess
    import threading
    from typing import Any

    from forecaster_mcp.server.client import stdio_params

    params = stdio_params(tmp_path / "home", replay=[conv_a100])
    kernel = {**conv("k0", FAST), "source": conv("k0", FAST)["source"] + "\n// caf\udce9\n"}
    lines = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "compare_kernels", "arguments": {"candidates": [kernel, conv("k1", FAST)]}},
        },
        {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "tools/call",
            "params": {"name": "budget_status", "arguments": {}},
        },
    ]
    wire = "".join(json.dumps(m) + "\n" for m in lines)
    assert "\\udce9" in wire
    proc = subprocess.Popen(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=params.env,
        text=True,
    )
    # A client keeps its end open until it has its replies; a hung server is killed, not waited on forever.
    watchdog = threading.Timer(120.0, proc.kill)
    watchdog.start()
    replies: dict[int, dict[str, Any]] = {}
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(wire)
        proc.stdin.flush()
        while len(replies) < 3 and (line := proc.stdout.readline()):
            message = json.loads(line)
            if "id" in message:
                replies[message["id"]] = message
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert set(replies) == {1, 2, 3}, replies
    assert "result" in replies[2], replies[2]
    compared = replies[2]["result"]
    assert not compared.get("isError"), compared
    assert compared["structuredContent"]["baseline"] == "k0"
    assert not replies[3]["result"].get("isError")


def test_surrogate_filter_keeps_pairs_and_leaves_other_lines_alone() -> None:
    import json

    from forecaster_mcp.server.app import without_lone_surrogates

    plain = '{"jsonrpc": "2.0", "id": 7, "method": "ping"}'
    assert without_lone_surrogates(plain) is plain
    # `\\ud800` in JSON text is an escaped backslash and "ud800": text, not an escape.
    assert without_lone_surrogates('"\\\\ud800 \\ud800"') == '"\\\\ud800 \\ufffd"'
    line = json.dumps({"a": "x\ud800y", "\udc80k": ["\U0001f600", "\\ud800 as text"]})
    assert json.loads(without_lone_surrogates(line)) == {
        "a": "x\ufffdy",
        "\ufffdk": ["\U0001f600", "\\ud800 as text"],
    }


def test_stdio_server_survives_lines_the_surrogate_filter_cannot_parse(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A lone surrogate escape in a line nested deeper than Python's recursion limit must not take the server
    down: the filter used to re-parse the line, and the RecursionError ended the whole process."""
    import json
    import subprocess
    import threading
    from typing import Any

    from forecaster_mcp.server.client import stdio_params

    params = stdio_params(tmp_path / "home", replay=[conv_a100])
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    deep = (
        '{"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"x": '
        + "[" * 5000
        + '"\\ud800"'
        + "]" * 5000
    )
    wire = "".join(
        line + "\n"
        for line in (
            json.dumps(initialize),
            json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            deep + "}}",
            json.dumps({"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"x": "\udc80"}}),
        )
    )
    proc = subprocess.Popen(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=params.env,
        text=True,
    )
    watchdog = threading.Timer(120.0, proc.kill)
    watchdog.start()
    replies: dict[int, dict[str, Any]] = {}
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(wire)
        proc.stdin.flush()
        while 3 not in replies and (line := proc.stdout.readline()):
            message = json.loads(line)
            if "id" in message:
                replies[message["id"]] = message
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    # The deep line goes the way the SDK treats any line nested that deep (dropped); the server goes on.
    assert replies.get(3) == {"jsonrpc": "2.0", "id": 3, "result": {}}, replies
