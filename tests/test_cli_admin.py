"""Operator commands through the real entry point: ledgers and tokens."""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from replay_kernels import small_recording
from serverproc import cli
from state_files import damage_table

from forecaster_mcp.cli import main
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import Store

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ledger_create_topup_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ledger", "create", "team-a", "--gpu-seconds", "10")
    assert code == 0 and "created ledger 'team-a': limit 10" in out
    code, out, _ = run(capsys, "ledger", "topup", "team-a", "--gpu-seconds", "2.5")
    assert code == 0 and "limit 12.5" in out and "remaining 12.5 GPU-seconds" in out
    run(capsys, "ledger", "create", "team-b", "--gpu-seconds", "0")

    code, out, _ = run(capsys, "ledger", "show")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["ledger", "limit", "spent", "reserved", "remaining"]
    assert lines[1].split() == ["team-a", "12.5", "0", "0", "12.5"]
    assert lines[2].split() == ["team-b", "0", "0", "0", "0"]

    code, out, _ = run(capsys, "ledger", "show", "team-a")
    assert code == 0 and "ledger 'team-a'" in out and "remaining" in out and "12.5 GPU-seconds" in out

    code, out, _ = run(capsys, "ledger", "show", "team-a", "--json")
    report = json.loads(out)
    assert code == 0 and report["name"] == "team-a" and report["remaining_gpu_seconds"] == 12.5
    assert report["measurements"]["count"] == 0 and report["forecasts"]["accuracy"] is None

    code, out, _ = run(capsys, "ledger", "show", "--json")
    assert [v["name"] for v in json.loads(out)] == ["team-a", "team-b"]


def test_ledger_show_reflects_spending(capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "ledger", "create", "x", "--gpu-seconds", "10")

    async def spend() -> None:
        store = await Store.open(Settings.from_env().db_path)
        try:
            hold = await store.reserve("x", 5, "m")
            await store.commit(hold, 3.25)
        finally:
            await store.close()

    asyncio.run(spend())
    code, out, _ = run(capsys, "ledger", "show", "x", "--json")
    report = json.loads(out)
    assert code == 0 and (report["spent_gpu_seconds"], report["remaining_gpu_seconds"]) == (3.25, 6.75)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ledger", "create", "dup", "--gpu-seconds", "1"], "already exists"),
        (["ledger", "create", "neg", "--gpu-seconds", "-1"], "finite number"),
        (["ledger", "create", "nan", "--gpu-seconds", "nan"], "finite number"),
        (["ledger", "topup", "ghost", "--gpu-seconds", "1"], "ledger 'ghost' does not exist"),
        (["ledger", "topup", "dup", "--gpu-seconds", "0"], "> 0"),
        (["ledger", "topup", "dup", "--gpu-seconds", "1e-300"], "below the smallest amount kept"),
        (["ledger", "create", "tiny", "--gpu-seconds", "1e-9"], "below the smallest amount kept"),
        (["ledger", "show", "ghost"], "forecaster-mcp ledger create ghost"),
        (["token", "issue", "--ledger", "ghost"], "ledger 'ghost' does not exist"),
        (["token", "revoke", "fmcp_not-a-real-token"], "no active token matches"),
    ],
)
def test_operator_mistakes_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run(capsys, "ledger", "create", "dup", "--gpu-seconds", "1")
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("forecaster-mcp: ") and message in err


