"""Argument validation errors an agent can read: one line per kind of mistake, not one per list item.

The SDK reports pydantic's full text for arguments that fail validation: every error of every list item, each
with the input echoed and a documentation URL. One mistake repeated over 64 candidates (an extra field, a
null define, which fails each branch of a union) came back as 12-40 KB, thousands of an agent's tokens.
`compact_validation_error` keeps what the agent needs: where (list indices as `*`, with how many items), what
was expected, and a short sample of what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

MAX_LINES = 8
MAX_LINE_CHARS = 600
MAX_CHARS = 2000


def _where(loc: Sequence[int | str]) -> str:
    return ".".join("*" if isinstance(p, int) else str(p) for p in loc) or "arguments"


def _sample(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _merged(errors: Sequence[ErrorDetails]) -> list[tuple[tuple[int | str, ...], str, Any]]:
    """(loc, message, input) per error, the branches of a union that all failed at one spot as one."""
    branches: dict[tuple[int | str, ...], list[ErrorDetails]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        if loc and isinstance(loc[-1], str) and str(e["type"]).endswith("_type"):
            branches.setdefault(loc[:-1], []).append(e)
    union = {p for p, es in branches.items() if len(es) >= 2}
    out: list[tuple[tuple[int | str, ...], str, Any]] = []
    seen: set[tuple[int | str, ...]] = set()
    for e in errors:
        loc = tuple(e["loc"])
        if loc[:-1] in union and str(e["type"]).endswith("_type"):
            spot = loc[:-1]
            if spot not in seen:
                seen.add(spot)
                kinds = " or ".join(str(b["loc"][-1]) for b in branches[spot])
                out.append((spot, f"should be {kinds}", e.get("input")))
            continue
        out.append((loc, str(e["msg"]), e.get("input")))
    return out


def summary(exc: ValidationError) -> str:
    """The errors of `exc`, one line per (place, message), with how many list items share it."""
    groups: dict[tuple[str, str], list[Any]] = {}
    merged = _merged(exc.errors(include_url=False))
    for loc, msg, value in merged:
        groups.setdefault((_where(loc), msg), []).append(value)
    lines = []
    for (where, msg), values in list(groups.items())[:MAX_LINES]:
        many = f" ({len(values)} items)" if len(values) > 1 else ""
        got = f"; got {_sample(values[0])}" if values[0] is not None or "should be" in msg else ""
        line = f"- {where}: {msg}{got}{many}"
        lines.append(line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "...")
    if len(groups) > MAX_LINES:
        lines.append(f"- ... and {len(groups) - MAX_LINES} more kinds of problem")
    text = "\n".join(lines)
    if len(text) > MAX_CHARS:
        text = text[: MAX_CHARS - 3] + "..."
    count = len(merged)
    star = " ('*' is any list item)" if any("*" in where for where, _ in groups) else ""
    return (
        f"{count} problem{'s' if count != 1 else ''} in the arguments{star}; nothing was run or charged: fix "
        f"{'them' if count != 1 else 'it'} and resend\n{text}"
    )


def compact_validation_error(exc: ValidationError) -> ValidationError:
    """A ValidationError whose text is `summary(exc)` (the SDK reports a ValidationError's text to the agent)."""
    return ValidationError.from_exception_data(
        exc.title,
        [
            {
                "type": PydanticCustomError("invalid_arguments", "{summary}", {"summary": summary(exc)}),
                "loc": (),
                "input": "(see above)",
            }
        ],
    )
