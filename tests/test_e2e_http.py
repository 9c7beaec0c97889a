"""A real HTTP server process: bearer tokens map to ledgers, bad tokens get 401 and touch nothing."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from conftest import dataset, isolate
from replay_kernels import conv_block as kernel
from serverproc import INITIALIZE, HttpServer, cli, free_port, start_http

from forecaster_mcp.server.client import ToolCallFailed, connect_http


def _ledger_and_token(home: Path, ledger: str, gpu_seconds: float) -> str:
    """Create `ledger` in the state folder `home` and issue a bearer token for it (printed last)."""
    cli(home, "ledger", "create", ledger, "--gpu-seconds", str(gpu_seconds))
    return cli(home, "token", "issue", "--ledger", ledger).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, dict[str, str]]]:
    """One server process for the tests below (five processes each, set up per test, took a third of this
    file's time): none of them depends on a fresh one. Only alice measures, and only once; the token revoked is
    one issued for it; the rest read."""
    tmp = tmp_path_factory.mktemp("e2e_http")
    with pytest.MonkeyPatch.context() as env:
        isolate(env, tmp)  # set up before any test's own isolation: the processes started here need it too
        home = tmp / "srv"
        tokens = {name: _ledger_and_token(home, name, 50) for name in ("alice", "bob")}
        srv = start_http(home, ["--replay", str(dataset("cachefiles", "convolution_milo", "A100.json.gz"))])
        try:
            yield srv, tokens
        finally:
            srv.stop()


def _ledger(home: Path, name: str) -> dict[str, Any]:
    out = json.loads(cli(home, "ledger", "show", name, "--json").stdout)
    return out[0] if isinstance(out, list) else out


_TOOLS_LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
_MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def _refusal(srv: HttpServer, authorization: str | None) -> str:
    """POST tools/list with this Authorization header (None: none); assert a standard 401 (the SDK's
    `invalid_token` challenge, the same description in header and body); return the description."""
    headers = dict(_MCP_HEADERS)
    if authorization is not None:
        headers["Authorization"] = authorization
    with httpx2.Client(timeout=10) as http:
        refused = http.post(srv.url, json=_TOOLS_LIST, headers=headers)
    assert refused.status_code == 401, refused.text
    assert refused.headers["content-type"] == "application/json"
    body = refused.json()
    assert body["error"] == "invalid_token"
    challenge = refused.headers["www-authenticate"]
    assert challenge == f'Bearer error="invalid_token", error_description="{body["error_description"]}"'
    return str(body["error_description"])


def test_a_401_says_whether_the_token_is_missing_or_refused_and_what_to_do(
    server: tuple[HttpServer, dict[str, str]],
) -> None:
    """Every refusal was "Authentication required": a client with no token configured and one with a wrong or
    revoked token could not tell which, nor what to do next."""
    srv, tokens = server
    missing = _refusal(srv, None)
    assert "no bearer token" in missing and "Authorization: Bearer <token>" in missing
    assert "forecaster-mcp token issue --ledger" in missing

    assert "not a bearer token" in _refusal(srv, "Basic dXNlcjpwYXNz")
    assert "without `Bearer `" in _refusal(srv, tokens["alice"])
    # `Bearer ${FORECASTER_MCP_TOKEN}` with the variable unset, as the server reads it (trailing space stripped).
    assert "no token after `Bearer`" in _refusal(srv, "Bearer")

    unknown = _refusal(srv, "Bearer fmcp_not-a-real-token")
    assert "not known to this server or was revoked" in unknown
    assert "forecaster-mcp token list" in unknown and "FORECASTER_MCP_HOME" in unknown
    # A token of its own (the server is shared), used, then revoked while the server runs: it reads as one never
    # issued, so a refusal tells nothing about which tokens exist.
    revoked = cli(srv.home, "token", "issue", "--ledger", "bob").stdout.strip().splitlines()[-1]
    assert _post_initialize(srv, revoked) == 200
    cli(srv.home, "token", "revoke", revoked)
    assert _refusal(srv, f"Bearer {revoked}") == unknown
    for shown in (missing, unknown):
        assert "alice" not in shown and "bob" not in shown and "fmcp_not" not in shown
    assert "start with fmcp_" in _refusal(srv, "Bearer sk-ant-123")
    assert "quotes or spaces" in _refusal(srv, f'Bearer "{tokens["alice"]}"')

    # The right token still opens a session (a refused request's session id is dropped, not an accepted one's).
    with httpx2.Client(timeout=10) as http:
        ok = http.post(
            srv.url, json=INITIALIZE, headers={**_MCP_HEADERS, "Authorization": f"Bearer {tokens['alice']}"}
        )
    assert ok.status_code == 200 and ok.headers["mcp-session-id"]


def test_first_contact_mistakes_are_answered_with_what_to_send(
    server: tuple[HttpServer, dict[str, str]],
) -> None:
    """The mistakes of a first hand-written client got bare answers ("Not Found", "Invalid Content-Type header",
    "Missing session ID", "Request body too large") that did not say what the server wanted instead."""
    srv, tokens = server
    auth = {"Authorization": f"Bearer {tokens['alice']}"}
    base = srv.url.removesuffix("/mcp")
    with httpx2.Client(timeout=10) as http:
        for path in ("/", "/sse", "/mcp/v1"):  # the server's root, another transport's path, a guessed one
            lost = http.post(base + path, json=INITIALIZE, headers={**_MCP_HEADERS, **auth})
            assert lost.status_code == 404
            assert "MCP at /mcp" in lost.text and "streamable HTTP" in lost.text
        assert http.get(base + "/").status_code == 404  # no token needed to learn the path
        # /mcp/ is /mcp: it was a 307 to http://<Host>/mcp, which behind a TLS proxy sent the client to plain http
        slash = http.post(srv.url + "/", json=INITIALIZE, headers={**_MCP_HEADERS, **auth})
        assert slash.status_code == 200 and "mcp-session-id" in slash.headers, (
            slash.status_code,
            slash.headers,
        )

        untyped = http.post(
            srv.url, content=json.dumps(INITIALIZE), headers={"Accept": _MCP_HEADERS["Accept"], **auth}
        )
        assert untyped.status_code == 400 and "Content-Type: application/json" in untyped.text

        no_session = http.post(srv.url, json=_TOOLS_LIST, headers={**_MCP_HEADERS, **auth})
        assert no_session.status_code == 400
        message = no_session.json()["error"]["message"]
        assert message.startswith("Bad Request: Missing session ID") and "initialize" in message
        assert "mcp-session-id" in message
        # The session the refused request would have opened is gone: its id is not offered to reuse.
        assert "mcp-session-id" not in no_session.headers

    # A body declared past the limit is refused before it is read, saying the limit.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {tokens['alice']}\r\n"
                "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Content-Length: {97 * 2**20}\r\n\r\n"
            ).encode()
        )
        answer = sock.makefile("rb")
        status = answer.readline()
        length = 0
        while (line := answer.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            length = int(value) if name.lower() == b"content-length" else length
        refused = status + answer.read(length)
    assert refused.startswith(b"HTTP/1.1 413"), refused
    assert refused.endswith(b"at most 96 MiB"), refused


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
    # The server charges the tokens' ledgers only: it adds no `default` ledger of its own to the operator's.
    shown = json.loads(cli(srv.home, "ledger", "show", "--json").stdout)
    assert sorted(row["name"] for row in shown) == ["alice", "bob"]


@pytest.mark.anyio
async def test_concurrent_clients_never_overspend(tmp_path: Path, conv_a100: Path) -> None:
    """Hundreds of concurrent measure_kernel calls from several clients against a small ledger."""
    home = tmp_path / "attack"
    token = _ledger_and_token(home, "small", 0.5)
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


def _one_line_refusal(proc: Any) -> str:
    err = str(proc.stderr)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("forecaster-mcp: ") and "serving streamable HTTP" not in err
    return err


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (["--port", "70000"], "--port must be between 1 and 65535, got 70000"),
        (["--port", "-1"], "--port must be between 1 and 65535, got -1"),
        (["--host", "999.1.1.1"], "--host '999.1.1.1' is not an IP address or host name"),
        (["--host", "no_such host"], "is not an IP address or host name"),
    ],
)
def test_bad_host_or_port_is_a_one_line_error(tmp_path: Path, address: list[str], message: str) -> None:
    err = _one_line_refusal(cli(tmp_path / "home", "serve", "--http", *address, check=False))
    assert message in err
    assert not (tmp_path / "home" / "forecaster.sqlite3").exists()  # refused before the service opened


def test_busy_port_is_a_one_line_error(server: tuple[HttpServer, dict[str, str]], tmp_path: Path) -> None:
    srv, _ = server
    busy = cli(tmp_path / "other", "serve", "--http", "--port", str(srv.port), check=False)
    err = _one_line_refusal(busy)
    assert f"port {srv.port} is already in use" in err and "pass another --port" in err
    assert not (
        tmp_path / "other" / "forecaster.sqlite3"
    ).exists()  # the port is bound before the service opens


def test_serving_line_comes_only_once_the_service_opened(tmp_path: Path) -> None:
    not_a_recording = tmp_path / "notes.json"
    not_a_recording.write_text("{}")
    port = str(free_port())
    failed = cli(
        tmp_path / "home", "serve", "--http", "--port", port, "--replay", str(not_a_recording), check=False
    )
    assert "cannot read replay recording" in _one_line_refusal(failed)


@pytest.mark.anyio
async def test_401_points_at_no_oauth_server_when_bound_to_every_interface(tmp_path: Path) -> None:
    """Tokens are static bearer tokens: a 401 must not send clients to OAuth metadata or an authorization server
    (which do not exist, and which --host 0.0.0.0 would have named as http://0.0.0.0:PORT)."""
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    srv = start_http(home, ["--host", "0.0.0.0"])
    try:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        with httpx2.Client(timeout=10) as http:
            refused = http.post(srv.url, json=body, headers=headers)
            assert refused.status_code == 401
            challenge = refused.headers["www-authenticate"]
            assert challenge.startswith("Bearer ") and "resource_metadata" not in challenge
            assert "0.0.0.0" not in challenge + refused.text
            base = srv.url.removesuffix("/mcp")
            for well_known in (
                "oauth-protected-resource/mcp",
                "oauth-protected-resource",
                "oauth-authorization-server",
            ):
                assert http.get(f"{base}/.well-known/{well_known}").status_code == 404
        async with connect_http(srv.url, token) as (_, call):  # the static token is what works
            assert (await call("budget_status", {}))["ledger"] == "alice"
        # Whatever name clients reach the machine by (no --allowed-host: no Host check off loopback).
        assert _post_initialize(srv, token, Host="gpu-box:8765") == 200
    finally:
        srv.stop()


@pytest.mark.anyio
async def test_a_compare_of_large_sources_fits_in_one_http_request(
    server: tuple[HttpServer, dict[str, str]],
) -> None:
    # 64 candidates of up to 1 MB each are within the tool's contract: 12 of 600 KB (7 MB, past the SDK's
    # default 4 MiB body limit, which answered a bare 413) are accepted as they are over stdio.
    srv, tokens = server
    padding = "// " + "x" * 600_000 + "\n"
    candidates = [{**kernel(16 * (1 + i % 4), 1 + i // 4), "id": f"k{i}"} for i in range(12)]
    for c in candidates:
        c["source"] = padding + c["source"]
    async with connect_http(srv.url, tokens["alice"]) as (_, call):
        out = await call("compare_kernels", {"candidates": candidates})
    assert len(out["candidates"]) == 11


@pytest.mark.anyio
async def test_sigterm_closes_the_store_before_the_process_exits(tmp_path: Path, conv_a100: Path) -> None:
    # uvicorn raised the SIGTERM again once it had shut down, which killed the process before the service
    # closed: the store was never closed and its write-ahead log was left behind.
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    srv = start_http(home, ["--replay", str(conv_a100)])
    try:
        async with connect_http(srv.url, token) as (_, call):
            assert (await call("measure_kernel", {"kernel": kernel(32, 4)}))["status"] == "ok"
        assert (home / "forecaster.sqlite3-wal").exists()  # open, in WAL mode
        srv.proc.terminate()
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    assert not (home / "forecaster.sqlite3-wal").exists()  # the last connection closed cleanly
    assert _ledger(home, "alice")["spent_gpu_seconds"] > 0


def test_one_ledger_cannot_take_every_session(tmp_path: Path, conv_a100: Path) -> None:
    """The SDK's session limit is server-wide (10,000, idle ones kept 30 minutes): one token opening sessions in
    a loop locked every other ledger out. Each ledger now has its own limit."""
    home = tmp_path / "srv"
    tokens = {name: _ledger_and_token(home, name, 5) for name in ("mallory", "alice")}
    srv = start_http(home, ["--replay", str(conv_a100)], env={"FORECASTER_MCP_MAX_SESSIONS_PER_LEDGER": "2"})
    body = INITIALIZE
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}

    def open_session(ledger: str) -> int:
        auth = {**headers, "Authorization": f"Bearer {tokens[ledger]}"}
        with httpx2.Client(timeout=10) as http:
            return http.post(srv.url, json=body, headers=auth).status_code

    try:
        assert [open_session("mallory") for _ in range(3)] == [200, 200, 503]
        assert open_session("alice") == 200
    finally:
        srv.stop()


def _ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_available(), reason="this machine has no IPv6")
def test_host_double_colon_listens_on_ipv4_too_as_its_start_up_line_says(tmp_path: Path) -> None:
    # `serve --http --host ::` said "port P of every interface (on this machine: http://127.0.0.1:P/mcp)" but
    # listened on IPv6 only: that URL, and every IPv4 client, was refused a connection.
    srv = start_http(tmp_path / "srv", ["--host", "::"])  # waits for 127.0.0.1:PORT to accept (bounded)
    try:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        with httpx2.Client(timeout=10) as http:
            for url in (srv.url, f"http://[::1]:{srv.port}/mcp"):
                assert http.post(url, json=body, headers=headers).status_code == 401  # reached: asks a token
    finally:
        srv.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)], ids=["sigterm", "ctrl-c-twice"]
)
async def test_a_stop_signal_cancels_a_call_in_flight_and_charges_what_it_used(
    tmp_path: Path, conv_a100: Path, signals: tuple[signal.Signals, ...]
) -> None:
    # uvicorn waited for every open request: SIGTERM during a measurement kept the server serving it (here for
    # hours). Now it waits a few seconds, then cancels the call, charged its occupancy, as stdio does.
    # A second Ctrl-C within those seconds was uvicorn's "force quit": the service closed under the calls still
    # running (a "the store is closed" traceback for each, their holds left open and released free at the next
    # start, the device time they used never charged). Now it stops the same orderly way.
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 50)
    srv = start_http(home, ["--replay", str(conv_a100)], env={"FORECASTER_MCP_REPLAY_REALTIME": "100000"})
    db = home / "forecaster.sqlite3"
    errors: list[BaseException] = []

    async def measure() -> None:
        try:
            async with connect_http(srv.url, token) as (_, call):
                await call("measure_kernel", {"kernel": kernel(32, 4)})
        except Exception as exc:  # the server stops under the call: that is the point
            errors.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(measure)
            deadline = time.monotonic() + 30  # bounded wait until the measurement holds its reservation
            while time.monotonic() < deadline:
                if _open_holds(db):
                    break
                await anyio.sleep(0.05)
            assert _open_holds(db), "the server never reserved"
            for sig in signals:
                srv.proc.send_signal(sig)
                await anyio.sleep(0.3)  # a person pressing Ctrl-C again
            await anyio.to_thread.run_sync(lambda: srv.proc.wait(timeout=20))
            tg.cancel_scope.cancel()
        assert srv.proc.returncode == 0
        assert srv.proc.stderr is not None
        err = srv.proc.stderr.read().decode()
        assert "Traceback" not in err and "cancelled" in err, err
    finally:
        srv.stop()
    assert _open_holds(db) == 0  # settled at shutdown, not left for the next start to release free
    state = _ledger(home, "alice")
    assert state["reserved_gpu_seconds"] == 0
    assert 0 < state["spent_gpu_seconds"] < 0.01  # a few seconds at 100,000 s per GPU-second