def test_token_issue_list_revoke(capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "ledger", "create", "agent-1", "--gpu-seconds", "5")
    code, out, err = run(capsys, "token", "issue", "--ledger", "agent-1", "--label", "run 1")
    assert code == 0 and "shown only this once" in err
    [token] = out.splitlines()  # the token, alone on its line, and nothing else on stdout
    assert token.startswith("fmcp_") and token in out

    code, out, _ = run(capsys, "token", "list")
    assert code == 0 and token not in out and token[5:] not in out
    header, row = out.splitlines()
    assert header.split()[:4] == ["id", "fingerprint", "ledger", "label"]
    assert row.split()[2] == "agent-1" and row.rstrip().endswith("active")

    async def ledger_of(t: str) -> str | None:
        store = await Store.open(Settings.from_env().db_path)
        try:
            return await store.ledger_for_token(t)
        finally:
            await store.close()

    assert asyncio.run(ledger_of(token)) == "agent-1"
    code, out, _ = run(capsys, "token", "revoke", token)
    assert code == 0 and out.strip() == "revoked"
    assert asyncio.run(ledger_of(token)) is None
    code, out, _ = run(capsys, "token", "list")
    assert "revoked" in out.splitlines()[1]

    # A lost token can be revoked by the fingerprint `token list` shows.
    run(capsys, "token", "issue", "--ledger", "agent-1")
    code, out, _ = run(capsys, "token", "list")
    fingerprint = out.splitlines()[2].split()[1]
    code, out, _ = run(capsys, "token", "revoke", fingerprint)
    assert code == 0 and out.strip() == "revoked"

    # ... or by the id in its first column (it was refused: 'no active token matches').
    run(capsys, "token", "issue", "--ledger", "agent-1")
    code, out, _ = run(capsys, "token", "list")
    third = out.splitlines()[3].split()[0]
    assert third == "3"
    code, out, _ = run(capsys, "token", "revoke", third)
    assert code == 0 and out.strip() == "revoked"
    assert run(capsys, "token", "list")[1].splitlines()[3].split()[-3] == "revoked"
    code, _, err = run(capsys, "token", "revoke", third)  # no longer active
    assert code == 2 and "its id or fingerprint" in err


