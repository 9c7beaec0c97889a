"""Argument validation errors an agent can read: one line per kind of mistake, not one per list item.

The SDK reports pydantic's full text for arguments that fail validation: every error of every list item, each
with the input echoed and a documentation URL. One mistake repeated over 64 candidates (an extra field, a
null define, which fails each branch of a union) came back as 12-40 KB, thousands of an agent's tokens.
`compact_validation_error` keeps what the agent needs: where (the list items it happened in), what was
expected, and a short sample of what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from forecaster_mcp.errors import validation_message

MAX_LINES = 8
MAX_LINE_CHARS = (
    1500  # a validator's own message (the accepted compile options) is long and all of it matters
)
MAX_CHARS = 4000
_SHOWN_ITEMS = 5
# The names pydantic gives the branches of a union in an error's location (int | float | str, a model).
_SCALAR_BRANCHES = frozenset({"int", "float", "str", "bool", "bytes", "none"})

Loc = tuple[int | str, ...]


def _is_branch(part: int | str) -> bool:
    """Whether a location part names a union branch (a type) rather than a field."""
    return isinstance(part, str) and (part in _SCALAR_BRANCHES or "[" in part or part[:1].isupper())


def _path(loc: Loc, any_item: bool = False) -> str:
    """`candidates[3].source`; with `any_item`, `candidates[*].source` (the place in every list item)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += "[*]" if any_item else f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "arguments"


# A sample shows this many characters of the repr of what was sent.
_SAMPLE_CHARS = 40


class _Full(Exception):
    """The sample has its characters (`_sample`)."""


def _sample(value: Any) -> str:
    """The repr of `value`, cut to _SAMPLE_CHARS characters, written only as far as that: the repr of a whole
    dict of a million entries (the input of a refused count), or a copy holding a few items of each container
    of a nested one (16 items at every level of a tree 16 wide are all of it), took seconds of the server's
    event loop, only to be cut to 40 characters."""
    parts: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        parts.append(text)
        size += len(text)
        if size > _SAMPLE_CHARS:
            raise _Full

    def write(v: Any) -> None:
        if isinstance(v, dict):
            put("{")
            for i, (key, item) in enumerate(v.items()):
                put(", " if i else "")
                write(key)
                put(": ")
                write(item)
            put("}")
        elif isinstance(v, list | tuple):
            put("[" if isinstance(v, list) else "(")
            for i, item in enumerate(v):
                put(", " if i else "")
                write(item)
            put("]" if isinstance(v, list) else ",)" if len(v) == 1 else ")")
        elif isinstance(v, str):
            put(repr(v[: _SAMPLE_CHARS + 1]))  # (any longer is cut anyway)
        else:
            put(repr(v))

    try:
        write(value)
    except _Full:
        pass
    text = "".join(parts)
    return text if len(text) <= _SAMPLE_CHARS else text[: _SAMPLE_CHARS - 3] + "..."


def _merged(errors: Sequence[ErrorDetails]) -> list[tuple[Loc, str, Any]]:
    """(loc, message, input) per error, the branches of a union that all failed at one spot as one."""
    branches: dict[Loc, list[ErrorDetails]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        if loc and _is_branch(loc[-1]):
            branches.setdefault(loc[:-1], []).append(e)
    union = {spot for spot, es in branches.items() if len(es) >= 2}
    out: list[tuple[Loc, str, Any]] = []
    seen: set[Loc] = set()
    for e in errors:
        loc = tuple(e["loc"])
        if loc[:-1] in union and _is_branch(loc[-1]):
            spot = loc[:-1]
            if spot not in seen:
                seen.add(spot)
                kinds = " or ".join(str(b["loc"][-1]) for b in branches[spot])
                out.append((spot, f"should be {kinds}", e.get("input")))
            continue
        # A validator's own message without pydantic's "Value error, " before it (noise on every such line).
        out.append((loc, validation_message(e), e.get("input")))
    return out


MAX_ERRORS_READ = 1000


def field_names(model: type[BaseModel]) -> frozenset[str]:
    """Every field name of `model` and of the models nested in it, for "did you mean" on a misspelt field."""
    names: set[str] = set()
    todo: list[Any] = [model]
    seen: set[int] = set()
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, type) and issubclass(t, BaseModel):
            for name, field in t.model_fields.items():
                names.add(field.alias or name)
                todo.append(field.annotation)
        for arg in getattr(t, "__args__", ()) or ():
            todo.append(arg)
        todo.extend(getattr(t, "__metadata__", ()) or ())
        origin = getattr(t, "__origin__", None)
        if origin is not None:
            todo.append(origin)
    return frozenset(names)


