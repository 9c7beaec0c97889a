"""Operator commands: `forecaster-mcp ledger ...` and `forecaster-mcp token ...`.

These are the only ways to create or raise a budget and to issue tokens; no MCP tool can.
Operator mistakes raise OperatorError (cli.main prints it and exits 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from forecaster_mcp.errors import OperatorError, validation_message
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import LedgerView, Store, fmt_gpu_seconds

T = TypeVar("T")


def _no_database(settings: Settings) -> str | None:
    """What to say when the state folder holds no database yet, else None. Only `ledger create` makes one:
    any other command pointed at a mistyped --home made an empty database there, and then said 'no ledgers
    yet' or 'ledger ... does not exist' as if the operator's ledgers were gone."""
    folder = settings.db_path.parent
    if settings.db_path.exists() or (folder.exists() and not folder.is_dir()):
        return None  # a database, or a state folder that is a file (Store.open says so)
    return (
        f"no state database at {settings.db_path} (nothing was created there): check --home "
        "(env FORECASTER_MCP_HOME), or make the first ledger there with: "
        "forecaster-mcp ledger create NAME --gpu-seconds N"
    )


def _with_store(settings: Settings, action: Callable[[Store], Awaitable[T]], *, create: bool = False) -> T:
    """Run `action` on the state database; OperatorError when there is none and `create` is false."""
    if not create and (missing := _no_database(settings)) is not None:
        raise OperatorError(missing)

    async def run() -> T:
        store = await Store.open(settings.db_path)
        try:
            return await action(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ledger_line(view: LedgerView) -> str:
    return (
        f"ledger '{view.name}': limit {fmt_gpu_seconds(view.limit_gpu_seconds)}, "
        f"spent {fmt_gpu_seconds(view.spent_gpu_seconds)}, "
        f"reserved {fmt_gpu_seconds(view.reserved_gpu_seconds)}, "
        f"remaining {fmt_gpu_seconds(view.remaining_gpu_seconds)} GPU-seconds"
    )


def _report_text(name: str, r: dict[str, Any]) -> str:
    m, f, saved = r["measurements"], r["forecasts"], r["gpu_seconds_saved"]
    llm, cal = r["llm"], r["calibration"]
    accuracy = "-" if f["accuracy"] is None else f"{100 * f['accuracy']:.1f}%"
    brier = "-" if cal["brier"] is None else f"{cal['brier']:.3f}"
    rows = [
        ("limit", f"{fmt_gpu_seconds(r['limit_gpu_seconds'])} GPU-seconds"),
        ("spent", f"{fmt_gpu_seconds(r['spent_gpu_seconds'])} GPU-seconds"),
        ("reserved", f"{fmt_gpu_seconds(r['reserved_gpu_seconds'])} GPU-seconds"),
        ("remaining", f"{fmt_gpu_seconds(r['remaining_gpu_seconds'])} GPU-seconds"),
        (
            "measurements",
            f"{m['count']} ({m['cache_hits']} cache hits, {m['failures']} failures), "
            f"{fmt_gpu_seconds(m['gpu_seconds'])} GPU-seconds charged"
            # The rest of `spent`: without it the two lines did not add up (spent 3.25, measurements 0 charged).
            + (
                f"; {fmt_gpu_seconds(m['cancelled_gpu_seconds'])} more for device time that left no stored "
                "result (a measurement cancelled on the device)"
                if m.get("cancelled_gpu_seconds")
                else ""
            )
            + (
                f"; {fmt_gpu_seconds(m['not_saved_gpu_seconds'])} more for measurements whose result could not "
                "be saved"
                if m.get("not_saved_gpu_seconds")
                else ""
            ),
        ),
        (
            "forecasts",
            f"{f['count']} ({f['decided']} decided, {f['deferred']} deferred); "
            f"{f['verified']} verified, {f['verified_correct']} correct, accuracy {accuracy}",
        ),
        (
            "saved",
            f"cache {fmt_gpu_seconds(saved['cache'])}, "
            f"forecasts {fmt_gpu_seconds(saved['forecasts'])} GPU-seconds (estimated)",
        ),
        (
            "llm",
            f"{llm['calls']} calls, {llm['input_tokens']} input / {llm['output_tokens']} output tokens, "
            f"${llm['cost_usd']:.4f}"
            + (
                f" (and {llm['unpriced_tokens']} tokens of a model with no known price)"
                if llm["unpriced_tokens"]
                else ""
            ),
        ),
        ("calibration", f"{cal['verified_pairs']} verified pairs, Brier {brier}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"ledger '{name}'", *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def ledger_command(settings: Settings, args: argparse.Namespace) -> int:
    """`ledger create|topup|show`: prints a human summary, or JSON for `show --json`."""
    action = args.action
    if action == "create":
        view = _with_store(settings, lambda s: s.create_ledger(args.name, args.gpu_seconds), create=True)
        print(f"created {_ledger_line(view)}")
        return 0
    if action == "topup":
        view = _with_store(settings, lambda s: s.topup_ledger(args.name, args.gpu_seconds))
        print(f"topped up {_ledger_line(view)}")
        return 0
    if action == "show":
        return _show(settings, getattr(args, "name", None), bool(getattr(args, "json", False)))
    raise OperatorError(f"unknown ledger action {action!r}: use create, topup or show")


def _show(settings: Settings, name: str | None, as_json: bool) -> int:
    if name is not None:
        report = _with_store(settings, lambda s: s.ledger_report(name))
        print(json.dumps({"name": name, **report}, indent=2) if as_json else _report_text(name, report))
        return 0
    if (missing := _no_database(settings)) is not None:
        if as_json:
            print(f"forecaster-mcp: {missing}", file=sys.stderr)
        print(json.dumps([]) if as_json else missing)
        return 0
    views = _with_store(settings, lambda s: s.list_ledgers())
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": v.name,
                        "limit_gpu_seconds": v.limit_gpu_seconds,
                        "spent_gpu_seconds": v.spent_gpu_seconds,
                        "reserved_gpu_seconds": v.reserved_gpu_seconds,
                        "remaining_gpu_seconds": v.remaining_gpu_seconds,
                    }
                    for v in views
                ],
                indent=2,
            )
        )
        return 0
    if not views:
        print("no ledgers yet; create one with: forecaster-mcp ledger create NAME --gpu-seconds N")
        return 0
    rows = [
        [
            v.name,
            fmt_gpu_seconds(v.limit_gpu_seconds),
            fmt_gpu_seconds(v.spent_gpu_seconds),
            fmt_gpu_seconds(v.reserved_gpu_seconds),
            fmt_gpu_seconds(v.remaining_gpu_seconds),
        ]
        for v in views
    ]
    print(_table(["ledger", "limit", "spent", "reserved", "remaining"], rows))
    print("(GPU-seconds)")
    return 0


def token_command(settings: Settings, args: argparse.Namespace) -> int:
    """`token issue|revoke|list`. `issue` prints the token alone on a stdout line, once; notes: stderr."""
    action = args.action
    if action == "issue":
        token = _with_store(settings, lambda s: s.issue_token(args.ledger, args.label))
        print(token)
        print(
            f"issued a token for ledger '{args.ledger}'; it is shown only this once and stored hashed. "
            "Clients send it as: Authorization: Bearer <token>",
            file=sys.stderr,
        )
        return 0
    if action == "revoke":
        if not _with_store(settings, lambda s: s.revoke_token(args.token)):
            raise OperatorError(
                "no active token matches; pass the token itself, or its id or fingerprint "
                "from `forecaster-mcp token list`"
            )
        print("revoked")
        return 0
    if action == "list":
        if (missing := _no_database(settings)) is not None:
            print(f"{missing}, then issue a token with: forecaster-mcp token issue --ledger NAME")
            return 0
        tokens = _with_store(settings, lambda s: s.list_tokens())
        if not tokens:
            print("no tokens yet; issue one with: forecaster-mcp token issue --ledger NAME")
            return 0
        rows = [
            [
                str(t["id"]),
                t["fingerprint"],
                t["ledger"],
                t["label"] or "-",
                _when(t["created_at"]),
                "active" if t["revoked_at"] is None else f"revoked {_when(t['revoked_at'])}",
            ]
            for t in tokens
        ]
        print(_table(["id", "fingerprint", "ledger", "label", "created", "status"], rows))
        return 0
    raise OperatorError(f"unknown token action {action!r}: use issue, revoke or list")


def export_command(settings: Settings, args: argparse.Namespace) -> int:
    """`export --out FILE [--device NAME]`: the stored measurements, one JSON line each, for `serve --replay`."""
    import os
    from pathlib import Path

    from pydantic import ValidationError

    from forecaster_mcp.cli import check_writable_file
    from forecaster_mcp.hardware.specs import canonical_name
    from forecaster_mcp.measure.replay import export_line
    from forecaster_mcp.models import HISTORY_SCOPE_MARK, Kernel, MeasureResult, history_gpu

    out = Path(args.out)
    if out.suffix != ".jsonl":
        # `serve --replay` and `search` tell an export from a Kernel Tuner recording by this suffix: another
        # name was written, and the replay command printed below then failed on it.
        raise OperatorError(
            f"--out {out} must end in .jsonl (how `serve --replay` knows an export): use {out.stem}.jsonl"
        )
    check_writable_file(out)
    if (missing := _no_database(settings)) is not None:
        raise OperatorError(f"nothing to export: {missing}")
    # A replayed device's history is filed apart from the GPU's own ("A100 (replay 1a2b...)"): exported as the GPU.
    rows = [
        (history_gpu(hw), wk, kj, rj) for hw, wk, kj, rj in _with_store(settings, lambda s: s.export_rows())
    ]
    stored = sorted({r[0] for r in rows})
    if args.device is not None:
        wanted = {args.device, canonical_name(args.device)}
        rows = [r for r in rows if r[0] in wanted]
    if not rows:
        where = f" on device {args.device!r}" if args.device is not None else ""
        # A short name resolves to one model (A100 is the A100-SXM4-80GB): name what the store does hold.
        others = f"; it holds measurements on {', '.join(stored)}" if stored else ""
        raise OperatorError(f"nothing to export: no measurements stored{where} in {settings.db_path}{others}")
    by_key: dict[tuple[str, str, str], str] = {}  # one line per kernel, workload and device: the latest
    skipped: list[str] = []
    for hw, wk, kj, rj in rows:
        try:
            # A ledger's own history (isolate_ledgers) is filed under "<key>@<ledger>": replay matches the key,
            # and a kernel several ledgers measured is exported once (rows come oldest first).
            key = wk.split(HISTORY_SCOPE_MARK, 1)[0]
            kernel = Kernel.model_validate_json(kj)
            by_key[(hw, key, kernel.content_key())] = export_line(
                hw, key, kernel, MeasureResult.model_validate_json(rj)
            )
        except ValidationError as exc:  # stored by an older version whose rules were looser
            skipped.append(validation_message(exc.errors()[0])[:200])
    lines = list(by_key.values())
    if skipped:
        print(
            f"forecaster-mcp: skipped {len(skipped)} stored measurement(s) this version no longer accepts "
            f"(first: {skipped[0]})",
            file=sys.stderr,
        )
    if not lines:
        raise OperatorError("nothing to export: every stored measurement was skipped (see above)")
    partial = out.with_name(out.name + ".partial")
    try:
        partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(partial, out)
    except OSError as exc:
        raise OperatorError(f"cannot write --out {out}: {exc.strerror or exc}") from exc
    devices = sorted({r[0] for r in rows})
    print(
        f"exported {len(lines)} measurements on {', '.join(devices)} to {out}; "
        f"replay them with `forecaster-mcp serve --replay {out}`"
    )
    return 0