def test_empty_listings_say_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert "ledger create NAME" in run(capsys, "ledger", "show")[1]
    assert "token issue --ledger NAME" in run(capsys, "token", "list")[1]


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = dict(os.environ, FORECASTER_MCP_HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "forecaster_mcp"]
    made = subprocess.run(
        [*cmd, "ledger", "create", "ci", "--gpu-seconds", "7.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    shown = subprocess.run(
        [*cmd, "ledger", "show", "ci", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["limit_gpu_seconds"] == 7.5
    again = subprocess.run(
        [*cmd, "ledger", "create", "ci", "--gpu-seconds", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "already exists" in again.stderr


def test_demo_refuses_a_file_that_is_not_a_recording(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A message and exit code 2, not the traceback of a server that exited before the demo's client could
    connect."""
    not_a_recording = tmp_path / "notes.json"
    not_a_recording.write_text("[1, 2, 3]")
    code, out, err = run(capsys, "demo", "--replay", str(not_a_recording))
    assert code == 2
    assert "cannot read replay recording" in out + err and "Kernel Tuner cache file" in out + err


def test_demo_replays_a_folder_of_recordings_smaller_than_its_pool(tmp_path: Path) -> None:
    """A folder (as `serve --replay` takes) holding a 3-configuration recording: fewer than the 16 candidates a
    round forecasts."""
    folder = tmp_path / "recordings"
    small_recording(
        folder / "A100.json",
        {
            "32": {"bx": 32, "time": 1.0, "times": [1.0, 1.0]},
            "64": {"bx": 64, "time": 2.0, "times": [2.0, 2.0]},
            "128": {"bx": 128, "time": 0.5, "times": [0.5]},
        },
    )
    done = cli(tmp_path / "home", "demo", "--replay", str(folder))  # a real process: the demo starts a server
    out = done.stdout
    assert "search over 3 recorded configurations of kk" in out and str(folder / "A100.json") in out
    assert "round 1: 3 candidates" in out and "best found" in out


def test_demo_replays_what_forecaster_mcp_replay_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --replay the demo takes the recordings of FORECASTER_MCP_REPLAY, as `serve` does; with it, only
    the one given (the server it starts is not handed the environment's as well)."""
    env_rec = small_recording(tmp_path / "env" / "A100.json", {"32": {"bx": 32, "time": 1.0, "times": [1.0]}})
    arg_rec = small_recording(
        tmp_path / "arg" / "A100.json",
        {"32": {"bx": 32, "time": 1.0, "times": [1.0]}, "64": {"bx": 64, "time": 0.5, "times": [0.5]}},
    )
    monkeypatch.setenv("FORECASTER_MCP_REPLAY", str(env_rec))
    out = cli(tmp_path / "home", "demo").stdout
    assert "search over 1 recorded configurations of kk" in out and str(env_rec) in out
    out = cli(tmp_path / "home2", "demo", "--replay", str(arg_rec)).stdout
    assert "search over 2 recorded configurations of kk" in out and str(env_rec) not in out


def test_demo_refuses_a_recording_without_a_configuration_that_ran(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    failed = small_recording(
        tmp_path / "failed.json",
        {"32": {"bx": 32, "time": "InvalidConfig"}, "64": {"bx": 64, "time": "RuntimeFailedConfig"}},
    )
    code, out, err = run(capsys, "demo", "--replay", str(failed))
    assert code == 2 and out == ""
    assert err.startswith("forecaster-mcp: ") and len(err.strip().splitlines()) == 1
    assert "none of its 2 recorded configurations ran successfully" in err
    code, _, err = run(capsys, "demo", "--replay", str(small_recording(tmp_path / "empty.json", {})))
    assert code == 2 and "no configurations recorded" in err


def test_demo_says_so_when_no_starting_configuration_can_be_replayed(tmp_path: Path) -> None:
    """The only configuration that ran took longer than a measurement may: its replay is a timeout, which has
    no runtime to start the search from."""
    slow = small_recording(
        tmp_path / "slow.json",
        {"32": {"bx": 32, "time": 1e6, "times": []}, "64": {"bx": 64, "time": "InvalidConfig"}},
    )
    out = cli(tmp_path / "home", "demo", "--replay", str(slow)).stdout
    assert "starting configuration {'bx': 32}: timeout" in out
    assert "no starting configuration could be replayed (1 tried" in out and "round 1" not in out
    assert "== 3. Budget" in out


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["serve", "--ledger", "bad name"], {}), (["serve"], {"FORECASTER_MCP_LEDGER": "x y"})],
)
def test_serve_refuses_a_ledger_name_ledger_create_would_refuse(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str]
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("forecaster-mcp: --ledger ") and "is not allowed: use 1 to 128" in err
    assert len(err.strip().splitlines()) == 1
    assert not Settings.from_env().db_path.exists()  # refused before the server opened its store


def test_serve_refuses_a_ledger_that_does_not_exist(capsys: pytest.CaptureFixture[str]) -> None:
    # Every call would fail on it, free forecasts included: refused at start-up instead.
    code, out, err = run(capsys, "serve", "--ledger", "nonexist", "--measurer", "none")
    assert code == 2 and out == ""
    assert "ledger 'nonexist' does not exist" in err and "`forecaster-mcp ledger create nonexist" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--measurer", "replay"], "--measurer replay needs a recording"),
        (["--measurer", "none", "--replay", "{rec}"], "not 'none': drop one of the two"),
        (["--measurer", "pycuda", "--replay", "{rec}"], "not 'pycuda': drop one of the two"),
        (["--measurer", "pycuda"], "--measurer pycuda cannot measure on this machine: "),
    ],
)
def test_serve_refuses_a_measurer_it_cannot_use(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], says: str
) -> None:
    # Chosen explicitly, a measurer that cannot work (or a recording it would drop) is refused at start-up:
    # an IDE user would otherwise only learn of it from the agent's first failed measurement.
    if argv == ["--measurer", "pycuda"] and ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine may have a GPU to measure on")
    rec = small_recording(tmp_path / "rec.json", {"32": {"bx": 32, "time": 1.0, "times": [1.0]}})
    code, out, err = run(capsys, "serve", *[a.format(rec=rec) for a in argv])
    assert code == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1


def test_serve_warns_at_start_up_about_a_default_gpu_it_does_not_know(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from forecaster_mcp.server.app import _check_startup
    from forecaster_mcp.service import Service

    async def check(hardware: str) -> str:
        settings = Settings.from_env(measurer="none", hardware=hardware)
        service = await Service.open(settings)
        try:
            await _check_startup(service, settings, http=False)
        finally:
            await service.close()
        return capsys.readouterr().err

    warned = asyncio.run(check("RTX 4900"))
    assert "warning: --hardware 'RTX 4900' is not a GPU this server knows (did you mean RTX 4090" in warned
    assert asyncio.run(check("h100")) == ""  # a known name, however spelled
    # An architecture is no GPU: the warning names the GPUs of it (it named none for "gfx942").
    assert "(did you mean MI300X, MI300A, MI325X?)" in asyncio.run(check("gfx942"))


def test_serve_warns_when_the_default_gpu_is_not_the_one_it_measures_on(
    capsys: pytest.CaptureFixture[str], conv_a100: Path
) -> None:
    # An agent config's --hardware H100 kept beside --replay A100.json.gz: compare_kernels would default to H100
    # while measure_kernel measures (and stores) on the A100, so forecasts would never learn.
    from forecaster_mcp.server.app import _check_startup
    from forecaster_mcp.service import Service

    async def check(hardware: str) -> tuple[str, list[str]]:
        settings = Settings.from_env(measurer="replay", replay=[conv_a100], hardware=hardware)
        service = await Service.open(settings)
        try:
            await _check_startup(service, settings, http=False)
            return capsys.readouterr().err, service.resolve_hardware(None).notes
        finally:
            await service.close()

    warned, notes = asyncio.run(check("H100"))
    assert "warning: --hardware 'H100' is none of the devices this server measures on (A100" in warned
    assert "leave out --hardware" in warned
    assert notes and "forecasts for H100-SXM5-80GB do not learn from those measurements" in notes[0]
    assert asyncio.run(check("a100")) == ("", [])


def test_unknown_ledger_message_quotes_the_name_for_the_shell() -> None:
    from forecaster_mcp.errors import UnknownLedger
    from forecaster_mcp.service import Service

    async def status_of(ledger: str) -> str:
        service = await Service.open(Settings.from_env(measurer="none"))
        try:
            with pytest.raises(UnknownLedger) as raised:
                await service.budget_status(ledger)
            return str(raised.value)
        finally:
            await service.close()

    assert "`forecaster-mcp ledger create 'team a;b' --gpu-seconds N`" in asyncio.run(status_of("team a;b"))
    assert "`forecaster-mcp ledger create team-b --gpu-seconds N`" in asyncio.run(status_of("team-b"))


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "lots"])
def test_a_bad_model_cache_bound_is_an_operator_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FORECASTER_MCP_MODEL_CACHE_MB", value)
    code, out, err = run(capsys, "ledger", "show", "default")
    assert code == 2 and out == ""
    assert "bad setting model_cache_mb (env FORECASTER_MCP_MODEL_CACHE_MB)" in err


