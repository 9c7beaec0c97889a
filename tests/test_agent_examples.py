"""Every ready-made client configuration parses and starts the server it names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from serverproc import cli, start_http

from forecaster_mcp.server.client import connect_http

EXAMPLES = Path(__file__).resolve().parents[1] / "agent_examples"
STDIO_FILES = ["claude_code.mcp.json", "cursor.mcp.json", "vscode.mcp.json"]


def _server_entry(doc: dict[str, Any]) -> dict[str, Any]:
    servers = doc.get("mcpServers") or doc.get("servers")
    assert isinstance(servers, dict) and "forecaster" in servers
    entry = servers["forecaster"]
    assert isinstance(entry, dict)
    return entry


def _command(name: str) -> str:
    """The configs name `forecaster-mcp` as installed on PATH; in tests use this venv's copy."""
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.skip(f"{name} is not installed in this environment (pip install -e .)")
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("filename", STDIO_FILES)
async def test_stdio_config_starts_a_working_server(filename: str, tmp_path: Path) -> None:
    entry = _server_entry(json.loads((EXAMPLES / filename).read_text()))
    assert entry.get("type", "stdio") == "stdio"
    env = {**entry.get("env", {}), "FORECASTER_MCP_HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    params = StdioServerParameters(command=_command(entry["command"]), args=entry["args"], env=env)
    async with Client(params, read_timeout_seconds=60) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert names == {"compare_kernels", "measure_kernel", "budget_status"}
        status = (await client.call_tool("budget_status", {})).structured_content
        assert status is not None and status["ledger"] == entry["env"]["FORECASTER_MCP_LEDGER"]


@pytest.mark.anyio
async def test_http_config_reaches_a_token_protected_server(tmp_path: Path) -> None:
    entry = _server_entry(json.loads((EXAMPLES / "shared_http.mcp.json").read_text()))
    assert entry["type"] == "http"
    home = tmp_path / "srv"
    cli(home, "ledger", "create", "agent-run-1", "--gpu-seconds", "10")
    token = cli(home, "token", "issue", "--ledger", "agent-run-1").stdout.strip().splitlines()[-1]
    port_in_config = int(re.search(r":(\d+)/mcp", entry["url"]).group(1))  # type: ignore[union-attr]
    srv = start_http(home)
    try:
        url = entry["url"].replace(str(port_in_config), str(srv.port))
        header = entry["headers"]["Authorization"].replace("${FORECASTER_MCP_TOKEN}", token)
        assert header == f"Bearer {token}"
        async with connect_http(url, token) as (_, call):
            status = await call("budget_status", {})
            assert status["ledger"] == "agent-run-1"
            assert status["limit_gpu_seconds"] == 10
    finally:
        srv.stop()


def test_search_loop_example_runs_a_budgeted_search(conv_a100: Path, tmp_path: Path) -> None:
    """The loop users copy: it starts a real stdio server on a recording, forecasts, measures measure_next's
    head, and reports what it spent."""
    env = {**os.environ, "FORECASTER_MCP_HOME": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "search_loop.py"),
            str(conv_a100),
            "--measurements",
            "6",
            "--pool",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.search(r"after 6 measurements, \d+ candidates considered, [0-9.]+ GPU-seconds spent", last), (
        last
    )
    assert "new best" in done.stdout


def test_search_loop_gives_its_own_server_the_budget_asked_for(conv_a100: Path, tmp_path: Path) -> None:
    # --gpu-seconds is the limit of the stdio server's ledger; the caller's FORECASTER_MCP_* settings reach that
    # server too, its own state folder and ledger aside.
    done = _search_loop(
        str(conv_a100),
        "--measurements",
        "40",
        "--gpu-seconds",
        "0.2",
        env={"FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS": "99", "FORECASTER_MCP_LEDGER": "not-in-its-home"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stopping: the server refused a measurement" in done.stdout and "(limit 0.2," in done.stdout
    spent = float(re.search(r"([0-9.]+) GPU-seconds spent", done.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < spent <= 0.2


def _search_loop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "search_loop.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def test_search_loop_drives_a_shared_http_server_until_its_budget_is_spent(
    conv_a100: Path, tmp_path: Path
) -> None:
    """--url: the loop charges the ledger of its token on a running server, and an exhausted budget ends it with
    a report, not a traceback."""
    home = tmp_path / "srv"
    cli(home, "ledger", "create", "agent-run-1", "--gpu-seconds", "0.15")
    token = cli(home, "token", "issue", "--ledger", "agent-run-1").stdout.strip().splitlines()[-1]
    srv = start_http(home, ["--replay", str(conv_a100)])
    try:
        done = _search_loop(
            str(conv_a100), "--url", srv.url, "--measurements", "40", env={"FORECASTER_MCP_TOKEN": token}
        )
        between = json.loads(cli(home, "ledger", "show", "agent-run-1", "--json").stdout)["spent_gpu_seconds"]
        # Again on the same ledger: it reports what this run spent, not the ledger's lifetime spend. The token
        # as a secret file mounted into the environment gives it, with its line break (an invalid header before).
        again = _search_loop(
            str(conv_a100),
            "--url",
            srv.url,
            "--measurements",
            "40",
            env={"FORECASTER_MCP_TOKEN": token + "\n"},
        )
    finally:
        srv.stop()
    assert again.returncode == 0, again.stderr[-2000:]
    after = json.loads(cli(home, "ledger", "show", "agent-run-1", "--json").stdout)["spent_gpu_seconds"]
    last_again = again.stdout.strip().splitlines()[-1]
    second = float(re.search(r"([0-9.]+) GPU-seconds spent", last_again).group(1))  # type: ignore[union-attr]
    assert second == pytest.approx(after - between, abs=1e-3) and between > 0
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "stopping: the server refused a measurement" in done.stdout and "GPU-seconds left" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    spent = float(re.search(r"([0-9.]+) GPU-seconds spent", last).group(1))  # type: ignore[union-attr]
    assert 0 < spent <= 0.15
    assert between == pytest.approx(spent, abs=1e-3)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["no-such.json.gz"], {}, "is not a readable Kernel Tuner cache file"),
        (
            ["RECORDING", "--url", "http://127.0.0.1:9/mcp"],
            {"FORECASTER_MCP_TOKEN": ""},
            "FORECASTER_MCP_TOKEN",
        ),
        (
            ["RECORDING", "--url", "http://127.0.0.1:9/mcp"],
            {"FORECASTER_MCP_TOKEN": " \n"},
            "--url needs a bearer token in FORECASTER_MCP_TOKEN",
        ),
        (
            ["RECORDING", "--url", "http://127.0.0.1:9/mcp"],
            {"FORECASTER_MCP_TOKEN": "fmcp_x"},
            "cannot use the server at http://127.0.0.1:9/mcp",
        ),
        (
            ["RECORDING", "--url", "http://127.0.0.1:9/mcp", "--gpu-seconds", "5"],
            {"FORECASTER_MCP_TOKEN": "fmcp_x"},
            "not with --url",
        ),
        (["RECORDING", "--gpu-seconds", "-1"], {}, "a number >= 0"),
    ],
)
def test_search_loop_mistakes_are_one_line_errors(
    conv_a100: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    done = _search_loop(*[str(conv_a100) if a == "RECORDING" else a for a in args], env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert message in done.stderr


def test_search_loop_counts_each_configuration_once(tmp_path: Path) -> None:
    """A space of 12 configurations, pools of 8: the candidates considered are at most the space, and the
    loop ends when every configuration is measured instead of proposing measured ones again."""
    from replay_kernels import small_recording

    rec = small_recording(
        tmp_path / "tiny.json",
        {str(bx): {"bx": bx, "time": 1.0 + abs(bx - 96) / 100, "times": [1.0]} for bx in range(16, 208, 16)},
    )
    env = {**os.environ, "FORECASTER_MCP_HOME": str(tmp_path / "home")}

    script = str(EXAMPLES / "search_loop.py")

    def loop(measurements: int) -> str:
        done = subprocess.run(
            [sys.executable, script, str(rec), "--pool", "8", "--measurements", str(measurements)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    out = loop(40)
    found = re.search(r"after (\d+) measurements, (\d+) candidates considered", out)
    assert found is not None, out
    assert int(found.group(1)) <= 12 and int(found.group(2)) <= 12
    # The anchor round measures one proposal and forecasts none: the other seven were never considered.
    out = loop(1)
    assert "after 1 measurements, 1 candidates considered" in out, out
