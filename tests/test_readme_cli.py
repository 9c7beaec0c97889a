"""What the README tells a user to run or set, run as written: the demo under the settings it documents, and
`serve` options that only mean something in the other transport."""

from __future__ import annotations

from pathlib import Path

import pytest
from serverproc import cli

from forecaster_mcp.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_runs_with_a_named_ledger_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent configs set FORECASTER_MCP_LEDGER; the demo's throw-away state has only its own ledger."""
    monkeypatch.setenv("FORECASTER_MCP_LEDGER", "run-42")
    done = cli(tmp_path / "home", "demo", check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "== 3. Budget (ledger default)" in done.stdout


def test_demo_refused_tool_call_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, conv_a100: Path
) -> None:
    """A budget the user set to nothing is the server's answer, not a traceback."""
    monkeypatch.setenv("FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS", "0")
    done = cli(tmp_path / "home", "demo", "--replay", str(conv_a100), check=False)
    err = done.stderr
    assert done.returncode == 2, err[-2000:]
    assert err.startswith("forecaster-mcp: ") and len(err.strip().splitlines()) == 1, err
    assert "0 GPU-seconds left" in err and "FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS" in err


@pytest.mark.parametrize(
    "address", [["--port", "8765"], ["--host", "0.0.0.0"], ["--allowed-host", "mcp.example.com"]]
)
def test_serve_host_or_port_without_http_is_refused(
    capsys: pytest.CaptureFixture[str], address: list[str]
) -> None:
    """Without --http they would be ignored and a stdio server would sit waiting on the terminal."""
    code, out, err = run(capsys, "serve", *address)
    assert code == 2 and out == ""
    assert err.startswith("forecaster-mcp: ") and "--http" in err and len(err.strip().splitlines()) == 1


def test_an_allowed_host_that_could_never_match_a_host_header_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A URL where the Host header value goes: every request through the proxy would get 421."""
    code, out, err = run(capsys, "serve", "--http", "--allowed-host", "https://mcp.example.com/mcp")
    assert code == 2 and out == ""
    assert "'https://mcp.example.com/mcp' is not a Host header value (a URL: pass its host alone)" in err


def test_an_unbracketed_ipv6_allowed_host_is_refused_with_how_to_write_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`::1` is no Host header value (a client sends `[::1]:8765`): the refusal says to bracket it."""
    code, out, err = run(capsys, "serve", "--http", "--allowed-host", "fe80::1")
    assert code == 2 and out == ""
    assert "'fe80::1' is not a Host header value (an IPv6 address goes in brackets: [::1], [::1]:8443)" in err


def test_serve_http_with_ledger_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """An HTTP server charges each token's ledger: --ledger would be silently ignored."""
    # An out-of-range port: were --ledger not refused first, the server would refuse the port, never serve.
    code, out, err = run(capsys, "serve", "--http", "--port", "70000", "--ledger", "run-42")
    assert code == 2 and out == ""
    assert "token issue --ledger run-42" in err and len(err.strip().splitlines()) == 1


def test_output_piped_into_a_reader_that_stops_early_is_no_traceback(tmp_path: Path) -> None:
    """`forecaster-mcp ledger show | head -1`: the closed pipe used to end in a BrokenPipeError traceback.
    The reader's end is closed before the command writes, so every write meets the closed pipe."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    assert main(["--home", str(home), "ledger", "create", "team", "--gpu-seconds", "10"]) == 0
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "forecaster_mcp", "--home", str(home), "ledger", "show"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_demo_whose_server_cannot_start_ends_with_the_server_s_message_not_a_traceback(
    tmp_path: Path,
) -> None:
    # A state folder the server cannot write: the server said so and exited, and the demo's client then raised
    # an exception group ("Connection closed") forty lines long under it.
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    proc = cli(tmp_path, "--home", str(blocked / "home"), "demo", check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "exited before it answered" in proc.stderr + proc.stdout
