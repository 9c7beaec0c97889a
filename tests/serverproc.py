"""Start real `forecaster-mcp` server processes for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# A client's first message, written out (the tests that speak the wire themselves).
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}


def cli(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real CLI entry point (`python -m forecaster_mcp`) against a state directory."""
    env = {**os.environ, "FORECASTER_MCP_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "forecaster_mcp", *args], env=env, capture_output=True, text=True, timeout=60
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"forecaster-mcp {' '.join(args)} failed: {proc.stderr}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class HttpServer:
    proc: subprocess.Popen[bytes]
    port: int
    home: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def kill(self) -> None:
        """SIGKILL: the crash the ledger must survive."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_http(home: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> HttpServer:
    """Start `forecaster-mcp serve --http` and wait (bounded) until it accepts connections."""
    port = free_port()
    full_env = {**os.environ, "FORECASTER_MCP_HOME": str(home), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "forecaster_mcp", "serve", "--http", "--port", str(port), *extra],
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"server exited early ({proc.returncode}): {err}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return HttpServer(proc, port, home)
        except OSError:
            time.sleep(0.05)  # polling a port under a deadline, not synchronising on time
    proc.kill()
    raise AssertionError("server did not start listening within 30 s")