def _did_you_mean(loc: Loc, msg: str, known: frozenset[str]) -> str:
    """`msg` for a field the tool does not take, with the known field names closest to it."""
    import difflib  # only error paths need it

    if not known or not loc or not isinstance(loc[-1], str) or msg != "Extra inputs are not permitted":
        return msg
    # A name some other model takes (a buffer's `name` sent in a Kernel) is no misspelling of itself.
    close = difflib.get_close_matches(loc[-1], sorted(known - {loc[-1]}), n=2, cutoff=0.6)
    return f"{msg} (did you mean {' or '.join(repr(c) for c in close)}?)" if close else msg


def summary(
    exc: ValidationError, known_fields: frozenset[str] = frozenset(), first: Sequence[str] = ()
) -> str:
    """The errors of `exc`, one line per (place, message), naming the list items that share it; a field not
    taken gets the closest of `known_fields` as a suggestion. `first`: problems found apart from `exc` (argument
    names the tool does not take), said before its errors. One problem comes on one line."""
    groups: dict[tuple[str, str], list[tuple[Loc, Any]]] = {}
    if exc.error_count() > MAX_ERRORS_READ:
        # Each error costs a dict of its own (with its input): a list of a million bad items took gigabytes to
        # describe. The first are enough to say what is wrong.
        errors = exc.errors(include_url=False, include_input=False)[:MAX_ERRORS_READ]
    else:
        errors = exc.errors(include_url=False)
    merged = _merged(errors)
    for loc, msg, value in merged:
        msg = _did_you_mean(loc, msg, known_fields)
        groups.setdefault((_path(loc, any_item=True), msg), []).append((loc, value))
    lines = [f"- {problem}" for problem in first]
    for (pattern, msg), found in list(groups.items())[:MAX_LINES]:
        where = _path(found[0][0]) if len(found) == 1 else pattern
        value = found[0][1]
        got = f"; got {_sample(value)}" if value is not None or "should be" in msg else ""
        items = ""
        if len(found) > 1:
            firsts = ", ".join(
                "[" + "][".join(str(p) for p in loc if isinstance(p, int)) + "]"
                for loc, _ in found[:_SHOWN_ITEMS]
            )
            items = f" ({len(found)} items: {firsts}{', ...' if len(found) > _SHOWN_ITEMS else ''})"
        line = f"- {where}: {msg}{got}{items}"
        lines.append(line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "...")
    if len(groups) > MAX_LINES:
        lines.append(f"- ... and {len(groups) - MAX_LINES} more kinds of problem")
    text = "\n".join(lines)
    if len(text) > MAX_CHARS:
        text = text[: MAX_CHARS - 3] + "..."
    head = "the arguments do not fit the tool; nothing was run or charged: correct and resend"
    if len(lines) == 1:
        return (
            f"the arguments do not fit the tool, nothing was run or charged: {text[2:]}; correct and resend"
        )
    return f"{head}\n{text}"


class ArgumentsError(ValidationError):
    """A ValidationError whose text is the summary alone: the SDK reports `str()` of it to the agent, and
    pydantic's own text wraps a message in "1 validation error for compare_kernelsArguments" and
    "[type=..., input_value=..., input_type=...]", noise around the one line the agent should read."""

    def __str__(self) -> str:
        return str(self.errors(include_url=False)[0]["msg"])


def compact_validation_error(
    exc: ValidationError, known_fields: frozenset[str] = frozenset(), first: Sequence[str] = ()
) -> ValidationError:
    """A ValidationError whose text is `summary(exc, known_fields, first)` (the SDK reports a ValidationError's
    text to the agent)."""
    return ArgumentsError.from_exception_data(
        exc.title,
        [
            {
                "type": PydanticCustomError(
                    "invalid_arguments", "{summary}", {"summary": summary(exc, known_fields, first)}
                ),
                "loc": (),
                "input": "(above)",
            }
        ],
    )