def test_a_bad_setting_says_what_its_validator_said_without_pydantics_prefix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORECASTER_MCP_ALLOWED_HOSTS", "https://mcp.example.com/")
    code, out, err = run(capsys, "ledger", "show", "default")
    assert code == 2 and out == ""
    assert (
        "bad setting allowed_hosts (env FORECASTER_MCP_ALLOWED_HOSTS): 'https://mcp.example.com/' is not a Host "
        "header value (a URL: pass its host alone)"
    ) in err, err
    assert "Value error" not in err


def test_a_state_folder_that_is_a_file_or_a_database_that_is_not_one_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Both crashed every command with a traceback.
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    code, _, err = run(capsys, "--home", str(a_file), "ledger", "show")
    assert code == 2 and "cannot open the state database" in err and "--home" in err
    assert len(err.strip().splitlines()) == 1
    garbage = tmp_path / "home"
    garbage.mkdir()
    (garbage / "forecaster.sqlite3").write_text("this is not a database\n" * 100)
    for argv in (["ledger", "show"], ["serve", "--measurer", "none"]):
        code, _, err = run(capsys, "--home", str(garbage), *argv)
        assert code == 2 and "is not a forecaster-mcp state database, or is damaged" in err, err
        assert len(err.strip().splitlines()) == 1
    assert (garbage / "forecaster.sqlite3").read_text().startswith("this is not a database")  # left as it was


