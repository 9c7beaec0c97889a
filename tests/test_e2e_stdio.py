"""A real stdio server process driven by the MCP client, as an IDE would."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replay_kernels import FAST, conv
from serverproc import INITIALIZE

from forecaster_mcp.server.client import connect_stdio, stdio_params

pytestmark = pytest.mark.anyio

Replies = dict[int, dict[str, Any]]
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def _serve_process(home: Path, replay: Path, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """A real `serve` process on `replay`, its stdin and stdout piped (text), stderr as asked."""
    params = stdio_params(home, replay=[replay])
    return subprocess.Popen(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=params.env,
        text=True,
    )


def raw_exchange(home: Path, replay: Path, lines: list[str], done: Callable[[Replies], bool]) -> Replies:
    """Write `lines` to a real `serve` process's stdin and read its replies (by id) until `done`, keeping stdin
    open as a client does; a hung server is killed after 120 s, not waited on forever."""
    proc = _serve_process(home, replay)
    watchdog = threading.Timer(120.0, proc.kill)
    watchdog.start()
    replies: Replies = {}
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(line + "\n" for line in lines))
        proc.stdin.flush()
        while not done(replies) and (line := proc.stdout.readline()):
            message = json.loads(line)
            if "id" in message:
                replies[message["id"]] = message
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    return replies


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
    kernel = {**conv("k0", FAST), "source": conv("k0", FAST)["source"] + "\n// caf\udce9\n"}
    calls = [
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
    lines = [json.dumps(m) for m in (INITIALIZE, INITIALIZED, *calls)]
    assert "\\udce9" in lines[2]
    replies = raw_exchange(tmp_path / "home", conv_a100, lines, lambda r: len(r) >= 3)
    assert set(replies) == {1, 2, 3}, replies
    assert "result" in replies[2], replies[2]
    compared = replies[2]["result"]
    assert not compared.get("isError"), compared
    assert compared["structuredContent"]["baseline"] == "k0"
    assert not replies[3]["result"].get("isError")


def test_surrogate_filter_keeps_pairs_and_leaves_other_lines_alone() -> None:
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
    deep = (
        '{"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"x": '
        + "[" * 5000
        + '"\\ud800"'
        + "]" * 5000
    )
    lines = [
        json.dumps(INITIALIZE),
        json.dumps(INITIALIZED),
        deep + "}}",
        json.dumps({"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"x": "\udc80"}}),
    ]
    replies = raw_exchange(tmp_path / "home", conv_a100, lines, lambda r: {2, 3} <= set(r))
    # The deep line is answered as any line nested that deep is (a parse error), and the server goes on.
    assert replies.get(2, {}).get("error", {}).get("code") == -32700, replies
    assert replies.get(3) == {"jsonrpc": "2.0", "id": 3, "result": {}}, replies


def test_stdio_server_answers_lines_it_cannot_parse_with_a_parse_error(
    tmp_path: Path, conv_a100: Path
) -> None:
    """mcp 2.3's stdio transport hands a line it cannot parse to the session, which drops it: a client sending
    a define nested 300 lists deep, an integer of 5000 digits or a cut-off line waited for ever (HTTP answers
    400 with -32700). Each now gets a JSON-RPC parse error under its id (null when none can be read)."""
    deep = {"name": "compare_kernels", "arguments": {"candidates": [conv("a", FAST), conv("b", FAST)]}}
    deep["arguments"]["candidates"][1]["defines"] = {"X": "@"}
    text = json.dumps({"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": deep})
    lines = [
        json.dumps(INITIALIZE),
        json.dumps(INITIALIZED),
        text.replace('"@"', "[" * 300 + "1" + "]" * 300),
        '{"jsonrpc": "2.0", "id": "big", "method": "ping", "params": {"n": ' + "9" * 5000 + "}}",
        '{"jsonrpc": "2.0", "method": "ping", "params": {"id": 5}, "id": 12, "x": [[',
        '{"params": [1, 2',
        json.dumps({"jsonrpc": "2.0", "id": 13, "method": "ping"}),
    ]
    # Every reply, not only the last line's: the parse errors come from the server's own reader, the ping's
    # from the session, and the two may reach stdout in either order.
    replies = raw_exchange(tmp_path / "home", conv_a100, lines, lambda r: {10, "big", 12, None, 13} <= set(r))
    for key in (10, "big", 12, None):
        error = replies.get(key, {}).get("error", {})
        assert error.get("code") == -32700 and "flatten the value" in error.get("message", ""), replies
    assert replies.get(13) == {"jsonrpc": "2.0", "id": 13, "result": {}}, replies


async def test_two_server_processes_asked_for_one_measurement_charge_it_once(
    tmp_path: Path, conv_a100: Path
) -> None:
    """Two IDE windows on one state directory: the second waits for the first's measurement, served free."""
    import anyio
    from replay_kernels import SLOW

    home = tmp_path / "home"
    slow = {"FORECASTER_MCP_REPLAY_REALTIME": "4"}  # the recorded ~1 GPU-second takes ~4 s of wall time
    async with connect_stdio(home, replay=[conv_a100]) as (_c, call):
        await call("budget_status", {})  # creates the state directory and its default ledger first
    costs: list[dict[str, Any]] = []

    async def one(second: bool) -> None:
        async with connect_stdio(home, replay=[conv_a100], extra_env=slow) as (_c, call):
            if second:
                # Asks only once the first process holds the device (its hold is visible to every process):
                # a fixed delay raced the first server's start-up on a slow machine and both measured.
                with anyio.fail_after(60):
                    while (await call("budget_status", {}))["reserved_gpu_seconds"] == 0:  # noqa: ASYNC110
                        await anyio.sleep(0.05)  # the hold is in another process: nothing here to wait on
            costs.append((await call("measure_kernel", {"kernel": conv("x", SLOW)}))["cost"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, False)
        tg.start_soon(one, True)
    assert sorted(c["cached"] for c in costs) == [False, True], costs
    charged = [c["gpu_seconds"] for c in costs if not c["cached"]]
    async with connect_stdio(home, replay=[conv_a100]) as (_c, call):
        status = await call("budget_status", {})
    assert status["spent_gpu_seconds"] == pytest.approx(charged[0]) and charged[0] > 0.5
    assert status["reserved_gpu_seconds"] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_stdio_server_cleanly(tmp_path: Path, conv_a100: Path, sig: signal.Signals) -> None:
    """SIGTERM killed a stdio server with its store open (WAL left behind, a measurement's hold open until
    the next start released it free); SIGINT closed the service but left the process waiting on stdin for one
    more line. Both now end it as EOF does, exit status 0."""
    proc = _serve_process(tmp_path, conv_a100)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(INITIALIZE) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["id"] == INITIALIZE["id"]
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0  # stdin still open: no EOF ended it
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "forecaster.sqlite3-wal").exists()