def _open_holds(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM reservations WHERE state = 'open'").fetchone()[0])


def _post_initialize(srv: HttpServer, token: str | None, **headers: str) -> int:
    sent = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json", **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    with httpx2.Client(timeout=10) as http:
        return http.post(srv.url, json=INITIALIZE, headers=sent).status_code


def _stopped_stderr(srv: HttpServer) -> str:
    srv.stop()
    assert srv.proc.stderr is not None
    return srv.proc.stderr.read().decode()


def test_a_loopback_server_refuses_a_foreign_host_even_with_a_valid_token(tmp_path: Path) -> None:
    # The MCP SDK's (and the specification's) DNS-rebinding check on a loopback address: 31c5346 had turned it
    # off, so a page that learnt a token could call the server from any name. Refused requests say in the
    # server's log how a reverse proxy's name is let in.
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    srv = start_http(home)  # --host 127.0.0.1
    try:
        assert _post_initialize(srv, None, Host="gpu-box.example.com") == 401  # the token is checked first
        assert _post_initialize(srv, token, Host="gpu-box.example.com") == 421
        assert _post_initialize(srv, token, Host=f"localhost:{srv.port}") == 200
        assert _post_initialize(srv, token, Origin="https://evil.example") == 403
        assert _post_initialize(srv, token, Origin=f"http://localhost:{srv.port}") == 200
    finally:
        err = _stopped_stderr(srv)
    assert "refused a request (421) for Host 'gpu-box.example.com'" in err
    assert "serve --allowed-host NAME" in err


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_tls_proxy_keeping_the_host_reaches_a_loopback_server_named_by_allowed_host(
    tmp_path: Path, how: str
) -> None:
    # The README's advice beyond a trusted network, a TLS reverse proxy in front of a server on 127.0.0.1: a proxy
    # that passes on the Host it was asked for (Caddy's default, nginx with `proxy_set_header Host $host`) is let
    # in by naming that host; other names are still refused.
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    if how == "option":
        srv = start_http(
            home, ["--allowed-host", "gpu-box.example.com", "--allowed-host", "other.example:8443"]
        )
    else:
        srv = start_http(
            home, env={"FORECASTER_MCP_ALLOWED_HOSTS": "gpu-box.example.com, other.example:8443\n"}
        )
    try:
        assert _post_initialize(srv, None, Host="gpu-box.example.com") == 401
        for host in (
            "gpu-box.example.com",
            "gpu-box.example.com:443",
            "other.example:8443",
            f"127.0.0.1:{srv.port}",
        ):
            assert _post_initialize(srv, token, Host=host) == 200, host
        assert _post_initialize(srv, token, Host="other.example:9000") == 421
        assert _post_initialize(srv, token, Host="evil.example") == 421
        assert (
            _post_initialize(srv, token, Host="gpu-box.example.com", Origin="https://gpu-box.example.com")
            == 200
        )
        assert _post_initialize(srv, token, Host="gpu-box.example.com", Origin="https://evil.example") == 403
    finally:
        srv.stop()


def test_allowed_hosts_are_names_as_clients_send_them(tmp_path: Path) -> None:
    # A Host name is case-insensitive, a trailing dot names the same host, and a client leaves the scheme's own
    # port out of Host. `--allowed-host GPU-Box.Example.com:443` refused every request through a proxy on 443
    # (its clients send `gpu-box.example.com`, nginx's $host is lower case), `other.example:*` refused the name
    # without a port, and `Host: LOCALHOST:PORT` or `localhost.:PORT` from this machine got 421.
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    srv = start_http(home, ["--allowed-host", "GPU-Box.Example.com:443", "--allowed-host", "other.example:*"])
    try:
        for host in (
            "gpu-box.example.com",
            "gpu-box.example.com:443",
            "GPU-BOX.example.com.",
            "other.example",
            "other.example:9000",
            f"LOCALHOST:{srv.port}",
            f"localhost.:{srv.port}",
        ):
            assert _post_initialize(srv, token, Host=host) == 200, host
        for host in ("gpu-box.example.com:8443", "evil.example", "gpu-box.example.com.evil.example"):
            assert _post_initialize(srv, token, Host=host) == 421, host
        assert _post_initialize(srv, None, Host="gpu-box.example.com") == 401
        for origin in ("https://gpu-box.example.com", "https://other.example", "http://other.example:9000"):
            assert _post_initialize(srv, token, Host="gpu-box.example.com", Origin=origin) == 200, origin
        assert _post_initialize(srv, token, Host="gpu-box.example.com", Origin="https://evil.example") == 403
    finally:
        srv.stop()


@pytest.mark.parametrize("protocol_version", [None, "2099-01-01"])
def test_a_client_that_hangs_up_mid_request_is_one_log_line_not_a_traceback(
    tmp_path: Path, protocol_version: str | None
) -> None:
    """A search client timing out while it sends a call: the SDK (or, on its newer protocol path, uvicorn) logged
    an ERROR with a ClientDisconnect traceback for each one, which reads as a crash in a busy server's log."""
    home = tmp_path / "srv"
    token = _ledger_and_token(home, "alice", 5)
    srv = start_http(home)
    try:
        body = json.dumps(INITIALIZE).encode()
        version = f"MCP-Protocol-Version: {protocol_version}\r\n" if protocol_version else ""
        head = (
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n{version}"
            f"Content-Length: {len(body) + 100}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(head + body[:20])  # and hang up before the rest
        with httpx2.Client(timeout=10) as http:  # the server still answers
            headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
            assert http.post(srv.url, json=INITIALIZE, headers=headers).status_code == 200
    finally:
        err = _stopped_stderr(srv)
    assert "Traceback" not in err and "ClientDisconnect" not in err, err
    assert "disconnected" in err