def test_a_database_damaged_past_its_first_pages_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Damage Store.open does not read (a lost block under the ledgers table) crashed every command, the server
    included, with a traceback ending in 'sqlite3.DatabaseError: database disk image is malformed'."""
    assert run(capsys, "ledger", "create", "L", "--gpu-seconds", "5")[0] == 0
    damage_table(Path(os.environ["FORECASTER_MCP_HOME"]) / "forecaster.sqlite3", "ledgers")
    for argv in (
        ["ledger", "show"],
        ["ledger", "topup", "L", "--gpu-seconds", "1"],
        ["serve", "--measurer", "none"],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "the state database is damaged (database disk image is malformed)" in err, err
        assert ".recover" in err and len(err.strip().splitlines()) == 1


def test_a_bug_that_sqlite_refuses_is_not_told_as_a_damaged_database(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sqlite3.DatabaseError was told 'the state database is damaged ... recover it (.recover)', also a
    constraint the code broke (an IntegrityError, a bug): the operator was sent to recover a sound file, and
    the traceback that locates the bug was lost. Only damage is told as damage."""
    assert run(capsys, "ledger", "create", "L", "--gpu-seconds", "5")[0] == 0
    with sqlite3.connect(":memory:") as conn:
        conn.execute("CREATE TABLE t (x INTEGER CHECK (x >= 0))")
        with pytest.raises(sqlite3.IntegrityError) as broken:
            conn.execute("INSERT INTO t VALUES (-1)")
    conn.close()

    async def refused(self: Store) -> None:
        raise broken.value

    monkeypatch.setattr(Store, "list_ledgers", refused)
    with pytest.raises(sqlite3.IntegrityError):
        main(["ledger", "show"])
    assert "damaged" not in capsys.readouterr().err


UNOPENABLE = """
import asyncio, sys
from pathlib import Path
from forecaster_mcp.errors import OperatorError
from forecaster_mcp.store.db import Store
for _ in range(3):
    try:
        asyncio.run(Store.open(Path(sys.argv[1])))
    except OperatorError as exc:
        print(exc, file=sys.stderr)
"""