def test_a_client_that_stops_reading_ends_a_stdio_server_with_one_line(
    tmp_path: Path, conv_a100: Path
) -> None:
    """A client that goes away (its read end closed) while the server still has answers to write: the server
    printed a BrokenPipeError traceback through two exception groups and exited 1. It now stops as EOF stops it
    (the service closed, the store's WAL gone), says so in one line, and exits 0."""
    proc = _serve_process(tmp_path, conv_a100, stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(json.dumps(INITIALIZE) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["id"] == INITIALIZE["id"]
        proc.stdin.write(json.dumps(INITIALIZED) + "\n")
        proc.stdout.close()
        try:
            for i in range(5):
                proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 10 + i, "method": "tools/list"}) + "\n")
                proc.stdin.flush()
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the server had already gone
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "the client stopped reading" in err, err
    assert not (tmp_path / "forecaster.sqlite3-wal").exists()


async def test_a_parse_error_names_its_own_lines_id_when_the_reader_is_ahead() -> None:
    """The SDK's reader may take the next line before the previous line's parse error is answered: the error
    was sent under the next request's id (now and then in a full run), and the unparsable request's client
    waited for ever."""
    import io

    import anyio
    from mcp.shared.message import SessionMessage
    from mcp.types import JSONRPCRequest

    from forecaster_mcp.server.app import _answer_unparsed, _WireLines

    bad = '{"jsonrpc": "2.0", "id": 10, "method": "ping", "params": [[[\n'
    good = '{"jsonrpc": "2.0", "id": 13, "method": "ping"}\n'
    lines = _WireLines(io.StringIO(bad + good))
    read_send, read_stream = anyio.create_memory_object_stream[Any](4)
    inner_send, inner_read = anyio.create_memory_object_stream[Any](4)
    write_send, write_read = anyio.create_memory_object_stream[Any](4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_unparsed, read_stream, inner_send, write_send, lines)
        seen = [line async for line in lines]  # the reader has read both lines before either item is taken
        assert len(seen) == 2
        await read_send.send(ValueError("EOF while parsing a list"))
        await read_send.send(SessionMessage(JSONRPCRequest(jsonrpc="2.0", id=13, method="ping")))
        with anyio.fail_after(5):
            reply = await write_read.receive()
            forwarded = await inner_read.receive()
        tg.cancel_scope.cancel()
    assert reply.message.id == 10 and reply.message.error.code == -32700
    assert forwarded.message.id == 13


async def test_an_agent_s_load_inline_modules_are_forecast_with_the_launch_their_wrappers_give(
    tmp_path: Path,
) -> None:
    """KernelBench's form through a real server: two Python modules compiling their CUDA with torch's
    load_inline, sent without launches. The forecast reads each launch from the C++ wrapper in the module's
    string, so the vector kernel's four elements a thread count (work per thread), as for .cu files."""
    from test_host_launch import TORCH_NAIVE, TORCH_VEC4, _load_inline

    workload = {
        "name": "relu_16M",
        "args": [
            {"name": "x", "dtype": "float32", "shape": [1 << 24], "init": "random_uniform", "intent": "in"}
        ],
    }
    kernels = [
        {"id": kid, "source": _load_inline(cuda), "entry": "ModelNew", "language": "python"}
        for kid, cuda in (("naive", TORCH_NAIVE), ("vec4", TORCH_VEC4))
    ]
    async with connect_stdio(tmp_path / "home") as (_, call):
        out = await call("compare_kernels", {"candidates": kernels, "workload": workload, "hardware": "H100"})
    [vec4] = out["candidates"]
    assert vec4["id"] == "vec4" and vec4["p_faster"] > 0.75
    assert "more work per thread" in vec4["rationale"]
    assert (
        "launch read from the source's host code: baseline's grid [65536, 1, 1], block [256, 1, 1]"
        in (vec4["rationale"])
    )
