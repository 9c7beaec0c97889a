"""The `forecaster-mcp` command line. Handlers are imported lazily so start-up stays fast."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sqlite3
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from forecaster_mcp import __version__
from forecaster_mcp.errors import AgentError, OperatorError
from forecaster_mcp.settings import Settings, unknown_variables


def _os_reason(exc: OSError, path: Path) -> str:
    if isinstance(exc, FileExistsError) and exc.filename is not None:  # mkdir met a file where a folder goes
        return f"{exc.filename} is a file, not a folder"
    reason = exc.strerror or str(exc)
    if exc.filename is not None and Path(exc.filename) in path.parents:  # a folder above it is the problem
        reason += f" ({exc.filename})"
    return reason


def check_writable_dir(path: Path, option: str = "--out") -> None:
    """Create the output folder `path` and prove it writable, so a command fails before its work, not after.

    OperatorError naming `option` when it is a file or cannot be created or written."""
    if path.exists() and not path.is_dir():
        raise OperatorError(
            f"{option} {path} is an existing file, not a folder: pass a folder (created if missing)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OperatorError(
            f"cannot write to {option} {path}: {_os_reason(exc, path)}; pass a folder you can write to"
        ) from exc


def check_writable_file(path: Path, option: str = "--out") -> None:
    """Create the folder of the output file `path` and prove the file can be written, without touching it.

    OperatorError naming `option` when it is a folder or cannot be written."""
    if path.is_dir():
        raise OperatorError(f"{option} {path} is a folder: pass a file name, e.g. {path / 'report.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open("a"):  # appends nothing: the file keeps its content until the command writes it
                pass
        else:
            with tempfile.TemporaryFile(dir=path.parent):
                pass
    except OSError as exc:
        raise OperatorError(
            f"cannot write {option} {path}: {_os_reason(exc, path)}; pass a path you can write to"
        ) from exc


def partial_path(path: Path) -> Path:
    """Where `path` is written before it replaces the file (same folder: os.replace is then atomic)."""
    return path.with_name(f".{path.name}.partial")


def write_partial(path: Path, text: str) -> None:
    """Write `text` to `partial_path(path)`, flushed to disk (OSError as writing raised it, the partial
    file removed)."""
    tmp = partial_path(path)
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part: a full
    disk midway leaves the previous report as it was. OSError as writing raised it."""
    write_partial(path, text)
    try:
        os.replace(partial_path(path), path)
    except OSError:
        partial_path(path).unlink(missing_ok=True)
        raise


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def _serve_options(args: argparse.Namespace) -> None:
    """Refuse `serve` options the chosen transport would silently ignore; fill in the HTTP defaults."""
    if not args.http and (args.host is not None or args.port is not None or args.allowed_host):
        raise OperatorError(
            "--host, --port and --allowed-host apply to an HTTP server: add --http (without it `serve` speaks MCP "
            "over stdin/stdout, as an IDE launches it)"
        )
    if args.http and args.ledger is not None:
        raise OperatorError(
            "--ledger applies to a stdio server; an HTTP server charges each request to the ledger of its "
            f"bearer token: issue one with `forecaster-mcp token issue --ledger {shlex.quote(args.ledger)}`"
        )
    if args.http and os.environ.get("FORECASTER_MCP_LEDGER"):
        # Not refused (it may be set for the stdio servers an IDE starts), but said: it is ignored here.
        print(
            "forecaster-mcp: warning: FORECASTER_MCP_LEDGER is ignored by an HTTP server: each request is "
            "charged to the ledger of its bearer token",
            file=sys.stderr,
        )
    args.host = DEFAULT_HOST if args.host is None else args.host
    args.port = DEFAULT_PORT if args.port is None else args.port


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forecaster-mcp",
        description="MCP server: forecast which CUDA kernel is faster; measure only when unsure.",
    )
    p.add_argument("--version", action="version", version=f"forecaster-mcp {__version__}")
    p.add_argument("--home", type=Path, help="state directory (env FORECASTER_MCP_HOME)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the MCP server (stdio by default)")
    serve.add_argument("--http", action="store_true", help="serve streamable HTTP at /mcp instead of stdio")
    # No argparse defaults: given without --http they would be ignored, so main refuses them (see _serve_options).
    serve.add_argument("--host", help=f"with --http: address to listen on (default {DEFAULT_HOST})")
    serve.add_argument("--port", type=int, help=f"with --http: port to listen on (default {DEFAULT_PORT})")
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="with --http: a Host header the server answers besides its own address, e.g. the name a TLS reverse "
        "proxy passes on (mcp.example.com, or with :PORT); repeatable. Requests for other names get 421 (on a "
        "loopback address this check is always on; elsewhere only with this option). Env "
        "FORECASTER_MCP_ALLOWED_HOSTS, comma-separated",
    )
    serve.add_argument(
        "--replay",
        type=Path,
        action="append",
        default=[],
        help="Kernel Tuner cache file, `forecaster-mcp export` file (.jsonl) or folder of them to replay; "
        "repeatable",
    )
    serve.add_argument("--ledger", help="ledger a stdio server charges (env FORECASTER_MCP_LEDGER)")
    serve.add_argument("--hardware", help="default GPU for forecasts, e.g. H100")
    serve.add_argument(
        "--measurer",
        choices=["auto", "replay", "pycuda", "none"],
        help="how measure_kernel measures (auto: replay with --replay, else pycuda where a GPU is; env "
        "FORECASTER_MCP_MEASURER)",
    )
    serve.add_argument(
        "--isolate-ledgers",
        action="store_true",
        default=None,
        help="each ledger sees only its own measurements (cache, measured answers, family models): for "
        "evaluations of several agents on one server (env FORECASTER_MCP_ISOLATE_LEDGERS=1)",
    )
    serve.set_defaults(handler="forecaster_mcp.server.app:serve_command")

    ledger = sub.add_parser("ledger", help="operator: create, top up and show GPU-second ledgers")
    lsub = ledger.add_subparsers(dest="action", required=True)
    create = lsub.add_parser("create", help="create a ledger with a limit")
    create.add_argument("name", help="the ledger's name (what --ledger and token issue --ledger name)")
    create.add_argument("--gpu-seconds", type=float, required=True, help="its limit, in GPU-seconds")
    topup = lsub.add_parser("topup", help="raise a ledger's limit")
    topup.add_argument("name", help="an existing ledger")
    topup.add_argument("--gpu-seconds", type=float, required=True, help="GPU-seconds added to its limit")
    show = lsub.add_parser("show", help="show one ledger or all")
    show.add_argument("name", nargs="?", help="one ledger in detail (default: a table of all)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    ledger.set_defaults(handler="forecaster_mcp.store.admin:ledger_command")

    token = sub.add_parser("token", help="operator: issue and revoke bearer tokens for HTTP")
    tsub = token.add_subparsers(dest="action", required=True)
    issue = tsub.add_parser("issue", help="issue a token for a ledger (printed once)")
    issue.add_argument("--ledger", required=True, help="the ledger the token's requests are charged to")
    issue.add_argument("--label", default=None, help="a note shown by token list (who or what holds it)")
    revoke = tsub.add_parser("revoke", help="revoke a token")
    revoke.add_argument("token", help="the token, or its id or fingerprint from `token list`")
    tsub.add_parser("list", help="list tokens (never their secret)")
    token.set_defaults(handler="forecaster_mcp.store.admin:token_command")

    ex = sub.add_parser(
        "export", help="operator: write the stored measurements to a file `serve --replay` replays exactly"
    )
    ex.add_argument("--out", type=Path, required=True, help="the export file (.jsonl)")
    ex.add_argument(
        "--device", help="only measurements on this device (as budget_status and results name it)"
    )
    ex.set_defaults(handler="forecaster_mcp.store.admin:export_command")

    ev = sub.add_parser("eval", help="forecaster metrics on a pairs file (JSON lines)")
    ev.add_argument("pairs", type=Path, help="pairs file (JSON lines), e.g. from make-pairs")
    ev.add_argument("--out", type=Path, default=Path("eval-out"), help="folder for metrics.json and plots")
    ev.add_argument("--forecaster", default="local", help="local, claude or local+claude")
    ev.add_argument(
        "--target-error",
        type=float,
        default=None,
        help="largest acceptable error rate among decided verdicts (default 0.1; env FORECASTER_MCP_TARGET_ERROR)",
    )
    ev.add_argument("--calibrate-on", type=Path, default=None, help="pairs file to fit calibration on first")
    ev.add_argument("--no-ptxas", action="store_true", help="skip nvcc/ptxas resource features")
    ev.add_argument(
        "--batch",
        action="store_true",
        help="Claude answers through the Message Batches API (half price; results in minutes to hours)",
    )
    ev.set_defaults(handler="forecaster_mcp.forecast.evaluate:eval_command")

    mp = sub.add_parser("make-pairs", help="write a pairs file sampled from Kernel Tuner recordings")
    mp.add_argument("recordings", type=Path, nargs="+", help="Kernel Tuner cache files (.json or .json.gz)")
    mp.add_argument("-n", type=int, default=1000, help="pairs per recording (1000)")
    mp.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same file (0)")
    mp.add_argument("--out", type=Path, required=True, help="the pairs file to write (.jsonl)")
    mp.add_argument(
        "--history",
        type=int,
        default=0,
        help="also write K measured configurations per recording as history (kept out of the pairs)",
    )
    mp.set_defaults(handler="forecaster_mcp.forecast.evaluate:make_pairs_command")

    se = sub.add_parser("search", help="budgeted search over a replay space through the MCP tools")
    se.add_argument("recording", type=Path, help="Kernel Tuner cache file (.json or .json.gz) to search")
    se.add_argument(
        "--measurements",
        type=int,
        default=100,
        help="measurements each run makes (100), the first 10 (half of a smaller budget) random; both strategies "
        "are also compared at equal GPU-seconds",
    )
    se.add_argument(
        "--gpu-seconds",
        type=float,
        default=None,
        help="give each run a ledger of this many GPU-seconds: a run ends when the ledger refuses a measurement "
        "(or at --measurements), so both strategies search on the same budget",
    )
    se.add_argument(
        "--seeds", type=int, default=5, help="runs per strategy, each from its own random start (5)"
    )
    se.add_argument(
        "--strategy",
        choices=["forecast", "random", "both"],
        default="both",
        help="forecast-guided, measure-everything random, or both at the same budget (both)",
    )
    se.add_argument(
        "--client",
        choices=["full", "plain", "unsure"],
        default="plain",
        help="forecast-guided client, each after 10 random measurements: plain (the default: one pool of 63 "
        "random untried configurations per step in one compare_kernels call against the best so far; the first "
        "two of measure_next and of the faster verdicts go to a final call, and its measure_next head is "
        "measured unless a faster one is worth more), full (local moves + several random pools per step: "
        "stranded more seeds on rugged spaces at 100 measurements) or unsure (the plain client letting "
        "compare_kernels measure with measure_if_unsure, max_measurements 1)",
    )
    se.add_argument(
        "--claude",
        action="store_true",
        help="forecast with Claude too (paid; needs ANTHROPIC_API_KEY): without it the runs use the local "
        "forecaster only, whatever the environment holds",
    )
    se.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    se.set_defaults(handler="forecaster_mcp.search:search_command")

    demo = sub.add_parser(
        "demo", help="start a server and drive it as an MCP client: the whole idea in one screen"
    )
    demo.add_argument(
        "--replay",
        type=Path,
        action="append",
        default=[],
        help="recording to measure against (default: those FORECASTER_MCP_REPLAY names)",
    )
    demo.set_defaults(handler="forecaster_mcp.demo:demo_command")
    _home_after_the_command(p)
    return p


def _home_after_the_command(parser: argparse.ArgumentParser) -> None:
    """`--home DIR` after any (sub)command too (`ledger show --home DIR`), not only before it: defaulting to
    SUPPRESS, a command's own `--home` is set only when given, so the one before the command stays otherwise."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                child.add_argument("--home", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                _home_after_the_command(child)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        # One BLAS thread per process: the family model's small factorisations run beside request handling,
        # and multi-threaded BLAS under contention made them ~80x slower.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    try:
        if args.command == "serve":
            _serve_options(args)
        settings = Settings.from_env(
            home=args.home,
            replay=getattr(args, "replay", None),
            allowed_hosts=getattr(args, "allowed_host", None),
            ledger=getattr(args, "ledger", None) if args.command == "serve" else None,
            hardware=getattr(args, "hardware", None),
            measurer=getattr(args, "measurer", None),
            isolate_ledgers=getattr(args, "isolate_ledgers", None),
        )
        for line in unknown_variables():
            print(f"forecaster-mcp: warning: {line}", file=sys.stderr)
        module_name, func_name = args.handler.split(":")
        handler = getattr(importlib.import_module(module_name), func_name)
        code: int = handler(settings, args)
        return code
    except (OperatorError, AgentError) as exc:
        print(f"forecaster-mcp: {exc}", file=sys.stderr)
        return 2
    except sqlite3.OperationalError as exc:
        print(
            f"forecaster-mcp: the state database is busy or cannot be written ({exc}): another process holds it "
            "(a server, a VACUUM) or its folder is read-only or full; try again when it is free",
            file=sys.stderr,
        )
        return 2
    except sqlite3.DatabaseError as exc:
        # Damage past the pages read at open (a disk or copy that lost blocks): each command crashed with a
        # traceback. Not retried: it stays damaged until someone recovers it. Any other DatabaseError (a
        # constraint or a statement refused: a bug) is no damage, and "run .recover" would send the operator
        # the wrong way: it stays a traceback.
        from forecaster_mcp.store.db import damaged

        if not damaged(exc):
            raise
        print(
            f"forecaster-mcp: the state database is damaged ({exc}): stop the servers using it, copy the state "
            "folder aside, and recover its ledgers and measurements (sqlite3 forecaster.sqlite3 .recover), or "
            "point --home (env FORECASTER_MCP_HOME) at another folder",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`ledger show | head`): stop quietly, as Unix tools do. Python would still flush
        # stdout at exit into the closed pipe and print a second error, so stdout points at the null device.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe


if __name__ == "__main__":
    sys.exit(main())