def test_a_database_that_cannot_be_opened_is_one_line_and_no_traceback(tmp_path: Path) -> None:
    """A folder where the database file should be said 'unable to open database file; point ... at a folder
    you can write to', and then two tracebacks ('Event loop is closed') of aiosqlite's thread, still stopping
    after the command's event loop had closed; so did any database that could not be opened (a
    symlink to a volume that is not mounted)."""
    home = tmp_path / "home"
    (home / "forecaster.sqlite3").mkdir(parents=True)
    for argv in (["ledger", "show"], ["serve", "--measurer", "none"]):
        proc = cli(home, *argv, check=False)
        assert (
            proc.returncode == 2 and "forecaster.sqlite3: it is a folder, not a database file" in proc.stderr
        )
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    dangling = tmp_path / "db.sqlite3"
    dangling.symlink_to(tmp_path / "unmounted" / "db.sqlite3")  # a state file on a volume that is not there
    proc = subprocess.run(
        [sys.executable, "-c", UNOPENABLE, str(dangling)], capture_output=True, text=True, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and all("unable to open database file" in line for line in lines), proc.stderr


@pytest.mark.parametrize(
    "setting",
    [
        "DEFAULT_LEDGER_GPU_SECONDS=inf",  # blamed a --gpu-seconds the operator never passed
        "DEFAULT_LEDGER_GPU_SECONDS=1e13",
        "REPLAY_REALTIME=inf",  # a replayed measurement would sleep for ever, holding its reservation
        "MAX_MEASURE_SECONDS=0.01",  # below what any measurement may ask for (0.1)
        "FORECAST_TIMEOUT_S=nan",
    ],
)
def test_a_setting_out_of_range_is_refused_naming_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    name, value = setting.split("=")
    monkeypatch.setenv(f"FORECASTER_MCP_{name}", value)
    code, out, err = run(capsys, "serve", "--measurer", "none")
    assert code == 2 and out == ""
    assert f"(env FORECASTER_MCP_{name})" in err and len(err.strip().splitlines()) == 1, err


def test_home_may_follow_the_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # `ledger show --home DIR` was "unrecognized arguments: --home".
    home = tmp_path / "state"
    code, out, _ = run(capsys, "ledger", "create", "after", "--gpu-seconds", "3", "--home", str(home))
    assert code == 0 and "created ledger 'after'" in out
    code, out, _ = run(capsys, "--home", str(home), "ledger", "show", "after", "--json")
    assert code == 0 and json.loads(out)["limit_gpu_seconds"] == 3
    code, out, _ = run(capsys, "--home", str(tmp_path / "elsewhere"), "ledger", "show", "--home", str(home))
    assert code == 0 and "after" in out  # the one nearest the command wins


def test_a_locked_database_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server (or a VACUUM) holding the write lock: a read still answers, a write says what is wrong."""
    from forecaster_mcp.store import db

    assert run(capsys, "ledger", "create", "L", "--gpu-seconds", "5")[0] == 0
    monkeypatch.setattr(db, "BUSY_TIMEOUT_S", 0.2)
    other = sqlite3.connect(
        Path(os.environ["FORECASTER_MCP_HOME"]) / "forecaster.sqlite3", isolation_level=None
    )
    try:
        other.execute("BEGIN IMMEDIATE")
        code, out, _ = run(capsys, "ledger", "show", "L")
        assert code == 0 and "limit         5 GPU-seconds" in out
        code, _, err = run(capsys, "ledger", "topup", "L", "--gpu-seconds", "1")
        assert code == 2 and "the state database is busy or cannot be written (database is locked)" in err
        assert "Traceback" not in err
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_a_report_written_atomically_keeps_the_old_one_when_the_disk_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """search --out, make-pairs --out and eval's files: the old file or the whole new one, never a part."""
    from forecaster_mcp.cli import write_atomically

    report = tmp_path / "report.json"
    write_atomically(report, '{"old": true}')

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(report, '{"new": ' + "1" * 10_000 + "}")
    assert report.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_the_demo_suggests_a_recording_that_exists_from_where_it_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from another folder, the demo suggested the same `../shared/...` path the user had just tried."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "demo", "--replay", "nope.json.gz")
    assert code == 2 and "recording not found: nope.json.gz" in out
    hint = out.split("(try ", 1)[1].rstrip().removesuffix(")")
    assert Path(hint).is_file() or "AutoTuningAssociation/benchmark_hub" in hint


HOLDER = """
import asyncio, sys
from forecaster_mcp.store.db import Store
async def main():
    store = await Store.open(sys.argv[1])
    await store.reserve("run", 5.0, "measure k")
    print("held", flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


def test_ledger_show_does_not_wait_on_a_writer_for_a_live_hold(tmp_path: Path) -> None:
    """Another server measuring (its hold open, its owner alive) while some writer holds the lock: `ledger
    show` took the write lock to release orphans anyway and waited out the 30 s busy timeout."""
    home = tmp_path / "home"
    cli(home, "ledger", "create", "run", "--gpu-seconds", "60")
    db_path = Settings.from_env(home=home).db_path
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db_path)], stdout=subprocess.PIPE, text=True)
    lock = sqlite3.connect(db_path, isolation_level=None)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock.execute("BEGIN IMMEDIATE")
        env = {**os.environ, "FORECASTER_MCP_HOME": str(home)}
        shown = subprocess.run(
            [sys.executable, "-m", "forecaster_mcp", "ledger", "show", "run", "--json"],
            env=env, capture_output=True, text=True, timeout=15,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["reserved_gpu_seconds"] == 5.0
    finally:
        lock.close()
        holder.kill()
        holder.wait()


def test_a_token_label_is_one_line_and_an_http_server_says_it_ignores_the_ledger_setting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(capsys, "ledger", "create", "lbl", "--gpu-seconds", "1")[0] == 0
    code, _, err = run(capsys, "token", "issue", "--ledger", "lbl", "--label", "run\n42")
    assert code == 2 and "one line of printable text" in err  # a newline broke `token list`'s table
    home = tmp_path / "srv"
    env = {**os.environ, "FORECASTER_MCP_HOME": str(home), "FORECASTER_MCP_LEDGER": "nope"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "forecaster_mcp", "serve", "--http", "--port", "0"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "FORECASTER_MCP_LEDGER is ignored by an HTTP server" in first


def test_ledger_show_text_accounts_for_all_that_was_spent(capsys: pytest.CaptureFixture[str]) -> None:
    """Device time charged with no stored result (a cancelled run) is part of spent: the text report said
    'spent 3.25' and 'measurements 0 (...), 0 GPU-seconds charged' and nothing of the rest."""
    run(capsys, "ledger", "create", "x", "--gpu-seconds", "10")

    async def cancelled_run() -> None:
        store = await Store.open(Settings.from_env().db_path)
        try:
            await store.commit(await store.reserve("x", 5, "measure k"), 3.25)
        finally:
            await store.close()

    asyncio.run(cancelled_run())
    code, out, _ = run(capsys, "ledger", "show", "x")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert code == 0 and lines["spent"].split()[1:] == ["3.25", "GPU-seconds"]
    assert (
        "0 GPU-seconds charged; 3.25 more for device time that left no stored result" in lines["measurements"]
    )


def test_a_state_folder_without_a_database_is_named_and_left_as_it_was(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Every operator command made a database wherever --home pointed: a mistyped one got an empty database,
    'ledger show' said 'no ledgers yet' and 'ledger topup' 'ledger ... does not exist' (the operator's ledgers
    gone, it seemed). Only `ledger create` makes one."""
    home = tmp_path / "fmcp-prdo"
    code, out, _ = run(capsys, "ledger", "show", "--home", str(home))
    assert code == 0 and f"no state database at {home}" in out and "ledger create NAME" in out
    code, out, _ = run(capsys, "token", "list", "--home", str(home))
    assert code == 0 and f"no state database at {home}" in out
    for argv in (
        ["ledger", "topup", "run-1", "--gpu-seconds", "5"],
        ["ledger", "show", "run-1"],
        ["token", "issue", "--ledger", "run-1"],
        ["token", "revoke", "1"],
    ):
        code, out, err = run(capsys, *argv, "--home", str(home))
        assert (code, out) == (2, "") and f"no state database at {home}" in err, argv
    assert not home.exists()
    code, _, _ = run(capsys, "ledger", "create", "run-1", "--gpu-seconds", "5", "--home", str(home))
    assert code == 0 and "run-1" in run(capsys, "ledger", "show", "--home", str(home))[1]


def test_a_state_folder_given_with_a_tilde_is_in_the_users_home(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # What an IDE's JSON config passes as written (no shell expands it): the server kept its state in a folder
    # named "~" under the IDE's working directory, apart from the ledgers `ledger create` made from a shell.
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FORECASTER_MCP_HOME", "~/fmcp")
    monkeypatch.setenv("FORECASTER_MCP_NVCC", "~/cuda/bin/nvcc")
    code, _, err = run(capsys, "ledger", "create", "ide", "--gpu-seconds", "2")
    assert code == 0, err
    assert not (tmp_path / "~").exists()
    assert (tmp_path / "user" / "fmcp" / "forecaster.sqlite3").is_file()
    assert Settings.from_env().nvcc == str(tmp_path / "user" / "cuda" / "bin" / "nvcc")


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LEDGER", " run-42\n", "run-42"),  # a name (refused by serve with the newline)
        ("HARDWARE", "H100\r\n", "H100"),  # an optional name (a GPU "H100\n" the spec table did not know)
        ("MEASURER", "replay\n", "replay"),  # a choice (refused)
        ("ISOLATE_LEDGERS", "1\n", True),  # a flag (refused)
        ("MAX_SESSIONS_PER_LEDGER", " 7\n", 7),  # a number (pydantic strips these itself)
        ("HOME", "/srv/fmcp\n", Path("/srv/fmcp")),  # a path (a new, empty state folder "fmcp\n")
        (
            "HOME",
            "/srv/fmcp \n",
            Path("/srv/fmcp "),
        ),  # ... which keeps its spaces: a file name may end in one
        ("NVCC", "/opt/cuda/bin/nvcc\n", "/opt/cuda/bin/nvcc"),  # a path kept as text
        ("REPLAY", f"/r/a.json\n{os.pathsep}/r/b.json{os.pathsep}\n", [Path("/r/a.json"), Path("/r/b.json")]),
        (
            "ALLOWED_HOSTS",
            " mcp.example.com ,\nother.example:8443\n",
            ["mcp.example.com", "other.example:8443"],
        ),
        ("LEDGER", " \n", "default"),  # nothing but whitespace: unset, as an empty variable is
    ],
)
def test_a_setting_read_with_a_trailing_newline_or_stray_spaces_means_what_it_says(
    variable: str, value: str, expected: object
) -> None:
    # From an env file, a mounted secret or `$(cat file)`: whitespace around a value was kept (a ledger, a GPU,
    # a path), refused (a choice, a flag) or stripped (the API key, numbers), depending on the setting.
    settings = Settings.from_env(environ={f"FORECASTER_MCP_{variable}": value})
    assert getattr(settings, variable.lower()) == expected


def test_command_line_settings_lose_surrounding_whitespace_too() -> None:
    settings = Settings.from_env(
        environ={},
        home=Path("/srv/fmcp\n"),
        replay=[Path("/r/a.json\n")],
        hardware=" A100\n",
        ledger="team\n",
    )
    assert (settings.home, settings.replay) == (Path("/srv/fmcp"), [Path("/r/a.json")])
    assert (settings.hardware, settings.ledger) == ("A100", "team")


def test_a_state_folder_named_with_a_trailing_newline_is_that_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # FORECASTER_MCP_HOME="$(cat home.txt)"-style values: the ledger went to a new folder "fmcp\n", and a server
    # started with the clean value could not find it.
    monkeypatch.setenv("FORECASTER_MCP_HOME", f"{tmp_path / 'fmcp'}\n")
    code, _, err = run(capsys, "ledger", "create", "nl", "--gpu-seconds", "2")
    assert code == 0, err
    assert (tmp_path / "fmcp" / "forecaster.sqlite3").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fmcp"]


def test_a_misspelt_setting_in_the_environment_is_named_not_silently_ignored(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # FORECASTER_MCP_MAX_MEASURE_SECOND=5 (the S missing) left every measurement capped at the default 30 s,
    # without a word; the variables read elsewhere (a client's token) are not settings and are not named.
    monkeypatch.setenv("FORECASTER_MCP_MAX_MEASURE_SECOND", "5")
    monkeypatch.setenv("FORECASTER_MCP_TOKEN", "fmcp_client_side")
    code, _, err = run(capsys, "ledger", "create", "typo", "--gpu-seconds", "2")
    assert code == 0, err
    assert err.strip().splitlines() == [
        "forecaster-mcp: warning: FORECASTER_MCP_MAX_MEASURE_SECOND is not a setting (did you mean "
        "FORECASTER_MCP_MAX_MEASURE_SECONDS?): it is ignored"
    ]
